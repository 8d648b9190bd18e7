"""``kernelmix train``: train a model on text; checkpoints, metrics, exact ``--resume``."""

from __future__ import annotations

import argparse
import os
import sys


def _train(args: argparse.Namespace) -> int:
    from ..training import CheckpointError, run_config, train

    try:
        config = run_config(args.config, args.set, out_dir=args.out, resume=args.resume)
    except ValueError as err:  # unknown key, bad value, unknown preset/mixer/option
        args.parser.error(str(err))
    try:
        result = train(config, resume=args.resume)
    except (CheckpointError, ValueError) as err:  # an existing run, a bad checkpoint, a corpus problem
        print(f"kernelmix train: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        last = result.losses.get(result.final_step)
        val = result.val_losses.get(result.final_step)
        print(
            f"step {result.final_step}/{result.total_steps}"
            + (f", loss {last:.4f}" if last is not None else "")
            + (f", val loss {val:.4f}" if val is not None else "")
            + f", {result.tokens_per_s:,.0f} tokens/s; metrics {result.metrics_path}, checkpoint {result.checkpoint}"
        )
    return 0


def add_command(sub) -> None:
    trainer = sub.add_parser(
        "train", help="train a model on text (a preset + overrides); checkpoints, metrics, exact --resume",
        description="Train a CausalLM: settings from --config (TOML/YAML/JSON) and --set key=value "
        "(e.g. --set model.mixer=cubit --set lr=3e-4 --set model.mixer_options.cubit.lrr=false). "
        "Many processes: torchrun --nproc_per_node=N -m kernelmix.cli train ...",
    )
    trainer.add_argument("--config", help="a .toml, .yaml or .json file of settings (or a run's config.json)")
    trainer.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting (repeatable)")
    trainer.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    trainer.add_argument("--out", help="the run directory (sets out_dir)")
    trainer.set_defaults(func=_train, parser=trainer)
