"""The blocked solve of the causal kernel-smoother system (see ``_triangular`` for the system):
any device, forward substitution over row blocks of C tokens with a custom backward.

This module never holds more than a C×T block of K for a few heads at a time (``TILE_ELEMENTS``
bounds a block; heads are processed in groups so that memory stays bounded as T grows). Memory is
O(T·C + T·d) per group.

Forward: forward substitution over row blocks of C tokens. A row block's logits come from one
matrix product; the stabiliser is folded into that product as an extra column (x_i ↦ [x_i, −m_i],
y_j ↦ [y_j, 1]), so the tile sees one elementwise pass, an in-place ``exp2``. The row sums come from
the same product that mixes the past values (U ↦ [U, 1]), so the tile is never normalised either:
only the C×C diagonal block and the C×d results are. For Cubit the row maximum is known before the
product — the diagonal logit r_i·r̂_i = s‖r_i‖ bounds every r_i·r̂_j (Cauchy–Schwarz) — otherwise
(DeltaFormer) a max pass runs first. The row log-normalisers (base 2) are saved.

Backward: with db = A^{-T} dU, Y = K U and e_i = db_i · Y_i (Y is not stored: e_i = Σ_j K_ij db_i·u_j
comes from the tile that also gives dL):
    dγ = -Σ_i db_i·u_i,   dβ_i = -e_i,
    dL_ij = β_i K_ij (e_i - db_i·u_j)        (softmax backward; Σ_j K_ij dK_ij = -β_i e_i)
    dx_i = scale Σ_j dL_ij y_j,   dy_j = scale Σ_i dL_ij x_i.
It runs over row blocks from the last: row block I recomputes its normalised kernel rows in one
product (the saved log-normaliser is the extra column) and one ``exp2``; its db_I is final once
every later row block has subtracted its contribution A[I', I]ᵀ db_I' from the right-hand side,
and it then subtracts its own from the earlier rows (one product), so db, dx (complete per row
block) and dy (accumulated) come out of the same pass. S = db uᵀ is one product; K ⊙ S, its row
sums e and K ⊙ S − e K (= dL up to a per-row factor) three elementwise passes.
Five T×C×d products per row block (logits, Aᵀdb, db uᵀ, dL y, dLᵀ x) and four elementwise passes.

Memory (fwd+bwd peak at T=8192, H=8, d=64, C=128, fp32, RSS high-water mark): the forward keeps
only U and the log-normalisers besides its inputs. y may be given as x ⊙ y_scale (Cubit's
r̂ = r·s/‖r‖) or as x itself (DeltaFormer's K–K form): it then exists one head group at a time,
and dy, whose rows ≥ i0 are final once row block i0 is done, turns into dx in place (one [T, H, d]
gradient buffer instead of two). The right-hand side may carry a per-row scale (Cubit's ρ), so
ρ ⊙ V is never materialised either.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import autocast_off, causal_hidden, solve_backward_buffers

# A kernel block holds at most about this many elements (×4 bytes in float32): heads are processed
# in groups of ⌊TILE_ELEMENTS / (C·T)⌋ (at least one). 2**20 elements = 4 MiB in float32.
TILE_ELEMENTS = 2**20
LOG2E = 1.0 / math.log(2.0)


def _head_groups(heads: int, rows: int, length: int) -> list[tuple[int, int]]:
    size = max(1, min(heads, TILE_ELEMENTS // max(1, rows * length)))
    return [(h0, min(h0 + size, heads)) for h0 in range(0, heads, size)]


class _Blocks:
    """Row blocks [i0, i1) of one batch element, with the first visible column ``lo`` of the block
    (the earliest document start among its rows; 0 without documents) and the boolean mask of
    columns [lo, i1) hidden from each row by its document (None where no row needs one)."""

    def __init__(self, length: int, chunk_size: int, doc_start: Tensor | None, device):
        self.blocks: list[tuple[int, int, int, Tensor | None]] = []
        starts = None if doc_start is None else doc_start.tolist()
        for i0 in range(0, length, chunk_size):
            i1 = min(i0 + chunk_size, length)
            if starts is None:
                self.blocks.append((i0, i1, 0, None))
                continue
            lo, hi = min(starts[i0:i1]), max(starts[i0:i1])
            hidden = None
            if hi > lo:
                cols = torch.arange(lo, i1, device=device)
                hidden = cols[None, :] < doc_start[i0:i1, None]
            self.blocks.append((i0, i1, lo, hidden))


def _kernel_block(xa: Tensor, ya: Tensor, i0: int, i1: int, lo: int, hidden_doc, hidden_diag) -> Tensor:
    """Base-2 logits (minus the stabiliser carried in the last column of ``xa``) of rows [i0, i1)
    against columns [lo, i1), with hidden entries at −inf: ``[g, C, i1 − lo]``, a fresh tensor."""
    logits = xa[:, i0:i1] @ ya[:, lo:i1].transpose(-1, -2)
    logits[..., i0 - lo:].masked_fill_(hidden_diag[: i1 - i0, : i1 - i0], float("-inf"))
    if hidden_doc is not None:
        logits.masked_fill_(hidden_doc, float("-inf"))
    return logits


def _with_column(x: Tensor, column: Tensor | float, factor: Tensor | float | None = None) -> Tensor:
    """[x · factor, column] along the last dim: ``[g, T, k]`` → ``[g, T, k + 1]`` (contiguous);
    ``factor`` is a float or ``[g, T]`` (one per row), None for 1."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] + 1)
    if factor is None:
        out[..., :-1] = x
    elif isinstance(factor, Tensor):
        torch.mul(x, factor[..., None], out=out[..., :-1])
    else:
        torch.mul(x, factor, out=out[..., :-1])
    out[..., -1] = column
    return out


