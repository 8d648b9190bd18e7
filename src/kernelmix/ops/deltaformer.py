"""DeltaFormer (docs/math.md §4), a baseline.

    u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(w_i·k_j · scale) u_j      (u_0 = v_0)
    o   = causal softmax(q kᵀ · scale) U

i.e. (I + diag(β) P) U = V with P the strictly-causal softmax of w kᵀ. ``w`` defaults to ``k``
(the K–K form). The fast path is the solve of ``_triangular`` (O(T·C) memory, custom backward;
``solver`` picks its implementation); ``deltaformer_attention_naive`` is the per-token loop of the definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
from torch import Tensor

from ..errors import KernelmixError
from ._common import (
    append_rows, autocast_off, cached_nonfinite, check_4d, check_chunk_size, check_doc_start, check_per_token_heads,
    check_per_token_range, check_qkv, check_state, compute_dtype, decode_logits, expand_heads, find_nonfinite,
    masked_softmax, readout_values, softmax_scale, step_nonfinite, zero_nonfinite,
)
from ._triangular import kernel_triangular_solve
from .softmax import causal_softmax_attention, softmax_attention_naive

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Unpack


@dataclass
class DeltaFormerState:
    """Decode cache: keys ``k`` ``[B, t, H_kv, d]`` (read-out and solve keys) and solved values
    ``u`` ``[B, t, H, d_v]`` in the compute dtype. A u that sees a non-finite input is cached as 0
    and ``nonfinite`` ``[B, t, H]`` flags those tokens (None: none does; see ``_common``, non-finite
    inputs in decode steps)."""

    k: Tensor
    u: Tensor
    nonfinite: Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[1]


BETA_FIX = ("gate it into [0, 1], e.g. beta = torch.sigmoid(x) (the DeltaFormer layer's gate), or pass beta=None "
            "for beta = 1")


def _check_inputs(q, k, v, beta, w) -> None:
    check_qkv(q, k, v, same_dtype=True)
    check_per_token_heads("beta", beta, q)
    # β ∈ (0, 1) by the math (docs/math.md §4), but the layer's sigmoid gives exactly 1 (logits above
    # ~17) and exactly 0 (below ~-88, or a -inf hidden state) in float32: both are well-defined (β = 0
    # turns the delta rule off for the token, u = v). β < 0 turns it around, β > 1 over-subtracts.
    check_per_token_range("beta", beta, upper=1.0, zero=True, fix=BETA_FIX)
    if w is not None:
        check_4d("w", w)
        heads = q.shape[2]
        if w.shape[0] != q.shape[0] or w.shape[1] != q.shape[1] or w.shape[3] != q.shape[3] or heads % w.shape[2]:
            raise KernelmixError(
                f"w must have shape [B, T, H_w, d] with q's B, T, d and H divisible by H_w; "
                f"q is {tuple(q.shape)}, w is {tuple(w.shape)}"
            )


class DeltaFormerOptions(TypedDict, total=False):
    """The keywords of :func:`deltaformer_attention` besides ``return_state`` (its overloads' ``**options``)."""

    beta: Tensor | None
    w: Tensor | None
    scale: float | None
    chunk_size: int
    doc_start: Tensor | None
    solver: str
    backend: str


@overload
def deltaformer_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[DeltaFormerOptions],
) -> Tensor: ...


@overload
def deltaformer_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_state: Literal[True],
    **options: Unpack[DeltaFormerOptions],
) -> tuple[Tensor, DeltaFormerState]: ...


def deltaformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None = None,
    w: Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    return_state: bool = False,
    solver: str = "auto",
    backend: str = "auto",
) -> Tensor | tuple[Tensor, DeltaFormerState]:
    """DeltaFormer, fast path: u_i = v_i − β_i Σ_{j<i} softmax_j(w_i·k_j·scale) u_j, then softmax attention over U.

    Args:
        q: ``[B, T, H, d]``.
        k, v: ``[B, T, H_kv, d]`` (``H % H_kv == 0``).
        beta: ``[B, T, H]`` in [0, 1] (None = ones; outside: a KernelmixError on the CPU).
        w: the solve's query side, like k (default ``k``).
        scale: used for both the solve's softmax and the read-out (default 1/√d).
        chunk_size: rows per block of the solve.
        doc_start: ``[B, T]`` or None; keeps packed documents / left padding apart (u restarts at v
            per document).
        return_state: also return the decode state.
        solver: "auto" (default: the fused-attention "rectangles" on CPU where they apply, the blocked
            solve elsewhere), "blocked" or "rectangles" (CPU and d == d_v only; a RuntimeError
            elsewhere). Both give the same result up to rounding.
        backend: "auto" (default: the Triton solve for CUDA tensors when triton imports, the PyTorch
            solves elsewhere), "torch", or "triton" (CUDA; CPU only under ``TRITON_INTERPRET=1``).

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, or ``(out, DeltaFormerState)`` with ``return_state``. A NaN or
        ±inf in k, v, β or w at token t makes rows ≥ t of its document NaN; every other row is what the
        clean input gives."""
    _check_inputs(q, k, v, beta, w)
    check_chunk_size(chunk_size)
    check_doc_start(doc_start, q.shape[0], q.shape[1])
    heads = q.shape[2]
    dtype = compute_dtype(q, k, v, k if w is None else w)
    guard = find_nonfinite({"k": k, "v": v, "beta": beta, "w": w}, heads)
    k_in, v_in = k, v
    if guard is not None:
        k, v, beta, w = (guard.zeroed(name, x) for name, x in (("k", k), ("v", v), ("beta", beta), ("w", w)))
    keys = expand_heads(k, heads).to(dtype).transpose(1, 2)
    u = kernel_triangular_solve(
        keys if w is None else expand_heads(w, heads).to(dtype).transpose(1, 2),
        None if w is None else keys,  # K–K form: y = x = k, and one gradient buffer
        expand_heads(v, heads).to(dtype).transpose(1, 2),
        beta=None if beta is None else beta.to(dtype).transpose(1, 2),
        gamma=torch.ones(heads, dtype=dtype, device=q.device),
        scale=softmax_scale(q, scale),
        strict=True,
        chunk_size=chunk_size,
        doc_start=doc_start,
        solver=solver,
        backend=backend,
    ).transpose(1, 2)
    out = causal_softmax_attention(q, expand_heads(k, heads), readout_values(q, u), scale=scale, doc_start=doc_start)
    out = out.to(v_in.dtype)
    nonfinite = cached_nonfinite(guard, doc_start)
    if guard is not None:  # the state caches the rows that see a non-finite input as 0, flagged
        out, u = out.masked_fill(nonfinite[..., None], float("nan")), u.masked_fill(nonfinite[..., None], 0.0)
    if return_state:
        return out, DeltaFormerState(k=k_in, u=u, nonfinite=nonfinite)
    return out


