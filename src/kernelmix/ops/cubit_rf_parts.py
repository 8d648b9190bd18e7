"""Cubit-RF with either part exact: the ablation that says which estimate costs the recall.

Cubit-RF (``cubit_rf``, docs/math.md §12) replaces two kernels of Cubit by random-feature estimates:
the Gram kernel exp(r_iᵀ r̂_j) of the ridge solve and the read-out's exp(q_iᵀ k_j / √d).
:func:`cubit_rf_parts_attention` computes the same mixer densely (T × T weights, one triangular
solve), with ``estimate`` choosing which of the two kernels is the random-feature estimate and which
is exact:

* ``"both"``: Cubit-RF (equal to ``cubit_rf_attention_naive``);
* ``"gram"``: the Gram estimated, the read-out Cubit's exact causal softmax;
* ``"readout"``: Cubit's exact Gram, the read-out estimated;
* ``"none"``: exact Cubit (equal to ``cubit_attention_naive``), the control.

``readout="reference"`` reads the solve's own regression instead: the weights of row i are those of the
Gram's kernel at the query, softmax_j(q_iᵀ r̂_j) (estimated: φ(q_i d^¼)·φ(r̂_j d^¼)), so that o_i is the
kernel ridge regression's prediction at q_i, Σ_j g(q_i, r̂_j) u_j — in the linear-time form a read of the
solve's state R with the query's features, one state instead of two (k is then unused).
``readout="linear"`` weighs U by the plain causal products q_iᵀ k_j / √d, no exponential and no
normalisation (linear attention over U, a d × d_v state): there is no kernel to estimate, so ``estimate``
is "gram" or "none" with it.

Each weight matrix is a causal softmax over its logits: exact, ℓ_ij = x_iᵀ y_j (Cubit's Gram:
r_iᵀ r̂_j; the read-out: q_iᵀ k_j / √d; with DARKFormer's M, of M x and M y); estimated,
ℓ_ij = log Σ_m φ(x_i)_m φ(y_j)_m, a log-sum-exp over the features, so that a row normalised by its
own sum is computed without overflow. Memory is O(T²·m): this is a training and diagnostic path
for short sequences (MQAR at T = 64), not the linear-time op, and it has no decode step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import KernelmixError
from ._common import autocast_off, check_doc_start, compute_dtype, expand_heads, per_head, zero_nonfinite
from .cubit import REFERENCE_NORM_EPS
from .cubit_rf import check_cubit_rf_inputs
from .random_features import feature_logits

ESTIMATES = ("both", "gram", "readout", "none")
READOUTS = ("keys", "reference", "linear")


def _visible(batch_doc_start: Tensor | None, length: int, device: torch.device) -> Tensor:
    """j ≤ i in i's document: ``[1, 1, T, T]`` or ``[B, 1, T, T]``."""
    visible = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if batch_doc_start is not None:
        visible = visible & (torch.arange(length, device=device)[None, None, :] >= batch_doc_start[:, :, None])[:, None]
    return visible


def _logits(left: Tensor, right: Tensor, projection: Tensor, transform: Tensor | None, *, estimated: bool,
            scale: float) -> Tensor:
    """ℓ_ij ``[B, H, T, T]`` for ``left``, ``right`` ``[B, T, H, d]``: the exact scaled dot products, or the
    log of the random-feature estimate of exp(scale · left_iᵀ right_j) (the estimate's x̃ = d^{-1/4} x
    meets x = scale^{1/2} d^{1/4} · left)."""
    d = left.shape[-1]
    if not estimated:
        if transform is not None:
            left, right = (torch.einsum("hed,bthd->bthe", transform, x) for x in (left, right))
        return scale * torch.einsum("bihd,bjhd->bhij", left, right)
    root = (scale * d**0.5) ** 0.5
    a = feature_logits(left * root, projection, transform)  # the constants −½ log m cancel in the row's softmax
    b = feature_logits(right * root, projection, transform)
    return torch.logsumexp(a.transpose(1, 2)[:, :, :, None, :] + b.transpose(1, 2)[:, :, None, :, :], dim=-1)


def _weights(logits: Tensor, visible: Tensor) -> Tensor:
    return logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)


def cubit_rf_parts_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
    projection: Tensor,
    *,
    estimate: str = "both",
    readout: str = "keys",
    rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6,
    ref_scale: float | Tensor = 1.0,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> Tensor:
    """Cubit-RF computed densely with the parts ``estimate`` names estimated and the others exact.

    Args:
        q, r: ``[B, T, H, d]``; k, v: ``[B, T, H_kv, d]`` (grouped heads expanded).
        projection: W ``[m, d]`` or ``[H, m, d]``; transform: M ``[H, d, d]`` or None (both parts).
        estimate: one of :data:`ESTIMATES` (the module docstring).
        readout: ``"keys"`` (Cubit's read-out, softmax(q kᵀ/√d) over U), ``"reference"`` (the
            regression's prediction at q, softmax(q r̂ᵀ) over U) or ``"linear"`` (q kᵀ/√d over U, causal).
        rho, ridge, ref_scale, doc_start: as :func:`~kernelmix.ops.cubit_rf.cubit_rf_attention`.

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, differentiable in every input; computed in float32 (float64
        for float64 inputs) with autocast off. Rows that see a non-finite k, v, r or ρ are NaN.
    """
    if estimate not in ESTIMATES:
        raise KernelmixError(f"estimate must be one of {', '.join(ESTIMATES)}, got {estimate!r}")
    if readout not in READOUTS:
        raise KernelmixError(f"readout must be one of {', '.join(READOUTS)}, got {readout!r}")
    if readout == "linear" and estimate in ("both", "readout"):
        raise KernelmixError("readout='linear' has no kernel to estimate; "
                             f"use estimate='gram' or 'none', got {estimate!r}")
    check_cubit_rf_inputs(q, k, v, r, projection, rho, transform)
    out_dtype = v.dtype
    batch, length, heads, d = q.shape
    check_doc_start(doc_start, batch, length)
    guard, (k, v, r, rho) = zero_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads)
    with autocast_off(q):
        dtype = compute_dtype(q, k, v, r, projection)
        q, k, v, r = (x.to(dtype) for x in (q, expand_heads(k, heads), expand_heads(v, heads), r))
        w, m = projection.to(dtype), None if transform is None else transform.to(dtype)
        lam = per_head("ridge", ridge, heads, r, positive=True)
        s = per_head("ref_scale", ref_scale, heads, r, positive=True)
        r_hat = s[:, None] * r / r.norm(dim=-1, keepdim=True).clamp_min(REFERENCE_NORM_EPS)
        visible = _visible(doc_start, length, q.device)
        gram = _weights(_logits(r, r_hat, w, m, estimated=estimate in ("both", "gram"), scale=1.0), visible)
        values = v if rho is None else rho.to(dtype)[..., None] * v
        system = gram + lam[:, None, None] * torch.eye(length, dtype=dtype, device=q.device)
        u = torch.linalg.solve_triangular(system, values.transpose(1, 2), upper=False)  # [B, H, T, d_v]
        if readout == "linear":
            weights = (d**-0.5 * torch.einsum("bihd,bjhd->bhij", q, k)).masked_fill(~visible, 0.0)
        else:
            keys, scale = (k, d**-0.5) if readout == "keys" else (r_hat, 1.0)
            weights = _weights(_logits(q, keys, w, m, estimated=estimate in ("both", "readout"), scale=scale), visible)
        out = (weights @ u).transpose(1, 2)
    return guard.poison_visible(out, visible).to(out_dtype)


__all__ = ["ESTIMATES", "READOUTS", "cubit_rf_parts_attention"]
