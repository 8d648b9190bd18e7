"""Shared test helpers: error metrics against float64 references."""

from __future__ import annotations

import torch


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def rel_rmse(actual: torch.Tensor, expected: torch.Tensor, *, zero_floor: float = 1e-3) -> float:
    """Relative RMSE ‖a − e‖ / ‖e‖ (RMS norms).

    Where the reference is (analytically) zero — e.g. the q/k gradients at T = 1 — a relative error
    is meaningless (it only measures rounding noise), so the error is taken relative to ``zero_floor``
    instead: an absolute check on the scale of the O(1) test inputs.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = rms(actual.double() - expected.double())
    return err / max(rms(expected), zero_floor)
