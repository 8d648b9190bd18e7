"""Cubit: attention as kernel ridge regression (docs/math.md §3).

    r̂_j = s_h · r_j / max(‖r_j‖, 1e-6)
    G_ij = softmax_{j≤i}(r_i · r̂_j)                    (causal, row-normalised, diagonal included)
    U    = (G + λ_h I)^{-1} (ρ ⊙ V)                    (forward substitution)
    O    = causal softmax(q kᵀ · scale) U              (ordinary attention with v := U)

``cubit_attention`` solves blockwise with a custom backward (O(T·C) memory, see ``_triangular``;
``solver`` picks its implementation);
``cubit_attention_naive`` is the dense ``solve_triangular`` reference; ``cubit_attention_step``
decodes one token from a (k, u, r̂) cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
from torch import Tensor

from ..errors import KernelmixError
from ._common import (
    NonFinite, append_rows, autocast_off, cached_nonfinite, check_4d, check_chunk_size, check_doc_start,
    check_per_token_heads, check_per_token_range, check_qkv, check_state, compute_dtype, decode_logits,
    expand_heads, find_nonfinite, per_head, readout_values, softmax_scale, step_nonfinite, zero_nonfinite,
)
from ._triangular import kernel_triangular_solve
from .softmax import causal_softmax_attention, softmax_attention_naive

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Unpack

REFERENCE_NORM_EPS = 1e-6


@dataclass
class CubitState:
    """Decode cache: read-out keys ``k`` ``[B, t, H_kv, d]``, solved values ``u`` ``[B, t, H, d_v]``
    and normalised references ``r_hat`` ``[B, t, H, d_r]`` (u and r̂ in the compute dtype).
    Cached u never change: token t only appends. A u that sees a non-finite input is cached as 0
    and ``nonfinite`` ``[B, t, H]`` flags those tokens (None: none does; see ``_common``, non-finite
    inputs in decode steps)."""

    k: Tensor
    u: Tensor
    r_hat: Tensor
    nonfinite: Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[1]


def _check_cubit_inputs(q, k, v, r, rho) -> None:
    check_qkv(q, k, v, same_dtype=True)
    check_4d("r", r)
    if tuple(r.shape[:3]) != tuple(q.shape[:3]):
        raise KernelmixError(
            f"r must have shape [B, T, H, d_r] with the query's B, T and H = {tuple(q.shape[:3])}, "
            f"got {tuple(r.shape)}"
        )
    check_per_token_heads("rho", rho, q)
    check_rho(rho)


RHO_FIX = ("map it into a positive range, e.g. rho = lo + (hi - lo) * torch.sigmoid(x) with 0 < lo < hi (the "
           "Cubit layer's LRR), or pass rho=None for rho = 1")


def check_rho(rho: Tensor | None) -> None:
    """ρ ∈ (0, ∞) per token and head (docs/math.md §3): ρ = 0 zeroes the values, ρ < 0 flips them."""
    check_per_token_range("rho", rho, upper=None, zero=False, fix=RHO_FIX)


def reference_factor(r: Tensor, ref_scale: Tensor) -> Tensor:
    """s_h / max(‖r‖₂, 1e-6), ``[B, T, H]``, for ``r`` ``[B, T, H, d]`` and ``ref_scale`` ``[H]``: r̂ = r ⊙ factor."""
    return ref_scale / r.norm(dim=-1).clamp_min(REFERENCE_NORM_EPS)


def normalize_reference(r: Tensor, ref_scale: Tensor) -> Tensor:
    """r̂ = s_h · r / max(‖r‖₂, 1e-6) for ``r`` ``[B, T, H, d]`` and ``ref_scale`` ``[H]``."""
    return r * reference_factor(r, ref_scale)[..., None]


def cubit_solve(
    r: Tensor,
    v: Tensor,
    *,
    rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6,
    ref_scale: float | Tensor = 1.0,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    solver: str = "auto",
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The kernel-ridge step alone: returns ``(U, r̂)``, both ``[B, T, H, *]`` in the compute dtype.

    ``v`` may have fewer heads than ``r`` (grouped values are shared across query heads).
    ``solver`` and ``backend`` as in :func:`cubit_attention`. A NaN or ±inf in r, v or ρ at token t makes the rows
    ≥ t of U in its document NaN (and r̂_t, for a non-finite r_t); the other rows are unaffected.
    """
    check_4d("r", r)
    check_4d("v", v)
    check_per_token_heads("rho", rho, r)
    check_rho(rho)
    guard = find_nonfinite({"v": v, "r": r, "rho": rho}, r.shape[2])
    u, r_hat = _cubit_solve(
        r if guard is None else guard.zeroed("r", r), v if guard is None else guard.zeroed("v", v),
        rho=rho if guard is None else guard.zeroed("rho", rho), ridge=ridge, ref_scale=ref_scale,
        chunk_size=chunk_size, doc_start=doc_start, solver=solver, backend=backend, want_r_hat=True,
    )
    return _poisoned_solution(guard, u, r_hat, doc_start)


