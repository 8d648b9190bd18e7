"""What a training run shows and records on its main process: ``metrics.jsonl`` (one JSON line per
log step and per evaluation), TensorBoard scalars when the package is installed, and a rich
progress bar on a terminal (plain lines in a log file). A full disk or a directory that cannot be
written is a :class:`~kernelmix.training.checkpoint.CheckpointError` naming metrics.jsonl and the fix."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from ..output import ProgressBar, write_text_atomic
from .checkpoint import writing


class Reporter:
    """Rank 0's outputs: metrics.jsonl, TensorBoard (when installed), and a rich progress bar or
    plain lines."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int, progress: bool | None, active: bool):
        self.active = active
        self.metrics_path = out_dir / "metrics.jsonl"
        self.bar = self.tb = self.file = None
        if not active:
            return
        with writing(self.metrics_path, "open"):
            self.file = open(self.metrics_path, "a", encoding="utf-8")
        try:  # optional: torch's SummaryWriter needs the tensorboard package
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except Exception:
            self.tb = None
        self.quiet = progress is False
        if progress is None:  # a bar on a terminal, plain lines in a log file
            progress = sys.stderr.isatty()
        if progress:
            self.bar = ProgressBar("train", total_steps, completed=start_step, transient=False,
                                   fields={"loss": "loss {}", "tps": "{} tok/s", "val": "val {}"})

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with writing(self.metrics_path):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("kind", "step", "tokens", "wall_s") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(completed=step)

    def show(self, text: str, **fields: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(**fields)
        elif not self.quiet:
            print(text, flush=True)

    def note(self, text: str) -> None:
        """A message that is not a metric (printed above the bar)."""
        if not self.active or self.quiet:
            return
        (self.bar.print if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            # every line was flushed when written; what a close can still fail on is a line whose
            # write already failed and was reported (raising again would hide that message)
            with contextlib.suppress(OSError):
                self.file.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past ``step`` (written after the checkpoint we resume from), atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short by a kill
            continue
    write_text_atomic(path, "".join(line + "\n" for line in kept))


__all__ = ["Reporter", "truncate_metrics"]
