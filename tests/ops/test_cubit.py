"""Cubit (docs/math.md §3): blocked fast path vs the dense reference, gradients, causality, decode, math."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from kernelmix.ops import (
    CubitState,
    cubit_attention,
    cubit_attention_naive,
    cubit_attention_step,
    cubit_solve,
)
from tests.utils import rel_rmse, rms

B, H, H_KV, D, D_V, D_R = 2, 4, 2, 16, 12, 8
PER_TOKEN = ("q", "k", "v", "r", "rho")  # inputs with a token axis (dim 1)


def grad_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel_rmse, except against an exactly-zero reference (q, k, r, ref_scale gradients at T = 1:
    a one-element softmax has no gradient), where the fast path returns rounding noise of a
    cancelling sum (~1e-6 in float32): there the RMS error is taken absolutely, on the O(1) scale
    of the inputs."""
    if rms(expected) == 0.0:
        return rms(actual)
    return rel_rmse(actual, expected)


def make_inputs(T: int, *, seed: int, h_kv: int = H_KV, with_rho: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = {
        "q": randn(B, T, H, D),
        "k": randn(B, T, h_kv, D),
        "v": randn(B, T, h_kv, D_V),
        "r": randn(B, T, H, D_R),
        "rho": 0.5 + 1.5 * torch.sigmoid(randn(B, T, H)) if with_rho else None,
        # one tiny ridge (the init), the others better conditioned; distinct per-head scales
        "ridge": torch.tensor([1e-6, 1e-2, 0.1, 0.5], dtype=torch.float64),
        "ref_scale": torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=torch.float64),
    }
    return x


def convert(x: dict, dtype: torch.dtype) -> dict:
    return {n: None if t is None else t.detach().to(dtype) for n, t in x.items()}


def token_slice(x: dict, start: int, stop: int) -> dict:
    return {n: t[:, start:stop] if n in PER_TOKEN and t is not None else t for n, t in x.items()}


def fast(x: dict, chunk_size: int, **kw):
    return cubit_attention(
        x["q"], x["k"], x["v"], x["r"], rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"],
        chunk_size=chunk_size, **kw,
    )


def naive(x: dict):
    return cubit_attention_naive(
        x["q"], x["k"], x["v"], x["r"], rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"]
    )


def step(x: dict, state):
    return cubit_attention_step(
        x["q"], x["k"], x["v"], x["r"], state, rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"]
    )


def forward_and_grads(fn, x: dict, grad_out: torch.Tensor):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None}
    out = fn({**x, **leaves})
    grads = torch.autograd.grad(
        out, list(leaves.values()), grad_out.to(out.dtype), allow_unused=True, materialize_grads=True
    )
    return out.detach(), dict(zip(leaves, grads))


# ------------------------------------------------------------------------------------------------
# 1. fast path vs dense reference (forward and every input gradient)

CASES = [  # (T, chunk_size, H_kv, with_rho)
    (1, 16, H_KV, True),
    (2, 3, H, True),
    (63, 16, H_KV, True),
    (65, 16, H, True),
    (65, 16, H_KV, False),
    (257, 64, H_KV, True),
    (257, 48, H, True),
]


