"""Shared test helpers: error metrics against float64 references, the ahead-of-time Triton compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def rel_rmse(actual: torch.Tensor, expected: torch.Tensor, *, zero_threshold: float = 1e-6) -> float:
    """Relative RMSE ‖a − e‖ / ‖e‖ (RMS norms).

    Where the reference is (analytically) zero — e.g. the q/k gradients at T = 1, where the output
    is v_0 — a relative error only measures rounding noise, so below ``zero_threshold`` the error is
    taken in absolute terms, i.e. relative to the O(1) scale of the test inputs.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = rms(actual.double() - expected.double())
    scale = rms(expected)
    return err / (scale if scale > zero_threshold else 1.0)


def isolated_data_cache(tmp_path_factory):
    """Fixture body: point KERNELMIX_CACHE (token caches; inherited by subprocesses) at a fresh
    temporary directory for one module and restore it afterwards. Use as
    ``data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)``."""
    import os

    old = os.environ.get("KERNELMIX_CACHE")
    os.environ["KERNELMIX_CACHE"] = str(tmp_path_factory.mktemp("kernelmix-cache"))
    yield
    if old is None:
        os.environ.pop("KERNELMIX_CACHE", None)
    else:
        os.environ["KERNELMIX_CACHE"] = old


def compile_ahead_of_time(script: str, cache_dir, *, kernels: int, timeout: int = 600) -> None:
    """Run ``script`` (Triton kernels compiled for a GPU, one "compiled" line printed per kernel) in
    a process without TRITON_INTERPRET — the interpreter accepts code the GPU compiler rejects — and
    check that all ``kernels`` compiled; a Triton without the compile API skips (the script exits
    with "SKIP: ...")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 and "SKIP:" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == kernels, result.stdout
