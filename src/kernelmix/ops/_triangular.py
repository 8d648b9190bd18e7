"""Blocked solve of a causal kernel-smoother system, shared by Cubit and DeltaFormer.

Both mixers solve a lower-triangular system

    A U = b,   A = diag(β) K + γ I,   K_ij = softmax_{j ≤ i (or j < i)} (scale · x_i · y_j)

Cubit: x = r, y = r̂, scale = 1, β = 1, γ = λ_h, inclusive mask (SPEC §2).
With ``doc_start`` (packed documents, left padding) K_ij is also 0 across documents: the system is
block-diagonal, one independent solve per document.
DeltaFormer: x = w, y = k, scale = 1/√d, β = β_i, γ = 1, strict mask (SPEC §3).

The dense reference builds K (T×T) and calls ``solve_triangular``. This module never holds more
than a C×T (or T×C) block of K: the forward pass is forward substitution over row blocks of C
tokens, and the backward pass is the transposed (backward) substitution over column blocks, with
K recomputed from the saved row log-normalisers. Memory is O(T·C + T·d) in both directions.

Backward, with db = A^{-T} dU, Y = K U and e_i = db_i · Y_i:
    dγ = -Σ_i db_i·u_i,   dβ_i = -e_i,
    dL_ij = β_i K_ij (e_i - db_i·u_j)        (softmax backward; Σ_j K_ij dK_ij = -β_i e_i)
    dx_i = scale Σ_j dL_ij y_j,   dy_j = scale Σ_i dL_ij x_i.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import masked_logsumexp, visible




class _KernelTriangularSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, doc_start, scale, strict, chunk_size):
        # x, y: [B, H, T, dk]; b: [B, H, T, dv]; beta: [B, H, T] or None; gamma: [H];
        # doc_start: [B, T] (first token of each token's document) or None (one document)
        batch, heads, length, _ = x.shape
        device = x.device
        gamma_diag = gamma.view(1, heads, 1, 1)
        u = torch.empty_like(b)
        ku = torch.empty_like(b)  # Y = K U, needed by the backward pass
        lse = x.new_empty(batch, heads, length)
        positions = torch.arange(length, device=device)
        for i0 in range(0, length, chunk_size):
            i1 = min(i0 + chunk_size, length)
            logits = scale * (x[:, :, i0:i1] @ y[:, :, :i1].transpose(-1, -2))  # [B, H, C, i1]
            rows_doc = None if doc_start is None else doc_start[:, i0:i1]
            logits = logits.masked_fill(~visible(positions[i0:i1], positions[:i1], rows_doc, strict=strict), float("-inf"))
            row_lse = masked_logsumexp(logits)
            kernel = torch.exp(logits - row_lse[..., None])
            lse[:, :, i0:i1] = row_lse
            diag_block = kernel[..., i0:i1]
            if i0 > 0:
                past = kernel[..., :i0] @ u[:, :, :i0]
            else:
                past = torch.zeros_like(b[:, :, i0:i1])
            beta_c = None if beta is None else beta[:, :, i0:i1, None]
            rhs = b[:, :, i0:i1] - (past if beta_c is None else beta_c * past)
            scaled_block = diag_block if beta_c is None else beta_c * diag_block
            eye = torch.eye(i1 - i0, dtype=x.dtype, device=device)
            system = scaled_block + gamma_diag * eye
            u_c = torch.linalg.solve_triangular(system, rhs, upper=False)
            u[:, :, i0:i1] = u_c
            ku[:, :, i0:i1] = past + diag_block @ u_c
        ctx.save_for_backward(x, y, beta, gamma, u, ku, lse, doc_start)
        ctx.scale, ctx.strict, ctx.chunk_size = scale, strict, chunk_size
        return u

    @staticmethod
    @once_differentiable  # a gradient of this gradient is not implemented: say so clearly
    def backward(ctx, grad_u):
        with torch.autocast(grad_u.device.type, enabled=False):  # the transposed solve stays in fp32+
            return _KernelTriangularSolve._backward(ctx, grad_u)

    @staticmethod
    def _backward(ctx, grad_u):
        x, y, beta, gamma, u, ku, lse, doc_start = ctx.saved_tensors
        scale, strict, chunk_size = ctx.scale, ctx.strict, ctx.chunk_size
        batch, heads, length, _ = x.shape
        device = x.device
        grad_u = grad_u.to(u.dtype)
        gamma_diag = gamma.view(1, heads, 1, 1)
        grad_b = torch.empty_like(u)
        grad_x = torch.zeros_like(x)
        grad_y = torch.empty_like(y)
        grad_gamma = x.new_zeros(batch, heads)
        e = x.new_empty(batch, heads, length)  # e_i = db_i · (K U)_i
        positions = torch.arange(length, device=device)
        last = ((length - 1) // chunk_size) * chunk_size
        for i0 in range(last, -1, -chunk_size):
            i1 = min(i0 + chunk_size, length)
            c = i1 - i0
            # Column block j ∈ [i0, i1) of K for every row i ≥ i0 (rows above it are masked anyway).
            logits = scale * (x[:, :, i0:] @ y[:, :, i0:i1].transpose(-1, -2))  # [B, H, T - i0, C]
            rows_doc = None if doc_start is None else doc_start[:, i0:]
            logits = logits.masked_fill(~visible(positions[i0:], positions[i0:i1], rows_doc, strict=strict), float("-inf"))
            kernel = torch.exp(logits - lse[:, :, i0:, None])
            scaled = kernel if beta is None else beta[:, :, i0:, None] * kernel
            rhs = grad_u[:, :, i0:i1]
            if i1 < length:
                rhs = rhs - scaled[:, :, c:].transpose(-1, -2) @ grad_b[:, :, i1:]
            eye = torch.eye(c, dtype=x.dtype, device=device)
            system = scaled[:, :, :c] + gamma_diag * eye
            db_c = torch.linalg.solve_triangular(system.transpose(-1, -2), rhs, upper=True)
            grad_b[:, :, i0:i1] = db_c
            u_c = u[:, :, i0:i1]
            grad_gamma -= (db_c * u_c).sum(dim=(-1, -2))
            e[:, :, i0:i1] = (db_c * ku[:, :, i0:i1]).sum(-1)
            grad_logits = scaled * (e[:, :, i0:, None] - grad_b[:, :, i0:] @ u_c.transpose(-1, -2))
            grad_x[:, :, i0:] += scale * (grad_logits @ y[:, :, i0:i1])
            grad_y[:, :, i0:i1] = scale * (grad_logits.transpose(-1, -2) @ x[:, :, i0:])
        grad_beta = -e if beta is not None and ctx.needs_input_grad[3] else None
        grad_gamma = grad_gamma.sum(0) if ctx.needs_input_grad[4] else None
        return grad_x, grad_y, grad_b, grad_beta, grad_gamma, None, None, None, None


def kernel_triangular_solve(
    x: Tensor,
    y: Tensor,
    b: Tensor,
    *,
    beta: Tensor | None,
    gamma: Tensor,
    scale: float,
    strict: bool,
    chunk_size: int,
    doc_start: Tensor | None = None,
) -> Tensor:
    """Solve (diag(β) K + γ I) U = b blockwise; tensors are ``[B, H, T, *]`` in the compute dtype."""
    with torch.autocast(x.device.type, enabled=False):  # bf16 autocast must not reach the solve
        return _KernelTriangularSolve.apply(
            x.contiguous(), y.contiguous(), b.contiguous(), beta, gamma, doc_start, float(scale), bool(strict),
            int(chunk_size),
        )
