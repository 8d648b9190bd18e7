"""The one error type kernelmix raises for a problem the user can fix.

``KernelmixError`` is a ``ValueError`` (so code that catches ``ValueError`` keeps working); its
message names the problem and the fix. The command line catches it at the top and prints the
message alone; ``--debug`` (or ``KERNELMIX_DEBUG=1``) shows the traceback as well.
"""

from __future__ import annotations


class KernelmixError(ValueError):
    """A bad input, a bad run directory or a bad environment: the message says what and how to fix it."""


class RunDirectoryBusy(KernelmixError):
    """Another live process holds the run directory's lock."""


__all__ = ["KernelmixError", "RunDirectoryBusy"]
