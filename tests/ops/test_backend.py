"""The backend switch (kernelmix.ops, backend="auto" | "torch" | "triton"): what each choice
resolves to on this machine, and the errors that say what to do instead."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.model import ModelConfig
from kernelmix.ops import (
    BACKENDS,
    cubit_attention,
    cubit_attention_naive,
    deltaformer_attention,
    deltaformer_attention_naive,
    random_feature_attention,
)
from kernelmix.ops import _backend

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(
    _backend.triton_import_error() is not None,
    reason="triton is not installed (the test extra brings it on Linux; it has no wheels elsewhere)",
)


def test_the_choices():
    assert BACKENDS == ("auto", "torch", "triton")
    for backend in BACKENDS:
        assert _backend.check_backend(backend) == backend
    with pytest.raises(KernelmixError, match=r"unknown backend 'cuda' \(choose from: auto, torch, triton\)"):
        _backend.check_backend("cuda")


def test_auto_and_torch_take_the_pytorch_paths_on_cpu():
    for dtype in (torch.float32, torch.float64):
        assert _backend.resolve_backend("auto", CPU, dtype) == "torch"
        assert _backend.resolve_backend("torch", CPU, dtype) == "torch"


def test_auto_takes_triton_only_for_float32_cuda(monkeypatch):
    monkeypatch.setattr(_backend, "triton_import_error", lambda: None)
    cuda = torch.device("cuda")
    assert _backend.resolve_backend("auto", cuda, torch.float32) == "triton"
    assert _backend.resolve_backend("auto", cuda, torch.float64) == "torch"
    monkeypatch.setattr(_backend, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    assert _backend.resolve_backend("auto", cuda, torch.float32) == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.resolve_backend("triton", CPU, torch.float32) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1.*backend='auto' or 'torch'"):
        _backend.resolve_backend("triton", CPU, torch.float32)
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        cubit_attention(q, q, q, q, backend="triton")
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        deltaformer_attention(q, q, q, backend="triton")
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        random_feature_attention(q, q, q, torch.randn(16, 8), backend="triton")


def test_triton_refuses_float64_and_a_missing_package(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(KernelmixError, match="compute in float32.*torch.float64.*backend='auto' or 'torch'"):
        _backend.resolve_backend("triton", CPU, torch.float64)
    monkeypatch.setattr(_backend, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(KernelmixError, match="needs the triton package.*pip install triton"):
        _backend.resolve_backend("triton", CPU, torch.float32)


def test_a_torch_solver_with_the_triton_backend_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(KernelmixError, match="solver='blocked'.*leave solver='auto'"):
        cubit_attention(q, q, q, q, backend="triton", solver="blocked")


def test_unknown_backends_are_refused_by_ops_layers_and_config():
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(KernelmixError, match="unknown backend"):
        cubit_attention(q, q, q, q, backend="gpu")
    with pytest.raises(KernelmixError, match="unknown backend"):
        random_feature_attention(q, q, q, torch.randn(16, 8), backend="gpu")
    with pytest.raises(KernelmixError, match="unknown backend 'gpu'"):
        ModelConfig.preset("tiny", backend="gpu")
    config = ModelConfig.preset("tiny", mixer="cubit", backend="torch")
    assert config.backend == "torch" and ModelConfig.from_dict(config.to_dict()).backend == "torch"


# ---------------------------------------------------------------------------------------------
# The Triton kernels through the switch (CPU: Triton's interpreter, which conftest turns on)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return ((actual.to(torch.float64) - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def documents(batch: int, length: int, starts: list[list[int]]) -> torch.Tensor:
    """doc_start [B, T] for documents beginning at the given token indices (0 first) per row."""
    out = torch.zeros(batch, length, dtype=torch.long)
    for b, row in enumerate(starts):
        for s in row:
            out[b, s:] = s
    return out


@needs_triton
def test_random_feature_attention_by_triton_is_the_reference(monkeypatch):
    """bf16 inputs, grouped heads, two documents, a transform (DARKFormer): the op with
    backend="triton" against the float64 dense reference, output and gradients."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernelmix.ops import random_feature_attention_naive

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, h, 16, generator=g) for h in (2, 1, 1))  # the interpreter is slow: small
    w = torch.randn(2, 16, 16, generator=g)
    transform = torch.eye(16) + 0.1 * torch.randn(2, 16, 16, generator=g)
    doc = documents(1, 37, [[0, 20]])
    inputs = [x.clone().requires_grad_(True) for x in (q, k, v, transform)]
    out = random_feature_attention(*inputs[:3], w, transform=inputs[3], chunk_size=16, doc_start=doc, backend="triton")
    ref_inputs = [x.double().requires_grad_(True) for x in (q, k, v, transform)]
    ref = random_feature_attention_naive(*ref_inputs[:3], w.double(), transform=ref_inputs[3], doc_start=doc)
    # the kernels' default products take TF32 operands (measured ≤ 3.3e-4 in the output, ≤ 1.1e-3 in the
    # gradients: tests/ops/test_triton_features.py, which also holds full-fp32 products to 1e-4)
    assert rel_error(out, ref) <= 2e-3
    cotangent = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, inputs, cotangent)
    ref_grads = torch.autograd.grad(ref, ref_inputs, cotangent.double())
    for name, got, want in zip("q k v transform".split(), grads, ref_grads):
        assert rel_error(got, want) <= 2e-3, name
    bf16 = random_feature_attention(*(x.bfloat16() for x in (q, k, v)), w, transform=transform, chunk_size=16,
                                    doc_start=doc, backend="triton")
    assert bf16.dtype == torch.bfloat16
    bf16_ref = random_feature_attention_naive(*(x.bfloat16().double() for x in (q, k, v)), w.double(),
                                              transform=transform.double(), doc_start=doc)
    assert rel_error(bf16, bf16_ref) <= 3e-2


