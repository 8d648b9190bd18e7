"""The small device functions the solve's Triton kernels share (``_triton_solve_kernels``: the span
and gradient kernels; ``_triton_solve_sequential``: the in-sub-span ones): tile loads and stores,
per-row scalars, the masked base-2 logits and the kernel tile recomputed from them, and the online
softmax's stored partials."""

from __future__ import annotations

from ._triton_products import product

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without Triton (it then defines no device function)
    triton = None
    tl = None

# The running maximum starts at a finite floor, not −inf: a row whose visible columns all lie in
# later blocks then keeps exp2(s − m) = 0 and a rescale factor of 1, with no inf − inf = NaN.
MAX_FLOOR = -1.0e30 if tl is None else tl.constexpr(-1.0e30)

__all__ = ["MAX_FLOOR", "load_block", "store_block", "quarters", "add_to_stored", "row_vector", "doc_starts", "betas",
           "first_column", "masked_logits", "kernel_tile", "kernel_tile_transposed", "span_partials"]


if triton is not None:

    @triton.jit
    def load_block(ptr, row0, cols, stride_t, stride_d, length, width, ROWS: tl.constexpr):
        """The [ROWS, cols] tile at rows [row0, row0 + ROWS) of a [T, width] matrix at ``ptr`` (zeros
        outside). The block's first row is offset in 64 bits, the rows and columns inside it in 32
        (``_triton_solve`` makes every tensor's strides fit): 64-bit offsets for every element of a
        128 × 128 tile take 128 registers a thread, and storing the gradient kernels' 128 rows that way
        spilled 536 B (ptxas, sm_90, d = 128; with these offsets, 128 registers and no spill)."""
        index = tl.arange(0, ROWS)
        offsets = index[:, None] * stride_t + cols[None, :] * stride_d
        return tl.load(ptr + row0.to(tl.int64) * stride_t + offsets,
                       mask=((row0 + index)[:, None] < length) & (cols[None, :] < width), other=0.0)

    @triton.jit
    def store_block(ptr, row0, cols, stride_t, stride_d, length, width, value, ROWS: tl.constexpr):
        """Store ``value`` as :func:`load_block` reads a tile (the rows from ``length`` on left alone)."""
        index = tl.arange(0, ROWS)
        offsets = index[:, None] * stride_t + cols[None, :] * stride_d
        tl.store(ptr + row0.to(tl.int64) * stride_t + offsets, value,
                 mask=((row0 + index)[:, None] < length) & (cols[None, :] < width))

    @triton.jit
    def quarters(tile, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """The four quarters of a [ROWS, COLUMNS] tile's columns, left to right (COLUMNS a multiple of 4).
        QUARTERS: a span kernel that adds its tile to a stored one (the pushes) does it a quarter at a
        time (:func:`add_to_stored`), so that it holds a quarter of the stored tile at once, not all of
        it: 128 rows or columns of a 128-wide head, merged whole, spilled 72-128 B (ptxas, sm_90), by
        quarters nothing."""
        left, right = tl.split(tl.permute(tl.reshape(tile, [ROWS, 2, COLUMNS // 2]), [0, 2, 1]))
        first, second = tl.split(tl.permute(tl.reshape(left, [ROWS, 2, COLUMNS // 4]), [0, 2, 1]))
        third, fourth = tl.split(tl.permute(tl.reshape(right, [ROWS, 2, COLUMNS // 4]), [0, 2, 1]))
        return first, second, third, fourth

    @triton.jit
    def add_to_stored(ptr, row0, cols, stride_t, stride_d, length, width, part, part_scale, stored_scale,
                      ROWS: tl.constexpr):
        """Replace the stored tile at rows [row0, row0 + ROWS) and ``cols`` by stored_scale · it +
        part_scale · ``part`` (the scales per row)."""
        stored = load_block(ptr, row0, cols, stride_t, stride_d, length, width, ROWS)
        store_block(ptr, row0, cols, stride_t, stride_d, length, width,
                    stored * stored_scale[:, None] + part * part_scale[:, None], ROWS)

    @triton.jit
    def row_vector(ptr, rows, stride_t, length, other):
        return tl.load(ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=other)

    @triton.jit
    def doc_starts(ds_ptr, rows, stride_t, length, HAS_DOC: tl.constexpr):
        """The first visible column of each row: its document's start (0 with one document)."""
        if HAS_DOC:
            return tl.load(ds_ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=0).to(tl.int32)
        return tl.zeros(rows.shape, dtype=tl.int32)

    @triton.jit
    def betas(beta_ptr, rows, stride_t, length, HAS_BETA: tl.constexpr):
        if HAS_BETA:
            return tl.load(beta_ptr + rows.to(tl.int64) * stride_t, mask=rows < length, other=0.0)
        return tl.full(rows.shape, 1.0, dtype=tl.float32)

    @triton.jit
    def first_column(ds_ptr, i0, stride_t, BLOCK_T: tl.constexpr, HAS_DOC: tl.constexpr):
        """The first column block (as a column index) any row of the block at ``i0`` sees: doc_start
        is non-decreasing, so the block's first row has the earliest document start."""
        if HAS_DOC:
            return (tl.load(ds_ptr + i0 * stride_t).to(tl.int32) // BLOCK_T) * BLOCK_T
        return 0

    @triton.jit
    def masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT: tl.constexpr,
                            OPERANDS: tl.constexpr):
        """Base-2 logits scale·log2(e)·x_i·y_j of a tile, the product's operands as ``OPERANDS`` says
        (``product``), −inf where column j is hidden from row i (the future, the diagonal when
        ``STRICT``, other documents, padding)."""
        logits = product(x_tile, tl.trans(y_tile), OPERANDS) * scale2
        visible = (cols[None, :] >= starts[:, None]) & (rows[:, None] < length) & (cols[None, :] < length)
        if STRICT:
            visible = visible & (cols[None, :] < rows[:, None])
        else:
            visible = visible & (cols[None, :] <= rows[:, None])
        return tl.where(visible, logits, float("-inf"))

    @triton.jit
    def kernel_tile(x_tile, y_tile, lse_rows, rows, cols, starts, length, scale2, STRICT: tl.constexpr,
                          OPERANDS: tl.constexpr):
        """The normalised kernel tile K_IJ, recomputed from the saved base-2 log-normalisers (hidden
        entries are −inf, and exp2(−inf − lse) = 0: lse is finite, 0 for an empty row)."""
        logits = masked_logits(x_tile, y_tile, rows, cols, starts, length, scale2, STRICT, OPERANDS)
        return tl.exp2(logits - lse_rows[:, None])

    @triton.jit
    def kernel_tile_transposed(y_tile, x_tile, lse_rows, rows, cols, starts, length, scale2, STRICT: tl.constexpr,
                               OPERANDS: tl.constexpr):
        """:func:`kernel_tile` transposed, K_IJᵀ (columns × rows), formed as y·xᵀ: the same products,
        masks and log-normalisers, for a kernel whose products take its columns as their rows."""
        logits = product(y_tile, tl.trans(x_tile), OPERANDS) * scale2
        visible = (cols[:, None] >= starts[None, :]) & (rows[None, :] < length) & (cols[:, None] < length)
        if STRICT:
            visible = visible & (cols[:, None] < rows[None, :])
        else:
            visible = visible & (cols[:, None] <= rows[None, :])
        return tl.exp2(tl.where(visible, logits, float("-inf")) - lse_rows[None, :])

    @triton.jit
    def span_partials(max_ptr, sum_ptr, acc_ptr, row0, vcols, s_at, s_ad, length, dv,
                      BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, HAS_PAST: tl.constexpr):
        """Where the online softmax of rows [row0, row0 + BLOCK_T) starts: the past spans' partials
        (running max, sum and mix, :func:`past_span_kernel`), or nothing seen yet."""
        if HAS_PAST:
            rows = row0 + tl.arange(0, BLOCK_T)
            row_max = tl.load(max_ptr + rows, mask=rows < length, other=MAX_FLOOR)
            row_sum = tl.load(sum_ptr + rows, mask=rows < length, other=0.0)
            acc = load_block(acc_ptr, row0, vcols, s_at, s_ad, length, dv, BLOCK_T)
        else:
            row_max = tl.full([BLOCK_T], MAX_FLOOR, dtype=tl.float32)
            row_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
            acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        return row_max, row_sum, acc
