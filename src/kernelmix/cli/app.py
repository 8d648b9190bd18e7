"""The full ``kernelmix`` parser: every subcommand (one module each, with an ``add_command(subparsers)``;
the table :data:`~kernelmix.cli.commands.SUBCOMMANDS`) and the options of ``kernelmix`` itself.
:func:`kernelmix.cli.main` imports this module when it runs a command other than ``gpu-check``; it
needs pydantic (through :mod:`kernelmix.config`), which the light :mod:`kernelmix.cli` package itself
does not.

``build_parser(["compare"])`` builds one command's options and lists the others by their line of
help only, importing none of their modules: what :func:`kernelmix.cli.main` parses with, so that
``kernelmix --help`` and ``kernelmix compare --help`` import no study, op or torch (a command whose
options come from a torch-importing module, e.g. ``train``'s TrainConfig, still imports it).
``build_parser()`` builds every command (the tests walk it). :data:`COMMANDS`, the modules, is
imported at its first use.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

import importlib
from collections.abc import Iterable

from ..config import Field, check
from .commands import SUBCOMMANDS
from .options import Threads, add_options


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


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """``kernelmix``'s parser with the options of ``commands`` (None: every command); each other
    command is listed with its line of help and no option, its module not imported."""
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    add_options(parser, GlobalOptions)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = set(SUBCOMMANDS) if commands is None else set(commands)
    for name, command in SUBCOMMANDS.items():
        if name in wanted:
            importlib.import_module(f"{__package__}.{command.module}").add_command(sub)
        else:
            sub.add_parser(name, help=command.help)
    _add_to_subcommands(parser)
    return parser


def __getattr__(name: str):
    """:data:`COMMANDS`: the module of every subcommand, in the order ``kernelmix --help`` lists them."""
    if name != "COMMANDS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return tuple(importlib.import_module(f"{__package__}.{command.module}") for command in SUBCOMMANDS.values())


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


__all__ = ["COMMANDS", "GlobalOptions", "ThreadOptions", "build_parser"]  # noqa: F822 (COMMANDS: __getattr__, lazily)
