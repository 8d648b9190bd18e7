"""Solve of a causal kernel-smoother system, shared by Cubit and DeltaFormer: a blocked solve
(any device; below) and, on CPU, the same solve with its off-diagonal work in PyTorch's fused
attention kernel ("rectangles", at the end of this module; faster, chosen automatically).

Both mixers solve a lower-triangular system

    A U = b,   A = diag(β) K + γ I,   K_ij = softmax_{j ≤ i (or j < i)} (scale · x_i · y_j)

Cubit: x = r, y = r̂, scale = 1, β = 1, γ = λ_h, inclusive mask (SPEC §2).
With ``doc_start`` (packed documents, left padding) K_ij is also 0 across documents: the system is
block-diagonal, one independent solve per document.
DeltaFormer: x = w, y = k, scale = 1/√d, β = β_i, γ = 1, strict mask (SPEC §3).

The dense reference builds K (T×T) and calls ``solve_triangular``. This module never holds more
than a C×T block of K for a few heads at a time (``TILE_ELEMENTS`` bounds a block; heads are
processed in groups so that memory stays bounded as T grows). Memory is O(T·C + T·d) per group.

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


def _causal_hidden(size: int, strict: bool, device) -> Tensor:
    """Within the diagonal block: True where column j is not visible from row i (j > i, or j ≥ i)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(0 if strict else 1)


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


