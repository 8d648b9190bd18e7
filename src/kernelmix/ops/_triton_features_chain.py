"""The Triton kernels (device code) around the span kernels of ``_triton_features_kernels``: DARKFormer's
transform x' = M x̃ and the feature logits before them, and the backward's chain through the feature
map after them.

- ``logits_kernel``: the feature logits ℓ = W x' of both sides, once in the backward, for its span
  kernels to read instead of forming them again per block; with M for W it is DARKFormer's transform
  x' = M_h (d^{-1/4} x), fp32-accurate as the logits it feeds, one pass over the rows.
- ``chain_rows_kernel``: dx' = dℓ W with the keys' −Σ dℓ · x' term and the scales fused (and
  DARKFormer's dx̃ = dx' M, the same kernel with M for W), one read of dℓ and x, one write of dx.
- ``chain_weights_kernel``: the span parts of dW = Σ dℓᵀ x' (and dM = Σ dx'ᵀ x̃), torch adds the spans.

The chain's products take ``FEATURE_OPERANDS`` (TF32 by default: their input dℓ already carries the
span kernels' TF32 error); rows are read in any float dtype and dx written in its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_features_kernels import feature_logits
from ._triton_products import product_into, stored_as

__all__ = ["chain_rows_kernel", "chain_weights_kernel", "logits_kernel"]


@triton.jit
def _row_block(T, H, BLOCK_T: tl.constexpr):
    """A row kernel's program, from the grid (row blocks, B·H): (batch, query head, its rows, which exist)."""
    pid_bh = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    return (pid_bh // H).to(tl.int64), pid_bh % H, t, t < T


@triton.jit
def chain_rows_kernel(g_ptr, x_ptr, w_ptr, out_ptr, T, H, H_X, m_g, d, w_head_stride, w_scale, x_coef,
                      HAS_X_TERM: tl.constexpr, OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_D: tl.constexpr, F_STEP: tl.constexpr):
    """out = w_scale · (G W_h) − x_coef · (Σ_f G_f) x for a block of rows of one (batch, query head)
    (grid: row blocks, B·H): G ``[B, T, H, m_g]`` fp32 (a logit gradient, or dx' for DARKFormer's dx̃),
    W_h ``[m_g, d]``, x ``[B, T, H_X, d]`` in any float dtype (read per its own head: kv heads are never
    expanded), out ``[B, T, H, d]`` in its own dtype. The product over m_g in steps of F_STEP (small
    tiles, few registers) at the kernels' operands; the keys' −Σ dℓ · x' term and the scales fused:
    one read of G and x, one write of out."""
    b, h, t, row_ok = _row_block(T, H, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    g_rows = g_ptr + ((b * T + t) * H + h) * m_g
    first = 0
    while first < m_g:  # (a while loop: see the note at the top)
        offs_f = first + tl.arange(0, F_STEP)
        f_ok = offs_f < m_g
        g = tl.load(g_rows[:, None] + offs_f[None, :], mask=row_ok[:, None] & f_ok[None, :], other=0.0)
        w = tl.load(w_ptr + h * w_head_stride + offs_f[:, None] * d + offs_d[None, :],
                    mask=f_ok[:, None] & d_ok[None, :], other=0.0)
        acc = product_into(g, w, acc, OPERANDS)
        total += tl.sum(g, axis=1)
        first += F_STEP
    out = w_scale * acc
    if HAS_X_TERM:
        x = tl.load(x_ptr + ((b * T + t) * H_X + h // (H // H_X))[:, None] * d + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        out -= x_coef * total[:, None] * x
    tl.store(out_ptr + ((b * T + t) * H + h)[:, None] * d + offs_d[None, :], stored_as(out, out_ptr),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def chain_weights_kernel(g_ptr, x_ptr, part_ptr, T, H, H_X, m_g, d, span_rows, OPERANDS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    """One span's part of Σ_rows G_iᵀ x_i for one (batch, query head) and block of G's columns (grid:
    spans, B·H, column blocks): G ``[B, T, H, m_g]`` fp32, x ``[B, T, H_X, d]`` in any float dtype (per its
    own head), the part into ``[spans, B·H, m_g, d]`` (torch adds the spans: a few MB, where an [m, d]
    accumulator over all rows in one program would leave the machine idle). dW = Σ dℓᵀ x', and
    DARKFormer's dM = Σ dx'ᵀ x̃."""
    span = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_f = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < m_g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    acc = tl.zeros([BLOCK_F, BLOCK_D], dtype=tl.float32)
    first = span * span_rows
    stop = tl.minimum(T, first + span_rows)
    row = first
    while row < stop:  # (a while loop: see the note at the top)
        t = row + tl.arange(0, BLOCK_T)
        row_ok = t < stop
        g = tl.load(g_ptr + ((b * T + t) * H + h)[:, None] * m_g + offs_f[None, :],
                    mask=row_ok[:, None] & f_ok[None, :], other=0.0)
        x = tl.load(x_ptr + ((b * T + t) * H_X + h // (H // H_X))[:, None] * d + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = product_into(tl.trans(g), x, acc, OPERANDS)
        row += BLOCK_T
    rows = (span * tl.num_programs(1) + pid_bh).to(tl.int64) * m_g + offs_f
    tl.store(part_ptr + rows[:, None] * d + offs_d[None, :], acc, mask=f_ok[:, None] & d_ok[None, :])


@triton.jit
def logits_kernel(x_ptr, w_ptr, out_ptr, T, H, H_X, d, m_feats, w_head_stride, scale, IS_KEY: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """The feature logits ℓ = W_h (scale·x) (keys: − ½‖scale·x‖²) of a block of rows of one (batch, query
    head) (grid: row blocks, B·H), once for the backward's span kernels to read: x ``[B, T, H_X, d]`` in
    any float dtype (per its own head: kv heads are never expanded), ℓ ``[B, T, H, m]`` fp32.
    fp32-accurate: three TF32 products (they are exponentiated). With M_h for W_h (m = d, not a key)
    it is DARKFormer's transform x' = M x̃, which feeds the logits and so is fp32-accurate as they are."""
    b, h, t, row_ok = _row_block(T, H, BLOCK_T)
    logits = feature_logits(x_ptr + b * T * H_X * d + (h // (H // H_X)) * d, H_X * d, t, row_ok,
                            w_ptr + h * w_head_stride, scale, d, m_feats, 0, IS_KEY, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + ((b * T + t) * H + h)[:, None] * m_feats + offs_m[None, :], logits,
             mask=row_ok[:, None] & (offs_m < m_feats)[None, :])
