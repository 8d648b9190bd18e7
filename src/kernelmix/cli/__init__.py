"""The ``kernelmix`` command line: a thin shell over the library. Each subcommand lives in its own
module here with an ``add_command(subparsers)``; nothing in the library imports this package.

This package itself is light: the parser with every subcommand is :mod:`kernelmix.cli.app` (which
needs pydantic, through :mod:`kernelmix.config`), imported by :func:`main` when it is needed, with
the options of the command being run only (``kernelmix --help`` imports no command's module; torch's
threads are set when torch is first imported, so an option refused before the work imports none);
``kernelmix gpu-check`` is parsed by :mod:`kernelmix.cli.gpu_check` alone, so that it runs where
pydantic is missing (the GPU machine; ``python -m kernelmix gpu-check``). Other names of the full
CLI (``build_parser``, ``COMMANDS``, ``GlobalOptions``, ``ThreadOptions``) are forwarded to ``app``
(:data:`APP_NAMES`).

:func:`main` is also where a problem the user can fix stops being a traceback: a
:class:`~kernelmix.errors.KernelmixError` (a bad input, a busy run directory, an interrupted run),
an operating-system error (disk full, no permission, a missing path), a missing optional package
and Ctrl-C each print one line and exit non-zero. ``kernelmix --debug ...`` or
``KERNELMIX_DEBUG=1`` shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import os
import re
import sys

from .. import oserror
from ..errors import KernelmixError
from ..lazy import after_import
from ..threads import set_threads

DEBUG_ENV = "KERNELMIX_DEBUG"
STANDALONE_COMMAND = "gpu-check"  # parsed without the full CLI (no pydantic needed)


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """Whether ``--debug`` was given or ``KERNELMIX_DEBUG`` is set to something other than 0/empty."""
    return (bool(getattr(args, "debug", False))
            or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false"))


def command_word(argv: list[str]) -> str | None:
    """The subcommand of ``argv``: its first word that is not an option (``kernelmix`` itself takes
    only the flag ``--debug``, so no option value comes before the subcommand)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run ``kernelmix ARGV``; returns the exit status (0: done)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_word(argv)
    if command == STANDALONE_COMMAND:
        from .gpu_check import build_parser

        parser = build_parser()
    else:
        from .app import build_parser

        parser = build_parser([command] if command else [])  # only this command's options and modules
    return run_parsed(parser.parse_args(argv))


def run_parsed(args: argparse.Namespace) -> int:
    """Run parsed arguments (``args.func(args)``) with the threads they ask for, turning the errors a
    user can fix into one line and an exit status."""
    name = " ".join(["kernelmix"] + [n for n in (args.command, getattr(args, "pretrained_command", None)) if n])
    debug = debug_requested(args)
    try:
        # torch's threads are set as soon as torch is imported (now if it is), not before: an option
        # the command refuses before its work is refused without importing torch
        after_import("torch", functools.partial(_set_threads, getattr(args, "threads", None)))
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


def _set_threads(requested: int | None) -> None:
    note = set_threads(requested)
    if note:
        print(note, file=sys.stderr)


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


# what :mod:`.app` defines for the full CLI, forwarded on first use (any other unknown name is an
# AttributeError, so that ``from kernelmix.cli import model_info`` imports that submodule as usual)
APP_NAMES = frozenset({"COMMANDS", "GlobalOptions", "ThreadOptions", "build_parser"})


def __getattr__(name: str):
    """The full CLI's names (:data:`APP_NAMES`) from :mod:`.app`, imported at their first use."""
    if name not in APP_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.app"), name)


__all__ = ["DEBUG_ENV", "build_parser", "command_word", "debug_requested", "main", "missing_extra", "run_parsed"]
