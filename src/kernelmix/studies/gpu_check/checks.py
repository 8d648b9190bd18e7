"""Part (a): every checked op on the device against its float64 reference (values and every
input gradient, by relative RMSE, at the test suite's tolerances)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ... import ops
from .measure import fast_backend, finite_or_text, relative_rmse, short_error
from .report import format_error
from .settings import RANDOM_FEATURE_BF16_TOLERANCE, RANDOM_FEATURE_TF32_TOLERANCE, TOLERANCES, CheckCase, Sizes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
        "r_rf": randn(b, t, h, d),  # Cubit-RF's references: the queries' shape (one W for the Gram and the read-out)
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
    # float32 inputs: 1e-4, or the measured bound of the random-feature kernels' TF32 products (2e-3,
    # tests/ops/test_triton_features.py) where the Triton backend runs them
    f32_tolerance: float = TOLERANCES["float32"]


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


def _fast_and_reference(fast_op, reference_op, arguments):
    """(fast, reference) callables of a check: both ops called on ``arguments(x)`` = (args, kwargs), the
    fast one also with the cell's chunk size and backend."""
    def fast(x, backend, chunk):
        args, kwargs = arguments(x)
        return fast_op(*args, chunk_size=chunk, backend=backend, **kwargs)

    def reference(x):
        args, kwargs = arguments(x)
        return reference_op(*args, **kwargs)

    return fast, reference


def _random_features(transform: bool):
    """Performer (``transform=False``: one shared projection) or DARKFormer (per-head projections
    and the transform M): the fast op and its dense float64 reference."""
    def arguments(x):
        projection = x["head_projection"] if transform else x["projection"]
        return (x["q"], x["k"], x["v_rf"], projection), {"transform": x["transform"] if transform else None,
                                                          "doc_start": x["doc_start"]}

    return _fast_and_reference(ops.random_feature_attention, ops.random_feature_attention_naive, arguments)


def _cubit_rf(transform: bool):
    """Cubit-RF with its per-head ridge and reference scale, ρ, documents, per-head projections and
    (``transform``) the data-aware M: the fast op (the read-out's backend) and its dense float64 reference."""
    def arguments(x):
        return (x["q"], x["k"], x["v"], x["r_rf"], x["head_projection"]), {
            "rho": x["rho"], "ridge": x["ridge"], "ref_scale": x["ref_scale"],
            "transform": x["transform"] if transform else None, "doc_start": x["doc_start"]}

    return _fast_and_reference(ops.cubit_rf_attention, ops.cubit_rf_attention_naive, arguments)


OP_CHECKS = (
    OpCheck("cubit_attention", _cubit_attention, _cubit_attention_reference,
            ("q", "k", "v", "r", "rho", "ridge", "ref_scale")),
    OpCheck("cubit_solve", _cubit_solve, dense_cubit_solve, ("r", "v", "rho", "ridge", "ref_scale")),
    OpCheck("deltaformer_attention", _deltaformer, _deltaformer_reference, ("q", "k", "v", "beta")),
    OpCheck("random_feature_attention (Performer)", *_random_features(False), ("q", "k", "v_rf"),
            RANDOM_FEATURE_BF16_TOLERANCE, RANDOM_FEATURE_TF32_TOLERANCE),
    OpCheck("random_feature_attention (DARKFormer)", *_random_features(True), ("q", "k", "v_rf", "transform"),
            RANDOM_FEATURE_BF16_TOLERANCE, RANDOM_FEATURE_TF32_TOLERANCE),
    OpCheck("cubit_rf_attention (data-aware)", *_cubit_rf(True),
            ("q", "k", "v", "r_rf", "rho", "ridge", "ref_scale", "transform"), RANDOM_FEATURE_BF16_TOLERANCE,
            RANDOM_FEATURE_TF32_TOLERANCE),
)


def outputs_and_grads(fn: Callable, x: dict, names: tuple[str, ...], seed: int):
    """``(outputs, grads)`` of ``fn(x)`` (one tensor or a tuple) for a seeded random output
    gradient; ``grads`` maps each of ``names`` to its gradient."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    out = fn({**x, **leaves})
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    grad_outs = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=o.device, dtype=o.dtype)
                 for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), grad_outs, allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], dict(zip(names, grads))


def rounded(x: dict, dtype: torch.dtype) -> dict:
    """The inputs rounded to ``dtype`` (float tensors only; doc_start stays integer)."""
    return {n: v.to(dtype) if v is not None and v.is_floating_point() else v for n, v in x.items()}


def run_one_check(spec: OpCheck, case: CheckCase, backend: str, dtype_name: str, inputs: dict, reference) -> dict:
    """One row of part (a): the fast op on the rounded inputs against the float64 reference."""
    dtype = DTYPES[dtype_name]
    f32 = spec.f32_tolerance if backend != "torch" else TOLERANCES["float32"]
    tolerance = f32 if dtype_name == "float32" else spec.bf16_tolerance
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
    return (f"{'ok' if row['passed'] else 'FAIL'} value {format_error(row['value_error'])}, grads ≤ "
            f"{format_error(row['worst_grad_error'])} ({row['worst_grad']}); tol {row['tolerance']:.0e}")


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
