"""Triton kernels of causal positive random-feature attention (Performer, DARKFormer; docs/math.md §6–7).

The same function as the chunked CPU path (``random_features._chunked_attention``), with the same
stabilisers: queries divided by their own max over features, keys shifted by the causal running
max s_i of their logit maxima (per document, at least the carried shift for rows that continue an
``initial_state``), the state (S, z) kept at scale exp(−shift) and rescaled when the shift grows,
and a zero row (zero gradients) where the denominator is at or below √tiny(float32).

Design: chunk-parallel, every chunk of C rows in its own program (grid: chunks × B·H × value blocks),
as flash-linear-attention's chunked linear attention, with the running-max stabiliser carried
through the states between chunks. The forward is three launches:

1. ``_chunk_state_kernel``: each chunk's own part of the state, ΔS_c = Σ_j exp(ℓ^k_j − σ'_c) φ'_j v_jᵀ
   and Δz_c over the keys of the chunk's last document, at its local scale σ'_c (their max logit);
2. ``_state_scan_kernel``: one program per elementwise tile of the m × d_v state walks the chunks
   in order, S_c = exp(σ_{c−1} − σ_c) S_{c−1} + exp(σ'_c − σ_c) ΔS_c with σ_c = max(σ_{c−1}, σ'_c)
   (or ΔS_c alone where a document begins in the chunk), and leaves in each chunk's slot the state
   entering it and its scale: a memory-bound pass over n·m·d_v numbers, no products;
3. ``_forward_kernel``: each chunk's outputs from its own keys (a C × C score tile with the
   segmented running max as a masked C × C max, no scan) and the entering state.

The feature map is fused: a program loads its C × d queries and keys, applies d^{-1/4}, the transform
M and the projection W with ``tl.dot`` in full fp32 (the feature logits stay fp32) and forms the
features in registers, so φ(Q), φ(K) (T × m) never reach memory. The products of features, states
and values take ``FEATURE_OPERANDS`` (TF32 on tensor cores by default; ``_triton_products``), the
normalisers and states accumulate in fp32. Grouped heads are indexed (query head h reads kv head
h // (H / H_kv)), never expanded.

The backward saves only q, k, v, W, M and per-row scalars (the key shift s_i, the query max and
the denominator), recomputes the features and the entering states (launches 1–2 again). With g =
dL/do, ĝ_i = g_i / den_i and c_i = −(g_i · o_i) / den_i (computed in torch, like flash-attention's
D), the gradient of an unnormalised score P_ij is ĝ_i · v_j + c_i. Then:

- ``_query_grad_kernel`` (forward direction): dφq_i = Σ_j exp(ℓ^k_j − s_i) (ĝ_i · v_j + c_i), the
  earlier chunks through the entering state;
- ``_reverse_state_kernel`` and ``_reverse_scan_kernel`` (reverse direction): R_c = Σ_{i after
  chunk c, same document} exp(σ_c − s_i) φq_i [ĝ_i, c_i]ᵀ, each chunk's part in parallel and a scan
  from the last chunk; its scales are the forward's saved shifts, every factor ≤ 1;
- ``_key_grad_kernel``: dv_j and dφk_j from the chunk's own rows and R_c.

Both gradient kernels store the per-row gradients of the feature logits, dℓ = φ ⊙ dφ ``[T, m]``
(value-column blocks each store their part; the c_i terms enter only in block 0), and torch adds the
blocks and chains them through the feature map with five products over all rows
(``_chain_feature_map``: dx', for keys with the −½‖x'‖² term, dW = Σ dℓᵀ x', dx̃ = Mᵀ dx', dM = Σ dx' x̃ᵀ).
The kernels keep no dW [m, d] or dM [d, d] accumulator: at m = d = 128 those spilled on sm_90 and
made ptxas take minutes. Memory: the per-chunk states, B·H·n·m·(d_v + 1) fp32 (one buffer, reused
by the reverse direction), and O(T) per row; no T × m and no T × T tensor.

Loops over chunks are ``while`` loops: Triton 3.6's interpreter passes a run-time scalar as a
1-element array, which ``range`` cannot take under NumPy ≥ 2.4; on a GPU both compile to the same loop.

Sizes: any T ≥ 0, any d_v (blocks of :data:`VALUE_BLOCK` columns), m ≤ 256 features and head dim
d ≤ 256 (one register tile each; beyond that use ``backend="torch"``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..errors import KernelmixError
from ._backend import KernelLaunch, aot_signature, defined_for_the_interpreter
from ._triton_products import product

#: Largest block of value columns one program holds (its part of the state is m × VALUE_BLOCK fp32);
#: the key gradient, which holds the most tiles, takes half as many.
VALUE_BLOCK = 64
#: From this padded m or d on, chunks are 32 rows, not 64. The blocks, the warps and ``LOGIT_STEP``
#: are those with which ptxas (sm_90) spilled nothing at d = m = 128 and 64 (results/gpu-plan).
LARGE_TILE = 128
#: Largest number of random features (and head dim) the kernels hold in one register tile.
MAX_FEATURES = 256
MAX_HEAD_DIM = 256
#: Elementwise tile (features × value columns) of one program of the scans over chunks.
SCAN_TILE = (16, 16)
#: Operands of the products of features, states and values: "tf32" (tensor cores; the error against
#: float64 is measured in tests/ops/test_triton_features.py and docs/gpu.md), "bf16" or "fp32".
FEATURE_OPERANDS = "tf32"
#: Head columns per step of the feature logits' product (a K loop: small tiles, few registers).
LOGIT_STEP = 16
#: √tiny(float32): a denominator at or below it gives a zero row (as ``safe_ratio``).
UNDERFLOW_FLOOR = math.sqrt(torch.finfo(torch.float32).tiny)

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Shared pieces of the kernels


@triton.jit
def _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
    """Token indices of chunk c (in this call), which exist, their absolute positions and the
    absolute start of their document (0 without documents: one document from position 0)."""
    offs = tl.arange(0, BLOCK_T)
    t = c * BLOCK_T + offs
    row_ok = t < T
    pos = start + t
    if HAS_DOC:
        doc = tl.load(doc_ptr + b * T + t, mask=row_ok, other=0)
    else:
        doc = tl.zeros([BLOCK_T], dtype=tl.int64)
    return t, row_ok, pos, doc


@triton.jit
def _feature_logits(x_ptr, x_row_stride, t, row_ok, w_ptr, scale, d, m_feats, IS_KEY: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """The feature logits of the rows t of x (``x_ptr`` at the head's first element): W (scale·x)
    ``[BLOCK_T, BLOCK_M]``, for keys minus ½‖scale·x‖²; padding is 0. Over the head in steps of
    ``D_STEP`` columns (small tiles, few registers), each step's product at fp32 accuracy on tensor
    cores (``"tf32x3"``: the logits are exponentiated, so they stay fp32)."""
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_feats
    logits = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    half_norm = tl.zeros([BLOCK_T], dtype=tl.float32)
    for first in range(0, BLOCK_D, D_STEP):
        offs_d = first + tl.arange(0, D_STEP)
        d_ok = offs_d < d
        x = tl.load(x_ptr + t[:, None] * x_row_stride + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0) * scale
        w_t = tl.load(w_ptr + offs_m[None, :] * d + offs_d[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        logits += product(x, w_t, "tf32x3")
        if IS_KEY:
            half_norm += 0.5 * tl.sum(x * x, axis=1)
    if IS_KEY:
        logits -= half_norm[:, None]
    return logits


@triton.jit
def _visible(t, pos, doc, row_ok):
    """``[BLOCK_T, BLOCK_T]``: query row i sees key column j of the same chunk (causal, same document)."""
    return (t[None, :] <= t[:, None]) & (pos[None, :] >= doc[:, None]) & row_ok[None, :] & row_ok[:, None]


@triton.jit
def _exp_where(x, keep):
    """exp(x) where ``keep``, exactly 0 elsewhere (masked before the exp so it cannot overflow)."""
    return tl.exp(tl.where(keep, x, float("-inf")))


@triton.jit
def _last_row(values, t, c, T, BLOCK_T: tl.constexpr):
    """The entry of ``values`` at the chunk's last existing row (a masked sum: no gather)."""
    last = tl.minimum(T - c * BLOCK_T, BLOCK_T) - 1
    return tl.sum(tl.where(t - c * BLOCK_T == last, values, 0), axis=0)


@triton.jit
def _key_shift(key_max, visible, continuing, carried, row_ok):
    """The running shift s_i of the rows of a chunk: the max of the visible keys' logit maxima (a
    masked C × C max instead of a scan), and at least the carried shift for rows whose document
    began before the chunk. Padding rows get 0 (their features are 0)."""
    shift = tl.max(tl.where(visible, key_max[None, :], float("-inf")), axis=1)
    shift = tl.where(continuing, tl.maximum(shift, carried), shift)
    return tl.where(row_ok, shift, 0.0)


@triton.jit
def _chunk_features(q_head, k_head, q_row_stride, k_row_stride, t, row_ok, w_head, scale, d, m_feats,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """The chunk's query and key feature logits (keys with −½‖x'‖²) and which are real (``valid``)."""
    q_logits = _feature_logits(q_head, q_row_stride, t, row_ok, w_head, scale, d, m_feats, False, BLOCK_T, BLOCK_D,
                               BLOCK_M, D_STEP)
    k_logits = _feature_logits(k_head, k_row_stride, t, row_ok, w_head, scale, d, m_feats, True, BLOCK_T, BLOCK_D,
                               BLOCK_M, D_STEP)
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    return q_logits, k_logits, valid


@triton.jit
def _load_value_block(ptr, t, row_ok, row_stride, cols, cols_ok):
    return tl.load(ptr + t[:, None] * row_stride + cols[None, :], mask=row_ok[:, None] & cols_ok[None, :], other=0.0)


# ---------------------------------------------------------------------------------------------
# The states between chunks (forward and backward)


@triton.jit
def _chunk_program(H, H_K, H_KV, dv, BLOCK_V: tl.constexpr):
    """This program's chunk, (batch, query head), key and value heads and block of value columns, from
    the grid (chunks, B·H, value blocks): (c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: B·T·H·d may pass 2^31
    h = pid_bh % H
    kk = h // (H // H_K)  # the transformed keys are per query head (H_K = H), plain ones per kv head
    kv = h // (H // H_KV)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    return c, pid_bh, pid_v, b, h, kk, kv, cols, cols < dv


@triton.jit
def _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, BLOCK_M: tl.constexpr):
    """Where this program's block of chunk c's state lives in ``[B·H, chunks, m, d_v]`` (offsets,
    mask) and its normaliser part in ``[B·H, chunks, m]`` (offsets, mask)."""
    offs_m = tl.arange(0, BLOCK_M)
    feat_ok = offs_m < m_feats
    rows = (pid_bh * n_chunks + c).to(tl.int64) * m_feats + offs_m
    return rows[:, None] * dv + cols[None, :], feat_ok[:, None] & cols_ok[None, :], rows, feat_ok


@triton.jit
def _chunk_state_kernel(k_ptr, v_ptr, w_ptr, doc_ptr, ds_ptr, dz_ptr, dsig_ptr,
                        T, H, H_K, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                        HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                    D_STEP: tl.constexpr):
    """Chunk c's own part of the state, all chunks in parallel: the keys of the chunk's last document
    at the chunk's local scale σ'_c (the max of their logit maxima), ΔS_c = Σ_j exp(ℓ^k_j − σ'_c) v_jᵀ
    and Δz_c, with σ'_c (every factor ≤ 1)."""
    c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok = _chunk_program(H, H_K, H_KV, dv, BLOCK_V)
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    k_logits = _feature_logits(k_ptr + b * T * H_K * d + kk * d, H_K * d, t, row_ok, w_ptr + h * w_head_stride,
                               scale, d, m_feats, True, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    in_last = row_ok & (pos >= _last_row(doc, t, c, T, BLOCK_T))  # the keys a later chunk may see
    key_max = tl.max(tl.where(valid, k_logits, float("-inf")), axis=1)
    local = tl.max(tl.where(in_last, key_max, float("-inf")), axis=0)
    weighted = _exp_where(k_logits - local, valid & in_last[:, None])
    v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, BLOCK_M)
    tl.store(ds_ptr + offsets, product(tl.trans(weighted), v, OPERANDS), mask=mask)
    if pid_v == 0:
        tl.store(dz_ptr + rows, tl.sum(weighted, axis=0), mask=feat_ok)
        tl.store(dsig_ptr + pid_bh * n_chunks + c, local)


@triton.jit
def _scan_tile(H, m_feats, dv, SCAN_M: tl.constexpr, SCAN_V: tl.constexpr):
    """A scan program's tile of its (batch, head)'s m × d_v state, from the grid (B·H, feature tiles,
    value tiles): (pid_bh, pid_m, pid_v, b, feature rows, value columns, feature mask, tile mask)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_v = tl.program_id(2)
    offs_m = pid_m * SCAN_M + tl.arange(0, SCAN_M)
    cols = pid_v * SCAN_V + tl.arange(0, SCAN_V)
    feat_ok = offs_m < m_feats
    return (pid_bh, pid_m, pid_v, (pid_bh // H).to(tl.int64), offs_m, cols, feat_ok,
            feat_ok[:, None] & (cols < dv)[None, :])


@triton.jit
def _restarts(doc_ptr, b, c, T, start, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
    """Whether chunk c's last row's document begins inside the chunk (the state before it is dropped);
    without documents, only at position 0."""
    if HAS_DOC:
        doc_last = tl.load(doc_ptr + b * T + tl.minimum(T, (c + 1) * BLOCK_T) - 1)
    else:
        doc_last = 0
    return doc_last >= start + c * BLOCK_T


@triton.jit
def _state_scan_kernel(ds_ptr, dz_ptr, dsig_ptr, doc_ptr, s0_ptr, z0_ptr, shift0_ptr, carried_ptr,
                       s_out_ptr, z_out_ptr, shift_out_ptr, T, H, dv, m_feats, start, n_chunks,
                       HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, SCAN_M: tl.constexpr, SCAN_V: tl.constexpr):
    """The states between chunks, a sequential scan over the chunks of one elementwise tile (grid:
    B·H, feature tiles, value tiles): ΔS_c, Δz_c are overwritten by the state entering chunk c (at
    scale exp(−σ_{c−1}), written to ``carried``), then S_c = exp(σ_{c−1} − σ_c) S_{c−1} +
    exp(σ'_c − σ_c) ΔS_c with σ_c = max(σ_{c−1}, σ'_c), or ΔS_c alone where the chunk's last
    document begins inside it. The next chunk's ΔS is loaded before this one's is used (a ``while``
    loop is not pipelined by the compiler: this hides one load latency per step)."""
    pid_bh, pid_m, pid_v, b, offs_m, cols, feat_ok, mask = _scan_tile(H, m_feats, dv, SCAN_M, SCAN_V)
    head_rows = pid_bh * m_feats + offs_m
    state = tl.load(s0_ptr + head_rows[:, None] * dv + cols[None, :], mask=mask, other=0.0)
    state_z = tl.load(z0_ptr + head_rows, mask=feat_ok, other=0.0)
    sigma = tl.load(shift0_ptr + pid_bh)
    rows = (pid_bh * n_chunks).to(tl.int64) * m_feats + offs_m
    delta = tl.load(ds_ptr + rows[:, None] * dv + cols[None, :], mask=mask, other=0.0)
    delta_z = tl.load(dz_ptr + rows, mask=feat_ok, other=0.0)
    c = 0
    while c < n_chunks:  # (a while loop: see the note at the top)
        # (the last step loads its own slot again, unused: an index in range, not a scalar mask)
        next_rows = (pid_bh * n_chunks + tl.minimum(c + 1, n_chunks - 1)).to(tl.int64) * m_feats + offs_m
        next_delta = tl.load(ds_ptr + next_rows[:, None] * dv + cols[None, :], mask=mask, other=0.0)
        next_delta_z = tl.load(dz_ptr + next_rows, mask=feat_ok, other=0.0)
        local = tl.load(dsig_ptr + pid_bh * n_chunks + c)
        tl.store(ds_ptr + rows[:, None] * dv + cols[None, :], state, mask=mask)
        if pid_v == 0:
            tl.store(dz_ptr + rows, state_z, mask=feat_ok)
            if pid_m == 0:
                tl.store(carried_ptr + pid_bh * n_chunks + c, sigma)
        restarts = _restarts(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
        new_sigma = tl.where(restarts, local, tl.maximum(sigma, local))
        keep = tl.where(restarts, 0.0, tl.exp(sigma - new_sigma))
        add = tl.exp(local - new_sigma)
        state = keep * state + add * delta
        state_z = keep * state_z + add * delta_z
        sigma = new_sigma
        rows = next_rows
        delta = next_delta
        delta_z = next_delta_z
        c += 1
    tl.store(s_out_ptr + head_rows[:, None] * dv + cols[None, :], state, mask=mask)
    if pid_v == 0:
        tl.store(z_out_ptr + head_rows, state_z, mask=feat_ok)
        if pid_m == 0:
            tl.store(shift_out_ptr + pid_bh, sigma)


@triton.jit
def _entering_state(ds_ptr, dz_ptr, carried_ptr, pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok,
                    BLOCK_M: tl.constexpr):
    """The state entering chunk c, this program's block of it: (S, z, σ_{c−1})."""
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, BLOCK_M)
    return (tl.load(ds_ptr + offsets, mask=mask, other=0.0), tl.load(dz_ptr + rows, mask=feat_ok, other=0.0),
            tl.load(carried_ptr + pid_bh * n_chunks + c))


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, w_ptr, doc_ptr, ds_ptr, dz_ptr, carried_ptr,
                    out_ptr, den_ptr, shift_ptr, qmax_ptr,
                    T, H, H_K, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale, floor,
                    HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                    D_STEP: tl.constexpr):
    """The outputs of one chunk, all chunks in parallel: the chunk's own keys (a C × C masked score
    tile) and the earlier chunks through the state entering it."""
    c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok = _chunk_program(H, H_K, H_KV, dv, BLOCK_V)
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    chunk_start = start + c * BLOCK_T
    q_logits, k_logits, valid = _chunk_features(
        q_ptr + b * T * H * d + h * d, k_ptr + b * T * H_K * d + kk * d, H * d, H_K * d, t, row_ok,
        w_ptr + h * w_head_stride, scale, d, m_feats, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    state_s, state_z, carried = _entering_state(ds_ptr, dz_ptr, carried_ptr, pid_bh, c, n_chunks, m_feats, dv,
                                                cols, cols_ok, BLOCK_M)
    q_max = tl.where(row_ok, tl.max(tl.where(valid, q_logits, float("-inf")), axis=1), 0.0)
    q_feat = _exp_where(q_logits - q_max[:, None], valid)
    visible = _visible(t, pos, doc, row_ok)
    continuing = row_ok & (doc < chunk_start)
    key_max = tl.max(tl.where(valid, k_logits, float("-inf")), axis=1)
    shift = _key_shift(key_max, visible, continuing, carried, row_ok)
    key_feat = _exp_where(k_logits - shift[:, None], valid)  # ≤ 1
    v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
    decay = _exp_where(shift[None, :] - shift[:, None], visible)  # exp(s_j − s_i) ≤ 1
    scores = product(q_feat, tl.trans(key_feat), OPERANDS) * decay
    carry = _exp_where(carried - shift, continuing)  # the entering state reaches row i at exp(σ − s_i)
    numerator = product(scores, v, OPERANDS) + carry[:, None] * product(q_feat, state_s, OPERANDS)
    denominator = tl.sum(scores, axis=1) + carry * tl.sum(q_feat * state_z[None, :], axis=1)
    empty = denominator <= floor
    out = tl.where(empty[:, None], 0.0, numerator / tl.where(empty, 1.0, denominator)[:, None])
    tl.store(out_ptr + (b * T + t)[:, None] * H * dv + h * dv + cols[None, :], out,
             mask=row_ok[:, None] & cols_ok[None, :])
    if pid_v == 0:  # the per-row scalars: one value block writes them (a branch, not `row_ok & (pid_v == 0)`,
        # whose dtype Triton 3.9's interpreter turns into int32, which a mask may not be)
        tl.store(den_ptr + pid_bh * T + t, denominator, mask=row_ok)
        tl.store(shift_ptr + pid_bh * T + t, shift, mask=row_ok)
        tl.store(qmax_ptr + pid_bh * T + t, q_max, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _query_features(q_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, d, m_feats, w_head, scale,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """The chunk's query features again, at the forward's query max (so they are the forward's)."""
    q_logits = _feature_logits(q_ptr + b * T * H * d + h * d, H * d, t, row_ok, w_head, scale, d, m_feats, False,
                               BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    q_max = tl.load(qmax_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    return _exp_where(q_logits - q_max[:, None], valid)


@triton.jit
def _gradient_rows(g_ptr, c_ptr, b, h, pid_bh, pid_v, t, row_ok, T, H, dv, cols, cols_ok):
    """ĝ of the chunk's rows (this value block) and c_i, which belongs to no value block: block 0 carries it."""
    g_hat = _load_value_block(g_ptr + b * T * H * dv + h * dv, t, row_ok, H * dv, cols, cols_ok)
    c_row = tl.load(c_ptr + pid_bh * T + t, mask=row_ok, other=0.0) * (pid_v == 0).to(tl.float32)
    return g_hat, c_row


@triton.jit
def _recompute_chunk(q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v,
                     kk, cols, cols_ok, T, H, H_K, H_KV, d, dv, m_feats, start, w_head, scale, HAS_DOC: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """What both gradient kernels need of chunk c: the features again (from the saved key shift and
    query max, so they are the forward's), the masks, the value block, ĝ and (block 0 only) c_i."""
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    chunk_start = start + c * BLOCK_T
    q_feat = _query_features(q_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, d, m_feats, w_head, scale, BLOCK_T,
                             BLOCK_D, BLOCK_M, D_STEP)
    k_logits = _feature_logits(k_ptr + b * T * H_K * d + kk * d, H_K * d, t, row_ok, w_head, scale, d, m_feats, True,
                               BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    shift = tl.load(shift_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    key_feat = _exp_where(k_logits - shift[:, None], valid)
    visible = _visible(t, pos, doc, row_ok)
    continuing = row_ok & (doc < chunk_start)
    decay = _exp_where(shift[None, :] - shift[:, None], visible)
    v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
    g_hat, c_row = _gradient_rows(g_ptr, c_ptr, b, h, pid_bh, pid_v, t, row_ok, T, H, dv, cols, cols_ok)
    return t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row


@triton.jit
def _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M: tl.constexpr):
    """This value block's dL/dlogit of the chunk's rows into its slot of ``[blocks, B, T, H, m]``
    (torch adds the blocks and chains them through the feature map: no dW, dM accumulators here)."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = ((pid_v * (tl.num_programs(1) // H) + b) * T + t) * H + h
    tl.store(dlog_ptr + rows[:, None] * m_feats + offs_m[None, :], d_logits,
             mask=row_ok[:, None] & (offs_m < m_feats)[None, :])


@triton.jit
def _query_grad_kernel(q_ptr, k_ptr, v_ptr, w_ptr, doc_ptr, ds_ptr, dz_ptr, carried_ptr,
                       g_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr,
                       T, H, H_K, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                       HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                    D_STEP: tl.constexpr):
    """Forward direction, all chunks in parallel: dφq_i = Σ_j exp(ℓ^k_j − s_i)(ĝ_i·v_j + c_i), the
    earlier chunks through the recomputed state entering the chunk; stored as dL/dℓ^q = φq ⊙ dφq
    (this value block's part)."""
    c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok = _chunk_program(H, H_K, H_KV, dv, BLOCK_V)
    t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row = _recompute_chunk(
        q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v, kk, cols,
        cols_ok, T, H, H_K, H_KV, d, dv, m_feats, start, w_ptr + h * w_head_stride, scale, HAS_DOC, BLOCK_T, BLOCK_D,
        BLOCK_M, D_STEP)
    state_s, state_z, carried = _entering_state(ds_ptr, dz_ptr, carried_ptr, pid_bh, c, n_chunks, m_feats, dv,
                                                cols, cols_ok, BLOCK_M)
    d_scores = (product(g_hat, tl.trans(v), OPERANDS) + c_row[:, None]) * decay
    d_feat = product(d_scores, key_feat, OPERANDS)
    carry = _exp_where(carried - shift, continuing)
    from_state = product(g_hat, tl.trans(state_s), OPERANDS) + c_row[:, None] * state_z[None, :]
    d_logits = q_feat * (d_feat + carry[:, None] * from_state)  # the query max is detached
    _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M)


@triton.jit
def _reverse_state_kernel(q_ptr, w_ptr, doc_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, carried_ptr,
                          rs_ptr, rz_ptr, T, H, H_K, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                          HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr, D_STEP: tl.constexpr):
    """Chunk c's own part of the reverse state, all chunks in parallel: its rows that continue the
    document of chunk c − 1's last row, at the scale of that row, ΔR_c = Σ_i exp(σ_{c−1} − s_i)
    φq_i [ĝ_i, c_i]ᵀ (every factor ≤ 1; the c part in value block 0)."""
    c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok = _chunk_program(H, H_K, H_KV, dv, BLOCK_V)
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    q_feat = _query_features(q_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, d, m_feats, w_ptr + h * w_head_stride,
                             scale, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    shift = tl.load(shift_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    carried = tl.load(carried_ptr + pid_bh * n_chunks + c)
    reads_back = q_feat * _exp_where(carried - shift, row_ok & (doc < start + c * BLOCK_T))[:, None]
    g_hat, c_row = _gradient_rows(g_ptr, c_ptr, b, h, pid_bh, pid_v, t, row_ok, T, H, dv, cols, cols_ok)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, BLOCK_M)
    tl.store(rs_ptr + offsets, product(tl.trans(reads_back), g_hat, OPERANDS), mask=mask)
    if pid_v == 0:
        tl.store(rz_ptr + rows, tl.sum(reads_back * c_row[:, None], axis=0), mask=feat_ok)


@triton.jit
def _reverse_scan_kernel(rs_ptr, rz_ptr, doc_ptr, shift_ptr, carried_ptr, T, H, dv, m_feats, start, n_chunks,
                         HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, SCAN_M: tl.constexpr, SCAN_V: tl.constexpr):
    """The reverse states, a sequential scan from the last chunk (grid as the forward scan): ΔR_c is
    overwritten by R_c = Σ over the later chunks' rows of the same document, at scale exp(σ_c), read by
    chunk c's keys; then R_{c−1} = exp(σ_{c−1} − σ_c) R_c + ΔR_c, or ΔR_c alone where chunk c's
    last document begins inside it. The scales are the forward's saved shifts: no maximum to track."""
    pid_bh, pid_m, pid_v, b, offs_m, cols, feat_ok, mask = _scan_tile(H, m_feats, dv, SCAN_M, SCAN_V)
    later = tl.zeros([SCAN_M, SCAN_V], dtype=tl.float32)
    later_z = tl.zeros([SCAN_M], dtype=tl.float32)
    rows = (pid_bh * n_chunks + n_chunks - 1).to(tl.int64) * m_feats + offs_m
    delta = tl.load(rs_ptr + rows[:, None] * dv + cols[None, :], mask=mask, other=0.0)
    delta_z = tl.load(rz_ptr + rows, mask=feat_ok, other=0.0)
    step = 0
    while step < n_chunks:  # (a while loop: see the note at the top)
        c = n_chunks - 1 - step
        next_rows = (pid_bh * n_chunks + tl.maximum(c - 1, 0)).to(tl.int64) * m_feats + offs_m
        next_delta = tl.load(rs_ptr + next_rows[:, None] * dv + cols[None, :], mask=mask, other=0.0)
        next_delta_z = tl.load(rz_ptr + next_rows, mask=feat_ok, other=0.0)
        tl.store(rs_ptr + rows[:, None] * dv + cols[None, :], later, mask=mask)
        if pid_v == 0:
            tl.store(rz_ptr + rows, later_z, mask=feat_ok)
        sigma = tl.load(shift_ptr + pid_bh * T + tl.minimum(T, (c + 1) * BLOCK_T) - 1)  # the chunk's last row's
        carried = tl.load(carried_ptr + pid_bh * n_chunks + c)
        back = tl.where(_restarts(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC), 0.0, tl.exp(carried - sigma))
        later = back * later + delta
        later_z = back * later_z + delta_z
        rows = next_rows
        delta = next_delta
        delta_z = next_delta_z
        step += 1


@triton.jit
def _key_grad_kernel(q_ptr, k_ptr, v_ptr, w_ptr, doc_ptr, rs_ptr, rz_ptr,
                     g_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr, dv_ptr,
                     T, H, H_K, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                     HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                    D_STEP: tl.constexpr):
    """Reverse direction, all chunks in parallel: dv_j and dφk_j from this chunk's rows and from the
    later rows of the same document through the reverse state R_c (at most 1 per term); dL/dℓ^k =
    φk ⊙ dφk stored (this value block's part)."""
    c, pid_bh, pid_v, b, h, kk, kv, cols, cols_ok = _chunk_program(H, H_K, H_KV, dv, BLOCK_V)
    t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row = _recompute_chunk(
        q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v, kk, cols,
        cols_ok, T, H, H_K, H_KV, d, dv, m_feats, start, w_ptr + h * w_head_stride, scale, HAS_DOC, BLOCK_T, BLOCK_D,
        BLOCK_M, D_STEP)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, BLOCK_M)
    later = tl.load(rs_ptr + offsets, mask=mask, other=0.0)  # R_c: the later rows' ĝ part
    later_c = tl.load(rz_ptr + rows, mask=feat_ok, other=0.0) * (pid_v == 0).to(tl.float32)  # their c part (block 0)
    sigma = _last_row(shift, t, c, T, BLOCK_T)
    seen_later = _exp_where(shift - sigma, row_ok & (pos >= _last_row(doc, t, c, T, BLOCK_T)))  # keys later chunks read
    scores = product(q_feat, tl.trans(key_feat), OPERANDS) * decay
    d_v = product(tl.trans(scores), g_hat, OPERANDS) + seen_later[:, None] * product(key_feat, later, OPERANDS)
    tl.store(dv_ptr + ((b * T + t) * H + h)[:, None] * dv + cols[None, :], d_v, mask=row_ok[:, None] & cols_ok[None, :])
    d_scores = (product(g_hat, tl.trans(v), OPERANDS) + c_row[:, None]) * decay
    d_feat = product(tl.trans(d_scores), q_feat, OPERANDS)
    d_feat += seen_later[:, None] * (product(v, tl.trans(later), OPERANDS) + later_c[None, :])
    _store_logit_grads(dlog_ptr, key_feat * d_feat, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M)

# ---------------------------------------------------------------------------------------------
# Python side: checks, launches, autograd


class _Geometry:
    """Sizes, block sizes and grids of one call (pure data)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, projection: Tensor, chunk_size: int, start: int,
                 has_transform: bool) -> None:
        self.batch, self.length, self.heads, self.head_dim = q.shape
        self.kv_heads, self.value_dim = k.shape[2], v.shape[3]
        # the kernels read x' = M x̃ per query head with a transform (scale 1), else k per kv head (scale d^{-1/4})
        self.key_heads = self.heads if has_transform else self.kv_heads
        self.scale = 1.0 if has_transform else self.head_dim ** -0.25
        self.features = projection.shape[-2]
        self.start = start
        self.block_d = max(16, triton.next_power_of_2(self.head_dim))
        self.block_m = max(16, triton.next_power_of_2(self.features))
        large = max(self.block_m, self.block_d) >= LARGE_TILE
        self.block_t = min(32 if large else 64, max(16, triton.next_power_of_2(chunk_size)))
        self.block_v = min(max(16, triton.next_power_of_2(self.value_dim)), max(16, VALUE_BLOCK))
        self.key_block_v = max(16, self.block_v // 2)
        self.n_chunks = triton.cdiv(self.length, self.block_t)
        self.value_blocks = triton.cdiv(self.value_dim, self.block_v)
        self.key_value_blocks = triton.cdiv(self.value_dim, self.key_block_v)
        self.operands = FEATURE_OPERANDS
        # a shared projection [m, d] is read by every head: a head stride of 0
        self.w_head_stride = 0 if projection.dim() == 2 else self.features * self.head_dim

    @property
    def grid(self) -> tuple[int, int, int]:
        """The chunk kernels': every chunk of every (batch, head), per block of value columns."""
        return (self.n_chunks, self.batch * self.heads, self.value_blocks)

    @property
    def key_grid(self) -> tuple[int, int, int]:
        """The key gradient's: its value blocks are half as wide."""
        return (self.n_chunks, self.batch * self.heads, self.key_value_blocks)

    @property
    def scan_grid(self) -> tuple[int, int, int]:
        """The scans': one program per elementwise tile of every (batch, head)'s m × d_v state."""
        return (self.batch * self.heads, triton.cdiv(self.features, SCAN_TILE[0]),
                triton.cdiv(self.value_dim, SCAN_TILE[1]))

    def sizes(self) -> tuple:
        return (self.length, self.heads, self.key_heads, self.kv_heads, self.head_dim, self.value_dim, self.features,
                self.start, self.n_chunks, self.w_head_stride, self.scale)

    def scan_sizes(self) -> tuple:
        return (self.length, self.heads, self.value_dim, self.features, self.start, self.n_chunks)

    def blocks(self, key_grad: bool = False) -> dict:
        """The chunk kernels' block sizes, products and warps per program (8 for tiles of 64 or more:
        chosen by the compiler's report, see ``LARGE_TILE``; the interpreter ignores warps)."""
        warps = 8 if max(self.block_m, self.block_d) >= 64 else 4
        return dict(OPERANDS=self.operands, BLOCK_T=self.block_t, BLOCK_D=self.block_d, BLOCK_M=self.block_m,
                    BLOCK_V=self.key_block_v if key_grad else self.block_v, D_STEP=min(self.block_d, LOGIT_STEP),
                    num_warps=warps)

    def scan_blocks(self) -> dict:
        return dict(BLOCK_T=self.block_t, SCAN_M=SCAN_TILE[0], SCAN_V=SCAN_TILE[1], num_warps=1)

    def state_buffers(self, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per chunk: the state ``[B·H, chunks, m, d_v]`` and its normaliser ``[B·H, chunks, m]``
        (first each chunk's own part, then, after the scan, the state entering it), the local scale
        and the scale of the entering state ``[B·H, chunks]``."""
        bh, n, m = self.batch * self.heads, self.n_chunks, self.features
        return (like.new_empty(bh, n, m, self.value_dim), like.new_empty(bh, n, m), like.new_empty(bh, n),
                like.new_empty(bh, n))


def _interpreted() -> bool:
    """Whether the kernels were defined under the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return defined_for_the_interpreter(_forward_kernel)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, transform: Tensor | None, state) -> None:
    named = {"q": q, "k": k, "v": v, "projection": projection}
    if transform is not None:
        named["transform"] = transform
    if state is not None:
        named.update({"initial_state.S": state[0], "initial_state.z": state[1], "initial_state.shift": state[2]})
    for name, tensor in named.items():
        if tensor.dtype != torch.float32:
            raise KernelmixError(
                f"the Triton random-feature kernel takes float32 tensors, but {name} is {tensor.dtype}; "
                "cast to float32 first (random_feature_attention does) or use backend=\"torch\""
            )
    if state is not None and any(x.requires_grad for x in state[:3]):
        raise KernelmixError(
            "the Triton random-feature kernel does not differentiate through initial_state (S, z or shift "
            "requires grad); use backend=\"torch\" or detach the state"
        )
    if q.device.type == "cpu" and not _interpreted():
        raise KernelmixError(
            "the Triton random-feature kernel got CPU tensors but Triton's interpreter is off; set "
            "TRITON_INTERPRET=1 in the environment before triton is imported, move the tensors to a GPU, "
            "or use backend=\"torch\""
        )
    if projection.shape[-2] > MAX_FEATURES or q.shape[-1] > MAX_HEAD_DIM:
        raise KernelmixError(
            f"the Triton random-feature kernel holds at most {MAX_FEATURES} features and head dim {MAX_HEAD_DIM} "
            f"(got m={projection.shape[-2]}, d={q.shape[-1]}); use backend=\"torch\""
        )


def _state_tensors(state, geometry: _Geometry, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(S, z, shift) to start from, detached and contiguous: the given state or an empty one."""
    batch, heads, m, dv = geometry.batch, geometry.heads, geometry.features, geometry.value_dim
    if state is None:
        return (like.new_zeros(batch, heads, m, dv), like.new_zeros(batch, heads, m),
                like.new_full((batch, heads), NEG_INF))
    return tuple(x.detach().contiguous() for x in state[:3])


def _as_tuple(state):
    """``initial_state`` as (S, z, shift, length): a tuple, or a RandomFeatureState-like object."""
    if state is None or isinstance(state, (tuple, list)):
        return state
    return (state.S, state.z, state.shift, state.length)




def _kernel_inputs(q: Tensor, k: Tensor, transform: Tensor | None, geometry: _Geometry) -> tuple[Tensor, Tensor]:
    """The queries and keys the kernels read: with a transform, x' = M (d^{-1/4} x) per query head (torch
    products over all rows, the keys expanded to the query heads); without, q and k as they are (the
    kernels scale them). Keeps the [d, d] transform out of the kernels' registers."""
    if transform is None:
        return q, k
    scale = geometry.head_dim ** -0.25
    keys = k.repeat_interleave(geometry.heads // geometry.kv_heads, dim=2)
    return (torch.einsum("bthe,hfe->bthf", q * scale, transform).contiguous(),
            torch.einsum("bthe,hfe->bthf", keys * scale, transform).contiguous())


def _launch_states(k_in, v, projection, doc, state, geometry: _Geometry):
    """The states entering every chunk (the chunk-state kernel, then the scan over chunks):
    (S per chunk, z per chunk, the entering scales, the final (S, z, shift))."""
    chunk_s, chunk_z, local, carried = geometry.state_buffers(v)
    doc_arg = k_in if doc is None else doc
    _chunk_state_kernel[geometry.grid](
        k_in, v, projection, doc_arg, chunk_s, chunk_z, local, *geometry.sizes(), HAS_DOC=doc is not None,
        **geometry.blocks())
    final = (torch.empty_like(state[0]), torch.empty_like(state[1]), torch.empty_like(state[2]))
    _state_scan_kernel[geometry.scan_grid](
        chunk_s, chunk_z, local, doc_arg, *state, carried, *final, *geometry.scan_sizes(),
        HAS_DOC=doc is not None, **geometry.scan_blocks())
    return chunk_s, chunk_z, carried, final


def _launch_forward(q_in, k_in, v, projection, doc, state, geometry: _Geometry):
    """The forward: (out, denominator, key shift, query max, S, z, shift)."""
    batch, length, heads = geometry.batch, geometry.length, geometry.heads
    chunk_s, chunk_z, carried, final = _launch_states(k_in, v, projection, doc, state, geometry)
    out = q_in.new_empty(batch, length, heads, geometry.value_dim)
    row_scalars = [q_in.new_empty(batch, heads, length) for _ in range(3)]  # denominator, key shift, query max
    _forward_kernel[geometry.grid](
        q_in, k_in, v, projection, q_in if doc is None else doc, chunk_s, chunk_z, carried, out, *row_scalars,
        *geometry.sizes(), UNDERFLOW_FLOOR, HAS_DOC=doc is not None, **geometry.blocks(),
    )
    return (out, *row_scalars, *final)


def triton_random_feature_attention(q, k, v, projection, transform, *, chunk_size: int, doc_start,
                                    initial_state=None):
    """Causal random-feature attention by the Triton kernels: the function of the chunked CPU path.

    ``q`` ``[B, T, H, d]``; ``k``, ``v`` ``[B, T, H_kv, d]`` / ``[B, T, H_kv, d_v]``; ``projection``
    ``[m, d]`` or ``[H, m, d]``; ``transform`` ``[H, d, d]`` or None; ``doc_start`` ``[B, T]``
    (absolute) or None; ``initial_state`` None or (S, z, shift, length) — all float32, finite.
    Returns ``(out [B, T, H, d_v], denominator [B, H, T], (S, z, shift, length))``; ``out`` is
    differentiable w.r.t. q, k, v, projection and transform, the rest is not."""
    state = _as_tuple(initial_state)
    _check_inputs(q, k, v, projection, transform, state)
    start = 0 if state is None else int(state[3])
    geometry = _Geometry(q, k, v, projection, chunk_size, start, transform is not None)
    s0, z0, shift0 = _state_tensors(state, geometry, v)
    if geometry.length == 0 or geometry.batch == 0:  # nothing to mix: no launch, the state as it was
        out = v.repeat_interleave(geometry.heads // geometry.kv_heads, dim=2)  # empty, and autograd sees v
        return (out, v.new_zeros(geometry.batch, geometry.heads, geometry.length),
                (s0, z0, shift0, start + geometry.length))
    doc = None if doc_start is None else doc_start.to(device=q.device, dtype=torch.int64).contiguous()
    out, denominator, s, z, shift = _RandomFeatureAttention.apply(
        q, k, v, projection, transform, doc, (s0, z0, shift0), geometry)
    return out, denominator, (s, z, shift, start + geometry.length)


class _RandomFeatureAttention(torch.autograd.Function):
    """The kernels' forward and backward; saves q, k, v, W, M and O(T) row scalars, never features."""

    @staticmethod
    def forward(ctx, q, k, v, projection, transform, doc, state, geometry):
        q, k, v, projection = (x.contiguous() for x in (q, k, v, projection))
        transform = None if transform is None else transform.contiguous()
        out, denominator, shift_rows, q_max, s, z, shift = _launch_forward(
            *_kernel_inputs(q, k, transform, geometry), v, projection, doc, state, geometry)
        ctx.save_for_backward(q, k, v, projection, transform, doc, *state, out, denominator, shift_rows, q_max)
        ctx.geometry = geometry
        ctx.mark_non_differentiable(denominator, s, z, shift)
        return out, denominator, s, z, shift

    @staticmethod
    def backward(ctx, grad_out, *_):
        q, k, v, projection, transform, doc, s0, z0, shift0, out, denominator, shift_rows, q_max = ctx.saved_tensors
        grads = _backward(q, k, v, projection, transform, doc, (s0, z0, shift0), out, denominator, shift_rows, q_max,
                          grad_out, ctx.geometry)
        return (*grads, None, None, None)


def _backward(q, k, v, projection, transform, doc, state, out, denominator, shift_rows, q_max, grad_out,
              geometry: _Geometry):
    """dL/d(q, k, v, projection, transform): the two backward kernels give dv and the per-row
    gradients of the feature logits; torch chains those through the feature map (:func:`_chain_feature_map`)."""
    g = grad_out.float()
    den = denominator.transpose(1, 2)[..., None]  # [B, T, H, 1]
    empty = den <= UNDERFLOW_FLOOR  # zero rows have zero gradients (as safe_ratio)
    safe = torch.where(empty, torch.ones_like(den), den)
    g_hat = torch.where(empty, torch.zeros_like(g), g / safe).contiguous()
    c_row = torch.where(empty, torch.zeros_like(den), -(g * out).sum(-1, keepdim=True) / safe)
    c_row = c_row[..., 0].transpose(1, 2).contiguous()  # [B, H, T]
    batch, length, heads, d = q.shape
    m = geometry.features
    dq_logits = q.new_empty(geometry.value_blocks, batch, length, heads, m)  # per value block
    dk_logits = q.new_empty(geometry.key_value_blocks, batch, length, heads, m)
    dv = q.new_empty(batch, length, heads, geometry.value_dim)
    common = dict(HAS_DOC=doc is not None, **geometry.blocks())
    q_in, k_in = _kernel_inputs(q, k, transform, geometry)
    doc_arg = q if doc is None else doc
    # forward direction: the states entering each chunk again (recomputed: nothing of size T·m saved)
    chunk_s, chunk_z, carried, _ = _launch_states(k_in, v, projection, doc, state, geometry)
    _query_grad_kernel[geometry.grid](
        q_in, k_in, v, projection, doc_arg, chunk_s, chunk_z, carried, g_hat, c_row, shift_rows, q_max, dq_logits,
        *geometry.sizes(), **common)
    # reverse direction: each chunk's part of R (in the same buffers), the scan from the last chunk, the keys
    _reverse_state_kernel[geometry.grid](
        q_in, projection, doc_arg, g_hat, c_row, shift_rows, q_max, carried, chunk_s, chunk_z,
        *geometry.sizes(), **common)
    _reverse_scan_kernel[geometry.scan_grid](
        chunk_s, chunk_z, doc_arg, shift_rows, carried, *geometry.scan_sizes(), HAS_DOC=doc is not None,
        **geometry.scan_blocks())
    _key_grad_kernel[geometry.key_grid](
        q_in, k_in, v, projection, doc_arg, chunk_s, chunk_z, g_hat, c_row, shift_rows, q_max, dk_logits, dv,
        *geometry.sizes(), HAS_DOC=doc is not None, **geometry.blocks(key_grad=True))
    d_logits = (dq_logits.sum(0), dk_logits.sum(0))  # the value blocks' parts
    groups = heads // geometry.kv_heads
    keys = k.repeat_interleave(groups, dim=2)  # [B, T, H, d]: query head h reads kv head h // groups
    weights = projection if projection.dim() == 3 else projection.expand(heads, m, d)
    primes = (None, None) if transform is None else (q_in, k_in)  # x' = M x̃, as the kernels read them
    d_q, dw_q, dm_q = _chain_feature_map(q, primes[0], d_logits[0], weights, transform, is_key=False)
    d_k, dw_k, dm_k = _chain_feature_map(keys, primes[1], d_logits[1], weights, transform, is_key=True)
    d_k = d_k.view(batch, length, geometry.kv_heads, groups, d).sum(3)
    d_v = dv.view(batch, length, geometry.kv_heads, groups, geometry.value_dim).sum(3)
    d_w = dw_q + dw_k  # [H, m, d]
    d_w = d_w.sum(0) if projection.dim() == 2 else d_w
    d_m = None if transform is None else dm_q + dm_k
    return d_q, d_k, d_v, d_w, d_m



def _chain_feature_map(x: Tensor, x_prime: Tensor | None, d_logits: Tensor, weights: Tensor, transform: Tensor | None,
                       *, is_key: bool):
    """From dL/dℓ ``[B, T, H, m]`` of the logits ℓ = W x' (keys: − ½‖x'‖²), x' = M x̃, x̃ = d^{-1/4} x
    (``x`` ``[B, T, H, d]``, ``x_prime`` x' when there is a transform, W ``[H, m, d]``, M ``[H, d, d]`` or
    None) to dL/dx and this side's dL/dW and dL/dM: four fp32 products over all rows, in place of
    per-program accumulators in the kernels (an [m, d] and a [d, d] accumulator per program spilled
    on sm_90 at m = d = 128)."""
    scale = x.shape[-1] ** -0.25
    x_tilde = x * scale
    x_prime = x_tilde if transform is None else x_prime
    d_prime = torch.einsum("bthm,hmd->bthd", d_logits, weights)
    if is_key:
        d_prime = d_prime - d_logits.sum(-1, keepdim=True) * x_prime
    d_w = torch.einsum("bthm,bthd->hmd", d_logits, x_prime)
    if transform is None:
        return d_prime * scale, d_w, None
    d_m = torch.einsum("bthf,bthe->hfe", d_prime, x_tilde)
    return torch.einsum("bthf,hfe->bthe", d_prime, transform) * scale, d_w, d_m





def feature_launches(batch: int, heads: int, kv_heads: int, length: int, head_dim: int, value_dim: int,
                     features: int, *, chunk_size: int, has_transform: bool, has_doc: bool) -> list[KernelLaunch]:
    """The kernels one differentiated call launches at these sizes (forward: the chunk states, the
    scan, the outputs; backward: the states and the scan again, the query gradients, the reverse
    states, their scan, the key gradients), with the grids, blocks and warps of the launches above
    (the same ``_Geometry``, built on meta tensors: no memory, no GPU)."""
    q = torch.empty(batch, length, heads, head_dim, device="meta")
    k = torch.empty(batch, length, kv_heads, head_dim, device="meta")
    v = torch.empty(batch, length, kv_heads, value_dim, device="meta")
    projection = torch.empty(heads, features, head_dim, device="meta")  # per head (a shared one launches the same)
    geometry = _Geometry(q, k, v, projection, chunk_size, 0, has_transform)
    tiles = dict(block_t=geometry.block_t, block_d=geometry.block_d, block_m=geometry.block_m,
                 block_v=geometry.block_v, chunks=geometry.n_chunks, has_transform=has_transform,
                 features=features, value_dim=value_dim, scan_tile=SCAN_TILE)
    launches = []
    for name, kernel, scan, calls in (("features_chunk_states", _chunk_state_kernel, False, 2),
                                      ("features_state_scan", _state_scan_kernel, True, 2),
                                      ("features_forward", _forward_kernel, False, 1),
                                      ("features_query_grad", _query_grad_kernel, False, 1),
                                      ("features_reverse_states", _reverse_state_kernel, False, 1),
                                      ("features_reverse_scan", _reverse_scan_kernel, True, 1),
                                      ("features_key_grad", _key_grad_kernel, False, 1)):
        blocks = geometry.scan_blocks() if scan else geometry.blocks(key_grad=kernel is _key_grad_kernel)
        warps = blocks.pop("num_warps")
        constexprs = dict(HAS_DOC=has_doc) | blocks
        constexprs = {key: value for key, value in constexprs.items() if key in kernel.arg_names}
        grid = geometry.scan_grid if scan else geometry.key_grid if kernel is _key_grad_kernel else geometry.grid
        launches.append(KernelLaunch(name, kernel, grid, constexprs, warps,
                                     aot_signature(kernel, constexprs, {"doc_ptr": "*i64"}, {"scale", "floor"}),
                                     dict(tiles, block_v=blocks.get("BLOCK_V", geometry.block_v)), calls))
    return launches
