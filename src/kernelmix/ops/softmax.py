"""Causal softmax attention (docs/math.md §2): the Nadaraya–Watson baseline.

Fast path: ``F.scaled_dot_product_attention``. Reference: a dense masked softmax.
Decode: a KV cache (:class:`SoftmaxState`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import KernelmixError
from ._common import (
    append_rows,
    autocast_off,
    bf16_attention_in_fp32,
    cached_nonfinite,
    check_doc_start,
    check_qkv,
    check_mask,
    check_state,
    compute_dtype,
    expand_heads,
    find_nonfinite,
    masked_softmax,
    query_rows_per_kv_head,
    softmax_scale,
    step_nonfinite,
    visible,
)

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Unpack


@dataclass
class SoftmaxState:
    """KV cache: keys and values of every token seen so far, ``[B, t, H_kv, d]``. A non-finite key
    or value is cached as 0 and ``nonfinite`` ``[B, t, H]`` flags the tokens whose rows see one
    (None: none does; see ``_common``, non-finite inputs in decode steps)."""

    k: Tensor
    v: Tensor
    nonfinite: Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[1]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """``F.scaled_dot_product_attention`` on ``[B, H, T, d]`` tensors, under the CPU bf16 policy
    (``_common``, policy 2): fp32 products and a bf16 result where ``bf16_attention_in_fp32`` says
    so (mixed input dtypes are then allowed: Cubit / DeltaFormer pass their fp32 U)."""
    if not bf16_attention_in_fp32(q):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with autocast_off(q):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    return out.to(torch.bfloat16)


class SoftmaxOptions(TypedDict, total=False):
    """The keywords of :func:`softmax_attention` besides ``return_state`` (its overloads' ``**options``)."""

    scale: float | None
    doc_start: Tensor | None


@overload
def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[SoftmaxOptions],
) -> Tensor: ...


@overload
def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_state: Literal[True],
    **options: Unpack[SoftmaxOptions],
) -> tuple[Tensor, SoftmaxState]: ...


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    doc_start: Tensor | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, SoftmaxState]:
    """Causal softmax attention o_i = Σ_{j≤i} softmax_j(q_i·k_j·scale) v_j via SDPA.

    Args:
        q: ``[B, T, H, d]``.
        k, v: ``[B, T, H_kv, d]`` with ``H % H_kv == 0``.
        scale: the logits' scale (default 1/√d).
        doc_start: ``[B, T]`` or None: index of the first token of each token's document; no token
            reads across a document boundary (packed sequences, left padding).
        return_state: also return the decode state.

    Returns:
        ``o`` shaped like ``q`` with ``v``'s head dim, or ``(o, SoftmaxState)`` with ``return_state``.
        bf16 on a CPU without native bf16 products runs in fp32 (see ``bf16_attention_in_fp32``) and
        returns bf16. A NaN or ±inf in k or v at token t makes rows ≥ t of its document NaN and leaves
        every other row as it is (see ``_common``, non-finite inputs)."""
    check_qkv(q, k, v, same_dtype=True)
    check_doc_start(doc_start, q.shape[0], q.shape[1])
    guard = find_nonfinite({"k": k, "v": v}, q.shape[2])
    if guard is not None:
        k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    out = causal_softmax_attention(q, k, v, scale=scale, doc_start=doc_start)
    nonfinite = cached_nonfinite(guard, doc_start)  # the rows that see a non-finite key or value
    if guard is not None:
        out = out.masked_fill(nonfinite[..., None], float("nan"))
    if return_state:
        return out, SoftmaxState(k=k, v=v, nonfinite=nonfinite)
    return out


def causal_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, doc_start: Tensor | None = None
) -> Tensor:
    """:func:`softmax_attention`'s SDPA call alone, on checked inputs and without the non-finite
    guard: for the ops that guard their own inputs (Cubit's and DeltaFormer's read-out of U)."""
    length, heads = q.shape[1], q.shape[2]
    if doc_start is None:
        mask_kwargs = {"is_causal": True}
    else:
        idx = torch.arange(length, device=q.device)
        mask_kwargs = {"attn_mask": visible(idx, idx, doc_start)}
    return _sdpa(
        q.transpose(1, 2),
        expand_heads(k, heads).transpose(1, 2),
        expand_heads(v, heads).transpose(1, 2),
        scale=softmax_scale(q, scale),
        **mask_kwargs,
    ).transpose(1, 2)


