"""``kernelmix generate-bench``: generation throughput per mixer, cached vs uncached."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Annotated

from ..config import Choice, Field, NonNegativeInt, PositiveInt, check
from ..layers import MIXERS
from ..model import PRESETS
from .options import add_options, from_args


@dataclass
class GenerateBenchOptions:
    """The arguments of :func:`kernelmix.generate.benchmark_generation`, and the output."""

    preset: Annotated[str, Choice(PRESETS, "preset")] = "small"
    mixers: Annotated[list[str], Choice(MIXERS, "mixer"), Field(min_length=1, description="comma-separated (default: all)")] = (
        field(default_factory=lambda: list(MIXERS)))
    prompt_length: PositiveInt = 32
    new_tokens: PositiveInt = 1024
    uncached_new_tokens: Annotated[NonNegativeInt | None, Field(
        description="measure the slow uncached baseline on this many new tokens (default: --new-tokens; 0 skips it)")] = None
    batch: PositiveInt = 1
    repeats: PositiveInt = 1
    seed: int = 0
    threads: Annotated[PositiveInt | None, Field(description="torch CPU threads (default: torch's)")] = None
    device: Annotated[str, Field(description="cpu or cuda[:N]")] = "cpu"
    json: Annotated[str | None, Field(description="also write the rows as JSON to this path")] = None

    def __post_init__(self) -> None:
        check(self)


def _generate_bench(args: argparse.Namespace) -> int:
    import torch

    from ..generate import benchmark_generation, format_bench_table

    try:
        opts = from_args(GenerateBenchOptions, args)
    except ValueError as err:
        args.parser.error(str(err))
    try:
        device = torch.device(opts.device)
    except RuntimeError:
        args.parser.error(f"unknown device {opts.device!r} (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda asked for, but torch sees no CUDA device")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    uncached = opts.new_tokens if opts.uncached_new_tokens is None else opts.uncached_new_tokens
    fewer = 0 < uncached < opts.new_tokens
    print(
        f"kernelmix generate-bench: preset {opts.preset}, freshly initialised float32 models, greedy, batch "
        f"{opts.batch}, prompt {opts.prompt_length} tokens; cached: {opts.new_tokens} new tokens, uncached: "
        + (f"{uncached} new tokens" if uncached else "not measured")
        + f"; {where}, median of {opts.repeats}\n"
    )
    try:
        rows = benchmark_generation(
            opts.preset, opts.mixers, prompt_length=opts.prompt_length, new_tokens=opts.new_tokens,
            uncached_new_tokens=uncached, batch=opts.batch, repeats=opts.repeats, seed=opts.seed, device=device,
        )
    except ValueError as err:  # e.g. prompt + new tokens beyond the preset's max_seq_len
        args.parser.error(str(err))
    print(format_bench_table(rows))
    print(
        "\ntokens/s = batch x new tokens / wall time of one generate call (prefill included)."
        + (
            f" Uncached was measured on {uncached} new tokens only (it recomputes the whole sequence per token); "
            f"its cost per token grows with length, so over {opts.new_tokens} tokens it would be slower still and "
            "the ratio larger."
            if fewer else ""
        )
    )
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(
                [dict(row.__dict__, speedup=row.speedup, prompt_length=opts.prompt_length, batch=opts.batch,
                      device=where) for row in rows],
                fh, indent=2,
            )
        print(f"wrote {opts.json}")
    return 0


def add_command(sub) -> None:
    bench = sub.add_parser(
        "generate-bench", help="generation throughput per mixer: cached (prefill + 1 token/step) vs uncached"
    )
    add_options(bench, GenerateBenchOptions)
    bench.set_defaults(func=_generate_bench, parser=bench)
