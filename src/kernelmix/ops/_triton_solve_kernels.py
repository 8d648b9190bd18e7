"""The Triton kernels (device code) of the causal kernel-smoother solve (Cubit and DeltaFormer; see
``_triangular``; the launches, checks and autograd are in ``_triton_solve``):

    A U = b,   A = diag(β) K + γ_h I,   K_ij = softmax over visible j of (scale · x_i·y_j),

visible: j ≤ i (Cubit) or j < i (DeltaFormer, ``strict``), and j ≥ doc_start[b, i] with packed
documents. The same computation as ``_solve_blocked`` (its docstring derives the backward), as a
chunk-parallel forward substitution: the rows are cut into spans of ``SPAN_ROWS`` (this constant
and the others the launches read live in ``_triton_solve``); per span, one launch mixes every row
of the span with all earlier spans' solved rows in parallel (``past_span_kernel``: the bulk of the
products, on tensor cores), then the span's rows are solved a sub-span (``SUBSPAN_ROWS``) at a time:
one program per (batch, head, slice of value columns) walks the sub-span's row blocks in order
(``solve_forward_kernel``), then ``past_span_kernel`` again pushes the solved sub-span into the
online softmax of the span's later rows (carrying on from their stored partials), in parallel.

Forward: for row block I, an online softmax (running max, running sum, flash-attention style) over
the past column blocks mixes the stored U rows — the earlier spans' in ``past_span_kernel``, which
leaves its running max, sum and mix per row, the span's own in ``solve_forward_kernel``, which
continues from them in blocks of ``SUBSTITUTION_ROWS``; the diagonal tile closes the softmax, which gives K_II, the mix
of the past Σ_{j<i0} K_ij u_j and the row log-normaliser (base 2, saved for the backward); then the C×C system
β_I K_II + γ I is solved in registers (rows divided by their pivots, then a column-oriented
forward substitution: two reductions per row) and U_I stored. The solve is
independent per column of b, so programs split the value columns (``BLOCK_V``); each recomputes the
logits, which costs dv / BLOCK_V times the logit products and buys that many parallel programs.

Backward, with db = A^{-T} dU and e_i = Σ_j K_ij (db_i·u_j):
    grad b = db,   dγ_h = −Σ_i db_i·u_i,   dβ_i = −e_i,
    dL_ij = −β_i K_ij (db_i·u_j − e_i),   dx_i = scale Σ_j dL_ij y_j,   dy_j = scale Σ_i dL_ij x_i.
Three stages: the transposed solve (per span from the last, ``future_span_kernel`` sums the later
spans' A_IJᵀ db_I for every column block of the span in parallel, then per sub-span from the last
``solve_transposed_kernel`` walks its row blocks from the last and ``future_span_kernel`` adds its
A_IJᵀ db_I to the sums of the span's earlier columns; K is recomputed from x, y and the saved
log-normalisers, the back substitution is in registers);
then e = db ⊙ (K U) summed over the value columns, O(T·d) in torch: Cubit's K U = b − γ U, and
DeltaFormer's as its forward stored it (formed there, as (b − γU)/β would amplify rounding where β
is small); then dx and dy (S = db uᵀ, dx_i = −scale β_i Σ_j K_ij (S_ij − e_i) y_j), in parallel: the
row kernel (``grad_rows_kernel``) gives dx over the columns its rows see and the column kernel
(``grad_columns_kernel``) dy over the rows that see its columns, each writing its own rows once
(the same bits on every run); where the row kernel spills (``_triton_solve``, GRADIENT_STREAM_ROWS),
the column kernel also gives dx, each (column block, row tile) pair adding its part with fp32
atomics (on a GPU the order of those additions, so dx's last bits, may then differ from run to run).
dγ is a torch reduction of db ⊙ U.

Memory O(T·d): no T×T matrix; the forward saves its inputs, U, the log-normalisers and (DeltaFormer) K U.
Softmax, normalisers and systems are fp32, and so are the in-sub-span products (``input_precision=
"ieee"``, ``product(..., "fp32")``); with more than one span, the products across spans, the pushes'
and the gradient kernels' take ``SPAN_OPERANDS`` (TF32 by default; the error measured against
float64 is at the constant).

Blocks: the row block is ``BLOCK_T = min(64, max(16, next_pow2(chunk_size)))`` (Triton blocks are
powers of two ≥ 16, and tl.dot needs ≥ 16); head dims are padded to ``max(16, next_pow2(d))`` with
masks; the value slice of the sequential kernels is ``BLOCK_V = min(64, max(16, next_pow2(dv)))``;
the row and column gradient kernels hold all of dv (``BLOCK_DV``). A program of the forward's span
kernel holds ``BLOCK_R`` rows and one of the transposed direction's ``BLOCK_C`` columns (whole row
blocks: ``SPAN_ROW_BLOCKS``, ``SPAN_COLUMN_BLOCKS``), so that each tile they stream serves them all.

On CPU the kernels run under Triton's interpreter (tests, ``TRITON_INTERPRET=1``), where every
call of a device function re-patches ``triton.language`` (≈1 ms): the loops with many iterations
load their tiles inline rather than through the small helpers.
"""

