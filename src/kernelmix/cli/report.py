"""``kernelmix report darkformer``: the DARKFormer report on a real pretrained model."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated

from ..config import Field, check
from ..errors import Interrupted
from ..studies.darkformer_report import DarkformerReportSettings, darkformer_report
from .options import add_options, from_args


@dataclass
class ReportOptions:
    """Where the report goes and how big it is (what it studies: DarkformerReportSettings)."""

    out: Annotated[str, Field(description="output directory (the committed report: results/darkformer)")] = (
        "runs/darkformer-report")
    work: Annotated[str | None, Field(description="checkpoints and reusable results (default runs/report-darkformer)")] = None
    quick: Annotated[bool, Field(description="a smoke-sized run of the whole pipeline")] = False

    def __post_init__(self) -> None:
        check(self)


def _cli_report(args) -> int:
    try:
        opts = from_args(ReportOptions, args)
        quick = DarkformerReportSettings.quick if opts.quick else None
        settings = from_args(DarkformerReportSettings, args, factory=quick)
        darkformer_report(settings, opts.out, opts.work, progress=None)
    except Interrupted as stop:  # the finetuning run in progress saved its step; the same command continues
        print(f"kernelmix report darkformer: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"kernelmix report darkformer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a finetuning step (loading, diagnostics), or pressed twice
        print("kernelmix report darkformer: stopped by Ctrl-C; finished work is kept and the same command continues",
              file=sys.stderr)
        return 130
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix report``."""
    p = sub.add_parser("report", help="reproduce a study end to end (darkformer); writes under runs/ unless --out says otherwise")
    reports = p.add_subparsers(dest="report", required=True)
    d = reports.add_parser(
        "darkformer",
        help="kernel diagnostics + finetuning comparison of Performer vs DARKFormer on a real pretrained model",
        description="Diagnostics of every layer (anisotropy, error vs m, estimator variance, end-to-end loss) and a "
                    "small finetuning comparison (softmax / Performer / DARKFormer at equal m and budget, a learning-rate "
                    "sweep counting loss spikes) on Gemma 3 270M by default: about an hour on 2 CPU cores. Interrupted "
                    "runs continue where they stopped. The defaults shown are the full run's; --quick shrinks them.",
    )
    add_options(d, ReportOptions, DarkformerReportSettings)
    d.set_defaults(func=_cli_report, parser=d)
