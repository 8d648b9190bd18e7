"""The in-sub-span kernels of the Triton solve (Cubit and DeltaFormer): the only part of it that is
sequential in the rows. The system and its backward are derived in ``_triton_solve_kernels``, which
also holds the parallel span kernels; the launches are in ``_triton_solve``.

Inside a span the rows are solved a sub-span at a time (``SUBSPAN_ROWS`` rows W, from the span's
first row in steps of W): one program per (batch, head, slice of value columns) walks the sub-span's blocks of
``SUBSTITUTION_ROWS`` rows in order, the forward from the first, the transposed solve from the last.

The logits of a row against its sub-span's columns do not depend on the solution, so one launch forms
them all beforehand, for every sub-span of the sequence at once (``subspan_logits_kernel``: fp32 on
CUDA cores, as the substitution; −inf where a column is hidden: the future, the diagonal for
DeltaFormer, other documents, padding) into a [B·H, T, W] fp32 buffer. The sequential programs then
read them (W · 4 bytes per row) and keep only what needs the solved rows: the online softmax over
them, their mix and the C × C substitution. Without the logits' products in them (2·d FLOPs per pair
of rows, against 2·(value slice) for the mix), splitting the value columns finely
(``SUBSTITUTION_VALUES``) repeats little work and gives the sequential launches more programs.

On CPU these kernels run under Triton's interpreter, where every call of a device function costs
about 1 ms: the loops load their tiles inline.
"""

from __future__ import annotations

