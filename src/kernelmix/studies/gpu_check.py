"""``kernelmix gpu-check``: check and measure the GPU kernels in one command (≤ 8 minutes on one H200).

Three parts, each written to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` as soon as it ends
(so a Ctrl-C or a crash keeps what finished); a failing part is recorded and the next one runs.

(a) **Op checks** on the device against float64 references: ``cubit_attention``, ``cubit_solve``,
    ``deltaformer_attention`` and ``random_feature_attention`` (Performer: no transform; DARKFormer:
    a transform) with the fast backend (``"auto"``: Triton on CUDA) and ``"torch"``, float32 and
    bfloat16 inputs, an odd T with a chunk that does not divide it, grouped-query heads, and a case
    with packed documents (``doc_start``). The references are the ``*_naive`` ops (and a dense
    solve for ``cubit_solve``) in float64 on the same device, on the inputs rounded to the checked
    dtype; values and every input gradient are compared by relative RMSE against the tolerances of
    the test suite (1e-4 float32; 2e-2 bfloat16, 3e-2 for random features).
(b) **Bench** (B=1, H=16, d=128, m=128, bf16 inputs): forward and forward+backward medians (CUDA
    events, a warm-up first, the mixers interleaved round by round so that a slow spell slows them
    all) and peak memory (the caching allocator's peak after a reset) at T = 1024 … 32768 for SDPA
    (flash backend), Cubit, DeltaFormer, Performer, DARKFormer and flash-linear-attention's
    DeltaFormer when it imports; then decode latency against the position (each mixer's
    ``*_step`` after a prefill) and, last, T = 65536 for Cubit and DeltaFormer if time is left.
    An out-of-memory cell is recorded and ends that mixer's lengths; so does a cell that takes
    longer than its time budget. The issue's targets become a pass/fail table.
(c) **Compare**: a short :mod:`kernelmix.studies.compare` (``small`` preset, T=1024, all six mixers,
    one seed, the same seconds of training each) into ``DIR/compare``. It needs pydantic (through
    :mod:`kernelmix.config`); where that does not import, the part says so and is skipped.

``quick=True`` runs the same code at tiny sizes (T ∈ {64, 128}, H=2, d=16; part (c) a few steps of
the ``tiny`` preset) for a dry run on CPU; there the fast backend is ``"triton"`` under Triton's
interpreter (the command line sets ``TRITON_INTERPRET=1`` before triton kernels are defined), or
``"torch"`` with a note where triton does not import. Quick timings mean nothing; they check that
the code runs.

This module imports only torch, the standard library, :mod:`kernelmix.ops`, :mod:`kernelmix.errors`
and :mod:`kernelmix.output` at import time (no pydantic): the GPU machine it is for may not have it.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .. import ops
from ..errors import Interrupted, KernelmixError
from ..output import pyplot, write_json_atomic, write_text_atomic
from .decode_timing import decode_step_after_prefill

FORMAT = "kernelmix.gpu_check/1"
PARTS = ("a", "b", "c")
PART_TITLES = {"a": "op checks against float64 references", "b": "bench", "c": "compare"}
DEVICES = ("cuda", "cpu")
INTERPRETER_ENV = "TRITON_INTERPRET"
MIXERS = ("softmax", "cubit", "deltaformer", "performer", "darkformer")
FLA_PEER = "fla-deltaformer"
PYDANTIC_FIX = "fix: pip install pydantic (or carry a wheel to this machine)"
# the tolerances of the test suite (tests/ops): relative RMSE against the float64 reference
TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2}
RANDOM_FEATURE_BF16_TOLERANCE = 3e-2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class CheckCase:
    """One shape of part (a): T, the chunk size (not dividing T) and whether documents are packed."""

    length: int
    chunk_size: int
    documents: bool

    @property
    def label(self) -> str:
        return f"T={self.length} chunk={self.chunk_size} GQA" + (" docs" if self.documents else "")


@dataclass(frozen=True)
class Sizes:
    """Everything the run's size and duration depend on (:func:`sizes_for`)."""

    check_cases: tuple[CheckCase, ...]
    check_shape: dict[str, int]  # batch, heads, kv_heads, head_dim, value_dim, ref_dim, features
    lengths: tuple[int, ...]
    long_length: int | None  # tried last, for LONG_MIXERS, if part (b)'s time allows
    batch: int
    heads: int
    head_dim: int
    num_features: int
    repeats: int
    warmup_calls: int  # untimed forward+backward calls per cell before its rounds (Triton compiles in them)
    decode_positions: tuple[int, ...]
    decode_repeats: int
    cell_budget_s: float  # a bench cell (warm-up + repeats) longer than this ends the mixer's lengths
    part_budget_s: dict[str, float]
    target_lengths: dict[str, int]  # where the issue's targets are read: solve (8192), features (16384)
    compare: dict[str, Any]  # CompareConfig settings of part (c)


LONG_MIXERS = ("softmax", "cubit", "deltaformer")  # softmax too: the ratio at T=65536 in the same run


def full_sizes() -> Sizes:
    """One H200, ≤ 8 minutes: (a) ≤ 2 (Triton compiles most of it), (b) ≤ 3.5, (c) ≈ 2.5 minutes
    (10 s of training per mixer after a calibration). Only (a) and (b) watch their budget."""
    return Sizes(
        check_cases=(CheckCase(37, 16, False), CheckCase(257, 48, True)),
        check_shape=dict(batch=2, heads=4, kv_heads=2, head_dim=32, value_dim=24, ref_dim=16, features=32),
        lengths=(1024, 4096, 8192, 16384, 32768), long_length=65536,
        batch=1, heads=16, head_dim=128, num_features=128, repeats=10, warmup_calls=1,
        decode_positions=(1024, 4096, 8192, 16384, 32768), decode_repeats=50,
        cell_budget_s=20.0, part_budget_s={"a": 120.0, "b": 200.0, "c": 150.0},
        target_lengths={"solve": 8192, "features": 16384},
        compare=dict(preset="small", lengths=[1024], seeds=[0], tokens_per_step=16384, steps=300, budget="time",
                     seconds=10.0, calibration_steps=3, warmup_steps=30, eval_docs=8),
    )


