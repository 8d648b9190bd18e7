"""What commands leave behind and show while they run: atomic files, progress bars, plots.

One place for the three things every long-running part of kernelmix needs, so that each writes
files the same way (a kill never leaves half a file: write a temporary sibling, then rename it over
the target), shows progress the same way (rich, on stderr), and draws plots the same way
(matplotlib without a display).
"""

from __future__ import annotations

import hashlib
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


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ProgressBar:
    """A rich progress bar on stderr: ``advance(n)``, ``update(completed=..., **fields)``,
    ``print(text)`` (above the bar), ``close()``. ``unit="bytes"`` shows sizes and a transfer rate;
    ``fields`` maps a name to how its value is shown after the count, ``{}`` standing for the value
    (``{"loss": "loss {}", "tps": "{} tok/s"}``); values start as ``-`` and change with :meth:`update`."""

    def __init__(self, label: str, total: int, *, completed: int = 0, unit: str = "items",
                 fields: dict[str, str] | None = None, transient: bool = True):
        from rich.console import Console
        from rich.progress import (
            BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
            TransferSpeedColumn,
        )

        fields = dict(fields or {})
        shown = [TextColumn(shape.replace("{}", f"{{task.fields[{name}]}}")) for name, shape in fields.items()]
        counts = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
        self.console = Console(stderr=True)
        self._progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), *counts, *shown, TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=self.console, transient=transient,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=total, completed=completed, **{name: "-" for name in fields})

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def update(self, completed: int | None = None, **fields: str) -> None:
        self._progress.update(self._task, completed=completed, **fields)

    def print(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        self._progress.stop()


class _NoBar:
    """What :func:`progress_bar` returns when the bar is off: every call does nothing."""

    def advance(self, n: int = 1) -> None:
        pass

    def update(self, completed: int | None = None, **fields: str) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, label: str, total: int, **options):
    """A :class:`ProgressBar` (options as there), or an object whose methods do nothing."""
    return ProgressBar(label, total, **options) if enabled else _NoBar()


def pyplot():
    """matplotlib's pyplot drawing off-screen (no display needed); ImportError names the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or kernelmix[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


__all__ = ["ProgressBar", "progress_bar", "pyplot", "write_json_atomic", "write_text_atomic"]
