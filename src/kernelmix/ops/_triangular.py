"""Solve of a causal kernel-smoother system, shared by Cubit and DeltaFormer, and the choice of
its implementation: the blocked solve (``_solve_blocked``: any device) or, on CPU, the same solve
with its off-diagonal work in PyTorch's fused attention kernel (``_solve_rectangles``: faster;
``solver="auto"`` takes it wherever it applies).

Both mixers solve a lower-triangular system

    A U = b,   A = diag(β) K + γ I,   K_ij = softmax_{j ≤ i (or j < i)} (scale · x_i · y_j)

Cubit: x = r, y = r̂, scale = 1, β = 1, γ = λ_h, inclusive mask (docs/math.md §3).
With ``doc_start`` (packed documents, left padding) K_ij is also 0 across documents: the system is
block-diagonal, one independent solve per document.
DeltaFormer: x = w, y = k, scale = 1/√d, β = β_i, γ = 1, strict mask (docs/math.md §4).

The dense references build K (T×T) and call ``solve_triangular``. Neither implementation holds K
(the blocked solve keeps at most a C×T block of it for a few heads, the rectangles one fused
call's piece), and both compute the gradients of every input in a custom backward.

``backend`` (``_backend``) chooses between these PyTorch implementations and the Triton kernels
of ``_triton_solve`` (CUDA; CPU under the Triton interpreter), which take y and the scaled
right-hand side materialised (O(T·d) each) and return the same U.
"""

from __future__ import annotations

from torch import Tensor

from ..errors import KernelmixError
from ._backend import resolve_backend
from ._common import autocast_off
from ._solve_blocked import blocked_solve
from ._solve_rectangles import rectangle_solve, rectangles_applicable

# "auto": the rectangles where they apply (CPU, dk == dv), else the blocked solve; the others force
# one implementation (the tests run both).
SOLVERS = ("auto", "blocked", "rectangles")


def check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise KernelmixError(f"unknown solver {solver!r} (choose from: {', '.join(SOLVERS)})")


def kernel_triangular_solve(
    x: Tensor,
    y: Tensor | None,
    b: Tensor,
    *,
    beta: Tensor | None,
    gamma: Tensor,
    scale: float,
    strict: bool,
    chunk_size: int,
    doc_start: Tensor | None = None,
    diagonal_is_row_max: bool = False,
    y_scale: Tensor | None = None,
    b_scale: Tensor | None = None,
    solver: str = "auto",
    backend: str = "auto",
) -> Tensor:
    """Solve (diag(β) K + γ I) U = b ⊙ b_scale blockwise; tensors are ``[B, H, T, *]`` in the
    compute dtype (any strides: the callers pass transposed ``[B, T, H, *]`` tensors).

    ``y=None`` means y = x ⊙ y_scale (per row; y = x without ``y_scale``): the solve then never
    materialises y beyond one head group, and dx and dy share one buffer in the backward pass
    (Cubit: r̂ = r · s/‖r‖; DeltaFormer's K–K form: y = x = k). ``b_scale`` ``[B, H, T]`` scales the
    right-hand side per row (Cubit's ρ) without a full-size ρ ⊙ v. ``diagonal_is_row_max`` promises
    x_i·y_i ≥ x_i·y_j for every visible j (Cubit, by Cauchy–Schwarz), which saves a pass.
    ``chunk_size`` is the blocked solve's row block; the CPU rectangle solve uses diagonal blocks
    of max(chunk_size, ``RECT_MIN_LEAF``) rows (smaller ones only add small, slow calls).
    ``solver``: "auto" (the rectangles on CPU where dk == dv, else the blocked solve), "blocked" or
    "rectangles" (a RuntimeError where it cannot run); anything else is a KernelmixError (a ValueError).
    ``backend`` (see ``_backend``): "auto" (Triton on CUDA where it imports), "torch" (``solver``
    picks which) or "triton" (then ``solver`` must stay "auto").
    Returns U as a ``[B, H, T, dv]`` tensor (a view of a ``[B, T, H, dv]`` one on the torch paths)."""
    check_solver(solver)
    if y is not None and y_scale is not None:
        raise KernelmixError("y_scale applies only when y is None (y = x ⊙ y_scale)")
    if resolve_backend(backend, x.device, x.dtype) == "triton":
        if solver != "auto":
            raise KernelmixError(
                f"solver={solver!r} picks one of the PyTorch solves; with backend='triton' leave solver='auto' "
                "(or use backend='torch' to choose the PyTorch solve)"
            )
        with autocast_off(x):
            return _triton_solve(x, y, b, beta=beta, gamma=gamma, y_scale=y_scale, b_scale=b_scale, scale=scale,
                                 strict=strict, chunk_size=chunk_size, doc_start=doc_start)
    common = dict(beta=beta, gamma=gamma, y_scale=y_scale, b_scale=b_scale, doc_start=doc_start, scale=scale,
                  strict=strict, chunk_size=chunk_size)
    with autocast_off(x):  # bf16 autocast must not reach the solve
        if solver == "rectangles" or (solver == "auto" and rectangles_applicable(x, b)):
            return rectangle_solve(x, y, b, **common)
        return blocked_solve(x, y, b, diagonal_is_row_max=diagonal_is_row_max, **common)


def _triton_solve(x, y, b, *, beta, gamma, y_scale, b_scale, scale, strict, chunk_size, doc_start) -> Tensor:
    """The Triton kernels' solve, with y = x ⊙ y_scale and b ⊙ b_scale formed first (autograd
    carries their gradients back to x, y_scale, b and b_scale)."""
    from ._triton_solve import triton_kernel_solve  # imports triton: only when it is asked for

    if y is None:
        y = x if y_scale is None else x * y_scale[..., None]
    if b_scale is not None:
        b = b * b_scale[..., None]
    return triton_kernel_solve(
        x, y, b, beta=beta, gamma=gamma, scale=float(scale), strict=bool(strict), chunk_size=int(chunk_size),
        doc_start=doc_start,
    )