@needs_triton
def test_random_feature_prefill_by_triton_then_decode(monkeypatch):
    """A Triton prefill's state continues with the decode step exactly as the torch prefill's (the
    kernels' products in full fp32: their TF32 default has a test of its own)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("kernelmix.ops._triton_features.FEATURE_OPERANDS", "fp32")
    from kernelmix.ops import random_feature_attention_step

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 30, 2, 16, generator=g) for _ in range(3))
    w = torch.randn(32, 16, generator=g)
    outs = {}
    for backend in ("torch", "triton"):
        prefix, state = random_feature_attention(q[:, :29], k[:, :29], v[:, :29], w, chunk_size=16, return_state=True,
                                                 backend=backend)
        last, _ = random_feature_attention_step(q[:, 29:], k[:, 29:], v[:, 29:], w, state)
        outs[backend] = torch.cat([prefix, last], dim=1)
    assert rel_error(outs["triton"], outs["torch"]) <= 1e-5


@needs_triton
@pytest.mark.parametrize("mixer", ["cubit", "darkformer"])
def test_a_model_with_the_triton_backend_trains_like_the_torch_one(mixer, monkeypatch):
    """ModelConfig.backend reaches the ops: the same loss and gradients from both backends (the
    random-feature kernels' products in full fp32, so that the bounds are float32's)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("kernelmix.ops._triton_features.FEATURE_OPERANDS", "fp32")
    from kernelmix.model import CausalLM

    tokens = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("torch", "triton"):
        config = ModelConfig.preset("tiny", mixer=mixer, num_layers=1, backend=backend)
        model = CausalLM(config, seed=3)
        assert all(getattr(m, "backend", backend) == backend for m in model.modules())
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-6)
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def solve_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 37, 2, 16, generator=g)
    k, v = torch.randn(1, 37, 1, 16, generator=g), torch.randn(1, 37, 1, 12, generator=g)  # GQA, d_v ≠ d
    return {"q": q, "k": k, "v": v, "r": torch.randn(1, 37, 2, 8, generator=g),
            "rho": 0.5 + 1.5 * torch.rand(1, 37, 2, generator=g), "beta": torch.rand(1, 37, 2, generator=g),
            "ridge": torch.tensor([1e-6, 0.1]), "ref_scale": torch.tensor([1.0, 2.0]),
            "cotangent": torch.randn(1, 37, 2, 12, generator=g), "doc_start": documents(1, 37, [[0, 20]])}


@needs_triton
@pytest.mark.parametrize("op", ["cubit", "deltaformer"])
def test_the_solves_by_triton_are_the_reference(op, monkeypatch):
    """Cubit (ρ, per-head ridge and ref_scale) and DeltaFormer (β) with backend="triton" against
    their float64 references through the ops: two documents, grouped heads, d_v ≠ d, every gradient."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = solve_inputs(4)
    names = ["q", "k", "v", "r", "rho", "ridge", "ref_scale"] if op == "cubit" else ["q", "k", "v", "beta"]

    def run(tensors: dict, fast: bool):
        if op == "cubit":
            fn = cubit_attention if fast else cubit_attention_naive
            kw = {"chunk_size": 16, "backend": "triton"} if fast else {}
            return fn(tensors["q"], tensors["k"], tensors["v"], tensors["r"], rho=tensors["rho"],
                      ridge=tensors["ridge"], ref_scale=tensors["ref_scale"], doc_start=x["doc_start"], **kw)
        fn = deltaformer_attention if fast else deltaformer_attention_naive
        kw = {"chunk_size": 16, "backend": "triton"} if fast else {}
        return fn(tensors["q"], tensors["k"], tensors["v"], beta=tensors["beta"], doc_start=x["doc_start"], **kw)

    fast_in = {n: x[n].clone().requires_grad_(True) for n in names}
    ref_in = {n: x[n].double().requires_grad_(True) for n in names}
    out, ref = run(fast_in, True), run(ref_in, False)
    assert out.dtype == torch.float32 and rel_error(out, ref) <= 1e-4
    grads = torch.autograd.grad(out, list(fast_in.values()), x["cotangent"])
    ref_grads = torch.autograd.grad(ref, list(ref_in.values()), x["cotangent"].double())
    for name, got, want in zip(names, grads, ref_grads):
        assert rel_error(got, want) <= 1e-4, name
    bf16_in = {n: x[n].bfloat16() if n in ("q", "k", "v") else x[n] for n in names}
    bf16_ref = {n: t.double() for n, t in bf16_in.items()}
    bf16_out = run(bf16_in, True)
    assert bf16_out.dtype == torch.bfloat16 and rel_error(bf16_out, run(bf16_ref, False)) <= 2e-2