from ._triton_products import product, stored_as
from ._triton_solve_tiles import (
    betas,
    doc_starts,
    first_column,
    load_block,
    row_vector,
    span_partials,
    store_block,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without Triton (it then defines no kernel)
    triton = None
    tl = None

__all__ = ["subspan_logits_kernel", "solve_forward_kernel", "solve_transposed_kernel"]


if triton is not None:

    @triton.jit
    def subspan_logits_kernel(
        x_ptr, y_ptr, ds_ptr, lg_ptr, s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_dsb, s_dst,
        heads, length, dk, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr, WIDTH: tl.constexpr,
        SPAN: tl.constexpr, STREAM_T: tl.constexpr, STRICT: tl.constexpr, HAS_DOC: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_T`` rows, a divisor of WIDTH and of SPAN): each row's base-2
        logits scale·log2(e)·x_i·y_j against the columns j of its sub-span (spans of ``SPAN`` rows, each
        cut into sub-spans of WIDTH from its first) up to its block's last row, −inf where j is hidden
        from i, in column tiles of ``STREAM_T`` (a divisor of BLOCK_T), stored at ``lg_ptr`` ([B·H, T,
        WIDTH] contiguous, column c of a row being its sub-span's c-th). The later columns are not
        written: no kernel reads them."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        i0 = tl.program_id(1) * BLOCK_T
        rows = i0 + tl.arange(0, BLOCK_T)
        inside = rows < length
        starts = doc_starts(ds_ptr + bi * s_dsb, rows, s_dst, length, HAS_DOC)
        x_ptr += bi * s_xb + hi * s_xh
        y_ptr += bi * s_yb + hi * s_yh
        span_start = (i0 // SPAN) * SPAN
        sub_start = span_start + ((i0 - span_start) // WIDTH) * WIDTH
        out = lg_ptr + pid.to(tl.int64) * length * WIDTH + rows[:, None].to(tl.int64) * WIDTH - sub_start
        j0 = sub_start
        while j0 < i0 + BLOCK_T:  # (while, not range: see _triton_solve_kernels' LOOPS; loads inline)
            cols = j0 + tl.arange(0, STREAM_T)
            # x_i·y_j in fp32 (CUDA cores), CHUNK_K of the head at a time: a CUDA-core product keeps its
            # rows' and columns' whole reduction in registers (ptxas, sm_90, d = 128: 250-3,400 B spilled
            # with all 128 at once)
            logits = tl.zeros([BLOCK_T, STREAM_T], dtype=tl.float32)
            for k0 in tl.static_range(0, BLOCK_K, CHUNK_K):
                kcols = k0 + tl.arange(0, CHUNK_K)
                x_part = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xt + kcols[None, :] * s_xd,
                                 mask=inside[:, None] & (kcols[None, :] < dk), other=0.0)
                y_part = tl.load(y_ptr + cols[:, None].to(tl.int64) * s_yt + kcols[None, :] * s_yd,
                                 mask=(cols[:, None] < length) & (kcols[None, :] < dk), other=0.0)
                logits += tl.dot(x_part, tl.trans(y_part), input_precision="ieee")
            visible = (cols[None, :] >= starts[:, None]) & inside[:, None] & (cols[None, :] < length)
            if STRICT:
                visible = visible & (cols[None, :] < rows[:, None])
            else:
                visible = visible & (cols[None, :] <= rows[:, None])
            tl.store(out + cols[None, :], tl.where(visible, logits * scale2, float("-inf")), mask=inside[:, None])
            j0 += STREAM_T

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
    def _forward_block(
        lg_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr, gamma,
        s_bt, s_bd, s_ut, s_ud, s_at, s_ad, s_betat, s_dst, i0, sub_start, length, dv, vcols,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, WIDTH: tl.constexpr, HAS_BETA: tl.constexpr,
        HAS_DOC: tl.constexpr, HAS_PAST: tl.constexpr, SHADOW: tl.constexpr, STORE_MIX: tl.constexpr,
    ):
        """Row block [i0, i0 + BLOCK_T) of the forward substitution, for one slice of value columns
        (the pointers are those of this batch element and head): the sub-span's earlier columns (their
        logits read, their U rows solved already) on top of the partials from outside the sub-span,
        then the diagonal tile and the C×C solve. With ``STORE_MIX`` (DeltaFormer, when a backward will
        need it) it also stores Y_I = (K U)_I at ``ku_ptr`` (U's strides), for the backward's
        e_i = db_i·Y_i: formed here, not as (b − γU)/β, whose division by a small β_i would amplify
        rounding."""
        rows = i0 + tl.arange(0, BLOCK_T)
        inside = rows < length
        # row i's logit against column j of the sequence: tiles[i, j − j0] + j0 (j0 a column block's first)
        tiles = lg_ptr + rows[:, None].to(tl.int64) * WIDTH + (tl.arange(0, BLOCK_T) - sub_start)[None, :]
        row_max, row_sum, acc = span_partials(max_ptr, sum_ptr, acc_ptr, i0, vcols, s_at, s_ad, length, dv,
                                              BLOCK_T, BLOCK_V, HAS_PAST)
        j0 = tl.maximum(first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), sub_start)
        while j0 < i0:  # the online softmax over the sub-span's solved rows (loads inline)
            cols = j0 + tl.arange(0, BLOCK_T)
            logits = tl.load(tiles + j0, mask=inside[:, None], other=float("-inf"))
            u_tile = tl.load(u_ptr + cols[:, None].to(tl.int64) * s_ut + vcols[None, :] * s_ud,
                             mask=(cols[:, None] < length) & (vcols[None, :] < dv), other=0.0)
            new_max = tl.maximum(row_max, tl.max(logits, 1))
            rescale = tl.exp2(row_max - new_max)
            weights = tl.exp2(logits - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + product(weights, u_tile, "fp32")
            row_max = new_max
            j0 += BLOCK_T
        # the diagonal tile closes the softmax
        logits = tl.load(tiles + i0, mask=inside[:, None], other=float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 1))
        rescale = tl.exp2(row_max - new_max)
        weights = tl.exp2(logits - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        # a row with no visible column (strict mask, first token of a document) has K row 0
        nonempty = row_sum > 0
        inverse = tl.where(nonempty, 1.0 / tl.where(nonempty, row_sum, 1.0), 0.0)
        lse = tl.where(nonempty, new_max + tl.log2(tl.where(nonempty, row_sum, 1.0)), 0.0)
        tl.store(lse_ptr + rows, lse, mask=inside)
        beta_rows = betas(beta_ptr, rows, s_betat, length, HAS_BETA)
        rhs = load_block(b_ptr, i0, vcols, s_bt, s_bd, length, dv, BLOCK_T)
        past_mix = (acc * rescale[:, None]) * inverse[:, None]
        rhs = rhs - beta_rows[:, None] * past_mix
        kernel = weights * inverse[:, None]
        u_block = _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T, False)
        store_block(u_ptr, i0, vcols, s_ut, s_ud, length, dv, u_block, BLOCK_T)
        if STORE_MIX:
            mix = past_mix + tl.dot(kernel, u_block, input_precision="ieee")
            store_block(ku_ptr, i0, vcols, s_ut, s_ud, length, dv, mix, BLOCK_T)
        if SHADOW:  # the bf16 copy (U's strides) that the bf16 span kernels and pushes read
            store_block(u16_ptr, i0, vcols, s_ut, s_ud, length, dv, stored_as(u_block, u16_ptr), BLOCK_T)

    @triton.jit
    def solve_forward_kernel(
        lg_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, gamma_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr,
        s_bb, s_bh, s_bt, s_bd, s_ub, s_uh, s_ut, s_ud, s_ab, s_ah, s_at, s_ad, s_betab, s_betah, s_betat,
        s_dsb, s_dst, heads, length, dv, span_start, span_end,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, WIDTH: tl.constexpr, HAS_BETA: tl.constexpr,
        HAS_DOC: tl.constexpr, HAS_PAST: tl.constexpr, SHADOW: tl.constexpr, PARTIAL_V: tl.constexpr,
        STORE_MIX: tl.constexpr,
    ):
        """Grid (B·H, value slices): one program solves the rows [span_start, span_end) of one sub-span,
        for one slice of one head, in order, from the logits :func:`subspan_logits_kernel` stored at
        ``lg_ptr``; with ``SHADOW`` it also stores U in bf16 at ``u16_ptr`` (laid out as U) for the span
        kernels with bf16 operands, and with ``STORE_MIX`` K U at ``ku_ptr`` (laid out as U). The span
        kernels' partials are per slice of ``PARTIAL_V`` columns (a multiple of BLOCK_V): it reads those
        of the slice its columns lie in."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        vcols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        gamma = tl.load(gamma_ptr + hi)
        lg_ptr += pid.to(tl.int64) * length * WIDTH
        b_ptr += bi * s_bb + hi * s_bh
        u_ptr += bi * s_ub + hi * s_uh
        u16_ptr += bi * s_ub + hi * s_uh
        ku_ptr += bi * s_ub + hi * s_uh
        acc_ptr += bi * s_ab + hi * s_ah
        beta_ptr += bi * s_betab + hi * s_betah
        ds_ptr += bi * s_dsb
        lse_ptr += pid.to(tl.int64) * length
        # the partials are kept per span value slice: a push updates them in place, slice by slice
        partials = ((tl.program_id(1) * BLOCK_V) // PARTIAL_V * tl.num_programs(0) + pid).to(tl.int64) * length
        max_ptr += partials
        sum_ptr += partials
        i0 = span_start
        while i0 < span_end:
            _forward_block(
                lg_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr, gamma,
                s_bt, s_bd, s_ut, s_ud, s_at, s_ad, s_betat, s_dst, i0, span_start, length, dv, vcols,
                BLOCK_T, BLOCK_V, WIDTH, HAS_BETA, HAS_DOC, HAS_PAST, SHADOW, STORE_MIX,
            )
            # later row blocks load this block's U from global memory: make the stores visible
            tl.debug_barrier()
            i0 += BLOCK_T

    @triton.jit
    def solve_transposed_kernel(
        lg_ptr, gu_ptr, db_ptr, db16_ptr, beta_ptr, gamma_ptr, lse_ptr, end_ptr, fut_ptr,
        s_gb, s_gh, s_gt, s_gd, s_dbb, s_dbh, s_dbt, s_dbd, s_fb, s_fh, s_ft, s_fd, s_betab, s_betah, s_betat,
        heads, length, blocks, dv, span_first, span_stop,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, WIDTH: tl.constexpr, HAS_BETA: tl.constexpr,
        HAS_FUTURE: tl.constexpr, SHADOW: tl.constexpr,
    ):
        """Grid (B·H, value slices): db = A^{-T} dU for one slice over one sub-span's row blocks
        [span_first, span_stop), from the last: block J subtracts A_IJᵀ db_I = K_IJᵀ (β_I db_I) of the
        sub-span's later blocks (and the sums from outside it, :func:`future_span_kernel`) from dU_J,
        then back-substitutes its diagonal block; K from the logits at ``lg_ptr`` and the forward's
        log-normalisers. ``end_ptr`` [B, blocks]: one past the last row block that sees each column
        block. With ``SHADOW`` db is also stored in bf16 at ``db16_ptr`` (laid out as db), for the bf16
        span kernels."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        vcols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        gamma = tl.load(gamma_ptr + hi)
        lg_ptr += pid.to(tl.int64) * length * WIDTH
        gu_ptr += bi * s_gb + hi * s_gh
        db_ptr += bi * s_dbb + hi * s_dbh
        db16_ptr += bi * s_dbb + hi * s_dbh
        fut_ptr += bi * s_fb + hi * s_fh
        beta_ptr += bi * s_betab + hi * s_betah
        lse_ptr += pid.to(tl.int64) * length
        sub_start = span_first * BLOCK_T
        j_block = span_stop - 1
        while j_block >= span_first:
            cols = j_block * BLOCK_T + tl.arange(0, BLOCK_T)
            columns = (cols - sub_start)[None, :]  # the columns' place in the stored logits' rows
            end_block = tl.minimum(tl.load(end_ptr + bi * blocks + j_block), span_stop)
            later = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
            r0 = (j_block + 1) * BLOCK_T
            while r0 < end_block * BLOCK_T:  # the sub-span's later rows that see J (loads inline)
                rows = r0 + tl.arange(0, BLOCK_T)
                inside = rows < length
                logits = tl.load(lg_ptr + rows[:, None].to(tl.int64) * WIDTH + columns, mask=inside[:, None],
                                 other=float("-inf"))
                kernel = tl.exp2(logits - tl.load(lse_ptr + rows, mask=inside, other=0.0)[:, None])
                if HAS_BETA:
                    kernel = kernel * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
                db_rows = tl.load(db_ptr + rows[:, None].to(tl.int64) * s_dbt + vcols[None, :] * s_dbd,
                                  mask=inside[:, None] & (vcols[None, :] < dv), other=0.0)
                later += product(tl.trans(kernel), db_rows, "fp32")
                r0 += BLOCK_T
            rhs = load_block(gu_ptr, j_block * BLOCK_T, vcols, s_gt, s_gd, length, dv, BLOCK_T) - later
            if HAS_FUTURE:
                rhs -= load_block(fut_ptr, j_block * BLOCK_T, vcols, s_ft, s_fd, length, dv, BLOCK_T)
            logits = tl.load(lg_ptr + cols[:, None].to(tl.int64) * WIDTH + columns, mask=(cols < length)[:, None],
                             other=float("-inf"))
            kernel = tl.exp2(logits - row_vector(lse_ptr, cols, 1, length, 0.0)[:, None])
            beta_rows = betas(beta_ptr, cols, s_betat, length, HAS_BETA)
            db_block = _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T, True)
            store_block(db_ptr, j_block * BLOCK_T, vcols, s_dbt, s_dbd, length, dv, db_block, BLOCK_T)
            if SHADOW:  # β folded in: the bf16 kernels that read this copy take no β (_triton_solve: FOLDED)
                store_block(db16_ptr, j_block * BLOCK_T, vcols, s_dbt, s_dbd, length, dv,
                            stored_as(db_block * beta_rows[:, None] if HAS_BETA else db_block, db16_ptr), BLOCK_T)
            # earlier row blocks load this block's db from global memory
            tl.debug_barrier()
            j_block -= 1