def _poisoned_solution(guard: NonFinite | None, u: Tensor, r_hat: Tensor | None,
                       doc_start) -> tuple[Tensor, Tensor | None]:
    """U (and r̂) of a solve on zeroed inputs, with NaN back where the inputs had it: the rows of U
    that see a non-finite token, and r̂ of a non-finite reference."""
    if guard is None:
        return u, r_hat
    u = guard.poison_causal(u, doc_start)
    if r_hat is not None and "r" in guard.masks:
        r_hat = r_hat.masked_fill(guard.masks["r"][..., None], float("nan"))
    return u, r_hat


def _cubit_solve(
    r, v, *, rho, ridge, ref_scale, chunk_size, doc_start, solver, backend, want_r_hat
) -> tuple[Tensor, Tensor | None]:
    check_4d("r", r)
    check_4d("v", v)
    if r.shape[:2] != v.shape[:2] or r.shape[2] % v.shape[2]:
        raise KernelmixError(
            f"r {tuple(r.shape)} and v {tuple(v.shape)} must share B and T, and r's head count must be a "
            "multiple of v's"
        )
    check_per_token_heads("rho", rho, r)
    check_chunk_size(chunk_size)
    check_doc_start(doc_start, r.shape[0], r.shape[1])
    dtype = compute_dtype(r, v)
    heads = r.shape[2]
    r = r.to(dtype)
    lam = per_head("ridge", ridge, heads, r, positive=True)
    s = per_head("ref_scale", ref_scale, heads, r, positive=True)
    # r̂ = r ⊙ factor and ρ ⊙ v are applied inside the solve, one head group at a time: neither
    # full-size product is materialised (nor kept for the backward pass)
    factor = reference_factor(r, s)  # [B, T, H]
    u = kernel_triangular_solve(
        r.transpose(1, 2),
        None,  # y = r ⊙ factor = r̂
        expand_heads(v, heads).to(dtype).transpose(1, 2),
        beta=None,
        gamma=lam,
        scale=1.0,
        strict=False,
        chunk_size=chunk_size,
        doc_start=doc_start,
        diagonal_is_row_max=True,  # r_i·r̂_j ≤ s‖r_i‖ = r_i·r̂_i (Cauchy–Schwarz)
        y_scale=factor.transpose(1, 2),
        b_scale=None if rho is None else rho.to(dtype).transpose(1, 2),
        solver=solver,
        backend=backend,
    ).transpose(1, 2)
    return u, (r * factor[..., None] if want_r_hat else None)


class CubitOptions(TypedDict, total=False):
    """The keywords of :func:`cubit_attention` besides ``return_state`` (its overloads' ``**options``)."""

    rho: Tensor | None
    ridge: float | Tensor
    ref_scale: float | Tensor
    scale: float | None
    chunk_size: int
    doc_start: Tensor | None
    solver: str
    backend: str


@overload
def cubit_attention(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[CubitOptions],
) -> Tensor: ...


@overload
def cubit_attention(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, *, return_state: Literal[True],
    **options: Unpack[CubitOptions],
) -> tuple[Tensor, CubitState]: ...


