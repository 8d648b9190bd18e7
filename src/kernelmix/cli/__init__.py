"""The ``kernelmix`` command line: a thin shell over the library. Each subcommand lives in its own
module here with an ``add_command(subparsers)``; nothing in the library imports this package.

:func:`main` is also where a problem the user can fix stops being a traceback: a
:class:`~kernelmix.errors.KernelmixError` (a bad input, a busy run directory, an interrupted run),
an operating-system error (disk full, no permission, a missing path), a missing optional package
and Ctrl-C each print one line and exit non-zero. ``kernelmix --debug ...`` or
``KERNELMIX_DEBUG=1`` shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass
from typing import Annotated

from .. import oserror
from ..config import Field, check
from ..errors import KernelmixError
from . import bench, compare, convert, demo, diagnose, finetune, generate_bench, model_info, pretrained, recall, report, train
from . import eval as eval_command
from ..threads import set_threads
from .options import Threads, add_options

COMMANDS = (demo, model_info, generate_bench, train, bench, pretrained, convert, diagnose, finetune, report, eval_command, compare, recall)
DEBUG_ENV = "KERNELMIX_DEBUG"


@dataclass
class GlobalOptions:
    """The options of ``kernelmix`` itself, accepted before or after the subcommand."""

    debug: Annotated[bool, Field(description=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")] = False

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


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """Whether ``--debug`` was given or ``KERNELMIX_DEBUG`` is set to something other than 0/empty."""
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")


def main(argv: list[str] | None = None) -> int:
    """Run ``kernelmix ARGV``; returns the exit status (0: done)."""
    args = build_parser().parse_args(argv)
    name = " ".join(["kernelmix"] + [n for n in (args.command, getattr(args, "pretrained_command", None)) if n])
    debug = debug_requested(args)
    note = set_threads(getattr(args, "threads", None))
    if note:
        print(note, file=sys.stderr)
    try:
        return args.func(args)
    except KernelmixError as error:  # a bad input or run directory, an interrupted run: the message has the fix
        if debug:
            raise
        return _say(name, str(error), error.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        return _say(name, "interrupted (Ctrl-C)", 130)
    except BrokenPipeError:  # `kernelmix ... | head` closed our stdout: not an error, and nothing more can be shown
        if debug:
            raise
        with contextlib.suppress(OSError, ValueError):  # so the exit's flush of stdout does not complain
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell shows for a program stopped by a closed pipe
    except OSError as error:  # the environment: disk full, permissions, a missing path
        if debug:
            raise
        return _say(name, f"{oserror.describe(error)} (add --debug to see where)", 1)
    except ImportError as error:
        extra = missing_extra(error)
        if debug or extra is None:  # kernelmix's own imports failing is a bug: keep its traceback
            raise
        return _say(name, extra, 1)
    except Exception as error:
        inner = oserror.from_safetensors(error)  # safetensors' own error type around a disk or path error
        if debug or inner is None:
            raise
        return _say(name, f"{oserror.describe(inner)} (add --debug to see where)", 1)


def _say(name: str, message: str, code: int) -> int:
    print(f"{name}: error: {message}", file=sys.stderr)
    return code


# import names of the optional packages whose distribution has another name
_DISTRIBUTIONS = {"yaml": "pyyaml", "fla": "flash-linear-attention", "lm_eval": "lm-eval"}


def missing_extra(error: ImportError) -> str | None:
    """The message for a missing optional package: the error's own text when it already says what to
    install (kernelmix's :func:`~kernelmix.pretrained.require`, transformers' own checks), else the
    package and the ``kernelmix[extra]`` that brings it; None when the missing module is not one of
    kernelmix's optional dependencies (then it is a bug, not the environment)."""
    if "pip install" in str(error):
        return str(error)
    if not error.name:
        return None
    top = error.name.split(".")[0]
    distribution = _DISTRIBUTIONS.get(top, top.replace("_", "-"))
    extras = sorted(_extras_of(distribution), key=lambda extra: (extra == "test", extra))  # "test" has everything
    if not extras:
        return None
    return (f"the optional package {distribution} is not installed ({error}); "
            f"install it with: pip install \"kernelmix[{extras[0]}]\" (or pip install {distribution})")


def _extras_of(distribution: str) -> set[str]:
    """The extras of the installed kernelmix that list ``distribution`` (names compared as PyPI does)."""
    try:
        requirements = importlib.metadata.requires("kernelmix") or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    wanted = re.sub(r"[-_.]+", "-", distribution).lower()
    found = set()
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;.*extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if match and re.sub(r"[-_.]+", "-", match.group(1)).lower() == wanted:
            found.add(match.group(2))
    return found


__all__ = ["DEBUG_ENV", "GlobalOptions", "build_parser", "debug_requested", "main", "missing_extra"]
