"""Underflow of random-feature attention's denominators: the safe ratio the ops divide with, and
the once-per-process warning when some rows came out exactly 0 (docs/math.md §6)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor


def safe_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, and 0 where the denominator is below √tiny of its dtype (a NaN
    denominator stays NaN: a non-finite input must not come out as a zero row).

    Such a row has no numerically visible key mass: with very anisotropic inputs (seen on Gemma 3
    270M after a few DARKFormer finetuning steps, ‖Mq‖² ≈ 5·10⁴) a query's dominant features can
    miss every key's, the sum underflows and the ratio is 0/0. Clamping alone is not enough: the
    division's backward divides by the denominator again, so anything below √tiny overflows there.
    The selects (not a multiplication by a mask) keep the gradients of those rows exactly 0, not
    NaN. Rows above the floor are untouched, so ordinary inputs give bit-identical results."""
    empty = denominator <= underflow_floor(denominator.dtype)  # False for NaN
    safe = torch.where(empty, torch.ones_like(denominator), denominator)
    return torch.where(empty, torch.zeros_like(numerator), numerator / safe)


def underflow_floor(dtype: torch.dtype) -> float:
    """√tiny of ``dtype``: a denominator at or below it gives a zero row (:func:`safe_ratio`)."""
    return math.sqrt(torch.finfo(dtype).tiny)


class UnderflowWarning(RuntimeWarning):
    """Random-feature attention gave exactly-zero rows: their denominators underflowed."""


class UnderflowCheck:
    """Warns once per process (an :class:`UnderflowWarning`) when some rows of random-feature
    attention came out exactly 0 because the estimator's denominator φ(q)·Σφ(k) underflowed.

    The check needs a device sync, so it runs on the first call and then every ``every``-th call,
    and never again once it has warned (or while ``torch.compile`` traces): on an accelerator the
    other calls stay sync-free. The ops call :meth:`observe` where they already have the
    denominators; ``reset`` starts over (tests)."""

    def __init__(self, every: int = 100) -> None:
        self.every = every
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.warned = False

    def observe(self, denominator: Tensor, counted: Tensor | None = None) -> None:
        """``denominator``: one entry per output row (query token × head); ``counted``: which rows
        count (broadcastable bool; None: all) — a row with no visible key is 0 by definition."""
        if self.warned or torch.compiler.is_compiling():
            return
        self.calls += 1
        if (self.calls - 1) % self.every or denominator.numel() == 0:
            return
        with torch.no_grad():
            empty = denominator.detach() <= underflow_floor(denominator.dtype)
            if counted is None:
                counted = torch.ones_like(empty)
            counted = counted.expand_as(empty)
            zero_rows, rows = torch.stack([(empty & counted).sum(), counted.sum()]).tolist()  # the one sync
        if zero_rows:
            self.warned = True
            warnings.warn(_underflow_message(zero_rows, rows, self.every), UnderflowWarning, stacklevel=3)


def _underflow_message(zero_rows: int, rows: int, every: int) -> str:
    return (
        f"random-feature attention: {zero_rows / rows:.1%} of the output rows ({zero_rows} of {rows} query "
        "tokens × heads) came out exactly 0: their denominator φ(q)·Σφ(k) underflowed (every random feature "
        "that dominates the query misses every key). This is the estimator's limit, not a bug, but those "
        "rows carry no information. What helps: more random features (num_features), a smaller logit scale "
        "(temperature) of q and k, the data-aware transform (DARKFormer; RandomFeatureMap.whiten_), or "
        "float64 inputs (float32 and bfloat16 inputs are computed in float32). "
        f"(Checked on the first call and every {every}th; shown once per process.)"
    )


#: The process-wide underflow check of the random-feature ops (see :class:`UnderflowCheck`).
UNDERFLOW_CHECK = UnderflowCheck()
