"""The Triton kernels of the causal kernel-smoother solve (``_triton_solve``), run under Triton's CPU
interpreter, against a dense float64 reference written here (K built with its masks, A, and
``solve_triangular``; gradients by autograd through it): U and the gradients of x, y, b, β and γ,
at odd lengths (1, 37, 130), row blocks that do not divide T (chunk 24 → block 32; T = 37 with 16),
the inclusive (Cubit) and strict (DeltaFormer) masks, β absent and given, packed documents laid out
differently per batch element, dk ≠ dv, a well-conditioned γ and Cubit's tiny ridge (γ = 1e-6,
y = x·s/‖x‖, where the diagonal is the row maximum). Inputs are transposed views of [B, T, H, d]
tensors, as the callers pass them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py also sets it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.ops import _triton_solve  # noqa: E402
from kernelmix.ops._triton_solve import row_block_size, triton_kernel_solve  # noqa: E402
from tests.utils import rel_rmse  # noqa: E402

F64 = torch.float64
B, H, DK, DV = 2, 2, 8, 12
TOL = 1e-4


def dense_solve(x, y, b, beta, gamma, *, scale, strict, doc_start):
    """(diag(β) K + γ I)⁻¹ b with K the full T×T masked softmax, in the inputs' dtype."""
    batch, heads, length, _ = x.shape
    i = torch.arange(length)
    visible = (i[None, :] < i[:, None]) if strict else (i[None, :] <= i[:, None])
    visible = visible.expand(batch, 1, length, length)
    if doc_start is not None:
        visible = visible & (i[None, None, None, :] >= doc_start[:, None, :, None])
    logits = (scale * x @ y.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    kernel = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing visible is 0
    rows = torch.ones(batch, heads, length, dtype=x.dtype) if beta is None else beta
    system = rows[..., None] * kernel + gamma[None, :, None, None] * torch.eye(length, dtype=x.dtype)
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


def make_inputs(length: int, *, seed: int, with_beta: bool, gamma, cubit_like: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, length, H, DK, generator=g, dtype=F64)
    if cubit_like:  # Cubit's column side: y = x · s / ‖x‖, so x_i·y_i is every row's maximum
        y = x * (torch.tensor([1.0, 2.5], dtype=F64)[:, None] / x.norm(dim=-1, keepdim=True))
    else:
        y = torch.randn(B, length, H, DK, generator=g, dtype=F64)
    b = torch.randn(B, length, H, DV, generator=g, dtype=F64)
    beta = torch.rand(B, length, H, generator=g, dtype=F64) * 0.9 + 0.05 if with_beta else None
    return {"x": x, "y": y, "b": b, "beta": beta, "gamma": torch.tensor(gamma, dtype=F64)}


def check_against_reference(length, chunk_size, *, strict, with_beta, gamma, cuts, cubit_like=False, seed=0):
    t = make_inputs(length, seed=seed, with_beta=with_beta, gamma=gamma, cubit_like=cubit_like)
    doc_start = None if cuts is None else doc_starts(length, cuts)
    scale = 1.0 if cubit_like else DK**-0.5
    names = [n for n in ("x", "y", "b", "beta", "gamma") if t[n] is not None]
    ours = {n: t[n].float().requires_grad_() for n in names}
    ref = {n: t[n].clone().requires_grad_() for n in names}

    def args(d):
        three = {n: bhtd(d[n]) for n in ("x", "y", "b")}
        beta = None if t["beta"] is None else bhtd(d["beta"])
        return dict(**three, beta=beta, gamma=d["gamma"], scale=scale, strict=strict, doc_start=doc_start)

    u = triton_kernel_solve(**args(ours), chunk_size=chunk_size)
    expected = dense_solve(**args(ref))
    assert u.shape == (B, H, length, DV) and u.dtype == torch.float32
    assert rel_rmse(u, expected) <= TOL, rel_rmse(u, expected)
    grad_u = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    got = torch.autograd.grad(u, [ours[n] for n in names], grad_u.float())
    want = torch.autograd.grad(expected, [ref[n] for n in names], grad_u)
    errors = {n: rel_rmse(a, e) for n, a, e in zip(names, got, want)}
    assert all(e <= TOL for e in errors.values()), errors
    return errors


@pytest.mark.parametrize(
    "length, chunk_size, strict, with_beta, gamma, cuts",
    [
        # Cubit-shaped (inclusive, β = 1), block 32 not dividing 130, 3 / 2 documents per element
        (130, 24, False, False, [0.1, 1.0], [[0, 40, 97], [0, 64]]),
        # DeltaFormer-shaped (strict, β given, γ = 1), block 16 not dividing 37, boundaries mid-block
        (37, 16, True, True, [1.0, 1.0], [[0, 5, 21], [0, 16, 30]]),
        (130, 16, True, True, [0.3, 1.0], None),
        (37, 16, False, True, [0.5, 0.2], None),
    ],
)
def test_matches_dense_reference(length, chunk_size, strict, with_beta, gamma, cuts):
    check_against_reference(length, chunk_size, strict=strict, with_beta=with_beta, gamma=gamma, cuts=cuts)


def test_cubit_tiny_ridge():
    """γ = 1e-6 with the inclusive mask: A ≈ K, whose diagonal K_ii ≥ 1/n_i is the row maximum."""
    check_against_reference(37, 16, strict=False, with_beta=False, gamma=[1e-6, 1e-6], cuts=[[0, 20], [0]],
                            cubit_like=True)


@pytest.mark.parametrize("strict", [False, True])
def test_single_token(strict):
    """T = 1: u = b / (β K_00 + γ), K_00 = 1 (inclusive) or 0 (strict: the row is empty)."""
    check_against_reference(1, 16, strict=strict, with_beta=True, gamma=[0.5, 2.0], cuts=None)


def test_empty_sequence():
    x = torch.zeros(B, H, 0, DK, requires_grad=True)
    b = torch.zeros(B, H, 0, DV, requires_grad=True)
    u = triton_kernel_solve(x, x, b, beta=None, gamma=torch.ones(H), scale=1.0, strict=False, chunk_size=16,
                            doc_start=None)
    assert u.shape == (B, H, 0, DV)
    u.sum().backward()
    assert x.grad.shape == x.shape and b.grad.shape == b.shape


def test_row_block_sizes():
    assert [row_block_size(c) for c in (1, 16, 17, 24, 64, 100, 512)] == [16, 16, 32, 32, 64, 64, 64]


def test_rejects_other_dtypes_and_cpu_without_interpreter(monkeypatch):
    x = torch.randn(1, 1, 4, DK)
    b = torch.randn(1, 1, 4, DV)
    common = dict(beta=None, gamma=torch.ones(1), scale=1.0, strict=False, chunk_size=16, doc_start=None)
    with pytest.raises(KernelmixError, match="float32"):
        triton_kernel_solve(x.double(), x.double(), b, **common)
    with pytest.raises(KernelmixError, match="float32"):
        triton_kernel_solve(x, x, b.bfloat16(), **common)
    monkeypatch.setattr(_triton_solve, "interpreter_enabled", lambda: False)
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        triton_kernel_solve(x, x, b, **common)