def deltaformer_attention_naive(  # the fast path's parameters (same meanings), less chunking, backend and state
    q: Tensor, k: Tensor, v: Tensor, *, beta: Tensor | None = None, w: Tensor | None = None,
    scale: float | None = None, doc_start: Tensor | None = None,
) -> Tensor:
    """Reference: the recurrence of the definition, one token at a time (float64-friendly).

    Args:
        q, k, v, beta, w, scale, doc_start: as :func:`deltaformer_attention` (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype. Non-finite k, v,
        β or w are zeroed and every row that sees one is NaN (as the fast path)."""
    _check_inputs(q, k, v, beta, w)
    heads, length = q.shape[2], q.shape[1]
    check_doc_start(doc_start, q.shape[0], length)
    guard, (k, v, beta, w) = zero_nonfinite({"k": k, "v": v, "beta": beta, "w": w}, heads)
    w = k if w is None else w
    dtype = compute_dtype(q, k, v, w)
    sc = softmax_scale(q, scale)
    kk = expand_heads(k, heads).to(dtype)
    ww = expand_heads(w, heads).to(dtype)
    vv = expand_heads(v, heads).to(dtype)
    us: list[Tensor] = []
    for i in range(length):
        if i == 0:
            us.append(vv[:, 0])
            continue
        past_u = torch.stack(us, dim=1)  # [B, i, H, d_v]
        logits = torch.einsum("bhd,bjhd->bhj", ww[:, i], kk[:, :i]) * sc
        if doc_start is None:
            weights = logits.softmax(dim=-1)
        else:  # earlier documents are invisible; a document's first row is empty
            hidden = torch.arange(i, device=q.device)[None, None, :] < doc_start[:, i, None, None]
            weights = masked_softmax(logits, hidden.expand_as(logits))
        mixed = torch.einsum("bhj,bjhd->bhd", weights, past_u)
        b_i = 1.0 if beta is None else beta[:, i].to(dtype)[..., None]
        us.append(vv[:, i] - b_i * mixed)
    u = torch.stack(us, dim=1) if us else vv
    out = softmax_attention_naive(q.to(dtype), kk, u, scale=scale, doc_start=doc_start)
    seen = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:
        seen = seen & (torch.arange(length, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]
    return guard.poison_visible(out, seen).to(v.dtype)


def deltaformer_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: DeltaFormerState | None,
    *,
    beta: Tensor | None = None,
    w: Tensor | None = None,
    scale: float | None = None,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, DeltaFormerState]:
    """Decode one token: u_t from the cached (k, u), append, read out over all t + 1 tokens.

    Args:
        q: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        state: the :class:`DeltaFormerState` of the tokens before.
        beta, w, scale: as :func:`deltaformer_attention` (``beta`` ``[B, 1, H]``).
        doc_start: ``[B, 1]`` or None; only cached tokens of the same document are read.

    Returns:
        ``(out [B, 1, H, d_v], state)``. A non-finite k, v, β or w makes the rows that see it NaN, in its
        document only (as :func:`deltaformer_attention`)."""
    _check_inputs(q, k, v, beta, w)
    if q.shape[1] != 1:
        raise KernelmixError(
            f"a decode step takes one token (T=1), got T={q.shape[1]}; use deltaformer_attention for prefill"
        )
    heads = q.shape[2]
    if state is not None:
        check_state(
            "deltaformer_attention_step", state, DeltaFormerState,
            {"k": ((q.shape[0], None, *k.shape[2:]), "[B, t, H_kv, d]"),
             "u": ((q.shape[0], None, heads, v.shape[3]), "[B, t, H, d_v]"),
             "nonfinite": ((q.shape[0], None, heads), "[B, t, H]")},
            same_length=("k", "u", "nonfinite"), optional=("nonfinite",),
        )
    position = 0 if state is None else state.length
    check_doc_start(doc_start, q.shape[0], 1, offset=position)
    # cached tokens of earlier documents (or left padding) are invisible
    hidden = (None if doc_start is None
              else torch.arange(position + 1, device=q.device)[None, None, :] < doc_start[:, :, None])
    # hidden logits are selected away (−inf), but u is multiplied: a flagged u is cached as 0
    flag, nonfinite = step_nonfinite(find_nonfinite({"k": k, "v": v, "beta": beta, "w": w}, heads),
                                     None if state is None else state.nonfinite, hidden, position)
    with autocast_off(q):  # the solve's row and the cached u stay fp32 under bf16 autocast (the policy, _common)
        dtype = compute_dtype(q, k, v, k if w is None else w) if state is None else state.u.dtype
        sc = softmax_scale(q, scale)
        u_t = expand_heads(v, heads).to(dtype)[:, 0]
        if state is not None:
            w_t = expand_heads(k if w is None else w, heads)[:, 0]
            logits = decode_logits(w_t, state.k, dtype) * sc
            # a document's first token has no visible past: its row is empty (0), not NaN
            weights = (logits.softmax(dim=-1) if hidden is None
                       else masked_softmax(logits, hidden[..., :-1].expand_as(logits)))
            b_t = 1.0 if beta is None else beta[:, 0].to(dtype)[..., None]
            u_t = u_t - b_t * torch.einsum("bhj,bjhd->bhd", weights, state.u)
        if flag is not None:
            u_t = u_t.masked_fill(flag[:, 0, :, None], 0.0)
        u = append_rows(None if state is None else state.u, u_t[:, None])
        k_all = append_rows(None if state is None else state.k, k)
        logits = decode_logits(q[:, 0], k_all, dtype) * sc
        if hidden is not None:
            logits = logits.masked_fill(hidden, float("-inf"))
        weights = logits.softmax(-1)
        out = torch.einsum("bhj,bjhd->bhd", weights, u)[:, None].to(v.dtype)
        if flag is not None:
            out = out.masked_fill(flag[..., None], float("nan"))
        return out, DeltaFormerState(k=k_all, u=u, nonfinite=nonfinite)