def softmax_attention_naive(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, doc_start: Tensor | None = None
) -> Tensor:
    """Dense reference: explicit T×T scores, causal (+ document) mask, softmax (float64-friendly).

    Args:
        q, k, v, scale, doc_start: as :func:`softmax_attention` (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype."""
    check_qkv(q, k, v, same_dtype=True)
    h, t = q.shape[2], q.shape[1]
    check_doc_start(doc_start, q.shape[0], t)
    guard = find_nonfinite({"k": k, "v": v}, h, always=True)
    k, v = expand_heads(guard.zeroed("k", k), h), expand_heads(guard.zeroed("v", v), h)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * softmax_scale(q, scale)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:
        mask = mask & (torch.arange(t, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    # non-finite keys/values were zeroed: the rows that see one are NaN, the others exact
    return guard.poison_visible(torch.einsum("bhij,bjhd->bihd", weights, v), mask)


def softmax_attention_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax attention under an arbitrary mask, densely: the exact counterpart of
    :func:`~kernelmix.ops.random_features.random_feature_attention_masked` (weights ∝ exp(q·k/√d)
    over the visible keys, the kernel the random features estimate; hence no ``scale``).

    ``q`` ``[B, T, H, d]``; ``k``, ``v`` ``[B, L, H_kv, d]``; ``mask`` bool ``[B, T, L]`` (True where query
    t reads key l; a batch of 1 broadcasts). Returns ``(out [B, T, H, d_v], weights [B, H, T, L])``,
    both computed in float32 (float64 for float64 queries); ``out`` is cast to v's dtype. A row
    with no visible key gives 0; a row that shows a non-finite key or value gives NaN (rows that
    do not show it are unaffected). Runs with autocast off (the precision policy, ``_common``)."""
    check_qkv(q, k, v, same_length=False, same_dtype=True)
    check_mask(mask, q, k)
    heads, d = q.shape[2], q.shape[3]
    guard = find_nonfinite({"k": k, "v": v}, heads)
    out_dtype = v.dtype
    if guard is not None:
        k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    with autocast_off(q):
        dtype = compute_dtype(q)
        logits = torch.einsum("bthd,blhd->bhtl", q.to(dtype), expand_heads(k, heads).to(dtype)) / math.sqrt(d)
        weights = masked_softmax(logits, ~mask[:, None])
        out = torch.einsum("bhtl,blhd->bthd", weights, expand_heads(v, heads).to(dtype))
    if guard is not None:
        out = guard.poison_visible(out, mask[:, None])
    return out.to(out_dtype), weights


def softmax_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: SoftmaxState | None,
    *,
    scale: float | None = None,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, SoftmaxState]:
    """One decode token: attends to the cache and to itself.

    Args:
        q: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        state: the :class:`SoftmaxState` of the tokens before (from ``softmax_attention(...,
            return_state=True)`` or an earlier step).
        scale: the logits' scale (default 1/√d).
        doc_start: ``[B, 1]`` or None; only cached tokens at indices ≥ it are read.

    Returns:
        ``(out [B, 1, H, d_v], state)``, the state holding this token too. A non-finite key or value
        makes the rows that see it NaN, in its document only (as :func:`softmax_attention`)."""
    check_qkv(q, k, v, same_dtype=True)
    if q.shape[1] != 1:
        raise KernelmixError(f"a decode step takes one token (T=1), got T={q.shape[1]}; "
                             "use softmax_attention for prefill")
    if state is not None:
        check_state(
            "softmax_attention_step", state, SoftmaxState,
            {"k": ((k.shape[0], None, *k.shape[2:]), "[B, t, H_kv, d]"),
             "v": ((v.shape[0], None, *v.shape[2:]), "[B, t, H_kv, d_v]"),
             "nonfinite": ((v.shape[0], None, q.shape[2]), "[B, t, H]")},
            same_length=("k", "v", "nonfinite"), optional=("nonfinite",),
        )
    position = 0 if state is None else state.length
    check_doc_start(doc_start, q.shape[0], 1, offset=position)
    batch, _, heads, _ = q.shape
    mask = None
    if doc_start is not None:
        idx = torch.arange(position + 1, device=q.device)
        mask = visible(idx[-1:], idx, doc_start)  # [B, 1, 1, t]: the same for every head and query row
    guard = find_nonfinite({"k": k, "v": v}, heads)
    flag, nonfinite = step_nonfinite(guard, None if state is None else state.nonfinite,
                                     None if mask is None else ~mask[:, 0], position)
    if guard is not None:  # cached as 0: a hidden row's weight 0 must not meet a NaN
        k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    if state is not None:
        k = append_rows(state.k, k)  # amortised O(1) per token, not cat's O(t) copy
        v = append_rows(state.v, v)
    # one SDPA call over the cache as it is: a kv head's G query heads are its G query rows
    out = _sdpa(
        query_rows_per_kv_head(q[:, 0], k.shape[2]),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=softmax_scale(q, scale),
    ).reshape(batch, 1, heads, v.shape[-1])  # [B, H_kv, G, d_v] → [B, 1, H, d_v]
    if flag is not None:
        out = out.masked_fill(flag[..., None], float("nan"))
    return out, SoftmaxState(k=k, v=v, nonfinite=nonfinite)


__all__ = [
    "SoftmaxState",
    "causal_softmax_attention",
    "softmax_attention",
    "softmax_attention_masked",
    "softmax_attention_naive",
    "softmax_attention_step",
]
