"""Causal softmax attention (docs/math.md §2): SDPA fast path vs the dense reference, GQA, causality, decode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernelmix.ops import SoftmaxState, softmax_attention, softmax_attention_naive, softmax_attention_step
from tests.utils import rel_rmse, rms

B, H, H_KV, D, D_V = 2, 4, 2, 16, 12


def grad_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel_rmse, except against an exactly-zero reference (q, k gradients at T = 1, where the
    output is v_0): there the RMS error is taken absolutely, on the O(1) scale of the inputs."""
    if rms(expected) == 0.0:
        return rms(actual)
    return rel_rmse(actual, expected)


def make_inputs(T: int, *, seed: int, h_kv: int = H_KV) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"q": randn(B, T, H, D), "k": randn(B, T, h_kv, D), "v": randn(B, T, h_kv, D_V)}


def convert(x: dict, dtype: torch.dtype) -> dict:
    return {n: t.detach().to(dtype) for n, t in x.items()}


def forward_and_grads(fn, x: dict, grad_out: torch.Tensor):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    out = fn(**leaves)
    grads = torch.autograd.grad(
        out, list(leaves.values()), grad_out.to(out.dtype), allow_unused=True, materialize_grads=True
    )
    return out.detach(), dict(zip(leaves, grads))


# ------------------------------------------------------------------------------------------------
# 1. fast path (SDPA) vs dense reference, forward and gradients


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("T, h_kv", [(1, H_KV), (2, H), (63, H_KV), (65, H), (257, H_KV)])
def test_fast_matches_naive_forward_and_grads(T, h_kv, dtype, tol):
    x = make_inputs(T, seed=T + h_kv, h_kv=h_kv)
    x_fast = convert(x, dtype)
    x_ref = convert(x_fast, torch.float64)
    grad_out = torch.randn(B, T, H, D_V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    out, grads = forward_and_grads(softmax_attention, x_fast, grad_out)
    out_ref, grads_ref = forward_and_grads(softmax_attention_naive, x_ref, grad_out)

    assert out.dtype == dtype and out.shape == (B, T, H, D_V)
    err = rel_rmse(out, out_ref)
    assert err <= tol, f"forward rel RMSE {err:.2e}"
    for name, g in grads.items():
        assert g.dtype == dtype and g.shape == x[name].shape, name
        err = grad_error(g, grads_ref[name])
        assert err <= tol, f"d{name}: rel RMSE {err:.2e}"


@pytest.mark.parametrize("T", [2, 65])
def test_bf16_forward(T):
    x = convert(make_inputs(T, seed=3), torch.bfloat16)
    out = softmax_attention(**x)
    assert out.dtype == torch.bfloat16
    err = rel_rmse(out, softmax_attention_naive(**convert(x, torch.float64)))
    assert err <= 2e-2, f"bf16 forward rel RMSE {err:.2e}"


def np_softmax_attention(q, k, v, scale):
    """Causal softmax attention written out with numpy (float64), heads already matched."""
    T = q.shape[1]
    logits = np.einsum("bihd,bjhd->bhij", q, k) * scale
    logits = np.where(np.tril(np.ones((T, T), dtype=bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", e / e.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_numpy(scale):
    T = 29
    x = make_inputs(T, seed=8, h_kv=H)
    expected = torch.from_numpy(
        np_softmax_attention(*(t.numpy() for t in x.values()), 1 / math.sqrt(D) if scale is None else scale)
    )
    assert rel_rmse(softmax_attention(**x, scale=scale), expected) <= 1e-12
    assert rel_rmse(softmax_attention_naive(**x, scale=scale), expected) <= 1e-12


def test_gqa_equals_explicitly_repeated_heads():
    T = 33
    x = make_inputs(T, seed=17, h_kv=H_KV)
    idx = torch.arange(H) // (H // H_KV)  # query head h reads kv head h // group
    x_rep = {**x, "k": x["k"][:, :, idx], "v": x["v"][:, :, idx]}
    assert rel_rmse(softmax_attention(**x), softmax_attention(**x_rep)) <= 1e-13
    assert rel_rmse(softmax_attention_naive(**x), softmax_attention_naive(**x_rep)) <= 1e-13
    # and the grouping is not the other (tiled) order
    x_tiled = {**x, "k": x["k"].repeat(1, 1, H // H_KV, 1), "v": x["v"].repeat(1, 1, H // H_KV, 1)}
    assert rel_rmse(softmax_attention(**x), softmax_attention(**x_tiled)) > 1e-2


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 7, h, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    assert torch.autograd.gradcheck(softmax_attention, (q, k, v))


# ------------------------------------------------------------------------------------------------
# 3. causality


@pytest.mark.parametrize("t", [0, 5, 18])
def test_causality(t):
    T = 20
    x = make_inputs(T, seed=11)
    noise = make_inputs(T, seed=12)
    y = {n: v.clone() for n, v in x.items()}
    for name in y:
        y[name][:, t + 1 :] = noise[name][:, t + 1 :]
    for fn in (softmax_attention, softmax_attention_naive):
        a, b = fn(**x), fn(**y)
        assert (a[:, : t + 1] - b[:, : t + 1]).abs().max().item() <= 1e-12
        if t + 1 < T:
            assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------
# 4. decode


@pytest.mark.parametrize("prefill", [0, 7])
@pytest.mark.parametrize("h_kv", [H, H_KV])
def test_decode_matches_parallel(prefill, h_kv):
    T = 23
    x = make_inputs(T, seed=21, h_kv=h_kv)
    full = softmax_attention(**x)
    state, outs = None, []
    if prefill:
        out, state = softmax_attention(**{n: t[:, :prefill] for n, t in x.items()}, return_state=True)
        assert isinstance(state, SoftmaxState) and state.length == prefill
        outs.append(out)
    for t in range(prefill, T):
        out, state = softmax_attention_step(**{n: v[:, t : t + 1] for n, v in x.items()}, state=state)
        assert out.shape == (B, 1, H, D_V)
        assert state.length == t + 1
        outs.append(out)
    assert rel_rmse(torch.cat(outs, dim=1), full) <= 1e-10
    assert torch.equal(state.k, x["k"]) and torch.equal(state.v, x["v"])


# ------------------------------------------------------------------------------------------------
# 6. bad input


def _bad_cases():
    T = 5
    x = make_inputs(T, seed=0)
    q, k, v = x["q"], x["k"], x["v"]
    step = softmax_attention_step
    return [
        ("q-3d", lambda: softmax_attention(q[:, :, 0], k, v), r"q must have shape \[B, T, H, d\]"),
        ("q-3d-naive", lambda: softmax_attention_naive(q[:, :, 0], k, v), r"q must have shape \[B, T, H, d\]"),
        ("k-int", lambda: softmax_attention(q, k.long(), v), r"k must be a floating tensor"),
        ("batch", lambda: softmax_attention(q, k[:1], v[:1]), r"batch sizes differ"),
        ("length", lambda: softmax_attention(q, k, v[:, :4]), r"sequence lengths differ"),
        ("head-dim", lambda: softmax_attention(q, k[..., :8], v), r"head dims differ"),
        ("kv-heads-differ", lambda: softmax_attention(q, k, v[:, :, :1]), r"k has 2 heads but v has 1"),
        (
            "heads-not-divisible",
            lambda: softmax_attention(q, k[:, :, :1].expand(B, T, 3, D), v[:, :, :1].expand(B, T, 3, D_V)),
            r"multiple",
        ),
        ("step-two-tokens", lambda: step(q[:, :2], k[:, :2], v[:, :2], None),
         r"decode step takes one token \(T=1\), got T=2"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_value_error(case):
    _, fn, pattern = case
    with pytest.raises(ValueError, match=pattern):
        fn()
