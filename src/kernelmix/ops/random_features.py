"""Positive random features: Performer (FAVOR+) and DARKFormer (docs/math.md §6–7).

    x̃ = d^{-1/4} x,   φ(x) = m^{-1/2} exp(W (M x̃) − ½‖M x̃‖²) ∈ R^m_{>0}
    o_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j)

M is DARKFormer's per-head transform (Σ = MᵀM, E[φ(q)·φ(k)] = exp(qᵀΣk/√d)); M = None is
Performer (Σ = I).

Numerical stability without bias and without reading the future: the query side is divided by
its own max over features (a per-query constant, cancels in the ratio). The key side is shifted
by a *running* max s_i = max_{j≤i} max_r logit(k_j)_r: for query i every key j ≤ i is multiplied by
the same exp(−s_i), so the ratio is unchanged, and s_i depends only on tokens ≤ i. Keys stored at
their own s_j are brought to s_i by the factor exp(s_j − s_i) ≤ 1, which never overflows. The state
(S, z) is kept at scale exp(−shift) and rescaled when the shift grows, in the chunked pass and in
decode alike. No additive epsilon enters the ratio; a row whose denominator underflows (below √tiny:
no numerically visible key mass) gets 0 and zero gradients instead of 0/0 (:func:`safe_ratio`), and
the ops say so once per process (:class:`UnderflowWarning`, checked by :data:`UNDERFLOW_CHECK`).
A NaN or ±inf input is never turned into zeros: the rows that see it are NaN, the others exact
(``_common``, non-finite inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..errors import KernelmixError
from ._backend import resolve_backend
from .feature_draws import gaussian_random_features, orthogonal_random_features  # noqa: F401  (re-exported)
from .feature_underflow import (  # noqa: F401  (re-exported: the ops' public names stay here)
    UNDERFLOW_CHECK, UnderflowCheck, UnderflowWarning, safe_ratio, underflow_floor,
)
from ._common import (
    NonFinite, autocast_off, check_4d, check_chunk_size, check_doc_start, check_mask, check_qkv, check_state,
    check_tensor, compute_dtype, expand_heads, find_nonfinite, reaches_causal, recompute_in_segments,
    recompute_segments, scan_syncs, segmented_cummax, split_segments,
)

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Unpack


@dataclass
class RandomFeatureState:
    """Recurrent state: ``S`` ``[B, H, m, d_v]`` and ``z`` ``[B, H, m]`` at scale exp(−shift),
    ``shift`` ``[B, H]`` the running max of key feature logits, ``length`` tokens seen."""

    S: Tensor
    z: Tensor
    shift: Tensor
    length: int


# ---------------------------------------------------------------------------------------------
# Projections and the feature map


def feature_logits(x: Tensor, projection: Tensor, transform: Tensor | None, *, norm_term: bool = True) -> Tensor:
    """log(√m · φ(x)) = W (M x̃) − ½‖M x̃‖² for ``x`` ``[B, T, H, d]`` → ``[B, T, H, m]``, in x's dtype
    (the callers pass x, W and M in the compute dtype). ``norm_term=False`` leaves out −½‖M x̃‖², a
    per-token constant (for queries it cancels in the ratio)."""
    x = x * x.shape[-1] ** -0.25
    if transform is not None:
        x = torch.einsum("hed,bthd->bthe", transform, x)
    if projection.dim() == 2:
        proj = torch.einsum("bthd,md->bthm", x, projection)
    else:
        proj = torch.einsum("bthd,hmd->bthm", x, projection)
    if not norm_term:
        return proj
    return proj - 0.5 * x.pow(2).sum(dim=-1, keepdim=True)


def _check_projection(projection: Tensor, transform: Tensor | None, heads: int, head_dim: int) -> None:
    check_tensor("projection", projection, "[m, d] or [H, m, d]")
    if projection.dim() not in (2, 3):
        raise KernelmixError(f"projection must be a tensor [m, d] or [H, m, d], got {tuple(projection.shape)}")
    if projection.shape[-2] <= 0:
        raise KernelmixError(f"projection has m = {projection.shape[-2]} features; m must be ≥ 1")
    if projection.shape[-1] != head_dim:
        raise KernelmixError(f"projection rows have dim {projection.shape[-1]} but the head dim is {head_dim}")
    if projection.dim() == 3 and projection.shape[0] != heads:
        raise KernelmixError(f"projection has {projection.shape[0]} heads but q has {heads}; use [m, d] or [H, m, d]")
    if transform is not None:
        check_tensor("transform", transform, "[H, d, d]")
    if transform is not None and tuple(transform.shape) != (heads, head_dim, head_dim):
        got = tuple(transform.shape)
        raise KernelmixError(f"transform (M) must have shape [H, d, d] = {(heads, head_dim, head_dim)}, got {got}")


def positive_random_features(x: Tensor, projection: Tensor, *, transform: Tensor | None = None) -> Tensor:
    """The positive feature map φ(x) (docs/math.md §6–7), ``[B, T, H, d]`` → ``[B, T, H, m]``, unstabilised.

    E[φ(q)·φ(k)] = exp(qᵀ Σ k / √d) with Σ = MᵀM (Σ = I when ``transform`` is None). Computed in
    float32 (float64 for float64 inputs) with autocast off, as the attention ops compute it."""
    check_4d("x", x)
    _check_projection(projection, transform, x.shape[2], x.shape[3])
    with autocast_off(x):
        dtype = compute_dtype(x, projection)
        logits = feature_logits(x.to(dtype), projection.to(dtype), None if transform is None else transform.to(dtype))
        return torch.exp(logits) / math.sqrt(projection.shape[-2])


# ---------------------------------------------------------------------------------------------
# Attention


def _prepare(q, k, v, projection, transform):
    check_qkv(q, k, v)
    heads, head_dim = q.shape[2], q.shape[3]
    _check_projection(projection, transform, heads, head_dim)
    dtype = compute_dtype(q, k, v, projection)
    proj = projection.to(dtype)
    m = None if transform is None else transform.to(dtype)
    # −½‖q̃‖² is a per-query constant: it cancels between numerator and denominator, so the
    # queries skip it (and its backward); the per-query max subtracted later stabilises them.
    q_logits = feature_logits(q.to(dtype), proj, m, norm_term=False)
    k_logits = feature_logits(expand_heads(k, heads).to(dtype), proj, m)
    return q_logits, k_logits, expand_heads(v, heads).to(dtype), dtype


def _normalised_queries(q_logits: Tensor) -> Tensor:
    # A per-query constant cancels in the ratio; detached since the output does not depend on it.
    return torch.exp(q_logits - q_logits.detach().amax(dim=-1, keepdim=True))


def _exp_where(x: Tensor, keep: Tensor) -> Tensor:
    """exp(x) where ``keep``, exactly 0 elsewhere (masked before the exp so it cannot overflow)."""
    return torch.exp(x.masked_fill(~keep, float("-inf")))


def _running_shift(key_max: Tensor, doc_start: Tensor | None) -> Tensor:
    """s_i = max of the key logit maxima over j ∈ [doc_start_i, i] (:func:`segmented_cummax`): causal, per
    document, so a token's shift depends on its own document alone. Detached (the output is invariant to it)."""
    return segmented_cummax(key_max, doc_start)


