"""``kernelmix report darkformer``: the DARKFormer report on a real pretrained model."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated

from ..config import Field, check
from ..errors import Interrupted
from ..studies.conversion_settings import ConversionReportSettings
from ..studies.darkformer_settings import DarkformerReportSettings
from .commands import summary
from .options import add_options, from_args


@dataclass
class ReportOptions:
    """Where the report goes and how big it is (what it studies: DarkformerReportSettings)."""

    out: Annotated[str, Field(description="output directory")] = (
        "runs/darkformer-report")
    work: Annotated[str | None,
                    Field(description="checkpoints and reusable results (default runs/report-darkformer)")] = None
    quick: Annotated[bool, Field(description="a smoke-sized run of the whole pipeline")] = False

    def __post_init__(self) -> None:
        check(self)


def _cli_report(args) -> int:
    try:
        opts = from_args(ReportOptions, args)
        quick = DarkformerReportSettings.quick if opts.quick else None
        settings = from_args(DarkformerReportSettings, args, factory=quick)
        from ..studies.darkformer_report import darkformer_report  # torch: once the settings are known to be right

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


@dataclass
class ConversionReportOptions:
    """Where the conversion report goes and how big it is (what it measures: ConversionReportSettings)."""

    out: Annotated[str, Field(description="output directory (the committed report: results/conversion)")] = (
        "runs/conversion-report")
    work: Annotated[str | None, Field(description="transfers, finetuning runs and finished rows (default "
                                                    "runs/report-conversion)")] = None
    quick: Annotated[bool, Field(description="a smoke-sized run of the whole pipeline")] = False

    def __post_init__(self) -> None:
        check(self)


def _cli_conversion(args) -> int:
    try:
        opts = from_args(ConversionReportOptions, args)
        quick = ConversionReportSettings.quick if opts.quick else None
        settings = from_args(ConversionReportSettings, args, factory=quick)
    except ValueError as error:
        args.parser.error(str(error))
    from ..studies.conversion_report import conversion_report

    try:
        conversion_report(settings, opts.out, opts.work, progress=True, log=lambda msg: print(msg, flush=True))
    except Interrupted as stop:
        print(f"kernelmix report conversion: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("kernelmix report conversion: stopped by Ctrl-C; finished rows, transfers and finetuning checkpoints are "
              "kept and the same command continues", file=sys.stderr)
        return 130
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix report``."""
    p = sub.add_parser("report", help=summary("report"))
    reports = p.add_subparsers(dest="report", required=True)
    d = reports.add_parser(
        "darkformer",
        help="kernel diagnostics + finetuning comparison of Performer vs DARKFormer on a real pretrained model",
        description="Diagnostics of every layer (anisotropy, error vs m, estimator variance, end-to-end loss) and a "
                    "small finetuning comparison (softmax / Performer / DARKFormer at equal m and budget, a "
                    "learning-rate sweep counting loss spikes) on Gemma 3 270M by default: about an hour on 2 CPU "
                    "cores. Interrupted runs continue where they stopped. "
                    "The defaults shown are the full run's; --quick shrinks them.",
    )
    add_options(d, ReportOptions, DarkformerReportSettings)
    d.set_defaults(func=_cli_report, parser=d)
    c = reports.add_parser(
        "conversion",
        help="conversion that keeps the host: window + sinks + features, attention transfer, "
             "LoRA, constant-memory decode",
        description="Gemma 3 270M converted on its global or all layers (window, Performer, whitened and transferred "
                    "DARKFormer, transferred Hedgehog), before and after LoRA: held-out loss, per-layer attention "
                    "error, and decode memory and time at 1k/8k/32k tokens of context against the host. Resumable.",
    )
    add_options(c, ConversionReportOptions, ConversionReportSettings)
    c.set_defaults(func=_cli_conversion, parser=c)
