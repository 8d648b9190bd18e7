"""The CPU bf16 policy (ops/_common.py, policy 2): on a CPU without native bf16 matrix products the
attention read-out runs in fp32 and returns bf16. Forced on and off here, so both paths are
tested on any machine: dtypes, accuracy against the float64 references within bf16 bounds,
gradients, autocast, and that it never applies off the CPU."""

from __future__ import annotations

import pytest
import torch

from kernelmix import ops
from kernelmix.ops import _common
from tests.utils import rel_rmse, rms

B, T, H, HKV, D = 2, 65, 4, 2, 16
BF16_TOL = 2e-2  # the bf16 forward bound of the core tests


def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, T, H, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, T, HKV, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, T, HKV, D, generator=g, dtype=torch.float64),
        "r": torch.randn(B, T, H, D, generator=g, dtype=torch.float64),
        "rho": 0.5 + 1.5 * torch.rand(B, T, H, generator=g, dtype=torch.float64),
        "beta": torch.rand(B, T, H, generator=g, dtype=torch.float64),
    }


MIXERS = {
    "softmax": (lambda x, **kw: ops.softmax_attention(x["q"], x["k"], x["v"], **kw),
                lambda x: ops.softmax_attention_naive(x["q"], x["k"], x["v"]), ["q", "k", "v"]),
    "cubit": (lambda x, **kw: ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], chunk_size=16, **kw),
              lambda x: ops.cubit_attention_naive(x["q"], x["k"], x["v"], x["r"], rho=x["rho"]), ["q", "k", "v", "r"]),
    "deltaformer": (lambda x, **kw: ops.deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], chunk_size=16,
                                                              **kw),
                    lambda x: ops.deltaformer_attention_naive(x["q"], x["k"], x["v"], beta=x["beta"]), ["q", "k", "v"]),
}


@pytest.fixture(params=[False, True], ids=["policy-on", "native-bf16"])
def native(request, monkeypatch):
    monkeypatch.setattr(_common, "cpu_has_native_bf16", lambda: request.param)
    return request.param


def _grads(fn, x: dict, names: list[str], grad_out: torch.Tensor, autocast: bool = False):
    leaves = {n: t.detach().clone().requires_grad_(n in names) for n, t in x.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], grad_out.to(out.dtype))
    return out, dict(zip(names, grads))


def test_predicate(native, monkeypatch):
    x = torch.zeros(2, dtype=torch.bfloat16)
    assert _common.bf16_attention_in_fp32(x) is (not native)
    assert not _common.bf16_attention_in_fp32(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _common.bf16_attention_in_fp32(x.float()) is (not native)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not _common.bf16_attention_in_fp32(x.float())
    # never off the CPU (CUDA and other accelerators have their own bf16 kernels)
    assert not _common.bf16_attention_in_fp32(torch.zeros(2, dtype=torch.bfloat16, device="meta"))


def test_policy_computes_in_fp32(monkeypatch):
    monkeypatch.setattr(_common, "cpu_has_native_bf16", lambda: False)
    x = {n: _inputs(0)[n].bfloat16() for n in ("q", "k", "v")}
    out = ops.softmax_attention(x["q"], x["k"], x["v"])
    assert out.dtype == torch.bfloat16
    # exactly the fp32 computation rounded once
    assert torch.equal(out, ops.softmax_attention(x["q"].float(), x["k"].float(), x["v"].float()).bfloat16())
    step, _ = ops.softmax_attention_step(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], None)
    assert step.dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(MIXERS))
def test_bf16_inputs(native, name):
    fast, naive, names = MIXERS[name]
    x = _inputs(1)
    x_bf16 = {n: t.bfloat16() for n, t in x.items()}
    ref_in = {n: t.double() for n, t in x_bf16.items()}  # the reference sees the same rounded inputs
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, grads = _grads(fast, x_bf16, names, grad_out.bfloat16())
    ref, ref_grads = _grads(naive, ref_in, names, grad_out.bfloat16().double())
    assert out.dtype == torch.bfloat16
    assert rel_rmse(out, ref) <= BF16_TOL
    for n in names:
        assert grads[n].dtype == torch.bfloat16 and torch.isfinite(grads[n]).all(), n
        assert rel_rmse(grads[n], ref_grads[n]) <= BF16_TOL, n


@pytest.mark.parametrize("name", list(MIXERS))
def test_fp32_inputs_under_bf16_autocast(native, name):
    fast, naive, names = MIXERS[name]
    x = _inputs(3)
    x32 = {n: t.float() for n, t in x.items()}
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, grads = _grads(fast, x32, names, grad_out.float(), autocast=True)
    ref, ref_grads = _grads(naive, x, names, grad_out)
    # softmax attention returns autocast's dtype; Cubit and DeltaFormer return v's
    assert out.dtype == (torch.bfloat16 if name == "softmax" else torch.float32)
    assert rel_rmse(out, ref) <= BF16_TOL
    for n in names:
        assert grads[n].dtype == torch.float32 and torch.isfinite(grads[n]).all(), n
        assert rms(grads[n].double() - ref_grads[n]) <= BF16_TOL * rms(ref_grads[n]), n


@pytest.mark.parametrize("name", ["cubit", "deltaformer"])
def test_decode_steps_keep_the_solve_in_fp32_under_bf16_autocast(name):
    """The cached u of a decode step is the last row of the triangular solve: under bf16 autocast
    it must come out as without autocast (a bf16 Gram row compounds along the sequence; at a small
    ridge it put Cubit's u off by 0.2 of 34 before the step turned autocast off)."""
    g = torch.Generator().manual_seed(0)
    batch, length, heads, dim = 1, 40, 2, 16
    q, k, v, r = (torch.randn(batch, length, heads, dim, generator=g) for _ in range(4))
    beta = torch.rand(batch, length, heads, generator=g)

    def cached_u(autocast: bool) -> torch.Tensor:
        state = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for t in range(length):
                sl = slice(t, t + 1)
                if name == "cubit":
                    _, state = ops.cubit_attention_step(q[:, sl], k[:, sl], v[:, sl], r[:, sl], state, ridge=1e-3)
                else:
                    _, state = ops.deltaformer_attention_step(q[:, sl], k[:, sl], v[:, sl], state, beta=beta[:, sl])
        return state.u

    plain, mixed = cached_u(False), cached_u(True)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=1e-6, atol=1e-6)
