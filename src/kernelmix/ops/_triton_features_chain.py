"""The Triton kernels (device code) around the span kernels of ``_triton_features_kernels``: DARKFormer's
keys' half norms and the feature logits before them, and the backward's chain through the feature map
after them. DARKFormer's transform M is folded into the projection (ℓ = W M x̃ = W' x̃ with W' = W M per
head, formed by torch once per call), so no kernel writes x' = M x̃; only the keys' −½‖M x̃‖², a product
per row, needs M.

- ``key_norm_kernel``: DARKFormer's ½‖M_h x̃‖² of every key row per query head, once in the forward
  (kept for the backward), fp32-accurate as the logits it enters.
- ``logits_kernel``: the feature logits ℓ = W x̃ of both sides (keys minus their half norm), once in the
  backward, for its span kernels to read instead of forming them again per block.
- ``chain_kernel``: both halves of a side's chain in one pass over its rows, every feature in one
  block: dx = d^{-1/4} (dℓ W) (with Performer's keys' −Σ dℓ · x̃ term) and the span parts of
  dW = Σ dℓᵀ x̃ (DARKFormer's dW' for W' = W M): one read of dℓ and x for both.
- ``chain_rows_kernel`` and ``chain_weights_kernel``: the same two halves apart, where one block does
  not fit (DARKFormer's keys, whose norm term −Σ dℓ · Σ x̃ with Σ = MᵀM needs a second product beside
  dW's accumulator: spilled on sm_90 at d = 128; or m · d over 128 × 128); the weight kernel also forms
  the span parts of DARKFormer's Σ_i s_i x̃_i x̃_iᵀ (s_i = Σ_f dℓ_if, the keys' norm term of dM). torch
  adds the spans.

The chain's products take ``FEATURE_OPERANDS`` (TF32 by default: their input dℓ already carries the
span kernels' TF32 error); rows are read in any float dtype and dx written in its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_features_rows import feature_logits
from ._triton_products import product, product_into, stored_as

__all__ = ["chain_kernel", "chain_rows_kernel", "chain_weights_kernel", "key_norm_kernel", "logits_kernel"]


@triton.jit
def _row_block(T, H, BLOCK_T: tl.constexpr):
    """A row kernel's program, from the grid (row blocks, B·H): (batch, query head, its rows, which exist)."""
    pid_bh = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    return (pid_bh // H).to(tl.int64), pid_bh % H, t, t < T


@triton.jit
def _span_block(T, H, span_rows):
    """A span kernel's program, from the grid (spans, B·H, ...): (batch, query head, its span's first row and
    end, its part's index in ``[spans, B·H]``)."""
    pid_bh = tl.program_id(1)
    first = tl.program_id(0) * span_rows
    part = (tl.program_id(0) * tl.num_programs(1) + pid_bh).to(tl.int64)
    return (pid_bh // H).to(tl.int64), pid_bh % H, first, tl.minimum(T, first + span_rows), part


@triton.jit
def chain_kernel(g_ptr, x_ptr, w_ptr, out_ptr, part_ptr, T, H, H_X, m_g, d, span_rows, w_head_stride, w_scale,
                 x_coef, HAS_X_TERM: tl.constexpr, OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, D_STEP: tl.constexpr):
    """Both halves of the chain for one span of rows of one (batch, query head) (grid: spans, B·H), every
    feature in one block (m_g ≤ BLOCK_F): per row out = w_scale · (G W_h) − x_coef · (Σ_f G_f) x, and the
    span's part of Σ_rows G_iᵀ x_i into ``[spans, B·H, m_g, d]``. G ``[B, T, H, m_g]`` fp32, W_h ``[m_g,
    d]``, x ``[B, T, H_X, d]`` in any float dtype (per its own head), out ``[B, T, H, d]`` in its own dtype.
    Each block of rows' G and x are read once for both products: the weights' accumulates, then out is
    formed and stored D_STEP columns at a time (W's columns, and x's for the term, from L2) so that no
    second [m, d] tile is live beside the accumulator."""
    b, h, row, stop, part = _span_block(T, H, span_rows)
    offs_f = tl.arange(0, BLOCK_F)
    f_ok = offs_f < m_g
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_F, BLOCK_D], dtype=tl.float32)
    while row < stop:  # (a while loop: see the note at the top)
        t = row + tl.arange(0, BLOCK_T)
        row_ok = t < stop
        g = tl.load(g_ptr + ((b * T + t) * H + h)[:, None] * m_g + offs_f[None, :],
                    mask=row_ok[:, None] & f_ok[None, :], other=0.0)
        x_rows = x_ptr + ((b * T + t) * H_X + h // (H // H_X)) * d
        x = tl.load(x_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < d)[None, :], other=0.0)
        acc = product_into(tl.trans(g), x.to(tl.float32), acc, OPERANDS)
        total = tl.sum(g, axis=1)
        out_rows = out_ptr + ((b * T + t) * H + h) * d
        column = 0
        while column < d:
            offs_c = column + tl.arange(0, D_STEP)
            c_ok = row_ok[:, None] & (offs_c < d)[None, :]
            w = tl.load(w_ptr + h * w_head_stride + offs_f[:, None] * d + offs_c[None, :],
                        mask=f_ok[:, None] & (offs_c < d)[None, :], other=0.0)
            out = w_scale * product(g, w, OPERANDS)
            if HAS_X_TERM:
                x_part = tl.load(x_rows[:, None] + offs_c[None, :], mask=c_ok, other=0.0).to(tl.float32)
                out -= x_coef * total[:, None] * x_part
            tl.store(out_rows[:, None] + offs_c[None, :], stored_as(out, out_ptr), mask=c_ok)
            column += D_STEP
        row += BLOCK_T
    rows = part * m_g + offs_f
    tl.store(part_ptr + rows[:, None] * d + offs_d[None, :], acc, mask=f_ok[:, None] & (offs_d < d)[None, :])


