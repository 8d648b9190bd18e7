"""What the studies write beside their results: ``<stem>.json`` and ``<stem>.md``, and plots when
matplotlib is installed (a study without it still writes its numbers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..output import write_json_atomic, write_text_atomic


def write_json_and_markdown(out: Path, stem: str, data: Any, markdown: str) -> None:
    """``out/<stem>.json`` (``data``, indent 1) and ``out/<stem>.md`` (``markdown``), ``out`` created."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{stem}.json", data, indent=1)
    write_text_atomic(out / f"{stem}.md", markdown)


def plot_if_installed(draw: Callable[[Any, Path], Any], data: Any, out: Path) -> None:
    """``draw(data, out)``, skipped when matplotlib (the ``plot`` extra) is not installed."""
    try:
        draw(data, out)
    except ImportError:
        pass
