"""The data-aware transform of DARKFormer (``ops.data_aware``): M = S^{1/2}, F = S⁻¹ from regularised
second moments, with S = B⁻¹ # A (the geometric mean), which leaves the kernel qᵀk unchanged; float64."""

import pytest
import torch

from kernelmix.ops import data_aware_transform, regularised_second_moments

from ..layers.common import F64, HEAD_DIM, HEADS, KV_HEADS, rel_err


def correlated_samples(n, heads, kv_heads, d, seed=0, zero_dims=()):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64)
    k = 3.0 * torch.randn(n, kv_heads, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64)
    for dim in zero_dims:
        q[..., dim] = 0.0
        k[..., dim] = 0.0
    return q, k


@pytest.mark.parametrize("zero_dims", [(), (0, 5), tuple(range(HEAD_DIM))], ids=["full", "singular", "all-zero"])
@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS])
def test_data_aware_transform(zero_dims, kv_heads):
    q, k = correlated_samples(300, HEADS, kv_heads, HEAD_DIM, zero_dims=zero_dims)
    m, fold = data_aware_transform(q, k, eps=1e-3)
    assert m.shape == fold.shape == (HEADS, HEAD_DIM, HEAD_DIM) and m.dtype == F64
    assert torch.isfinite(m).all() and torch.isfinite(fold).all()
    assert torch.allclose(m, m.transpose(-1, -2)) and torch.allclose(fold, fold.transpose(-1, -2))

    a, b = regularised_second_moments(q, k, eps=1e-3)
    s = m @ m  # M = S^{1/2}, symmetric
    assert torch.linalg.eigvalsh(s).min() > 0
    assert rel_err(s @ b @ s, a) <= 1e-8  # S = B^{-1} # A solves S B S = A
    assert rel_err(fold @ s, torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1)) <= 1e-8
    # the features see equal second moments on both sides: S^{-1/2} A S^{-1/2} = S^{1/2} B S^{1/2}
    m_inv = torch.linalg.inv(m)
    assert rel_err(m_inv @ a @ m_inv, m @ b @ m) <= 1e-8

    # the kernel is preserved: (F q̃)ᵀ MᵀM k̃ = q̃ᵀ k̃ for any q, k
    g = torch.Generator().manual_seed(5)
    qt = torch.randn(20, HEADS, HEAD_DIM, generator=g, dtype=F64)
    kt = torch.randn(20, HEADS, HEAD_DIM, generator=g, dtype=F64)
    folded = torch.einsum("hij,nhj->nhi", fold, qt)
    whitened = torch.einsum("nhi,hij,hjk,mhk->hnm", folded, m.transpose(-1, -2), m, kt)
    plain = torch.einsum("nhi,mhi->hnm", qt, kt)
    assert rel_err(whitened, plain) <= 1e-8


def test_data_aware_transform_whitens_a_known_case():
    # A = a·I, B = b·I  →  S = √(a/b)·I
    g = torch.Generator().manual_seed(0)
    n, d = 4000, 4
    basis = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=F64))[0] * n**0.5  # E[xxᵀ] = I exactly
    q = (2.0 * basis)[:, None]
    k = (0.5 * basis)[:, None]
    m, fold = data_aware_transform(q, k, eps=1e-9)
    assert torch.allclose(m @ m, 4.0 * torch.eye(d, dtype=F64)[None], atol=1e-6)
    assert torch.allclose(fold, 0.25 * torch.eye(d, dtype=F64)[None], atol=1e-6)
