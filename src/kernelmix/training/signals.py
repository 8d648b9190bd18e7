"""Stopping a training loop cleanly on SIGINT (Ctrl-C) or SIGTERM (what schedulers, ``kill`` and
``torchrun`` send).

Inside :func:`catch_stop_signals` the first SIGINT or SIGTERM only records its number: the loop
finishes the step it is in, writes a checkpoint and raises :class:`kernelmix.errors.Interrupted`
(see :meth:`.trainer.Trainer.run`), so the command exits with 128 + the signal's number. A second
signal stops at once, the way it would have without us (``KeyboardInterrupt`` for SIGINT, the
process ends for SIGTERM): someone who presses Ctrl-C twice means it. The previous handlers are
restored when the block ends. Python lets only the main thread install handlers; elsewhere nothing
is installed and the signals keep their usual effect.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class StopSignals:
    """The handlers of one :func:`catch_stop_signals` block; ``received`` is the number of the first
    stop signal (None: none yet)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        for number in STOP_SIGNALS:
            self.previous[number] = signal.getsignal(number)
            signal.signal(number, self._handle)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            # None: a handler not installed from Python, which cannot be put back; the default is closest
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}

    def _handle(self, number: int, frame) -> None:
        if self.received is None:
            self.received = number
            return
        previous = self.previous.get(number)
        self.restore()
        if callable(previous):  # Python's default SIGINT handler raises KeyboardInterrupt
            previous(number, frame)
        else:  # SIG_DFL ends the process as the signal does; SIG_IGN ignores it, as before
            signal.raise_signal(number)


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopSignals]:
    """Record SIGINT/SIGTERM instead of acting on them for the block (main thread only)."""
    stop = StopSignals()
    if threading.current_thread() is threading.main_thread():
        stop.install()
    try:
        yield stop
    finally:
        stop.restore()


__all__ = ["STOP_SIGNALS", "StopSignals", "catch_stop_signals", "signal_name"]
