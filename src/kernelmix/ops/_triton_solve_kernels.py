"""The parallel Triton kernels (device code) of the causal kernel-smoother solve (Cubit and DeltaFormer;
see ``_triangular``; the launches, checks and autograd are in ``_triton_solve``, the sequential
in-sub-span kernels in ``_triton_solve_sequential``, the small device functions in
``_triton_solve_tiles``):

    A U = b,   A = diag(β) K + γ_h I,   K_ij = softmax over visible j of (scale · x_i·y_j),

visible: j ≤ i (Cubit) or j < i (DeltaFormer, ``strict``), and j ≥ doc_start[b, i] with packed
documents. The same computation as ``_solve_blocked`` (its docstring derives the backward), as a
chunk-parallel forward substitution: the rows are cut into spans of ``SPAN_ROWS`` (this constant
and the others the launches read live in ``_triton_solve``); per span, one launch mixes every row
of the span with all earlier spans' solved rows in parallel (``past_span_kernel``: the bulk of the
products, on tensor cores), then the span's rows are solved a sub-span (``SUBSPAN_ROWS``) at a time:
one program per (batch, head, slice of value columns) walks the sub-span's row blocks in order
(``solve_forward_kernel``, reading the in-sub-span logits that ``subspan_logits_kernel`` formed for
the whole sequence beforehand), then ``past_span_kernel`` again pushes the solved sub-span into the
online softmax of the span's later rows (carrying on from their stored partials), in parallel.

Forward: for row block I, an online softmax (running max, running sum, flash-attention style) over
the past column blocks mixes the stored U rows — the earlier spans' in ``past_span_kernel``, which
leaves its running max, sum and mix per row, the sub-span's own in ``solve_forward_kernel``, which
continues from them in blocks of ``SUBSTITUTION_ROWS``; the diagonal tile closes the softmax, which
gives K_II, the mix of the past Σ_{j<i0} K_ij u_j and the row log-normaliser (base 2, saved for the
backward); then the C×C system β_I K_II + γ I is solved in registers (rows divided by their pivots,
then a column-oriented forward substitution: two reductions per row) and U_I stored. The solve is
independent per column of b, so programs split the value columns (``BLOCK_V``); the span kernels
recompute the logits per slice, which costs dv / BLOCK_V times their logit products and buys that
many parallel programs (the sequential kernels read theirs, and take narrower slices).

Backward, with db = A^{-T} dU and e_i = Σ_j K_ij (db_i·u_j):
    grad b = db,   dγ_h = −Σ_i db_i·u_i,   dβ_i = −e_i,
    dL_ij = −β_i K_ij (db_i·u_j − e_i),   dx_i = scale Σ_j dL_ij y_j,   dy_j = scale Σ_i dL_ij x_i.
Three stages: the transposed solve (per span from the last, ``future_span_kernel`` sums the later
spans' A_IJᵀ db_I for every column block of the span in parallel, then per sub-span from the last
``solve_transposed_kernel`` walks its row blocks from the last and ``future_span_kernel`` adds its
A_IJᵀ db_I to the sums of the span's earlier columns; K is recomputed from x, y (the sequential
kernel: from the in-sub-span logits, formed again) and the saved log-normalisers, the back
substitution is in registers);
then e = db ⊙ (K U) summed over the value columns, O(T·d) in torch: Cubit's K U = b − γ U, and
DeltaFormer's as its forward stored it (formed there, as (b − γU)/β would amplify rounding where β
is small); then dx and dy (S = db uᵀ, dx_i = −scale β_i Σ_j K_ij (S_ij − e_i) y_j), in parallel: the
row kernel (``grad_rows_kernel``) gives dx over the columns its rows see and the column kernel
(``grad_columns_kernel``) dy over the rows that see its columns, each writing its own rows once
(the same bits on every run); with bf16 operands (one pass: each pair's logits formed once, the
column kernel's tiles transposed, ``COLUMN_MAJOR``) and where the row kernel spills (``_triton_solve``,
GRADIENT_STREAM_ROWS), the column kernel also gives dx, each (column group, row tile) pair adding its
part with fp32 atomics (on a GPU the order of those additions, so dx's last bits, may then differ from
run to run). With bf16 operands at heads up to 128 wide the gradients are *fused*: the pairs across
spans are the transposed solve's own (a span's columns against the later spans' rows, whose db and e
are known when it runs), so ``future_span_kernel`` with ``GRAD`` forms their dy and dx on its kernel
tiles, and the column kernel (``WITHIN_SPAN``) sums only each span's own rows; β is then folded into
db's bf16 copy (β ⊙ db) and into e (β e), so that no kernel reading the copy multiplies by β.
dγ is a torch reduction of db ⊙ U.

Memory O(T·d): no T×T matrix; the forward saves its inputs, U, the log-normalisers and (DeltaFormer)
K U; each direction holds the in-sub-span logits ([B, H, T, SUBSPAN_ROWS] fp32) while it runs, and with
bf16 operands the forward the across-span kernel's second column half's partials (one [T, d_v] fp32
tensor more) and the backward e and β e.
Softmax, normalisers and systems are fp32, and so are the in-sub-span products and logits
(``input_precision="ieee"``, ``product(..., "fp32")``); with more than one span, the products across spans, the pushes'
and the gradient kernels' take the operands ``kernelmix.ops.solve_operands`` chooses (TF32 by default,
``SPAN_OPERANDS``; the error measured against float64 is at that constant).

Blocks: the row block is ``BLOCK_T = min(64, max(16, next_pow2(chunk_size)))`` (Triton blocks are
powers of two ≥ 16, and tl.dot needs ≥ 16); head dims are padded to ``max(16, next_pow2(d))`` with
masks; the value slice of the span kernels is up to 128 columns on tensor cores (``BLOCK_V =
min(64, max(16, next_pow2(dv)))`` with fp32 operands), the sequential kernels' SUBSTITUTION_VALUES;
the row and column gradient kernels hold all of dv (``BLOCK_DV``). A program of the forward's span
kernel holds ``BLOCK_R`` rows and one of the transposed direction's ``BLOCK_C`` columns (whole row
blocks: ``SPAN_ROW_BLOCKS``, ``SPAN_COLUMN_BLOCKS``), so that each tile they stream serves them all.

On CPU the kernels run under Triton's interpreter (tests, ``TRITON_INTERPRET=1``), where every
call of a device function re-patches ``triton.language`` (≈1 ms): the loops with many iterations
load their tiles inline rather than through the small helpers.
"""

