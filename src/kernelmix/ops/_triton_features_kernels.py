"""The Triton kernels (device code) of causal positive random-feature attention (Performer,
DARKFormer; docs/math.md §6–7).

The same function as the chunked CPU path (``random_features._chunked_attention``), with the same
stabilisers: queries divided by their own max over features, keys shifted by the causal running
max s_i of their logit maxima (per document, at least the carried shift for rows that continue an
``initial_state``), the state (S, z) kept at scale exp(−shift) and rescaled when the shift grows,
and a zero row (zero gradients) where the denominator is at or below √tiny(float32).

Design: chunk-parallel, as flash-linear-attention's chunked linear attention, with the running-max
stabiliser carried through the states between chunks, in spans of up to ``SPAN_BLOCKS`` chunks of C
rows (grid: spans × B·H × value blocks): one program walks its span's chunks in order (the key
gradient from the last) and carries the state in registers from one chunk to the next, so the
states reach memory once per span, not once per chunk. The forward is three launches:

1. ``chunk_state_kernel``: each span's own part of the state, ΔS_c = Σ_j exp(ℓ^k_j − σ'_c) φ'_j v_jᵀ
   and Δz_c over the keys of the span's last document, at its local scale σ'_c (their max logit);
2. ``state_scan_kernel``: one program per elementwise tile of the m × d_v state walks the spans
   in order, S_c = exp(σ_{c−1} − σ_c) S_{c−1} + exp(σ'_c − σ_c) ΔS_c with σ_c = max(σ_{c−1}, σ'_c)
   (or ΔS_c alone where a document begins in the span), and leaves in each span's slot the state
   entering it and its scale: a memory-bound pass over n_s·m·d_v numbers, no products;
3. ``forward_kernel``: each chunk's outputs from its own keys (a C × C score tile with the
   segmented running max as a masked C × C max, no scan) and the state entering it, which the walk
   updates after each chunk by the scan's step (``_walk_step``); it stores the scale entering every
   chunk for the reverse direction.

The feature map is fused in the forward: a program loads its C × d queries and keys (in their own
dtype), applies d^{-1/4} and the projection W with ``tl.dot`` at fp32 accuracy (the feature logits
stay fp32) and forms the features in registers, so the forward keeps no T × m tensor. DARKFormer's M
is folded into the projection (ℓ = W M x̃: the kernels read q and k with W' = W M per head), and its
keys' −½‖M x̃‖² is read (``STORED_NORM``), formed once by ``key_norm_kernel`` (``_triton_features_chain``).
The products of features, states and values take ``FEATURE_OPERANDS`` (TF32 on tensor cores by
default; ``_triton_products``), the normalisers and states accumulate in fp32. Grouped heads are
indexed (query head h reads kv head h // (H / H_kv)), never expanded.

The backward saves q, k, v, W, M, W' and the keys' half norms (DARKFormer), per-row scalars (the key
shift s_i, the query max and the denominator), the output at fp32, the scale entering each chunk and
the states entering each span.
It forms the feature logits of both sides once (``logits_kernel``), which its span kernels read
(``_stored_logits``). With g = dL/do, ĝ_i = g_i / den_i and c_i = −(g_i · o_i) / den_i (like
flash-attention's D; 1/den from torch, c from the reverse-state kernel when it holds every value
column; ĝ is never a tile: 1/den scales the small products of g), the gradient of an unnormalised
score P_ij is ĝ_i · v_j + c_i. Then, in this order:

- ``reverse_state_kernel`` and ``reverse_scan_kernel`` (reverse direction): R_c = Σ_{i after
  span c, same document} exp(σ_c − s_i) φq_i [ĝ_i, c_i]ᵀ, each span's part in parallel (its rows whose
  document began before the span, at the scale entering it) and a scan from the last span; its
  scales are the forward's saved shifts, every factor ≤ 1;
- ``query_grad_kernel`` (forward direction, spans walked as in the forward): dφq_i = Σ_j exp(ℓ^k_j −
  s_i) (ĝ_i · v_j + c_i), the earlier chunks through the entering state, per block of features;
- ``key_grad_kernel``: dφk_j, per block of features, and ``value_grad_kernel``: dv_j, per block of
  value columns, each from the chunk's own rows and the reverse state, which their walks from the
  span's last chunk extend by each chunk's rows.

The two logit-gradient kernels (queries', keys') run per block of features with every value column:
a block of dφ needs only its own features and the full score gradient ĝ vᵀ + c, so each program reads
only its own features' logits and stores its columns of dℓ = φ ⊙ dφ ``[T, m]``, whole. The value
gradient needs every feature (a score is φq · φk) and runs per block of value columns, as the
forward. The chain kernels of ``_triton_features_chain`` take dℓ through the feature map (dx̃ = dℓ W'
with the keys' norm term, dW' = Σ dℓᵀ x̃, and DARKFormer's Σ_i s_i x̃_i x̃_iᵀ for dM): the span kernels
keep no dW [m, d] or dM [d, d] accumulator (at m = d = 128 those spilled on sm_90 and made ptxas take
minutes). Memory: the span states, B·H·n_s·m·(d_v + 1) fp32 (kept for the backward), the output at
fp32 for 16-bit rows, and during the backward as many span states for the reverse direction and the
two sides' logits and logit gradients (T × m fp32 each); no T × T tensor.

Loops over chunks are ``while`` loops: Triton 3.6's interpreter passes a run-time scalar as a
1-element array, which ``range`` cannot take under NumPy ≥ 2.4; on a GPU both compile to the same loop.

Sizes: any T ≥ 0, m ≤ 256 features, head dim d ≤ 256 and d_v ≤ 256 (one register tile each: the
logit gradients hold every value column; beyond that use ``backend="torch"``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_features_rows import feature_logits, row_base
from ._triton_products import product, product_into, stored_as

__all__ = ["chunk_state_kernel", "state_scan_kernel", "forward_kernel", "query_grad_kernel", "reverse_state_kernel",
           "reverse_scan_kernel", "key_grad_kernel", "value_grad_kernel"]

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
def _stored_logits(l_ptr, b, h, T, H, m_feats, t, row_ok, first_feature, BLOCK_M: tl.constexpr):
    """The feature logits of the rows t of head h, the features from ``first_feature``, from ``[B, T, H,
    m]`` (``logits_kernel`` forms them once for the backward's kernels: keys with −½‖x'‖²); padding is 0."""
    offs_m = first_feature + tl.arange(0, BLOCK_M)
    return tl.load(l_ptr + ((b * T + t) * H + h)[:, None] * m_feats + offs_m[None, :],
                   mask=row_ok[:, None] & (offs_m < m_feats)[None, :], other=0.0)


@triton.jit
def _row_features(q_head, k_head, q_row_stride, k_row_stride, t, row_ok, w_head, scale, d, m_feats, norm_row,
                  STORED_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  D_STEP: tl.constexpr):
    """The chunk's query and key feature logits from its rows (keys with −½‖x'‖²) and which are real
    (``valid``): the forward's kernels form them (the backward's read them stored)."""
    q_logits = feature_logits(q_head, q_row_stride, t, row_ok, w_head, scale, d, m_feats, 0, norm_row, False, False,
                              BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    k_logits = feature_logits(k_head, k_row_stride, t, row_ok, w_head, scale, d, m_feats, 0, norm_row, True,
                              STORED_NORM, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    return q_logits, k_logits, valid


@triton.jit
def _load_value_block(ptr, t, row_ok, row_stride, cols, cols_ok):
    """A [rows, value columns] tile of the consecutive rows t in fp32, from any float dtype."""
    rows, local = row_base(ptr, t, row_stride)
    return tl.load(rows + local[:, None] * row_stride + cols[None, :], mask=row_ok[:, None] & cols_ok[None, :],
                   other=0.0).to(tl.float32)


# ---------------------------------------------------------------------------------------------
# The states between chunks (forward and backward)


@triton.jit
def _chunk_program(H, H_KV, dv, BLOCK_V: tl.constexpr):
    """This program's chunk, (batch, query head), value head and block of value columns, from the grid
    (chunks, B·H, value blocks): (c, pid_bh, pid_v, b, h, kv, cols, cols_ok)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: B·T·H·d may pass 2^31
    h = pid_bh % H
    kv = h // (H // H_KV)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    return c, pid_bh, pid_v, b, h, kv, cols, cols < dv


