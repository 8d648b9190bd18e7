"""Device functions that read rows for the random-feature kernels (``_triton_features_kernels``, the span
kernels, and ``_triton_features_chain``, the kernels around them): a block of consecutive rows' base
pointer in 64 bits, and the feature logits of a block of rows, fp32-accurate on tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_products import product

__all__ = ["feature_logits", "row_base"]


@triton.jit
def row_base(ptr, t, row_stride):
    """(``ptr`` at the first of the consecutive rows t, their offsets from it): the first row's offset in
    64 bits (t · stride passes 2^31 from T · H · d ≈ 1M tokens × 16 heads × 128), the in-block offsets
    in 32 (64-bit offsets per element spilled in the span kernels)."""
    first = tl.min(t, axis=0)
    return ptr + first.to(tl.int64) * row_stride, t - first


@triton.jit
def feature_logits(x_ptr, x_row_stride, t, row_ok, w_ptr, scale, d, m_feats, first_feature, norm_ptr,
                   IS_KEY: tl.constexpr, STORED_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, D_STEP: tl.constexpr):
    """The feature logits of the rows t of x (``x_ptr`` at the head's first element) for the features
    from ``first_feature``: W (scale·x) ``[BLOCK_T, BLOCK_M]``, for keys minus ½‖scale·x‖², or with
    ``STORED_NORM`` minus the half norms at ``norm_ptr + t`` (DARKFormer's ½‖M x̃‖², formed once by
    ``key_norm_kernel``: W is then the folded W M); padding is 0. Over the head in steps of ``D_STEP``
    columns (small tiles, few registers), each step's product at fp32 accuracy on tensor cores
    (``"tf32x3"``: the logits are exponentiated, so they stay fp32)."""
    offs_m = first_feature + tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_feats
    logits = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    half_norm = tl.zeros([BLOCK_T], dtype=tl.float32)
    x_rows, local = row_base(x_ptr, t, x_row_stride)
    for first in range(0, BLOCK_D, D_STEP):
        offs_d = first + tl.arange(0, D_STEP)
        d_ok = offs_d < d
        x = tl.load(x_rows + local[:, None] * x_row_stride + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32) * scale  # (rows in any float dtype: bf16 rows are read as bf16)
        w_t = tl.load(w_ptr + offs_m[None, :] * d + offs_d[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        logits += product(x, w_t, "tf32x3")
        if IS_KEY:
            if not STORED_NORM:
                half_norm += 0.5 * tl.sum(x * x, axis=1)
    if IS_KEY:
        if STORED_NORM:
            half_norm = tl.load(norm_ptr + t, mask=row_ok, other=0.0)
        logits -= half_norm[:, None]
    return logits