class RandomFeatureOptions(TypedDict, total=False):
    """The keywords of :func:`random_feature_attention` besides ``return_state`` (its overloads' ``**options``)."""

    transform: Tensor | None
    chunk_size: int
    doc_start: Tensor | None
    initial_state: RandomFeatureState | None
    backend: str


@overload
def random_feature_attention(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[RandomFeatureOptions],
) -> Tensor: ...


@overload
def random_feature_attention(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, *, return_state: Literal[True],
    **options: Unpack[RandomFeatureOptions],
) -> tuple[Tensor, RandomFeatureState]: ...


def random_feature_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    transform: Tensor | None = None,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    initial_state: RandomFeatureState | None = None,
    return_state: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, RandomFeatureState]:
    """Causal random-feature attention in chunks (never a T×T matrix): O(T·m·d) time.

    All chunks are processed at once as batched products over a ``[B, H, N, C, *]`` view (N chunks
    of C tokens, the last one padded): the intra-chunk scores, every chunk's own state contribution
    and the read-out are each one product; only the carry of the (m × d) state from chunk to chunk
    is a loop over N. Values carry an extra ones column, so one product gives numerator and
    denominator (S and z travel together as ``[m, d_v + 1]``).

    Args:
        q: ``[B, T, H, d]``.
        k, v: ``[B, T, H_kv, d]``.
        projection: W ``[m, d]`` or ``[H, m, d]``.
        transform: DARKFormer's M ``[H, d, d]``, or None (Performer).
        chunk_size: tokens per chunk.
        doc_start: ``[B, T]`` or None (absolute indices, counting the tokens of ``initial_state``);
            keeps packed documents / left padding apart: the state restarts at every document boundary.
        initial_state: a :class:`RandomFeatureState` to continue from (chunked prefill / decode of
            several tokens), or None.
        return_state: also return the state.
        backend: "auto" (default: the Triton kernel of ``_triton_features`` for CUDA tensors when triton
            imports — same function, features recomputed in its backward instead of stored — and this
            PyTorch path elsewhere), "torch", or "triton" (CUDA; CPU only under ``TRITON_INTERPRET=1``;
            no gradient into ``initial_state`` there).

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, or ``(out, RandomFeatureState)`` with ``return_state``. T = 0 gives
        an empty output (and the state unchanged). A NaN or ±inf in k or v at token t (or in
        ``initial_state``) makes the rows that see it NaN — rows ≥ t of its document (the rows that
        continue the state) — and the returned state; every other row is what the clean input gives.
        Rows whose denominator underflows are 0 and raise an :class:`UnderflowWarning` (once per process)."""
    check_chunk_size(chunk_size)
    check_qkv(q, k, v)
    _check_projection(projection, transform, q.shape[2], q.shape[3])
    guard = find_nonfinite({"k": k, "v": v}, q.shape[2])
    if guard is not None:
        k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    initial_state, state_bad = _finite_state(initial_state, q, v, projection)
    with autocast_off(q):  # feature logits and states stay ≥ fp32 (the precision policy, _common)
        if resolve_backend(backend, q.device, compute_dtype(q, k, v, projection)) == "triton":
            out, final, denominator = _triton_attention(q, k, v, projection, transform, chunk_size, doc_start,
                                                        initial_state)
        else:
            out, final, denominator = _recomputed_attention(q, k, v, projection, transform, chunk_size, doc_start,
                                                            initial_state)
    UNDERFLOW_CHECK.observe(denominator)
    reached = _reached_rows(guard, state_bad, doc_start, final.length - q.shape[1], q.shape[:3])
    if reached is not None:
        out = out.masked_fill(reached[..., None], float("nan"))
        final = _poisoned_state(final, reached[:, -1] if q.shape[1] else state_bad)
    return (out, final) if return_state else out


