"""One writer per run directory.

Every command that writes a run directory (``train``, ``compare``, ``finetune``, ``report``,
``convert``) holds :func:`run_directory_lock` while it writes. The lock is the operating system's
advisory lock (``filelock``: ``flock`` on POSIX) on ``<dir>/.kernelmix.lock``: it is released by the
kernel when its process dies, however it dies, so a crash never leaves a lock behind. Beside it,
``<dir>/.kernelmix.lock.json`` says who holds it (pid, host, command, since when) so that a second
writer is refused with a message naming the holder; a holder file whose lock is free is what a dead
process left, and the next writer takes over with a note. A directory the lock created (and the
parents it created with it) is removed again when the command leaves nothing in it but the lock
file — a run that failed on its corpus leaves no empty ``--out`` behind; a directory that existed
before is never removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import KernelmixError, RunDirectoryBusy

LOCK_NAME = ".kernelmix.lock"
HOLDER_NAME = ".kernelmix.lock.json"


def _read_holder(directory: Path) -> dict | None:
    try:
        return json.loads((directory / HOLDER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another process (it has not said who it is yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"`{holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since})"


@contextlib.contextmanager
def run_directory_lock(directory: str | os.PathLike, command: str) -> Iterator[Path]:
    """Hold ``directory``'s writer lock for the ``with`` block (the directory is created if needed).

    A second writer raises :class:`RunDirectoryBusy` at once, naming the holder and the fix. The
    lock is re-entrant within one process (a study that trains into its own run directory can hold
    it and call ``train``, which takes it again)."""
    from filelock import FileLock, Timeout

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise KernelmixError(f"{directory} is a file, not a run directory: pass an --out that is a directory "
                             "(or does not exist yet)")
    created = _missing_directories(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KernelmixError(f"cannot create the run directory {directory}: {error.strerror or error}; choose another "
                             "--out (one you can write to)") from error
    lock = FileLock(str(directory / LOCK_NAME), is_singleton=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RunDirectoryBusy(
            f"{directory} is being written by {_describe(_read_holder(directory))}. Wait for it to finish, stop it, "
            "or write to another directory (--out)") from None
    outer = lock.lock_counter > 1
    if not outer:
        stale = _read_holder(directory)
        if stale and stale.get("pid") != os.getpid():
            print(f"note: taking over {directory}'s lock, left by {_describe(stale)}, which is no longer running",
                  file=sys.stderr)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": time.time()}
        (directory / HOLDER_NAME).write_text(json.dumps(holder) + "\n", encoding="utf-8")
    try:
        yield directory
    finally:
        unused = False
        if not outer:
            with contextlib.suppress(OSError):
                (directory / HOLDER_NAME).unlink()
            # unlinked while still held: a writer that opens the path after this creates a fresh lock
            unused = bool(created) and _only_the_lock(directory)
            if unused:
                with contextlib.suppress(OSError):
                    (directory / LOCK_NAME).unlink()
        lock.release()
        if unused:
            _remove_empty(created)


def _missing_directories(directory: Path) -> list[Path]:
    """``directory`` and those of its parents that do not exist yet, innermost first."""
    missing, path = [], directory
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _only_the_lock(directory: Path) -> bool:
    try:
        return [entry.name for entry in directory.iterdir()] == [LOCK_NAME]
    except OSError:
        return False


def _remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (innermost first) while they are empty: rmdir refuses a directory that
    another process wrote to meanwhile, which is then kept with everything above it."""
    for path in directories:
        try:
            path.rmdir()
        except OSError:
            return


__all__ = ["HOLDER_NAME", "LOCK_NAME", "run_directory_lock"]