def _augmented_y(x: Tensor, y: Tensor | None, y_scale: Tensor | None, bi: int, h0: int, h1: int) -> Tensor:
    """[y, 1] of one head group: ``y`` itself, or ``x`` (times ``y_scale`` per row) when y is None."""
    if y is not None:
        return _with_column(y[bi, h0:h1], 1.0)
    return _with_column(x[bi, h0:h1], 1.0, None if y_scale is None else y_scale[bi, h0:h1])


class _BlockedSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, y_scale, b_scale, doc_start, scale, strict, chunk_size, diagonal_is_row_max):
        # x, y: [B, H, T, dk] (y None: y = x ⊙ y_scale, or x); b: [B, H, T, dv] (any strides);
        # beta, y_scale, b_scale: [B, H, T] or None; gamma: [H];
        # doc_start: [B, T] (first token of each token's document) or None (one document)
        batch, heads, length, _ = x.shape
        dk, dv = x.shape[-1], b.shape[-1]
        # outputs laid out [B, T, H, dv] (the callers' layout), seen here as [B, H, T, dv]
        u = b.new_empty(batch, length, heads, dv).transpose(1, 2)
        lse2 = x.new_empty(batch, heads, length)  # base-2 row log-normalisers
        hidden_diag = causal_hidden(min(chunk_size, length), strict, x.device)
        factor = scale * LOG2E
        for bi in range(batch):
            blocks = _Blocks(length, chunk_size, None if doc_start is None else doc_start[bi], x.device)
            for h0, h1 in _head_groups(heads, min(chunk_size, length), length):
                xa = _with_column(x[bi, h0:h1], 0.0, factor)  # [g, T, dk + 1], base-2 logits
                ya = _augmented_y(x, y, y_scale, bi, h0, h1)
                if diagonal_is_row_max:  # Cubit: the diagonal logit is every row's maximum
                    row_max = (xa[..., :dk] * ya[..., :dk]).sum(-1)
                    xa[..., dk] = -row_max
                else:
                    row_max = None
                ua = b.new_empty(h1 - h0, length, dv + 1)  # [U, 1]: one product gives K U and the row sums
                ua[..., dv] = 1.0
                gam = gamma[h0:h1, None]
                for i0, i1, lo, hidden_doc in blocks.blocks:
                    tile = _kernel_block(xa, ya, i0, i1, lo, hidden_doc, hidden_diag)
                    if row_max is None:
                        block_max = tile.amax(dim=-1, keepdim=True)
                        # a row with nothing visible (strict mask, first token) is −inf: keep it 0
                        block_max = block_max.masked_fill_(torch.isinf(block_max), 0.0)
                        tile.sub_(block_max)
                        block_max = block_max[..., 0]
                    else:
                        block_max = row_max[:, i0:i1]
                    tile.exp2_()
                    diag = tile[..., i0 - lo:]
                    row_sum = diag.sum(-1)
                    past = None
                    if i0 > lo:
                        past_aug = tile[..., : i0 - lo] @ ua[:, lo:i0]
                        past, row_sum = past_aug[..., :dv], row_sum + past_aug[..., dv]
                    inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
                    lse2[bi, h0:h1, i0:i1] = torch.where(row_sum > 0, block_max + torch.log2(row_sum), 0.0)
                    kernel_diag = diag * inv[..., None]
                    rhs = b[bi, h0:h1, i0:i1]
                    if b_scale is not None:
                        rhs = rhs * b_scale[bi, h0:h1, i0:i1, None]
                    if past is not None:
                        past = past * inv[..., None]
                        rhs = rhs - (past if beta is None else beta[bi, h0:h1, i0:i1, None] * past)
                    system = kernel_diag if beta is None else beta[bi, h0:h1, i0:i1, None] * kernel_diag
                    system = system + torch.diag_embed(gam.expand(-1, i1 - i0))
                    u_c = torch.linalg.solve_triangular(system, rhs, upper=False)
                    ua[:, i0:i1, :dv] = u_c
                    u[bi, h0:h1, i0:i1] = u_c
        # b is needed only for the gradient of its row scale (ρ); K U is not stored (see _backward)
        keep_b = b if b_scale is not None and ctx.needs_input_grad[6] else None
        ctx.save_for_backward(x, y, keep_b, beta, gamma, y_scale, b_scale, u, lse2, doc_start)
        ctx.scale, ctx.strict, ctx.chunk_size = scale, strict, chunk_size
        return u

    @staticmethod
    @once_differentiable  # a gradient of this gradient is not implemented: say so clearly
    def backward(ctx, grad_u):
        with autocast_off(grad_u):  # the transposed solve stays in fp32+
            return _BlockedSolve._backward(ctx, grad_u)

    @staticmethod
    def _backward(ctx, grad_u):
        x, y, b, beta, gamma, y_scale, b_scale, u, lse2, doc_start = ctx.saved_tensors
        scale, strict, chunk_size = ctx.scale, ctx.strict, ctx.chunk_size
        batch, heads, length, dk = x.shape
        fused = y is None  # y derived from x: one buffer receives dy, then becomes the whole dx
        # grad_b doubles as the right-hand side of the transposed solve: rows ≥ i0 hold db once row
        # block i0 is done, rows < i0 the dU still to be reduced by the later rows' contributions.
        grad_b, grad_gamma, grad_beta, grad_y_scale = solve_backward_buffers(
            ctx.needs_input_grad, x, u, grad_u, beta, y_scale)
        del grad_u
        # dy accumulates over the row blocks from the last; columns ≥ i0 are final once row block i0
        # is done (later rows only reach back), so with y = x ⊙ y_scale the same rows can then turn
        # into dx = dx_direct + y_scale ⊙ dy in place.
        grad_y = x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        grad_x = grad_y if fused else x.new_empty(batch, length, heads, dk).transpose(1, 2)
        grad_b_scale = None if b is None else x.new_empty(batch, heads, length)
        hidden_diag = causal_hidden(min(chunk_size, length), strict, x.device)
        factor = scale * LOG2E
        for bi in range(batch):
            blocks = _Blocks(length, chunk_size, None if doc_start is None else doc_start[bi], x.device)
            for h0, h1 in _head_groups(heads, min(chunk_size, length), length):
                xa = _with_column(x[bi, h0:h1], -lse2[bi, h0:h1], factor)  # exp2 of these logits is K itself
                ya = _augmented_y(x, y, y_scale, bi, h0, h1)
                ys = ya[..., :dk]
                uc = u[bi, h0:h1].contiguous()
                gb, gy = grad_b[bi, h0:h1], grad_y[bi, h0:h1]
                gam = gamma[h0:h1, None]
                for i0, i1, lo, hidden_doc in reversed(blocks.blocks):
                    kernel = _kernel_block(xa, ya, i0, i1, lo, hidden_doc, hidden_diag).exp2_()
                    beta_c = None if beta is None else beta[bi, h0:h1, i0:i1, None]
                    diag = kernel[..., i0 - lo:]
                    system = diag if beta_c is None else beta_c * diag
                    system = system + torch.diag_embed(gam.expand(-1, i1 - i0))
                    db = torch.linalg.solve_triangular(system.transpose(-1, -2), gb[:, i0:i1], upper=True)
                    scaled_db = db if beta_c is None else beta_c * db
                    if i0 > lo:  # A[I, :i0]ᵀ db_I leaves the right-hand side of the earlier rows
                        gb[:, lo:i0].baddbmm_(kernel[..., : i0 - lo].transpose(-1, -2), scaled_db, alpha=-1.0)
                    u_c = uc[:, i0:i1]
                    grad_gamma[h0:h1] -= (db * u_c).sum(dim=(-1, -2))
                    # P = K ⊙ (db uᵀ − e) = −dL / β, with e_i = db_i·(K U)_i = Σ_j K_ij (db_i·u_j)
                    # taken from the same tile (K U itself is not kept from the forward pass)
                    p = torch.bmm(db, uc[:, lo:i1].transpose(-1, -2)).mul_(kernel)
                    e = p.sum(-1)
                    p.addcmul_(kernel, e[..., None], value=-1.0)
                    if grad_beta is not None:
                        grad_beta[bi, h0:h1, i0:i1] = -e
                    row = (-scale) if beta_c is None else -scale * beta_c
                    grad_x_c = (p @ ys[:, lo:i1]) * row
                    # dy_j = scale Σ_i dL_ij x_i
                    gy[:, lo:i1].baddbmm_(p.transpose(-1, -2), x[bi, h0:h1, i0:i1] * row)
                    if fused:  # dy of rows [i0, i1) is final: dx = dx_direct + y_scale ⊙ dy
                        gy_c = gy[:, i0:i1]
                        if y_scale is not None:
                            if grad_y_scale is not None:
                                grad_y_scale[bi, h0:h1, i0:i1] = (gy_c * x[bi, h0:h1, i0:i1]).sum(-1)
                            gy_c.mul_(y_scale[bi, h0:h1, i0:i1, None])
                        gy_c.add_(grad_x_c)
                    else:
                        grad_x[bi, h0:h1, i0:i1] = grad_x_c
                    if b_scale is not None:  # rhs = b ⊙ b_scale: db becomes the gradient of b
                        if grad_b_scale is not None:
                            grad_b_scale[bi, h0:h1, i0:i1] = (db * b[bi, h0:h1, i0:i1]).sum(-1)
                        db = db * b_scale[bi, h0:h1, i0:i1, None]
                    gb[:, i0:i1] = db
        grad_gamma = grad_gamma if ctx.needs_input_grad[4] else None
        return (
            grad_x, None if fused else grad_y, grad_b, grad_beta, grad_gamma, grad_y_scale, grad_b_scale,
            None, None, None, None, None,
        )


def blocked_solve(x, y, b, *, beta, gamma, y_scale, b_scale, doc_start, scale, strict, chunk_size, diagonal_is_row_max):
    """(diag(β) K + γ I) U = b ⊙ b_scale in row blocks of ``chunk_size`` tokens; the arguments as in
    :func:`~kernelmix.ops._triangular.kernel_triangular_solve`."""
    return _BlockedSolve.apply(
        x, y, b, beta, gamma, y_scale, b_scale, doc_start, float(scale), bool(strict), int(chunk_size),
        bool(diagonal_is_row_max),
    )
