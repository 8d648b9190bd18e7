"""``kernelmix train``: train a model on text; checkpoints, metrics, exact ``--resume``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Annotated

from ..config import Arg, Field, check, expectation, specs
from ..errors import KernelmixError
from ..training.config import TrainConfig
from .commands import summary
from .options import add_options, from_args


@dataclass
class TrainOptions:
    """Where the settings come from; the settings themselves are :class:`~kernelmix.training.TrainConfig`'s."""

    config: Annotated[str | None,
                      Field(description="a .toml, .yaml or .json file of settings (or a run's config.json)")] = None
    overrides: Annotated[list[str], Arg(flag="--set", repeat=True, metavar="KEY=VALUE"), Field(
        description="override one setting (repeatable)")] = field(default_factory=list)
    resume: Annotated[bool, Field(description="continue the run in --out from its newest checkpoint")] = False
    out: Annotated[str | None, Field(description="the run directory (sets out_dir)")] = None
    reschedule: Annotated[bool, Field(description=(
        "with --resume and another steps/tokens: lay the learning-rate schedule over the new total (the rate jumps "
        "at the resumed step); without it such a resume is refused"))] = False

    def __post_init__(self) -> None:
        check(self)
        if self.reschedule and not self.resume:
            raise KernelmixError("--reschedule changes the schedule of a resumed run: "
                                 "add --resume, or drop --reschedule")


def settings_help(cls: type = TrainConfig) -> str:
    """The settings of ``cls`` for ``--help``: name, default, what it must be, what it does."""
    lines = []
    for s in specs(cls):
        default = s.default if isinstance(s.default, str) else json.dumps(s.default, separators=(",", ":"))
        text = f"{s.name} = {default}: {s.description or expectation(s.annotation)}"
        lines.append(textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="      "))
    return "settings (--set KEY=VALUE, or keys of the --config file):\n" + "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    from ..errors import Interrupted
    from ..training.config import run_config

    opts = from_args(TrainOptions, args)
    main_process = int(os.environ.get("RANK", "0")) == 0
    try:
        config = run_config(opts.config, opts.overrides, out_dir=opts.out, resume=opts.resume)
    except ValueError as err:  # unknown key, bad value, unknown preset/mixer/option
        args.parser.error(str(err))
    from ..training import train  # the loop, the model and torch: once the settings are known to be right

    try:
        result = train(config, resume=opts.resume, reschedule=opts.reschedule)
    except Interrupted as err:  # SIGINT/SIGTERM: saved; the message says where and how to resume
        if main_process:
            print(f"kernelmix train: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:  # a busy or existing run, a bad checkpoint, a full disk, divergence, a corpus problem
        print(f"kernelmix train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (loading data, building the model)
        print("kernelmix train: stopped by Ctrl-C without saving (outside the training steps, or pressed twice); "
              "the checkpoints written before are kept", file=sys.stderr)
        return 130
    if main_process:
        last = result.losses.get(result.final_step)
        val = result.val_losses.get(result.final_step)
        print(
            f"step {result.final_step}/{result.total_steps}"
            + (f", loss {last:.4f}" if last is not None else "")
            + (f", val loss {val:.4f}" if val is not None else "")
            + (f", {len(result.skipped_steps)} skipped updates" if result.skipped_steps else "")
            + f", {result.tokens_per_s:,.0f} tokens/s; metrics {result.metrics_path}, checkpoint {result.checkpoint}"
        )
    return 0


def add_command(sub) -> None:
    trainer = sub.add_parser(
        "train", help=summary("train"),
        description=textwrap.fill(
            "Train a CausalLM: settings from --config (TOML/YAML/JSON) and --set key=value "
            "(e.g. --set model.mixer=cubit --set lr=3e-4 --set model.mixer_options.cubit.lrr=false). "
            "Many processes: torchrun --nproc_per_node=N -m kernelmix.cli train ...", 100),
        epilog=settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(trainer, TrainOptions)
    trainer.set_defaults(func=_train, parser=trainer)