def quick_sizes() -> Sizes:
    """The dry run: the same code at tiny sizes (a few minutes on CPU under the interpreter)."""
    return Sizes(
        check_cases=(CheckCase(37, 16, False), CheckCase(45, 16, True)),
        check_shape=dict(batch=1, heads=2, kv_heads=1, head_dim=16, value_dim=12, ref_dim=8, features=16),
        lengths=(64, 128), long_length=192,
        batch=1, heads=2, head_dim=16, num_features=16, repeats=2, warmup_calls=1,
        decode_positions=(64, 128), decode_repeats=3,
        cell_budget_s=60.0, part_budget_s={"a": 300.0, "b": 300.0, "c": 300.0},
        target_lengths={"solve": 128, "features": 128},
        compare=dict(preset="tiny", lengths=[64], seeds=[0], tokens_per_step=128, steps=2, warmup_steps=1,
                     eval_docs=2, eval_batch_size=2),
    )


def smoke_sizes() -> Sizes:
    """The smallest sizes that still run every part's code (the test suite's run, tens of seconds on
    CPU under the interpreter): one check case (odd T, a chunk that does not divide it, documents,
    grouped heads), one bench length, no warm-up, one repeat."""
    return Sizes(
        check_cases=(CheckCase(20, 16, True),),
        check_shape=dict(batch=1, heads=2, kv_heads=1, head_dim=16, value_dim=12, ref_dim=8, features=16),
        lengths=(16,), long_length=None,
        batch=1, heads=1, head_dim=16, num_features=16, repeats=1, warmup_calls=0,
        decode_positions=(8, 16), decode_repeats=1,
        cell_budget_s=60.0, part_budget_s={"a": 300.0, "b": 300.0, "c": 300.0},
        target_lengths={"solve": 16, "features": 16},
        compare=dict(preset="tiny", lengths=[32], seeds=[0], tokens_per_step=64, steps=1, warmup_steps=0,
                     eval_docs=1, eval_batch_size=1),
    )


@dataclass
class GpuCheckConfig:
    """What :func:`run_gpu_check` runs. ``lengths`` replaces part (b)'s lengths; ``skip`` lists parts
    not to run ("a", "b", "c"); ``compare`` overrides part (c)'s CompareConfig settings."""

    device: str = "cuda"
    quick: bool = False
    lengths: tuple[int, ...] | None = None
    skip: tuple[str, ...] = ()
    compare: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise KernelmixError(f"unknown device {self.device!r} for gpu-check (choose from: {', '.join(DEVICES)})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise KernelmixError("gpu-check --device cuda: torch sees no CUDA device here; run it on the GPU machine, "
                                 "or dry-run it with --device cpu --quick")
        unknown = sorted(set(self.skip) - set(PARTS))
        if unknown:
            raise KernelmixError(f"unknown part(s) to skip {unknown} (the parts are: {', '.join(PARTS)})")
        if self.lengths is not None and (not self.lengths or any(t < 1 for t in self.lengths)):
            raise KernelmixError(f"lengths must be positive integers, got {list(self.lengths)}")


def sizes_for(config: GpuCheckConfig) -> Sizes:
    """The full or quick sizes; ``config.lengths`` are then part (b)'s lengths, all of them (the
    long length is not added: put it in the list to have it)."""
    sizes = quick_sizes() if config.quick else full_sizes()
    if config.lengths is None:
        return sizes
    fields = asdict(sizes)
    fields.update(lengths=tuple(sorted(set(config.lengths))), long_length=None, check_cases=sizes.check_cases)
    return Sizes(**fields)


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


# ---------------------------------------------------------------------------------------------
# Shared measurement helpers


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


# ---------------------------------------------------------------------------------------------
# Part (a): op checks


def document_starts(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``doc_start`` ``[B, T]`` of packed documents: three per row, the boundaries shifted per row."""
    rows = []
    for b in range(batch):
        cuts = sorted({0, min(length - 1, length // 3 + b), min(length - 1, (2 * length) // 3 + 2 * b)})
        rows.append([max(c for c in cuts if c <= t) for t in range(length)])
    return torch.tensor(rows, dtype=torch.long, device=device)


def check_inputs(case: CheckCase, shape: dict[str, int], device: torch.device) -> dict[str, torch.Tensor | None]:
    """Float64 inputs of every checked op (seeded by the case), on ``device``."""
    g = torch.Generator().manual_seed(1000 + case.length)
    b, t, h, hk = shape["batch"], case.length, shape["heads"], shape["kv_heads"]
    d, dv, dr, m = shape["head_dim"], shape["value_dim"], shape["ref_dim"], shape["features"]

    def randn(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64)

    # one tiny ridge (a model's initial value), the others better conditioned (as tests/ops)
    ridge = torch.tensor([(1e-6, 1e-2, 0.1, 0.5)[i % 4] for i in range(h)], dtype=torch.float64)
    x = {
        "q": randn(b, t, h, d), "k": randn(b, t, hk, d), "v": randn(b, t, hk, dv), "r": randn(b, t, h, dr),
        "rho": 0.5 + 1.5 * torch.sigmoid(randn(b, t, h)), "beta": torch.sigmoid(randn(b, t, h)),
        "ridge": ridge, "ref_scale": 0.5 + torch.rand(h, generator=g, dtype=torch.float64) * 2,
        "projection": ops.orthogonal_random_features(m, d, generator=g, dtype=torch.float64),
        "head_projection": ops.orthogonal_random_features(m, d, num_heads=h, generator=g, dtype=torch.float64),
        "transform": torch.eye(d, dtype=torch.float64) + 0.3 * randn(h, d, d),
    }
    x = {name: value.to(device) for name, value in x.items()}
    x["v_rf"] = x["v"]  # random features: the same values
    x["doc_start"] = document_starts(b, t, device) if case.documents else None
    return x


def dense_cubit_solve(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``cubit_solve``: the dense Gram softmax(r r̂ᵀ) + λI and one triangular solve."""
    r, heads, length = x["r"].transpose(1, 2), x["r"].shape[2], x["r"].shape[1]
    r_hat = x["ref_scale"][:, None, None] * r / r.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    seen = torch.ones(length, length, dtype=torch.bool, device=r.device).tril()
    if x["doc_start"] is not None:
        positions = torch.arange(length, device=r.device)
        seen = seen & (positions[None, None, :] >= x["doc_start"][:, :, None])[:, None]
    gram = (r @ r_hat.transpose(-1, -2)).masked_fill(~seen, float("-inf")).softmax(-1)
    system = gram + x["ridge"][:, None, None] * torch.eye(length, dtype=r.dtype, device=r.device)
    values = ops.expand_heads(x["v"], heads) * x["rho"][..., None]
    u = torch.linalg.solve_triangular(system, values.transpose(1, 2), upper=False)
    return u.transpose(1, 2), r_hat.transpose(1, 2)


@dataclass(frozen=True)
class OpCheck:
    """One checked op: its fast call ``(inputs, backend, chunk) → output(s)``, the float64
    reference ``inputs → output(s)``, the inputs it differentiates and its bf16 tolerance."""

    name: str
    fast: Callable
    reference: Callable
    inputs: tuple[str, ...]
    bf16_tolerance: float = TOLERANCES["bfloat16"]


def _cubit_attention(x, backend, chunk):
    return ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], ridge=x["ridge"],
                               ref_scale=x["ref_scale"], chunk_size=chunk, doc_start=x["doc_start"], backend=backend)