@functools.lru_cache(maxsize=None)
def reference_case(T, h_kv, with_rho):
    """Inputs rounded to float32 (so the float64 and float32 runs share one float64 reference),
    an output gradient, and the reference output and input gradients in float64."""
    x = make_inputs(T, seed=T + 7 * h_kv, h_kv=h_kv, with_rho=with_rho)
    x = convert(convert(x, torch.float32), torch.float64)
    grad_out = torch.randn(B, T, H, D_V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out_ref, grads_ref = forward_and_grads(naive, x, grad_out)
    return x, grad_out, out_ref, grads_ref


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("T, chunk, h_kv, with_rho", CASES)
def test_fast_matches_naive_forward_and_grads(T, chunk, h_kv, with_rho, dtype, tol):
    x, grad_out, out_ref, grads_ref = reference_case(T, h_kv, with_rho)
    out, grads = forward_and_grads(lambda z: fast(z, chunk), convert(x, dtype), grad_out)

    assert out.dtype == dtype and out.shape == (B, T, H, D_V)
    err = rel_rmse(out, out_ref)
    assert err <= tol, f"forward rel RMSE {err:.2e}"
    assert set(grads) == {"q", "k", "v", "r", "ridge", "ref_scale"} | ({"rho"} if with_rho else set())
    for name, g in grads.items():
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err = grad_error(g, grads_ref[name])
        assert err <= tol, f"d{name}: rel RMSE {err:.2e}"


@pytest.mark.parametrize("T, chunk", [(2, 3), (65, 16)])
def test_bf16_forward_solves_in_fp32(T, chunk):
    x = convert(make_inputs(T, seed=3), torch.bfloat16)
    x["ridge"] = x["ridge"].float()
    x["ref_scale"] = x["ref_scale"].float()
    x_ref = convert(x, torch.float64)

    out, state = fast(x, chunk, return_state=True)
    assert out.dtype == torch.bfloat16
    assert state.u.dtype == torch.float32 and state.r_hat.dtype == torch.float32
    err = rel_rmse(out, naive(x_ref))
    assert err <= 2e-2, f"bf16 forward rel RMSE {err:.2e}"

    u, r_hat = cubit_solve(x["r"], x["v"], rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"], chunk_size=chunk)
    assert u.dtype == torch.float32 and r_hat.dtype == torch.float32
    u_ref, _ = cubit_solve(
        x_ref["r"], x_ref["v"], rho=x_ref["rho"], ridge=x_ref["ridge"], ref_scale=x_ref["ref_scale"], chunk_size=chunk
    )
    # fp32 accuracy on the bf16 inputs: a bf16 solve would be ~1e-2 off
    assert rel_rmse(u, u_ref) <= 1e-4


def test_solve_stays_fp32_under_bf16_autocast():
    T, chunk = 65, 16
    x = convert(make_inputs(T, seed=4), torch.float32)
    grad_u = torch.randn(B, T, H, D_V, generator=torch.Generator().manual_seed(2))

    def solve_and_grads(x, autocast):
        r, v = x["r"].clone().requires_grad_(), x["v"].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            u, _ = cubit_solve(r, v, rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"], chunk_size=chunk)
            grads = torch.autograd.grad(u, (r, v), grad_u.to(u.dtype))
        return u, grads

    u, grads = solve_and_grads(x, True)
    u_ref, grads_ref = solve_and_grads(convert(x, torch.float64), False)
    assert u.dtype == torch.float32
    assert rel_rmse(u, u_ref) <= 1e-4
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32 and rel_rmse(g, g_ref) <= 1e-4


# ------------------------------------------------------------------------------------------------
# 2. gradcheck of the custom autograd.Function (through the public op)


@pytest.mark.parametrize("T, h_kv", [(7, 1), (9, 2)])  # chunk 3: a partial last chunk, exact chunks
def test_gradcheck(T, h_kv):
    g = torch.Generator().manual_seed(T + h_kv)
    d, heads = 4, 2

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v, r = leaf(1, T, heads, d), leaf(1, T, h_kv, d), leaf(1, T, h_kv, d), leaf(1, T, heads, d)
    rho = (0.5 + 1.5 * torch.rand(1, T, heads, generator=g, dtype=torch.float64)).requires_grad_()
    ridge = torch.tensor([0.1, 0.5], dtype=torch.float64, requires_grad=True)
    ref_scale = torch.tensor([0.7, 1.5], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, r, rho, ridge, ref_scale):
        return cubit_attention(q, k, v, r, rho=rho, ridge=ridge, ref_scale=ref_scale, chunk_size=3)

    assert torch.autograd.gradcheck(f, (q, k, v, r, rho, ridge, ref_scale), eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# 3. causality


@pytest.mark.parametrize("t", [0, 3, 4, 7, 8, 13, 18])
def test_causality(t):
    T, chunk = 20, 4
    x = make_inputs(T, seed=11)
    y = {n: None if v is None else v.clone() for n, v in x.items()}
    noise = make_inputs(T, seed=12)
    for name in PER_TOKEN:
        y[name][:, t + 1 :] = noise[name][:, t + 1 :]
    for fn in (lambda z: fast(z, chunk), naive):
        a, b = fn(x), fn(y)
        assert (a[:, : t + 1] - b[:, : t + 1]).abs().max().item() <= 1e-12
        if t + 1 < T:  # the perturbation is real
            assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------
# 4. decode


@pytest.mark.parametrize("prefill", [0, 7])
@pytest.mark.parametrize("h_kv", [H, H_KV])
def test_decode_matches_parallel(prefill, h_kv):
    T, chunk = 23, 5
    x = make_inputs(T, seed=21, h_kv=h_kv)
    full, full_state = fast(x, chunk, return_state=True)

    state, outs = None, []
    if prefill:
        out, state = fast(token_slice(x, 0, prefill), chunk, return_state=True)
        assert isinstance(state, CubitState) and state.length == prefill
        outs.append(out)
    for t in range(prefill, T):
        out, state = step(token_slice(x, t, t + 1), state)
        assert out.shape == (B, 1, H, D_V)
        assert state.length == t + 1
        outs.append(out)

    assert rel_rmse(torch.cat(outs, dim=1), full) <= 1e-10
    # cached u and r̂ never change: the stepped cache is the parallel one
    assert rel_rmse(state.u, full_state.u) <= 1e-10
    assert rel_rmse(state.r_hat, full_state.r_hat) <= 1e-10
    assert torch.equal(state.k, x["k"])


# ------------------------------------------------------------------------------------------------
# 5. math


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("ridge", [1e-6, 0.5, "per-head"])
def test_constant_value_column_scaled_by_one_over_one_plus_ridge(ridge, impl):
    T = 40
    x = make_inputs(T, seed=5, with_rho=False)
    x["v"][..., 0] = 3.0
    if ridge == "per-head":
        lam = x["ridge"] = torch.tensor([1e-6, 0.5, 0.1, 2.0], dtype=torch.float64)
    else:
        lam, x["ridge"] = torch.full((H,), ridge, dtype=torch.float64), ridge  # a plain float ridge
    out = fast(x, 16) if impl == "fast" else naive(x)
    expected = (3.0 / (1.0 + lam)).expand(B, T, H)
    assert rel_rmse(out[..., 0], expected) <= 1e-10
    # the other columns are not constant, so they are not simply scaled
    assert rel_rmse(out[..., 1], torch.full_like(out[..., 1], out[..., 1].mean().item())) > 0.1


def np_causal_softmax(logits: np.ndarray) -> np.ndarray:
    """Row softmax over j ≤ i of a [..., T, T] array, zero above the diagonal (numpy, float64)."""
    T = logits.shape[-1]
    visible = np.tril(np.ones((T, T), dtype=bool))
    z = np.where(visible, logits, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_cubit(x: dict):
    """Dense Cubit written out with numpy: returns (G, r̂, U, O), G/U/O per [B, H, T, *]."""
    q, k, v, r = (x[n].numpy() for n in ("q", "k", "v", "r"))
    lam, s = x["ridge"].numpy(), x["ref_scale"].numpy()
    heads, T = q.shape[2], q.shape[1]
    group = np.arange(heads) // (heads // k.shape[2])
    k, v = k[:, :, group], v[:, :, group]
    r_hat = s[None, None, :, None] * r / np.linalg.norm(r, axis=-1, keepdims=True)
    gram = np_causal_softmax(np.einsum("bihd,bjhd->bhij", r, r_hat))
    rhs = (x["rho"].numpy()[..., None] * v).transpose(0, 2, 1, 3)
    system = gram + lam[None, :, None, None] * np.eye(T)
    u = np.linalg.solve(system, rhs)
    attn = np_causal_softmax(np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1]))
    return gram, r_hat, u, attn @ u


@pytest.mark.parametrize("h_kv", [H, H_KV])
def test_matches_dense_system_built_with_numpy(h_kv):
    T = 37
    x = make_inputs(T, seed=9, h_kv=h_kv)
    gram, r_hat_np, u_np, out_np = np_cubit(x)

    u, r_hat = cubit_solve(x["r"], x["v"], rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"], chunk_size=8)
    assert rel_rmse(r_hat, torch.from_numpy(r_hat_np)) <= 1e-12
    u_bh = u.transpose(1, 2).numpy()
    lam = x["ridge"].numpy()[None, :, None, None]
    group = np.arange(H) // (H // h_kv)
    rhs = (x["rho"].numpy()[..., None] * x["v"].numpy()[:, :, group]).transpose(0, 2, 1, 3)
    residual = gram @ u_bh + lam * u_bh - rhs
    assert np.sqrt((residual**2).mean() / (rhs**2).mean()) <= 1e-12
    assert rel_rmse(u.transpose(1, 2), torch.from_numpy(u_np)) <= 1e-10

    out, state = fast(x, 8, return_state=True)
    assert rel_rmse(out.transpose(1, 2), torch.from_numpy(out_np)) <= 1e-10
    assert rel_rmse(state.u, u) <= 1e-14


def test_grouped_heads_equal_explicitly_repeated_heads():
    T = 33
    x = make_inputs(T, seed=17, h_kv=H_KV)
    idx = torch.arange(H) // (H // H_KV)  # query head h reads kv head h // group
    x_rep = {**x, "k": x["k"][:, :, idx], "v": x["v"][:, :, idx]}
    assert rel_rmse(fast(x, 8), fast(x_rep, 8)) <= 1e-13
    assert rel_rmse(naive(x), naive(x_rep)) <= 1e-13


# ------------------------------------------------------------------------------------------------
# 6. bad input


def _bad_cases():
    T = 5
    x = make_inputs(T, seed=0)
    q, k, v, r, rho = (x[n] for n in PER_TOKEN)

    def call(**over):
        z = {**x, **over}
        chunk = z.pop("chunk_size", 4)
        return lambda: fast(z, chunk)

    def call_step(**over):
        z = {**token_slice(x, 0, 1), **over}
        return lambda: step(z, None)

    return [
        ("q-3d", call(q=q[:, :, 0]), r"q must have shape \[B, T, H, d\]"),
        ("k-3d", call(k=k[0]), r"k must have shape \[B, T, H, d\]"),
        ("batch", call(k=k[:1], v=v[:1]), r"batch sizes differ"),
        ("length", call(v=v[:, :4]), r"sequence lengths differ"),
        ("head-dim", call(k=k[..., :8]), r"head dims differ"),
        ("heads-not-divisible", call(k=k[:, :, :1].expand(B, T, 3, D), v=v[:, :, :1].expand(B, T, 3, D_V)),
         r"multiple"),
        ("rho-shape", call(rho=rho[..., None]), r"rho must have shape \[B, T, H\]"),
        ("rho-heads", call(rho=rho[:, :, :2]), r"rho must have shape \[B, T, H\]"),
        ("r-3d", call(r=r[..., 0]), r"r must have shape \[B, T, H, d\]"),
        ("r-heads", call(r=r[:, :, :2]), r"r must have shape \[B, T, H, d_r\]"),
        ("r-length", call(r=r[:, :4]), r"r must have shape \[B, T, H, d_r\]"),
        ("ridge-zero", call(ridge=0.0), r"ridge must be > 0"),
        ("ridge-negative", call(ridge=-1.0), r"ridge must be > 0"),
        ("ridge-tensor-zero", call(ridge=torch.tensor([0.1, 0.0, 0.1, 0.1])), r"ridge must be > 0"),
        ("ridge-tensor-negative", call(ridge=torch.full((H,), -1.0, dtype=torch.float64)), r"ridge must be > 0"),
        ("ridge-tensor-shape", call(ridge=torch.ones(H + 1)), r"ridge must be a float or a tensor of shape \[H\]"),
        ("ref-scale-zero", call(ref_scale=0.0), r"ref_scale must be > 0"),
        ("ref-scale-tensor-negative", call(ref_scale=-torch.ones(H, dtype=torch.float64)), r"ref_scale must be > 0"),
        ("chunk-zero", call(chunk_size=0), r"chunk_size must be a positive int"),
        ("naive-ridge-zero", lambda: naive({**x, "ridge": 0.0}), r"ridge must be > 0"),
        ("naive-q-3d", lambda: naive({**x, "q": q[:, :, 0]}), r"q must have shape"),
        ("step-two-tokens", lambda: step(token_slice(x, 0, 2), None), r"decode step takes one token \(T=1\), got T=2"),
        ("step-ridge-negative", call_step(ridge=-1.0), r"ridge must be > 0"),
        ("step-rho-shape", call_step(rho=rho[:, :1, :2]), r"rho must have shape"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_value_error(case):
    _, fn, pattern = case
    with pytest.raises(ValueError, match=pattern):
        fn()


def test_cubit_solve_validates_its_own_inputs():
    r = torch.randn(1, 4, 2, 4, dtype=torch.float64)
    v = torch.randn(1, 5, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="share B and T"):
        cubit_solve(r, v)
    with pytest.raises(ValueError, match=r"rho must have shape \[B, T, H\]"):
        cubit_solve(r, v[:, :4], rho=torch.rand(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="4 dims"):
        cubit_solve(r[0], v[0])


def test_second_derivative_is_refused_clearly():
    r = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    u, _ = cubit_solve(r, v, chunk_size=3)
    (grad_v,) = torch.autograd.grad(u.pow(2).sum(), v, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_v.sum().backward()
