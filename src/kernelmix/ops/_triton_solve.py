"""Triton kernels of the causal kernel-smoother solve (Cubit and DeltaFormer; see ``_triangular``):

    A U = b,   A = diag(β) K + γ_h I,   K_ij = softmax over visible j of (scale · x_i·y_j),

visible: j ≤ i (Cubit) or j < i (DeltaFormer, ``strict``), and j ≥ doc_start[b, i] with packed
documents. The same computation as ``_solve_blocked`` (its docstring derives the backward), as a
chunked forward substitution: one program per (batch, head, slice of value columns) walks the row
blocks in order.

Forward (``_solve_forward_kernel``): for row block I, an online softmax (running max, running sum,
flash-attention style) over the past column blocks mixes the U rows this same program stored
earlier; the diagonal tile closes the softmax, which gives K_II, the mix of the past
Σ_{j<i0} K_ij u_j and the row log-normaliser (base 2, saved for the backward); then the C×C system
β_I K_II + γ I is solved in registers (rows divided by their pivots, then a column-oriented
forward substitution: two reductions per row) and U_I stored. The solve is
independent per column of b, so programs split the value columns (``BLOCK_V``); each recomputes the
logits, which costs dv / BLOCK_V times the logit products and buys that many parallel programs.

Backward, with db = A^{-T} dU and e_i = Σ_j K_ij (db_i·u_j):
    grad b = db,   dγ_h = −Σ_i db_i·u_i,   dβ_i = −e_i,
    dL_ij = −β_i K_ij (db_i·u_j − e_i),   dx_i = scale Σ_j dL_ij y_j,   dy_j = scale Σ_i dL_ij x_i.
Three kernels: the transposed solve (``_solve_transposed_kernel``: per value slice, row blocks from
the last, K recomputed from x, y and the saved log-normalisers, back substitution in registers);
then, in parallel over row blocks, e and dx (``_grad_rows_kernel``; dx_i = −scale β_i (Σ_j K_ij S_ij y_j
− e_i Σ_j K_ij y_j), S = db uᵀ, in one pass over the columns), and in parallel over column blocks dy
(``_grad_columns_kernel``, which needs e). dγ is a torch reduction of db ⊙ U.

Memory O(T·d): no T×T matrix; the forward saves its inputs, U and the log-normalisers only.
Everything (products, softmax, systems) is fp32; the products use ``input_precision="ieee"``
(``DOT_PRECISION``; no TF32), since they feed a triangular system.

Blocks: the row block is ``BLOCK_T = min(64, max(16, next_pow2(chunk_size)))`` (Triton blocks are
powers of two ≥ 16, and tl.dot needs ≥ 16); head dims are padded to ``max(16, next_pow2(d))`` with
masks; the value slice of the sequential kernels is ``BLOCK_V = min(64, max(16, next_pow2(dv)))``;
the row and column gradient kernels hold all of dv (``BLOCK_DV``).

On CPU the kernels run under Triton's interpreter (tests, ``TRITON_INTERPRET=1``), where every
call of a device function re-patches ``triton.language`` (≈1 ms): the loops with many iterations
load their tiles inline rather than through the small helpers.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..errors import KernelmixError
from ._backend import defined_for_the_interpreter

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without Triton; triton_kernel_solve then says what to install
    triton = None
    tl = None

LOG2E = 1.0 / math.log(2.0)
# The running maximum starts at a finite floor, not −inf: a row whose visible columns all lie in
# later blocks then keeps exp2(s − m) = 0 and a rescale factor of 1, with no inf − inf = NaN.
MAX_FLOOR = -1.0e30 if tl is None else tl.constexpr(-1.0e30)
# Every product feeds a triangular system: full fp32 ("ieee"), not TF32. One constant, so that a
# GPU run can measure "tf32" against the accuracy bounds.
DOT_PRECISION = "ieee" if tl is None else tl.constexpr("ieee")
# LOOPS: loops with run-time bounds are ``while`` loops, not ``range``: Triton 3.6's interpreter
# turns a run-time scalar into a 1-element array, which ``range`` cannot take under NumPy ≥ 2.4
# (int() of a 1-d array is an error there); ``while`` compiles to the same loop on a GPU.


def row_block_size(chunk_size: int) -> int:
    """The kernels' row block for a requested ``chunk_size``: a power of two in [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(max(1, int(chunk_size)))))


def padded_dim(d: int) -> int:
    """A head dimension padded to a tl.dot operand size (a power of two ≥ 16)."""
    return max(16, triton.next_power_of_2(d))