def _cubit_attention_reference(x):
    return ops.cubit_attention_naive(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], ridge=x["ridge"],
                                     ref_scale=x["ref_scale"], doc_start=x["doc_start"])


def _cubit_solve(x, backend, chunk):
    return ops.cubit_solve(x["r"], x["v"], rho=x["rho"], ridge=x["ridge"], ref_scale=x["ref_scale"],
                           chunk_size=chunk, doc_start=x["doc_start"], backend=backend)


def _deltaformer(x, backend, chunk):
    return ops.deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], chunk_size=chunk,
                                     doc_start=x["doc_start"], backend=backend)


def _deltaformer_reference(x):
    return ops.deltaformer_attention_naive(x["q"], x["k"], x["v"], beta=x["beta"], doc_start=x["doc_start"])


def _random_features(transform: bool):
    """Performer (``transform=False``: one shared projection) or DARKFormer (per-head projections
    and the transform M): the fast op and its dense float64 reference."""
    def arguments(x):
        projection = x["head_projection"] if transform else x["projection"]
        return (x["q"], x["k"], x["v_rf"], projection), {"transform": x["transform"] if transform else None,
                                                          "doc_start": x["doc_start"]}

    def fast(x, backend, chunk):
        args, kwargs = arguments(x)
        return ops.random_feature_attention(*args, chunk_size=chunk, backend=backend, **kwargs)

    def reference(x):
        args, kwargs = arguments(x)
        return ops.random_feature_attention_naive(*args, **kwargs)

    return fast, reference


OP_CHECKS = (
    OpCheck("cubit_attention", _cubit_attention, _cubit_attention_reference,
            ("q", "k", "v", "r", "rho", "ridge", "ref_scale")),
    OpCheck("cubit_solve", _cubit_solve, dense_cubit_solve, ("r", "v", "rho", "ridge", "ref_scale")),
    OpCheck("deltaformer_attention", _deltaformer, _deltaformer_reference, ("q", "k", "v", "beta")),
    OpCheck("random_feature_attention (Performer)", *_random_features(False), ("q", "k", "v_rf"),
            RANDOM_FEATURE_BF16_TOLERANCE),
    OpCheck("random_feature_attention (DARKFormer)", *_random_features(True), ("q", "k", "v_rf", "transform"),
            RANDOM_FEATURE_BF16_TOLERANCE),
)