def _recomputed_attention(q, k, v, projection, transform, chunk_size, doc_start, initial_state):
    """:func:`_chunked_attention` in segments of ``_common.RECOMPUTE_SEGMENT_TOKENS`` tokens, the state
    carried between them (the same chunks, the same sums). Under autograd each segment is checkpointed
    (its tiles recomputed in the backward: a fraction of the memory); without a backward the segments
    keep a long prefill's tiles in the caches (unsegmented, T = 16,384 ran 3.9× T = 8,192's time). Under
    ``torch.compile``, or in one segment, it is :func:`_chunked_attention` itself."""
    segments = recompute_segments(q.shape[1], chunk_size)
    if len(segments) == 1 or torch.compiler.is_compiling():
        return _chunked_attention(q, k, v, projection, transform, chunk_size, doc_start, initial_state)
    state_tensors = () if initial_state is None else (initial_state.S, initial_state.z)
    checkpointed = recompute_in_segments(q, k, v, projection, transform, *state_tensors)
    outs, denominators, state = [], [], initial_state
    pieces = zip(*(split_segments(x, segments) for x in (q, k, v, doc_start)))
    for q_seg, k_seg, v_seg, doc_seg in pieces:
        inputs = (q_seg, k_seg, v_seg, projection, transform, chunk_size, doc_seg, state)
        if checkpointed:
            out, state, denominator = checkpoint(_chunked_attention, *inputs, use_reentrant=False)
        else:
            out, state, denominator = _chunked_attention(*inputs)
        outs.append(out)
        denominators.append(denominator)
    return torch.cat(outs, dim=1), state, torch.cat(denominators, dim=-1)


def _chunked_attention(q, k, v, projection, transform, chunk_size, doc_start, initial_state):
    """The chunked pass of :func:`random_feature_attention` on checked, finite inputs: returns the
    output ``[B, T, H, d_v]`` (v's dtype), the final state and the denominators ``[B, H, T]``."""
    q_logits, k_logits, values, _ = _prepare(q, k, v, projection, transform)
    dv = values.shape[-1]
    mixed, _, final = _chunked_sums(q_logits, k_logits, values, chunk_size, doc_start, initial_state)
    out = safe_ratio(mixed[..., :dv], mixed[..., dv:]).transpose(1, 2).to(v.dtype)
    return out, final, mixed[..., dv]


