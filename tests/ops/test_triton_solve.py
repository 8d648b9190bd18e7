"""The Triton kernels of the causal kernel-smoother solve (``_triton_solve``), run under Triton's CPU
interpreter, against a dense float64 reference written here (K built with its masks, A, and
``solve_triangular``; gradients by autograd through it): U and the gradients of x, y, b, β and γ,
at odd lengths (1, 37, 130), row blocks that do not divide T (chunk 24 → block 32; T = 37 with 16),
the inclusive (Cubit) and strict (DeltaFormer) masks, β absent and given, packed documents laid out
differently per batch element, dk ≠ dv, a well-conditioned γ and Cubit's tiny ridge (γ = 1e-6,
y = x·s/‖x‖, where the diagonal is the row maximum). Inputs are transposed views of [B, T, H, d]
tensors, as the callers pass them."""

from __future__ import annotations

import contextlib
import os
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.ops import _triton_solve  # noqa: E402
from kernelmix.ops._triton_solve import row_block_size, triton_kernel_solve  # noqa: E402
from kernelmix.ops._triton_solve_plan import solve_launches  # noqa: E402
from tests.utils import compile_ahead_of_time, rel_rmse  # noqa: E402

F64 = torch.float64
TOL = 1e-4
# the bounds the tests hold each operand choice of the span products to (the errors measured, docs/gpu.md)
TENSOR_CORE_BOUNDS = {"fp32": TOL, "tf32": 2e-3, "bf16": 2e-2}


def dense_solve(x, y, b, beta, gamma, *, scale, strict, doc_start):
    """(diag(β) K + γ I)⁻¹ b with K the full T×T masked softmax, in the inputs' dtype."""
    batch, heads, length, _ = x.shape
    i = torch.arange(length, device=x.device)
    visible = (i[None, :] < i[:, None]) if strict else (i[None, :] <= i[:, None])
    visible = visible.expand(batch, 1, length, length)
    if doc_start is not None:
        visible = visible & (i[None, None, None, :] >= doc_start[:, None, :, None])
    logits = (scale * x @ y.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    kernel = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing visible is 0
    rows = torch.ones(batch, heads, length, dtype=x.dtype, device=x.device) if beta is None else beta
    eye = torch.eye(length, dtype=x.dtype, device=x.device)
    system = rows[..., None] * kernel + gamma[None, :, None, None] * eye
    return torch.linalg.solve_triangular(system, b, upper=False)


def doc_starts(length: int, cuts: list[list[int]]) -> torch.Tensor:
    """[B, T] document starts: batch element n has documents beginning at each of ``cuts[n]``."""
    starts = torch.zeros(len(cuts), length, dtype=torch.long)
    for n, points in enumerate(cuts):
        for p in points:
            starts[n, p:] = p
    return starts


def bhtd(t: torch.Tensor) -> torch.Tensor:
    """A [B, H, T, *] view of a [B, T, H, *] tensor (the callers' layout)."""
    return t.transpose(1, 2)


def make_inputs(shape, *, seed: int, with_beta: bool, gamma, cubit_like: bool) -> dict:
    """[B, T, H, d] inputs of ``shape`` = (B, T, H, dk, dv); H = len(gamma)."""
    batch, length, heads, dk, dv = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, dk, generator=g, dtype=F64)
    if cubit_like:  # Cubit's column side: y = x · s / ‖x‖, so x_i·y_i is every row's maximum
        ref_scale = torch.linspace(1.0, 2.5, heads, dtype=F64)[:, None]
        y = x * (ref_scale / x.norm(dim=-1, keepdim=True))
    else:
        y = torch.randn(batch, length, heads, dk, generator=g, dtype=F64)
    b = torch.randn(batch, length, heads, dv, generator=g, dtype=F64)
    beta = torch.rand(batch, length, heads, generator=g, dtype=F64) * 0.9 + 0.05 if with_beta else None
    return {"x": x, "y": y, "b": b, "beta": beta, "gamma": torch.tensor(gamma, dtype=F64)}


def check_against_reference(length, chunk_size, *, strict, with_beta, gamma, cuts, batch=2, dims=(8, 12),
                            cubit_like=False, seed=0, device="cpu", tolerance=TOL):
    """U and every gradient within ``TOL`` of the float64 reference; ``cuts``: document starts per
    batch element (None: one document), H = len(gamma), ``dims`` = (dk, dv)."""
    shape = (batch, length, len(gamma), *dims)
    t = make_inputs(shape, seed=seed, with_beta=with_beta, gamma=gamma, cubit_like=cubit_like)
    t = {n: None if v is None else v.to(device) for n, v in t.items()}
    doc_start = None if cuts is None else doc_starts(length, cuts).to(device)
    scale = 1.0 if cubit_like else dims[0] ** -0.5
    names = [n for n in ("x", "y", "b", "beta", "gamma") if t[n] is not None]
    ours = {n: t[n].float().requires_grad_() for n in names}
    ref = {n: t[n].clone().requires_grad_() for n in names}

    def args(d):
        three = {n: bhtd(d[n]) for n in ("x", "y", "b")}
        beta = None if t["beta"] is None else bhtd(d["beta"])
        return dict(**three, beta=beta, gamma=d["gamma"], scale=scale, strict=strict, doc_start=doc_start)

    u = triton_kernel_solve(**args(ours), chunk_size=chunk_size)
    expected = dense_solve(**args(ref))
    assert u.shape == (batch, len(gamma), length, dims[1]) and u.dtype == torch.float32
    assert rel_rmse(u, expected) <= tolerance, rel_rmse(u, expected)
    grad_u = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64).to(device)
    got = torch.autograd.grad(u, [ours[n] for n in names], grad_u.float())
    want = torch.autograd.grad(expected, [ref[n] for n in names], grad_u)
    errors = {"u": rel_rmse(u, expected)} | {n: rel_rmse(a, e) for n, a, e in zip(names, got, want)}
    assert all(e <= tolerance for e in errors.values()), errors
    return errors


