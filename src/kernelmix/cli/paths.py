"""Checks a command makes before its work: that what it will write can be written.

A benchmark that runs for minutes and then finds that ``--out`` is a file (or that ``--json`` is a
directory, or a parent that cannot be written) has wasted the user's minutes; these checks say so
at once, naming the option and the fix. They create nothing: the directory is made when it is
written. And :func:`user_errors`: the library's ValueErrors about the user's input, raised while
a command works, become the :class:`~kernelmix.errors.KernelmixError` that ``kernelmix`` prints
without a traceback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import KernelmixError


def output_dir(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a directory the command may create or write into; a KernelmixError naming ``flag``
    when it is a file, or when the nearest existing folder above it is a file or not writable."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise KernelmixError(f"{flag} {path} is a file: choose a directory (it is created if needed)")
    _writable(path, flag)
    return path


def output_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a file the command may write (its folder is created if needed); a KernelmixError
    naming ``flag`` when it is a directory, or when the nearest existing folder above it cannot be written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise KernelmixError(f"{flag} {path} is a directory: give a file's path, e.g. {path / 'results.json'}")
    _writable(path.parent, flag)
    return path


def _writable(path: Path, flag: str) -> None:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise KernelmixError(f"{flag} {path}: {existing} is a file, not a directory: "
                             "fix the path or move the file away")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise KernelmixError(f"{flag} {path}: {existing} is not writable by you: check its permissions (ls -ld "
                             f"{existing}) or choose a path you own")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Inside the block, a ValueError (the library's word for a bad input: an unknown corpus, a layer out
    of range) is re-raised as a KernelmixError with the same message, so the command line prints it
    (``--debug`` still shows where it came from)."""
    try:
        yield
    except KernelmixError:
        raise
    except ValueError as error:
        raise KernelmixError(str(error)) from error


__all__ = ["output_dir", "output_file", "user_errors"]
