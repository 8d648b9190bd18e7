"""What parts (a) and (b) share: the fast backend they exercise, the environment the numbers
depend on, relative errors, out-of-memory handling and timers (CUDA events or the wall clock)."""

from __future__ import annotations

import importlib
import math
import os
import platform
import sys
import time
from typing import Any, Callable

import torch

from ...errors import KernelmixError
from .settings import INTERPRETER_ENV

def fast_backend(device: torch.device) -> tuple[str | None, str | None]:
    """``(backend, note)``: the backend whose kernels part (a) and (b) exercise besides "torch".
    CUDA: "auto" (Triton when it imports). CPU: "triton" under the interpreter, or None (with the
    reason) where triton does not import or the interpreter is off."""
    if device.type == "cuda":
        return "auto", None
    missing = triton_import_error()
    if missing is not None:
        return None, f"triton does not import here ({missing}): the Triton backend is not exercised, backend torch only"
    if os.environ.get(INTERPRETER_ENV, "").strip().lower() not in ("1", "true", "on", "yes"):
        return None, (f"{INTERPRETER_ENV}=1 is not set: on CPU the Triton kernels run only under the interpreter, "
                      "so backend torch only (`python -m kernelmix gpu-check --device cpu` sets it)")
    return "triton", None


def triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as error:  # a missing package, or a broken install raising something else
        return f"{type(error).__name__}: {error}"
    return None


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers depend on: versions, the GPU, triton and the interpreter."""
    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": str(device), "threads": torch.get_num_threads(),
        INTERPRETER_ENV: os.environ.get(INTERPRETER_ENV),
    }
    missing = triton_import_error()
    info["triton"] = sys.modules["triton"].__version__ if missing is None else f"not importable: {missing}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    for package in ("pydantic", "fla", "matplotlib", "rich"):
        try:
            module = importlib.import_module(package)
            info[package] = getattr(module, "__version__", "installed")
        except Exception as error:
            info[package] = f"not importable ({type(error).__name__}: {error})"
    return info



def relative_rmse(actual: torch.Tensor, expected: torch.Tensor, zero_threshold: float = 1e-6) -> float:
    """‖a − e‖ / ‖e‖ in RMS norms (the test suite's ``rel_rmse``); against a reference below
    ``zero_threshold`` (an exactly-zero gradient) the error is taken absolutely."""
    if actual.shape != expected.shape:
        raise KernelmixError(f"shape {tuple(actual.shape)} != reference shape {tuple(expected.shape)}")
    if not actual.numel():
        return 0.0
    err = (actual.double() - expected.double()).pow(2).mean().sqrt().item()
    scale = expected.double().pow(2).mean().sqrt().item()
    return err / (scale if scale > zero_threshold else 1.0)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def short_error(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" + ("…" if len(text) > 300 else "")


def finite_or_text(value: float | None) -> float | str | None:
    """A float for JSON: non-finite values as text ("nan", "inf"), which strict JSON readers accept."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


class Timer:
    """Times calls on ``device``: CUDA events (recorded around the call, read after a synchronize),
    or the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple[list[float], Any, Any]] = []

    def time(self, fn: Callable[[], object], into: list[float]) -> None:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.pending.append((into, start, end))
        else:
            started = time.perf_counter()
            fn()
            into.append((time.perf_counter() - started) * 1e3)

    def collect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for into, start, end in self.pending:
            into.append(start.elapsed_time(end))
        self.pending.clear()


def wall_seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