@triton.jit
def chain_rows_kernel(g_ptr, x_ptr, w_ptr, sigma_ptr, out_ptr, total_ptr, T, H, H_X, m_g, d, w_head_stride,
                      w_scale, x_coef, HAS_X_TERM: tl.constexpr, X_THROUGH_SIGMA: tl.constexpr,
                      OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, F_STEP: tl.constexpr):
    """out = w_scale · (G W_h) − x_coef · (Σ_f G_f) x for a block of rows of one (batch, query head)
    (grid: row blocks, B·H): G ``[B, T, H, m_g]`` fp32 (a logit gradient), W_h ``[m_g, d]``, x ``[B, T,
    H_X, d]`` in any float dtype (read per its own head: kv heads are never expanded), out ``[B, T, H,
    d]`` in its own dtype. With ``X_THROUGH_SIGMA`` (DARKFormer's keys) the term is x Σ_h instead of x
    (Σ ``[H, d, d]``, symmetric: the gradient of ½‖M x̃‖²), and the row sums Σ_f G_f are stored in
    ``total`` ``[B, T, H]`` for the norm's part of dM. The products in steps of F_STEP (small tiles, few
    registers) at the kernels' operands; the norm term and the scales fused: one read of G and x, one
    write of out."""
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
        x_rows = x_ptr + ((b * T + t) * H_X + h // (H // H_X)) * d
        if X_THROUGH_SIGMA:
            x = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            first = 0
            while first < d:
                offs_e = first + tl.arange(0, F_STEP)
                e_ok = offs_e < d
                x_step = tl.load(x_rows[:, None] + offs_e[None, :], mask=row_ok[:, None] & e_ok[None, :],
                                 other=0.0).to(tl.float32)
                sigma = tl.load(sigma_ptr + h * d * d + offs_e[:, None] * d + offs_d[None, :],
                                mask=e_ok[:, None] & d_ok[None, :], other=0.0)
                x = product_into(x_step, sigma, x, OPERANDS)
                first += F_STEP
            tl.store(total_ptr + (b * T + t) * H + h, total, mask=row_ok)
        else:
            x = tl.load(x_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
        out -= x_coef * total[:, None] * x
    tl.store(out_ptr + ((b * T + t) * H + h)[:, None] * d + offs_d[None, :], stored_as(out, out_ptr),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def chain_weights_kernel(g_ptr, x_ptr, part_ptr, T, H, H_X, m_g, d, span_rows, SCALED_ROWS: tl.constexpr,
                         OPERANDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """One span's part of Σ_rows G_iᵀ x_i for one (batch, query head) and block of G's columns (grid:
    spans, B·H, column blocks): G ``[B, T, H, m_g]`` fp32, x ``[B, T, H_X, d]`` in any float dtype (per its
    own head), the part into ``[spans, B·H, m_g, d]`` (torch adds the spans: a few MB, where an [m, d]
    accumulator over all rows in one program would leave the machine idle). dW = Σ dℓᵀ x̃. With
    ``SCALED_ROWS``, G_i = s_i x_i (``g_ptr`` holds s ``[B, T, H]``, m_g = d): DARKFormer's Σ_i s_i x_i x_iᵀ."""
    b, h, row, stop, part = _span_block(T, H, span_rows)
    offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < m_g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    acc = tl.zeros([BLOCK_F, BLOCK_D], dtype=tl.float32)
    while row < stop:  # (a while loop: see the note at the top)
        t = row + tl.arange(0, BLOCK_T)
        row_ok = t < stop
        x_rows = x_ptr + ((b * T + t) * H_X + h // (H // H_X)) * d
        if SCALED_ROWS:
            s = tl.load(g_ptr + (b * T + t) * H + h, mask=row_ok, other=0.0)
            g = s[:, None] * tl.load(x_rows[:, None] + offs_f[None, :], mask=row_ok[:, None] & f_ok[None, :],
                                     other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + ((b * T + t) * H + h)[:, None] * m_g + offs_f[None, :],
                        mask=row_ok[:, None] & f_ok[None, :], other=0.0)
        x = tl.load(x_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        acc = product_into(tl.trans(g), x, acc, OPERANDS)
        row += BLOCK_T
    rows = part * m_g + offs_f
    tl.store(part_ptr + rows[:, None] * d + offs_d[None, :], acc, mask=f_ok[:, None] & d_ok[None, :])


@triton.jit
def logits_kernel(x_ptr, w_ptr, norm_ptr, out_ptr, T, H, H_X, d, m_feats, w_head_stride, scale, IS_KEY: tl.constexpr,
                  STORED_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  D_STEP: tl.constexpr):
    """The feature logits ℓ = W_h (scale·x) (keys: − ½‖scale·x‖², or with ``STORED_NORM`` minus the half
    norms ``[B, H, T]`` of ``key_norm_kernel``) of a block of rows of one (batch, query head) (grid: row
    blocks, B·H), once for the backward's span kernels to read: x ``[B, T, H_X, d]`` in any float dtype
    (per its own head: kv heads are never expanded), ℓ ``[B, T, H, m]`` fp32. fp32-accurate: three TF32
    products (they are exponentiated)."""
    b, h, t, row_ok = _row_block(T, H, BLOCK_T)
    logits = feature_logits(x_ptr + b * T * H_X * d + (h // (H // H_X)) * d, H_X * d, t, row_ok,
                            w_ptr + h * w_head_stride, scale, d, m_feats, 0, norm_ptr + (b * H + h) * T, IS_KEY,
                            STORED_NORM, BLOCK_T, BLOCK_D, BLOCK_M, D_STEP)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + ((b * T + t) * H + h)[:, None] * m_feats + offs_m[None, :], logits,
             mask=row_ok[:, None] & (offs_m < m_feats)[None, :])


@triton.jit
def key_norm_kernel(x_ptr, m_ptr, out_ptr, T, H, H_X, d, scale, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                    D_STEP: tl.constexpr):
    """DARKFormer's ½‖M_h (scale·x)‖² of a block of key rows of one (batch, query head) (grid: row
    blocks, B·H): x ``[B, T, H_X, d]`` in any float dtype (per its own head), M ``[H, d, d]``, the half
    norms into ``[B, H, T]`` fp32. M x̃ is formed in registers (the logits' fp32-accurate product, as
    the half norm enters them) and never stored."""
    b, h, t, row_ok = _row_block(T, H, BLOCK_T)
    x_prime = feature_logits(x_ptr + b * T * H_X * d + (h // (H // H_X)) * d, H_X * d, t, row_ok, m_ptr + h * d * d,
                             scale, d, d, 0, out_ptr, False, False, BLOCK_T, BLOCK_D, BLOCK_D, D_STEP)
    tl.store(out_ptr + (b * H + h) * T + t, 0.5 * tl.sum(x_prime * x_prime, axis=1), mask=row_ok)