@triton.jit
def _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, first_feature, BLOCK_M: tl.constexpr):
    """Where this program's block of chunk c's state (its features from ``first_feature``, its value
    columns) lives in ``[B·H, chunks, m, d_v]`` (offsets, mask) and its normaliser part in
    ``[B·H, chunks, m]`` (offsets, mask)."""
    offs_m = first_feature + tl.arange(0, BLOCK_M)
    feat_ok = offs_m < m_feats
    rows = (pid_bh * n_chunks + c).to(tl.int64) * m_feats + offs_m
    return rows[:, None] * dv + cols[None, :], feat_ok[:, None] & cols_ok[None, :], rows, feat_ok


@triton.jit
def _span_chunks(c, n_chunks, SPAN_BLOCKS: tl.constexpr):
    """Span c's first chunk and how many chunks it holds (the last span may hold fewer)."""
    first = c * SPAN_BLOCKS
    return first, tl.minimum(n_chunks - first, SPAN_BLOCKS)


@triton.jit
def chunk_state_kernel(k_ptr, v_ptr, w_ptr, norm_ptr, doc_ptr, ds_ptr, dz_ptr, dsig_ptr,
                       T, H, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale, n_spans,
                       HAS_DOC: tl.constexpr, STORED_NORM: tl.constexpr, OPERANDS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                       D_STEP: tl.constexpr, SPAN_BLOCKS: tl.constexpr):
    """Span c's own part of the state, all spans in parallel, its chunks walked in order: the keys of
    the span's last document at the span's local scale σ'_c (the max of their logit maxima, grown as the
    walk meets them, the sum rescaled when it grows), ΔS_c = Σ_j exp(ℓ^k_j − σ'_c) v_jᵀ and Δz_c, with
    σ'_c (every factor ≤ 1)."""
    c, pid_bh, pid_v, b, h, kv, cols, cols_ok = _chunk_program(H, H_KV, dv, BLOCK_V)
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    span_end = tl.minimum(T, (first + n_sub) * BLOCK_T)
    if HAS_DOC:
        doc_last = tl.load(doc_ptr + b * T + span_end - 1)  # the span's last row's document
    else:
        doc_last = 0
    delta = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    delta_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    local = -3.0e38  # below every logit, finite: the first key's rescale is exp(−huge) = 0, never −inf − −inf
    j = 0
    while j < n_sub:  # (a while loop: see the note at the top)
        t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, first + j, T, start, BLOCK_T, HAS_DOC)
        k_logits = feature_logits(k_ptr + b * T * H_KV * d + kv * d, H_KV * d, t, row_ok, w_ptr + h * w_head_stride,
                                  scale, d, m_feats, 0, norm_ptr + pid_bh * T, True, STORED_NORM, BLOCK_T, BLOCK_D,
                                  BLOCK_M, D_STEP)
        valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
        in_last = row_ok & (pos >= doc_last)  # the keys a later span may see
        key_max = tl.max(tl.where(valid, k_logits, float("-inf")), axis=1)
        grown = tl.maximum(local, tl.max(tl.where(in_last, key_max, float("-inf")), axis=0))
        keep = tl.exp(local - grown)
        weighted = _exp_where(k_logits - grown, valid & in_last[:, None])
        v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
        delta = product_into(tl.trans(weighted), v, keep * delta, OPERANDS)
        delta_z = keep * delta_z + tl.sum(weighted, axis=0)
        local = grown
        j += 1
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_spans, m_feats, dv, cols, cols_ok, 0, BLOCK_M)
    tl.store(ds_ptr + offsets, delta, mask=mask)
    if pid_v == 0:
        tl.store(dz_ptr + rows, delta_z, mask=feat_ok)
        tl.store(dsig_ptr + pid_bh * n_spans + c, local)


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
def state_scan_kernel(ds_ptr, dz_ptr, dsig_ptr, doc_ptr, s0_ptr, z0_ptr, shift0_ptr, carried_ptr,
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
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_chunks, m_feats, dv, cols, cols_ok, 0, BLOCK_M)
    return (tl.load(ds_ptr + offsets, mask=mask, other=0.0), tl.load(dz_ptr + rows, mask=feat_ok, other=0.0),
            tl.load(carried_ptr + pid_bh * n_chunks + c))


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _walk_step(state_s, state_z, sigma, key_feat, shift, v, doc_ptr, b, c, t, row_ok, pos, doc, T, start,
               OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
    """The state entering chunk c + 1 from the one entering chunk c, inside a span's walk: the step
    of ``state_scan_kernel`` with chunk c's own part formed in place. The new scale is the key shift of
    the chunk's last row (the max of the carried scale, unless its document restarts here, and of its
    document's keys in the chunk), so its keys enter at exp(ℓ − σ) = φk · exp(s_j − σ) ≤ 1."""
    new_sigma = _last_row(shift, t, c, T, BLOCK_T)
    keep = tl.where(_restarts(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC), 0.0, tl.exp(sigma - new_sigma))
    in_last = row_ok & (pos >= _last_row(doc, t, c, T, BLOCK_T))
    weighted = key_feat * _exp_where(shift - new_sigma, in_last)[:, None]
    return (product_into(tl.trans(weighted), v, keep * state_s, OPERANDS), keep * state_z + tl.sum(weighted, axis=0),
            new_sigma)


@triton.jit
def forward_kernel(q_ptr, k_ptr, v_ptr, w_ptr, norm_ptr, doc_ptr, ds_ptr, dz_ptr, carried_ptr,
                   out_ptr, kept_ptr, den_ptr, shift_ptr, qmax_ptr, fine_ptr,
                   T, H, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale, n_spans, floor,
                   HAS_DOC: tl.constexpr, STORED_NORM: tl.constexpr, OPERANDS: tl.constexpr, KEEP_FP32: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                   D_STEP: tl.constexpr, SPAN_BLOCKS: tl.constexpr):
    """The outputs of one span, all spans in parallel, its chunks walked in order: each chunk's own
    keys (a C × C masked score tile) and the earlier chunks through the state entering it, which the
    walk carries (in registers) from the span's entering state; the scale entering each chunk is
    stored in ``fine`` for the reverse direction."""
    c, pid_bh, pid_v, b, h, kv, cols, cols_ok = _chunk_program(H, H_KV, dv, BLOCK_V)
    state_s, state_z, sigma = _entering_state(ds_ptr, dz_ptr, carried_ptr, pid_bh, c, n_spans, m_feats, dv,
                                              cols, cols_ok, BLOCK_M)
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    j = 0
    while j < n_sub:  # (a while loop: see the note at the top)
        chunk = first + j
        t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, chunk, T, start, BLOCK_T, HAS_DOC)
        q_logits, k_logits, valid = _row_features(
            q_ptr + b * T * H * d + h * d, k_ptr + b * T * H_KV * d + kv * d, H * d, H_KV * d, t, row_ok,
            w_ptr + h * w_head_stride, scale, d, m_feats, norm_ptr + pid_bh * T, STORED_NORM, BLOCK_T, BLOCK_D,
            BLOCK_M, D_STEP)
        q_max = tl.where(row_ok, tl.max(tl.where(valid, q_logits, float("-inf")), axis=1), 0.0)
        q_feat = _exp_where(q_logits - q_max[:, None], valid)
        visible = _visible(t, pos, doc, row_ok)
        continuing = row_ok & (doc < start + chunk * BLOCK_T)
        key_max = tl.max(tl.where(valid, k_logits, float("-inf")), axis=1)
        shift = _key_shift(key_max, visible, continuing, sigma, row_ok)
        key_feat = _exp_where(k_logits - shift[:, None], valid)  # ≤ 1
        v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
        decay = _exp_where(shift[None, :] - shift[:, None], visible)  # exp(s_j − s_i) ≤ 1
        scores = product(q_feat, tl.trans(key_feat), OPERANDS) * decay
        carry = _exp_where(sigma - shift, continuing)  # the entering state reaches row i at exp(σ − s_i)
        numerator = product(scores, v, OPERANDS) + carry[:, None] * product(q_feat, state_s, OPERANDS)
        denominator = tl.sum(scores, axis=1) + carry * tl.sum(q_feat * state_z[None, :], axis=1)
        empty = denominator <= floor
        out = tl.where(empty[:, None], 0.0, numerator / tl.where(empty, 1.0, denominator)[:, None])
        out_offsets = (b * T + t)[:, None] * H * dv + h * dv + cols[None, :]
        tl.store(out_ptr + out_offsets, stored_as(out, out_ptr), mask=row_ok[:, None] & cols_ok[None, :])
        if KEEP_FP32:  # rows narrower than fp32: the backward's c = −g·o/den takes o at fp32 (``kept``)
            tl.store(kept_ptr + out_offsets, out, mask=row_ok[:, None] & cols_ok[None, :])
        if pid_v == 0:  # the per-row scalars: one value block writes them (a branch, not `row_ok & (pid_v == 0)`,
            # whose dtype Triton 3.9's interpreter turns into int32, which a mask may not be)
            tl.store(den_ptr + pid_bh * T + t, denominator, mask=row_ok)
            tl.store(shift_ptr + pid_bh * T + t, shift, mask=row_ok)
            tl.store(qmax_ptr + pid_bh * T + t, q_max, mask=row_ok)
            tl.store(fine_ptr + pid_bh * n_chunks + chunk, sigma)
        state_s, state_z, sigma = _walk_step(state_s, state_z, sigma, key_feat, shift, v, doc_ptr, b, chunk, t, row_ok,
                                             pos, doc, T, start, OPERANDS, BLOCK_T, HAS_DOC)
        j += 1


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _feature_program(H, H_KV, dv, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's span, (batch, query head), value head and block of features, from the grid (spans,
    B·H, feature blocks); it holds every value column (BLOCK_V ≥ d_v):
    (c, pid_bh, b, h, kv, first_feature, cols, cols_ok)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    first_feature = tl.program_id(2) * BLOCK_M
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv = h // (H // H_KV)
    cols = tl.arange(0, BLOCK_V)
    return c, pid_bh, b, h, kv, first_feature, cols, cols < dv


