"""DeltaFormer (docs/math.md §4): blocked fast path vs the per-token reference, gradients, causality,
decode and the defining linear system."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from kernelmix.ops import (
    DeltaFormerState,
    deltaformer_attention,
    deltaformer_attention_naive,
    deltaformer_attention_step,
    softmax_attention,
    softmax_attention_naive,
)
from tests.utils import rel_rmse, rms

B, H, H_KV, D, D_V = 2, 4, 2, 16, 12
PER_TOKEN = ("q", "k", "v", "beta", "w")  # inputs with a token axis (dim 1)


def grad_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel_rmse, except against an exactly-zero reference (q, k, w gradients at T = 1, where the
    output is v_0): there the RMS error of the fast path's rounding noise is taken absolutely, on
    the O(1) scale of the inputs."""
    if rms(expected) == 0.0:
        return rms(actual)
    return rel_rmse(actual, expected)


def make_inputs(T: int, *, seed: int, h_kv: int = H_KV, w: str | None = None, with_beta: bool = True) -> dict:
    """w: None (the K–K default), "q" (the Q–K variant: a separate tensor holding q's values, so it
    gets its own gradient) or "grouped" (an independent w with H_kv heads)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = {
        "q": randn(B, T, H, D),
        "k": randn(B, T, h_kv, D),
        "v": randn(B, T, h_kv, D_V),
        "beta": torch.sigmoid(randn(B, T, H)) if with_beta else None,
        "w": None,
    }
    if w == "q":
        x["w"] = x["q"].clone()
    elif w == "grouped":
        x["w"] = randn(B, T, h_kv, D)
    return x


def convert(x: dict, dtype: torch.dtype) -> dict:
    return {n: None if t is None else t.detach().to(dtype) for n, t in x.items()}


def token_slice(x: dict, start: int, stop: int) -> dict:
    return {n: None if t is None else t[:, start:stop] for n, t in x.items()}


def fast(x: dict, chunk_size: int, **kw):
    return deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], w=x["w"], chunk_size=chunk_size, **kw)


def naive(x: dict):
    return deltaformer_attention_naive(x["q"], x["k"], x["v"], beta=x["beta"], w=x["w"])


def step(x: dict, state):
    return deltaformer_attention_step(x["q"], x["k"], x["v"], state, beta=x["beta"], w=x["w"])


def forward_and_grads(fn, x: dict, grad_out: torch.Tensor):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None}
    out = fn({**x, **leaves})
    grads = torch.autograd.grad(
        out, list(leaves.values()), grad_out.to(out.dtype), allow_unused=True, materialize_grads=True
    )
    return out.detach(), dict(zip(leaves, grads))


# ------------------------------------------------------------------------------------------------
# 1. fast path vs per-token reference (forward and every input gradient)

CASES = [  # (T, chunk_size, H_kv, w, with_beta)
    (1, 16, H_KV, None, True),
    (1, 16, H, "q", True),
    (2, 3, H, "q", True),
    (2, 3, H_KV, None, True),
    (63, 16, H_KV, None, True),
    (63, 16, H, "q", True),
    (65, 16, H, None, True),
    (65, 16, H_KV, "q", True),
    (65, 16, H_KV, "grouped", False),
    (257, 64, H_KV, None, True),
    (257, 48, H, "q", True),
]


@functools.lru_cache(maxsize=None)
def reference_case(T, h_kv, w, with_beta):
    """Inputs rounded to float32 (so the float64 and float32 runs share one float64 reference),
    an output gradient, and the reference output and input gradients in float64."""
    x = make_inputs(T, seed=T + 7 * h_kv, h_kv=h_kv, w=w, with_beta=with_beta)
    x = convert(convert(x, torch.float32), torch.float64)
    grad_out = torch.randn(B, T, H, D_V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out_ref, grads_ref = forward_and_grads(naive, x, grad_out)
    return x, grad_out, out_ref, grads_ref


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("T, chunk, h_kv, w, with_beta", CASES)
def test_fast_matches_naive_forward_and_grads(T, chunk, h_kv, w, with_beta, dtype, tol):
    x, grad_out, out_ref, grads_ref = reference_case(T, h_kv, w, with_beta)
    out, grads = forward_and_grads(lambda z: fast(z, chunk), convert(x, dtype), grad_out)

    assert out.dtype == dtype and out.shape == (B, T, H, D_V)
    err = rel_rmse(out, out_ref)
    assert err <= tol, f"forward rel RMSE {err:.2e}"
    assert set(grads) == {"q", "k", "v"} | ({"beta"} if with_beta else set()) | ({"w"} if w else set())
    for name, g in grads.items():
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err = grad_error(g, grads_ref[name])
        assert err <= tol, f"d{name}: rel RMSE {err:.2e}"


@pytest.mark.parametrize("T, chunk, w", [(2, 3, None), (65, 16, None), (65, 16, "q")])
def test_bf16_forward_solves_in_fp32(T, chunk, w):
    x = convert(make_inputs(T, seed=3, w=w), torch.bfloat16)
    x_ref = convert(x, torch.float64)

    out, state = fast(x, chunk, return_state=True)
    assert out.dtype == torch.bfloat16
    assert state.u.dtype == torch.float32
    err = rel_rmse(out, naive(x_ref))
    assert err <= 2e-2, f"bf16 forward rel RMSE {err:.2e}"
    _, state_ref = fast(x_ref, chunk, return_state=True)
    # fp32 accuracy on the bf16 inputs: a bf16 solve would be ~1e-2 off
    assert rel_rmse(state.u, state_ref.u) <= 1e-4


# ------------------------------------------------------------------------------------------------
# 2. gradcheck of the custom autograd.Function (through the public op)


@pytest.mark.parametrize("T, h_kv, w", [(7, 1, None), (9, 2, "q")])  # chunk 3: partial / exact chunks
def test_gradcheck(T, h_kv, w):
    g = torch.Generator().manual_seed(T + h_kv)
    d, heads = 4, 2

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(1, T, heads, d), leaf(1, T, h_kv, d), leaf(1, T, h_kv, d)
    beta = torch.rand(1, T, heads, generator=g, dtype=torch.float64).requires_grad_()
    inputs = (q, k, v, beta) if w is None else (q, k, v, beta, q.detach().clone().requires_grad_())

    def f(q, k, v, beta, w=None):
        return deltaformer_attention(q, k, v, beta=beta, w=w, chunk_size=3)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# 3. causality


@pytest.mark.parametrize("w", [None, "q"])
@pytest.mark.parametrize("t", [0, 3, 4, 7, 8, 13, 18])
def test_causality(t, w):
    T, chunk = 20, 4
    x = make_inputs(T, seed=11, w=w)
    noise = make_inputs(T, seed=12, w=w)
    y = {n: None if v is None else v.clone() for n, v in x.items()}
    for name in PER_TOKEN:
        if y[name] is not None:
            y[name][:, t + 1 :] = noise[name][:, t + 1 :]
    for fn in (lambda z: fast(z, chunk), naive):
        a, b = fn(x), fn(y)
        assert (a[:, : t + 1] - b[:, : t + 1]).abs().max().item() <= 1e-12
        if t + 1 < T:  # the perturbation is real
            assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max().item() > 1e-3


def test_causality_of_beta_and_w_alone():
    """Only beta and w after t change: outputs ≤ t must not move, later ones must."""
    T, chunk, t = 20, 4, 9
    x = make_inputs(T, seed=13, w="q")
    y = {n: v.clone() for n, v in x.items()}
    y["beta"][:, t + 1 :] = 1.0 - y["beta"][:, t + 1 :]
    y["w"][:, t + 1 :] = -3.0 * y["w"][:, t + 1 :]
    a, b = fast(x, chunk), fast(y, chunk)
    assert (a[:, : t + 1] - b[:, : t + 1]).abs().max().item() <= 1e-12
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------
# 4. decode


@pytest.mark.parametrize("prefill", [0, 7])
@pytest.mark.parametrize("h_kv, w", [(H, None), (H_KV, None), (H_KV, "q"), (H_KV, "grouped")])
def test_decode_matches_parallel(prefill, h_kv, w):
    T, chunk = 23, 5
    x = make_inputs(T, seed=21, h_kv=h_kv, w=w)
    full, full_state = fast(x, chunk, return_state=True)

    state, outs = None, []
    if prefill:
        out, state = fast(token_slice(x, 0, prefill), chunk, return_state=True)
        assert isinstance(state, DeltaFormerState) and state.length == prefill
        outs.append(out)
    for t in range(prefill, T):
        out, state = step(token_slice(x, t, t + 1), state)
        assert out.shape == (B, 1, H, D_V)
        assert state.length == t + 1
        outs.append(out)

    assert rel_rmse(torch.cat(outs, dim=1), full) <= 1e-10
    assert rel_rmse(state.u, full_state.u) <= 1e-10  # cached u never change
    assert torch.equal(state.k, x["k"])


# ------------------------------------------------------------------------------------------------
# 5. math


@pytest.mark.parametrize("h_kv, w", [(H, None), (H_KV, None), (H_KV, "q")])
def test_zero_beta_is_softmax_attention(h_kv, w):
    T = 37
    x = make_inputs(T, seed=4, h_kv=h_kv, w=w)
    x["beta"] = torch.zeros(B, T, H, dtype=torch.float64)
    expected = softmax_attention_naive(x["q"], x["k"], x["v"])
    out, state = fast(x, 8, return_state=True)
    assert torch.equal(state.u, x["v"][:, :, torch.arange(H) // (H // h_kv)])  # (I + 0·P) U = V: U = V
    assert rel_rmse(out, expected) <= 1e-14
    assert torch.equal(out, softmax_attention(x["q"], x["k"], x["v"]))
    assert rel_rmse(naive(x), expected) <= 1e-14
    # and β ≠ 0 really changes the output
    assert rel_rmse(fast(make_inputs(T, seed=4, h_kv=h_kv, w=w), 8), expected) > 1e-2


def np_causal_softmax(logits: np.ndarray, *, strict: bool) -> np.ndarray:
    """Row softmax of a [..., T, T] array over j ≤ i (j < i if strict); invisible entries and
    empty rows (row 0 when strict) are 0."""
    T = logits.shape[-1]
    visible = np.tril(np.ones((T, T), dtype=bool), -1 if strict else 0)
    z = np.where(visible, logits, -np.inf)
    row_max = z.max(axis=-1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(row_max), row_max, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


@pytest.mark.parametrize("h_kv, w", [(H, None), (H_KV, None), (H_KV, "q"), (H_KV, "grouped")])
def test_solves_dense_system_built_with_numpy(h_kv, w):
    T = 37
    x = make_inputs(T, seed=9, h_kv=h_kv, w=w)
    q, k, v, beta = (x[n].numpy() for n in ("q", "k", "v", "beta"))
    group = np.arange(H) // (H // h_kv)
    k, v = k[:, :, group], v[:, :, group]
    ww = k if x["w"] is None else x["w"].numpy()[:, :, np.arange(H) // (H // x["w"].shape[2])]
    scale = 1.0 / math.sqrt(D)
    p = np_causal_softmax(np.einsum("bihd,bjhd->bhij", ww, k) * scale, strict=True)  # [B, H, T, T]
    assert np.all(p[:, :, 0] == 0)
    system = np.eye(T) + beta.transpose(0, 2, 1)[..., None] * p
    rhs = v.transpose(0, 2, 1, 3)

    out, state = fast(x, 8, return_state=True)
    u = state.u.transpose(1, 2).numpy()
    residual = system @ u - rhs
    assert np.sqrt((residual**2).mean() / (rhs**2).mean()) <= 1e-12
    attn = np_causal_softmax(np.einsum("bihd,bjhd->bhij", q, k) * scale, strict=False)
    assert rel_rmse(out.transpose(1, 2), torch.from_numpy(attn @ u)) <= 1e-12


def test_grouped_heads_equal_explicitly_repeated_heads():
    T = 33
    x = make_inputs(T, seed=17, h_kv=H_KV, w="grouped")
    idx = torch.arange(H) // (H // H_KV)  # query head h reads kv head h // group
    x_rep = {**x, "k": x["k"][:, :, idx], "v": x["v"][:, :, idx], "w": x["w"][:, :, idx]}
    assert rel_rmse(fast(x, 8), fast(x_rep, 8)) <= 1e-13
    assert rel_rmse(naive(x), naive(x_rep)) <= 1e-13
    # w = None is the K–K form: the same as passing w = k
    x_kk = make_inputs(T, seed=17, h_kv=H_KV)
    assert rel_rmse(fast(x_kk, 8), fast({**x_kk, "w": x_kk["k"]}, 8)) <= 1e-14


# ------------------------------------------------------------------------------------------------
# 6. bad input


def _bad_cases():
    T = 5
    x = make_inputs(T, seed=0, w="q")
    q, k, v, beta = (x[n] for n in ("q", "k", "v", "beta"))

    def call(**over):
        z = {**x, **over}
        chunk = z.pop("chunk_size", 4)
        return lambda: fast(z, chunk)

    def call_step(**over):
        z = {**token_slice(x, 0, 1), **over}
        return lambda: step(z, None)

    return [
        ("q-3d", call(q=q[:, :, 0], w=None), r"q must have shape \[B, T, H, d\]"),
        ("v-5d", call(v=v[..., None]), r"v must have shape \[B, T, H, d\]"),
        ("batch", call(k=k[:1], v=v[:1]), r"batch sizes differ"),
        ("length", call(k=k[:, :4], v=v[:, :4]), r"sequence lengths differ"),
        ("head-dim", call(k=k[..., :8]), r"head dims differ"),
        ("heads-not-divisible", call(k=k[:, :, :1].expand(B, T, 3, D), v=v[:, :, :1].expand(B, T, 3, D_V)),
         r"multiple"),
        ("beta-shape", call(beta=beta[..., None]), r"beta must have shape \[B, T, H\]"),
        ("beta-length", call(beta=beta[:, :4]), r"beta must have shape \[B, T, H\]"),
        ("w-3d", call(w=q[..., 0]), r"w must have shape \[B, T, H, d\]"),
        ("w-head-dim", call(w=q[..., :8]), r"w must have shape \[B, T, H_w, d\]"),
        ("w-heads-not-divisible", call(w=q[:, :, :3]), r"w must have shape \[B, T, H_w, d\]"),
        ("chunk-zero", call(chunk_size=0), r"chunk_size must be a positive int"),
        ("naive-beta-shape", lambda: naive({**x, "beta": beta[:, :, :2]}), r"beta must have shape"),
        ("step-two-tokens", lambda: step(token_slice(x, 0, 2), None), r"decode step takes one token \(T=1\), got T=2"),
        ("step-beta-shape", call_step(beta=beta[:, :1, :2]), r"beta must have shape"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_value_error(case):
    _, fn, pattern = case
    with pytest.raises(ValueError, match=pattern):
        fn()
