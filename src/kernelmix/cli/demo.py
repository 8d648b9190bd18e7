"""``kernelmix demo``: every mixer on one random batch, time and error against its reference."""

from __future__ import annotations

import argparse
import json

from .options import positive_int


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ..studies.demo import ERROR_BOUNDS, cubit_memory, describe, format_table, run_demo

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    print(
        f"kernelmix demo: every mixer on one random batch B={args.batch} T={args.length} H={args.heads} "
        f"d={args.head_dim} (random features m={args.num_features}), fast path in float32 vs float64 reference\n"
    )
    rows = run_demo(
        batch=args.batch, length=args.length, heads=args.heads, head_dim=args.head_dim,
        num_features=args.num_features, repeats=args.repeats, device=args.device, dtype=dtype,
    )
    print(format_table(rows))
    print("\n" + describe(rows, dtype, args.device))
    if args.memory_length:
        mem = cubit_memory(length=args.memory_length, device=args.device)
        print(
            f"\nforward+backward peak memory at T={args.memory_length} (B=1, H=8, d=64, float32): "
            + ", ".join(f"{key} {val:.0f} MiB" if val is not None else f"{key} n/a" for key, val in mem.items())
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([row.__dict__ for row in rows], fh, indent=2)
        print(f"\nwrote {args.json}")
    bad = [r.mixer for r in rows if max(r.forward_error, r.grad_error) >= ERROR_BOUNDS[dtype]]
    return 1 if bad else 0


def add_command(sub) -> None:
    demo = sub.add_parser("demo", help="run every mixer on a random batch: time and error against its reference")
    demo.add_argument("--batch", type=positive_int, default=2)
    demo.add_argument("--length", type=positive_int, default=512)
    demo.add_argument("--heads", type=positive_int, default=4)
    demo.add_argument("--head-dim", type=positive_int, default=32)
    demo.add_argument("--num-features", type=positive_int, default=64)
    demo.add_argument("--repeats", type=positive_int, default=3)
    demo.add_argument(
        "--memory-length", type=int, default=2048,
        help="also measure Cubit's peak memory (blocked vs dense) at this T; 0 to skip",
    )
    demo.add_argument("--json", help="also write the table as JSON to this path")
    demo.add_argument("--device", default="cpu", help="torch device for the fast paths, e.g. cuda (default: cpu)")
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the fast paths")
    demo.set_defaults(func=_demo)