# The interpreter's cost grows with the programs (B·H·value slices) times the rows: the long cases
# use few heads.
@pytest.mark.parametrize(
    "length, chunk_size, strict, with_beta, gamma, cuts, batch, dims",
    [
        # Cubit-shaped (inclusive, β = 1), block 32 not dividing 130, 3 / 2 documents per element
        (130, 24, False, False, [0.1], [[0, 40, 97], [0, 64]], 2, (8, 12)),
        # DeltaFormer-shaped (strict, β given), one document, block 16 not dividing 130
        (130, 16, True, True, [0.3], None, 1, (8, 12)),
        # strict, β given, γ = 1, boundaries mid-block and on a block edge, two heads
        (37, 16, True, True, [1.0, 0.7], [[0, 5, 21], [0, 16, 30]], 2, (8, 12)),
        # dk = 20 (padded to 32), dv = 80: two value slices of 64 in the sequential kernels
        (37, 16, False, True, [0.5], None, 1, (20, 80)),
        # dv = 100 (padded to 128, a wide head): blocks of 64 rows, the column gradient (dy, and dx by
        # atomics: one span, fp32 operands) streaming rows in tiles of 16; T = 77 not a multiple of
        # either, a document boundary mid-block
        (77, 64, False, False, [0.1], [[0, 30]], 1, (8, 100)),
        (77, 64, True, True, [0.4], [[0, 45]], 1, (8, 100)),
        # blocks of 64 without documents: the gradient kernels' streamed tiles without doc starts
        (77, 64, False, False, [0.2], None, 1, (8, 12)),
        (77, 64, True, True, [0.6], None, 1, (8, 100)),
    ],
)
def test_matches_dense_reference(length, chunk_size, strict, with_beta, gamma, cuts, batch, dims):
    check_against_reference(length, chunk_size, strict=strict, with_beta=with_beta, gamma=gamma, cuts=cuts,
                            batch=batch, dims=dims)


# The chunk-parallel path: spans of 32 rows (2 row blocks of 16) or 48 rows with blocks of 16, so
# that T = 130 has 5 or 3 spans, the last one partial, and documents cross span edges.
@pytest.mark.parametrize(
    "span, length, chunk_size, strict, with_beta, gamma, cuts, batch, dims",
    [
        (32, 130, 16, False, False, [0.1], [[0, 40, 97], [0, 64]], 2, (8, 12)),  # Cubit-shaped, 3 / 2 documents
        (48, 130, 16, True, True, [0.3], None, 1, (8, 12)),  # DeltaFormer-shaped, one document
        (32, 37, 16, True, True, [1.0, 0.7], [[0, 5, 21], [0, 16, 30]], 2, (8, 12)),
        (16, 37, 16, False, True, [0.5], None, 1, (20, 80)),  # one block per span, two value slices
        # tiles of 64 rows, substitutions in blocks of 16 (SUBSTITUTION_ROWS): 3 spans, or one
        (128, 300, 64, False, True, [0.2], [[0, 150]], 1, (8, 12)),
        (1024, 130, 64, True, True, [0.5], [[0, 70]], 1, (8, 12)),
    ],
)
def test_spans_match_dense_reference(monkeypatch, span, length, chunk_size, strict, with_beta, gamma, cuts, batch,
                                     dims):
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", span)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "fp32")
    check_against_reference(length, chunk_size, strict=strict, with_beta=with_beta, gamma=gamma, cuts=cuts,
                            batch=batch, dims=dims)


# Sub-spans inside the spans: the sequential launches solve 16 or 32 rows at a time, each followed
# by a push of its rows into the span's later rows (forward) and earlier columns (backward); spans of
# 48 or 64 rows, so that a span has 2-4 sub-spans, the last one partial where T ends mid-span, with
# documents that begin inside a sub-span and cross sub-span and span edges; one span (T ≤ SPAN_ROWS)
# whose sub-spans are the only pushes.
@pytest.mark.parametrize(
    "span, subspan, length, chunk_size, strict, with_beta, gamma, cuts, batch, dims",
    [
        (64, 16, 130, 16, False, False, [0.1], [[0, 40, 97], [0, 70]], 2, (8, 12)),  # Cubit-shaped
        (48, 32, 131, 16, True, True, [0.3, 0.8], [[0, 21, 50]], 1, (8, 12)),  # DeltaFormer, 2 sub-spans of 2/1
        (1024, 16, 77, 16, True, True, [0.5], [[0, 33]], 1, (20, 80)),  # one span of 5 sub-spans, 2 slices
        (64, 32, 100, 32, False, True, [0.2], None, 1, (8, 12)),  # blocks of 32, substitution in 16s
        # dv = 160: the forward's three slices of 64, the transposed span kernels' two of 128
        (32, 16, 40, 16, True, True, [0.4], [[0, 17]], 1, (8, 160)),
    ],
)
def test_subspans_match_dense_reference(monkeypatch, span, subspan, length, chunk_size, strict, with_beta, gamma,
                                        cuts, batch, dims):
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", span)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", subspan)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "fp32")
    check_against_reference(length, chunk_size, strict=strict, with_beta=with_beta, gamma=gamma, cuts=cuts,
                            batch=batch, dims=dims)


