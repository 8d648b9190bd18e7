"""The run of ``kernelmix gpu-check``: parts (a), (b) and (c) in turn into one report, written
after every part; part (c), a short :mod:`kernelmix.studies.compare`."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import Interrupted
from .bench import run_bench
from .checks import run_op_checks
from .measure import environment, short_error
from .report import write_report
from .settings import FORMAT, PART_TITLES, PARTS, PYDANTIC_FIX, GpuCheckConfig, Sizes, sizes_for

def run_compare_part(part: dict, sizes: Sizes, device: torch.device, out_dir: Path, overrides: dict,
                     say: Callable[[str], None]) -> None:
    """Part (c) into ``part``: a short compare of compare's default mixers into ``out_dir/compare``."""
    try:
        from ..compare import CompareConfig, run_compare
    except ImportError as error:  # pydantic (kernelmix.config) missing on the GPU machine
        fix = PYDANTIC_FIX if "pydantic" in str(error) else f"fix: pip install {error.name or 'the missing package'}"
        part["status"] = f"not run: {short_error(error)}; {fix}"
        say(f"(c) {part['status']}")
        return
    settings = {**sizes.compare, **overrides, "device": device.type, "out_dir": str(out_dir / "compare")}
    part["settings"] = settings
    say(f"(c) compare: preset {settings['preset']}, T={settings['lengths']}, the default mixers "
        f"→ {settings['out_dir']}")
    results = run_compare(CompareConfig(**settings), progress=False)
    part["summary"] = [
        {"mixer": row["mixer"], "length": row["length"], "val_loss": row["val_loss"], "steps": row.get("steps"),
         "tokens_per_s": row["tokens_per_s"], "train_s": row.get("train_s")}
        for row in results["summary"]
    ]
    part["wall_s"] = results["wall_s"]


# ---------------------------------------------------------------------------------------------
# The run


def new_report(config: GpuCheckConfig, sizes: Sizes, device: torch.device) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "settings": {"device": config.device, "quick": config.quick, "skip": list(config.skip),
                     "sizes": asdict(sizes)},
        "environment": environment(device),
        "parts": {name: {"title": PART_TITLES[name], "status": "pending"} for name in PARTS},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def run_gpu_check(config: GpuCheckConfig, out_dir: str | os.PathLike, *,
                  say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Run the parts of ``config`` into ``out_dir``; returns the report (``gpu_check.json``'s content).
    The JSON and markdown are rewritten after every part; a part that fails is recorded with its
    traceback and the next part runs; Ctrl-C records the part as interrupted, writes, and re-raises."""
    device = torch.device(config.device)
    sizes = sizes_for(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = new_report(config, sizes, device)
    write_report(report, out)

    def save() -> None:
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_report(report, out)
    for name in PARTS:
        part = report["parts"][name]
        if name in config.skip:
            part["status"] = "skipped (--skip)"
            write_report(report, out)
            continue
        part["status"] = "running"
        started = time.perf_counter()
        try:
            if name == "a":
                run_op_checks(part, sizes, device, say, save)
            elif name == "b":
                run_bench(part, sizes, device, say, save)
            else:
                run_compare_part(part, sizes, device, out, config.compare, say)
            if part["status"] == "running":
                part["status"] = "done"
        except (KeyboardInterrupt, Interrupted):
            part["status"] = "interrupted (what finished is kept)"
            raise
        except Exception as error:  # the next part still runs; the traceback is in the JSON
            part["status"] = f"failed: {short_error(error)}"
            part["traceback"] = traceback.format_exc()
            say(f"({name}) {part['status']}")
        finally:
            part["seconds"] = round(time.perf_counter() - started, 1)
            report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_report(report, out, plots=name == "b")
    return report


def exit_status(report: dict) -> int:
    """0 when every part that ran finished and every op check passed; 1 otherwise (the targets
    are goals, not checks: they do not change it)."""
    parts = report["parts"].values()
    failed = any(p["status"].startswith(("failed", "interrupted")) for p in parts)
    return 1 if failed or report["parts"]["a"].get("failed") else 0
