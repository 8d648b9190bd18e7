"""The one error type kernelmix raises for a problem the user can fix.

``KernelmixError`` is a ``ValueError`` (so code that catches ``ValueError`` keeps working); its
message names the problem and the fix. The command line catches it at the top and prints the
message alone; ``--debug`` (or ``KERNELMIX_DEBUG=1``) shows the traceback as well.

:func:`check_positive_int` is the one argument check shared by modules that share nothing else
(the layers, the MQAR data).
"""

from __future__ import annotations

from typing import Any


class KernelmixError(ValueError):
    """A bad input, a bad run directory or a bad environment: the message says what and how to fix it.

    ``exit_code`` is what the command line exits with when it catches this error."""

    exit_code = 1


class RunDirectoryBusy(KernelmixError):
    """Another live process holds the run directory's lock."""


class Interrupted(KernelmixError):
    """A run stopped by SIGINT or SIGTERM after saving its state; the message says where and how to resume.
    The command line exits with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number


def check_positive_int(name: str, value: Any) -> int:
    """``value`` itself when it is an int > 0 (a bool is not); else a KernelmixError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KernelmixError(f"{name} must be a positive int, got {value!r}")
    return value


__all__ = ["Interrupted", "KernelmixError", "RunDirectoryBusy", "check_positive_int"]
