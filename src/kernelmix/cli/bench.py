"""``kernelmix bench``: op speed and memory per mixer against length; JSON + PNG."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

from ..config import Field, check
from ..studies.settings import BenchConfig
from .commands import summary
from .options import add_options, from_args
from .paths import output_dir


@dataclass
class BenchOutput:
    """Where ``kernelmix bench`` writes (what it measures: :class:`~kernelmix.studies.settings.BenchConfig`)."""

    out: Annotated[str,
                   Field(description="directory for bench.json / bench.png (the committed runs: results/bench*)")] = (
        "runs/bench")

    def __post_init__(self) -> None:
        check(self)


def _op_bench(args: argparse.Namespace) -> int:
    try:
        config, output = from_args(BenchConfig, args), from_args(BenchOutput, args)
    except ValueError as err:
        args.parser.error(str(err))
    from ..studies.bench import format_report, run_bench, write_report

    output_dir(output.out, "--out")  # now, not after minutes of measuring
    report = run_bench(config, progress=lambda text: print(f"  measuring {text}", flush=True))
    written = write_report(report, output.out)
    print(format_report(report))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_command(sub) -> None:
    opbench = sub.add_parser(
        "bench", help=summary("bench"),
    )
    add_options(opbench, BenchConfig, BenchOutput)
    opbench.set_defaults(func=_op_bench, parser=opbench)
