"""``kernelmix bench``: op speed and memory per mixer against length; JSON + PNG."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

from ..config import Choice, Field, PositiveInt, check
from ..studies.bench import MIXER_NAMES as MIXERS
from ..studies.bench import PEERS
from .options import add_options, from_args


@dataclass
class BenchOptions:
    """The keyword arguments of :func:`kernelmix.studies.bench.run_bench`, and where to write."""

    mixers: Annotated[list[str], Choice(MIXERS, "mixer"), Field(min_length=1, description="comma-separated (default: all)")] = (
        field(default_factory=lambda: list(MIXERS)))
    lengths: Annotated[list[PositiveInt], Field(min_length=1, description="e.g. 256,1024,4096")] = (
        field(default_factory=lambda: [256, 512, 1024, 2048, 4096]))
    decode_positions: list[PositiveInt] = field(default_factory=lambda: [256, 1024, 4096])
    batch: PositiveInt = 1
    heads: PositiveInt = 8
    head_dim: PositiveInt = 64
    num_features: PositiveInt = 128
    chunk_size: PositiveInt = 64
    dtype: Annotated[str, Choice(("float32", "bfloat16"), "dtype"), Field(description="the inputs' dtype")] = "float32"
    autocast: Annotated[str | None, Choice(("bfloat16", "float16"), "autocast dtype"), Field(
        description="run the forward passes under torch.autocast in this dtype (fp32 inputs; needs --dtype float32)")] = None
    device: str = "cpu"
    repeats: PositiveInt = 3
    memory: Annotated[bool, Field(description="skip the peak-memory measurement (each op in a fresh process)")] = True
    peers: Annotated[list[str], Choice(PEERS, "peer"), Field(
        description="comma-separated peers measured in the same run: performer-pytorch, fla-deltaformer-naive, "
        "cubit-dense (skipped with a note when not installed)")] = field(default_factory=list)
    peer_max_length: Annotated[PositiveInt, Field(description="largest T for the peers")] = 2048
    out: Annotated[str, Field(description="directory for bench.json / bench.png (the committed runs: results/bench*)")] = (
        "runs/bench")

    def __post_init__(self) -> None:
        check(self)


def _op_bench(args: argparse.Namespace) -> int:
    from ..studies.bench import format_report, run_bench, write_report

    try:
        opts = from_args(BenchOptions, args)
    except ValueError as err:
        args.parser.error(str(err))
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in dataclasses.asdict(opts).items() if k != "out"}
    report = run_bench(**settings, progress=lambda text: print(f"  measuring {text}", flush=True))
    written = write_report(report, opts.out)
    print(format_report(report))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_command(sub) -> None:
    opbench = sub.add_parser(
        "bench", help="op speed and memory per mixer vs T (forward, forward+backward, decode); JSON + PNG",
    )
    add_options(opbench, BenchOptions)
    opbench.set_defaults(func=_op_bench, parser=opbench)
