"""``kernelmix generate-bench``: generation throughput per mixer, cached vs uncached."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ..config import Field, check
from ..studies.settings import GenerateBenchConfig
from ..output import write_json_atomic
from .commands import summary
from .options import add_options, from_args
from .paths import output_file


@dataclass
class GenerateBenchOutput:
    """What the command adds to the study's config: a JSON copy of the rows."""

    json: Annotated[str | None, Field(description="also write the rows as JSON to this path")] = None

    def __post_init__(self) -> None:
        check(self)


def _generate_bench(args: argparse.Namespace) -> int:
    try:
        config = from_args(GenerateBenchConfig, args)
        out = from_args(GenerateBenchOutput, args)
    except ValueError as err:  # e.g. prompt + new tokens beyond the preset's max_seq_len, no CUDA device
        args.parser.error(str(err))
    import torch

    from ..studies.generate_bench import benchmark_generation, format_bench_table

    if out.json:
        output_file(out.json, "--json")  # now, not after the whole benchmark
    device = torch.device(config.device)
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    uncached = config.uncached_new_tokens
    print(
        f"kernelmix generate-bench: preset {config.preset}, freshly initialised {config.dtype} models, greedy, batch "
        f"{config.batch}, prompt {config.prompt_length} tokens; cached: {config.new_tokens} new tokens, uncached: "
        + (f"{uncached} new tokens" if uncached else "not measured")
        + f"; {where}, median of {config.repeats}\n"
    )
    rows = benchmark_generation(config, progress=True)
    print(format_bench_table(rows))
    print(
        "\ntokens/s = batch x new tokens / wall time of one generate call (prefill included)."
        + (
            f" Uncached was measured on {uncached} new tokens only (it recomputes the whole sequence per token); "
            f"its cost per token grows with length, so over {config.new_tokens} tokens it would be slower still and "
            "the ratio larger."
            if 0 < uncached < config.new_tokens else ""
        )
    )
    if out.json:
        Path(out.json).expanduser().parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(out.json).expanduser(),
                          [dict(row.__dict__, speedup=row.speedup, prompt_length=config.prompt_length,
                                batch=config.batch, dtype=config.dtype, device=where) for row in rows])
        print(f"wrote {out.json}")
    return 0


def add_command(sub) -> None:
    bench = sub.add_parser(
        "generate-bench", help=summary("generate-bench")
    )
    add_options(bench, GenerateBenchConfig, GenerateBenchOutput)
    bench.set_defaults(func=_generate_bench, parser=bench)