class _KernelTriangularSolve(torch.autograd.Function):
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
        hidden_diag = _causal_hidden(min(chunk_size, length), strict, x.device)
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
        with torch.autocast(grad_u.device.type, enabled=False):  # the transposed solve stays in fp32+
            return _KernelTriangularSolve._backward(ctx, grad_u)

    @staticmethod
    def _backward(ctx, grad_u):
        x, y, b, beta, gamma, y_scale, b_scale, u, lse2, doc_start = ctx.saved_tensors
        scale, strict, chunk_size = ctx.scale, ctx.strict, ctx.chunk_size
        batch, heads, length, dk = x.shape
        dv = u.shape[-1]
        fused = y is None  # y derived from x: one buffer receives dy, then becomes the whole dx
        # grad_b doubles as the right-hand side of the transposed solve: rows ≥ i0 hold db once row
        # block i0 is done, rows < i0 the dU still to be reduced by the later rows' contributions.
        grad_b = u.new_empty(batch, length, heads, dv).transpose(1, 2)
        grad_b.copy_(grad_u)
        del grad_u
        # dy accumulates over the row blocks from the last; columns ≥ i0 are final once row block i0
        # is done (later rows only reach back), so with y = x ⊙ y_scale the same rows can then turn
        # into dx = dx_direct + y_scale ⊙ dy in place.
        grad_y = x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        grad_x = grad_y if fused else x.new_empty(batch, length, heads, dk).transpose(1, 2)
        grad_gamma = x.new_zeros(heads)
        grad_beta = None if beta is None or not ctx.needs_input_grad[3] else x.new_empty(batch, heads, length)
        grad_y_scale = None if y_scale is None or not ctx.needs_input_grad[5] else x.new_empty(batch, heads, length)
        grad_b_scale = None if b is None else x.new_empty(batch, heads, length)
        hidden_diag = _causal_hidden(min(chunk_size, length), strict, x.device)
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
    Returns U as a ``[B, H, T, dv]`` view of a ``[B, T, H, dv]`` tensor."""
    if y is not None and y_scale is not None:
        raise ValueError("y_scale applies only when y is None (y = x ⊙ y_scale)")
    with torch.autocast(x.device.type, enabled=False):  # bf16 autocast must not reach the solve
        if _use_rectangles(x, b):
            return _RectangleSolve.apply(
                x, y, b, beta, gamma, y_scale, b_scale, doc_start, float(scale), bool(strict),
                max(int(chunk_size), RECT_MIN_LEAF),
            )
        return _KernelTriangularSolve.apply(
            x, y, b, beta, gamma, y_scale, b_scale, doc_start, float(scale), bool(strict), int(chunk_size),
            bool(diagonal_is_row_max),
        )


# ---------------------------------------------------------------------------------------------
# The same solve with the off-diagonal work done by PyTorch's fused CPU attention kernel.
#
# For rows [m, hi) against columns [lo, m) the system's matrix is a full rectangle of the softmax
# kernel. Its contribution to those rows, Σ_j K_ij u_j, is ordinary (non-causal) attention of
# queries x over keys y with values u, reweighted by the share of each row's mass the rectangle
# holds (exp(lse_rect − lse_row)). Forward substitution recurses: solve [lo, m), apply the
# rectangle to [m, hi), solve [m, hi); the leaves are diagonal blocks of max(C, RECT_MIN_LEAF)
# rows, solved densely. The rectangles tile the causal triangle, so the FLOPs are the blocked
# solve's, but they run in a few large fused calls: no C×T tile in memory and no Python loop per
# block and head group.
#
# The backward runs the recursion in reverse (backward substitution for db = A^{-T} dU) and uses
# the fused attention backward of the same rectangles. Given dO = −β db, O = Y = K U (full rows)
# and the full-row log-normaliser, it computes dS = P ⊙ (dO vᵀ − Δ) with Δ_i = dO_i·O_i = −β_i e_i,
# which is exactly dL on the rectangle, and returns dx (queries), dy (keys) and Pᵀ dO = −Kᵀ(β db),
# these rows' share of the earlier rows' right-hand side.
#
# Memory: until its diagonal block is solved, a row of U holds the rectangles' normalised
# contribution (its log-normaliser in lse), so the forward needs no other T-sized buffer. The
# backward recovers Y from the system itself, β ⊙ Y = b ⊙ b_scale − γU; only rows with β below
# BETA_EXACT, where that division would lose accuracy, keep the forward's Y. Fused calls cover at
# most RECT_ROWS × RECT_COLS, which bounds their temporaries however long the sequence, and one
# call's outputs are freed before the next call allocates its own (DeltaFormer's fwd+bwd peak at
# T=8192, H=8, d=64 was 125 MiB without that, 117 with it; 119 with 1024 × 1024 pieces and 110 with
# 512 × 512, which is ~7% slower); y = x ⊙ y_scale exists one piece at a time;
# dy and dx share one buffer (a row holds dy until its diagonal block is done, dx after). The fused
# kernel needs one head size for q, k and v (dk == dv) and runs on CPU; elsewhere the blocked
# solve above runs.

_FLASH_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"

# "auto": the fused rectangles on CPU where they apply, else the blocked solve; "blocked" or
# "rectangles" force one (the tests run both).
SOLVE_PATH = "auto"
# Rows with β below this keep Y = K U from the forward: elsewhere the backward recovers it as
# (b − γU)/β, whose rounding error grows like 1/β (≤ 2·16 ulp of b here).
BETA_EXACT = 1.0 / 16
# A fused call covers at most this many rows and columns.
RECT_ROWS = 1024
RECT_COLS = 512
# Diagonal blocks (leaves) have at least this many rows (chunk_size rows if that is larger): below
# ~128 rows the fused calls are too small to run at their large-call rate (a 64×64 rectangle at ~1/4
# of it) and every leaf costs a dozen small ops. Measured on 2 CPU threads, H=8, d=64, the solve's
# fwd+bwd in SDPA fwd+bwd units with leaves of 64 / 128 / 256 rows: 1.36 / 1.25 / 1.25 at T=4096,
# 1.63 / 1.40 / 1.37 at T=2048, 1.68 / 1.49 / 1.64 at T=1024 (Cubit); DeltaFormer's fwd+bwd peak at
# T=8192 grows with the leaf, 117 / 117 / 122 MiB.
RECT_MIN_LEAF = 128


def _has_fused_cpu_attention() -> bool:
    return hasattr(torch.ops.aten, _FLASH_FORWARD) and hasattr(torch.ops.aten, _FLASH_BACKWARD)


def _use_rectangles(x: Tensor, b: Tensor) -> bool:
    if SOLVE_PATH == "blocked":
        return False
    applicable = x.device.type == "cpu" and x.shape[-1] == b.shape[-1] and _has_fused_cpu_attention()
    if SOLVE_PATH == "rectangles" and not applicable:
        raise RuntimeError(
            "the rectangle solve needs CPU tensors, dk == dv and PyTorch's fused CPU attention; "
            "set kernelmix.ops._triangular.SOLVE_PATH to 'auto' (falls back by itself) or 'blocked'"
        )
    return applicable


def _segments(length: int, doc_start: Tensor | None, batch: int) -> list[tuple[slice, int, int]]:
    """(batch slice, first, end) of each independent system: the whole batch and sequence without
    documents; one per document and batch element with them (the system is block-diagonal)."""
    if doc_start is None:
        return [(slice(0, batch), 0, length)] if length else []
    segments = []
    positions = torch.arange(length, device=doc_start.device)
    for bi in range(batch):
        firsts = torch.nonzero(doc_start[bi] == positions).flatten().tolist()
        segments += [(slice(bi, bi + 1), first, end) for first, end in zip(firsts, firsts[1:] + [length])]
    return segments


def _split(lo: int, hi: int, leaf: int) -> int | None:
    """Where [lo, hi) splits (on a leaf boundary, halves as equal as possible); None for a leaf."""
    blocks = -(-(hi - lo) // leaf)
    return None if blocks <= 1 else lo + ((blocks + 1) // 2) * leaf


def _pieces(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    return [(p, min(p + size, hi)) for p in range(lo, hi, size)]


def _keys(x: Tensor, y: Tensor | None, y_scale: Tensor | None, bs: slice, lo: int, hi: int) -> Tensor:
    """y of rows [lo, hi): ``y`` itself, or x (⊙ y_scale) computed for these rows only."""
    if y is not None:
        return y[bs, :, lo:hi]
    rows = x[bs, :, lo:hi]
    return rows if y_scale is None else rows * y_scale[bs, :, lo:hi, None]


def _rhs(b: Tensor, b_scale: Tensor | None, bs: slice, lo: int, hi: int) -> Tensor:
    """The right-hand side b ⊙ b_scale of rows [lo, hi), computed for these rows only."""
    rows = b[bs, :, lo:hi]
    return rows if b_scale is None else rows * b_scale[bs, :, lo:hi, None]


def _diagonal_logits(x_block: Tensor, keys_block: Tensor, scale: float) -> Tensor:
    """Logits of a diagonal block, hidden entries included (``_visible_exp_`` drops them)."""
    return (x_block @ keys_block.transpose(-1, -2)).mul_(scale)


def _visible_exp_(shifted: Tensor, offset: int) -> Tensor:
    """In place: exp of the visible entries (on or below diagonal ``offset``) of logits already
    shifted by a row maximum or log-normaliser, 0 elsewhere. Hidden entries are zeroed before the
    exp, so a large hidden logit cannot overflow, and after it. This is ≈3× faster on CPU than
    filling them with −inf first: masked_fill with a broadcast mask is not vectorised, and the
    vectorised exp takes a slow path for −inf."""
    return shifted.tril_(offset).exp_().tril_(offset)


def _system_(kernel: Tensor, beta: Tensor | None, gamma: Tensor) -> Tensor:
    """diag(β) K + γI of a diagonal block, in place of ``kernel`` (which it returns)."""
    if beta is not None:
        kernel.mul_(beta[..., None])
    kernel.diagonal(dim1=-2, dim2=-1).add_(gamma[:, None])
    return kernel


class _RectangleSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, y_scale, b_scale, doc_start, scale, strict, leaf):
        # shapes as in _KernelTriangularSolve
        batch, heads, length, _ = x.shape
        dv = b.shape[-1]
        u = b.new_zeros(batch, length, heads, dv).transpose(1, 2)
        lse = x.new_full((batch, heads, length), float("-inf"))  # natural log, full rows once solved
        exact_at, exact_rows = [], []  # Y of the rows with β < BETA_EXACT (see full_rows in _backward)
        offset = -1 if strict else 0  # the diagonal blocks' visible entries: on or below this diagonal
        size = min(leaf, max(length, 1))
        hidden_bias = x.new_zeros(size, size).masked_fill_(_causal_hidden(size, strict, x.device), float("-inf"))
        flash = getattr(torch.ops.aten, _FLASH_FORWARD)

        def leaf_forward(bs, i0, i1):
            logits = _diagonal_logits(x[bs, :, i0:i1], _keys(x, y, y_scale, bs, i0, i1), scale)
            block_max = (logits + hidden_bias[: i1 - i0, : i1 - i0]).amax(dim=-1)
            block_max.masked_fill_(torch.isinf(block_max), 0.0)  # nothing visible (strict mask, first row)
            exps = _visible_exp_(logits.sub_(block_max[..., None]), offset)
            before = lse[bs, :, i0:i1]  # the rectangles' share of each row (−inf: none)
            full = torch.logaddexp(before, block_max + torch.log(exps.sum(-1)))
            full.masked_fill_(torch.isinf(full), 0.0)  # an empty row stays a zero row
            kernel = exps.mul_(torch.exp(block_max - full)[..., None])
            past = u[bs, :, i0:i1] * torch.exp(before - full)[..., None]  # Σ_{j < i0} K_ij u_j
            rhs = _rhs(b, b_scale, bs, i0, i1)
            beta_block = None if beta is None else beta[bs, :, i0:i1]
            rhs = rhs - (past if beta_block is None else beta_block[..., None] * past)
            small = None if beta_block is None else beta_block < BETA_EXACT
            exact_kernel = kernel.clone() if small is not None and small.any() else None  # K, before it becomes the system
            u_block = torch.linalg.solve_triangular(_system_(kernel, beta_block, gamma), rhs, upper=False)
            if exact_kernel is not None:  # these rows keep Y = K U
                at = small.nonzero()
                exact_at.append(at + at.new_tensor([bs.start, 0, i0]))
                exact_rows.append((past + exact_kernel @ u_block)[small])
            u[bs, :, i0:i1] = u_block
            lse[bs, :, i0:i1] = full

        def solve(bs, lo, hi):
            mid = _split(lo, hi, leaf)
            if mid is None:
                leaf_forward(bs, lo, hi)
                return
            solve(bs, lo, mid)
            for c0, c1 in _pieces(lo, mid, RECT_COLS):
                keys = _keys(x, y, y_scale, bs, c0, c1)
                for r0, r1 in _pieces(mid, hi, RECT_ROWS):
                    out, rect_lse = flash(x[bs, :, r0:r1], keys, u[bs, :, c0:c1], 0.0, False, scale=scale)
                    acc, acc_lse = u[bs, :, r0:r1], lse[bs, :, r0:r1]  # rows not solved yet
                    merged = torch.logaddexp(acc_lse, rect_lse)
                    acc.mul_(torch.exp(acc_lse - merged)[..., None]).add_(out.mul_(torch.exp(rect_lse - merged)[..., None]))
                    acc_lse.copy_(merged)
                    del out, rect_lse  # before the next call allocates its own
            solve(bs, mid, hi)

        for bs, lo, hi in _segments(length, doc_start, batch):
            solve(bs, lo, hi)
        exact_at = torch.cat(exact_at) if exact_at else x.new_zeros(0, 3, dtype=torch.long)
        exact_rows = torch.cat(exact_rows) if exact_rows else x.new_zeros(0, dv)
        # b recomputes Y = (b ⊙ b_scale − γU) / β and gives the gradient of b_scale
        ctx.save_for_backward(x, y, b, beta, gamma, y_scale, b_scale, u, lse, doc_start, exact_at, exact_rows)
        ctx.scale, ctx.strict, ctx.leaf = scale, strict, leaf
        return u

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_u):
        with torch.autocast(grad_u.device.type, enabled=False):
            return _RectangleSolve._backward(ctx, grad_u)

    @staticmethod
    def _backward(ctx, grad_u):
        x, y, b, beta, gamma, y_scale, b_scale, u, lse, doc_start, exact_at, exact_rows = ctx.saved_tensors
        scale, strict, leaf = ctx.scale, ctx.strict, ctx.leaf
        batch, heads, length, dk = x.shape
        dv = u.shape[-1]
        fused = y is None
        # the right-hand side of the transposed solve; each diagonal block overwrites its rows with db
        grad_b = u.new_empty(batch, length, heads, dv).transpose(1, 2)
        grad_b.copy_(grad_u)
        del grad_u
        grad_x = x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        grad_y = grad_x if fused else x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        grad_gamma = x.new_zeros(heads)
        grad_beta = None if beta is None or not ctx.needs_input_grad[3] else x.new_empty(batch, heads, length)
        grad_y_scale = None if y_scale is None or not ctx.needs_input_grad[5] else x.new_empty(batch, heads, length)
        offset = -1 if strict else 0
        flash_backward = getattr(torch.ops.aten, _FLASH_BACKWARD)

        def full_rows(bs, r0, r1):
            """Y = K U on rows [r0, r1), from the system itself: β ⊙ K U = b ⊙ b_scale − γU."""
            rows = _rhs(b, b_scale, bs, r0, r1) - gamma[:, None, None] * u[bs, :, r0:r1]
            if beta is None:
                return rows
            rows.div_(beta[bs, :, r0:r1, None].clamp_min(BETA_EXACT))
            if len(exact_at):  # rows with small β: the forward's own Y
                at_b, at_h, at_t = exact_at.unbind(1)
                inside = (at_t >= r0) & (at_t < r1) & (at_b >= bs.start) & (at_b < bs.stop)
                if inside.any():
                    picked = inside.nonzero().squeeze(1)
                    rows[at_b[picked] - bs.start, at_h[picked], at_t[picked] - r0] = exact_rows[picked]
            return rows

        def leaf_backward(bs, i0, i1):
            x_block, keys_block = x[bs, :, i0:i1], _keys(x, y, y_scale, bs, i0, i1)
            logits = _diagonal_logits(x_block, keys_block, scale).sub_(lse[bs, :, i0:i1, None])
            kernel = _visible_exp_(logits, offset)
            beta_block = None if beta is None else beta[bs, :, i0:i1]
            system = _system_(kernel.clone(), beta_block, gamma)
            # Aᵀ db = g as dbᵀ A = gᵀ: LAPACK copies a transposed (upper) matrix first, ~1.7× slower
            db = torch.linalg.solve_triangular(system, grad_b[bs, :, i0:i1].mT, upper=False, left=False).mT
            grad_b[bs, :, i0:i1] = db
            u_block = u[bs, :, i0:i1]
            grad_gamma.sub_((db * u_block).sum(dim=(0, 2, 3)))
            e = (db * full_rows(bs, i0, i1)).sum(-1)  # e_i = db_i · (K U)_i
            if grad_beta is not None:
                grad_beta[bs, :, i0:i1] = -e
            # dL_ij = β_i K_ij (e_i − db_i·u_j) on the diagonal block
            d_logits = kernel.mul_(e[..., None] - db @ u_block.transpose(-1, -2))
            d_logits.mul_(scale if beta_block is None else beta_block[..., None] * scale)  # scale: of the logits
            grad_x_block = d_logits @ keys_block
            grad_y[bs, :, i0:i1] += d_logits.transpose(-1, -2) @ x_block
            if fused:  # dy of these rows is final: the buffer's rows turn into dx
                rows = grad_x[bs, :, i0:i1]
                if y_scale is not None:
                    if grad_y_scale is not None:
                        grad_y_scale[bs, :, i0:i1] = (rows * x_block).sum(-1)
                    rows.mul_(y_scale[bs, :, i0:i1, None])
                rows.add_(grad_x_block)
            else:
                grad_x[bs, :, i0:i1] += grad_x_block

        def solve(bs, lo, hi):
            mid = _split(lo, hi, leaf)
            if mid is None:
                leaf_backward(bs, lo, hi)
                return
            solve(bs, mid, hi)  # db of rows [mid, hi) is final
            for r0, r1 in _pieces(mid, hi, RECT_ROWS):
                db = grad_b[bs, :, r0:r1]
                grad_out = -db if beta is None else db * -beta[bs, :, r0:r1, None]
                queries, rows, rows_lse = x[bs, :, r0:r1], full_rows(bs, r0, r1), lse[bs, :, r0:r1].contiguous()
                for c0, c1 in _pieces(lo, mid, RECT_COLS):
                    dq, dkeys, dvalues = flash_backward(
                        grad_out, queries, _keys(x, y, y_scale, bs, c0, c1), u[bs, :, c0:c1], rows, rows_lse,
                        0.0, False, scale=scale,
                    )
                    grad_x[bs, :, r0:r1] += dq  # these rows' diagonal blocks are done: dx
                    grad_y[bs, :, c0:c1] += dkeys  # these not yet: dy
                    grad_b[bs, :, c0:c1] += dvalues  # −Kᵀ(β db) leaves the earlier right-hand side
                    del dq, dkeys, dvalues  # before the next call allocates its own
            solve(bs, lo, mid)

        for bs, lo, hi in _segments(length, doc_start, batch):
            solve(bs, lo, hi)
        grad_b_scale = None
        if b_scale is not None:  # rhs = b ⊙ b_scale
            if ctx.needs_input_grad[6]:
                grad_b_scale = (grad_b * b).sum(-1)
            grad_b.mul_(b_scale[..., None])
        grad_gamma = grad_gamma if ctx.needs_input_grad[4] else None
        return (
            grad_x, None if fused else grad_y, grad_b, grad_beta, grad_gamma, grad_y_scale, grad_b_scale,
            None, None, None, None,
        )