def causal_feature_sums(
    q_logits: Tensor,
    k_logits: Tensor,
    values: Tensor,
    *,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    initial_state: RandomFeatureState | None = None,
) -> tuple[Tensor, Tensor, RandomFeatureState]:
    """The causal sums of linear attention on *log-features*, in chunks (the engine of
    :func:`random_feature_attention`, for any positive feature map φ = exp(logits)).

    ``q_logits`` ``[B, T, H, m]``, ``k_logits`` ``[B, T, H, m]`` (keys on the query heads), ``values``
    ``[B, T, H, d_v]``, all in one floating dtype (computed as given: the callers pass ≥ fp32).
    Returns ``(sums, log_scale, state)``: ``sums`` ``[B, T, H, d_v + 1]`` with

        sums_i · exp(log_scale_i) = Σ_{doc_i ≤ j ≤ i} exp(q_logits_i)·exp(k_logits_j) [v_j, 1]  (+ the carried state),

    ``log_scale`` ``[B, T, H]`` = a_i + s_i (a_i the query's own max logit, s_i the causal running
    max of the key logits, both detached), and the final state. The stabilised sums never overflow;
    ``initial_state`` and ``doc_start`` (absolute indices) work as in :func:`random_feature_attention`."""
    check_chunk_size(chunk_size)
    for name, x in (("q_logits", q_logits), ("k_logits", k_logits), ("values", values)):
        check_4d(name, x)
    if q_logits.shape != k_logits.shape or values.shape[:3] != q_logits.shape[:3]:
        raise KernelmixError(
            f"causal_feature_sums: q_logits {tuple(q_logits.shape)} and k_logits {tuple(k_logits.shape)} must be "
            f"[B, T, H, m] alike and values {tuple(values.shape)} [B, T, H, d_v]"
        )
    mixed, log_scale, final = _chunked_sums(q_logits, k_logits, values, chunk_size, doc_start, initial_state)
    return mixed.transpose(1, 2), log_scale, final


