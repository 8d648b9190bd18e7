"""Loss spikes: how a training loop tells a bad update from batch-to-batch noise."""

from __future__ import annotations

import math
import statistics
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


__all__ = ["find_spikes", "is_spike"]
