"""The causal kernel-smoother solve (see ``_triangular`` for the system) with its off-diagonal work
done by PyTorch's fused CPU attention kernel ("rectangles"): the same solve as ``_solve_blocked``,
faster on CPU.

For rows [m, hi) against columns [lo, m) the system's matrix is a full rectangle of the softmax
kernel. Its contribution to those rows, Σ_j K_ij u_j, is ordinary (non-causal) attention of
queries x over keys y with values u, reweighted by the share of each row's mass the rectangle
holds (exp(lse_rect − lse_row)). Forward substitution recurses: solve [lo, m), apply the
rectangle to [m, hi), solve [m, hi); the leaves are diagonal blocks of max(C, RECT_MIN_LEAF)
rows, solved densely. The rectangles tile the causal triangle, so the FLOPs are the blocked
solve's, but they run in a few large fused calls: no C×T tile in memory and no Python loop per
block and head group.

The backward runs the recursion in reverse (backward substitution for db = A^{-T} dU) and uses
the fused attention backward of the same rectangles. Given dO = −β db, O = Y = K U (full rows)
and the full-row log-normaliser, it computes dS = P ⊙ (dO vᵀ − Δ) with Δ_i = dO_i·O_i = −β_i e_i,
which is exactly dL on the rectangle, and returns dx (queries), dy (keys) and Pᵀ dO = −Kᵀ(β db),
these rows' share of the earlier rows' right-hand side.

Memory: until its diagonal block is solved, a row of U holds the rectangles' normalised
contribution (its log-normaliser in lse), so the forward needs no other T-sized buffer. The
backward recovers Y from the system itself, β ⊙ Y = b ⊙ b_scale − γU; only rows with β below
BETA_EXACT, where that division would lose accuracy, keep the forward's Y. Fused calls cover at
most RECT_ROWS × RECT_COLS, which bounds their temporaries however long the sequence, and one
call's outputs are freed before the next call allocates its own (DeltaFormer's fwd+bwd peak at
T=8192, H=8, d=64 was 125 MiB without that, 117 with it; 119 with 1024 × 1024 pieces and 110 with
512 × 512, which is ~7% slower); y = x ⊙ y_scale exists one piece at a time;
dy and dx share one buffer (a row holds dy until its diagonal block is done, dx after). The fused
kernel needs one head size for q, k and v (dk == dv) and runs on CPU (``rectangles_applicable``);
elsewhere the blocked solve runs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..lazy import after_import

from ._common import autocast_off, causal_hidden, solve_backward_buffers

_FLASH_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"

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


def rectangles_applicable(x: Tensor, b: Tensor) -> bool:
    """Whether the rectangle solve can run on ``x`` and ``b``: CPU tensors, dk == dv (one head size
    for the fused kernel's q, k and v) and a PyTorch with the fused CPU attention kernel."""
    return x.device.type == "cpu" and x.shape[-1] == b.shape[-1] and _has_fused_cpu_attention()


def rectangle_solve(x, y, b, *, beta, gamma, y_scale, b_scale, doc_start, scale, strict, chunk_size):
    """(diag(β) K + γ I) U = b ⊙ b_scale with the rectangles in fused attention calls and diagonal
    blocks of max(``chunk_size``, ``RECT_MIN_LEAF``) rows; the arguments as in
    :func:`~kernelmix.ops._triangular.kernel_triangular_solve`. Raises RuntimeError where it
    cannot run (see :func:`rectangles_applicable`)."""
    if not rectangles_applicable(x, b):
        raise RuntimeError(
            "the rectangle solve needs CPU tensors, dk == dv and PyTorch's fused CPU attention; "
            "pass solver='auto' (falls back by itself) or solver='blocked'"
        )
    # With β (DeltaFormer) the leaves branch on the data (rows with β below BETA_EXACT): under
    # torch.compile the whole solve runs eagerly, one graph break per call, instead of a break at
    # every leaf.
    apply = _apply_outside_graph if beta is not None and torch.compiler.is_compiling() else _RectangleSolve.apply
    return apply(
        x, y, b, beta, gamma, y_scale, b_scale, doc_start, float(scale), bool(strict),
        max(int(chunk_size), RECT_MIN_LEAF),
    )


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


def _kernel_times_u(rhs_rows: Tensor, u_rows: Tensor, gamma: Tensor, beta_rows: Tensor | None) -> Tensor:
    """Y = K U of some rows, from the system itself: β ⊙ K U = b ⊙ b_scale − γU (``rhs_rows`` is
    b ⊙ b_scale). β is clamped at BETA_EXACT: rows below it are replaced by the forward's own Y
    (:func:`_restore_exact_rows_`)."""
    rows = rhs_rows - gamma[:, None, None] * u_rows
    if beta_rows is None:
        return rows
    return rows.div_(beta_rows[..., None].clamp_min(BETA_EXACT))


def _restore_exact_rows_(rows: Tensor, exact_at: Tensor, exact_rows: Tensor, bs: slice, r0: int) -> Tensor:
    """In place: the rows of ``rows`` (batch elements ``bs``, tokens from ``r0``) that the forward
    kept exactly (β < BETA_EXACT; ``exact_at`` ``[n, 3]`` holds their (batch, head, token)) get that Y."""
    if len(exact_at):
        r1 = r0 + rows.shape[2]
        at_b, at_h, at_t = exact_at.unbind(1)
        inside = (at_t >= r0) & (at_t < r1) & (at_b >= bs.start) & (at_b < bs.stop)
        if inside.any():
            picked = inside.nonzero().squeeze(1)
            rows[at_b[picked] - bs.start, at_h[picked], at_t[picked] - r0] = exact_rows[picked]
    return rows


def _leaf_gradients(x_block, keys_block, lse_block, beta_block, gamma, grad_block, u_block, y_rows, scale, offset):
    """The backward of one diagonal block, given its right-hand side ``grad_block`` (dU less the
    later rows' contributions, final): db = A_IIᵀ⁻¹ g, and with e_i = db_i · Y_i (``y_rows``:
    Y = K U of the block's rows) the block's own softmax backward
    dL_ij = β_i K_ij (e_i − db_i·u_j). Returns (db, dγ, e, dL y (dx from the block), dLᵀ x (dy of
    the block's columns))."""
    logits = _diagonal_logits(x_block, keys_block, scale).sub_(lse_block[..., None])
    kernel = _visible_exp_(logits, offset)
    system = _system_(kernel.clone(), beta_block, gamma)
    # Aᵀ db = g as dbᵀ A = gᵀ: LAPACK copies a transposed (upper) matrix first, ~1.7× slower
    db = torch.linalg.solve_triangular(system, grad_block.mT, upper=False, left=False).mT
    d_gamma = (db * u_block).sum(dim=(0, 2, 3))
    e = (db * y_rows).sum(-1)  # e_i = db_i · (K U)_i
    d_logits = kernel.mul_(e[..., None] - db @ u_block.transpose(-1, -2))
    d_logits.mul_(scale if beta_block is None else beta_block[..., None] * scale)  # scale: of the logits
    return db, d_gamma, e, d_logits @ keys_block, d_logits.transpose(-1, -2) @ x_block


class _RectangleSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, y_scale, b_scale, doc_start, scale, strict, leaf):
        # shapes as in _solve_blocked._BlockedSolve
        batch, heads, length, _ = x.shape
        dv = b.shape[-1]
        u = b.new_zeros(batch, length, heads, dv).transpose(1, 2)
        lse = x.new_full((batch, heads, length), float("-inf"))  # natural log, full rows once solved
        exact_at, exact_rows = [], []  # Y of the rows with β < BETA_EXACT (see full_rows in _backward)
        offset = -1 if strict else 0  # the diagonal blocks' visible entries: on or below this diagonal
        size = min(leaf, max(length, 1))
        hidden = causal_hidden(size, strict, x.device)
        flash = getattr(torch.ops.aten, _FLASH_FORWARD)

        def leaf_forward(bs, i0, i1):
            logits = _diagonal_logits(x[bs, :, i0:i1], _keys(x, y, y_scale, bs, i0, i1), scale)
            # a select, not an additive −inf bias: a NaN logit of a later column must not reach the row's max
            block_max = logits.masked_fill(hidden[: i1 - i0, : i1 - i0], float("-inf")).amax(dim=-1)
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
            # K, before it becomes the system
            exact_kernel = kernel.clone() if small is not None and small.any() else None
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
                    acc.mul_(torch.exp(acc_lse - merged)[..., None]).add_(
                        out.mul_(torch.exp(rect_lse - merged)[..., None]))
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
        with autocast_off(grad_u):
            return _RectangleSolve._backward(ctx, grad_u)

    @staticmethod
    def _backward(ctx, grad_u):
        x, y, b, beta, gamma, y_scale, b_scale, u, lse, doc_start, exact_at, exact_rows = ctx.saved_tensors
        scale, strict, leaf = ctx.scale, ctx.strict, ctx.leaf
        batch, heads, length, dk = x.shape
        fused = y is None
        # the right-hand side of the transposed solve; each diagonal block overwrites its rows with db
        grad_b, grad_gamma, grad_beta, grad_y_scale = solve_backward_buffers(
            ctx.needs_input_grad, x, u, grad_u, beta, y_scale)
        del grad_u
        grad_x = x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        grad_y = grad_x if fused else x.new_zeros(batch, length, heads, dk).transpose(1, 2)
        offset = -1 if strict else 0
        flash_backward = getattr(torch.ops.aten, _FLASH_BACKWARD)

        def full_rows(bs, r0, r1):  # Y = K U on rows [r0, r1)
            beta_rows = None if beta is None else beta[bs, :, r0:r1]
            rows = _kernel_times_u(_rhs(b, b_scale, bs, r0, r1), u[bs, :, r0:r1], gamma, beta_rows)
            return _restore_exact_rows_(rows, exact_at, exact_rows, bs, r0)

        def leaf_backward(bs, i0, i1):
            x_block = x[bs, :, i0:i1]
            db, d_gamma, e, grad_x_block, grad_y_block = _leaf_gradients(
                x_block, _keys(x, y, y_scale, bs, i0, i1), lse[bs, :, i0:i1],
                None if beta is None else beta[bs, :, i0:i1], gamma, grad_b[bs, :, i0:i1], u[bs, :, i0:i1],
                full_rows(bs, i0, i1), scale, offset,
            )
            grad_b[bs, :, i0:i1] = db
            grad_gamma.sub_(d_gamma)
            if grad_beta is not None:
                grad_beta[bs, :, i0:i1] = -e
            grad_y[bs, :, i0:i1] += grad_y_block
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


def _apply_outside_graph(*args):
    return _RectangleSolve.apply(*args)


def _outside_graphs() -> None:
    """``torch.compiler.disable`` on :func:`_apply_outside_graph`, applied when torch._dynamo is imported
    (it always is before anything compiles) rather than at this module's import, which it would slow
    by seconds."""
    global _apply_outside_graph
    _apply_outside_graph = torch.compiler.disable(_apply_outside_graph)


after_import("torch._dynamo", _outside_graphs)