def outputs_and_grads(fn: Callable, x: dict, names: tuple[str, ...], seed: int):
    """``(outputs, grads)`` of ``fn(x)`` (one tensor or a tuple) for a seeded random output
    gradient; ``grads`` maps each of ``names`` to its gradient."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    out = fn({**x, **leaves})
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    grad_outs = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=o.device, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), grad_outs, allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], dict(zip(names, grads))


def rounded(x: dict, dtype: torch.dtype) -> dict:
    """The inputs rounded to ``dtype`` (float tensors only; doc_start stays integer)."""
    return {n: v.to(dtype) if v is not None and v.is_floating_point() else v for n, v in x.items()}


def run_one_check(spec: OpCheck, case: CheckCase, backend: str, dtype_name: str, inputs: dict, reference) -> dict:
    """One row of part (a): the fast op on the rounded inputs against the float64 reference."""
    dtype = DTYPES[dtype_name]
    tolerance = TOLERANCES["float32"] if dtype_name == "float32" else spec.bf16_tolerance
    row: dict[str, Any] = {"op": spec.name, "backend": backend, "dtype": dtype_name, "case": case.label,
                           "tolerance": tolerance}
    started = time.perf_counter()
    try:
        outs, grads = outputs_and_grads(lambda x: spec.fast(x, backend, case.chunk_size), rounded(inputs, dtype),
                                        spec.inputs, seed=case.length)
        ref_outs, ref_grads = reference
        value_error = max(relative_rmse(o, r) for o, r in zip(outs, ref_outs))
        grad_errors = {n: relative_rmse(grads[n], ref_grads[n]) for n in spec.inputs}
        worst = max(grad_errors, key=lambda n: grad_errors[n] if math.isfinite(grad_errors[n]) else math.inf)
        errors = [value_error, *grad_errors.values()]
        row.update(value_error=finite_or_text(value_error), worst_grad=worst,
                   worst_grad_error=finite_or_text(grad_errors[worst]),
                   grad_errors={n: finite_or_text(e) for n, e in grad_errors.items()},
                   passed=all(math.isfinite(e) and e <= tolerance for e in errors))
    except Exception as error:  # a kernel that does not compile or run is a failed check, not a stop
        row.update(passed=False, error=short_error(error))
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


def describe_check(row: dict) -> str:
    if "error" in row:
        return f"FAIL {row['error']}"
    return (f"{'ok' if row['passed'] else 'FAIL'} value {_fmt_error(row['value_error'])}, grads ≤ "
            f"{_fmt_error(row['worst_grad_error'])} ({row['worst_grad']}); tol {row['tolerance']:.0e}")


def _fmt_error(value: float | str | None) -> str:
    return "-" if value is None else value if isinstance(value, str) else f"{value:.1e}"


def run_op_checks(part: dict, sizes: Sizes, device: torch.device, say: Callable[[str], None],
                  save: Callable[[], None] = lambda: None) -> None:
    """Part (a) into ``part``: every case × op × dtype × backend, one row each (case-major, so that
    a spent time budget leaves a later case unchecked rather than a whole op). ``save`` is called
    after each op and case (the JSON keeps what finished if the run is killed)."""
    backend, note = fast_backend(device)
    backends = ([backend] if backend else []) + ["torch"]
    part.update(backends=backends, notes=[note] if note else [], checks=[])
    started = time.perf_counter()
    for case in sizes.check_cases:
        master = check_inputs(case, sizes.check_shape, device)
        for spec in OP_CHECKS:
            if time.perf_counter() - started > sizes.part_budget_s["a"]:
                part["notes"].append(f"not run: {spec.name} {case.label} and later checks "
                                     f"(part (a)'s {sizes.part_budget_s['a']:.0f} s were spent)")
                return _summarise_checks(part)
            for dtype_name in DTYPES:
                for row in check_op(spec, case, dtype_name, master, backends):
                    part["checks"].append(row)
                    say(f"(a) {spec.name} backend={row['backend']} {dtype_name} {case.label}: {describe_check(row)}")
            _summarise_checks(part)
            save()
        del master


def check_op(spec: OpCheck, case: CheckCase, dtype_name: str, master: dict, backends: list[str]) -> list[dict]:
    """The rows of one op, case and dtype: its float64 reference once (on the inputs rounded to the
    dtype, so both sides see the same numbers), then each backend against it."""
    try:
        reference_inputs = rounded(rounded(master, DTYPES[dtype_name]), torch.float64)
        reference = outputs_and_grads(spec.reference, reference_inputs, spec.inputs, seed=case.length)
    except Exception as error:
        return [{"op": spec.name, "backend": name, "dtype": dtype_name, "case": case.label, "passed": False,
                 "tolerance": TOLERANCES["float32"], "error": f"reference failed: {short_error(error)}"}
                for name in backends]
    return [run_one_check(spec, case, name, dtype_name, master, reference) for name in backends]


def _summarise_checks(part: dict) -> None:
    part["passed"] = sum(1 for row in part["checks"] if row["passed"])
    part["failed"] = len(part["checks"]) - part["passed"]


# ---------------------------------------------------------------------------------------------
# Part (b): bench

# the inputs each mixer's forward+backward differentiates (the per-token activations and, for
# DARKFormer, its learned transform; the random projection is a fixed buffer)
MIXER_LEAVES = {
    "softmax": ("q", "k", "v"), "cubit": ("q", "k", "v", "r", "rho"), "deltaformer": ("q", "k", "v", "beta"),
    "performer": ("q", "k", "v"), "darkformer": ("q", "k", "v", "transform"), FLA_PEER: ("q", "k", "v", "beta"),
}


def bench_inputs(sizes: Sizes, length: int, device: torch.device, requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """bf16 activations ``[B, T, H, d]`` (ρ and β in float32, as a model's gates), drawn on the device."""
    g = torch.Generator(device=device).manual_seed(length)
    cpu = torch.Generator().manual_seed(0)
    b, h, d = sizes.batch, sizes.heads, sizes.head_dim

    def rand(*size, normal=True, dtype=torch.bfloat16):
        draw = torch.randn if normal else torch.rand
        return draw(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    x = {name: rand(b, length, h, d) for name in ("q", "k", "v", "r")}
    x["rho"] = 0.5 + 1.5 * rand(b, length, h, normal=False, dtype=torch.float32)
    x["beta"] = rand(b, length, h, normal=False, dtype=torch.float32)
    x["transform"] = (torch.eye(d) + 0.05 * torch.randn(h, d, d, generator=cpu)).to(device)
    for tensor in x.values():
        tensor.requires_grad_(requires_grad)
    x["projection"] = ops.orthogonal_random_features(sizes.num_features, d, generator=cpu).to(device)
    return x


def mixer_forward(mixer: str, x: dict, backend: str, softmax_context: Callable, fla_op: Callable | None) -> Callable:
    """The no-argument forward of ``mixer`` on ``x`` (softmax: SDPA itself, the baseline)."""
    q, k, v = x["q"], x["k"], x["v"]
    if mixer == "softmax":
        def sdpa():
            with softmax_context():
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return sdpa
    if mixer == FLA_PEER:
        return lambda: fla_op(q, k, v, x["beta"].to(q.dtype))
    if mixer == "cubit":
        return lambda: ops.cubit_attention(q, k, v, x["r"], rho=x["rho"], backend=backend)
    if mixer == "deltaformer":
        return lambda: ops.deltaformer_attention(q, k, v, beta=x["beta"], backend=backend)
    transform = x["transform"] if mixer == "darkformer" else None
    return lambda: ops.random_feature_attention(q, k, v, x["projection"], transform=transform, backend=backend)


def forward_only(call: Callable) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            call()
    return run


def forward_backward(call: Callable, leaves: list[torch.Tensor]) -> Callable[[], None]:
    """Forward, then the gradients of ``leaves`` (torch.autograd.grad: nothing accumulates between calls)."""
    grad_out: list[torch.Tensor] = []

    def run():
        out = call()
        if not grad_out:  # one fixed output gradient per cell, drawn at the first call
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, leaves, grad_out[0])
    return run


@dataclass
class Cell:
    """One (mixer, T) of the bench while it is measured."""

    record: dict
    forward: Callable[[], None]
    step: Callable[[], None]
    warmup_s: float
    repeats: int = 1
    forward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    @property
    def round_s(self) -> float:
        """One round (forward, then forward+backward), from the first round's times."""
        return (self.forward_ms[0] + self.step_ms[0]) / 1e3 if self.step_ms else 0.0

    @property
    def measured_s(self) -> float:
        """The timed rounds and the memory call: what the cell budget limits (not the warm-up, where
        the first length of a run compiles its Triton kernels)."""
        return self.round_s * (self.repeats + (self.record.get("peak_memory_mib") is not None))


def prepare_cell(mixer: str, length: int, x: dict, context: dict, sizes: Sizes) -> Cell:
    """The cell's calls, warmed up (Triton compiles in the first call)."""
    call = mixer_forward(mixer, x, context["backend"], context["softmax_context"], context["fla_op"])
    device = context["device"]
    forward, step = forward_only(call), forward_backward(call, [x[n] for n in MIXER_LEAVES[mixer]])
    warmup_s = sum(wall_seconds(step, device) + wall_seconds(forward, device) for _ in range(sizes.warmup_calls))
    return Cell({"mixer": mixer, "length": length}, forward, step, warmup_s)


def bench_length(length: int, mixers: list[str], context: dict, sizes: Sizes, say) -> list[dict]:
    """Every mixer at one T: warm-up, interleaved timing rounds, then peak memory. A mixer whose cell
    fails (out of memory, an error) or runs past the cell budget is added to ``context["stopped"]``."""
    device, stopped = context["device"], context["stopped"]
    try:
        x = bench_inputs(sizes, length, device)
    except Exception as error:  # the inputs alone do not fit: no mixer runs at this length
        return [_failed_cell(mixer, length, error, stopped, device) for mixer in mixers]
    cells, records = [], []
    for mixer in mixers:
        say(f"(b) T={length} {mixer}: warm-up")
        try:
            cells.append(prepare_cell(mixer, length, x, context, sizes))
        except Exception as error:
            records.append(_failed_cell(mixer, length, error, stopped, device))
    _timing_rounds(cells, device, sizes)
    for cell in cells:
        _measure_cell(cell, device)
        if cell.measured_s > sizes.cell_budget_s:
            stopped[cell.record["mixer"]] = (f"stopped after T={length}: its cell took {cell.measured_s:.1f} s "
                                             f"> the cell budget of {sizes.cell_budget_s:.0f} s")
        cell.record.update(warmup_s=round(cell.warmup_s, 2), measured_s=round(cell.measured_s, 2))
        records.append(cell.record)
        say(f"(b) T={length} {cell.record['mixer']}: {_describe_cell(cell.record)}")
    del cells, x
    free_memory(device)
    return records


def _failed_cell(mixer: str, length: int, error: BaseException, stopped: dict, device: torch.device) -> dict:
    reason = "out of memory" if is_out_of_memory(error) else short_error(error)
    stopped[mixer] = f"stopped at T={length}: {reason}"
    free_memory(device)
    return {"mixer": mixer, "length": length, "note": reason}


def _timing_rounds(cells: list[Cell], device: torch.device, sizes: Sizes) -> None:
    """Round-robin: each round times every cell's forward and forward+backward once. The first
    round sets each cell's repeats (as many as its time budget holds, at most ``sizes.repeats``, at least 1);
    cells with fewer repeats drop out of the later rounds."""
    timer = Timer(device)
    _timed_round(cells, 0, timer)
    for cell in cells:  # the rounds and one more forward+backward for the peak memory fit the budget
        cell.repeats = max(1, min(sizes.repeats, int(sizes.cell_budget_s / max(cell.round_s, 1e-6)) - 1))
    for round_index in range(1, max((c.repeats for c in cells), default=0)):
        _timed_round(cells, round_index, timer)


def _timed_round(cells: list[Cell], round_index: int, timer: Timer) -> None:
    for cell in cells:
        if round_index < cell.repeats and "note" not in cell.record:
            try:
                timer.time(cell.forward, cell.forward_ms)
                timer.time(cell.step, cell.step_ms)
            except Exception as error:
                cell.record["note"] = "out of memory" if is_out_of_memory(error) else short_error(error)
    timer.collect()


def _measure_cell(cell: Cell, device: torch.device) -> None:
    """Medians of the timed rounds and, on CUDA, the peak memory of one more forward+backward."""
    record = cell.record
    record["repeats"] = len(cell.step_ms)
    record["forward_ms"] = statistics.median(cell.forward_ms) if cell.forward_ms else None
    record["forward_backward_ms"] = statistics.median(cell.step_ms) if cell.step_ms else None
    record["peak_memory_mib"] = None
    if device.type != "cuda" or "note" in record:
        return
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        cell.step()
        torch.cuda.synchronize(device)
        record["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    except Exception as error:
        record["note"] = f"peak memory: {short_error(error)}"


def _describe_cell(record: dict) -> str:
    if record.get("forward_backward_ms") is None:
        return record.get("note", "not measured")
    peak = record.get("peak_memory_mib")
    return (f"fwd {record['forward_ms']:.3f} ms, fwd+bwd {record['forward_backward_ms']:.3f} ms"
            + (f", peak {peak:.0f} MiB" if peak is not None else "") + f" ({record['repeats']} repeats)")


def softmax_backend(device: torch.device) -> tuple[Callable, str]:
    """``(context factory, note)``: SDPA pinned to its flash kernel where that runs here (a tiny
    probe), else SDPA's own choice, and why."""
    if device.type != "cuda":
        return contextlib.nullcontext, "SDPA's default backend (the flash kernel is CUDA-only)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

        probe = torch.randn(1, 2, 128, 128, device=device, dtype=torch.bfloat16)
        with flash():
            torch.nn.functional.scaled_dot_product_attention(probe, probe, probe, is_causal=True)
        return flash, "SDPA pinned to the flash backend (torch.nn.attention.sdpa_kernel)"
    except Exception as error:
        return contextlib.nullcontext, f"SDPA's default backend: the flash backend did not run ({short_error(error)})"


def fla_deltaformer(device: torch.device) -> tuple[Callable | None, str]:
    """flash-linear-attention's DeltaFormer (``fla.ops.deltaformer.deltaformer_attn``) or None, and a note."""
    try:
        from fla.ops.deltaformer import deltaformer_attn
    except Exception as error:  # fla's import can fail for reasons of its own (flash-attn, triton versions)
        return None, f"{FLA_PEER}: not importable: {short_error(error)}"
    if device.type != "cuda":
        return None, f"{FLA_PEER}: importable, but its kernels are CUDA-only: not run on {device}"
    return deltaformer_attn, f"{FLA_PEER}: fla.ops.deltaformer.deltaformer_attn"


def bench_decode(mixer: str, context: dict, sizes: Sizes, say) -> list[dict]:
    """Decode latency of one mixer at every position, the positions interleaved round by round (a
    step after another mixer's long cache finds the caches cold: not across mixers)."""
    device, positions = context["device"], sizes.decode_positions
    say(f"(b) decode {mixer} at positions {', '.join(map(str, positions))}")
    try:
        x = bench_inputs(sizes, max(positions) + 1, device, requires_grad=False)
        steps = [decode_step_after_prefill(mixer, x, position, backend=context["backend"]) for position in positions]
        for step in steps:  # warm-up
            step()
        times: list[list[float]] = [[] for _ in steps]
        timer = Timer(device)
        for _ in range(sizes.decode_repeats):
            for step, spent in zip(steps, times):
                timer.time(step, spent)
            timer.collect()
    except Exception as error:
        reason = "out of memory" if is_out_of_memory(error) else short_error(error)
        free_memory(device)
        return [{"mixer": mixer, "position": None, "step_ms": None, "note": reason}]
    rows = [{"mixer": mixer, "position": p, "step_ms": statistics.median(t)} for p, t in zip(positions, times)]
    say(f"(b) decode {mixer}: " + ", ".join(f"{r['position']}: {r['step_ms']:.3f} ms" for r in rows))
    del steps, x
    free_memory(device)
    return rows


def run_bench(part: dict, sizes: Sizes, device: torch.device, say: Callable[[str], None],
              save: Callable[[], None] = lambda: None) -> None:
    """Part (b) into ``part``: the lengths, the decode positions, then the long length if time is
    left; ``save`` after each (the JSON keeps what finished if the run is killed)."""
    backend, backend_note = fast_backend(device)
    softmax_context, softmax_note = softmax_backend(device)
    fla_op, fla_note = fla_deltaformer(device)
    context = {"device": device, "backend": backend or "torch", "softmax_context": softmax_context,
               "fla_op": fla_op, "stopped": {}}
    notes = [n for n in (backend_note, softmax_note, fla_note) if n]
    if device.type != "cuda":
        notes += ["peak memory is measured on CUDA only (the caching allocator's peak)",
                  "on CPU the timings (the Triton kernels under the interpreter) and the targets read from them "
                  "only show that the code runs"]
    part.update(backend=context["backend"], shape={"batch": sizes.batch, "heads": sizes.heads, "head_dim": sizes.head_dim,
                "num_features": sizes.num_features, "dtype": "bfloat16"}, records=[], decode=[], notes=notes,
                stopped=context["stopped"])
    mixers = list(MIXERS) + ([FLA_PEER] if fla_op is not None else [])
    budget, started = sizes.part_budget_s["b"], time.perf_counter()
    for length in sizes.lengths:
        if time.perf_counter() - started > 0.75 * budget:  # the rest is the decode's and the long length's
            notes.append(f"not run: T={length} and longer (three quarters of part (b)'s {budget:.0f} s were spent)")
            break
        active = [m for m in mixers if m not in context["stopped"]]
        part["records"] += bench_length(length, active, context, sizes, say)
        save()
    for mixer in MIXERS:
        part["decode"] += bench_decode(mixer, context, sizes, say)
    save()
    _bench_long_length(part, context, sizes, started, say)
    part["targets"] = evaluate_targets(part["records"], part["decode"], sizes, fla_op is not None)


def _bench_long_length(part: dict, context: dict, sizes: Sizes, started: float, say) -> None:
    """T = 65536 (the issue: it must run for Cubit and DeltaFormer), last, when time is left."""
    if sizes.long_length is None:
        return
    budget = sizes.part_budget_s["b"]
    if time.perf_counter() - started > budget:
        part["notes"].append(f"not run: T={sizes.long_length} (part (b)'s {budget:.0f} s were spent)")
        return
    # an earlier stop (out of memory, the cell budget) says the long length will not go better
    for mixer in LONG_MIXERS:
        if mixer in context["stopped"]:
            part["notes"].append(f"T={sizes.long_length} not tried for {mixer}: {context['stopped'][mixer]}")
    active = [m for m in LONG_MIXERS if m not in context["stopped"]]
    if active:
        part["records"] += bench_length(sizes.long_length, active, context, sizes, say)


# ---------------------------------------------------------------------------------------------
# The issue's targets


def _target(name: str, value: float | None, limit: float, *, at_most: bool, missing: str = "") -> dict:
    """A ratio target: passed when ``value`` ≤ ``limit`` (``at_most``) or ≥ it; None when not measured."""
    if value is None:
        return {"target": name, "measured": None, "unit": "×", "passed": None, "note": missing or "not measured"}
    passed = value <= limit if at_most else value >= limit
    return {"target": name, "measured": float(f"{value:.4g}"), "unit": "×", "passed": passed, "note": ""}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate_targets(records: list[dict], decode: list[dict], sizes: Sizes, fla_ran: bool) -> list[dict]:
    """The Targets of issue 16 as rows ``{target, measured, passed (None: not measured), note}``;
    ratios are within this run. (Quick runs read them at their tiny lengths: the code path only.)"""
    time_of = {(r["mixer"], r["length"]): r.get("forward_backward_ms") for r in records}
    peak_of = {(r["mixer"], r["length"]): r.get("peak_memory_mib") for r in records}
    step_of = {(d["mixer"], d["position"]): d["step_ms"] for d in decode}
    solve, features = sizes.target_lengths["solve"], sizes.target_lengths["features"]
    low, high = sizes.decode_positions[0], sizes.decode_positions[-1]
    rows = []
    for mixer in ("cubit", "deltaformer"):
        rows.append(_target(f"{mixer} fwd+bwd ≤ 2.5× SDPA's at T={solve}",
                            _ratio(time_of.get((mixer, solve)), time_of.get(("softmax", solve))), 2.5, at_most=True))
        rows.append(_target(f"{mixer} peak memory ≤ 2× SDPA's at T={solve}",
                            _ratio(peak_of.get((mixer, solve)), peak_of.get(("softmax", solve))), 2.0, at_most=True,
                            missing="not measured (peak memory is CUDA-only)" if not any(peak_of.values()) else ""))
    for mixer in ("cubit", "deltaformer"):
        if sizes.long_length is None:
            rows.append({"target": f"{mixer} runs at the long length", "measured": None, "unit": "ms fwd+bwd",
                         "passed": None, "note": "no long length in this run"})
            continue
        ran = time_of.get((mixer, sizes.long_length))
        rows.append({"target": f"{mixer} runs at T={sizes.long_length}", "measured": ran, "unit": "ms fwd+bwd",
                     "passed": ran is not None, "note": "" if ran is not None else "did not run (see the notes)"})
    for mixer in ("performer", "darkformer"):
        rows.append(_target(f"{mixer} fwd+bwd ≥ 3× faster than SDPA at T={features}",
                            _ratio(time_of.get(("softmax", features)), time_of.get((mixer, features))), 3.0, at_most=False))
    for mixer in ("performer", "darkformer"):
        rows.append(_target(f"{mixer} decode at position {high} ≤ 1.2× position {low}",
                            _ratio(step_of.get((mixer, high)), step_of.get((mixer, low))), 1.2, at_most=True))
    rows.append(_target(f"deltaformer fwd+bwd ≤ {FLA_PEER}'s at T={solve}",
                        _ratio(time_of.get(("deltaformer", solve)), time_of.get((FLA_PEER, solve))), 1.0, at_most=True,
                        missing="not measured: flash-linear-attention did not run here" if not fla_ran else ""))
    return rows


# ---------------------------------------------------------------------------------------------
# Part (c): compare


def run_compare_part(part: dict, sizes: Sizes, device: torch.device, out_dir: Path, overrides: dict,
                     say: Callable[[str], None]) -> None:
    """Part (c) into ``part``: a short compare of all six mixers into ``out_dir/compare``."""
    try:
        from .compare import CompareConfig, run_compare
    except ImportError as error:  # pydantic (kernelmix.config) missing on the GPU machine
        fix = PYDANTIC_FIX if "pydantic" in str(error) else f"fix: pip install {error.name or 'the missing package'}"
        part["status"] = f"not run: {short_error(error)}; {fix}"
        say(f"(c) {part['status']}")
        return
    settings = {**sizes.compare, **overrides, "device": device.type, "out_dir": str(out_dir / "compare")}
    part["settings"] = settings
    say(f"(c) compare: preset {settings['preset']}, T={settings['lengths']}, all six mixers → {settings['out_dir']}")
    results = run_compare(CompareConfig(**settings), progress=False)
    part["summary"] = [
        {"mixer": row["mixer"], "length": row["length"], "val_loss": row["val_loss"], "steps": row.get("steps"),
         "tokens_per_s": row["tokens_per_s"], "train_s": row.get("train_s")}
        for row in results["summary"]
    ]
    part["wall_s"] = results["wall_s"]


# ---------------------------------------------------------------------------------------------
# The run


def new_report(config: GpuCheckConfig, sizes: Sizes, device: torch.device) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "settings": {"device": config.device, "quick": config.quick, "skip": list(config.skip),
                     "sizes": asdict(sizes)},
        "environment": environment(device),
        "parts": {name: {"title": PART_TITLES[name], "status": "pending"} for name in PARTS},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def run_gpu_check(config: GpuCheckConfig, out_dir: str | os.PathLike, *,
                  say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Run the parts of ``config`` into ``out_dir``; returns the report (``gpu_check.json``'s content).
    The JSON and markdown are rewritten after every part; a part that fails is recorded with its
    traceback and the next part runs; Ctrl-C records the part as interrupted, writes, and re-raises."""
    device = torch.device(config.device)
    sizes = sizes_for(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = new_report(config, sizes, device)
    write_report(report, out)

    def save() -> None:
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_report(report, out)
    for name in PARTS:
        part = report["parts"][name]
        if name in config.skip:
            part["status"] = "skipped (--skip)"
            write_report(report, out)
            continue
        part["status"] = "running"
        started = time.perf_counter()
        try:
            if name == "a":
                run_op_checks(part, sizes, device, say, save)
            elif name == "b":
                run_bench(part, sizes, device, say, save)
            else:
                run_compare_part(part, sizes, device, out, config.compare, say)
            if part["status"] == "running":
                part["status"] = "done"
        except (KeyboardInterrupt, Interrupted):
            part["status"] = "interrupted (what finished is kept)"
            raise
        except Exception as error:  # the next part still runs; the traceback is in the JSON
            part["status"] = f"failed: {short_error(error)}"
            part["traceback"] = traceback.format_exc()
            say(f"({name}) {part['status']}")
        finally:
            part["seconds"] = round(time.perf_counter() - started, 1)
            report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_report(report, out, plots=name == "b")
    return report


def exit_status(report: dict) -> int:
    """0 when every part that ran finished and every op check passed; 1 otherwise (the targets
    are goals, not checks: they do not change it)."""
    parts = report["parts"].values()
    failed = any(p["status"].startswith(("failed", "interrupted")) for p in parts)
    return 1 if failed or report["parts"]["a"].get("failed") else 0


# ---------------------------------------------------------------------------------------------
# Output: JSON, markdown, PNG, console


def write_report(report: dict, out: Path, *, plots: bool = False) -> list[Path]:
    written = [write_json_atomic(out / "gpu_check.json", report),
               write_text_atomic(out / "gpu_check.md", format_markdown(report))]
    if plots:
        written += write_plots(report, out)
    return written


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def check_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["op", "backend", "dtype", "case", "value err", "worst grad err", "tol", "result"]
    rows = []
    for row in part.get("checks", []):
        worst = "-" if "error" in row else f"{_fmt_error(row['worst_grad_error'])} ({row['worst_grad']})"
        result = "pass" if row["passed"] else ("FAIL: " + row["error"] if "error" in row else "FAIL")
        rows.append([row["op"], row["backend"], row["dtype"], row["case"], _fmt_error(row.get("value_error")), worst,
                     f"{row['tolerance']:.0e}", result])
    return headers, rows


def bench_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "T", "fwd ms", "fwd+bwd ms", "vs SDPA", "peak MiB", "peak vs SDPA", "note"]
    records = part.get("records", [])
    sdpa = {r["length"]: r for r in records if r["mixer"] == "softmax"}
    rows = []
    for r in sorted(records, key=lambda r: (r["length"], list(MIXER_LEAVES).index(r["mixer"]))):
        base = sdpa.get(r["length"], {})
        ratio = _ratio(r.get("forward_backward_ms"), base.get("forward_backward_ms"))
        peak_ratio = _ratio(r.get("peak_memory_mib"), base.get("peak_memory_mib"))
        peak = r.get("peak_memory_mib")
        rows.append([r["mixer"], str(r["length"]), _ms(r.get("forward_ms")), _ms(r.get("forward_backward_ms")),
                     "-" if ratio is None else f"{ratio:.2f}×", "-" if peak is None else f"{peak:.0f}",
                     "-" if peak_ratio is None else f"{peak_ratio:.2f}×", r.get("note", "")])
    return headers, rows


def decode_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "position", "ms / token", "vs first position"]
    first: dict[str, float] = {}
    rows = []
    for d in part.get("decode", []):
        if d["step_ms"] is None:
            rows.append([d["mixer"], "-", "-", d.get("note", "")])
            continue
        first.setdefault(d["mixer"], d["step_ms"])
        rows.append([d["mixer"], str(d["position"]), _ms(d["step_ms"]), f"{d['step_ms'] / first[d['mixer']]:.2f}×"])
    return headers, rows


def target_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["target", "measured", "result"]
    rows = []
    for t in part.get("targets", []):
        measured = "-" if t["measured"] is None else f"{t['measured']:.3g} {t['unit']}".replace(" ×", "×")
        result = t["note"] if t["passed"] is None else ("pass" if t["passed"] else "FAIL")
        rows.append([t["target"], measured, result])
    return headers, rows


def compare_table(part: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["mixer", "T", "eval loss", "steps", "tokens/s", "train s"]
    rows = [[r["mixer"], str(r["length"]), f"{r['val_loss']:.3f}", "-" if r.get("steps") is None else f"{r['steps']:.0f}",
             f"{r['tokens_per_s']:.0f}", "-" if r.get("train_s") is None else f"{r['train_s']:.1f}"]
            for r in part.get("summary", [])]
    return headers, rows


def report_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, headers, rows)`` of every table, for the markdown and the console alike."""
    parts = report["parts"]
    tables = [("(a) op checks", *check_table(parts["a"])), ("(b) bench", *bench_table(parts["b"])),
              ("(b) decode latency", *decode_table(parts["b"])), ("(b) targets (issue 16)", *target_table(parts["b"])),
              ("(c) compare", *compare_table(parts["c"]))]
    return [table for table in tables if table[2]]


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(headers), line(["---"] * len(headers)), *map(line, rows)]


def format_markdown(report: dict) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        "# kernelmix gpu-check", "",
        f"Device {env.get('gpu', env['device'])}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"python {env['python']}; {'quick dry run' if settings['quick'] else 'full run'}; started {report['started']}"
        + (f", last written {report['finished']}" if report.get("finished") else "") + ".", "",
    ]
    for name, part in report["parts"].items():
        seconds = f" ({part['seconds']:.0f} s)" if "seconds" in part else ""
        summary = f"; {part['passed']} passed, {part['failed']} failed" if "passed" in part else ""
        lines.append(f"- ({name}) {part['title']}: {part['status']}{seconds}{summary}")
    for title, headers, rows in report_tables(report):
        lines += ["", f"## {title}", "", *_markdown_table(headers, rows)]
    notes = [f"({name}) {note}" for name, part in report["parts"].items() for note in part.get("notes", [])]
    notes += [f"(b) {mixer}: {why}" for mixer, why in report["parts"]["b"].get("stopped", {}).items()]
    if notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def print_tables(report: dict, *, file=None) -> None:
    """The tables on the console: rich tables when rich imports, else the markdown."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_markdown(report), file=file or sys.stdout)
        return
    console = Console(file=file, soft_wrap=True)
    for title, headers, rows in report_tables(report):
        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for name, part in report["parts"].items():
        console.print(f"({name}) {part['title']}: {part['status']}", highlight=False, markup=False)


def write_plots(report: dict, out: Path) -> list[Path]:
    """``bench_time.png`` (forward+backward time against T) and ``decode.png`` (latency against the
    position); a note instead where matplotlib is missing or nothing was measured."""
    part = report["parts"]["b"]
    try:
        plt = pyplot()
    except ImportError as error:
        part.setdefault("notes", []).append(f"no plots: {error}")
        return []
    written = []
    series = {
        "bench_time.png": ("forward+backward time (bf16)", "T", "ms",
                           [(r["mixer"], r["length"], r.get("forward_backward_ms")) for r in part.get("records", [])]),
        "decode.png": ("decode latency", "position", "ms / token",
                       [(d["mixer"], d["position"], d["step_ms"]) for d in part.get("decode", [])]),
    }
    for filename, (title, xlabel, ylabel, points) in series.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for mixer in dict.fromkeys(m for m, _, _ in points):
            mine = sorted((x, y) for m, x, y in points if m == mixer and x is not None and y)
            if mine:
                ax.plot(*zip(*mine), marker="o", label=mixer)
        if ax.lines:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=f"{title} — {report['environment'].get('gpu', report['environment']['device'])}", xlabel=xlabel,
               ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    return written


__all__ = [
    "FORMAT", "GpuCheckConfig", "OP_CHECKS", "PARTS", "Sizes", "evaluate_targets", "exit_status", "fast_backend",
    "format_markdown", "full_sizes", "print_tables", "quick_sizes", "relative_rmse", "run_gpu_check", "sizes_for",
    "write_report",
]
