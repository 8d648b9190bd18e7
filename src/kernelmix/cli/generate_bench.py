"""``kernelmix generate-bench``: generation throughput per mixer, cached vs uncached."""

from __future__ import annotations

import argparse
import json

from ..layers import MIXERS
from ..model import PRESETS
from .options import mixer_list, non_negative_int, positive_int


def _generate_bench(args: argparse.Namespace) -> int:
    import torch

    from ..generate import benchmark_generation, format_bench_table

    try:
        device = torch.device(args.device)
    except RuntimeError:
        args.parser.error(f"unknown device {args.device!r} (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda asked for, but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    uncached = args.new_tokens if args.uncached_new_tokens is None else args.uncached_new_tokens
    fewer = 0 < uncached < args.new_tokens
    print(
        f"kernelmix generate-bench: preset {args.preset}, freshly initialised float32 models, greedy, batch "
        f"{args.batch}, prompt {args.prompt_length} tokens; cached: {args.new_tokens} new tokens, uncached: "
        + (f"{uncached} new tokens" if uncached else "not measured")
        + f"; {where}, median of {args.repeats}\n"
    )
    try:
        rows = benchmark_generation(
            args.preset, args.mixers, prompt_length=args.prompt_length, new_tokens=args.new_tokens,
            uncached_new_tokens=uncached, batch=args.batch, repeats=args.repeats, seed=args.seed, device=device,
        )
    except ValueError as err:  # e.g. prompt + new tokens beyond the preset's max_seq_len
        args.parser.error(str(err))
    print(format_bench_table(rows))
    print(
        "\ntokens/s = batch x new tokens / wall time of one generate call (prefill included)."
        + (
            f" Uncached was measured on {uncached} new tokens only (it recomputes the whole sequence per token); "
            f"its cost per token grows with length, so over {args.new_tokens} tokens it would be slower still and "
            "the ratio larger."
            if fewer else ""
        )
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                [dict(row.__dict__, speedup=row.speedup, prompt_length=args.prompt_length, batch=args.batch,
                      device=where) for row in rows],
                fh, indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def add_command(sub) -> None:
    bench = sub.add_parser(
        "generate-bench", help="generation throughput per mixer: cached (prefill + 1 token/step) vs uncached"
    )
    bench.add_argument("--preset", choices=list(PRESETS), default="small")
    bench.add_argument("--mixers", type=mixer_list, default=list(MIXERS), help="comma-separated (default: all)")
    bench.add_argument("--prompt-length", type=positive_int, default=32)
    bench.add_argument("--new-tokens", type=positive_int, default=1024)
    bench.add_argument(
        "--uncached-new-tokens", type=non_negative_int, default=None,
        help="measure the slow uncached baseline on this many new tokens (default: --new-tokens; 0 skips it)",
    )
    bench.add_argument("--batch", type=positive_int, default=1)
    bench.add_argument("--repeats", type=positive_int, default=1)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    bench.add_argument("--json", help="also write the rows as JSON to this path")
    bench.set_defaults(func=_generate_bench, parser=bench)