def _chunked_sums(q_logits, k_logits, values, chunk_size, doc_start, initial_state):
    """(the stabilised sums ``[B, H, T, d_v + 1]``, their log scale ``[B, T, H]``, the final state):
    see :func:`causal_feature_sums`."""
    batch, length, heads, m = k_logits.shape
    dv = values.shape[-1]
    state, shift, start = _starting_state(initial_state, values, m)
    check_doc_start(doc_start, batch, length, offset=start)
    if length == 0:  # nothing to mix: an empty output, the state as it was
        final = RandomFeatureState(S=state[..., :dv], z=state[..., dv], shift=shift, length=start)
        empty = values[:, :0].transpose(1, 2)
        return torch.cat([empty, empty[..., :1]], dim=-1), values.new_zeros(batch, 0, heads), final
    running = _running_key_shift(k_logits, doc_start, start, shift)  # [B, H, T]
    chunk = min(chunk_size, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    pos = (start + torch.arange(n_chunks * chunk, device=values.device)).view(n_chunks, chunk)  # absolute
    # padding tokens continue the last document and repeat the last shift (their features are 0)
    rows_doc = None if doc_start is None else _repeat_last(doc_start, pad).view(batch, n_chunks, chunk)
    sc = _repeat_last(running, pad).view(batch, heads, n_chunks, chunk)
    q_max = q_logits.detach().amax(dim=-1, keepdim=True)
    q_feat = _chunked(torch.exp(q_logits - q_max), n_chunks, chunk)
    k_feat = _chunked(torch.exp(k_logits - running.transpose(1, 2)[..., None]), n_chunks, chunk)  # ≤ 1; padding: 0
    ones = values.new_ones(()).expand(*values.shape[:-1], 1)
    values = _chunked(torch.cat([values, ones], dim=-1), n_chunks, chunk)  # [V, 1]: numerator and denominator
    scores = _intra_chunk_scores(q_feat, k_feat, sc, pos, rows_doc)
    own_state = _chunk_states(k_feat, values, sc, pos, rows_doc)
    last_shift = sc[..., -1]  # [B, H, N]: each chunk's own state is at scale exp(−s_last)
    before, state, shift = _carry_states(own_state, state, shift, last_shift, pos, rows_doc)
    shift_before = torch.cat([_initial_shift(initial_state, batch, heads, values), last_shift[..., :-1]], dim=-1)
    mixed = _read_out(scores, values, q_feat, before, sc, shift_before, pos, rows_doc)
    mixed = mixed.reshape(batch, heads, n_chunks * chunk, dv + 1)[:, :, :length]
    final = RandomFeatureState(S=state[..., :dv], z=state[..., dv], shift=shift, length=start + length)
    return mixed, q_max[..., 0] + running.transpose(1, 2), final


def _triton_attention(q, k, v, projection, transform, chunk_size, doc_start, initial_state):
    """:func:`random_feature_attention` by the Triton kernel (float32 inside, as the chunked pass):
    the output in v's dtype, the final state and the denominators ``[B, H, T]``. q, k, v of one 16- or
    32-bit float dtype go in as they are (the kernels read bf16 rows as bf16 and write the output in
    it: no cast passes over T-long tensors); mixed dtypes are cast to float32 first."""
    from ._triton_features import ROW_DTYPES, triton_random_feature_attention  # imports triton: only when asked

    start = 0 if initial_state is None else initial_state.length
    check_doc_start(doc_start, q.shape[0], q.shape[1], offset=start)
    f32 = torch.float32
    state = None
    if initial_state is not None:
        state = (initial_state.S.to(f32), initial_state.z.to(f32), initial_state.shift.to(f32), initial_state.length)
    rows = (q, k, v) if q.dtype in ROW_DTYPES and k.dtype == q.dtype == v.dtype else (q.to(f32), k.to(f32), v.to(f32))
    out, denominator, (s, z, shift, length) = triton_random_feature_attention(
        *rows, projection.to(f32), None if transform is None else transform.to(f32),
        chunk_size=chunk_size, doc_start=doc_start, initial_state=state,
    )
    return out.to(v.dtype), RandomFeatureState(S=s, z=z, shift=shift, length=length), denominator


def _finite_state(state: RandomFeatureState | None, q: Tensor, v: Tensor, projection: Tensor):
    """``(state, bad)``: the checked ``state`` with every head that holds a NaN or ±inf (a shift of
    −inf is an empty state, not a fault) emptied, and which heads those were, ``[B, H]`` (None: no
    state, or found finite with a sync on the CPU; see ``_common``, non-finite inputs)."""
    if state is None:
        return None, None
    _check_state(state, q.shape[0], q.shape[2], projection.shape[-2], v.shape[3])
    finite = torch.isfinite(state.S.detach()).flatten(2).all(-1) & torch.isfinite(state.z.detach()).all(-1)
    bad = ~(finite & (state.shift.detach() < float("inf")))
    if scan_syncs(bad.device) and not bool(bad.any()):
        return state, None
    emptied = RandomFeatureState(
        S=state.S.masked_fill(bad[..., None, None], 0.0), z=state.z.masked_fill(bad[..., None], 0.0),
        shift=state.shift.masked_fill(bad, float("-inf")), length=state.length,
    )
    return emptied, bad


def _reached_rows(guard: NonFinite | None, state_bad: Tensor | None, doc_start, start: int, shape) -> Tensor | None:
    """``[B, T, H]``: the rows that see a non-finite token (causally, in their document) or continue
    a non-finite state; None when there is neither."""
    reached = None if guard is None else reaches_causal(guard.bad, doc_start, start)
    if state_bad is not None:
        batch, length, _ = shape
        continues = doc_start < start if doc_start is not None else state_bad.new_ones(batch, length)
        carried = continues[:, :, None] & state_bad[:, None, :]
        reached = carried if reached is None else reached | carried
    return reached


def _poisoned_state(state: RandomFeatureState, bad: Tensor) -> RandomFeatureState:
    """``state`` with NaN in every head ``bad`` ``[B, H]`` marks (its document saw a non-finite input)."""
    nan = float("nan")
    return RandomFeatureState(
        S=state.S.masked_fill(bad[..., None, None], nan), z=state.z.masked_fill(bad[..., None], nan),
        shift=state.shift.masked_fill(bad, nan), length=state.length,
    )


def _starting_state(initial_state: RandomFeatureState | None, values: Tensor, m: int) -> tuple[Tensor, Tensor, int]:
    """(S and z as one ``[B, H, m, d_v + 1]`` tensor, the shift ``[B, H]``, the tokens already seen)
    to start from: empty, or ``initial_state`` in the compute dtype (that of ``values`` ``[B, T, H, d_v]``)."""
    batch, _, heads, dv = values.shape
    if initial_state is None:
        return values.new_zeros(batch, heads, m, dv + 1), values.new_full((batch, heads), float("-inf")), 0
    _check_state(initial_state, batch, heads, m, dv)
    dtype = values.dtype
    state = torch.cat([initial_state.S.to(dtype), initial_state.z.to(dtype)[..., None]], dim=-1)
    return state, initial_state.shift.to(dtype), initial_state.length


def _running_key_shift(k_logits: Tensor, doc_start: Tensor | None, start: int, shift: Tensor) -> Tensor:
    """The key side's running shift s_i ``[B, H, T]``: the running max of the key logits (causal, per
    document), and at least the carried ``shift`` for tokens whose document began before this call
    (they continue the carried state). Detached: the output is invariant to it."""
    running = _running_shift(k_logits.detach().amax(dim=-1).transpose(1, 2), doc_start)
    if doc_start is None:
        return torch.maximum(running, shift[..., None])
    continues = doc_start < start
    return torch.where(continues[:, None, :], torch.maximum(running, shift[..., None]), running)


def _repeat_last(x: Tensor, pad: int) -> Tensor:
    """``x`` with its last entry along the last (token) dim repeated ``pad`` more times."""
    if not pad:
        return x
    return torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)


