"""What commands leave behind and show while they run: atomic files, progress bars, plots.

One place for the three things every long-running part of kernelmix needs, so that each writes
files the same way (a kill never leaves half a file: write a temporary sibling, then rename it over
the target), shows progress the same way (rich, on stderr), and draws plots the same way
(matplotlib without a display).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int | None = 2, sort_keys: bool = False) -> Path:
    """:func:`write_text_atomic` of ``data`` as JSON (with a final newline)."""
    return write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


class _NoBar:
    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, label: str, total: int, transient: bool):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=Console(stderr=True), transient=transient,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()


def progress_bar(enabled: bool, label: str, total: int, *, transient: bool = True):
    """A bar with ``advance(n)`` and ``close()`` on stderr, or an object that does nothing."""
    return _RichBar(label, total, transient) if enabled else _NoBar()


def pyplot():
    """matplotlib's pyplot drawing off-screen (no display needed); ImportError names the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or kernelmix[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


__all__ = ["progress_bar", "pyplot", "write_json_atomic", "write_text_atomic"]