@pytest.mark.parametrize("strict, chunk_size", [(False, 16), (True, 32)])
def test_subspan_logits_match_float64(monkeypatch, strict, chunk_size):
    """The logits the sequential kernels read, formed beforehand for every sub-span in one launch: each
    row against its sub-span's columns up to its own row block, scale·log2(e)·x_i·y_j in fp32 within
    float64's, −inf exactly where the column is hidden (the future, the diagonal when strict, another
    document, past the end). Spans of 96 rows in sub-spans of 64 (a span's second sub-span is 32 rows,
    so sub-spans do not start at multiples of their width), T = 131, documents mid-block."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 96)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 64)
    generator = torch.Generator().manual_seed(11)
    batch, heads, length, width, scale = 2, 3, 131, 24, 0.3
    x, y = (torch.randn(batch, heads, length, width, generator=generator) for _ in range(2))
    doc = doc_starts(length, [[0, 40, 101], [0]])
    lay = _triton_solve.SolveLayout(x, x, None, doc, scale, strict, chunk_size)
    logits = _triton_solve._subspan_logits(x, y, doc, lay)
    assert logits.shape == (batch, heads, length, 64) and lay.subspan_rows == 64
    exact = (x.double() @ y.double().transpose(-1, -2)) * scale / torch.log(torch.tensor(2.0, dtype=F64))
    block = lay.block_t
    for i in range(length):
        span_start = i // 96 * 96
        sub_start = span_start + (i - span_start) // 64 * 64
        stop = (i // block + 1) * block  # the row's block's end: the columns written
        for n in range(batch):
            written = logits[n, :, i, : stop - sub_start]
            cols = torch.arange(sub_start, stop)
            visible = (cols >= doc[n, i]) & ((cols < i) if strict else (cols <= i)) & (cols < length)
            assert torch.all(written[:, ~visible] == float("-inf")), (i, n)
            expected = exact[n, :, i, cols[visible]]
            assert torch.allclose(written[:, visible].double(), expected, rtol=1e-5, atol=1e-5), (i, n)


def test_gradient_kernels_take_the_blocks_that_compile_without_spills():
    """The blocks ptxas compiled without spills (sm_90, results/gpu-plan), the same for Cubit and
    DeltaFormer (both take e from their forward): with TF32 operands at a 128-wide head the column kernel
    alone gives dy and dx (by atomics), streaming 16 rows, a column block a program; at d = 64 the row
    kernel gives dx in 128-row programs and the column kernel dy in 128-column ones, both streaming 32;
    with bf16 operands, at either head, the column kernel alone, 128 columns a program, its tiles
    transposed, streaming 16; all at 8 warps."""
    def launches(heads, d, has_beta, operands=None):
        return {x.name: x for x in solve_launches(1, heads, 8192, d, d, chunk_size=64,
                                                                strict=has_beta, has_beta=has_beta, has_doc=True,
                                                                operands=operands)}

    def blocks(launch, group="BLOCK_C"):
        return (launch.constexprs[group], launch.constexprs["STREAM_T"], launch.grid, launch.num_warps,
                launch.constexprs.get("ROW_GRAD"), launch.constexprs.get("COLUMN_MAJOR"))

    for has_beta in (False, True):
        tf32, bf16 = launches(16, 128, has_beta), launches(16, 128, has_beta, "bf16")
        narrow, narrow_bf16 = launches(12, 64, has_beta), launches(12, 64, has_beta, "bf16")
        assert "solve_grad_rows" not in tf32 and "solve_grad_rows" not in bf16 and "solve_grad_rows" not in narrow_bf16
        assert blocks(tf32["solve_grad_columns"]) == (64, 16, (16, 128), 8, True, False)
        assert blocks(bf16["solve_grad_columns"]) == (128, 16, (16, 64), 8, True, True)
        assert blocks(narrow_bf16["solve_grad_columns"]) == (128, 16, (12, 64), 8, True, True)
        assert blocks(narrow["solve_grad_rows"], "BLOCK_R") == (128, 32, (12, 64), 8, None, None)
        assert blocks(narrow["solve_grad_columns"]) == (128, 32, (12, 64), 8, False, False)


def test_spans_with_cubit_tiny_ridge(monkeypatch):
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 16)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "fp32")
    check_against_reference(37, 16, strict=False, with_beta=False, gamma=[1e-6, 1e-6], cuts=[[0, 20], [0, 9]],
                            cubit_like=True)


# The span products on tensor cores: the interpreter computes in fp32, the kernels round the operands
# as the GPU does; the bounds are the errors measured here (docs/gpu.md), worst over values and
# gradients at T = 193 in spans of 32, and in spans of 64 with sub-spans of 16, whose pushes take the
# same operands (dγ at Cubit's tiny ridge is the largest: 1.5e-3 / 1.5e-2; dx 8.6e-4 / 7.9e-3). Spans of
# 64 in sub-spans of 16 run every kernel the spans of 32 run (and the pushes). By default one case runs:
# Cubit at its tiny ridge with bf16 operands in spans of 64 (the largest errors); the others are slow
# (-m slow). Both mixers and both operands also run by default at the plan's blocks (pushes included):
# test_gradient_kernels_at_the_plans_blocks.
def _tensor_core_cases():
    for span, subspan in ((32, 128), (64, 16)):
        for case in ("cubit", "deltaformer"):
            for operands, bound in (("tf32", 2e-3), ("bf16", 2e-2)):
                default = (span, subspan, case, operands) == (64, 16, "cubit", "bf16")
                yield pytest.param(operands, bound, case, span, subspan, marks=() if default else pytest.mark.slow,
                                   id=f"{span}-{subspan}-{case}-{operands}")


@pytest.mark.parametrize("operands, bound, case, span, subspan", list(_tensor_core_cases()))
def test_tensor_core_spans_within_their_measured_error(monkeypatch, operands, bound, case, span, subspan):
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", span)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", subspan)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", operands)
    if case == "cubit":
        kw = dict(strict=False, with_beta=False, gamma=[1e-6, 1e-6], cuts=[[0, 100], [0, 9]], cubit_like=True)
    else:
        kw = dict(strict=True, with_beta=True, gamma=[1.0, 1.0], cuts=[[0, 100], [0]])
    errors = check_against_reference(193, 16, dims=(16, 16), tolerance=bound, **kw)
    assert max(errors.values()) > 1e-6  # the rounding is there: fp32 gives ~1e-7


# The gradient kernels at the plan's blocks: 64-row blocks, two row (column) blocks a program; with
# TF32 operands at a narrow head (d = 8: dx from 128-row programs, dy from 128-column ones, columns
# streamed 32 at a time), with bf16 operands at a wide one (dv = 100, padded to 128: the column kernel
# alone, 128 columns a program, its tiles transposed, rows streamed 16 at a time, dx by atomics); spans
# of 128 in sub-spans of 64 so that T = 300 has three spans and pushes; document boundaries mid-block
# and mid-group.
# Cubit with bf16 operands at these blocks runs with -m slow (12 s here; Cubit's bf16 one-pass gradients
# run by default in test_tensor_core_spans_within_their_measured_error, DeltaFormer's here).
@pytest.mark.parametrize("operands, dims, case", [
    ("tf32", (8, 12), "cubit"), ("tf32", (8, 12), "deltaformer"), ("bf16", (8, 100), "deltaformer"),
    pytest.param("bf16", (8, 100), "cubit", marks=pytest.mark.slow)])
def test_gradient_kernels_at_the_plans_blocks(monkeypatch, operands, dims, case):
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 128)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 64)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", operands)
    if case == "cubit":
        kw = dict(strict=False, with_beta=False, gamma=[0.1], cuts=[[0, 150]], cubit_like=True)
    else:
        kw = dict(strict=True, with_beta=True, gamma=[0.8], cuts=[[0, 97]])
    errors = check_against_reference(300, 64, batch=1, dims=dims, tolerance=TENSOR_CORE_BOUNDS[operands], **kw)
    assert max(errors.values()) > 1e-6  # the rounding is there: fp32 gives ~1e-7


def test_transposed_span_kernels_at_keys_wider_than_128(monkeypatch):
    """With TF32 operands at keys wider than 128 (padded to 256) the transposed direction's span kernel and
    pushes hold one column block and stream the rows 16 at a time (two blocks spilled 24-120 B per thread on
    sm_90, one with its whole row block 168-356 B, one streamed none: results/gpu-plan's 256-wide head); bf16
    keeps two. The sub-spans' logits take programs of 32 rows there (either operands). Values and gradients
    against float64 within the TF32 bound at those blocks: keys of 130 (the padding masked), three spans with
    pushes, a document starting mid-block."""
    wide = {x.name: x for x in solve_launches(1, 4, 8192, 256, 256, chunk_size=64, strict=False, has_beta=False,
                                               has_doc=True)}
    for name in ("solve_future_span", "solve_span_push_transposed"):
        assert (wide[name].constexprs["BLOCK_C"], wide[name].constexprs["STREAM_T"]) == (64, 16), name
    logits = wide["solve_subspan_logits"]  # 32-row programs, 16-column tiles (64 rows spilled 24-64 B)
    assert (logits.constexprs["BLOCK_T"], logits.constexprs["STREAM_T"], logits.grid) == (32, 16, (4, 256))
    bf16 = {x.name: x for x in solve_launches(1, 4, 8192, 256, 256, chunk_size=64, strict=False, has_beta=False,
                                               has_doc=True, operands="bf16")}
    future = bf16["solve_future_span"].constexprs
    assert (future["BLOCK_C"], future["STREAM_T"]) == (128, 16)
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 128)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 64)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "tf32")
    errors = check_against_reference(300, 64, batch=1, dims=(130, 6), tolerance=TENSOR_CORE_BOUNDS["tf32"],
                                     strict=True, with_beta=True, gamma=[0.8], cuts=[[0, 97]])
    assert max(errors.values()) > 1e-6  # the rounding is there: fp32 gives ~1e-7


# bf16's slices of 128 are also read by test_bf16_operands_are_read_from_bf16_copies (one slice): its
# two-slice case runs with -m slow
@pytest.mark.parametrize("operands", ["tf32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_forward_span_slices_of_128_value_columns(monkeypatch, operands):
    """On tensor cores the forward's span kernels and pushes hold up to 128 value columns a program: at
    dv = 160 two slices (the second of 32 columns), which the sequential kernels' five slices of 32 read
    the partials of (the fifth from the second), streaming the columns 16 at a time (blocks of 16);
    within the operands' measured error of the float64 solve, documents crossing spans and sub-spans."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", operands)
    seen: list = []
    for name in ("past_span_kernel", "solve_forward_kernel"):
        monkeypatch.setattr(_triton_solve, name, ArgumentRecorder(getattr(_triton_solve, name), name, seen))
    errors = check_against_reference(70, 16, strict=True, with_beta=True, gamma=[0.6], cuts=[[0, 29]], batch=1,
                                     dims=(8, 160), tolerance=TENSOR_CORE_BOUNDS[operands])
    assert max(errors.values()) > 1e-6  # the operands' rounding is there
    slices = {name: {grid[-1] for n, _, grid in seen if n == name} for name in ("past_span_kernel",
                                                                                  "solve_forward_kernel")}
    # bf16: the across-span launches in two column halves per slice (4), the pushes whole (2)
    assert slices == {"past_span_kernel": {2} if operands == "tf32" else {2, 4}, "solve_forward_kernel": {5}}


class ArgumentRecorder:
    """Stands in for a @triton.jit kernel: records each launch's tensor arguments and grid, then launches it."""

    def __init__(self, kernel, name: str, seen: list):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((self.name, [a for a in args if isinstance(a, torch.Tensor)], tuple(grid)))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("with_beta", [False, True])
def test_bf16_operands_are_read_from_bf16_copies(monkeypatch, with_beta):
    """With bf16 operands the span kernels, the pushes and the gradient kernels read bf16 x, y, U and
    db (half the bytes; db's copy is β ⊙ db), and the copies of U and db the sequential kernels store as
    they solve are exactly the solved values rounded (to nearest, ties away, as the kernels round operands), every
    row and value slice of them; the sequential kernels themselves read fp32 (their logits and
    right-hand sides). dv = 80: the forward's span kernels take one slice of 128 columns, its
    sequential kernel three of 32, which read the one slice's partials; U within the bf16 bound of
    the float64 solve."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "bf16")
    seen: list = []
    for name in ("past_span_kernel", "future_span_kernel", "grad_rows_kernel", "grad_columns_kernel",
                 "solve_forward_kernel", "solve_transposed_kernel"):
        monkeypatch.setattr(_triton_solve, name, ArgumentRecorder(getattr(_triton_solve, name), name, seen))
    t = make_inputs((1, 70, 2, 8, 80), seed=5, with_beta=with_beta, gamma=[0.4, 0.9], cubit_like=False)
    leaves = {n: bhtd(t[n].float()).requires_grad_() for n in ("x", "y", "b")}
    beta = bhtd(t["beta"].float()) if with_beta else None
    doc = doc_starts(70, [[0, 41]])
    u = triton_kernel_solve(**leaves, beta=beta, gamma=t["gamma"].float(), scale=0.35, strict=with_beta,
                            chunk_size=16, doc_start=doc)
    expected = dense_solve(bhtd(t["x"]), bhtd(t["y"]), bhtd(t["b"]), None if beta is None else bhtd(t["beta"]),
                           t["gamma"], scale=0.35, strict=with_beta, doc_start=doc)
    assert 1e-6 < rel_rmse(u, expected) <= 2e-2
    slices = {name: {grid[-1] for n, _, grid in seen if n == name}
              for name in ("past_span_kernel", "solve_forward_kernel")}
    # value slices: 1 of 128 (the across-span launches in two column halves, the pushes whole), 3 of 32
    assert slices == {"past_span_kernel": {1, 2}, "solve_forward_kernel": {3}}
    u.backward(torch.randn(u.shape, generator=torch.Generator().manual_seed(6)))
    names = {name for name, _, _ in seen}
    # one gradient pass: the column kernel adds dx by atomics, no row kernel
    assert names >= {"past_span_kernel", "future_span_kernel", "grad_columns_kernel"}
    assert "grad_rows_kernel" not in names
    for name, tensors, _ in seen:
        operands = [a.dtype for a in tensors[:4]]  # x, y and U / db (grad kernels: x, y, U, db)
        if name.startswith("solve_"):
            assert operands[:2] == [torch.float32] * 2, name
        else:
            assert operands[:3] == [torch.bfloat16] * 3, name
    _, columns, _ = next(item for item in seen if item[0] == "grad_columns_kernel")
    assert torch.equal(columns[2], _triton_solve.bf16_copy(u.detach()))  # the forward's copy of U
    # db = dL/db, with β folded in (β ⊙ db: the kernels reading the copy multiply by no β)
    folded = leaves["b"].grad if beta is None else beta[..., None] * leaves["b"].grad
    assert torch.equal(columns[3], _triton_solve.bf16_copy(folded))
    assert columns[3].dtype == torch.bfloat16


class FlagRecorder:
    """Stands in for a @triton.jit kernel: records each launch's constexpr flags, then launches it."""

    def __init__(self, kernel, name: str, seen: list, flags: tuple):
        self.kernel, self.name, self.seen, self.flags = kernel, name, seen, flags

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((self.name, tuple(kwargs.get(flag) for flag in self.flags)))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("with_beta", [False, True])
def test_bf16_gradients_are_fused_into_the_transposed_span_kernel(monkeypatch, with_beta):
    """With bf16 operands the transposed solve's span kernel over the later spans (not its pushes) forms
    those pairs' gradients too (GRAD, dx by atomics), and the column kernel then sums the spans' own rows
    (WITHIN_SPAN); the gradients equal those of the separate pass (fusion off: the column kernel over all
    rows) up to the fp32 order of their sums, from the same bf16 operands."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "bf16")
    t = make_inputs((1, 77, 2, 8, 12), seed=9, with_beta=with_beta, gamma=[0.3, 0.7], cubit_like=False)
    doc = doc_starts(77, [[0, 45]])
    grad_u = torch.randn(1, 2, 77, 12, generator=torch.Generator().manual_seed(10))
    future, columns, layout = _triton_solve.future_span_kernel, _triton_solve.grad_columns_kernel, \
        _triton_solve.SolveLayout.__init__

    def gradients(fused: bool):
        seen: list = []
        monkeypatch.setattr(_triton_solve, "future_span_kernel", FlagRecorder(
            future, "future", seen, ("GRAD", "ROW_GRAD", "ACCUMULATE")))
        monkeypatch.setattr(_triton_solve, "grad_columns_kernel", FlagRecorder(
            columns, "columns", seen, ("WITHIN_SPAN", "ROW_GRAD")))

        def init(self, *args, **kwargs):
            layout(self, *args, **kwargs)
            self.fused_gradients = self.fused_gradients and fused

        monkeypatch.setattr(_triton_solve.SolveLayout, "__init__", init)
        leaves = {n: t[n].float().requires_grad_() for n in ("x", "y", "b", "beta") if t[n] is not None}
        u = triton_kernel_solve(bhtd(leaves["x"]), bhtd(leaves["y"]), bhtd(leaves["b"]),
                                beta=bhtd(leaves["beta"]) if with_beta else None, gamma=t["gamma"].float(), scale=0.35,
                                strict=with_beta, chunk_size=16, doc_start=doc)
        return torch.autograd.grad(u, list(leaves.values()), grad_u), seen

    fused, seen = gradients(True)
    spans = 3  # T = 77 in spans of 32: the first two gather from the later spans, with their gradients
    assert seen.count(("future", (True, True, False))) == spans - 1
    assert all(flags[0] is False for name, flags in seen if name == "future" and flags[2])  # the pushes: none
    assert [flags for name, flags in seen if name == "columns"] == [(True, True)]
    apart, seen = gradients(False)
    assert not any(flags[0] for _, flags in seen) and [f for n, f in seen if n == "columns"] == [(False, True)]
    for a, b in zip(fused, apart):
        assert rel_rmse(a, b) <= 1e-5


def test_bf16_across_span_halves_merge_to_the_whole(monkeypatch):
    """With bf16 operands the forward's across-span kernel takes four row blocks a program in two column
    halves, whose partials a merge kernel combines: U is as close to the float64 solve as with one program
    over all the columns, and differs from it only by the bf16 rounding of the weights (each half rounds
    exp2(s − its own running max)), with a document starting inside the second half (the first half then
    has no column for its rows: neutral partials), sub-spans of two blocks (the pushes' columns whole:
    a push split in halves would lose one) and T not a multiple of the blocks."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 64)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "bf16")
    t = make_inputs((1, 150, 1, 8, 12), seed=11, with_beta=True, gamma=[0.5], cubit_like=False)
    doc = doc_starts(150, [[0, 100]])  # rows of the third span see columns from 100 on: the second half only

    def solve(splits):
        monkeypatch.setattr(_triton_solve, "PAST_SPLITS", splits)
        seen: list = []
        monkeypatch.setattr(_triton_solve, "past_span_kernel", ArgumentRecorder(past, "past", seen))
        u = triton_kernel_solve(bhtd(t["x"].float()), bhtd(t["y"].float()), bhtd(t["b"].float()),
                                beta=bhtd(t["beta"].float()), gamma=t["gamma"].float(), scale=0.35, strict=True,
                                chunk_size=16, doc_start=doc)
        return u, {grid for _, _, grid in seen}

    past = _triton_solve.past_span_kernel
    halves, grids = solve(2)
    assert (1, 1, 2) in grids  # a span of 64 rows: one program of 4 blocks of 16 rows, per column half
    whole, grids = solve(1)
    assert (1, 1, 1) in grids and (1, 1, 2) not in grids
    expected = dense_solve(bhtd(t["x"]), bhtd(t["y"]), bhtd(t["b"]), bhtd(t["beta"]), t["gamma"], scale=0.35,
                           strict=True, doc_start=doc)
    error, whole_error = rel_rmse(halves, expected), rel_rmse(whole, expected)
    assert error <= 1.05 * whole_error <= TENSOR_CORE_BOUNDS["bf16"]
    assert 0 < rel_rmse(halves, whole) <= 0.25 * whole_error  # (a lost half: 0.1)


def test_solve_operands_picks_the_span_products(monkeypatch):
    """kernelmix.ops.solve_operands: inside the block the span kernels take its operands (bf16: they read
    bf16 copies), outside it the default (TF32: fp32 tiles); a forward run inside keeps its choice for a
    backward run outside; blocks nest; another name is an error naming the choices."""
    from kernelmix.ops import solve_operands

    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    seen: list = []
    for name in ("past_span_kernel", "grad_columns_kernel"):
        monkeypatch.setattr(_triton_solve, name, ArgumentRecorder(getattr(_triton_solve, name), name, seen))
    t = make_inputs((1, 40, 1, 8, 8), seed=12, with_beta=False, gamma=[0.5], cubit_like=False)

    def forward():
        seen.clear()
        x = bhtd(t["x"].float()).requires_grad_()
        u = triton_kernel_solve(x, bhtd(t["y"].float()), bhtd(t["b"].float()), beta=None, gamma=t["gamma"].float(),
                                scale=0.35, strict=False, chunk_size=16, doc_start=None)
        return x, u, {tensors[0].dtype for _, tensors, _ in seen}

    with solve_operands("bf16"):
        x, u, dtypes = forward()
        with solve_operands("tf32"):
            assert forward()[2] == {torch.float32}
        assert forward()[2] == {torch.bfloat16}
    assert dtypes == {torch.bfloat16}
    seen.clear()
    u.sum().backward()  # outside the block: the forward's choice
    assert {tensors[0].dtype for name, tensors, _ in seen if name == "grad_columns_kernel"} == {torch.bfloat16}
    assert forward()[2] == {torch.float32}  # the default again
    with pytest.raises(KernelmixError, match="'tf32x3'.*tf32, bf16, fp32"):
        with solve_operands("tf32x3"):
            pass


def test_solve_operands_hold_for_a_recomputed_forward(monkeypatch):
    """torch.utils.checkpoint recomputes the forward in the backward, outside the ``with solve_operands``
    block: with ``context_fn=keep_solve_operands`` (as the model's recompute modes pass it) it takes the
    forward's operands again, and the gradients are the plain backward's, bit for bit; without it the
    recomputation takes TF32 and saves other tensors than the forward did."""
    from torch.utils.checkpoint import checkpoint

    from kernelmix.ops import keep_solve_operands, solve_operands

    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    t = make_inputs((1, 40, 1, 8, 8), seed=13, with_beta=False, gamma=[0.5], cubit_like=False)
    y, b = bhtd(t["y"].float()), bhtd(t["b"].float())

    def solve(x):
        return triton_kernel_solve(x, y, b, beta=None, gamma=t["gamma"].float(), scale=0.35, strict=False,
                                   chunk_size=16, doc_start=None)

    def gradient(**recompute):
        x = bhtd(t["x"].float()).requires_grad_()
        with solve_operands("bf16"):
            u = checkpoint(solve, x, use_reentrant=False, **recompute) if recompute else solve(x)
        u.square().sum().backward()
        return x.grad

    plain = gradient()
    assert torch.equal(gradient(context_fn=keep_solve_operands), plain)
    with pytest.raises(RuntimeError):
        gradient(context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()))


