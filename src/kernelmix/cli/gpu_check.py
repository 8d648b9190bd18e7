"""``kernelmix gpu-check --out DIR``: check and measure the GPU kernels in one command
(:mod:`kernelmix.studies.gpu_check` says what it runs; docs/gpu.md how to run it).

Plain argparse, not :mod:`kernelmix.cli.options`: those options are built from config dataclasses
that pydantic validates, and the GPU machine this command is for may not have pydantic. It must
run there from the source tree as ``PYTHONPATH=src python3 -m kernelmix gpu-check ...`` with only
torch, triton, numpy, rich and matplotlib, so this module imports neither :mod:`kernelmix.config`
nor the full CLI (:mod:`kernelmix.cli.app`), and of the study only its settings (the standard
library) until it runs. :class:`GpuCheckOptions` (a stdlib dataclass) names every option and its
default; the full CLI's parser adds the same options through :func:`add_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from dataclasses import dataclass, fields
from pathlib import Path

from ..studies.gpu_check.settings import INTERPRETER_ENV, PARTS
from .commands import summary


@dataclass
class GpuCheckOptions:
    """The options of ``kernelmix gpu-check`` (their defaults; argparse leaves unset ones out)."""

    out: str = ""
    device: str = "cuda"
    quick: bool = False
    lengths: str | None = None
    skip: str = ""
    threads: int | None = None
    debug: bool = False
    plan: bool = False


HELP = {
    "out": "directory for gpu_check.json, gpu_check.md, the PNGs and compare/ (required)",
    "device": "cuda (the check itself) or cpu (a dry run: use with --quick) (default: cuda)",
    "quick": "tiny sizes: T in {64, 128}, H=2, d=16, a few compare steps; on CPU the Triton kernels run "
             "under the interpreter (TRITON_INTERPRET=1 is set for it)",
    "lengths": "part (b)'s sequence lengths, comma-separated, instead of 1024,4096,8192,16384,32768 and the long "
               "65536 at the end (quick: 64,128 and 192)",
    "skip": "parts not to run, comma-separated: a (op checks), b (bench), c (compare)",
    "threads": "CPU threads for torch (default: the cores the machine's load leaves idle)",
    "debug": "show the full traceback of an error (also: KERNELMIX_DEBUG=1)",
    "plan": "no GPU needed: compile every Triton kernel for sm_90 ahead of time at the target shapes and write "
            "the launch report (plan.json, plan.md, README.md: grids, registers, spills, shared memory, compile "
            "seconds, FLOPs, bytes, roofline) into --out (results/gpu-plan); resumes from --out's compiled.jsonl",
}
PLAN_ALONE = ("device", "quick", "lengths", "skip")  # options that mean nothing with --plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """gpu-check's options on ``parser`` (defaults SUPPRESSed: :func:`options_from` fills them in)."""
    hidden = argparse.SUPPRESS
    parser.add_argument("--out", required=True, default=hidden, metavar="DIR", help=HELP["out"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=hidden, help=HELP["device"])
    parser.add_argument("--quick", action="store_true", default=hidden, help=HELP["quick"])
    parser.add_argument("--lengths", default=hidden, metavar="T,T,...", help=HELP["lengths"])
    parser.add_argument("--skip", default=hidden, metavar="PARTS", help=HELP["skip"])
    parser.add_argument("--threads", type=thread_count, default=hidden, metavar="N", help=HELP["threads"])
    parser.add_argument("--debug", action="store_true", default=hidden, help=HELP["debug"])
    parser.add_argument("--plan", action="store_true", default=hidden, help=HELP["plan"])


def thread_count(text: str) -> int:
    """``--threads``' value: a positive integer, refused here rather than as torch's RuntimeError."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (a CPU thread count, e.g. 1), got {text!r}")
    return value


def add_command(sub) -> None:
    parser = sub.add_parser(
        "gpu-check", help=summary("gpu-check"),
        description="(a) the ops against float64 references, (b) a bench against SDPA with the issue's targets, "
                    "(c) a short compare; JSON + markdown + PNG into --out. Runs without pydantic: "
                    "PYTHONPATH=src python3 -m kernelmix gpu-check --out DIR",
    )
    add_arguments(parser)
    parser.set_defaults(func=run, parser=parser)


def build_parser() -> argparse.ArgumentParser:
    """``kernelmix`` with this one subcommand: what :func:`kernelmix.cli.main` parses ``kernelmix gpu-check``
    (and ``python -m kernelmix gpu-check``) with, so that neither imports the full CLI."""
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=HELP["debug"])
    add_command(parser.add_subparsers(dest="command", required=True))
    return parser


def options_from(args: argparse.Namespace) -> GpuCheckOptions:
    return GpuCheckOptions(**{f.name: getattr(args, f.name) for f in fields(GpuCheckOptions) if hasattr(args, f.name)})


def parse_lengths(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        lengths = tuple(int(word) for word in text.split(",") if word.strip())
    except ValueError:
        raise ValueError(f"--lengths: expected comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths: expected positive integers, got {text!r}")
    return lengths


def parse_skip(text: str) -> tuple[str, ...]:
    parts = tuple(word.strip() for word in text.split(",") if word.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"--skip: unknown part(s) {', '.join(unknown)} (the parts are: {', '.join(PARTS)})")
    return parts


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (``timeout`` around the command, a job scheduler) stops the run as Ctrl-C does: the
    running part is recorded as interrupted and the files are written before the exit."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_plan_command(args: argparse.Namespace, options: GpuCheckOptions) -> int:
    """``--plan``: the launch report (kernelmix.studies.gpu_check.plan), no GPU."""
    given = [name for name in PLAN_ALONE if hasattr(args, name)]
    if given:
        args.parser.error(f"--plan compiles for a GPU without one and takes only --out (and --threads, --debug); "
                          f"drop --{', --'.join(given)}")
    from ..studies.gpu_check.plan import run_plan

    plan = run_plan(options.out)
    print((Path(options.out) / "plan.md").read_text(), flush=True)
    print(f"wrote {os.path.join(options.out, 'plan.json')}, plan.md and README.md ({len(plan['kernels'])} kernels)")
    return 0


def run(args: argparse.Namespace) -> int:
    options = options_from(args)
    if options.plan:
        return run_plan_command(args, options)
    try:
        lengths, skip = parse_lengths(options.lengths), parse_skip(options.skip)
    except ValueError as error:
        args.parser.error(str(error))
    if options.device == "cpu":
        # before kernelmix's Triton kernels are defined (triton.jit reads it then): on CPU they run
        # only under the interpreter
        os.environ.setdefault(INTERPRETER_ENV, "1")
    from ..studies.gpu_check import GpuCheckConfig, exit_status, print_tables, run_gpu_check

    config = GpuCheckConfig(device=options.device, quick=options.quick, lengths=lengths, skip=skip)
    with terminate_as_interrupt():
        report = run_gpu_check(config, options.out, say=lambda text: print(text, flush=True))
    print_tables(report)
    print(f"wrote {os.path.join(options.out, 'gpu_check.json')} and gpu_check.md", flush=True)
    return exit_status(report)


__all__ = ["GpuCheckOptions", "add_arguments", "add_command", "build_parser", "options_from", "run", "run_plan_command"]