def cubit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
    *,
    rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6,
    ref_scale: float | Tensor = 1.0,
    scale: float | None = None,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    return_state: bool = False,
    solver: str = "auto",
    backend: str = "auto",
) -> Tensor | tuple[Tensor, CubitState]:
    """Cubit attention, fast path: U = (G + λI)⁻¹ (ρ ⊙ V), then causal softmax attention over U.

    Args:
        q, r: ``[B, T, H, d]``, the read-out's queries and the Gram's references.
        k, v: ``[B, T, H_kv, d]`` (``H % H_kv == 0``; grouped heads are expanded).
        rho: ``[B, T, H]``, the LRR factor, already in (lo, hi) (any value in (0, ∞); else a
            KernelmixError on the CPU), or None for ρ ≡ 1.
        ridge, ref_scale: λ and s, floats or ``[H]`` tensors (> 0); they receive gradients.
        scale: the read-out attention's scale (default 1/√d).
        chunk_size: rows per block of the solve.
        doc_start: ``[B, T]`` or None; keeps packed documents / left padding apart in both the solve
            and the read-out.
        return_state: also return the decode state.
        solver: "auto" (default: the fused-attention "rectangles" on CPU where they apply, the blocked
            solve elsewhere), "blocked" or "rectangles" (CPU and d_r == d_v only; a RuntimeError
            elsewhere). Both give the same result up to rounding.
        backend: "auto" (default: the Triton solve for CUDA tensors when triton imports, the PyTorch
            solves elsewhere), "torch", or "triton" (CUDA; CPU only under ``TRITON_INTERPRET=1``); the
            read-out is PyTorch's fused attention either way.

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, or ``(out, CubitState)`` with ``return_state``. A NaN or ±inf in
        k, v, r or ρ at token t makes rows ≥ t of its document NaN (U is causal); every other row is
        what the clean input gives."""
    _check_cubit_inputs(q, k, v, r, rho)
    heads = q.shape[2]
    guard = find_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads)
    keys = k if guard is None else guard.zeroed("k", k)
    u, r_hat = _cubit_solve(
        r if guard is None else guard.zeroed("r", r), v if guard is None else guard.zeroed("v", v),
        rho=rho if guard is None else guard.zeroed("rho", rho), ridge=ridge, ref_scale=ref_scale,
        chunk_size=chunk_size, doc_start=doc_start, solver=solver, backend=backend, want_r_hat=return_state,
    )
    out = causal_softmax_attention(q, expand_heads(keys, heads), readout_values(q, u), scale=scale, doc_start=doc_start)
    out = out.to(v.dtype)
    nonfinite = cached_nonfinite(guard, doc_start)
    if guard is not None:
        out = out.masked_fill(nonfinite[..., None], float("nan"))
        if return_state:  # the state caches the rows that see a non-finite input as 0, flagged
            u = u.masked_fill(nonfinite[..., None], 0.0)
            if "r" in guard.masks:  # r̂ of a non-finite reference is NaN (its logits are selected away)
                r_hat = r_hat.masked_fill(guard.masks["r"][..., None], float("nan"))
    if return_state:
        return out, CubitState(k=k, u=u, r_hat=r_hat, nonfinite=nonfinite)
    return out