def test_bf16_gradients_at_spans_of_an_odd_number_of_blocks(monkeypatch):
    """The fused gradients need whole programs (two column blocks) inside a span: at spans of three blocks
    (48 rows of 16) they are off, and the separate gradient pass (β still folded into db's copy and e)
    matches float64 within the bf16 bound, documents crossing spans."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 48)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", "bf16")
    x = torch.empty(1, 1, 100, 8, device="meta")
    layout = _triton_solve.SolveLayout(x, x, x[..., 0], None, 1.0, True, 16)
    assert layout.span_blocks == 3 and layout.shadowed and not layout.fused_gradients
    errors = check_against_reference(100, 16, strict=True, with_beta=True, gamma=[0.7], cuts=[[0, 61]], batch=1,
                                     dims=(8, 12), tolerance=TENSOR_CORE_BOUNDS["bf16"])
    assert max(errors.values()) > 1e-6


@pytest.mark.parametrize("mixer", ["cubit", "deltaformer"])
def test_a_solve_mixer_takes_its_solve_operands_option(monkeypatch, mixer):
    """The solve mixers' ``solve_operands`` option (a model config's ``mixer_options``): the layer's
    solves take it (bf16: the span kernels read bf16 copies), None leaves the default (TF32: fp32 tiles),
    another value is refused naming the choices."""
    from kernelmix.layers import build_mixer
    from kernelmix.model_config import ModelConfig

    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 32)
    monkeypatch.setattr(_triton_solve, "SUBSPAN_ROWS", 16)
    seen: list = []
    monkeypatch.setattr(_triton_solve, "past_span_kernel", ArgumentRecorder(_triton_solve.past_span_kernel, "past",
                                                                             seen))
    hidden = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(14))
    for operands, dtype in (("bf16", torch.bfloat16), (None, torch.float32)):
        seen.clear()
        torch.manual_seed(0)
        layer = build_mixer(mixer, hidden_size=32, num_heads=2, chunk_size=16, backend="triton",
                            solve_operands=operands)
        layer(hidden)
        assert {tensors[0].dtype for _, tensors, _ in seen} == {dtype}, operands
    with pytest.raises(KernelmixError, match="solve_operands must be one of 'tf32', 'bf16', 'fp32'; got 'tf32x3'"):
        build_mixer(mixer, hidden_size=32, num_heads=2, solve_operands="tf32x3")
    config = ModelConfig(mixer=mixer, mixer_options={mixer: {"solve_operands": "bf16"}})
    assert config.mixer_options[mixer]["solve_operands"] == "bf16"


def test_bf16_copy_rounds_to_nearest_with_ties_away_from_zero():
    """The copies round as the kernels' ``rounded``: to nearest, a tie away from zero (torch's own cast
    breaks it to even), in the tensor's own layout."""
    one_ulp = 2.0 ** -7  # bf16's spacing in [1, 2)
    values = torch.tensor([1.0 + one_ulp / 2, -(1.0 + one_ulp / 2), 1.0 + 3 * one_ulp / 2, 1.0 + one_ulp / 4,
                           float("inf"), -0.0])
    copy = _triton_solve.bf16_copy(values)
    assert copy.dtype == torch.bfloat16
    assert copy.float().tolist() == [1.0 + one_ulp, -(1.0 + one_ulp), 1.0 + 2 * one_ulp, 1.0, float("inf"), -0.0]
    assert values.bfloat16()[0].item() == 1.0  # ties to even: what bf16_copy does not do
    view = torch.randn(2, 5, 3, 4).transpose(1, 2)
    assert _triton_solve.bf16_copy(view).stride() == view.stride()


