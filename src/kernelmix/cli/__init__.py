"""The ``kernelmix`` command line: a thin shell over the library. Each subcommand lives in its own
module here with an ``add_command(subparsers)``; nothing in the library imports this package."""

from __future__ import annotations

import argparse

from . import bench, compare, convert, demo, diagnose, finetune, generate_bench, model_info, pretrained, report, train
from . import eval as eval_command

COMMANDS = (demo, model_info, generate_bench, train, bench, pretrained, convert, diagnose, finetune, report, eval_command, compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


__all__ = ["build_parser", "main"]
