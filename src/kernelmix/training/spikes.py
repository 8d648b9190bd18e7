"""Loss spikes: how a training loop tells a bad update from batch-to-batch noise."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence


def is_spike(history: Sequence[float], loss: float, *, window: int, nats: float, noise_k: float = 4.0) -> bool:
    """A non-finite loss, or one above the median of the last ``window`` finite losses by more than
    ``max(nats, noise_k · σ)``, σ = 1.4826·MAD of those losses (a robust estimate of the batch-to-batch
    noise: with small batches some windows of text are simply harder, and those are not spikes)."""
    if not math.isfinite(loss):
        return True
    recent = [x for x in history[-window:] if math.isfinite(x)]
    if len(recent) < min(window, 5):
        return False
    centre = statistics.median(recent)
    sigma = 1.4826 * statistics.median([abs(x - centre) for x in recent])
    return loss > centre + max(nats, noise_k * sigma)


def find_spikes(losses: Sequence[float], *, window: int, nats: float) -> list[dict]:
    """Every spike of a loss history (:func:`is_spike` at each step against the steps before it)."""
    return [{"step": step, "loss": value} for step, value in enumerate(losses)
            if is_spike(losses[:step], value, window=window, nats=nats)]


@dataclass
class SpikeGuard:
    """The bookkeeping of a loop that skips bad updates (``optimizer_step(skip_non_finite=True)``):
    every step's loss in ``losses``; a spike (:func:`is_spike` against the losses before it, or a
    non-finite gradient, marked ``"gradient": "non-finite"``) in ``spikes``; ``skipped`` updates;
    ``diverged`` once ``max_bad_steps`` updates in a row were skipped."""

    window: int
    nats: float
    max_bad_steps: int
    losses: list[float] = field(default_factory=list)
    spikes: list[dict] = field(default_factory=list)
    skipped: int = 0
    bad_in_a_row: int = 0
    diverged: bool = False

    def record(self, step: int, loss: float, *, grad_finite: bool | None, updated: bool) -> bool:
        """Book the update from ``step`` (0-based): its ``loss``, whether its gradient was finite
        (None: no gradient, the loss was not finite) and whether the optimizer stepped. Returns
        whether it was a spike."""
        spike = is_spike(self.losses, loss, window=self.window, nats=self.nats)
        if spike:
            self.spikes.append({"step": step, "loss": loss})
        if grad_finite is False:  # a finite loss with a non-finite gradient: the update was skipped
            if spike:
                self.spikes[-1]["gradient"] = "non-finite"
            else:
                self.spikes.append({"step": step, "loss": loss, "gradient": "non-finite"})
                spike = True
        if updated:
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
            self.skipped += 1
            self.diverged = self.diverged or self.bad_in_a_row >= self.max_bad_steps
        self.losses.append(loss)
        return spike


__all__ = ["SpikeGuard", "find_spikes", "is_spike"]