def interpreter_enabled() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter (how they were defined)."""
    return triton is not None and defined_for_the_interpreter(_solve_forward_kernel)


if triton is not None:

    @triton.jit
    def _load_rows(ptr, rows, cols, stride_t, stride_d, length, width):
        """A [rows, cols] tile of a [T, width] matrix at ``ptr`` (zeros outside)."""
        offsets = rows[:, None].to(tl.int64) * stride_t + cols[None, :].to(tl.int64) * stride_d
        return tl.load(ptr + offsets, mask=(rows[:, None] < length) & (cols[None, :] < width), other=0.0)

    @triton.jit
    def _store_rows(ptr, rows, cols, stride_t, stride_d, length, width, value):
        offsets = rows[:, None].to(tl.int64) * stride_t + cols[None, :].to(tl.int64) * stride_d
        tl.store(ptr + offsets, value, mask=(rows[:, None] < length) & (cols[None, :] < width))

    @triton.jit
    def _row_vector(ptr, rows, stride_t, length, other):
        return tl.load(ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=other)

    @triton.jit
    def _doc_starts(ds_ptr, rows, stride_t, length, HAS_DOC: tl.constexpr):
        """The first visible column of each row: its document's start (0 with one document)."""
        if HAS_DOC:
            return tl.load(ds_ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=0).to(tl.int32)
        return tl.zeros(rows.shape, dtype=tl.int32)

    @triton.jit
    def _betas(beta_ptr, rows, stride_t, length, HAS_BETA: tl.constexpr):
        if HAS_BETA:
            return tl.load(beta_ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=0.0)
        return tl.full(rows.shape, 1.0, dtype=tl.float32)

    @triton.jit
    def _first_column(ds_ptr, i0, stride_t, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
        """The first column block (as a column index) any row of the block at ``i0`` sees: doc_start
        is non-decreasing, so the block's first row has the earliest document start."""
        if HAS_DOC:
            return (tl.load(ds_ptr + i0 * stride_t).to(tl.int32) // BLOCK_T) * BLOCK_T
        return 0

    @triton.jit
    def _masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT: tl.constexpr):
        """Base-2 logits scale·log2(e)·x_i·y_j of a tile, −inf where column j is hidden from row i
        (the future, the diagonal when ``STRICT``, other documents, padding)."""
        logits = tl.dot(x_tile, tl.trans(y_tile), input_precision=DOT_PRECISION) * scale2
        visible = (cols[None, :] >= starts[:, None]) & (rows[:, None] < length) & (cols[None, :] < length)
        if STRICT:
            visible = visible & (cols[None, :] < rows[:, None])
        else:
            visible = visible & (cols[None, :] <= rows[:, None])
        return tl.where(visible, logits, float("-inf"))

    @triton.jit
    def _kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT: tl.constexpr):
        """The normalised kernel tile K_IJ, recomputed from the saved base-2 log-normalisers
        (hidden entries are −inf, and exp2(−inf − lse) = 0: lse is finite, 0 for an empty row)."""
        return tl.exp2(_masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT) - lse_rows[:, None])

    @triton.jit
    def _unit_substitution(off_diagonal, rhs, BLOCK_T: tl.constexpr, REVERSE: tl.constexpr):
        """Solve (I + N) S = rhs in registers for a strictly triangular N (lower: forward
        substitution; upper, ``REVERSE``: back substitution), column-oriented: once s_c = rhs_c is
        final, N[:, c] s_c leaves the rows not yet solved. Two reductions per row."""
        row_index = tl.arange(0, BLOCK_T)[:, None]
        col_index = tl.arange(0, BLOCK_T)[None, :]
        for step in range(0, BLOCK_T):
            if REVERSE:
                c = BLOCK_T - 1 - step
            else:
                c = step
            solved = tl.sum(tl.where(row_index == c, rhs, 0.0), 0)  # s_c
            column = tl.sum(tl.where(col_index == c, off_diagonal, 0.0), 1)  # N[:, c]
            rhs -= column[:, None] * solved[None, :]
        return rhs

    @triton.jit
    def _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T: tl.constexpr, TRANSPOSED: tl.constexpr):
        """Solve A_II S = rhs (or A_IIᵀ S = rhs) for one diagonal block, A_II = diag(β_I) K_II + γ I:
        the rows are first divided by the pivots (A_II's diagonal), so that the system has a unit
        diagonal and the substitution no pivot divisions."""
        index = tl.arange(0, BLOCK_T)
        system = beta_rows[:, None] * kernel
        pivots = tl.sum(tl.where(index[:, None] == index[None, :], system, 0.0), 1) + gamma
        if TRANSPOSED:  # Aᵀ[k, c] = A[c, k]: row k of Aᵀ divided by its pivot A_kk
            scaled = tl.where(index[None, :] > index[:, None], tl.trans(system) / pivots[:, None], 0.0)
        else:
            scaled = tl.where(index[None, :] < index[:, None], system / pivots[:, None], 0.0)
        return _unit_substitution(scaled, rhs / pivots[:, None], BLOCK_T, TRANSPOSED)

    @triton.jit
    def _forward_past(
        x_tile, y_ptr, u_ptr, rows, starts, first, i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, vcols,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, STRICT: tl.constexpr,
    ):
        """Online softmax of rows I over the past columns [first, i0) (flash-attention style): the
        running max, the running sum and Σ_j exp2(s_ij − max) u_j, from the U rows stored earlier."""
        kcols = tl.arange(0, BLOCK_K)
        row_max = tl.full([BLOCK_T], MAX_FLOOR, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        j0 = first
        while j0 < i0:  # (while, not range: see LOOPS; loads inline: each device call costs the interpreter)
            cols = j0 + tl.arange(0, BLOCK_T)
            y_tile = tl.load(y_ptr + cols[:, None].to(tl.int64) * s_yt + kcols[None, :] * s_yd,
                             mask=(cols[:, None] < length) & (kcols[None, :] < dk), other=0.0)
            u_tile = tl.load(u_ptr + cols[:, None].to(tl.int64) * s_ut + vcols[None, :] * s_ud,
                             mask=(cols[:, None] < length) & (vcols[None, :] < dv), other=0.0)
            logits = _masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT)
            new_max = tl.maximum(row_max, tl.max(logits, 1))
            rescale = tl.exp2(row_max - new_max)
            weights = tl.exp2(logits - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights, u_tile, input_precision=DOT_PRECISION)
            row_max = new_max
            j0 += BLOCK_T
        return row_max, row_sum, acc

    @triton.jit
    def _forward_block(
        x_ptr, y_ptr, b_ptr, u_ptr, beta_ptr, ds_ptr, lse_ptr, gamma,
        s_xt, s_xd, s_yt, s_yd, s_bt, s_bd, s_ut, s_ud, s_betat, s_dst, i0, length, dk, dv, scale2, vcols,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Row block [i0, i0 + BLOCK_T) of the forward substitution, for one slice of value columns
        (the pointers are those of this batch element and head)."""
        rows = i0 + tl.arange(0, BLOCK_T)
        kcols = tl.arange(0, BLOCK_K)
        starts = _doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = _load_rows(x_ptr, rows, kcols, s_xt, s_xd, length, dk)
        first = _first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC)
        row_max, row_sum, acc = _forward_past(
            x_tile, y_ptr, u_ptr, rows, starts, first, i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, vcols,
            BLOCK_T, BLOCK_K, BLOCK_V, STRICT,
        )
        # the diagonal tile closes the softmax
        y_tile = _load_rows(y_ptr, rows, kcols, s_yt, s_yd, length, dk)
        logits = _masked_logits(x_tile, y_tile, rows, rows, starts, length, scale2, STRICT)
        new_max = tl.maximum(row_max, tl.max(logits, 1))
        rescale = tl.exp2(row_max - new_max)
        weights = tl.exp2(logits - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        # a row with no visible column (strict mask, first token of a document) has K row 0
        nonempty = row_sum > 0
        inverse = tl.where(nonempty, 1.0 / tl.where(nonempty, row_sum, 1.0), 0.0)
        lse = tl.where(nonempty, new_max + tl.log2(tl.where(nonempty, row_sum, 1.0)), 0.0)
        tl.store(lse_ptr + rows, lse, mask=rows < length)
        beta_rows = _betas(beta_ptr, rows, s_betat, length, HAS_BETA)
        rhs = _load_rows(b_ptr, rows, vcols, s_bt, s_bd, length, dv)
        rhs = rhs - beta_rows[:, None] * ((acc * rescale[:, None]) * inverse[:, None])
        u_block = _triangular_solve(weights * inverse[:, None], beta_rows, gamma, rhs, BLOCK_T, False)
        _store_rows(u_ptr, rows, vcols, s_ut, s_ud, length, dv, u_block)

    @triton.jit
    def _solve_forward_kernel(
        x_ptr, y_ptr, b_ptr, u_ptr, beta_ptr, gamma_ptr, ds_ptr, lse_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_bb, s_bh, s_bt, s_bd,
        s_ub, s_uh, s_ut, s_ud, s_betab, s_betah, s_betat, s_dsb, s_dst,
        heads, length, dk, dv, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Grid (B·H, value slices): one program solves all T rows of one slice of one head."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        vcols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        gamma = tl.load(gamma_ptr + hi)
        x_ptr += bi * s_xb + hi * s_xh
        y_ptr += bi * s_yb + hi * s_yh
        b_ptr += bi * s_bb + hi * s_bh
        u_ptr += bi * s_ub + hi * s_uh
        beta_ptr += bi * s_betab + hi * s_betah
        ds_ptr += bi * s_dsb
        lse_ptr += pid.to(tl.int64) * length
        i0 = 0
        while i0 < length:
            _forward_block(
                x_ptr, y_ptr, b_ptr, u_ptr, beta_ptr, ds_ptr, lse_ptr, gamma,
                s_xt, s_xd, s_yt, s_yd, s_bt, s_bd, s_ut, s_ud, s_betat, s_dst, i0, length, dk, dv, scale2, vcols,
                BLOCK_T, BLOCK_K, BLOCK_V, STRICT, HAS_BETA, HAS_DOC,
            )
            # later row blocks load this block's U from global memory: make the stores visible
            tl.debug_barrier()
            i0 += BLOCK_T

    @triton.jit
    def _transposed_later(
        y_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, cols, j_block, end_block,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2, vcols,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Σ_{I>J} A_IJᵀ db_I = Σ K_IJᵀ (β_I db_I) over the later row blocks that see column block J
        (their db already stored by this program)."""
        kcols = tl.arange(0, BLOCK_K)
        total = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        i_block = j_block + 1
        while i_block < end_block:  # loads inline: each device call costs the interpreter
            rows = i_block * BLOCK_T + tl.arange(0, BLOCK_T)
            inside = rows < length
            if HAS_DOC:
                starts = tl.load(ds_ptr + rows.to(tl.int64) * s_dst, mask=inside, other=0).to(tl.int32)
            else:
                starts = tl.zeros([BLOCK_T], dtype=tl.int32)
            x_tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xt + kcols[None, :] * s_xd,
                             mask=inside[:, None] & (kcols[None, :] < dk), other=0.0)
            lse_rows = tl.load(lse_ptr + rows, mask=inside, other=0.0)
            db_rows = tl.load(db_ptr + rows[:, None].to(tl.int64) * s_dbt + vcols[None, :] * s_dbd,
                              mask=inside[:, None] & (vcols[None, :] < dv), other=0.0)
            if HAS_BETA:
                db_rows = db_rows * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
            kernel = _kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT)
            total += tl.dot(tl.trans(kernel), db_rows, input_precision=DOT_PRECISION)
            i_block += 1
        return total

    @triton.jit
    def _solve_transposed_kernel(
        x_ptr, y_ptr, gu_ptr, db_ptr, beta_ptr, gamma_ptr, ds_ptr, lse_ptr, end_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_gb, s_gh, s_gt, s_gd,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        heads, length, blocks, dk, dv, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Grid (B·H, value slices): db = A^{-T} dU for one slice, row blocks from the last: block J
        subtracts A_IJᵀ db_I of the later blocks from dU_J, then back-substitutes its diagonal block.
        ``end_ptr`` [B, blocks]: one past the last row block that sees each column block."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        vcols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        kcols = tl.arange(0, BLOCK_K)
        gamma = tl.load(gamma_ptr + hi)
        x_ptr += bi * s_xb + hi * s_xh
        y_ptr += bi * s_yb + hi * s_yh
        gu_ptr += bi * s_gb + hi * s_gh
        db_ptr += bi * s_dbb + hi * s_dbh
        beta_ptr += bi * s_betab + hi * s_betah
        ds_ptr += bi * s_dsb
        lse_ptr += pid.to(tl.int64) * length
        j_block = blocks - 1
        while j_block >= 0:
            cols = j_block * BLOCK_T + tl.arange(0, BLOCK_T)
            y_tile = _load_rows(y_ptr, cols, kcols, s_yt, s_yd, length, dk)
            end_block = tl.load(end_ptr + bi * blocks + j_block)
            rhs = _load_rows(gu_ptr, cols, vcols, s_gt, s_gd, length, dv) - _transposed_later(
                y_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, cols, j_block, end_block,
                s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2, vcols,
                BLOCK_T, BLOCK_K, BLOCK_V, STRICT, HAS_BETA, HAS_DOC,
            )
            starts = _doc_starts(ds_ptr, cols, s_dst, length, HAS_DOC)
            x_tile = _load_rows(x_ptr, cols, kcols, s_xt, s_xd, length, dk)
            lse_rows = _row_vector(lse_ptr, cols, 1, length, 0.0)
            kernel = _kernel_tile(x_tile, y_tile, lse_rows, cols, cols, starts, length, scale2, STRICT)
            beta_rows = _betas(beta_ptr, cols, s_betat, length, HAS_BETA)
            db_block = _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T, True)
            _store_rows(db_ptr, cols, vcols, s_dbt, s_dbd, length, dv, db_block)
            # earlier row blocks load this block's db from global memory
            tl.debug_barrier()
            j_block -= 1

    @triton.jit
    def _grad_rows_sums(
        x_tile, db_rows, lse_rows, starts, y_ptr, u_ptr, rows, first, i0,
        s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, STRICT: tl.constexpr,
    ):
        """Over the columns rows I see: e_I = Σ_j K_ij S_ij, Σ_j K_ij S_ij y_j and Σ_j K_ij y_j,
        with S = db uᵀ (one pass; dx follows from the three)."""
        kcols = tl.arange(0, BLOCK_K)
        vcols = tl.arange(0, BLOCK_DV)
        e_rows = tl.zeros([BLOCK_T], dtype=tl.float32)
        weighted = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        smoothed = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        j0 = first
        while j0 <= i0:  # loads inline: each device call costs the interpreter
            cols = j0 + tl.arange(0, BLOCK_T)
            y_tile = tl.load(y_ptr + cols[:, None].to(tl.int64) * s_yt + kcols[None, :] * s_yd,
                             mask=(cols[:, None] < length) & (kcols[None, :] < dk), other=0.0)
            u_tile = tl.load(u_ptr + cols[:, None].to(tl.int64) * s_ut + vcols[None, :] * s_ud,
                             mask=(cols[:, None] < length) & (vcols[None, :] < dv), other=0.0)
            kernel = _kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT)
            products = kernel * tl.dot(db_rows, tl.trans(u_tile), input_precision=DOT_PRECISION)  # K ⊙ (db uᵀ)
            e_rows += tl.sum(products, 1)
            weighted += tl.dot(products, y_tile, input_precision=DOT_PRECISION)
            smoothed += tl.dot(kernel, y_tile, input_precision=DOT_PRECISION)
            j0 += BLOCK_T
        return e_rows, weighted, smoothed

    @triton.jit
    def _grad_rows_kernel(
        x_ptr, y_ptr, u_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gx_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        s_gxb, s_gxh, s_gxt, s_gxd,
        heads, length, dk, dv, scale, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Grid (B·H, row blocks): e_I = Σ_j K_ij db_i·u_j (= −dβ_I) and
        dx_I = −scale β_I (Σ_j K_ij S_ij y_j − e_I Σ_j K_ij y_j)."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        i0 = tl.program_id(1) * BLOCK_T
        rows = i0 + tl.arange(0, BLOCK_T)
        kcols = tl.arange(0, BLOCK_K)
        ds_ptr += bi * s_dsb
        lse_ptr += pid.to(tl.int64) * length
        e_ptr += pid.to(tl.int64) * length
        starts = _doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = _load_rows(x_ptr + bi * s_xb + hi * s_xh, rows, kcols, s_xt, s_xd, length, dk)
        db_rows = _load_rows(db_ptr + bi * s_dbb + hi * s_dbh, rows, tl.arange(0, BLOCK_DV), s_dbt, s_dbd, length, dv)
        lse_rows = _row_vector(lse_ptr, rows, 1, length, 0.0)
        first = _first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC)
        e_rows, weighted, smoothed = _grad_rows_sums(
            x_tile, db_rows, lse_rows, starts, y_ptr + bi * s_yb + hi * s_yh, u_ptr + bi * s_ub + hi * s_uh,
            rows, first, i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, BLOCK_T, BLOCK_K, BLOCK_DV, STRICT,
        )
        factor = -scale * _betas(beta_ptr + bi * s_betab + hi * s_betah, rows, s_betat, length, HAS_BETA)
        grad_x = factor[:, None] * (weighted - e_rows[:, None] * smoothed)
        _store_rows(gx_ptr + bi * s_gxb + hi * s_gxh, rows, kcols, s_gxt, s_gxd, length, dk, grad_x)
        tl.store(e_ptr + rows, e_rows, mask=rows < length)

    @triton.jit
    def _grad_columns_sum(
        y_tile, u_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, cols, j_block, end_block,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Σ_i β_i K_ij (db_i·u_j − e_i) x_i (= −dy_j / scale) over the row blocks that see block J."""
        kcols = tl.arange(0, BLOCK_K)
        vcols = tl.arange(0, BLOCK_DV)
        total = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        i_block = j_block
        while i_block < end_block:  # loads inline: each device call costs the interpreter
            rows = i_block * BLOCK_T + tl.arange(0, BLOCK_T)
            inside = rows < length
            if HAS_DOC:
                starts = tl.load(ds_ptr + rows.to(tl.int64) * s_dst, mask=inside, other=0).to(tl.int32)
            else:
                starts = tl.zeros([BLOCK_T], dtype=tl.int32)
            x_tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xt + kcols[None, :] * s_xd,
                             mask=inside[:, None] & (kcols[None, :] < dk), other=0.0)
            db_rows = tl.load(db_ptr + rows[:, None].to(tl.int64) * s_dbt + vcols[None, :] * s_dbd,
                              mask=inside[:, None] & (vcols[None, :] < dv), other=0.0)
            lse_rows = tl.load(lse_ptr + rows, mask=inside, other=0.0)
            e_rows = tl.load(e_ptr + rows, mask=inside, other=0.0)
            scores = tl.dot(db_rows, tl.trans(u_tile), input_precision=DOT_PRECISION) - e_rows[:, None]
            if HAS_BETA:
                scores = scores * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
            kernel = _kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT)
            total += tl.dot(tl.trans(kernel * scores), x_tile, input_precision=DOT_PRECISION)
            i_block += 1
        return total

    @triton.jit
    def _grad_columns_kernel(
        x_ptr, y_ptr, u_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gy_ptr, end_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        s_gyb, s_gyh, s_gyt, s_gyd,
        heads, length, blocks, dk, dv, scale, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Grid (B·H, column blocks): dy_J = scale Σ_i dL_iJ x_i, dL_ij = −β_i K_ij (db_i·u_j − e_i)."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        j_block = tl.program_id(1)
        cols = j_block * BLOCK_T + tl.arange(0, BLOCK_T)
        kcols = tl.arange(0, BLOCK_K)
        y_tile = _load_rows(y_ptr + bi * s_yb + hi * s_yh, cols, kcols, s_yt, s_yd, length, dk)
        u_tile = _load_rows(u_ptr + bi * s_ub + hi * s_uh, cols, tl.arange(0, BLOCK_DV), s_ut, s_ud, length, dv)
        end_block = tl.load(end_ptr + bi * blocks + j_block)
        total = _grad_columns_sum(
            y_tile, u_tile, x_ptr + bi * s_xb + hi * s_xh, db_ptr + bi * s_dbb + hi * s_dbh,
            beta_ptr + bi * s_betab + hi * s_betah, ds_ptr + bi * s_dsb, lse_ptr + pid.to(tl.int64) * length,
            e_ptr + pid.to(tl.int64) * length, cols, j_block, end_block,
            s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2,
            BLOCK_T, BLOCK_K, BLOCK_DV, STRICT, HAS_BETA, HAS_DOC,
        )
        _store_rows(gy_ptr + bi * s_gyb + hi * s_gyh, cols, kcols, s_gyt, s_gyd, length, dk, -scale * total)


def _strides4(t: Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _check_inputs(x, y, b, beta, gamma, doc_start) -> None:
    if triton is None:
        raise KernelmixError("the Triton solve needs the triton package: pip install triton (or use backend='torch')")
    named = {"x": x, "y": y, "b": b, "gamma": gamma} | ({} if beta is None else {"beta": beta})
    for name, tensor in named.items():
        if tensor.dtype != torch.float32:
            raise KernelmixError(f"the Triton solve takes float32 tensors, but {name} is {tensor.dtype}: cast it "
                                 "with .float() (the ops run the solve in float32), or use backend='torch'")
    if x.device.type == "cpu" and not interpreter_enabled():
        raise KernelmixError("the Triton solve got CPU tensors but Triton's interpreter is off: set "
                             "TRITON_INTERPRET=1 in the environment before triton and kernelmix are imported, "
                             "move the tensors to CUDA, or use backend='torch'")
    if x.dim() != 4 or y.shape != x.shape or b.dim() != 4 or b.shape[:3] != x.shape[:3]:
        raise KernelmixError(f"the Triton solve needs x, y [B, H, T, dk] and b [B, H, T, dv]; got x "
                             f"{tuple(x.shape)}, y {tuple(y.shape)}, b {tuple(b.shape)}")
    batch, heads, length, _ = x.shape
    if gamma.shape != (heads,) or (beta is not None and beta.shape != (batch, heads, length)):
        raise KernelmixError(f"the Triton solve needs gamma [H] and beta [B, H, T] (H={heads}); got gamma "
                             f"{tuple(gamma.shape)}, beta {None if beta is None else tuple(beta.shape)}")
    if doc_start is not None and (doc_start.shape != (batch, length) or doc_start.is_floating_point()):
        raise KernelmixError(f"doc_start must be an integer [B, T] = {(batch, length)} tensor, got "
                             f"{doc_start.dtype} {tuple(doc_start.shape)}")
    tensors = [t for t in (x, y, b, beta, gamma, doc_start) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise KernelmixError(f"the Triton solve needs all its tensors on one device; got "
                             f"{sorted({str(t.device) for t in tensors})}: move them with .to({str(x.device)!r})")


def _row_block_ends(doc_start: Tensor | None, batch: int, length: int, block: int, device) -> Tensor:
    """[B, blocks] int32: one past the last row block whose rows see column block J. Rows that see
    a column < j1 are those with doc_start < j1, a prefix (doc_start is non-decreasing)."""
    blocks = triton.cdiv(length, block)
    if doc_start is None:
        return torch.full((batch, blocks), blocks, dtype=torch.int32, device=device)
    ends = torch.arange(1, blocks + 1, device=device, dtype=doc_start.dtype) * block
    ends = ends.clamp_(max=length).expand(batch, blocks).contiguous()
    rows = torch.searchsorted(doc_start.contiguous(), ends, side="left")
    return ((rows + block - 1) // block).to(torch.int32).contiguous()


class _Layout:
    """Block sizes, strides and flags shared by the launches of one solve."""

    def __init__(self, x, b, beta, doc_start, scale, strict, chunk_size):
        self.batch, self.heads, self.length, self.dk = x.shape
        self.dv = b.shape[-1]
        self.block_t = row_block_size(chunk_size)
        self.block_k = padded_dim(self.dk)
        self.block_v = min(64, padded_dim(self.dv))
        self.block_dv = padded_dim(self.dv)
        self.blocks = triton.cdiv(self.length, self.block_t)
        self.scale, self.scale2, self.strict = float(scale), float(scale) * LOG2E, bool(strict)
        self.has_beta, self.has_doc = beta is not None, doc_start is not None
        self.beta_strides = (0, 0, 0) if beta is None else tuple(beta.stride())
        self.ds_strides = (0, 0) if doc_start is None else tuple(doc_start.stride())
        # 64-row tiles of 128-wide head dims spill heavily at 4 warps (ptxas, sm_90: 25-37 KB stack
        # frames per kernel; 6-15 KB at 8 warps): a first guess, for a GPU run to tune
        self.num_warps = 8 if self.block_t * max(self.block_k, self.block_dv) >= 64 * 128 else 4

    def flags(self) -> dict:
        return dict(BLOCK_T=self.block_t, BLOCK_K=self.block_k, STRICT=self.strict, HAS_BETA=self.has_beta,
                    HAS_DOC=self.has_doc, num_warps=self.num_warps)


def _solve_forward(x, y, b, beta, gamma, doc_start, lay: _Layout) -> tuple[Tensor, Tensor]:
    # U laid out [B, T, H, dv] (the callers' layout), seen as [B, H, T, dv]
    u = b.new_empty(lay.batch, lay.length, lay.heads, lay.dv).transpose(1, 2)
    lse = x.new_empty(lay.batch, lay.heads, lay.length)  # base-2 row log-normalisers
    grid = (lay.batch * lay.heads, triton.cdiv(lay.dv, lay.block_v))
    _solve_forward_kernel[grid](
        x, y, b, u, x if beta is None else beta, gamma, x if doc_start is None else doc_start, lse,
        *_strides4(x), *_strides4(y), *_strides4(b), *_strides4(u), *lay.beta_strides, *lay.ds_strides,
        lay.heads, lay.length, lay.dk, lay.dv, lay.scale2, BLOCK_V=lay.block_v, **lay.flags(),
    )
    return u, lse


def _solve_backward(grad_u, x, y, beta, gamma, doc_start, u, lse, lay: _Layout, need_x: bool, need_y: bool):
    """db (the gradient of b), dx, dy and e (−dβ) of one solve."""
    ends = _row_block_ends(doc_start, lay.batch, lay.length, lay.block_t, x.device)
    grad_b = u.new_empty(lay.batch, lay.length, lay.heads, lay.dv).transpose(1, 2)
    beta_arg = x if beta is None else beta
    ds_arg = x if doc_start is None else doc_start
    common = (*lay.beta_strides, *lay.ds_strides)
    _solve_transposed_kernel[(lay.batch * lay.heads, triton.cdiv(lay.dv, lay.block_v))](
        x, y, grad_u, grad_b, beta_arg, gamma, ds_arg, lse, ends,
        *_strides4(x), *_strides4(y), *_strides4(grad_u), *_strides4(grad_b), *common,
        lay.heads, lay.length, lay.blocks, lay.dk, lay.dv, lay.scale2, BLOCK_V=lay.block_v, **lay.flags(),
    )
    e = x.new_empty(lay.batch, lay.heads, lay.length)
    grad_x = x.new_empty(lay.batch, lay.length, lay.heads, lay.dk).transpose(1, 2)
    grid = (lay.batch * lay.heads, lay.blocks)
    tensors = (*_strides4(x), *_strides4(y), *_strides4(u), *_strides4(grad_b), *common)
    _grad_rows_kernel[grid](
        x, y, u, grad_b, beta_arg, ds_arg, lse, e, grad_x, *tensors, *_strides4(grad_x),
        lay.heads, lay.length, lay.dk, lay.dv, lay.scale, lay.scale2, BLOCK_DV=lay.block_dv, **lay.flags(),
    )
    grad_y = None
    if need_y:
        grad_y = x.new_empty(lay.batch, lay.length, lay.heads, lay.dk).transpose(1, 2)
        _grad_columns_kernel[grid](
            x, y, u, grad_b, beta_arg, ds_arg, lse, e, grad_y, ends, *tensors, *_strides4(grad_y),
            lay.heads, lay.length, lay.blocks, lay.dk, lay.dv, lay.scale, lay.scale2,
            BLOCK_DV=lay.block_dv, **lay.flags(),
        )
    return grad_b, (grad_x if need_x else None), grad_y, e


def _launch_device(x: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class _TritonSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, doc_start, scale, strict, chunk_size):
        lay = _Layout(x, b, beta, doc_start, scale, strict, chunk_size)
        gamma = gamma.contiguous()  # the kernels read γ_h at gamma_ptr + h
        if lay.length == 0:  # nothing to solve: no launch
            u, lse = b.new_empty(b.shape), x.new_empty(x.shape[:3])
        else:
            with _launch_device(x):
                u, lse = _solve_forward(x, y, b, beta, gamma, doc_start, lay)
        ctx.save_for_backward(x, y, beta, gamma, doc_start, u, lse)
        ctx.layout = lay
        return u

    @staticmethod
    @once_differentiable  # a gradient of this gradient is not implemented: say so clearly
    def backward(ctx, grad_u):
        x, y, beta, gamma, doc_start, u, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if ctx.layout.length == 0:
            return (torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(u), None if beta is None else
                    torch.zeros_like(beta), torch.zeros_like(gamma), None, None, None, None)
        with _launch_device(x):
            grad_b, grad_x, grad_y, e = _solve_backward(
                grad_u.float(), x, y, beta, gamma, doc_start, u, lse, ctx.layout, needs[0], needs[1]
            )
        grad_beta = -e if beta is not None and needs[3] else None
        grad_gamma = -(grad_b * u).sum(dim=(0, 2, 3)) if needs[4] else None
        return grad_x, grad_y, grad_b if needs[2] else None, grad_beta, grad_gamma, None, None, None, None


def triton_kernel_solve(x: Tensor, y: Tensor, b: Tensor, *, beta: Tensor | None, gamma: Tensor, scale: float,
                        strict: bool, chunk_size: int, doc_start: Tensor | None) -> Tensor:
    """Solve (diag(β) K + γ_h I) U = b with the Triton kernels (the system in the module docstring).

    x, y: ``[B, H, T, dk]`` float32, b: ``[B, H, T, dv]`` float32 (any strides); beta ``[B, H, T]``
    float32 or None (β = 1); gamma ``[H]`` float32, > 0 (not checked: that would synchronise);
    doc_start ``[B, T]`` int64 (each token's document start, non-decreasing, ≤ its index) or None.
    The row block is ``BLOCK_T = min(64, max(16, next_pow2(chunk_size)))``; any T ≥ 1 works (masks),
    T = 0 returns an empty tensor. Returns U ``[B, H, T, dv]`` float32 (a view of a [B, T, H, dv]
    tensor), differentiable w.r.t. x, y, b, beta and gamma (once: no double backward). CPU tensors
    need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)."""
    _check_inputs(x, y, b, beta, gamma, doc_start)
    return _TritonSolve.apply(x, y, b, beta, gamma, doc_start, float(scale), bool(strict), int(chunk_size))