def _chunked(x: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """``[B, T, H, *]`` → ``[B, H, N, C, *]``, the tokens after T zero padding."""
    x = x.transpose(1, 2)
    pad = n_chunks * chunk - x.shape[2]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad), value=0.0)
    return x.reshape(x.shape[0], x.shape[1], n_chunks, chunk, x.shape[-1])


def _intra_chunk_scores(q_feat: Tensor, k_feat: Tensor, sc: Tensor, pos: Tensor, rows_doc: Tensor | None) -> Tensor:
    """φ(Q_c) φ(K_c)ᵀ ⊙ exp(s_j − s_i) over visible j ≤ i within each chunk, exactly 0 elsewhere:
    ``[B, H, N, C, C]``. ``pos`` ``[N, C]`` absolute positions, ``rows_doc`` ``[B, N, C]`` their
    document starts (None: one document)."""
    causal = pos[:, None, :] <= pos[:, :, None]  # [N, C, C]
    if rows_doc is None:
        seen = causal[None, None]
    else:
        seen = (causal[None] & (pos[None, :, None, :] >= rows_doc[..., None]))[:, None]  # [B, 1, N, C, C]
    decay = _exp_where(sc[..., None, :] - sc[..., :, None], seen)
    return (q_feat @ k_feat.transpose(-1, -2)) * decay


def _chunk_states(k_feat: Tensor, values: Tensor, sc: Tensor, pos: Tensor, rows_doc: Tensor | None) -> Tensor:
    """Each chunk's own contribution to the state, ``[B, H, N, m, d_v + 1]``: its keys (those of its
    last token's document) at the scale exp(−s) of its last token."""
    own = torch.exp(sc - sc[..., -1:])
    if rows_doc is not None:
        in_last_doc = (pos[None] >= rows_doc[..., -1:])[:, None]  # [B, 1, N, C]
        own = own.masked_fill(~in_last_doc, 0.0)
    return (own[..., None] * k_feat).transpose(-1, -2) @ values


def _carry_states(own_state, state, shift, last_shift, pos, rows_doc) -> tuple[Tensor, Tensor, Tensor]:
    """Carry the state from chunk to chunk: returns (the state at the start of every chunk
    ``[B, H, N, m, d_v + 1]``, the final state, its shift). A chunk whose last token starts a new
    document drops the carried state (its rescale factor is 0)."""
    keeps_state = None if rows_doc is None else (rows_doc[..., -1] < pos[:, 0])[:, None]  # [B, 1, N]
    # (unbind, not indexing: the backward of an index zero-fills a full-size tensor per chunk)
    before = []
    for n, own_n in enumerate(own_state.unbind(dim=2)):
        before.append(state)
        rescale = torch.exp(shift - last_shift[..., n])
        if keeps_state is not None:
            rescale = rescale.masked_fill(~keeps_state[..., n], 0.0)
        state = rescale[..., None, None] * state + own_n
        shift = last_shift[..., n]
    return torch.stack(before, dim=2), state, shift


def _read_out(scores, values, q_feat, before, sc, shift_before, pos, rows_doc) -> Tensor:
    """The intra-chunk part + the carried state read at scale exp(−s_i): numerator and denominator
    of o, ``[B, H, N, C, d_v + 1]``. The carried state (at exp(−shift_before)) reaches row i with the factor
    exp(shift_before − s_i) ≤ 1, and only rows whose document began before their chunk read it."""
    if rows_doc is None:
        carry_ok = torch.ones_like(sc, dtype=torch.bool)
    else:
        carry_ok = (rows_doc < pos[:, 0, None])[:, None].expand_as(sc)  # [B, H, N, C]
    carry = _exp_where(shift_before[..., None] - sc, carry_ok & torch.isfinite(shift_before)[..., None])
    return scores @ values + carry[..., None] * (q_feat @ before)


