"""The dense masked ops (any bool mask ``[B, T, L]``): random-feature and exact softmax attention.

With a plain causal mask (and with document masks) they must equal the float64 ``*_naive``
references, forward and gradients; with a sliding window, a dense float64 computation written out
here from the definitions; queries over a longer cache must equal the last rows of the full causal
computation; a row with nothing visible is 0 with finite gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernelmix import ops
from tests.ops.test_documents import _doc_start
from tests.utils import rel_rmse

F64 = torch.float64
B, H, HKV, D, M = 2, 4, 2, 8, 16


def _inputs(length: int, seed: int = 0, kv_length: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    kv_length = length if kv_length is None else kv_length
    return {
        "q": torch.randn(B, length, H, D, generator=g, dtype=F64),
        "k": torch.randn(B, kv_length, HKV, D, generator=g, dtype=F64),
        "v": torch.randn(B, kv_length, HKV, D, generator=g, dtype=F64),
        "transform": torch.eye(D, dtype=F64) + 0.3 * torch.randn(H, D, D, generator=g, dtype=F64),
        "projection": ops.orthogonal_random_features(M, D, num_heads=H, generator=g, dtype=F64),
    }


def _causal(length: int, kv_length: int | None = None) -> torch.Tensor:
    """Queries at the last ``length`` of ``kv_length`` positions, each reading keys j ≤ its own."""
    kv_length = length if kv_length is None else kv_length
    rows = torch.arange(kv_length - length, kv_length)
    return (torch.arange(kv_length)[None, :] <= rows[:, None]).expand(B, -1, -1)


def _sliding_window(length: int, window: int) -> torch.Tensor:
    i = torch.arange(length)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)).expand(B, -1, -1)


def _rf_masked(t, mask, darkformer):
    transform = t["transform"] if darkformer else None
    return ops.random_feature_attention_masked(t["q"], t["k"], t["v"], t["projection"], mask, transform=transform)


def _rf_naive(t, darkformer, **kw):
    transform = t["transform"] if darkformer else None
    return ops.random_feature_attention_naive(t["q"], t["k"], t["v"], t["projection"], transform=transform, **kw)


def _grads(fn, t: dict, names: list[str], grad_out: torch.Tensor):
    leaves = {n: x.clone().requires_grad_(n in names) for n, x in t.items()}
    out = fn(leaves)
    return out, torch.autograd.grad(out, [leaves[n] for n in names], grad_out)


def _dense_random_feature_attention(t, mask, darkformer):
    """φ(x) = m^{-1/2} exp(W M x̃ − ½‖M x̃‖²), x̃ = d^{-1/4} x; o_i = Σ_j K_ij v_j / Σ_j K_ij over the
    visible j, K_ij = φ(q_i)·φ(k_j); float64, no stabiliser."""
    def features(x):
        x = x * D**-0.25
        if darkformer:
            x = torch.einsum("hed,bthd->bthe", t["transform"], x)
        logits = torch.einsum("bthd,hmd->bthm", x, t["projection"]) - 0.5 * (x * x).sum(-1, keepdim=True)
        return torch.exp(logits) / math.sqrt(M)

    groups = H // HKV
    kernel = torch.einsum("bthm,blhm->bhtl", features(t["q"]), features(t["k"].repeat_interleave(groups, 2)))
    kernel = kernel * mask[:, None]
    weights = kernel / kernel.sum(-1, keepdim=True)
    return torch.einsum("bhtl,blhd->bthd", weights, t["v"].repeat_interleave(groups, 2)), weights


def _dense_softmax_attention(t, mask):
    """softmax_j(q_i·k_j/√d) over the visible j; float64."""
    groups = H // HKV
    logits = torch.einsum("bthd,blhd->bhtl", t["q"], t["k"].repeat_interleave(groups, 2)) / math.sqrt(D)
    weights = logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhtl,blhd->bthd", weights, t["v"].repeat_interleave(groups, 2)), weights


@pytest.mark.parametrize("darkformer", [False, True], ids=["performer", "darkformer"])
@pytest.mark.parametrize("T", [1, 17, 40])
def test_random_feature_masked_with_causal_mask_matches_naive(T, darkformer):
    t = _inputs(T, seed=T)
    names = ["q", "k", "v"] + (["transform"] if darkformer else [])
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref, ref_grads = _grads(lambda z: _rf_naive(z, darkformer), t, names, grad_out)
    out, grads = _grads(lambda z: _rf_masked(z, _causal(T), darkformer)[0], t, names, grad_out)
    assert out.dtype == F64 and out.shape == (B, T, H, D)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-10, n


@pytest.mark.parametrize("T", [1, 17, 40])
def test_softmax_masked_with_causal_mask_matches_naive(T):
    t = _inputs(T, seed=T + 1)
    names = ["q", "k", "v"]
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref, ref_grads = _grads(lambda z: ops.softmax_attention_naive(z["q"], z["k"], z["v"]), t, names, grad_out)
    out, grads = _grads(lambda z: ops.softmax_attention_masked(z["q"], z["k"], z["v"], _causal(T))[0], t, names,
                        grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-10, n


def test_document_masks_match_the_references_with_doc_start():
    T = 30
    t = _inputs(T, seed=3)
    doc_start = torch.stack([torch.zeros(T, dtype=torch.long), _doc_start([4, 1, 11, 14])])
    same_doc = torch.arange(T)[None, None, :] >= doc_start[:, :, None]
    mask = _causal(T) & same_doc
    rf, _ = _rf_masked(t, mask, darkformer=True)
    assert rel_rmse(rf, _rf_naive(t, darkformer=True, doc_start=doc_start)) <= 1e-10
    sm, _ = ops.softmax_attention_masked(t["q"], t["k"], t["v"], mask)
    assert rel_rmse(sm, ops.softmax_attention_naive(t["q"], t["k"], t["v"], doc_start=doc_start)) <= 1e-10


@pytest.mark.parametrize("window", [1, 4, 16])
def test_sliding_window_matches_dense_float64(window):
    T = 33
    t = _inputs(T, seed=window)
    mask = _sliding_window(T, window)
    rf, rf_weights = _rf_masked(t, mask, darkformer=True)
    rf_ref, rf_ref_weights = _dense_random_feature_attention(t, mask, darkformer=True)
    assert rel_rmse(rf, rf_ref) <= 1e-10 and rel_rmse(rf_weights, rf_ref_weights) <= 1e-10
    sm, sm_weights = ops.softmax_attention_masked(t["q"], t["k"], t["v"], mask)
    sm_ref, sm_ref_weights = _dense_softmax_attention(t, mask)
    assert rel_rmse(sm, sm_ref) <= 1e-10 and rel_rmse(sm_weights, sm_ref_weights) <= 1e-10
    # nothing outside the window: the weights there are exactly 0
    hidden = ~mask[:, None].expand_as(rf_weights)
    assert not rf_weights[hidden].any() and not sm_weights[hidden].any()


def test_queries_over_a_longer_cache_equal_the_last_rows():
    # T = 5 queries, L = 21 keys (decode / chunked prefill over a cache): the last rows of the full run
    T, L = 5, 21
    full = _inputs(L, seed=7)
    t = dict(full, q=full["q"][:, -T:])
    rf, _ = _rf_masked(t, _causal(T, L), darkformer=True)
    assert rf.shape == (B, T, H, D)
    assert rel_rmse(rf, _rf_naive(full, darkformer=True)[:, -T:]) <= 1e-10
    sm, _ = ops.softmax_attention_masked(t["q"], t["k"], t["v"], _causal(T, L))
    assert rel_rmse(sm, ops.softmax_attention_naive(full["q"], full["k"], full["v"])[:, -T:]) <= 1e-10


@pytest.mark.parametrize("op", ["random_features", "softmax"])
def test_a_row_with_no_visible_key_is_zero_with_finite_gradients(op):
    T = 9
    t = _inputs(T, seed=4)
    mask = _causal(T).clone()
    mask[0, 3] = False
    names = ["q", "k", "v"]
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(3), dtype=F64)
    if op == "softmax":
        fn = lambda z: ops.softmax_attention_masked(z["q"], z["k"], z["v"], mask)[0]  # noqa: E731
    else:
        fn = lambda z: _rf_masked(z, mask, darkformer=True)[0]  # noqa: E731
    out, grads = _grads(fn, t, names, grad_out)
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3]))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][0, 3], torch.zeros_like(grads[0][0, 3]))  # q of the empty row


def test_float32_and_bfloat16_inputs():
    # computed in float32 (also for bf16 inputs and under autocast); out in v's dtype
    T = 20
    t = _inputs(T, seed=5)
    ref, _ = _rf_masked(t, _causal(T), darkformer=True)
    for dtype in (torch.float32, torch.bfloat16):
        low = {n: x.to(dtype) for n, x in t.items()}
        out, weights = _rf_masked(low, _causal(T), darkformer=True)
        assert out.dtype == dtype and weights.dtype == torch.float32
        assert rel_rmse(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = _rf_masked({n: x.float() for n, x in t.items()}, _causal(T), darkformer=True)
    assert out.dtype == torch.float32 and rel_rmse(out, ref) <= 1e-5


@pytest.mark.parametrize(
    "mask, match",
    [
        (_causal(6).float(), "bool"),
        (_causal(6)[:, :, :5], r"\[B, T, L\]"),
        (_causal(6)[0], "bool tensor"),
        (torch.ones(3, 6, 6, dtype=torch.bool), r"\[B, T, L\]"),
    ],
    ids=["float", "short-keys", "2d", "batch"],
)
def test_bad_masks_raise_value_errors(mask, match):
    t = _inputs(6)
    with pytest.raises(ValueError, match=match):
        ops.softmax_attention_masked(t["q"], t["k"], t["v"], mask)
    with pytest.raises(ValueError, match=match):
        ops.random_feature_attention_masked(t["q"], t["k"], t["v"], t["projection"], mask)


def test_keys_and_values_must_share_their_length():
    t = _inputs(6, kv_length=8)
    with pytest.raises(ValueError, match="k and v need the same length"):
        ops.softmax_attention_masked(t["q"], t["k"], t["v"][:, :7], _causal(6, 8))
