"""What an operating-system error means for the user, in one sentence with the fix.

A disk that is full, a directory that cannot be written or a path that does not exist are
problems of the environment, not bugs: the command line prints :func:`describe`'s sentence instead
of a traceback, and the library turns such an error into a :class:`~kernelmix.errors.KernelmixError`
where it knows what was being written. ``safetensors`` reports the same errors as its own
``SafetensorError`` with the OS error inside its text; :func:`from_safetensors` gets it back out.
"""

from __future__ import annotations

import errno
import os
import re

# errno → the fix, phrased for someone at the command line
_FIXES = {
    errno.ENOSPC: "free some space on that disk or write somewhere else (another --out)",
    errno.EDQUOT: "your disk quota is used up: free some space or write somewhere else (another --out)",
    errno.EACCES: "you may not access it: check its permissions (ls -ld) or use a path you own",
    errno.EPERM: "the operation is not permitted there: check its permissions (ls -ld) or use a path you own",
    errno.EROFS: "that file system is read-only: write somewhere else (another --out)",
    errno.ENOENT: "it does not exist: check the spelling, or create the directory it should be in",
    errno.ENOTDIR: "a part of that path is a file, not a directory: fix the path or move the file away",
    errno.EISDIR: "it is a directory where a file is expected: give a file's path",
    errno.EEXIST: "something is already there: remove it or choose another path",
    errno.ENOTEMPTY: "the directory is not empty: empty it or choose another path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or run fewer things at once",
    errno.ENAMETOOLONG: "the path is too long: use a shorter one",
}


def describe(error: OSError, *, path: str | os.PathLike | None = None) -> str:
    """``<path>: <what the OS said> (<ERRNO>): <fix>`` for ``error``; ``path`` names the file when the
    error itself does not (a failed ``write`` carries no file name)."""
    where = error.filename if error.filename is not None else path
    if error.filename2 is not None:
        where = f"{error.filename} -> {error.filename2}"
    code = error.errno
    reason = error.strerror or str(error) or type(error).__name__
    name = f" ({errno.errorcode[code]})" if code in errno.errorcode else ""
    fix = _FIXES.get(code, "check the path and the disk, then run the command again")
    return f"{where}: {reason}{name}: {fix}" if where is not None else f"{reason}{name}: {fix}"


_OS_CODE = re.compile(r"\(os error (\d+)\)")
_AT_PATH = re.compile(r'at path "([^"]*)"')


def from_safetensors(error: BaseException) -> OSError | None:
    """The OSError inside a ``safetensors`` error (``... No space left on device (os error 28) at path
    "..."``), or None when ``error`` is no such error."""
    if type(error).__name__ != "SafetensorError":
        return None
    text = str(error)
    found = _OS_CODE.search(text)
    if found is None:
        return None
    code = int(found.group(1))
    at = _AT_PATH.search(text)
    return OSError(code, os.strerror(code), at.group(1) if at else None)


__all__ = ["describe", "from_safetensors"]