def cubit_attention_naive(  # the fast path's parameters (same meanings), less chunking, backend and state
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, *, rho: Tensor | None = None, ridge: float | Tensor = 1e-6,
    ref_scale: float | Tensor = 1.0, scale: float | None = None, doc_start: Tensor | None = None,
) -> Tensor:
    """Dense reference: the full T×T Gram matrix and one ``solve_triangular`` (float64-friendly).

    Args:
        q, k, v, r, rho, ridge, ref_scale, scale, doc_start: as :func:`cubit_attention` (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype. Non-finite k, v, r
        or ρ are zeroed and every row that sees one is NaN (as the fast path)."""
    _check_cubit_inputs(q, k, v, r, rho)
    heads, length = q.shape[2], q.shape[1]
    check_doc_start(doc_start, q.shape[0], length)
    guard, (k, v, r, rho) = zero_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads)
    dtype = compute_dtype(q, k, v, r)
    lam = per_head("ridge", ridge, heads, r.to(dtype), positive=True)
    s = per_head("ref_scale", ref_scale, heads, r.to(dtype), positive=True)
    rr = r.to(dtype).transpose(1, 2)  # [B, H, T, d]
    r_hat = s[:, None, None] * rr / rr.norm(dim=-1, keepdim=True).clamp_min(REFERENCE_NORM_EPS)
    visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:  # [B, 1, T, T]: also j ≥ doc_start[i]
        visible = visible & (torch.arange(length, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]
    gram = (rr @ r_hat.transpose(-1, -2)).masked_fill(~visible, float("-inf")).softmax(dim=-1)
    system = gram + lam[:, None, None] * torch.eye(length, dtype=dtype, device=q.device)
    values = expand_heads(v, heads).to(dtype)
    if rho is not None:
        values = rho.to(dtype)[..., None] * values
    u = torch.linalg.solve_triangular(system, values.transpose(1, 2), upper=False).transpose(1, 2)
    out = softmax_attention_naive(q.to(dtype), expand_heads(k, heads).to(dtype), u, scale=scale, doc_start=doc_start)
    return guard.poison_visible(out, visible).to(v.dtype)


def cubit_attention_step(  # one token of the fast path's inputs (same meanings) and the decode state
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, state: CubitState | None, *, rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6, ref_scale: float | Tensor = 1.0, scale: float | None = None,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, CubitState]:
    """Decode one token: append (k, u, r̂) to the cache and read out.

    u_t = (ρ_t v_t − Σ_{j<t} G_tj u_j) / (G_tt + λ), the last row of the forward substitution.

    Args:
        q, r: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        state: the :class:`CubitState` of the tokens before.
        rho, ridge, ref_scale, scale: as :func:`cubit_attention` (``rho`` ``[B, 1, H]``).
        doc_start: ``[B, 1]`` or None; only cached tokens of the same document are read.

    Returns:
        ``(out [B, 1, H, d_v], state)``. A non-finite k, v, r or ρ makes the rows that see it NaN, in its
        document only (as :func:`cubit_attention`)."""
    _check_cubit_inputs(q, k, v, r, rho)
    if q.shape[1] != 1:
        raise KernelmixError(f"a decode step takes one token (T=1), got T={q.shape[1]}; "
                             "use cubit_attention for prefill")
    heads = q.shape[2]
    if state is not None:
        batch = q.shape[0]
        check_state(
            "cubit_attention_step", state, CubitState,
            {"k": ((batch, None, *k.shape[2:]), "[B, t, H_kv, d]"),
             "u": ((batch, None, heads, v.shape[3]), "[B, t, H, d_v]"),
             "r_hat": ((batch, None, heads, r.shape[3]), "[B, t, H, d_r]"),
             "nonfinite": ((batch, None, heads), "[B, t, H]")},
            same_length=("k", "u", "r_hat", "nonfinite"), optional=("nonfinite",),
        )
    position = 0 if state is None else state.length
    check_doc_start(doc_start, q.shape[0], 1, offset=position)
    # cached tokens of earlier documents (or left padding) are invisible: −inf logits
    hidden = (None if doc_start is None
              else torch.arange(position + 1, device=q.device)[None, None, :] < doc_start[:, :, None])
    # hidden logits are selected away (−inf), but u is multiplied: a flagged u is cached as 0
    flag, nonfinite = step_nonfinite(find_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads),
                                     None if state is None else state.nonfinite, hidden, position)
    # the Gram row, the substitution and the cached u stay fp32 under bf16 autocast (the policy, _common)
    with autocast_off(q):
        dtype = compute_dtype(q, k, v, r) if state is None else state.u.dtype
        r_t = r.to(dtype)
        lam = per_head("ridge", ridge, heads, r_t, positive=True)
        s = per_head("ref_scale", ref_scale, heads, r_t, positive=True)
        r_hat_t = normalize_reference(r_t, s)
        r_hat = append_rows(None if state is None else state.r_hat, r_hat_t)
        gram_logits = torch.einsum("bhd,bjhd->bhj", r_t[:, 0], r_hat)  # [B, H, t+1]
        if hidden is not None:
            gram_logits = gram_logits.masked_fill(hidden, float("-inf"))
        gram_row = gram_logits.softmax(dim=-1)
        b_t = expand_heads(v, heads).to(dtype)[:, 0]  # [B, H, d_v]
        if rho is not None:
            b_t = rho.to(dtype)[:, 0, :, None] * b_t
        if state is not None:
            b_t = b_t - torch.einsum("bhj,bjhd->bhd", gram_row[..., :-1], state.u)
        u_t = (b_t / (gram_row[..., -1:] + lam[:, None]))[:, None]
        if flag is not None:
            u_t = u_t.masked_fill(flag[..., None], 0.0)
        u = append_rows(None if state is None else state.u, u_t)
        k_all = append_rows(None if state is None else state.k, k)
        weights = decode_logits(q[:, 0], k_all, dtype) * softmax_scale(q, scale)
        if hidden is not None:
            weights = weights.masked_fill(hidden, float("-inf"))
        weights = weights.softmax(dim=-1)
        out = torch.einsum("bhj,bjhd->bhd", weights, u)[:, None].to(v.dtype)
        if flag is not None:
            out = out.masked_fill(flag[..., None], float("nan"))
        return out, CubitState(k=k_all, u=u, r_hat=r_hat, nonfinite=nonfinite)
