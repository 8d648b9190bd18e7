"""Decode caches that grow in spare buffer rows: the values of torch.cat, amortised reallocation,
and a state that stays a value (continued twice, each continuation keeps its own rows)."""

from __future__ import annotations

import pytest
import torch

from kernelmix.ops._common import MIN_SPARE_ROWS, append_rows


def _rows(count: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, count, 3, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_appends_give_the_concatenation_and_reallocate_rarely():
    cached, pieces, buffers = None, [], set()
    for step in range(700):
        new = _rows(1 + step % 3, step)  # odd sizes: 1, 2 and 3 rows at a time
        cached = append_rows(cached, new)
        pieces.append(new)
        buffers.add(id(cached._base))
        assert torch.equal(cached, torch.cat(pieces, dim=1))
    rows = cached.shape[1]
    assert rows == sum(p.shape[1] for p in pieces) and cached._base.shape[1] >= rows
    # × 1.5 growth from MIN_SPARE_ROWS: about log_1.5(rows / 64) buffers, not one per step
    assert len(buffers) <= 2 + torch.tensor(rows / MIN_SPARE_ROWS).log().item() / torch.tensor(1.5).log().item()


def test_a_state_continued_twice_keeps_both_continuations():
    start = append_rows(append_rows(None, _rows(5, 0)), _rows(1, 1))
    snapshot = start.clone()
    first = append_rows(start, _rows(1, 2))
    second = append_rows(start, _rows(1, 3))  # must not write over first's last row
    assert torch.equal(first[:, :6], snapshot) and torch.equal(first[:, 6:], _rows(1, 2))
    assert torch.equal(second[:, :6], snapshot) and torch.equal(second[:, 6:], _rows(1, 3))
    assert torch.equal(start, snapshot)
    assert torch.equal(append_rows(first, _rows(1, 4))[:, 6:7], _rows(1, 2))  # first still grows correctly
    assert torch.equal(append_rows(first[:, :4], _rows(1, 5))[:, 4:], _rows(1, 5))  # a shorter view: a copy
    assert torch.equal(first[:, 4:6], snapshot[:, 4:6])


def test_dtype_promotion_gradients_and_inference_tensors():
    mixed = append_rows(_rows(3, 0, torch.bfloat16), _rows(1, 1))
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, torch.cat([_rows(3, 0, torch.bfloat16).float(), _rows(1, 1)], dim=1))

    leaf = _rows(2, 2).requires_grad_()
    grown = append_rows(append_rows(None, _rows(3, 3)), leaf)  # with a graph: a plain concatenation
    grown.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))

    with torch.inference_mode():
        made_in_inference = append_rows(None, _rows(2, 4))
    later = append_rows(made_in_inference, _rows(1, 5))  # outside inference mode: copied, not written into
    assert torch.equal(later, torch.cat([_rows(2, 4), _rows(1, 5)], dim=1))


@pytest.mark.parametrize("mixer", ["softmax", "cubit", "deltaformer"])
def test_a_decoded_cache_is_a_view_with_spare_rows(mixer):
    """The decode steps append with append_rows: after a few tokens the cache lives in a buffer
    with room for more, so the next token writes one row instead of copying the cache."""
    from kernelmix.model import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.preset("tiny", mixer=mixer), seed=0).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 256, (1, 5)), use_cache=True)
        for _ in range(3):
            out = model(torch.randint(0, 256, (1, 1)), cache=out.cache, use_cache=True)
    state = out.cache.layers[0].state
    keys = state.k
    assert keys.shape[1] == 8 and keys._base is not None and keys._base.shape[1] > 8