@pytest.mark.parametrize("operands", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("with_beta", [False, True])
def test_gradients_without_dx_match_those_with_it(monkeypatch, with_beta, operands):
    """x needs no gradient: no kernel forms dx (the column kernel adds none by atomics, ``ROW_GRAD`` off,
    with fp32 operands in one span and with bf16 operands, its tiles transposed, across spans; the row
    kernel is not launched with TF32 operands across spans) and dy, db, dβ are those of the full
    backward, bit for bit (the same kernel tiles, the same order)."""
    monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 1024 if operands == "fp32" else 32)
    monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", operands)
    seen: list = []
    monkeypatch.setattr(_triton_solve, "grad_rows_kernel",
                        ArgumentRecorder(_triton_solve.grad_rows_kernel, "grad_rows_kernel", seen))
    t = make_inputs((1, 50, 2, 8, 12), seed=3, with_beta=with_beta, gamma=[0.4, 0.9], cubit_like=False)
    grad_u = torch.randn(1, 2, 50, 12, generator=torch.Generator().manual_seed(4))

    def grads(x_needs_grad):
        x = bhtd(t["x"].float()).requires_grad_(x_needs_grad)
        rest = {n: t[n].float().requires_grad_() for n in ("y", "b", "beta") if t[n] is not None}
        u = triton_kernel_solve(x, bhtd(rest["y"]), bhtd(rest["b"]), beta=bhtd(rest["beta"]) if with_beta else None,
                                gamma=t["gamma"].float(), scale=0.35, strict=with_beta, chunk_size=16, doc_start=None)
        return torch.autograd.grad(u, list(rest.values()), grad_u)

    without = grads(False)
    assert not seen
    assert all(torch.equal(a, b) for a, b in zip(without, grads(True)))
    assert len(seen) == (operands == "tf32")  # dx from the row kernel across spans, else by the atomics


