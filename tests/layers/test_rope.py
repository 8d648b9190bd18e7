"""Rotary embedding: norm-preserving, identity at position 0, relative-position scores."""

from __future__ import annotations

import pytest
import torch

from kernelmix.layers.rope import RopeTables, apply_rope, rope_cos_sin, rotate_half

F64 = torch.float64


def test_rotate_half():
    x = torch.arange(6.0)
    assert torch.equal(rotate_half(x), torch.tensor([-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]))


def test_rope_properties():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 8, generator=g, dtype=F64)
    k = torch.randn(1, 1, 2, 8, generator=g, dtype=F64)
    pos = lambda p: torch.tensor([p])  # noqa: E731
    assert torch.equal(apply_rope(q, pos(0)), q)
    assert torch.allclose(apply_rope(q, pos(37)).norm(dim=-1), q.norm(dim=-1), atol=1e-13)

    def score(pq, pk):
        return (apply_rope(q, pos(pq)) * apply_rope(k, pos(pk))).sum(-1)

    assert torch.allclose(score(5, 2), score(103, 100), atol=1e-12)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_rope_matches_complex_rotation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=F64)
    positions = torch.arange(10, 15)
    theta = 500.0
    out = apply_rope(x, positions, theta=theta)
    freqs = theta ** (-torch.arange(0, 8, 2, dtype=F64) / 8)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(5, 4, dtype=F64), positions[:, None] * freqs)[
        None, :, None
    ]
    assert torch.allclose(out, torch.cat([z.real, z.imag], dim=-1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_rope_tables_give_the_rotate_half_formula_bit_for_bit(dtype):
    """The shared tables (roll and a signed sine) compute what x ⊙ cos + rotate_half(x) ⊙ sin does,
    to the bit, for [T] and [B, T] positions."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 3, 8, generator=g, dtype=F64).to(dtype)
    for positions in (torch.arange(5, 12), torch.randint(0, 300, (2, 7), generator=g)):
        cos, sin = rope_cos_sin(positions, 8, dtype=dtype)
        expected = x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]
        assert torch.equal(RopeTables.at(positions, 8, dtype=dtype).apply(x), expected)
        assert torch.equal(apply_rope(x, positions), expected)


def test_rope_errors():
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(torch.arange(3), 7)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.zeros(1, 3, 1, 4), torch.arange(4))
