"""The ``kernelmix`` command line: a thin shell over the library."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import ERROR_BOUNDS, cubit_memory, describe, format_table, run_demo

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _train(args: argparse.Namespace) -> int:
    from .training import CheckpointError, run_config, train

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every mixer on a random batch: time and error against its reference")
    demo.add_argument("--batch", type=_positive_int, default=2)
    demo.add_argument("--length", type=_positive_int, default=512)
    demo.add_argument("--heads", type=_positive_int, default=4)
    demo.add_argument("--head-dim", type=_positive_int, default=32)
    demo.add_argument("--num-features", type=_positive_int, default=64)
    demo.add_argument("--repeats", type=_positive_int, default=3)
    demo.add_argument(
        "--memory-length", type=int, default=2048,
        help="also measure Cubit's peak memory (blocked vs dense) at this T; 0 to skip",
    )
    demo.add_argument("--json", help="also write the table as JSON to this path")
    demo.add_argument("--device", default="cpu", help="torch device for the fast paths, e.g. cuda (default: cpu)")
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the fast paths")
    demo.set_defaults(func=_demo)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