def _initial_shift(state: RandomFeatureState | None, batch: int, heads: int, like: Tensor) -> Tensor:
    if state is None:
        return like.new_full((batch, heads, 1), float("-inf"))
    return state.shift.to(like.dtype)[..., None]


def _check_state(state: RandomFeatureState, batch: int, heads: int, m: int, dv: int,
                 op: str = "random_feature_attention") -> None:
    check_state(
        op, state, RandomFeatureState,
        {"S": ((batch, heads, m, dv), "[B, H, m, d_v]"), "z": ((batch, heads, m), "[B, H, m]"),
         "shift": ((batch, heads), "[B, H]")},
    )
    if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
        raise KernelmixError(f"{op}: state.length must be the number of tokens seen (an int ≥ 0), got {state.length!r}")


def random_feature_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> Tensor:
    """Dense reference: explicit φ(Q) φ(K)ᵀ (T×T), causal (+ document) mask, row-normalised.

    Args:
        q, k, v, projection, transform, doc_start: as :func:`random_feature_attention` (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype. Non-finite k or v
        are zeroed and every row that sees one is NaN (as the fast path)."""
    check_qkv(q, k, v)
    check_doc_start(doc_start, q.shape[0], q.shape[1])
    heads = q.shape[2]
    guard = find_nonfinite({"k": k, "v": v}, heads, always=True)
    k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    phi_q = positive_random_features(q, projection, transform=transform)
    phi_k = positive_random_features(expand_heads(k, heads), projection, transform=transform)
    length = q.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:
        mask = mask & (torch.arange(length, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]
    kernel = torch.einsum("bihm,bjhm->bhij", phi_q, phi_k).masked_fill(~mask, 0.0)  # a select: 0·inf is NaN
    values = expand_heads(v, heads).to(kernel.dtype)
    out = safe_ratio(torch.einsum("bhij,bjhd->bihd", kernel, values), kernel.sum(-1).transpose(1, 2)[..., None])
    return guard.poison_visible(out, mask).to(v.dtype)


def random_feature_attention_masked(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, mask: Tensor, *, transform: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Random-feature attention under an arbitrary mask, densely (sliding windows, irregular masks,
    queries over a cache): ``q`` ``[B, T, H, d]``, ``k``, ``v`` ``[B, L, H_kv, d]``, ``mask`` bool
    ``[B, T, L]`` (True where query t reads key l; a batch of 1 broadcasts). Returns
    ``(out [B, T, H, d_v], weights [B, H, T, L])``: ``out`` in v's dtype, the weights in float32
    (float64 for float64 queries). Stabilised like the chunked op: per-query max over features,
    per-key max and a per-row shift (the max over the row's visible keys), so nothing overflows
    and rows stay exact ratios. Rows with no visible key give 0; a row that shows a non-finite key
    or value gives NaN (the others are unaffected); underflowing rows warn as in the chunked op.
    :func:`~kernelmix.ops.softmax.softmax_attention_masked` is its exact counterpart."""
    check_qkv(q, k, v, same_length=False)
    check_mask(mask, q, k)
    heads = q.shape[2]
    _check_projection(projection, transform, heads, q.shape[3])
    guard = find_nonfinite({"k": k, "v": v}, heads)
    if guard is not None:
        k, v = guard.zeroed("k", k), guard.zeroed("v", v)
    dtype = compute_dtype(q)
    if k.shape[1] == 0:  # no keys: every row is empty (0); an empty sum, so autograd still sees v
        weights = q.new_zeros(q.shape[0], heads, q.shape[1], 0, dtype=dtype)
        out = torch.einsum("bhtl,blhd->bthd", weights, expand_heads(v, heads).to(dtype))
        return out.to(v.dtype), weights
    with autocast_off(q):  # feature logits stay ≥ fp32 (the precision policy, _common)
        proj = projection.to(dtype)
        m = None if transform is None else transform.to(dtype)
        q_logits = feature_logits(q.to(dtype), proj, m)  # [B, T, H, m]
        k_logits = feature_logits(expand_heads(k, heads).to(dtype), proj, m)  # [B, L, H, m]
        q_feat = _normalised_queries(q_logits).transpose(1, 2)  # [B, H, T, m]
        key_max = k_logits.detach().amax(-1).transpose(1, 2)  # [B, H, L]
        k_feat = torch.exp(k_logits.transpose(1, 2) - key_max[..., None])  # [B, H, L, m]
        seen = mask[:, None]  # [B, 1, T, L]
        row_shift = key_max[:, :, None, :].masked_fill(~seen, float("-inf")).amax(-1, keepdim=True)  # [B, H, T, 1]
        row_shift = torch.where(torch.isfinite(row_shift), row_shift, torch.zeros_like(row_shift))
        decay = _exp_where(key_max[:, :, None, :] - row_shift, seen)
        scores = (q_feat @ k_feat.transpose(-1, -2)) * decay
        denominator = scores.sum(-1, keepdim=True)
        weights = safe_ratio(scores, denominator)
        values = expand_heads(v, heads).to(dtype).transpose(1, 2)
        out = (weights @ values).transpose(1, 2)
    UNDERFLOW_CHECK.observe(denominator[..., 0], mask.any(-1)[:, None])  # rows with no visible key are 0 anyway
    if guard is not None:
        out = guard.poison_visible(out, seen)
    return out.to(v.dtype), weights


def random_feature_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    state: RandomFeatureState | None,
    *,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, RandomFeatureState]:
    """Decode one token with O(m·d) work and state, independent of the position.

    Args:
        q: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        projection, transform: as :func:`random_feature_attention`.
        state: the :class:`RandomFeatureState` of the tokens before.
        doc_start: ``[B, 1]`` or None; where ``doc_start == state.length`` the token starts a new
            document and the state restarts.

    Returns:
        ``(out [B, 1, H, d_v], state)``. A non-finite input makes this row and the state NaN (a new
        document then starts from an empty state again)."""
    check_qkv(q, k, v)
    if q.shape[1] != 1:
        raise KernelmixError(
            f"a decode step takes one token (T=1), got T={q.shape[1]}; use random_feature_attention for prefill"
        )
    with autocast_off(q):  # feature logits and states stay ≥ fp32 (the precision policy, _common)
        q_logits, k_logits, values, dtype = _prepare(q, k, v, projection, transform)
        q_feat = _normalised_queries(q_logits[:, 0])  # [B, H, m]
        k_logits, values = k_logits[:, 0], values[:, 0]  # [B, H, m], [B, H, d_v]
        batch, heads, m = k_logits.shape
        if state is None:
            state_s = values.new_zeros(batch, heads, m, values.shape[-1])
            state_z = values.new_zeros(batch, heads, m)
            shift = values.new_full((batch, heads), float("-inf"))
            length = 0
        else:
            _check_state(state, batch, heads, m, values.shape[-1], op="random_feature_attention_step")
            state_s, state_z, shift, length = state.S.to(dtype), state.z.to(dtype), state.shift.to(dtype), state.length
        check_doc_start(doc_start, batch, 1, offset=length)
        key_max = k_logits.detach().amax(dim=-1)
        if doc_start is None:
            keeps_state = torch.ones_like(key_max, dtype=torch.bool)
        else:
            keeps_state = (doc_start[:, 0] < length)[:, None].expand_as(key_max)
        new_shift = torch.where(keeps_state, torch.maximum(shift, key_max), key_max)
        rescale = _exp_where(shift - new_shift, keeps_state)
        k_feat = torch.exp(k_logits - new_shift[..., None])
        state_s = _rescaled(state_s, rescale[..., None, None],
                            None if doc_start is None else keeps_state[..., None, None])
        state_s = state_s + k_feat[..., :, None] * values[..., None, :]
        state_z = _rescaled(state_z, rescale[..., None], None if doc_start is None else keeps_state[..., None]) + k_feat
        numerator = torch.einsum("bhm,bhmd->bhd", q_feat, state_s)
        denominator = (q_feat * state_z).sum(-1, keepdim=True)
        out = safe_ratio(numerator, denominator)[:, None].to(v.dtype)
    UNDERFLOW_CHECK.observe(denominator[..., 0])
    return out, RandomFeatureState(S=state_s, z=state_z, shift=new_shift, length=length + 1)


def _rescaled(state: Tensor, rescale: Tensor, keeps: Tensor | None) -> Tensor:
    """rescale · state, and exactly 0 where ``keeps`` is False (a new document: a select, since the
    dropped state may hold NaN and 0 · NaN is NaN)."""
    if keeps is None:
        return rescale * state
    return torch.where(keeps, rescale * state, torch.zeros_like(state))
