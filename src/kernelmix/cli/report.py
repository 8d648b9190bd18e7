"""``kernelmix report darkformer``: the DARKFormer report on a real pretrained model."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..studies.darkformer_report import DarkformerReportSettings, darkformer_report
from .options import float_list, int_list

def _cli_report(args) -> int:
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        overrides: dict[str, Any] = {"model": args.model, "text": args.text, "seed": args.seed}
        if args.m:
            overrides["diag_m"] = tuple(int_list(args.m))
        if args.steps:
            overrides["ft_steps"] = args.steps
        if args.lrs:
            overrides["ft_lrs"] = tuple(float_list(args.lrs))
        if args.num_features:
            overrides["num_features"] = args.num_features
        if args.diag_layers:
            overrides["diag_layers"] = args.diag_layers
        settings = DarkformerReportSettings.quick(**overrides) if args.quick else DarkformerReportSettings(**overrides)
        darkformer_report(settings, args.out, args.work, progress=None)
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix report``."""
    p = sub.add_parser("report", help="reproduce a study end to end and write it under reports/ (darkformer)")
    reports = p.add_subparsers(dest="report", required=True)
    d = reports.add_parser(
        "darkformer",
        help="kernel diagnostics + finetuning comparison of Performer vs DARKFormer on a real pretrained model",
        description="Diagnostics of every layer (anisotropy, error vs m, estimator variance, end-to-end loss) and a "
                    "small finetuning comparison (softmax / Performer / DARKFormer at equal m and budget, a learning-rate "
                    "sweep counting loss spikes) on Gemma 3 270M by default: about an hour on 2 CPU cores. Interrupted "
                    "runs continue where they stopped.",
    )
    d.add_argument("--model", default="gemma3-270m", help="a known name (prepared on first use) or a local HF causal-LM directory")
    d.add_argument("--text", default="shakespeare", help="corpus name, dir, glob or file (split by document)")
    d.add_argument("--out", default="runs/darkformer-report", help="output directory (the committed report: results/darkformer)")
    d.add_argument("--work", default=None, help="checkpoints and reusable results (default runs/report-darkformer)")
    d.add_argument("--quick", action="store_true", help="a smoke-sized run of the whole pipeline")
    d.add_argument("--m", default="", help="diagnostic feature counts (default 16,64,256,1024)")
    d.add_argument("--diag-layers", default="", help="layers to diagnose (default all)")
    d.add_argument("--num-features", type=int, default=0, help="m of the finetuning comparison (default 64)")
    d.add_argument("--steps", type=int, default=0, help="finetuning steps per run (default 40)")
    d.add_argument("--lrs", default="", help="learning rates of the sweep (default 1e-3,3e-3)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=0)
    d.set_defaults(func=_cli_report)