from __future__ import annotations

from ._triton_products import product
from ._triton_solve_tiles import (
    MAX_FLOOR,
    add_to_stored,
    betas,
    doc_starts,
    first_column,
    kernel_tile,
    kernel_tile_transposed,
    load_block,
    masked_logits,
    quarters,
    row_vector,
    store_block,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without Triton (it then defines no kernel)
    triton = None
    tl = None

# LOOPS: loops with run-time bounds are ``while`` loops, not ``range``: Triton 3.6's interpreter
# turns a run-time scalar into a 1-element array, which ``range`` cannot take under NumPy ≥ 2.4
# (int() of a 1-d array is an error there); ``while`` compiles to the same loop on a GPU.

__all__ = ["past_span_kernel", "merge_split_partials_kernel", "future_span_kernel", "grad_rows_kernel",
           "grad_columns_kernel"]


if triton is not None:

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
            logits = masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT, OPERANDS)
            new_max = tl.maximum(row_max, tl.max(logits, 1))
            rescale = tl.exp2(row_max - new_max)
            weights = tl.exp2(logits - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + product(weights, u_tile, OPERANDS)
            row_max = new_max
            j0 += BLOCK_T
        return row_max, row_sum, acc

    @triton.jit
    def past_span_kernel(
        x_ptr, y_ptr, u_ptr, ds_ptr, max_ptr, sum_ptr, acc_ptr, max2_ptr, sum2_ptr, acc2_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud, s_ab, s_ah, s_at, s_ad,
        s_dsb, s_dst, heads, length, dk, dv, scale2, row_start, row_stop, column_start, column_stop,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
        STRICT: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr, CONTINUE: tl.constexpr,
        STREAM_T: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_R`` rows from ``row_start``, value slices), all in parallel: rows
        I against the solved columns [max(first_I, column_start), column_stop), all before its rows, in
        tiles of STREAM_T columns (a divisor of BLOCK_T) that each serve all BLOCK_R rows (BLOCK_R is a
        multiple of BLOCK_T, so a launch's last program may reach past ``row_stop``: only the rows before it
        are stored): the online softmax's running max, sum and Σ_j exp2(s_ij − max) u_j, started afresh or,
        with ``CONTINUE``, carried on from the partials stored (per value slice, so that no slice reads
        another's update); :func:`solve_forward_kernel` continues from them. Launched for a span's rows against every
        earlier span, and, inside a span, for the rows after a solved sub-span against it (a push).
        Its products are the off-diagonal ones, the bulk of the solve: on tensor cores unless
        ``OPERANDS`` is "fp32". With ``SPLITS`` = 2 (only the across-span launch, which a merge follows;
        never a push) the columns are cut in two halves (whole column blocks), a program for each (grid axis
        2: value slice · SPLITS + half): the second half's partials go to ``max2_ptr``, ``sum2_ptr``,
        ``acc2_ptr`` (laid out as the first's), for :func:`merge_split_partials_kernel` to merge."""
        tl.static_assert(SPLITS <= 2 and (SPLITS == 1 or not CONTINUE))
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        i0 = row_start + tl.program_id(1) * BLOCK_R
        rows = i0 + tl.arange(0, BLOCK_R)
        value_slice = tl.program_id(2) // SPLITS
        half = tl.program_id(2) % SPLITS
        vcols = value_slice * BLOCK_V + tl.arange(0, BLOCK_V)
        kcols = tl.arange(0, BLOCK_K)
        ds_ptr += bi * s_dsb
        partials = (value_slice * tl.num_programs(0) + pid).to(tl.int64) * length
        starts = doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = load_block(x_ptr + bi * s_xb + hi * s_xh, i0, kcols, s_xt, s_xd, length, dk, BLOCK_R)
        first = tl.maximum(first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), column_start)
        last = column_stop
        if SPLITS > 1:  # this program's half of the columns, in whole column blocks
            chunk = tl.cdiv(tl.cdiv(column_stop - column_start, SPLITS), BLOCK_T) * BLOCK_T
            first = tl.maximum(first, column_start + half * chunk)
            last = tl.minimum(column_stop, column_start + (half + 1) * chunk)
            if half == 1:
                max_ptr, sum_ptr, acc_ptr = max2_ptr, sum2_ptr, acc2_ptr
        acc_ptr += bi * s_ab + hi * s_ah
        row_max, row_sum, acc = _forward_past(
            x_tile, y_ptr + bi * s_yb + hi * s_yh, u_ptr + bi * s_ub + hi * s_uh, rows, starts, first, last,
            s_yt, s_yd, s_ut, s_ud, length, dk, dv, scale2, vcols, tl.full([BLOCK_R], MAX_FLOOR, dtype=tl.float32),
            tl.zeros([BLOCK_R], dtype=tl.float32), tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32),
            STREAM_T, BLOCK_K, STRICT, OPERANDS,
        )
        # a program of BLOCK_R rows may reach past the rows launched for (the span's end): those it neither
        # reads partials for nor stores
        stop = tl.minimum(row_stop, length)
        if CONTINUE:  # merged with the stored partials after the loop, whose tiles are then dead (ptxas
            # spilled 180 B at d = 128 when they were loaded before it), a quarter of the value columns at a
            # time (see QUARTERS)
            old_max = tl.load(max_ptr + partials + rows, mask=rows < stop, other=MAX_FLOOR)
            old_sum = tl.load(sum_ptr + partials + rows, mask=rows < stop, other=0.0)
            new_max = tl.maximum(old_max, row_max)
            old_scale, scale = tl.exp2(old_max - new_max), tl.exp2(row_max - new_max)
            row_sum = old_sum * old_scale + row_sum * scale
            row_max = new_max
            q0, q1, q2, q3 = quarters(acc, BLOCK_R, BLOCK_V)
            q_cols = value_slice * BLOCK_V + tl.arange(0, BLOCK_V // 4)
            add_to_stored(acc_ptr, i0, q_cols, s_at, s_ad, stop, dv, q0, scale, old_scale, BLOCK_R)
            add_to_stored(acc_ptr, i0, q_cols + BLOCK_V // 4, s_at, s_ad, stop, dv, q1, scale, old_scale, BLOCK_R)
            add_to_stored(acc_ptr, i0, q_cols + BLOCK_V // 2, s_at, s_ad, stop, dv, q2, scale, old_scale, BLOCK_R)
            add_to_stored(acc_ptr, i0, q_cols + 3 * BLOCK_V // 4, s_at, s_ad, stop, dv, q3, scale, old_scale,
                          BLOCK_R)
        else:
            store_block(acc_ptr, i0, vcols, s_at, s_ad, stop, dv, acc, BLOCK_R)
        tl.store(max_ptr + partials + rows, row_max, mask=rows < stop)
        tl.store(sum_ptr + partials + rows, row_sum, mask=rows < stop)

    @triton.jit
    def merge_split_partials_kernel(
        max_ptr, sum_ptr, acc_ptr, max2_ptr, sum2_ptr, acc2_ptr, s_ab, s_ah, s_at, s_ad, heads, length, dv,
        row_start, row_stop, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_T`` rows from ``row_start``, value slices of ``BLOCK_V``): the two
        halves' online-softmax partials of :func:`past_span_kernel` with SPLITS = 2 merged into the first's
        (the larger running max, each half's sum and mix rescaled to it), for the rows before ``row_stop``."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        r0 = row_start + tl.program_id(1) * BLOCK_T
        rows = r0 + tl.arange(0, BLOCK_T)
        stop = tl.minimum(row_stop, length)
        inside = rows < stop
        partials = (tl.program_id(2) * tl.num_programs(0) + pid).to(tl.int64) * length + rows
        first_max = tl.load(max_ptr + partials, mask=inside, other=MAX_FLOOR)
        second_max = tl.load(max2_ptr + partials, mask=inside, other=MAX_FLOOR)
        row_max = tl.maximum(first_max, second_max)
        first_scale, second_scale = tl.exp2(first_max - row_max), tl.exp2(second_max - row_max)
        row_sum = (tl.load(sum_ptr + partials, mask=inside, other=0.0) * first_scale
                   + tl.load(sum2_ptr + partials, mask=inside, other=0.0) * second_scale)
        tl.store(max_ptr + partials, row_max, mask=inside)
        tl.store(sum_ptr + partials, row_sum, mask=inside)
        vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        acc_ptr += bi * s_ab + hi * s_ah
        second = load_block(acc2_ptr + bi * s_ab + hi * s_ah, r0, vcols, s_at, s_ad, stop, dv, BLOCK_T)
        add_to_stored(acc_ptr, r0, vcols, s_at, s_ad, stop, dv, second, second_scale, first_scale, BLOCK_T)

    @triton.jit
    def _transposed_later(
        y_tile, u_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gx_ptr, cols, i_block, end_block,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2, vcols,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        STREAM_T: tl.constexpr, STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
        OPERANDS: tl.constexpr, GRAD: tl.constexpr, ROW_GRAD: tl.constexpr,
    ):
        """Σ_I A_IJᵀ db_I = Σ K_IJᵀ (β_I db_I) over the row blocks [i_block, end_block) that see the
        ``BLOCK_C`` columns J (their db already stored), in row tiles of ``STREAM_T`` (a divisor of BLOCK_T).
        With ``GRAD`` (these rows' e known, the value columns all of dv) also the same pairs' gradients on
        the same kernel tiles: Σ_i K_iJ (db_i·u_J − e_i) x_i (= −dy_J / scale, returned second), and with
        ``ROW_GRAD`` their parts of dx_i = −scale Σ_j K_ij (db_i·u_j − e_i) y_j, added to ``gx_ptr`` by fp32
        atomics (as :func:`_grad_columns_sum`'s transposed tiles). β is then folded into db and e by the
        caller (HAS_BETA off): a β multiply more on the kernel tile spilled 16 B (ptxas, sm_90, d = 128)."""
        kcols = tl.arange(0, BLOCK_K)
        total = tl.zeros([BLOCK_C, BLOCK_V], dtype=tl.float32)
        gradient = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)  # (dead, so no registers, without GRAD)
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
            if GRAD:  # transposed tiles (columns × rows), as _grad_columns_sum's COLUMN_MAJOR (HAS_BETA off)
                kernel = kernel_tile_transposed(y_tile, x_tile, lse_rows, rows, cols, starts, length, scale2, STRICT,
                                                OPERANDS)
                total += product(kernel, db_rows, OPERANDS)
                scores = kernel * (product(u_tile, tl.trans(db_rows), OPERANDS)
                                   - tl.load(e_ptr + rows, mask=inside, other=0.0)[None, :])
                gradient += product(scores, x_tile, OPERANDS)
                if ROW_GRAD:  # relaxed: the sums need no order among themselves, only the launch's end
                    tl.atomic_add(gx_ptr + rows[None, :].to(tl.int64) * s_gxt + kcols[:, None] * s_gxd,
                                  -scale * product(tl.trans(y_tile), scores, OPERANDS),
                                  mask=inside[None, :] & (kcols[:, None] < dk), sem="relaxed")
            else:
                kernel = kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
                if HAS_BETA:  # β_I on K's rows, not on db: a bf16 copy of db is then rounded once, as stored
                    kernel = kernel * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
                total += product(tl.trans(kernel), db_rows, OPERANDS)
            r0 += STREAM_T
        return total, gradient

    @triton.jit
    def future_span_kernel(
        x_ptr, y_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, end_ptr, fut_ptr, u_ptr, e_ptr, gy_ptr, gx_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_dbb, s_dbh, s_dbt, s_dbd, s_fb, s_fh, s_ft, s_fd,
        s_betab, s_betah, s_betat, s_dsb, s_dst, s_ub, s_uh, s_ut, s_ud, s_gyb, s_gyh, s_gyt, s_gyd,
        s_gxb, s_gxh, s_gxt, s_gxd, heads, length, blocks, dk, dv, scale, scale2, column_first,
        column_stop, row_first, row_stop,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        STREAM_T: tl.constexpr, STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr,
        OPERANDS: tl.constexpr, ACCUMULATE: tl.constexpr, GRAD: tl.constexpr, ROW_GRAD: tl.constexpr,
    ):
        """Grid (B·H, blocks of ``BLOCK_C`` columns from column block ``column_first``, value slices), all
        in parallel: columns J against the row blocks [row_first, row_stop) after them that see them,
        each streamed row tile serving all BLOCK_C columns, Σ_I K_IJᵀ (β_I db_I) (their db solved
        already), stored, or with ``ACCUMULATE`` added to what is stored: the transposed solve's
        off-diagonal products, for a span's columns against every later span, and inside a span for
        the columns before a solved sub-span against it (a push); on tensor cores unless ``OPERANDS``
        is "fp32". BLOCK_C is a multiple of BLOCK_T: a launch's last program may reach past column
        block ``column_stop``, and stores only the columns before it. With ``GRAD`` (the later spans, one
        value slice of all dv, β folded into db and e) it also forms those pairs' gradients on the same
        kernel tiles (:func:`_transposed_later`): −scale Σ_i dL_iJ x_i stored as J's dy from the later
        spans (the span's own rows add theirs in :func:`grad_columns_kernel`) and, with ``ROW_GRAD``, dx
        by atomics; the gradient pass over these pairs then forms no logits of its own."""
        tl.static_assert(not (GRAD and HAS_BETA))  # GRAD takes β folded into db's copy and e
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        j_block = column_first + tl.program_id(1) * (BLOCK_C // BLOCK_T)
        cols = j_block * BLOCK_T + tl.arange(0, BLOCK_C)
        vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        y_tile = load_block(y_ptr + bi * s_yb + hi * s_yh, j_block * BLOCK_T, tl.arange(0, BLOCK_K), s_yt, s_yd,
                            length, dk, BLOCK_C)
        # the rows that see a column are a range that ends later for later columns: the last block's end
        last_block = tl.minimum(j_block + BLOCK_C // BLOCK_T, column_stop) - 1
        end_block = tl.minimum(tl.load(end_ptr + bi * blocks + last_block), row_stop)
        if GRAD:  # all of dv (one value slice)
            u_tile = load_block(u_ptr + bi * s_ub + hi * s_uh, j_block * BLOCK_T, vcols, s_ut, s_ud, length, dv,
                                BLOCK_C)
        else:
            u_tile = y_tile  # (not read)
        total, gradient = _transposed_later(
            y_tile, u_tile, x_ptr + bi * s_xb + hi * s_xh, db_ptr + bi * s_dbb + hi * s_dbh,
            beta_ptr + bi * s_betab + hi * s_betah, ds_ptr + bi * s_dsb, lse_ptr + pid.to(tl.int64) * length,
            e_ptr + pid.to(tl.int64) * length, gx_ptr + bi * s_gxb + hi * s_gxh, cols, row_first, end_block,
            s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2, vcols,
            BLOCK_T, BLOCK_K, BLOCK_V, BLOCK_C, STREAM_T, STRICT, HAS_BETA, HAS_DOC, OPERANDS, GRAD, ROW_GRAD,
        )
        fut_ptr += bi * s_fb + hi * s_fh
        stop = tl.minimum(column_stop * BLOCK_T, length)
        if GRAD:
            store_block(gy_ptr + bi * s_gyb + hi * s_gyh, j_block * BLOCK_T, tl.arange(0, BLOCK_K), s_gyt, s_gyd,
                        stop, dk, -scale * gradient, BLOCK_C)
        if ACCUMULATE:  # added to the stored sums a quarter of the value columns at a time (see QUARTERS)
            q0, q1, q2, q3 = quarters(total, BLOCK_C, BLOCK_V)
            q_cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V // 4)
            one = tl.full([BLOCK_C], 1.0, dtype=tl.float32)
            j0 = j_block * BLOCK_T
            add_to_stored(fut_ptr, j0, q_cols, s_ft, s_fd, stop, dv, q0, one, one, BLOCK_C)
            add_to_stored(fut_ptr, j0, q_cols + BLOCK_V // 4, s_ft, s_fd, stop, dv, q1, one, one, BLOCK_C)
            add_to_stored(fut_ptr, j0, q_cols + BLOCK_V // 2, s_ft, s_fd, stop, dv, q2, one, one, BLOCK_C)
            add_to_stored(fut_ptr, j0, q_cols + 3 * BLOCK_V // 4, s_ft, s_fd, stop, dv, q3, one, one, BLOCK_C)
        else:
            store_block(fut_ptr, j_block * BLOCK_T, vcols, s_ft, s_fd, stop, dv, total, BLOCK_C)

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
            kernel = kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
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
        starts = doc_starts(ds_ptr, rows, s_dst, length, HAS_DOC)
        x_tile = load_block(x_ptr + bi * s_xb + hi * s_xh, i0, kcols, s_xt, s_xd, length, dk, BLOCK_R)
        db_rows = load_block(db_ptr + bi * s_dbb + hi * s_dbh, i0, tl.arange(0, BLOCK_DV), s_dbt, s_dbd, length, dv,
                             BLOCK_R)
        lse_rows = row_vector(lse_ptr + pid.to(tl.int64) * length, rows, 1, length, 0.0)
        e_rows = row_vector(e_ptr + pid.to(tl.int64) * length, rows, 1, length, 0.0)
        total = _grad_rows_dx(
            x_tile, db_rows, lse_rows, e_rows, starts, y_ptr + bi * s_yb + hi * s_yh, u_ptr + bi * s_ub + hi * s_uh,
            rows, first_column(ds_ptr, i0, s_dst, BLOCK_T, HAS_DOC), i0, s_yt, s_yd, s_ut, s_ud, length, dk, dv,
            scale2, BLOCK_R, BLOCK_K, BLOCK_DV, STRICT, OPERANDS, STREAM_T,
        )
        factor = -scale * betas(beta_ptr + bi * s_betab + hi * s_betah, rows, s_betat, length, HAS_BETA)
        store_block(gx_ptr + bi * s_gxb + hi * s_gxh, i0, kcols, s_gxt, s_gxd, length, dk, factor[:, None] * total,
                    BLOCK_R)

    @triton.jit
    def _grad_columns_sum(
        y_tile, u_tile, x_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gx_ptr, cols, c0, row_stop,
        s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2,
        BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
        STREAM_T: tl.constexpr, ROW_GRAD: tl.constexpr, COLUMN_MAJOR: tl.constexpr,
    ):
        """Σ_i β_i K_ij (db_i·u_j − e_i) x_i (= −dy_j / scale) for the ``BLOCK_C`` columns J from ``c0`` over
        the rows [c0, ``row_stop``) (those that can see J), streamed in tiles of ``STREAM_T``. With
        ``ROW_GRAD`` also J's part of dx_i = −scale Σ_j β_i K_ij (db_i·u_j − e_i) y_j, added to ``gx_ptr`` (fp32,
        zeroed) with atomics: the row gradient without a pass of its own over the columns."""
        tl.static_assert(not (COLUMN_MAJOR and HAS_BETA))
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
            if COLUMN_MAJOR:
                # the tiles transposed (columns × rows): every product then has the program's BLOCK_C columns
                # as its rows, and a tensor-core product of that many rows reads its other operand from
                # shared memory, where products of STREAM_T rows kept y, U and y again in registers through
                # the loop (ptxas, sm_90, d = 128, bf16, 128 columns with dx: 246 registers, no spill, against
                # 255 and 16-32 B spilled)
                # (no β: COLUMN_MAJOR is bf16 operands', which fold β into db's copy and e)
                scores = product(u_tile, tl.trans(db_rows), OPERANDS) - e_rows[None, :]
                scores = kernel_tile_transposed(y_tile, x_tile, lse_rows, rows, cols, starts, length, scale2, STRICT,
                                                OPERANDS) * scores
                total += product(scores, x_tile, OPERANDS)
                if ROW_GRAD:  # relaxed: the sums need no order among themselves, only the launch's end
                    tl.atomic_add(gx_ptr + rows[None, :].to(tl.int64) * s_gxt + kcols[:, None] * s_gxd,
                                  -scale * product(tl.trans(y_tile), scores, OPERANDS),
                                  mask=inside[None, :] & (kcols[:, None] < dk), sem="relaxed")
            else:
                # rows × columns: with TF32 operands the transposed tiles spilled (1.1-1.6 KB at d = 128)
                scores = product(db_rows, tl.trans(u_tile), OPERANDS) - e_rows[:, None]
                if HAS_BETA:
                    scores = scores * tl.load(beta_ptr + rows.to(tl.int64) * s_betat, mask=inside, other=0.0)[:, None]
                kernel = kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT, OPERANDS)
                scores = kernel * scores
                total += product(tl.trans(scores), x_tile, OPERANDS)
                if ROW_GRAD:  # relaxed: the sums need no order among themselves, only the launch's end
                    tl.atomic_add(gx_ptr + rows[:, None].to(tl.int64) * s_gxt + kcols[None, :] * s_gxd,
                                  -scale * product(scores, y_tile, OPERANDS),
                                  mask=inside[:, None] & (kcols[None, :] < dk), sem="relaxed")
            r0 += STREAM_T
        return total

    @triton.jit
    def grad_columns_kernel(
        x_ptr, y_ptr, u_ptr, db_ptr, beta_ptr, ds_ptr, lse_ptr, e_ptr, gy_ptr, gx_ptr, end_ptr,
        s_xb, s_xh, s_xt, s_xd, s_yb, s_yh, s_yt, s_yd, s_ub, s_uh, s_ut, s_ud,
        s_dbb, s_dbh, s_dbt, s_dbd, s_betab, s_betah, s_betat, s_dsb, s_dst,
        s_gyb, s_gyh, s_gyt, s_gyd, s_gxb, s_gxh, s_gxt, s_gxd,
        heads, length, blocks, dk, dv, scale, scale2, span_rows,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr,
        STRICT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DOC: tl.constexpr, OPERANDS: tl.constexpr,
        STREAM_T: tl.constexpr, ROW_GRAD: tl.constexpr, COLUMN_MAJOR: tl.constexpr, WITHIN_SPAN: tl.constexpr,
    ):
        """Grid (B·H, groups of ``BLOCK_C`` columns, whole column blocks): dy_J = scale Σ_i dL_iJ x_i,
        dL_ij = −β_i K_ij (db_i·u_j − e_i); with ``ROW_GRAD`` also dx, by atomics (:func:`_grad_columns_sum`;
        else :func:`grad_rows_kernel` forms it). With ``WITHIN_SPAN`` only the rows of the columns' own span
        (of ``span_rows`` rows; a group lies in one span), adding to the dy stored: the later spans' rows
        were summed by :func:`future_span_kernel` with ``GRAD``."""
        pid = tl.program_id(0)
        bi = (pid // heads).to(tl.int64)
        hi = (pid % heads).to(tl.int64)
        c0 = tl.program_id(1) * BLOCK_C
        cols = c0 + tl.arange(0, BLOCK_C)
        kcols = tl.arange(0, BLOCK_K)
        y_tile = load_block(y_ptr + bi * s_yb + hi * s_yh, c0, kcols, s_yt, s_yd, length, dk, BLOCK_C)
        u_tile = load_block(u_ptr + bi * s_ub + hi * s_uh, c0, tl.arange(0, BLOCK_DV), s_ut, s_ud, length, dv, BLOCK_C)
        # the rows that see a column are a range that ends later for later columns: the last block's end
        end_block = tl.load(end_ptr + bi * blocks + tl.minimum((c0 + BLOCK_C) // BLOCK_T, blocks) - 1)
        row_stop = end_block * BLOCK_T
        if WITHIN_SPAN:
            row_stop = tl.minimum(row_stop, (c0 // span_rows + 1) * span_rows)
        total = _grad_columns_sum(
            y_tile, u_tile, x_ptr + bi * s_xb + hi * s_xh, db_ptr + bi * s_dbb + hi * s_dbh,
            beta_ptr + bi * s_betab + hi * s_betah, ds_ptr + bi * s_dsb, lse_ptr + pid.to(tl.int64) * length,
            e_ptr + pid.to(tl.int64) * length, gx_ptr + bi * s_gxb + hi * s_gxh, cols, c0, row_stop,
            s_xt, s_xd, s_dbt, s_dbd, s_betat, s_dst, s_gxt, s_gxd, length, dk, dv, scale, scale2,
            BLOCK_C, BLOCK_K, BLOCK_DV, STRICT, HAS_BETA, HAS_DOC, OPERANDS, STREAM_T, ROW_GRAD, COLUMN_MAJOR,
        )
        gy_ptr += bi * s_gyb + hi * s_gyh
        if WITHIN_SPAN:  # added to the later spans' part (future_span_kernel's; zeros for the last span's columns)
            # a quarter of the columns at a time (see QUARTERS: loaded whole, 48 B spilled; ptxas, sm_90, d = 128)
            q0, q1, q2, q3 = quarters(total, BLOCK_C, BLOCK_K)
            q_cols = tl.arange(0, BLOCK_K // 4)
            factor = tl.full([BLOCK_C], -scale, dtype=tl.float32)
            one = tl.full([BLOCK_C], 1.0, dtype=tl.float32)
            add_to_stored(gy_ptr, c0, q_cols, s_gyt, s_gyd, length, dk, q0, factor, one, BLOCK_C)
            add_to_stored(gy_ptr, c0, q_cols + BLOCK_K // 4, s_gyt, s_gyd, length, dk, q1, factor, one, BLOCK_C)
            add_to_stored(gy_ptr, c0, q_cols + BLOCK_K // 2, s_gyt, s_gyd, length, dk, q2, factor, one, BLOCK_C)
            add_to_stored(gy_ptr, c0, q_cols + 3 * BLOCK_K // 4, s_gyt, s_gyd, length, dk, q3, factor, one, BLOCK_C)
        else:
            store_block(gy_ptr, c0, kcols, s_gyt, s_gyd, length, dk, -scale * total, BLOCK_C)
