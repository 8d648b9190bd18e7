"""``kernelmix compare``: every mixer trained on the same data and seeds, with an equal budget of
tokens, FLOPs or time (``--budget``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any


from ..config import Arg, Field, check
from ..errors import Interrupted
from ..studies.compare.settings import DEFAULT_MIXERS, MIXER_VARIANTS, CompareConfig
from .commands import summary
from .options import add_options, from_args


@dataclass
class CompareOptions:
    overrides: Annotated[list[str], Arg(flag="--set", repeat=True, metavar="KEY=VALUE"), Field(
        description="model override for every run, e.g. hidden_size=128 or "
                    "mixer_options.performer.num_features=64")] = (
        field(default_factory=list))

    def __post_init__(self) -> None:
        check(self)


def add_command(sub) -> None:
    """Register ``kernelmix compare``."""
    p = sub.add_parser(
        "compare", help=summary("compare"),
        description=f"Train the default mixers ({', '.join(DEFAULT_MIXERS)}; --mixers chooses among "
        f"{', '.join(MIXER_VARIANTS)}) with the same preset, data, tokenizer, seeds and budget at each training "
        "length, evaluate them (val loss at the training length, loss by position), and write results.json, "
        "results.md and PNG plots. --budget says what is equal: tokens (default), training FLOPs (softmax's for "
        "those tokens, analytic counts) or training seconds on this machine (measured, so noisy); every run reports "
        "all three. Finished runs in the output directory are reused, so an interrupted compare continues where it "
        "stopped.",
    )
    add_options(p, CompareConfig, CompareOptions)
    p.set_defaults(func=_cli_compare, parser=p)


def _cli_compare(args) -> int:
    try:
        opts = from_args(CompareOptions, args)
        wrapper: dict[str, Any] = {}
        if opts.overrides:  # (the training config's parser: it imports torch)
            from ..training.config import apply_override

            for assignment in opts.overrides:
                apply_override(wrapper, "model." + assignment)
        config = from_args(CompareConfig, args, model=wrapper.get("model", {}))
    except ValueError as error:
        args.parser.error(str(error))
    from ..studies.compare import format_markdown, run_compare
    from ..training import CheckpointError

    main_process = os.environ.get("RANK", "0") == "0"  # torchrun: rank 0 reports
    try:
        results = run_compare(config)
    except Interrupted as stop:  # SIGINT/SIGTERM: the run in progress is checkpointed; the message says how to go on
        if main_process:
            print(stop, file=sys.stderr)
        return stop.exit_code
    except (CheckpointError, ValueError) as error:  # an unknown corpus, a busy or damaged run directory, ...
        print(f"kernelmix compare: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C pressed twice, or while the corpus was loading
        print("kernelmix compare: stopped by Ctrl-C without saving the run in progress; finished runs are kept and "
              "the same command continues", file=sys.stderr)
        return 130
    if main_process:
        print(format_markdown(results))
    return 0
