"""The blocked triangular solve shared by Cubit and DeltaFormer: the paths the mixer tests do not
reach on their own — heads processed in groups (long sequences), several batch elements with
different document layouts, reference rows shorter than the norm clamp — against the float64
references, forward and every input gradient, at odd lengths and chunk sizes not dividing T."""

from __future__ import annotations

import pytest
import torch

from kernelmix import ops
from kernelmix.ops import _triangular
from tests.utils import rel_rmse

F64 = torch.float64
B, H, HKV, D = 2, 4, 2, 8


def _doc_start(lengths: list[int]) -> torch.Tensor:
    starts, pos = [], 0
    for n in lengths:
        starts += [pos] * n
        pos += n
    return torch.tensor(starts)


def _layouts(T: int) -> torch.Tensor:
    """Batch element 0: one document; 1: documents of varied lengths (some shorter than a chunk)."""
    lengths, left = [], T
    for n in (1, 2, 17, 5, 30, 3):
        if left <= 0:
            break
        lengths.append(min(n, left))
        left -= lengths[-1]
    if left > 0:
        lengths.append(left)
    return torch.stack([torch.zeros(T, dtype=torch.long), _doc_start(lengths)])


def _inputs(T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, T, H, D, generator=g, dtype=F64),
        "k": torch.randn(B, T, HKV, D, generator=g, dtype=F64),
        "v": torch.randn(B, T, HKV, D, generator=g, dtype=F64),
        "r": torch.randn(B, T, H, D, generator=g, dtype=F64),
        "rho": 0.5 + 1.5 * torch.rand(B, T, H, generator=g, dtype=F64),
        "beta": torch.rand(B, T, H, generator=g, dtype=F64),
    }


def _cubit(impl, t, **kw):
    return impl(t["q"], t["k"], t["v"], t["r"], rho=t["rho"], ridge=torch.tensor([1e-6, 1e-2, 0.1, 0.5], dtype=F64),
                ref_scale=torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=F64), **kw)


def _deltaformer(impl, t, **kw):
    return impl(t["q"], t["k"], t["v"], beta=t["beta"], **kw)


MIXERS = {
    "cubit": (ops.cubit_attention, ops.cubit_attention_naive, _cubit, ["q", "k", "v", "r", "rho"]),
    "deltaformer": (ops.deltaformer_attention, ops.deltaformer_attention_naive, _deltaformer, ["q", "k", "v", "beta"]),
}


def _forward_and_grads(call, t, names, grad_out):
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    out = call(leaves)
    return out, torch.autograd.grad(out, [leaves[n] for n in names], grad_out, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("documents", [False, True], ids=["one-doc", "docs"])
@pytest.mark.parametrize("T, chunk", [(1, 16), (63, 16), (65, 16), (65, 7)])
@pytest.mark.parametrize("name", list(MIXERS))
def test_head_groups_match_reference(monkeypatch, name, T, chunk, documents):
    # one head per group (a kernel block of ≤ 1 element forces the smallest groups)
    monkeypatch.setattr(_triangular, "TILE_ELEMENTS", 1)
    fast, naive, call, names = MIXERS[name]
    t = _inputs(T, seed=T + chunk)
    doc = {"doc_start": _layouts(T)} if documents else {}
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(3), dtype=F64)
    ref, ref_grads = _forward_and_grads(lambda z: call(naive, z, **doc), t, names, grad_out)
    out, grads = _forward_and_grads(lambda z: call(fast, z, chunk_size=chunk, **doc), t, names, grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert torch.isfinite(got).all(), n
        assert rel_rmse(got, want) <= 1e-10, n


@pytest.mark.parametrize("name", list(MIXERS))
def test_group_size_does_not_change_the_result(monkeypatch, name):
    fast, _, call, _ = MIXERS[name]
    t = _inputs(65, seed=5)
    t32 = {n: x.float() for n, x in t.items()}
    whole = call(fast, t32, chunk_size=16)
    monkeypatch.setattr(_triangular, "TILE_ELEMENTS", 1)
    grouped = call(fast, t32, chunk_size=16)
    assert torch.allclose(whole, grouped, rtol=1e-5, atol=1e-6)


def test_cubit_references_below_the_norm_clamp():
    # r ≈ 0 rows: r̂ = s·r/1e-6 and the diagonal logit is no longer the row maximum (all logits are
    # then tiny, so the stabiliser stays safe); the result must still match the reference
    t = _inputs(33, seed=11)
    t["r"][:, 3] = 0.0
    t["r"][:, 10] *= 1e-9
    grad_out = torch.randn(B, 33, H, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    names = ["q", "k", "v", "r", "rho"]
    ref, ref_grads = _forward_and_grads(lambda z: _cubit(ops.cubit_attention_naive, z), t, names, grad_out)
    out, grads = _forward_and_grads(lambda z: _cubit(ops.cubit_attention, z, chunk_size=8), t, names, grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-8, n


def test_large_logits_do_not_overflow():
    # big reference scale / keys: logits of several hundred; the stabilisers keep exp2 finite
    t = _inputs(40, seed=12)
    t["k"] = t["k"] * 30.0
    names = ["q", "k", "v", "beta"]
    grad_out = torch.randn(B, 40, H, D, generator=torch.Generator().manual_seed(5), dtype=F64)
    t32 = {n: x.float() for n, x in t.items()}
    ref, _ = _forward_and_grads(lambda z: _deltaformer(ops.deltaformer_attention_naive, z), t, names, grad_out)
    out, grads = _forward_and_grads(lambda z: _deltaformer(ops.deltaformer_attention, z, chunk_size=16), t32, names,
                                    grad_out.float())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_rmse(out, ref) <= 1e-3
    c = ops.cubit_attention(t32["q"], t32["k"], t32["v"], t32["r"], ref_scale=200.0, chunk_size=16)
    c_ref = ops.cubit_attention_naive(t["q"], t["k"], t["v"], t["r"], ref_scale=200.0)
    assert torch.isfinite(c).all() and rel_rmse(c, c_ref) <= 1e-3
