"""The full ``kernelmix`` parser: every subcommand (one module each, with an ``add_command(subparsers)``)
and the options of ``kernelmix`` itself. :func:`kernelmix.cli.main` imports this module when it runs
a command other than ``gpu-check``; it needs pydantic (through :mod:`kernelmix.config`), which the
light :mod:`kernelmix.cli` package itself does not.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

from ..config import Field, check
from . import (
    bench, compare, convert, demo, diagnose, finetune, generate_bench, gpu_check, model_info, pretrained, recall, report,
    train,
)
from . import eval as eval_command
from .options import Threads, add_options

COMMANDS = (demo, model_info, generate_bench, train, bench, gpu_check, pretrained, convert, diagnose, finetune, report,
            eval_command, compare, recall)


@dataclass
class GlobalOptions:
    """The options of ``kernelmix`` itself, accepted before or after the subcommand."""

    debug: Annotated[bool, Field(description="show the full traceback of an error (also: KERNELMIX_DEBUG=1)")] = False

    def __post_init__(self) -> None:
        check(self)


@dataclass
class ThreadOptions:
    """``--threads`` for every subcommand that does not define its own (the same option)."""

    threads: Threads = None

    def __post_init__(self) -> None:
        check(self)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    add_options(parser, GlobalOptions)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    _add_to_subcommands(parser)
    return parser


def _add_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand too (``kernelmix convert ... --debug``), where users type it
    (the options are SUPPRESSed when not given, so a subcommand never resets the top-level flag)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                if not any("--debug" in a.option_strings for a in child._actions):
                    add_options(child, GlobalOptions)
                if not any("--threads" in a.option_strings for a in child._actions) and child._subparsers is None:
                    add_options(child, ThreadOptions)
                _add_to_subcommands(child)


__all__ = ["COMMANDS", "GlobalOptions", "ThreadOptions", "build_parser"]
