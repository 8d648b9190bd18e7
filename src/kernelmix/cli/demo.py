"""``kernelmix demo``: every mixer on one random batch, time and error against its reference."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Annotated

from ..config import Choice, Field, NonNegativeInt, PositiveInt, check
from .options import add_options, from_args


@dataclass
class DemoOptions:
    batch: PositiveInt = 2
    length: PositiveInt = 512
    heads: PositiveInt = 4
    head_dim: PositiveInt = 32
    num_features: Annotated[PositiveInt, Field(description="random features m")] = 64
    repeats: PositiveInt = 3
    memory_length: Annotated[NonNegativeInt, Field(
        description="also measure Cubit's peak memory (blocked vs dense) at this T; 0 to skip")] = 2048
    json: Annotated[str | None, Field(description="also write the table as JSON to this path")] = None
    device: Annotated[str, Field(description="torch device for the fast paths, e.g. cuda")] = "cpu"
    dtype: Annotated[str, Choice(("float32", "bfloat16"), "dtype"), Field(description="dtype of the fast paths")] = "float32"

    def __post_init__(self) -> None:
        check(self)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ..studies.demo import ERROR_BOUNDS, cubit_memory, describe, format_table, run_demo

    try:
        opts = from_args(DemoOptions, args)
    except ValueError as err:
        args.parser.error(str(err))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]

    print(
        f"kernelmix demo: every mixer on one random batch B={opts.batch} T={opts.length} H={opts.heads} "
        f"d={opts.head_dim} (random features m={opts.num_features}), fast path in float32 vs float64 reference\n"
    )
    rows = run_demo(
        batch=opts.batch, length=opts.length, heads=opts.heads, head_dim=opts.head_dim,
        num_features=opts.num_features, repeats=opts.repeats, device=opts.device, dtype=dtype,
    )
    print(format_table(rows))
    print("\n" + describe(rows, dtype, opts.device))
    if opts.memory_length:
        mem = cubit_memory(length=opts.memory_length, device=opts.device)
        print(
            f"\nforward+backward peak memory at T={opts.memory_length} (B=1, H=8, d=64, float32): "
            + ", ".join(f"{key} {val:.0f} MiB" if val is not None else f"{key} n/a" for key, val in mem.items())
        )
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump([row.__dict__ for row in rows], fh, indent=2)
        print(f"\nwrote {opts.json}")
    bad = [r.mixer for r in rows if max(r.forward_error, r.grad_error) >= ERROR_BOUNDS[dtype]]
    return 1 if bad else 0


def add_command(sub) -> None:
    demo = sub.add_parser("demo", help="run every mixer on a random batch: time and error against its reference")
    add_options(demo, DemoOptions)
    demo.set_defaults(func=_demo, parser=demo)
