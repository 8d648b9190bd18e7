"""Triton kernels of causal positive random-feature attention (Performer, DARKFormer; docs/math.md §6–7).

The same function as the chunked CPU path (``random_features._chunked_attention``), with the same
stabilisers: queries divided by their own max over features, keys shifted by the causal running
max s_i of their logit maxima (per document, at least the carried shift for rows that continue an
``initial_state``), the state (S, z) kept at scale exp(−shift) and rescaled when the shift grows,
and a zero row (zero gradients) where the denominator is at or below √tiny(float32).

Design. One program per (batch · query head, block of value columns) walks the chunks in order
with the state S ``[m, BLOCK_V]`` and z ``[m]`` in fp32 registers. The feature map is fused: each
chunk loads its C × d queries and keys, applies d^{-1/4}, the transform M and the projection W with
``tl.dot``, and forms the features in registers, so φ(Q), φ(K) (T × m) never reach memory. The
segmented running max inside a chunk is a C × C masked max (no scan). Grouped heads are indexed
(query head h reads kv head h // (H / H_kv)), never expanded.

The backward saves only q, k, v, W, M and per-row scalars (the key shift s_i, the query max and
the denominator) and recomputes the features. With g = dL/do, ĝ_i = g_i / den_i and
c_i = −(g_i · o_i) / den_i (computed in torch, like flash-attention's D), the gradient of an
unnormalised score P_ij is ĝ_i · v_j + c_i. Two kernels:

- forward direction (queries): dφq_i = Σ_j exp(ℓ^k_j − s_i) (ĝ_i · v_j + c_i), the carried part
  read from the recomputed state at row i;
- reverse direction (keys, values): a state R_c = Σ_{i after chunk c, same document}
  exp(σ_c − s_i) φq_i [ĝ_i, c_i]ᵀ carried from the last chunk to the first; every factor is ≤ 1.

Both store the per-row gradients of the feature logits, dℓ = φ ⊙ dφ ``[T, m]`` (value-column
blocks each store their part; the c_i terms enter only in block 0), and torch adds the blocks and
chains them through the feature map with five products over all rows (``_chain_feature_map``: dx',
for keys with the −½‖x'‖² term, dW = Σ dℓᵀ x', dx̃ = Mᵀ dx', dM = Σ dx' x̃ᵀ). The kernels keep no
dW [m, d] or dM [d, d] accumulator: at m = d = 128 those spilled on sm_90 and made ptxas take minutes.

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

#: Largest block of value columns one program holds (its state is m × VALUE_BLOCK fp32).
VALUE_BLOCK = 64
#: From this padded m or d on, the kernels take blocks of 32 rows and 32 value columns (compile time, registers).
LARGE_TILE = 128
#: Largest number of random features (and head dim) the kernels hold in one register tile.
MAX_FEATURES = 256
MAX_HEAD_DIM = 256
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
def _feature_logits(x_ptr, x_row_stride, t, row_ok, w_ptr, m_ptr, scale, d, m_feats,
                    HAS_TRANSFORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """For the rows t of x (``x_ptr`` at the head's first element): x̃ = d^{-1/4} x, x' = M x̃ and
    the logits W x' ``[BLOCK_T, BLOCK_M]`` (without the −½‖x'‖² term); padding is 0."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_ok = offs_d < d
    x = tl.load(x_ptr + t[:, None] * x_row_stride + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    x_tilde = x * scale
    if HAS_TRANSFORM:
        # transposed load: m_t[e_in, e_out] = M[e_out, e_in], so x' = x̃ Mᵀ row by row
        m_t = tl.load(m_ptr + offs_d[None, :] * d + offs_d[:, None], mask=d_ok[:, None] & d_ok[None, :], other=0.0)
        x_prime = tl.dot(x_tilde, m_t, input_precision="ieee")
    else:
        x_prime = x_tilde
    w_t = tl.load(w_ptr + offs_m[None, :] * d + offs_d[:, None], mask=d_ok[:, None] & (offs_m[None, :] < m_feats), other=0.0)
    return x_tilde, x_prime, tl.dot(x_prime, w_t, input_precision="ieee")


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
def _state_update(state_s, state_z, key_feat, v, shift, carried, t, pos, doc, row_ok, c, T, chunk_start,
                  BLOCK_T: tl.constexpr):
    """The state after chunk c, at scale exp(−σ_c) with σ_c the shift of its last row: the carried
    state (at exp(−``carried``)) rescaled by exp(carried − σ_c) ≤ 1, or dropped when the last row's
    document begins inside the chunk, plus the chunk's keys of that document. Returns (S, z, σ_c)."""
    sigma = _last_row(shift, t, c, T, BLOCK_T)
    doc_last = _last_row(doc, t, c, T, BLOCK_T)
    weight = _exp_where(shift - sigma, row_ok & (pos >= doc_last))
    weighted = key_feat * weight[:, None]
    rescale = _exp_where(carried - sigma, doc_last < chunk_start)
    state_s = rescale * state_s + tl.dot(tl.trans(weighted), v, input_precision="ieee")
    state_z = rescale * state_z + tl.sum(weighted, axis=0)
    return state_s, state_z, sigma


@triton.jit
def _chunk_features(q_head, k_head, q_row_stride, k_row_stride, t, row_ok, w_head, m_head, scale, d, m_feats,
                    HAS_TRANSFORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The chunk's query and key feature logits (queries without −½‖x'‖², keys with it; padding
    rows and features −inf-masked later through ``valid``) and what the backward chains through."""
    x_tilde_q, x_prime_q, q_logits = _feature_logits(q_head, q_row_stride, t, row_ok, w_head, m_head, scale, d,
                                                     m_feats, HAS_TRANSFORM, BLOCK_D, BLOCK_M)
    x_tilde_k, x_prime_k, k_logits = _feature_logits(k_head, k_row_stride, t, row_ok, w_head, m_head, scale, d,
                                                     m_feats, HAS_TRANSFORM, BLOCK_D, BLOCK_M)
    k_logits = k_logits - 0.5 * tl.sum(x_prime_k * x_prime_k, axis=1)[:, None]
    valid = row_ok[:, None] & (tl.arange(0, BLOCK_M) < m_feats)[None, :]
    return x_tilde_q, x_prime_q, q_logits, x_tilde_k, x_prime_k, k_logits, valid


@triton.jit
def _load_value_block(ptr, t, row_ok, row_stride, cols, cols_ok):
    return tl.load(ptr + t[:, None] * row_stride + cols[None, :], mask=row_ok[:, None] & cols_ok[None, :], other=0.0)


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _program_block(H, H_KV, dv, BLOCK_V: tl.constexpr):
    """This program's (batch, query head) and block of value columns: (pid_bh, pid_v, b, h, kv, cols, cols_ok)."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: B·T·H·d may pass 2^31
    h = pid_bh % H
    kv = h // (H // H_KV)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    return pid_bh, pid_v, b, h, kv, cols, cols < dv


@triton.jit
def _initial_state(s0_ptr, z0_ptr, shift0_ptr, pid_bh, m_feats, dv, cols, cols_ok, BLOCK_M: tl.constexpr):
    """The state the call starts from, this program's part: (state_rows, state_mask, feat_ok, S, z, shift)."""
    offs_m = tl.arange(0, BLOCK_M)
    feat_ok = offs_m < m_feats
    state_rows = pid_bh * m_feats + offs_m
    state_mask = feat_ok[:, None] & cols_ok[None, :]
    state_s = tl.load(s0_ptr + state_rows[:, None] * dv + cols[None, :], mask=state_mask, other=0.0)
    state_z = tl.load(z0_ptr + state_rows, mask=feat_ok, other=0.0)
    return state_rows, state_mask, feat_ok, state_s, state_z, tl.load(shift0_ptr + pid_bh)


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, w_ptr, m_ptr, doc_ptr, s0_ptr, z0_ptr, shift0_ptr,
                    out_ptr, den_ptr, shift_ptr, qmax_ptr, s_out_ptr, z_out_ptr, shift_out_ptr,
                    T, H, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale, floor,
                    HAS_TRANSFORM: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program: one (batch, query head) and one block of value columns, all chunks in order."""
    pid_bh, pid_v, b, h, kv, cols, cols_ok = _program_block(H, H_KV, dv, BLOCK_V)
    q_head = q_ptr + b * T * H * d + h * d
    k_head = k_ptr + b * T * H_KV * d + kv * d
    v_head = v_ptr + b * T * H_KV * dv + kv * dv
    w_head = w_ptr + h * w_head_stride
    m_head = m_ptr + h * d * d
    state_rows, state_mask, feat_ok, state_s, state_z, carried = _initial_state(
        s0_ptr, z0_ptr, shift0_ptr, pid_bh, m_feats, dv, cols, cols_ok, BLOCK_M)
    c = 0
    while c < n_chunks:  # (a while loop: see the note at the top)
        t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
        chunk_start = start + c * BLOCK_T
        _, _, q_logits, _, _, k_logits, valid = _chunk_features(
            q_head, k_head, H * d, H_KV * d, t, row_ok, w_head, m_head, scale, d, m_feats, HAS_TRANSFORM, BLOCK_D,
            BLOCK_M)
        q_max = tl.where(row_ok, tl.max(tl.where(valid, q_logits, float("-inf")), axis=1), 0.0)
        q_feat = _exp_where(q_logits - q_max[:, None], valid)
        visible = _visible(t, pos, doc, row_ok)
        continuing = row_ok & (doc < chunk_start)
        key_max = tl.max(tl.where(valid, k_logits, float("-inf")), axis=1)
        shift = _key_shift(key_max, visible, continuing, carried, row_ok)
        key_feat = _exp_where(k_logits - shift[:, None], valid)  # ≤ 1
        v = _load_value_block(v_head, t, row_ok, H_KV * dv, cols, cols_ok)
        decay = _exp_where(shift[None, :] - shift[:, None], visible)  # exp(s_j − s_i) ≤ 1
        scores = tl.dot(q_feat, tl.trans(key_feat), input_precision="ieee") * decay
        carry = _exp_where(carried - shift, continuing)  # the carried state reaches row i at exp(σ − s_i)
        numerator = tl.dot(scores, v, input_precision="ieee")
        numerator += carry[:, None] * tl.dot(q_feat, state_s, input_precision="ieee")
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
        state_s, state_z, carried = _state_update(state_s, state_z, key_feat, v, shift, carried, t, pos, doc, row_ok,
                                                  c, T, chunk_start, BLOCK_T)
        c += 1
    tl.store(s_out_ptr + state_rows[:, None] * dv + cols[None, :], state_s, mask=state_mask)
    if pid_v == 0:
        tl.store(z_out_ptr + state_rows, state_z, mask=feat_ok)
        tl.store(shift_out_ptr + pid_bh, carried)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _recompute_chunk(q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v,
                     cols, cols_ok, T, H, H_KV, d, dv, m_feats, start, w_head, m_head, scale, HAS_TRANSFORM: tl.constexpr,
                     HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """What both backward kernels need of chunk c: the features again (from the saved key shift and
    query max, so they are the forward's), the masks, the value block, ĝ and (block 0 only) c_i."""
    q_head = q_ptr + b * T * H * d + h * d
    k_head = k_ptr + b * T * H_KV * d + kv * d
    v_head = v_ptr + b * T * H_KV * dv + kv * dv
    g_head = g_ptr + b * T * H * dv + h * dv
    t, row_ok, pos, doc = _chunk_rows(doc_ptr, b, c, T, start, BLOCK_T, HAS_DOC)
    chunk_start = start + c * BLOCK_T
    _xq, _pq, q_logits, _xk, _pk, k_logits, valid = _chunk_features(
        q_head, k_head, H * d, H_KV * d, t, row_ok, w_head, m_head, scale, d, m_feats, HAS_TRANSFORM, BLOCK_D, BLOCK_M)
    q_max = tl.load(qmax_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    shift = tl.load(shift_ptr + pid_bh * T + t, mask=row_ok, other=0.0)
    q_feat = _exp_where(q_logits - q_max[:, None], valid)
    key_feat = _exp_where(k_logits - shift[:, None], valid)
    visible = _visible(t, pos, doc, row_ok)
    continuing = row_ok & (doc < chunk_start)
    decay = _exp_where(shift[None, :] - shift[:, None], visible)
    v = _load_value_block(v_head, t, row_ok, H_KV * dv, cols, cols_ok)
    g_hat = _load_value_block(g_head, t, row_ok, H * dv, cols, cols_ok)
    # c_i (the denominator's gradient) belongs to no value block: block 0 carries it
    c_row = tl.load(c_ptr + pid_bh * T + t, mask=row_ok, other=0.0) * (pid_v == 0).to(tl.float32)  # block 0 only
    return t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row


@triton.jit
def _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M: tl.constexpr):
    """This value block's dL/dlogit of the chunk's rows into its slot of ``[blocks, B, T, H, m]``
    (torch adds the blocks and chains them through the feature map: no dW, dM accumulators here)."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = ((pid_v * (tl.num_programs(0) // H) + b) * T + t) * H + h
    tl.store(dlog_ptr + rows[:, None] * m_feats + offs_m[None, :], d_logits,
             mask=row_ok[:, None] & (offs_m < m_feats)[None, :])


@triton.jit
def _query_grad_kernel(q_ptr, k_ptr, v_ptr, w_ptr, m_ptr, doc_ptr, s0_ptr, z0_ptr, shift0_ptr,
                       g_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr,
                       T, H, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                       HAS_TRANSFORM: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Forward direction: dφq_i = Σ_j exp(ℓ^k_j − s_i)(ĝ_i·v_j + c_i), the earlier chunks through
    the recomputed state; stored as dL/dℓ^q = φq ⊙ dφq (this value block's part)."""
    pid_bh, pid_v, b, h, kv, cols, cols_ok = _program_block(H, H_KV, dv, BLOCK_V)
    w_head = w_ptr + h * w_head_stride
    m_head = m_ptr + h * d * d
    # (not `_`: the loop below assigns `_` too, and Triton would carry it through the loop with two types)
    _state_rows, _state_mask, _feat_ok, state_s, state_z, carried = _initial_state(
        s0_ptr, z0_ptr, shift0_ptr, pid_bh, m_feats, dv, cols, cols_ok, BLOCK_M)
    c = 0
    while c < n_chunks:  # (a while loop: see the note at the top)
        t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row = _recompute_chunk(
            q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v, cols, cols_ok,
            T, H, H_KV, d, dv, m_feats, start, w_head, m_head, scale, HAS_TRANSFORM, HAS_DOC, BLOCK_T, BLOCK_D, BLOCK_M)
        d_scores = (tl.dot(g_hat, tl.trans(v), input_precision="ieee") + c_row[:, None]) * decay
        d_feat = tl.dot(d_scores, key_feat, input_precision="ieee")
        carry = _exp_where(carried - shift, continuing)
        from_state = tl.dot(g_hat, tl.trans(state_s), input_precision="ieee") + c_row[:, None] * state_z[None, :]
        d_logits = q_feat * (d_feat + carry[:, None] * from_state)  # the query max is detached
        _store_logit_grads(dlog_ptr, d_logits, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M)
        state_s, state_z, carried = _state_update(state_s, state_z, key_feat, v, shift, carried, t, pos, doc, row_ok,
                                                  c, T, chunk_start, BLOCK_T)
        c += 1


@triton.jit
def _key_grad_kernel(q_ptr, k_ptr, v_ptr, w_ptr, m_ptr, doc_ptr, shift0_ptr,
                     g_ptr, c_ptr, shift_ptr, qmax_ptr, dlog_ptr, dv_ptr,
                     T, H, H_KV, d, dv, m_feats, start, n_chunks, w_head_stride, scale,
                     HAS_TRANSFORM: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Reverse direction: dv_j and dφk_j from this chunk's rows and from the later rows of the same
    document through R = Σ_i exp(σ_c − s_i) φq_i [ĝ_i, c_i]ᵀ (at most 1 per term); dL/dℓ^k = φk ⊙ dφk
    stored (this value block's part)."""
    pid_bh, pid_v, b, h, kv, cols, cols_ok = _program_block(H, H_KV, dv, BLOCK_V)
    w_head = w_ptr + h * w_head_stride
    m_head = m_ptr + h * d * d
    shift0 = tl.load(shift0_ptr + pid_bh)
    later = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)  # R: the later rows' ĝ part
    later_c = tl.zeros([BLOCK_M], dtype=tl.float32)  # and their c part (block 0 only)
    step = 0
    while step < n_chunks:  # (a while loop: see the note at the top)
        c = n_chunks - 1 - step
        t, row_ok, pos, doc, chunk_start, q_feat, key_feat, shift, continuing, decay, v, g_hat, c_row = _recompute_chunk(
            q_ptr, k_ptr, v_ptr, g_ptr, c_ptr, shift_ptr, qmax_ptr, doc_ptr, b, h, kv, c, pid_bh, pid_v, cols, cols_ok,
            T, H, H_KV, d, dv, m_feats, start, w_head, m_head, scale, HAS_TRANSFORM, HAS_DOC, BLOCK_T, BLOCK_D, BLOCK_M)
        sigma = _last_row(shift, t, c, T, BLOCK_T)
        doc_last = _last_row(doc, t, c, T, BLOCK_T)
        previous = tl.load(shift_ptr + pid_bh * T + tl.maximum(c * BLOCK_T - 1, 0))
        carried = tl.where(c > 0, previous, shift0)  # σ_{c−1}: the scale of the state this chunk continues
        seen_later = _exp_where(shift - sigma, row_ok & (pos >= doc_last))  # keys the later chunks read
        scores = tl.dot(q_feat, tl.trans(key_feat), input_precision="ieee") * decay
        d_v = tl.dot(tl.trans(scores), g_hat, input_precision="ieee")
        d_v += seen_later[:, None] * tl.dot(key_feat, later, input_precision="ieee")
        tl.store(dv_ptr + ((b * T + t) * H + h)[:, None] * dv + cols[None, :], d_v, mask=row_ok[:, None] & cols_ok[None, :])
        d_scores = (tl.dot(g_hat, tl.trans(v), input_precision="ieee") + c_row[:, None]) * decay
        d_feat = tl.dot(tl.trans(d_scores), q_feat, input_precision="ieee")
        d_feat += seen_later[:, None] * (tl.dot(v, tl.trans(later), input_precision="ieee") + later_c[None, :])
        _store_logit_grads(dlog_ptr, key_feat * d_feat, b, h, t, row_ok, pid_v, T, H, m_feats, BLOCK_M)
        # R for chunk c − 1: this chunk's rows of that chunk's last document, and R itself if the
        # document goes on through this chunk, all brought to the scale exp(σ_{c−1} − s_i) ≤ 1
        reads_back = q_feat * _exp_where(carried - shift, continuing)[:, None]
        back = _exp_where(carried - sigma, doc_last < chunk_start)
        later = back * later + tl.dot(tl.trans(reads_back), g_hat, input_precision="ieee")
        later_c = back * later_c + tl.sum(reads_back * c_row[:, None], axis=0)
        step += 1


# ---------------------------------------------------------------------------------------------
# Python side: checks, launches, autograd


class _Geometry:
    """Sizes and block sizes of one call (pure data)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, projection: Tensor, chunk_size: int, start: int) -> None:
        self.batch, self.length, self.heads, self.head_dim = q.shape
        self.kv_heads, self.value_dim = k.shape[2], v.shape[3]
        self.features = projection.shape[-2]
        self.start = start
        self.block_d = max(16, triton.next_power_of_2(self.head_dim))
        self.block_m = max(16, triton.next_power_of_2(self.features))
        # At d or m ≥ 128, chunks of 64 rows and 64 value columns made ptxas take minutes per kernel
        # (sm_90, compiled ahead of time here: 182 s for the forward); 32 and 32 took 22–59 s.
        large = max(self.block_m, self.block_d) >= LARGE_TILE
        self.block_t = min(32 if large else 64, max(16, triton.next_power_of_2(chunk_size)))
        self.block_v = min(max(16, triton.next_power_of_2(self.value_dim)), max(16, min(VALUE_BLOCK, 32 if large else 64)))
        self.n_chunks = triton.cdiv(self.length, self.block_t)
        self.value_blocks = triton.cdiv(self.value_dim, self.block_v)
        # a shared projection [m, d] is read by every head: a head stride of 0
        self.w_head_stride = 0 if projection.dim() == 2 else self.features * self.head_dim

    @property
    def grid(self) -> tuple[int, int]:
        return (self.batch * self.heads, self.value_blocks)

    def sizes(self) -> tuple:
        return (self.length, self.heads, self.kv_heads, self.head_dim, self.value_dim, self.features, self.start,
                self.n_chunks, self.w_head_stride, self.head_dim ** -0.25)

    def blocks(self) -> dict:
        """The block sizes and the warps per program: 8 for tiles of 128 or more (m or d), to spread
        the registers of the fp32 tiles; untuned (no GPU run yet), the interpreter ignores it."""
        warps = 8 if max(self.block_m, self.block_d) >= 128 else 4
        return dict(BLOCK_T=self.block_t, BLOCK_D=self.block_d, BLOCK_M=self.block_m, BLOCK_V=self.block_v,
                    num_warps=warps)


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


def _launch_forward(q, k, v, projection, transform, doc, state, geometry: _Geometry):
    """Run the forward kernel: (out, denominator, key shift, query max, S, z, shift)."""
    batch, length, heads = geometry.batch, geometry.length, geometry.heads
    out = q.new_empty(batch, length, heads, geometry.value_dim)
    row_scalars = [q.new_empty(batch, heads, length) for _ in range(3)]  # denominator, key shift, query max
    final = (torch.empty_like(state[0]), torch.empty_like(state[1]), torch.empty_like(state[2]))
    _forward_kernel[geometry.grid](
        q, k, v, projection, projection if transform is None else transform, q if doc is None else doc, *state,
        out, *row_scalars, *final, *geometry.sizes(), UNDERFLOW_FLOOR,
        HAS_TRANSFORM=transform is not None, HAS_DOC=doc is not None, **geometry.blocks(),
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
    geometry = _Geometry(q, k, v, projection, chunk_size, start)
    s0, z0, shift0 = _state_tensors(state, geometry, v)
    if geometry.length == 0 or geometry.batch == 0:  # nothing to mix: no launch, the state as it was
        out = v.repeat_interleave(geometry.heads // geometry.kv_heads, dim=2)  # empty, and autograd sees v
        return out, v.new_zeros(geometry.batch, geometry.heads, geometry.length), (s0, z0, shift0, start + geometry.length)
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
            q, k, v, projection, transform, doc, state, geometry)
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
    nvb, m = geometry.value_blocks, geometry.features
    d_logits = q.new_empty(2, nvb, batch, length, heads, m)  # [query, key] × value blocks
    dv = q.new_empty(batch, length, heads, geometry.value_dim)
    common = dict(HAS_TRANSFORM=transform is not None, HAS_DOC=doc is not None, **geometry.blocks())
    m_arg = projection if transform is None else transform
    doc_arg = q if doc is None else doc
    _query_grad_kernel[geometry.grid](
        q, k, v, projection, m_arg, doc_arg, *state, g_hat, c_row, shift_rows, q_max, d_logits[0],
        *geometry.sizes(), **common)
    _key_grad_kernel[geometry.grid](
        q, k, v, projection, m_arg, doc_arg, state[2], g_hat, c_row, shift_rows, q_max, d_logits[1], dv,
        *geometry.sizes(), **common)
    d_logits = d_logits.sum(1)  # the value blocks' parts
    groups = heads // geometry.kv_heads
    keys = k.repeat_interleave(groups, dim=2)  # [B, T, H, d]: query head h reads kv head h // groups
    weights = projection if projection.dim() == 3 else projection.expand(heads, m, d)
    d_q, dw_q, dm_q = _chain_feature_map(q, d_logits[0], weights, transform, is_key=False)
    d_k, dw_k, dm_k = _chain_feature_map(keys, d_logits[1], weights, transform, is_key=True)
    d_k = d_k.view(batch, length, geometry.kv_heads, groups, d).sum(3)
    d_v = dv.view(batch, length, geometry.kv_heads, groups, geometry.value_dim).sum(3)
    d_w = dw_q + dw_k  # [H, m, d]
    d_w = d_w.sum(0) if projection.dim() == 2 else d_w
    d_m = None if transform is None else dm_q + dm_k
    return d_q, d_k, d_v, d_w, d_m


def _chain_feature_map(x: Tensor, d_logits: Tensor, weights: Tensor, transform: Tensor | None, *, is_key: bool):
    """From dL/dℓ ``[B, T, H, m]`` of the logits ℓ = W x' (keys: − ½‖x'‖²), x' = M x̃, x̃ = d^{-1/4} x
    (``x`` ``[B, T, H, d]``, W ``[H, m, d]``, M ``[H, d, d]`` or None) to dL/dx and this side's dL/dW
    and dL/dM: five fp32 products over all rows, in place of per-program accumulators in the kernels
    (an [m, d] and a [d, d] accumulator per program spilled on sm_90 at m = d = 128)."""
    scale = x.shape[-1] ** -0.25
    x_tilde = x * scale
    x_prime = x_tilde if transform is None else torch.einsum("bthe,hfe->bthf", x_tilde, transform)
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
    """The three kernels one differentiated call launches at these sizes (the forward, the query and
    the key gradients), with the grids, blocks and warps of the launches above (the same
    ``_Geometry``, built on meta tensors: no memory, no GPU)."""
    q = torch.empty(batch, length, heads, head_dim, device="meta")
    k = torch.empty(batch, length, kv_heads, head_dim, device="meta")
    v = torch.empty(batch, length, kv_heads, value_dim, device="meta")
    projection = torch.empty(heads, features, head_dim, device="meta")  # per head (a shared one launches the same)
    geometry = _Geometry(q, k, v, projection, chunk_size, 0)
    blocks = geometry.blocks()
    warps = blocks.pop("num_warps")
    constexprs = dict(HAS_TRANSFORM=has_transform, HAS_DOC=has_doc) | blocks
    tiles = dict(block_t=geometry.block_t, block_d=geometry.block_d, block_m=geometry.block_m,
                 block_v=geometry.block_v, chunks=geometry.n_chunks, has_transform=has_transform)
    kernels = [("features_forward", _forward_kernel), ("features_query_grad", _query_grad_kernel),
               ("features_key_grad", _key_grad_kernel)]
    return [KernelLaunch(name, kernel, geometry.grid, constexprs, warps,
                         aot_signature(kernel, constexprs, {"doc_ptr": "*i64"}, {"scale", "floor"}), tiles)
            for name, kernel in kernels]