def test_cubit_tiny_ridge():
    """γ = 1e-6 with the inclusive mask: A ≈ K, whose diagonal K_ii ≥ 1/n_i is the row maximum."""
    check_against_reference(37, 16, strict=False, with_beta=False, gamma=[1e-6, 1e-6], cuts=[[0, 20], [0, 9]],
                            cubit_like=True)


def test_deltaformer_small_beta_keeps_its_precision():
    """β ~ 1e-3: dβ = −e, e_i = db_i·(K U)_i with K U as the forward formed it. The quotient
    (b − γU)/β, the form Cubit's e takes (β = 1), loses it: A ≈ γ I there, so b − γU is β K U, a small
    difference of large numbers (from the same fp32 U and db, its dβ is 5e-4 off float64; ours 1e-7)."""
    t = make_inputs((1, 45, 2, 8, 12), seed=7, with_beta=True, gamma=[1.0, 0.5], cubit_like=False)
    t["beta"] = t["beta"] * 1e-3
    names = ("x", "y", "b", "beta")
    ours = {n: t[n].float().requires_grad_() for n in names}
    ref = {n: t[n].clone().requires_grad_() for n in names}
    args = dict(scale=8 ** -0.5, strict=True, doc_start=None)
    u = triton_kernel_solve(*(bhtd(ours[n]) for n in ("x", "y", "b")), beta=bhtd(ours["beta"]),
                            gamma=t["gamma"].float(), chunk_size=16, **args)
    expected = dense_solve(*(bhtd(ref[n]) for n in ("x", "y", "b")), bhtd(ref["beta"]), t["gamma"], **args)
    grad_u = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grad_b, grad_beta = torch.autograd.grad(u, [ours["b"], ours["beta"]], grad_u.float())
    want = torch.autograd.grad(expected, [ref["beta"]], grad_u)[0]
    assert rel_rmse(grad_beta, want) <= 1e-5
    quotient = (bhtd(ours["b"].detach()) - t["gamma"].float()[None, :, None, None] * u.detach())
    quotient = quotient / bhtd(ours["beta"].detach())[..., None]
    assert rel_rmse(-(bhtd(grad_b) * quotient).sum(-1).transpose(1, 2), want) > 1e-4  # the control