@triton.jit
def _query_features(lq_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, m_feats, first_feature, BLOCK_M: tl.constexpr):
    """The chunk's query features (the block from ``first_feature``) again, at the forward's query max (so
    they are the forward's)."""
    q_logits = _stored_logits(lq_ptr, b, h, T, H, m_feats, t, row_ok, first_feature, BLOCK_M)
    valid = row_ok[:, None] & ((first_feature + tl.arange(0, BLOCK_M)) < m_feats)[None, :]
    q_max = tl.load(qmax_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    return _exp_where(q_logits - q_max[:, None], valid)


@triton.jit
def _gradient_features(lq_ptr, lk_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, c, pid_bh, T, H, m_feats, start,
                       first_feature, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """What every gradient kernel needs of chunk c: its rows, its query and key features (the block from
    ``first_feature``) again from the saved query max and key shift (so they are the forward's), and the
    masks: (t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, decay)."""
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    q_feat = _query_features(lq_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, m_feats, first_feature, BLOCK_M)
    k_logits = _stored_logits(lk_ptr, b, h, T, H, m_feats, t, row_ok, first_feature, BLOCK_M)
    valid = row_ok[:, None] & ((first_feature + tl.arange(0, BLOCK_M)) < m_feats)[None, :]
    shift = tl.load(shift_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    key_feat = _exp_where(k_logits - shift[:, None], valid)
    visible = _visible(t, pos, doc, row_ok)
    continuing = row_ok & (doc < start + c * BLOCK_T)
    decay = _exp_where(shift[None, :] - shift[:, None], visible)
    return t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, decay


@triton.jit
def _gradient_rows(g_ptr, inv_ptr, c_ptr, b, h, pid_bh, t, row_ok, T, H, dv, cols, cols_ok):
    """g of the chunk's rows (these value columns), 1/den_i (0 on empty rows) and c_i: ĝ_i = g_i / den_i
    is never formed as a tile: the kernels scale the small products of g by 1/den per row (a scaled
    copy of the C × V tile costs registers the walks do not have at d = m = d_v = 128)."""
    g = _load_value_block(g_ptr + b * T * H * dv + h * dv, t, row_ok, H * dv, cols, cols_ok)
    return (g, tl.load(inv_ptr + pid_bh * T + t, mask=row_ok, other=0.0),
            tl.load(c_ptr + pid_bh * T + t, mask=row_ok, other=0.0))


@triton.jit
def _logit_grad_chunk(lq_ptr, lk_ptr, v_ptr, g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh,
                      T, H, H_KV, dv, m_feats, start, first_feature, cols, cols_ok, HAS_DOC: tl.constexpr,
                      OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """What both logit-gradient kernels need of chunk c: its rows and features (``_gradient_features``),
    v and g (every value column), 1/den, c, and the gradient of its unnormalised scores,
    dP_ij = (ĝ_i · v_j + c_i) exp(s_j − s_i) on the masked C × C tile."""
    t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, decay = _gradient_features(
        lq_ptr, lk_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, c, pid_bh, T, H, m_feats, start, first_feature, HAS_DOC,
        BLOCK_T, BLOCK_M)
    v = _load_value_block(v_ptr + b * T * H_KV * dv + kv * dv, t, row_ok, H_KV * dv, cols, cols_ok)
    g, inv, c_row = _gradient_rows(g_ptr, inv_ptr, c_ptr, b, h, pid_bh, t, row_ok, T, H, dv, cols, cols_ok)
    d_scores = (product(g, tl.trans(v), OPERANDS) * inv[:, None] + c_row[:, None]) * decay
    return t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, v, g, inv, c_row, d_scores


@triton.jit
def _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, T, H, m_feats, first_feature, BLOCK_M: tl.constexpr):
    """dL/dlogit of the chunk's rows, this program's block of features, into ``[B, T, H, m]`` (torch
    chains them through the feature map: no dW, dM accumulators here)."""
    offs_m = first_feature + tl.arange(0, BLOCK_M)
    rows = (b * T + t) * H + h
    tl.store(dlog_ptr + rows[:, None] * m_feats + offs_m[None, :], d_logits,
             mask=row_ok[:, None] & (offs_m < m_feats)[None, :])


@triton.jit
def _reverse_step(later, q_feat, g_hat, row_scale, shift, sigma, continuing, fine_ptr, doc_ptr, b, pid_bh, chunk,
                  n_chunks, T, start, OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
    """R entering chunk c − 1 (from the later rows) from R entering chunk c, inside a span's walk back:
    R_{c−1} = exp(σ_{c−1} − σ_c) R_c + ΔR_c, or ΔR_c alone where chunk c's last document begins inside
    it, with ΔR_c from this chunk's rows that continue the previous chunk's document (``g_hat`` times
    ``row_scale`` per row is ĝ). Returns the new R, the factor on the old one and those rows' weighted
    features (for the c part)."""
    carried = tl.load(fine_ptr + pid_bh * n_chunks + chunk)  # the scale entering this chunk
    back = tl.where(_restarts(doc_ptr, b, chunk, T, start, BLOCK_T, HAS_DOC), 0.0, tl.exp(carried - sigma))
    reads_back = q_feat * _exp_where(carried - shift, continuing)[:, None]
    return (product_into(tl.trans(reads_back * row_scale[:, None]), g_hat, back * later, OPERANDS), back,
            reads_back)


@triton.jit
def query_grad_kernel(lq_ptr, lk_ptr, v_ptr, doc_ptr, ds_ptr, dz_ptr, carried_ptr,
                       g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr,
                       T, H, H_KV, dv, m_feats, start, n_chunks, n_spans,
                       HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                       SPAN_BLOCKS: tl.constexpr):
    """Forward direction, all spans in parallel, each span's chunks walked in order as the forward
    does, one program per block of features with every value column: dφq_i = Σ_j exp(ℓ^k_j − s_i)
    (ĝ_i·v_j + c_i), the earlier chunks through the state entering the chunk (the forward's saved span
    state, these features' rows of it, carried by the walk); stored as dL/dℓ^q = φq ⊙ dφq, whole (a
    block of features needs only its own features and the full score gradient ĝ vᵀ + c)."""
    c, pid_bh, b, h, kv, first_feature, cols, cols_ok = _feature_program(H, H_KV, dv, BLOCK_M, BLOCK_V)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_spans, m_feats, dv, cols, cols_ok, first_feature,
                                                      BLOCK_M)
    state_s = tl.load(ds_ptr + offsets, mask=mask, other=0.0)
    state_z = tl.load(dz_ptr + rows, mask=feat_ok, other=0.0)
    sigma = tl.load(carried_ptr + pid_bh * n_spans + c)
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    j = 0
    while j < n_sub:  # (a while loop: see the note at the top)
        chunk = first + j
        t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, v, g, inv, c_row, d_scores = _logit_grad_chunk(
            lq_ptr, lk_ptr, v_ptr, g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, chunk, pid_bh, T, H,
            H_KV, dv, m_feats, start, first_feature, cols, cols_ok, HAS_DOC, OPERANDS, BLOCK_T, BLOCK_M)
        d_feat = product(d_scores, key_feat, OPERANDS)
        carry = _exp_where(sigma - shift, continuing)
        from_state = product(g, tl.trans(state_s), OPERANDS) * inv[:, None] + c_row[:, None] * state_z[None, :]
        d_logits = q_feat * (d_feat + carry[:, None] * from_state)  # the query max is detached
        _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, T, H, m_feats, first_feature, BLOCK_M)
        state_s, state_z, sigma = _walk_step(state_s, state_z, sigma, key_feat, shift, v, doc_ptr, b, chunk, t, row_ok,
                                             pos, doc, T, start, OPERANDS, BLOCK_T, HAS_DOC)
        j += 1


@triton.jit
def reverse_state_kernel(lq_ptr, doc_ptr, g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, carried_ptr,
                          rs_ptr, rz_ptr, out_ptr, T, H, H_KV, dv, m_feats, start, n_chunks,
                          n_spans, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr, FORMS_C: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr, SPAN_BLOCKS: tl.constexpr):
    """Span c's own part of the reverse state, all spans in parallel (its chunks in any order): its rows
    that continue the document of span c − 1's last row, at the scale of that row (the scale entering
    the span), ΔR_c = Σ_i exp(σ_{c−1} − s_i) φq_i [ĝ_i, c_i]ᵀ (every factor ≤ 1; value block 0 stores the c
    part). A row reaches the keys before its span exactly when its document began before the span,
    and at that absolute scale: no chain of rescales inside the span. With ``FORMS_C`` (one block holds
    every value column) it forms c_i = −(g_i · o_i) / den_i itself, from g and the fp32 output ``out``,
    and stores it for the logit gradients (which run after it): one pass fewer over g and o."""
    c, pid_bh, pid_v, b, h, kv, cols, cols_ok = _chunk_program(H, H_KV, dv, BLOCK_V)
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    carried = tl.load(carried_ptr + pid_bh * n_spans + c)
    delta = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    delta_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    j = 0
    while j < n_sub:  # (a while loop: see the note at the top)
        t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, first + j, T, start, BLOCK_T, HAS_DOC)
        q_feat = _query_features(lq_ptr, qmax_ptr, b, h, pid_bh, t, row_ok, T, H, m_feats, 0, BLOCK_M)
        shift = tl.load(shift_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
        reads_back = q_feat * _exp_where(carried - shift, row_ok & (doc < start + first * BLOCK_T))[:, None]
        if FORMS_C:
            g = _load_value_block(g_ptr + b * T * H * dv + h * dv, t, row_ok, H * dv, cols, cols_ok)
            inv = tl.load(inv_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
            o = _load_value_block(out_ptr + b * T * H * dv + h * dv, t, row_ok, H * dv, cols, cols_ok)
            c_row = -tl.sum(g * o, axis=1) * inv
            tl.store(c_ptr + pid_bh * T + t, c_row, mask=row_ok)
        else:
            g, inv, c_row = _gradient_rows(g_ptr, inv_ptr, c_ptr, b, h, pid_bh, t, row_ok, T, H, dv, cols, cols_ok)
        delta = product_into(tl.trans(reads_back * inv[:, None]), g, delta, OPERANDS)
        delta_z += tl.sum(reads_back * c_row[:, None], axis=0)
        j += 1
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_spans, m_feats, dv, cols, cols_ok, 0, BLOCK_M)
    tl.store(rs_ptr + offsets, delta, mask=mask)
    if pid_v == 0:
        tl.store(rz_ptr + rows, delta_z, mask=feat_ok)


@triton.jit
def reverse_scan_kernel(rs_ptr, rz_ptr, doc_ptr, shift_ptr, carried_ptr, T, H, dv, m_feats, start, n_chunks,
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
def key_grad_kernel(lq_ptr, lk_ptr, v_ptr, doc_ptr, rs_ptr, rz_ptr, fine_ptr,
                     g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr,
                     T, H, H_KV, dv, m_feats, start, n_chunks, n_spans,
                     HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                     SPAN_BLOCKS: tl.constexpr):
    """Reverse direction, all spans in parallel, each span's chunks walked from its last, one program per
    block of features with every value column: dφk_j from the chunk's own rows and from the later rows of
    the same document through the reverse state R_c (these features' rows of it; at most 1 per term),
    which the walk carries from the span's slot (the later spans' rows) and extends by each chunk's rows
    (``_reverse_step``); dL/dℓ^k = φk ⊙ dφk stored, whole."""
    c, pid_bh, b, h, kv, first_feature, cols, cols_ok = _feature_program(H, H_KV, dv, BLOCK_M, BLOCK_V)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_spans, m_feats, dv, cols, cols_ok, first_feature,
                                                      BLOCK_M)
    later = tl.load(rs_ptr + offsets, mask=mask, other=0.0)  # R: the later rows' ĝ part
    later_c = tl.load(rz_ptr + rows, mask=feat_ok, other=0.0)  # and their c part
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    j = n_sub - 1
    while j >= 0:  # (a while loop: see the note at the top)
        chunk = first + j
        t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, v, g, inv, c_row, d_scores = _logit_grad_chunk(
            lq_ptr, lk_ptr, v_ptr, g_ptr, inv_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, chunk, pid_bh, T, H,
            H_KV, dv, m_feats, start, first_feature, cols, cols_ok, HAS_DOC, OPERANDS, BLOCK_T, BLOCK_M)
        sigma = _last_row(shift, t, chunk, T, BLOCK_T)  # R's scale: the chunk's last row's
        seen_later = _exp_where(shift - sigma, row_ok & (pos >= _last_row(doc, t, chunk, T, BLOCK_T)))
        d_feat = product(tl.trans(d_scores), q_feat, OPERANDS)
        d_feat += seen_later[:, None] * (tl.trans(product(later, tl.trans(v), OPERANDS)) + later_c[None, :])
        _store_logit_grads(dlog_ptr, key_feat * d_feat, b, h, t, row_ok, T, H, m_feats, first_feature, BLOCK_M)
        later, back, reads_back = _reverse_step(later, q_feat, g, inv, shift, sigma, continuing, fine_ptr, doc_ptr, b,
                                                pid_bh, chunk, n_chunks, T, start, OPERANDS, BLOCK_T, HAS_DOC)
        later_c = back * later_c + tl.sum(reads_back * c_row[:, None], axis=0)
        j -= 1


@triton.jit
def value_grad_kernel(lq_ptr, lk_ptr, doc_ptr, rs_ptr, fine_ptr, g_ptr, inv_ptr, shift_ptr, qmax_ptr, dv_ptr,
                       T, H, H_KV, dv, m_feats, start, n_chunks, n_spans,
                       HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                       SPAN_BLOCKS: tl.constexpr):
    """Reverse direction, all spans in parallel, each span's chunks walked from its last, one program per
    block of value columns with every feature (a score φq·φk needs them all): dv_j = Σ_{i ≥ j} P_ij ĝ_i,
    the chunk's own rows by a masked C × C score tile and the later rows through R_c's value columns,
    carried and extended by the walk as in ``key_grad_kernel``."""
    c, pid_bh, pid_v, b, h, kv, cols, cols_ok = _chunk_program(H, H_KV, dv, BLOCK_V)
    offsets, mask, rows, feat_ok = _chunk_state_block(pid_bh, c, n_spans, m_feats, dv, cols, cols_ok, 0, BLOCK_M)
    later = tl.load(rs_ptr + offsets, mask=mask, other=0.0)  # R: the later rows' ĝ part
    first, n_sub = _span_chunks(c, n_chunks, SPAN_BLOCKS)
    j = n_sub - 1
    while j >= 0:  # (a while loop: see the note at the top)
        chunk = first + j
        t, row_ok, pos, doc, q_feat, key_feat, shift, continuing, decay = _gradient_features(
            lq_ptr, lk_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, chunk, pid_bh, T, H, m_feats, start, 0, HAS_DOC,
            BLOCK_T, BLOCK_M)
        # g as stored, its rows' 1/den folded into the C × C scores and the rows' weights (no scaled copy of
        # the C × V tile: at d = m = d_v = 128 that copy made ptxas spill)
        g = _load_value_block(g_ptr + b * T * H * dv + h * dv, t, row_ok, H * dv, cols, cols_ok)
        inv = tl.load(inv_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
        sigma = _last_row(shift, t, chunk, T, BLOCK_T)  # R's scale: the chunk's last row's
        seen_later = _exp_where(shift - sigma, row_ok & (pos >= _last_row(doc, t, chunk, T, BLOCK_T)))
        scores = product(q_feat, tl.trans(key_feat), OPERANDS) * (decay * inv[:, None])
        d_v = product(tl.trans(scores), g, OPERANDS) + seen_later[:, None] * product(key_feat, later, OPERANDS)
        tl.store(dv_ptr + ((b * T + t) * H + h)[:, None] * dv + cols[None, :], stored_as(d_v, dv_ptr),
                 mask=row_ok[:, None] & cols_ok[None, :])
        later, _, _ = _reverse_step(later, q_feat, g, inv, shift, sigma, continuing, fine_ptr, doc_ptr, b, pid_bh,
                                    chunk, n_chunks, T, start, OPERANDS, BLOCK_T, HAS_DOC)
        j -= 1
