"""``kernelmix demo``: every mixer on one random batch, time and error against its reference."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ..config import Field, NonNegativeInt, check
from ..studies.settings import DemoConfig
from ..output import write_json_atomic
from .commands import summary
from .options import add_options, from_args
from .paths import output_file


@dataclass
class DemoExtras:
    """What ``kernelmix demo`` adds to the run of :class:`~kernelmix.studies.demo.DemoConfig`."""

    memory_length: Annotated[NonNegativeInt, Field(
        description="also measure Cubit's peak memory (blocked vs dense) at this T; 0 to skip")] = 2048
    json: Annotated[str | None, Field(description="also write the table as JSON to this path")] = None

    def __post_init__(self) -> None:
        check(self)


def _demo(args: argparse.Namespace) -> int:
    try:
        config, opts = from_args(DemoConfig, args), from_args(DemoExtras, args)
    except ValueError as err:
        args.parser.error(str(err))
    from ..studies.demo import DTYPES, ERROR_BOUNDS, cubit_memory, describe, format_table, run_demo

    if opts.json:
        output_file(opts.json, "--json")  # now, not after the whole run
    dtype = DTYPES[config.dtype]

    print(
        f"kernelmix demo: every mixer on one random batch B={config.batch} T={config.length} H={config.heads} "
        f"d={config.head_dim} (random features m={config.num_features}), "
        f"fast path in {config.dtype} vs float64 reference\n"
    )
    rows = run_demo(config, progress=True)
    print(format_table(rows))
    print("\n" + describe(rows, dtype, config.device))
    if opts.memory_length:
        mem = cubit_memory(length=opts.memory_length, device=config.device)
        print(
            f"\nforward+backward peak memory at T={opts.memory_length} (B=1, H=8, d=64, float32): "
            + ", ".join(f"{key} {val:.0f} MiB" if val is not None else f"{key} n/a" for key, val in mem.items())
        )
    if opts.json:
        Path(opts.json).expanduser().parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(opts.json).expanduser(), [row.__dict__ for row in rows])
        print(f"\nwrote {opts.json}")
    bad = [r.mixer for r in rows if max(r.forward_error, r.grad_error) >= ERROR_BOUNDS[dtype]]
    return 1 if bad else 0


def add_command(sub) -> None:
    demo = sub.add_parser("demo", help=summary("demo"))
    add_options(demo, DemoConfig, DemoExtras)
    demo.set_defaults(func=_demo, parser=demo)
