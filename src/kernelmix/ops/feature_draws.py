"""The random projections W of positive random features: iid Gaussian rows, or orthogonal blocks
with chi(d) row norms (both marginally N(0, I) per row, so the estimate stays unbiased)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import KernelmixError


def _check_feature_dims(num_features: int, head_dim: int, num_heads: int | None) -> None:
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
        raise KernelmixError(f"num_features (m) must be a positive int, got {num_features!r}")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise KernelmixError(f"head_dim must be a positive int, got {head_dim!r}")
    if num_heads is not None and (not isinstance(num_heads, int) or num_heads <= 0):
        raise KernelmixError(f"num_heads must be a positive int or None, got {num_heads!r}")


def gaussian_random_features(
    num_features: int,
    head_dim: int,
    *,
    num_heads: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """iid N(0, I) rows ω_i: ``[m, d]``, or ``[H, m, d]`` (independent per head) if ``num_heads``."""
    _check_feature_dims(num_features, head_dim, num_heads)
    shape = (num_features, head_dim) if num_heads is None else (num_heads, num_features, head_dim)
    w = torch.randn(shape, generator=generator, dtype=torch.float64)
    return w.to(dtype=dtype, device=device)


def _orthogonal_block_rows(num_features: int, head_dim: int, generator: torch.Generator | None) -> Tensor:
    blocks = []
    for _ in range(math.ceil(num_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Sign fix: without it QR's convention biases the distribution away from Haar.
        q = q * torch.sign(torch.diagonal(r)).masked_fill(torch.diagonal(r) == 0, 1.0)
        blocks.append(q.T)  # rows are orthonormal
    rows = torch.cat(blocks, dim=0)[:num_features]
    # Row norms of iid Gaussian vectors (chi(d)) so each row is marginally N(0, I): keeps unbiasedness.
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return rows * norms[:, None]


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    num_heads: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Orthogonal random features: blocks of d mutually orthogonal rows (QR of a Gaussian matrix
    with the sign fix), rows rescaled to chi(d)-distributed norms. ``[m, d]`` or ``[H, m, d]``."""
    _check_feature_dims(num_features, head_dim, num_heads)
    if num_heads is None:
        w = _orthogonal_block_rows(num_features, head_dim, generator)
    else:
        w = torch.stack([_orthogonal_block_rows(num_features, head_dim, generator) for _ in range(num_heads)])
    return w.to(dtype=dtype, device=device)