from __future__ import annotations

from ._triton_products import product, stored_as

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without Triton (it then defines no kernel)
    triton = None
    tl = None

# The running maximum starts at a finite floor, not −inf: a row whose visible columns all lie in
# later blocks then keeps exp2(s − m) = 0 and a rescale factor of 1, with no inf − inf = NaN.
MAX_FLOOR = -1.0e30 if tl is None else tl.constexpr(-1.0e30)
# LOOPS: loops with run-time bounds are ``while`` loops, not ``range``: Triton 3.6's interpreter
# turns a run-time scalar into a 1-element array, which ``range`` cannot take under NumPy ≥ 2.4
# (int() of a 1-d array is an error there); ``while`` compiles to the same loop on a GPU.

__all__ = ["solve_forward_kernel", "past_span_kernel", "future_span_kernel", "solve_transposed_kernel",
           "grad_rows_kernel", "grad_columns_kernel"]


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
        return _masked_logits_from(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT, "fp32")

    @triton.jit
    def _masked_logits_from(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT: tl.constexpr,
                            OPERANDS: tl.constexpr):
        """:func:`_masked_logits` with the product's operand precision (the span kernels')."""
        logits = product(x_tile, tl.trans(y_tile), OPERANDS) * scale2
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
        return _kernel_tile_from(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, "fp32")

    @triton.jit
    def _kernel_tile_from(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT: tl.constexpr,
                          OPERANDS: tl.constexpr):
        logits = _masked_logits_from(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT, OPERANDS)
        return tl.exp2(logits - lse_rows[:, None])

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
        row_max, row_sum, acc, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STRICT: tl.constexpr,
        OPERANDS: tl.constexpr,
    ):
        """Online softmax of rows I over the past columns [first, i0) (flash-attention style), from
        (``row_max``, ``row_sum``, ``acc``): the running max, the running sum and Σ_j exp2(s_ij − max) u_j,
        from the U rows stored earlier."""
        kcols = tl.arange(0, BLOCK_K)
        j0 = first
        while j0 < i0:  # (while, not range: see LOOPS; loads inline: each device call costs the interpreter)
            cols = j0 + tl.arange(0, BLOCK_T)
            y_tile = tl.load(y_ptr + cols[:, None].to(tl.int64) * s_yt + kcols[None, :] * s_yd,
                             mask=(cols[:, None] < length) & (kcols[None, :] < dk), other=0.0)
            u_tile = tl.load(u_ptr + cols[:, None].to(tl.int64) * s_ut + vcols[None, :] * s_ud,
                             mask=(cols[:, None] < length) & (vcols[None, :] < dv), other=0.0)
            logits = _masked_logits_from(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT, OPERANDS)
            new_max = tl.maximum(row_max, tl.max(logits, 1))
            rescale = tl.exp2(row_max - new_max)
            weights = tl.exp2(logits - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + product(weights, u_tile, OPERANDS)
            row_max = new_max
            j0 += BLOCK_T
        return row_max, row_sum, acc

    @triton.jit
    def _span_partials(max_ptr, sum_ptr, acc_ptr, rows, vcols, s_at, s_ad, length, dv,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, HAS_PAST: tl.constexpr):
        """Where rows I's online softmax starts: the past spans' partials (running max, sum and
        mix, :func:`past_span_kernel`), or nothing seen yet."""
        if HAS_PAST:
            row_max = tl.load(max_ptr + rows, mask=rows < length, other=MAX_FLOOR)
            row_sum = tl.load(sum_ptr + rows, mask=rows < length, other=0.0)
            acc = _load_rows(acc_ptr, rows, vcols, s_at, s_ad, length, dv)
        else:
            row_max = tl.full([BLOCK_T], MAX_FLOOR, dtype=tl.float32)
            row_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
            acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        return row_max, row_sum, acc

    @triton.jit
    def _forward_block(
        x_ptr, y_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr, gamma,
        s_xt, s_xd, s_yt, s_yd, s_bt, s_bd, s_ut, s_ud, s_at, s_ad, s_betat, s_dst, i0, span_start, length, dk, dv,
        scale2, vcols, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PAST: tl.constexpr,
        SHADOW: tl.constexpr, STORE_MIX: tl.constexpr,
    ):
        """Row block [i0, i0 + BLOCK_T) of the forward substitution, for one slice of value columns
        (the pointers are those of this batch element and head): the span's earlier columns on top of
        the past spans' partials, then the diagonal tile and the C×C solve. With ``STORE_MIX`` (DeltaFormer,
        when a backward will need it) it also stores Y_I = (K U)_I at ``ku_ptr`` (U's strides), for the
        backward's e_i = db_i·Y_i: formed here, not as (b − γU)/β, whose division by a small β_i would
        amplify rounding."""
        rows = i0 + tl.arange(0, BLOCK_T)
        kcols = tl.arange(0, BLOCK_K)
        starts = _doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = _load_rows(x_ptr, rows, kcols, s_xt, s_xd, length, dk)
        first = tl.maximum(_first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), span_start)
        row_max, row_sum, acc = _span_partials(max_ptr, sum_ptr, acc_ptr, rows, vcols, s_at, s_ad, length, dv,
                                               BLOCK_T, BLOCK_V, HAS_PAST)
        row_max, row_sum, acc = _forward_past(
            x_tile, y_ptr, u_ptr, rows, starts, first, i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, vcols,
            row_max, row_sum, acc, BLOCK_T, BLOCK_K, STRICT, "fp32",
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
        past_mix = (acc * rescale[:, None]) * inverse[:, None]
        rhs = rhs - beta_rows[:, None] * past_mix
        kernel = weights * inverse[:, None]
        u_block = _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T, False)
        _store_rows(u_ptr, rows, vcols, s_ut, s_ud, length, dv, u_block)
        if STORE_MIX:
            mix = past_mix + tl.dot(kernel, u_block, input_precision="ieee")
            _store_rows(ku_ptr, rows, vcols, s_ut, s_ud, length, dv, mix)
        if SHADOW:  # the bf16 copy (U's strides) that the bf16 span kernels and pushes read
            _store_rows(u16_ptr, rows, vcols, s_ut, s_ud, length, dv, stored_as(u_block, u16_ptr))

    @triton.jit
    def solve_forward_kernel(
        x_ptr, y_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, gamma_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_bb, s_bh, s_bt, s_bd,
        s_ub, s_uh, s_ut, s_ud, s_ab, s_ah, s_at, s_ad, s_betab, s_betah, s_betat, s_dsb, s_dst,
        heads, length, dk, dv, scale2, span_start, span_end,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PAST: tl.constexpr,
        SHADOW: tl.constexpr, PARTIAL_V: tl.constexpr, STORE_MIX: tl.constexpr,
    ):
        """Grid (B·H, value slices): one program solves the rows [span_start, span_end) of one slice
        of one head in order (all T rows when there is one span); with ``SHADOW`` it also stores U in
        bf16 at ``u16_ptr`` (laid out as U) for the span kernels with bf16 operands, and with
        ``STORE_MIX`` K U at ``ku_ptr`` (laid out as U). The span kernels'
        partials are per slice of ``PARTIAL_V`` columns (a multiple of BLOCK_V): it reads those of the
        slice its columns lie in."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        vcols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        gamma = tl.load(gamma_ptr + hi)
        x_ptr += bi * s_xb + hi * s_xh
        y_ptr += bi * s_yb + hi * s_yh
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
                x_ptr, y_ptr, b_ptr, u_ptr, u16_ptr, ku_ptr, beta_ptr, ds_ptr, lse_ptr, max_ptr, sum_ptr, acc_ptr,
                gamma, s_xt, s_xd, s_yt, s_yd, s_bt, s_bd, s_ut, s_ud, s_at, s_ad, s_betat, s_dst, i0, span_start,
                length, dk, dv, scale2, vcols, BLOCK_T, BLOCK_K, BLOCK_V, STRICT, HAS_BETA, HAS_DOC, HAS_PAST, SHADOW,
                STORE_MIX,
            )
            # later row blocks load this block's U from global memory: make the stores visible
            tl.debug_barrier()
            i0 += BLOCK_T

    @triton.jit
    def past_span_kernel(
        x_ptr, y_ptr, u_ptr, ds_ptr, max_ptr, sum_ptr, acc_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud, s_ab, s_ah, s_at, s_ad,
        s_dsb, s_dst, heads, length, dk, dv, scale2, row_start, row_stop, column_start, column_stop,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
        STRICT: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr, CONTINUE: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_R`` rows from ``row_start``, value slices), all in parallel: rows
        I against the solved columns [max(first_I, column_start), column_stop), all before its rows, in
        tiles of BLOCK_T columns that each serve all BLOCK_R rows (BLOCK_R is a multiple of BLOCK_T, so a
        launch's last program may reach past ``row_stop``: only the rows before it are stored): the online
        softmax's running max, sum and Σ_j exp2(s_ij − max) u_j, started afresh or, with ``CONTINUE``,
        carried on from the partials stored (per value slice, so that no slice reads another's update);
        :func:`solve_forward_kernel` continues from them. Launched for a span's rows against every
        earlier span, and, inside a span, for the rows after a solved sub-span against it (a push).
        Its products are the off-diagonal ones, the bulk of the solve: on tensor cores unless
        ``OPERANDS`` is "fp32"."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        i0 = row_start + tl.program_id(1) * BLOCK_R
        rows = i0 + tl.arange(0, BLOCK_R)
        vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kcols = tl.arange(0, BLOCK_K)
        ds_ptr += bi * s_dsb
        partials = (tl.program_id(2) * tl.num_programs(0) + pid).to(tl.int64) * length
        acc_ptr += bi * s_ab + hi * s_ah
        starts = _doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = _load_rows(x_ptr + bi * s_xb + hi * s_xh, rows, kcols, s_xt, s_xd, length, dk)
        first = tl.maximum(_first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), column_start)
        row_max, row_sum, acc = _forward_past(
            x_tile, y_ptr + bi * s_yb + hi * s_yh, u_ptr + bi * s_ub + hi * s_uh, rows, starts, first, column_stop,
            s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, vcols, tl.full([BLOCK_R], MAX_FLOOR, dtype=tl.float32),
            tl.zeros([BLOCK_R], dtype=tl.float32), tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32),
            BLOCK_T, BLOCK_K, STRICT, OPERANDS,
        )
        # a program of BLOCK_R rows may reach past the rows launched for (the span's end): those it neither
        # reads partials for nor stores
        stop = tl.minimum(row_stop, length)
        if CONTINUE:  # merged with the stored partials after the loop, whose tiles are then dead (ptxas
            # spilled 180 B at d = 128 when they were loaded before it)
            old_max, old_sum, old_acc = _span_partials(max_ptr + partials, sum_ptr + partials, acc_ptr, rows, vcols,
                                                       s_at, s_ad, stop, dv, BLOCK_R, BLOCK_V, True)
            new_max = tl.maximum(old_max, row_max)
            old_scale, scale = tl.exp2(old_max - new_max), tl.exp2(row_max - new_max)
            row_sum = old_sum * old_scale + row_sum * scale
            acc = old_acc * old_scale[:, None] + acc * scale[:, None]
            row_max = new_max
        _store_rows(acc_ptr, rows, vcols, s_at, s_ad, stop, dv, acc)
        tl.store(max_ptr + partials + rows, row_max, mask=rows < stop)
        tl.store(sum_ptr + partials + rows, row_sum, mask=rows < stop)

    @triton.jit
    def _transposed_later(
        y_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, cols, i_block, end_block,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2, vcols,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        STREAM_T: tl.constexpr, STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
        OPERANDS: tl.constexpr,
    ):
        """Σ_I A_IJᵀ db_I = Σ K_IJᵀ (β_I db_I) over the row blocks [i_block, end_block) that see the
        ``BLOCK_C`` columns J (their db already stored), in row tiles of ``STREAM_T`` (a divisor of BLOCK_T)."""
        kcols = tl.arange(0, BLOCK_K)
        total = tl.zeros([BLOCK_C, BLOCK_V], dtype=tl.float32)
        r0 = i_block * BLOCK_T
        while r0 < end_block * BLOCK_T:  # loads inline: each device call costs the interpreter
            rows = r0 + tl.arange(0, STREAM_T)
            inside = rows < length
            if HAS_DOC:
                starts = tl.load(ds_ptr + rows.to(tl.int64) * s_dst, mask=inside, other=0).to(tl.int32)
            else:
                starts = tl.zeros([STREAM_T], dtype=tl.int32)
            x_tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xt + kcols[None, :] * s_xd,
                             mask=inside[:, None] & (kcols[None, :] < dk), other=0.0)
            lse_rows = tl.load(lse_ptr + rows, mask=inside, other=0.0)
            db_rows = tl.load(db_ptr + rows[:, None].to(tl.int64) * s_dbt + vcols[None, :] * s_dbd,
                              mask=inside[:, None] & (vcols[None, :] < dv), other=0.0)
            kernel = _kernel_tile_from(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
            if HAS_BETA:  # β_I on K's rows, not on db: a bf16 copy of db is then rounded once, as stored
                kernel = kernel * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
            total += product(tl.trans(kernel), db_rows, OPERANDS)
            r0 += STREAM_T
        return total

    @triton.jit
    def solve_transposed_kernel(
        x_ptr, y_ptr, gu_ptr, db_ptr, db16_ptr, beta_ptr, gamma_ptr, ds_ptr, lse_ptr, end_ptr, fut_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_gb, s_gh, s_gt, s_gd,
        s_dbb, s_dbh, s_dbt, s_dbd, s_fb, s_fh, s_ft, s_fd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        heads, length, blocks, dk, dv, scale2, span_first, span_stop,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, HAS_FUTURE: tl.constexpr,
        SHADOW: tl.constexpr,
    ):
        """Grid (B·H, value slices): db = A^{-T} dU for one slice over the span's row blocks
        [span_first, span_stop), from the last: block J subtracts A_IJᵀ db_I of the span's later blocks
        (and the later spans' sum, :func:`future_span_kernel`) from dU_J, then back-substitutes its
        diagonal block. ``end_ptr`` [B, blocks]: one past the last row block that sees each column block.
        With ``SHADOW`` db is also stored in bf16 at ``db16_ptr`` (laid out as db), for the bf16 span kernels."""
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
        db16_ptr += bi * s_dbb + hi * s_dbh
        fut_ptr += bi * s_fb + hi * s_fh
        beta_ptr += bi * s_betab + hi * s_betah
        ds_ptr += bi * s_dsb
        lse_ptr += pid.to(tl.int64) * length
        j_block = span_stop - 1
        while j_block >= span_first:
            cols = j_block * BLOCK_T + tl.arange(0, BLOCK_T)
            y_tile = _load_rows(y_ptr, cols, kcols, s_yt, s_yd, length, dk)
            end_block = tl.minimum(tl.load(end_ptr + bi * blocks + j_block), span_stop)
            rhs = _load_rows(gu_ptr, cols, vcols, s_gt, s_gd, length, dv) - _transposed_later(
                y_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, cols, j_block + 1, end_block,
                s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2, vcols,
                BLOCK_T, BLOCK_K, BLOCK_V, BLOCK_T, BLOCK_T, STRICT, HAS_BETA, HAS_DOC, "fp32",
            )
            if HAS_FUTURE:
                rhs -= _load_rows(fut_ptr, cols, vcols, s_ft, s_fd, length, dv)
            starts = _doc_starts(ds_ptr, cols, s_dst, length, HAS_DOC)
            x_tile = _load_rows(x_ptr, cols, kcols, s_xt, s_xd, length, dk)
            lse_rows = _row_vector(lse_ptr, cols, 1, length, 0.0)
            kernel = _kernel_tile(x_tile, y_tile, lse_rows, cols, cols, starts, length, scale2, STRICT)
            beta_rows = _betas(beta_ptr, cols, s_betat, length, HAS_BETA)
            db_block = _triangular_solve(kernel, beta_rows, gamma, rhs, BLOCK_T, True)
            _store_rows(db_ptr, cols, vcols, s_dbt, s_dbd, length, dv, db_block)
            if SHADOW:
                _store_rows(db16_ptr, cols, vcols, s_dbt, s_dbd, length, dv, stored_as(db_block, db16_ptr))
            # earlier row blocks load this block's db from global memory
            tl.debug_barrier()
            j_block -= 1

    @triton.jit
    def future_span_kernel(
        x_ptr, y_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, end_ptr, fut_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_dbb, s_dbh, s_dbt, s_dbd, s_fb, s_fh, s_ft, s_fd,
        s_betab, s_betah, s_betat, s_dsb, s_dst, heads, length, blocks, dk, dv, scale2, column_first,
        column_stop, row_first, row_stop,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        STREAM_T: tl.constexpr, STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
        OPERANDS: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_C`` columns from column block ``column_first``, value slices), all
        in parallel: columns J against the row blocks [row_first, row_stop) after them that see them,
        each streamed row tile serving all BLOCK_C columns, Σ_I K_IJᵀ (β_I db_I) (their db solved
        already), stored, or with ``ACCUMULATE`` added to what is stored: the transposed solve's
        off-diagonal products, for a span's columns against every later span, and inside a span for
        the columns before a solved sub-span against it (a push); on tensor cores unless ``OPERANDS``
        is "fp32". BLOCK_C is a multiple of BLOCK_T: a launch's last program may reach past column
        block ``column_stop``, and stores only the columns before it."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        j_block = column_first + tl.program_id(1) * (BLOCK_C // BLOCK_T)
        cols = j_block * BLOCK_T + tl.arange(0, BLOCK_C)
        vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        y_tile = _load_rows(y_ptr + bi * s_yb + hi * s_yh, cols, tl.arange(0, BLOCK_K), s_yt, s_yd, length, dk)
        # the rows that see a column are a range that ends later for later columns: the last block's end
        last_block = tl.minimum(j_block + BLOCK_C // BLOCK_T, column_stop) - 1
        end_block = tl.minimum(tl.load(end_ptr + bi * blocks + last_block), row_stop)
        total = _transposed_later(
            y_tile, x_ptr + bi * s_xb + hi * s_xh, db_ptr + bi * s_dbb + hi * s_dbh,
            beta_ptr + bi * s_betab + hi * s_betah, ds_ptr + bi * s_dsb, lse_ptr + pid.to(tl.int64) * length,
            cols, row_first, end_block, s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, length, dk, dv, scale2, vcols,
            BLOCK_T, BLOCK_K, BLOCK_V, BLOCK_C, STREAM_T, STRICT, HAS_BETA, HAS_DOC, OPERANDS,
        )
        fut_ptr += bi * s_fb + hi * s_fh
        stop = tl.minimum(column_stop * BLOCK_T, length)
        if ACCUMULATE:
            total += _load_rows(fut_ptr, cols, vcols, s_ft, s_fd, stop, dv)
        _store_rows(fut_ptr, cols, vcols, s_ft, s_fd, stop, dv, total)

    @triton.jit
    def _grad_rows_dx(
        x_tile, db_rows, lse_rows, e_rows, starts, y_ptr, u_ptr, rows, first, i0,
        s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, STRICT: tl.constexpr,
        OPERANDS: tl.constexpr, STREAM_T: tl.constexpr,
    ):
        """Σ_j K_ij (S_ij − e_i) y_j (= −dx_i / (scale β_i)) over the columns the ``BLOCK_T`` rows I see,
        S = db uᵀ, the columns streamed in tiles of ``STREAM_T``: e is known, so the difference is formed
        before the product (summing K S y and K y apart and subtracting e times the second would cancel)."""
        kcols = tl.arange(0, BLOCK_K)
        vcols = tl.arange(0, BLOCK_DV)
        total = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        j0 = first
        while j0 < i0 + BLOCK_T:  # loads inline: each device call costs the interpreter
            cols = j0 + tl.arange(0, STREAM_T)
            y_tile = tl.load(y_ptr + cols[:, None].to(tl.int64) * s_yt + kcols[None, :] * s_yd,
                             mask=(cols[:, None] < length) & (kcols[None, :] < dk), other=0.0)
            u_tile = tl.load(u_ptr + cols[:, None].to(tl.int64) * s_ut + vcols[None, :] * s_ud,
                             mask=(cols[:, None] < length) & (vcols[None, :] < dv), other=0.0)
            kernel = _kernel_tile_from(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
            scores = kernel * (product(db_rows, tl.trans(u_tile), OPERANDS) - e_rows[:, None])
            total += product(scores, y_tile, OPERANDS)
            j0 += STREAM_T
        return total

    @triton.jit
    def grad_rows_kernel(
        x_ptr, y_ptr, u_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gx_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst, s_gxb, s_gxh, s_gxt, s_gxd,
        heads, length, dk, dv, scale, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
        STREAM_T: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_R`` rows, a multiple of BLOCK_T): dx_I = −scale β_I Σ_j K_Ij
        (db_I·u_j − e_I) y_j, given e, written once per row: no atomics, so the same bits on every run
        (:func:`grad_columns_kernel` then forms dy alone). Its rows are one or more of the solve's row
        blocks, each streamed column tile serving them all."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        i0 = tl.program_id(1) * BLOCK_R
        rows = i0 + tl.arange(0, BLOCK_R)
        kcols = tl.arange(0, BLOCK_K)
        ds_ptr += bi * s_dsb
        starts = _doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = _load_rows(x_ptr + bi * s_xb + hi * s_xh, rows, kcols, s_xt, s_xd, length, dk)
        db_rows = _load_rows(db_ptr + bi * s_dbb + hi * s_dbh, rows, tl.arange(0, BLOCK_DV), s_dbt, s_dbd, length, dv)
        lse_rows = _row_vector(lse_ptr + pid.to(tl.int64) * length, rows, 1, length, 0.0)
        e_rows = _row_vector(e_ptr + pid.to(tl.int64) * length, rows, 1, length, 0.0)
        total = _grad_rows_dx(
            x_tile, db_rows, lse_rows, e_rows, starts, y_ptr + bi * s_yb + hi * s_yh, u_ptr + bi * s_ub + hi * s_uh,
            rows, _first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv,
            scale2, BLOCK_R, BLOCK_K, BLOCK_DV, STRICT, OPERANDS, STREAM_T,
        )
        factor = -scale * _betas(beta_ptr + bi * s_betab + hi * s_betah, rows, s_betat, length, HAS_BETA)
        _store_rows(gx_ptr + bi * s_gxb + hi * s_gxh, rows, kcols, s_gxt, s_gxd, length, dk, factor[:, None] * total)

    @triton.jit
    def _grad_columns_sum(
        y_tile, u_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gx_ptr, cols, c0, row_stop,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2,
        BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
        STREAM_T: tl.constexpr, ROW_GRAD: tl.constexpr,
    ):
        """Σ_i β_i K_ij (db_i·u_j − e_i) x_i (= −dy_j / scale) for the ``BLOCK_C`` columns J from ``c0`` over
        the rows [c0, ``row_stop``) (those that can see J), streamed in tiles of ``STREAM_T``. With
        ``ROW_GRAD`` also J's part of dx_i = −scale Σ_j β_i K_ij (db_i·u_j − e_i) y_j, added to ``gx_ptr`` (fp32,
        zeroed) with atomics: the row gradient without a pass of its own over the columns."""
        kcols = tl.arange(0, BLOCK_K)
        vcols = tl.arange(0, BLOCK_DV)
        total = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
        r0 = c0
        while r0 < row_stop:  # loads inline: each device call costs the interpreter
            rows = r0 + tl.arange(0, STREAM_T)
            inside = rows < length
            if HAS_DOC:
                starts = tl.load(ds_ptr + rows.to(tl.int64) * s_dst, mask=inside, other=0).to(tl.int32)
            else:
                starts = tl.zeros([STREAM_T], dtype=tl.int32)
            x_tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xt + kcols[None, :] * s_xd,
                             mask=inside[:, None] & (kcols[None, :] < dk), other=0.0)
            db_rows = tl.load(db_ptr + rows[:, None].to(tl.int64) * s_dbt + vcols[None, :] * s_dbd,
                              mask=inside[:, None] & (vcols[None, :] < dv), other=0.0)
            lse_rows = tl.load(lse_ptr + rows, mask=inside, other=0.0)
            e_rows = tl.load(e_ptr + rows, mask=inside, other=0.0)
            scores = product(db_rows, tl.trans(u_tile), OPERANDS) - e_rows[:, None]
            if HAS_BETA:
                scores = scores * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
            kernel = _kernel_tile_from(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
            scores = kernel * scores
            total += product(tl.trans(scores), x_tile, OPERANDS)
            if ROW_GRAD:
                # relaxed: the sums need no order among themselves, only the launch's end (no fences)
                tl.atomic_add(gx_ptr + rows[:, None].to(tl.int64) * s_gxt + kcols[None, :] * s_gxd,
                              -scale * product(scores, y_tile, OPERANDS), mask=inside[:, None] & (kcols[None, :] < dk),
                              sem="relaxed")
            r0 += STREAM_T
        return total

    @triton.jit
    def grad_columns_kernel(
        x_ptr, y_ptr, u_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gy_ptr, gx_ptr, end_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        s_gyb, s_gyh, s_gyt, s_gyd, s_gxb, s_gxh, s_gxt, s_gxd,
        heads, length, blocks, dk, dv, scale, scale2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
        STREAM_T: tl.constexpr, ROW_GRAD: tl.constexpr,
    ):
        """Grid (B·H, groups of ``BLOCK_C`` columns, whole column blocks): dy_J = scale Σ_i dL_iJ x_i,
        dL_ij = −β_i K_ij (db_i·u_j − e_i); with ``ROW_GRAD`` also dx, by atomics (:func:`_grad_columns_sum`;
        else :func:`grad_rows_kernel` forms it)."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        c0 = tl.program_id(1) * BLOCK_C
        cols = c0 + tl.arange(0, BLOCK_C)
        kcols = tl.arange(0, BLOCK_K)
        y_tile = _load_rows(y_ptr + bi * s_yb + hi * s_yh, cols, kcols, s_yt, s_yd, length, dk)
        u_tile = _load_rows(u_ptr + bi * s_ub + hi * s_uh, cols, tl.arange(0, BLOCK_DV), s_ut, s_ud, length, dv)
        # the rows that see a column are a range that ends later for later columns: the last block's end
        end_block = tl.load(end_ptr + bi * blocks + tl.minimum((c0 + BLOCK_C) // BLOCK_T, blocks) - 1)
        total = _grad_columns_sum(
            y_tile, u_tile, x_ptr + bi * s_xb + hi * s_xh, db_ptr + bi * s_dbb + hi * s_dbh,
            beta_ptr + bi * s_betab + hi * s_betah, ds_ptr + bi * s_dsb, lse_ptr + pid.to(tl.int64) * length,
            e_ptr + pid.to(tl.int64) * length, gx_ptr + bi * s_gxb + hi * s_gxh, cols, c0, end_block * BLOCK_T,
            s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2,
            BLOCK_C, BLOCK_K, BLOCK_DV, STRICT, HAS_BETA, HAS_DOC, OPERANDS, STREAM_T, ROW_GRAD,
        )
        _store_rows(gy_ptr + bi * s_gyb + hi * s_gyh, cols, kcols, s_gyt, s_gyd, length, dk, -scale * total)