def test_deltaformer_keeps_k_u_only_where_a_gradient_needs_it(monkeypatch):
    """K U (for e) is stored by DeltaFormer's forward only when a gradient of x, y or β will be asked
    for: not under no_grad, not when b alone needs one (whose db is then the full backward's)."""
    stored: list = []
    kernel = _triton_solve.solve_forward_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stored.append(kwargs["STORE_MIX"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(_triton_solve, "solve_forward_kernel", Recorder())
    t = make_inputs((1, 20, 1, 8, 8), seed=2, with_beta=True, gamma=[0.5], cubit_like=False)

    def solve(needs):
        leaves = {n: bhtd(t[n].float()).requires_grad_(n in needs) for n in ("x", "y", "b")}
        beta = bhtd(t["beta"].float()).requires_grad_("beta" in needs)
        stored.clear()
        u = triton_kernel_solve(**leaves, beta=beta, gamma=t["gamma"].float(), scale=0.3, strict=True,
                                chunk_size=16, doc_start=None)
        return u, leaves, all(stored), any(stored)

    with torch.no_grad():
        assert solve({"x", "y", "b", "beta"})[2:] == (False, False)
    u, leaves, _, kept = solve({"b"})
    assert not kept
    grad_u = torch.ones_like(u)
    (alone,) = torch.autograd.grad(u, [leaves["b"]], grad_u)
    for needs in ({"x"}, {"y"}, {"beta"}, {"x", "y", "b", "beta"}):
        u, leaves, kept_all, _ = solve(needs)
        assert kept_all, needs
    assert torch.equal(alone, torch.autograd.grad(u, [leaves["b"]], grad_u)[0])


@pytest.mark.parametrize("strict", [False, True])
def test_single_token(strict):
    """T = 1: u = b / (β K_00 + γ), K_00 = 1 (inclusive) or 0 (strict: the row is empty)."""
    check_against_reference(1, 16, strict=strict, with_beta=True, gamma=[0.5, 2.0], cuts=None)


def test_empty_sequence():
    x = torch.zeros(2, 3, 0, 8, requires_grad=True)
    b = torch.zeros(2, 3, 0, 5, requires_grad=True)
    u = triton_kernel_solve(x, x, b, beta=None, gamma=torch.ones(3), scale=1.0, strict=False, chunk_size=16,
                            doc_start=None)
    assert u.shape == (2, 3, 0, 5)
    u.sum().backward()
    assert x.grad.shape == x.shape and b.grad.shape == b.shape


def test_row_block_sizes():
    assert [row_block_size(c) for c in (1, 16, 17, 24, 64, 100, 512)] == [16, 16, 32, 32, 64, 64, 64]


def test_strides_too_large_for_in_block_offsets_are_copied_first(monkeypatch):
    """The kernels offset a tile's rows and columns inside a block in 32 bits: a tensor whose largest
    offset inside a block (its last row of MAX_BLOCK, the head's last column) reaches 2³¹ is made
    contiguous before the launch, with the same result. (MAX_BLOCK is raised here, so that small tensors
    reach the limit: b's rows are 160 apart, x's 8.)"""
    generator = torch.Generator().manual_seed(3)
    x, y = (torch.randn(1, 2, 20, 8, generator=generator) for _ in range(2))
    b = torch.randn(1, 2, 20, 160, generator=generator)[..., ::20]  # [B, H, T, dv], strides 160 and 20
    kw = dict(beta=None, gamma=torch.tensor([0.5, 0.7]), scale=0.3, strict=False, chunk_size=16, doc_start=None)
    expected = triton_kernel_solve(x, y, b, **kw)
    monkeypatch.setattr(_triton_solve, "MAX_BLOCK", 2**31 // 160 + 1)  # 160 (MAX_BLOCK − 1) ≥ 2³¹ > 8 MAX_BLOCK
    assert _triton_solve._small_strides(x) is x and _triton_solve._small_strides(b).is_contiguous()
    assert torch.equal(triton_kernel_solve(x, y, b, **kw), expected)


def test_rejects_bad_inputs_and_cpu_without_interpreter(monkeypatch):
    x = torch.randn(1, 1, 4, 8)
    b = torch.randn(1, 1, 4, 5)
    common = dict(beta=None, gamma=torch.ones(1), scale=1.0, strict=False, chunk_size=16, doc_start=None)
    with pytest.raises(KernelmixError, match="float32"):
        triton_kernel_solve(x.double(), x.double(), b, **common)
    with pytest.raises(KernelmixError, match="float32"):
        triton_kernel_solve(x, x, b.bfloat16(), **common)
    with pytest.raises(KernelmixError, match="one device"):
        triton_kernel_solve(x, x, b.to("meta"), **common)
    with pytest.raises(KernelmixError, match="integer"):
        triton_kernel_solve(x, x, b, **(common | {"doc_start": torch.zeros(1, 4)}))
    with monkeypatch.context() as patch:  # operands the kernels were not measured with: named, with the choices
        patch.setattr(_triton_solve, "SPAN_OPERANDS", "tf32x3")
        with pytest.raises(KernelmixError, match="'tf32x3'.*tf32, bf16, fp32.*solve_operands"):
            triton_kernel_solve(x, x, b, **common)
    monkeypatch.setattr(_triton_solve, "interpreter_enabled", lambda: False)
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        triton_kernel_solve(x, x, b, **common)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the kernels compiled for the GPU")
@pytest.mark.parametrize(
    "strict, with_beta, gamma, cuts, cubit_like",
    [
        (False, False, [0.1, 1.0, 0.5, 0.2], [[0, 300, 301], [0, 64, 500]], False),
        (True, True, [1.0, 1.0, 1.0, 1.0], [[0, 100], [0, 640]], False),
        (False, False, [1e-6, 1e-6, 1e-6, 1e-6], None, True),
    ],
)
@pytest.mark.parametrize("operands", ["fp32", "tf32", "bf16"])
def test_on_cuda(monkeypatch, strict, with_beta, gamma, cuts, cubit_like, operands):
    """The compiled kernels at a GPU-sized head (d = 64, blocks of 64, T = 777) vs the float64 reference:
    in one span (fp32 operands), and in spans of 256 with tensor-core operands (the span kernels, the
    pushes, dx from the row kernel and dy from two-block column programs) within their bounds."""
    if operands != "fp32":
        monkeypatch.setattr(_triton_solve, "SPAN_ROWS", 256)
        monkeypatch.setattr(_triton_solve, "SPAN_OPERANDS", operands)
    check_against_reference(777, 64, strict=strict, with_beta=with_beta, gamma=gamma, cuts=cuts, dims=(64, 64),
                            cubit_like=cubit_like, device="cuda", tolerance=TENSOR_CORE_BOUNDS[operands])


def test_forward_span_kernels_take_the_blocks_that_compile_without_spills():
    """The forward's span kernel and pushes (ptxas, sm_90, 8 warps, no spill): 128 value columns streamed
    32 columns at a time with either tensor-core operands at keys up to 128 wide, and with bf16 ones at
    256; with TF32 ones at 256, 64 value columns streamed 16 at a time; fp32 operands (one span), 64. With
    bf16 operands at keys up to 128 wide the across-span kernel (not its pushes) holds 256 rows, streaming
    the columns 16 at a time, in two column halves (236-239 registers at d = 128; TF32 spilled 944 B)."""
    def blocks(d, operands, length=8192, name="solve_span_push"):
        launches = {x.name: x for x in solve_launches(1, 8, length, d, d, chunk_size=64, strict=False,
                                                                    has_beta=False, has_doc=True, operands=operands)}
        flags = launches[name].constexprs
        return flags["BLOCK_V"], flags["STREAM_T"], flags["BLOCK_R"], flags["SPLITS"]

    assert blocks(128, "tf32") == blocks(128, "bf16") == blocks(256, "bf16") == (128, 32, 128, 1)
    assert blocks(128, "tf32", name="solve_past_span") == blocks(256, "bf16", name="solve_past_span") == (
        128, 32, 128, 1)
    assert blocks(128, "bf16", name="solve_past_span") == (128, 16, 256, 2)
    assert blocks(64, "bf16", name="solve_past_span") == (64, 16, 256, 2)
    assert blocks(64, "tf32") == (64, 32, 128, 1)
    assert blocks(256, "tf32") == blocks(256, "tf32", name="solve_past_span") == (64, 16, 128, 1)
    assert blocks(128, "tf32", length=1000) == (64, 32, 128, 1)  # one span: fp32 operands, its pushes only


AOT_SCRIPT = textwrap.dedent("""
    import dataclasses
    import sys
    import triton
    from kernelmix.ops import _triton_solve as solve
    from kernelmix.ops._triton_solve_plan import solve_launches
    try:
        from triton.backends.compiler import GPUTarget
        source = triton.compiler.ASTSource
    except (ImportError, AttributeError) as error:
        sys.exit(f"SKIP: this Triton has no ahead-of-time compile API ({error})")
    solve.SPAN_ROWS = 32  # several spans of two sub-spans: every kernel of the chunk-parallel solve is launched
    solve.SUBSPAN_ROWS = 16
    # the launches the op makes (the same blocks, flags and warps; kernelmix gpu-check --plan compiles these)
    launches = solve_launches(1, 2, 100, 16, 16, chunk_size=16, strict=True, has_beta=True, has_doc=True)
    cubit = solve_launches(1, 2, 100, 16, 16, chunk_size=16, strict=False, has_beta=False, has_doc=True)
    # and with bf16 operands: the readers of the bf16 copies on bf16 pointers, the sequential kernels storing them
    bf16 = solve_launches(1, 2, 100, 16, 16, chunk_size=16, strict=True, has_beta=True, has_doc=True,
                                operands="bf16")
    assert all(x.constexprs.get("OPERANDS", "bf16") == "bf16" for x in bf16)
    # and its column kernel without dx (x needs no gradient): the transposed tiles without the atomics
    column = next(x for x in bf16 if x.name == "solve_grad_columns")
    assert column.constexprs["COLUMN_MAJOR"] and column.constexprs["ROW_GRAD"]
    bf16.append(dataclasses.replace(column, constexprs=dict(column.constexprs, ROW_GRAD=False)))
    # the column kernel adding dx by atomics: TF32 operands at a 128-wide head, where the row kernel spilled
    wide = [x for x in solve_launches(1, 2, 100, 128, 128, chunk_size=16, strict=False, has_beta=False,
                                            has_doc=True) if x.name == "solve_grad_columns"]
    assert [x.constexprs["ROW_GRAD"] for x in wide] == [True] and "solve_grad_rows" in {x.name for x in launches}
    gradients = [x for x in cubit if x.name in ("solve_grad_rows", "solve_grad_columns")]  # without β
    for launch in launches + gradients + wide + bf16:
        compiled = triton.compile(source(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": launch.num_warps})
        assert compiled.asm["cubin"], launch.name
        print(launch.name, "compiled")
""")



def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs code that the GPU compiler rejects (a global that is not a constexpr, a
    type that changes in a loop): compile the nine launches (seven kernels, two of them also as pushes),
    Cubit's gradient kernels (without β), the column kernel adding dx by atomics (TF32 at a 128-wide
    head) and the nine again with bf16 operands but the row kernel, plus the merge of the across-span
    kernel's column halves (bf16 tiles into bf16 products, the
    copies stored, the column kernel's transposed tiles adding dx by atomics, and without dx), for
    sm_90 down to a cubin (Triton ships ptxas), in a process without TRITON_INTERPRET, so that a GPU's
    first run does not fail on it."""
    compile_ahead_of_time(AOT_SCRIPT, tmp_path, kernels=22)
