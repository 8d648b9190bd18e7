"""The backend switch (kernelmix.ops, backend="auto" | "torch" | "triton"): what each choice
resolves to on this machine, and the errors that say what to do instead."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.model import ModelConfig
from kernelmix.ops import BACKENDS, cubit_attention, deltaformer_attention, random_feature_attention
from kernelmix.ops import _backend

CPU = torch.device("cpu")


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
