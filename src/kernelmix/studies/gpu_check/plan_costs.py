"""The cost model of ``kernelmix gpu-check --plan``: FLOPs and bytes one launch of each Triton kernel
moves, and a roofline time on an H200 from them.

**What is counted.** The work the kernel *executes*, tile by tile, at its padded block sizes (a
masked tile costs as much as a full one): the products (``tl.dot``, one multiply-add = 2 FLOPs),
and the global-memory loads and stores it issues, in bytes (fp32 = 4, bf16 = 2, int64 document starts = 8).
Elementwise work (exps, maxima, masks) is left out, as in :mod:`kernelmix.studies.flops`; a tile
loaded again by another program is counted again, so ``bytes`` is what the kernel asks of the memory
system, an upper bound on its DRAM traffic (L2 serves some of it).

**The solve** (Cubit, DeltaFormer; ``n`` row blocks of ``C`` rows in spans, ``P`` (row block,
earlier-span column block) pairs and as many (column block, later-span row block) pairs, ``Q`` pairs
of a row block and an earlier sub-span's column block in the same span, ``L`` / ``S`` tiles on and
below / strictly below the diagonal inside the sub-spans, ``L₀ = n(n+1)/2`` in all, ``s`` value slices
of ``V`` columns, key width ``K``, value width ``D_v``; :func:`span_tiles`, :func:`push_tiles`), per
(batch, head):

    past / future spans   s · P · 2·C²·(K + V)                 logits and mix of every pair (each
                                                               slice recomputes the logits)
                          + P · 2·C²·(2·K + V) (fused)         the future spans' pairs' gradients on the
                                                               same tiles (bf16 operands, one slice):
                                                               db·uᵀ, dy's product with x, dx's with y
    pushes (both ways)    s · Q · 2·C²·(K + V)                 the same, inside the spans
    sub-span logits       2·C²·K·L_C (twice: forward, backward)  every row's logits against its
                                                               sub-span's columns up to its block (L_C:
                                                               the pairs of row blocks on and below the
                                                               diagonal inside the sub-spans), stored
    forward, transposed   s · (2·c²·V·S + c²·V·n)              the sub-spans' own tiles, their logits
                                                               read, and the in-block substitution (in
                                                               blocks of c rows, ``SUBSTITUTION_ROWS``;
                                                               L, S, n counted in those blocks; s slices
                                                               of V = ``SUBSTITUTION_VALUES`` columns)
                          + s · 2·c²·V·n (DeltaFormer's)       the forward's K U (for e), stored
    grad rows             2·C²·(2·K + D_v)·L₀                  logits, db·uᵀ, the product with y: dx
                                                               (where it compiles without spills)
    grad columns          2·C²·(2·K + D_v)·L₀                  logits, db·uᵀ, the product with x: dy;
                          + 2·C²·K·L₀ with dx                  where the row kernel does not run, the
                                                               product with y too, whose C × K part of
                                                               dx per pair is added by fp32 atomics;
                                                               fused: over the spans' own rows only
                                                               (L₀ then counts the pairs inside spans)

The forward's span kernel runs programs of ``SPAN_ROW_BLOCKS`` row blocks (``span_block_r`` rows;
with bf16 operands ``PAST_ROW_BLOCKS``, ``past_block_r``, in ``PAST_SPLITS`` column halves, a program
each, whose partials a merge kernel then reads, both halves', and writes once: 3·(V + 2) fp32 a row),
its pushes ``SPAN_ROW_BLOCKS``, and the transposed direction's span kernel and pushes programs of
``SPAN_COLUMN_BLOCKS`` column blocks (``future_block_c`` columns; a push merges its tile with the
stored one a quarter at a time, the same bytes): P and Q count the pairs they execute, a launch's
last program reaching past its rows (columns) where their blocks do not divide; each program
streams its tiles once for all its rows (columns), so their bytes are those of P / 2 (Q / 2) tiles
at two blocks a program.
The gradient kernels run programs of ``gradient_group`` rows (columns) likewise (L₀ then counts the
pairs they execute, :func:`row_group_tiles`, :func:`column_group_tiles`). e is O(T·d) in torch for
both mixers (DeltaFormer's forward stores K U for it: a [T, D_v] fp32 store more in its sequential
kernel, and a C × C × V product per block).

With bf16 operands (``kernelmix.ops.solve_operands("bf16")``) the span kernels, pushes and gradient kernels read
bf16 copies of x, y, U and db (2 B an element; the sequential kernels store U's and db's copies as
they solve, 2·D_v B a row more; db's is β ⊙ db, so that they read no β); partials, sums, e, dx and dy
stay fp32. At heads up to 128 wide they are *fused*: the transposed direction's span kernel also forms
the gradients of its pairs (the later spans' rows; per streamed row e in and dx's atomics out, per
column U in and dy out), and the column gradient kernel then streams its span's own rows only (its dy
added to the stored one).

**The random features** (Performer, DARKFormer; ``n`` chunks of ``C`` rows in ``n_s`` spans of up to
``S`` chunks, head ``D``; a program's ``M`` features and ``V`` value columns: every feature and a block
of value columns, or, in the two logit gradients, a block of features and every value column; one
side's feature logits cost ``F = 2·C·D·M``), per (batch, head), chunk and block; every kernel but the
scans runs one program per span and block, which walks its chunks and loads or stores its M × V part
of the state once per span. The forward's two kernels form their logits from the rows (C × D each);
the backward's read the ones ``features_logits`` stored (C × M fp32 each, no F):

    span states           F + 2·C·M·V                          keys' logits, ΔS = φᵀ v
    forward (span)        2F + 2·C²·(M + V) + 4·C·M·V          scores, their mix, the entering state,
                                                               the walk's state update
    reverse span states   2·C·M·V                              ΔR = φᵀ ĝ (and c, from g and the output)
    query gradient (span) 2·C²·(M + V) + 4·C·M·V               ĝ vᵀ, stores dL/dℓ^q [C, M]
    key gradient          2·C²·(M + V) + 4·C·M·V               ĝ vᵀ, v Rᵀ, stores dL/dℓ^k [C, M]; the
                                                               walk back extends R
    value gradient        2·C²·(M + V) + 4·C·M·V               scores, stores dv [C, V]; the walk back
                                                               extends R

The feature logits (``F``) stay fp32-accurate: each is three TF32 products on tensor cores
(``Cost.split_flops``, at a third of the TF32 peak); the rest take the kernels' operands (TF32 by
default). The two scans have no products: per (batch, head) and span they read and write the
m × d_v state once (``2·M·D_v`` floats). Every value block recomputes its chunk's features (the
logits' work grows with the blocks); blocks of features form only their own. W is read by every
program of a head but counted once per head: the chunks of a head share it through L2 (1 MB for
all heads at the target). DARKFormer's transform is folded into the projection (W' = W M per head,
formed by torch once per call): its kernels read q and k as Performer's do, and its keys' half norms
½‖M x̃‖² are their own kernel (``features_key_norms``, per block of ``C`` rows: ``2·C·D²``
fp32-accurate FLOPs, k read, one fp32 a row written), once in the forward; the kernels that form or
read key logits read them (one fp32 a row). The logit gradients' feature blocks store disjoint
columns of one T × m tensor per side: nothing is added up after them. torch's work around the kernels
(the per-row 1/den and c, adding the chain's span parts, DARKFormer's W' = W M and its [H, m, d]
and [H, d, d] gradients) is counted from its aten ops (:mod:`.plan_glue`).
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
BF16 = 2
INT64 = 8

# H200 SXM peaks (NVIDIA's datasheet, dense): what the roofline divides by
H200 = dict(sms=132, fp32_flops=67e12, tf32_flops=495e12, bf16_flops=989e12, hbm_bytes_per_s=4.8e12)
PROGRAMS_PER_SM_TARGET = 2  # the target: ≥ 2 programs per SM (264 on an H200)


@dataclass(frozen=True)
class Cost:
    """One launch's executed FLOPs and the bytes it loads and stores."""

    flops: float
    bytes: float
    split_flops: float = 0.0  # of ``flops``, those at fp32 accuracy as three TF32 products ("tf32x3")

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else float("inf")


def span_tiles(blocks: int, span_blocks: int, row_group: int = 1, column_group: int = 1) -> dict:
    """Tile counts of the chunk-parallel solve's ``blocks`` row blocks in spans of ``span_blocks``:
    ``past`` (row block, earlier-span column block) pairs executed, its programs holding ``row_group``
    row blocks each (a span's last may reach past it), ``past_streamed`` the column tiles those
    programs stream; ``future`` (column block, later-span row block) pairs executed by programs of
    ``column_group`` column blocks, ``future_streamed`` the row tiles those stream; and the tiles on
    and below the diagonal inside the spans (``lower``; ``strict`` without the diagonal). Document
    starts would skip some; the count is the dense case."""
    past = past_streamed = future = future_streamed = lower = strict = 0
    for first in range(0, blocks, span_blocks):
        size = min(span_blocks, blocks - first)
        programs = -(-size // row_group)
        past += programs * row_group * first
        past_streamed += programs * first
        column_programs = -(-size // column_group)
        future += column_programs * column_group * (blocks - first - size)
        future_streamed += column_programs * (blocks - first - size)
        lower += size * (size + 1) // 2
        strict += size * (size - 1) // 2
    return dict(past=past, past_streamed=past_streamed, future=future, future_streamed=future_streamed,
                lower=lower, strict=strict)


def row_group_tiles(blocks: int, row_group: int) -> tuple[int, int]:
    """Programs of ``row_group`` row blocks over ``blocks`` row blocks, each streaming the column blocks
    up to its last row (the causal triangle): the (row block, column block) pairs they execute and the
    column tiles they stream (a last program reaching past ``blocks`` streams up to its own last row)."""
    streamed = sum((program + 1) * row_group for program in range(-(-blocks // row_group)))
    return streamed * row_group, streamed


def column_group_tiles(blocks: int, column_group: int, span_blocks: int | None = None) -> tuple[int, int]:
    """Programs of ``column_group`` column blocks over ``blocks`` column blocks, each streaming the row
    blocks from its first column on (the rows that can see it), up to the end of its span of
    ``span_blocks`` (default: all): the pairs they execute and the row tiles they stream."""
    span = span_blocks or blocks
    streamed = sum(min(blocks, (first // span + 1) * span) - first for first in range(0, blocks, column_group))
    return streamed * column_group, streamed


def push_tiles(blocks: int, span_blocks: int, subspan_blocks: int, row_group: int = 1) -> dict:
    """The pushes inside the spans: (row block, earlier sub-span's column block) pairs executed, their
    programs holding ``row_group`` row blocks each, the column tiles those stream (``streamed``), and
    the row blocks whose partials the pushes carry on (``reached``, summed over the pushes, as executed)."""
    pairs = streamed = reached = 0
    for first in range(0, blocks, span_blocks):
        stop = min(first + span_blocks, blocks)
        for sub_first in range(first, stop, subspan_blocks):
            sub_stop = min(sub_first + subspan_blocks, stop)
            programs = -(-(stop - sub_stop) // row_group)
            pairs += programs * row_group * (sub_stop - sub_first)
            streamed += programs * (sub_stop - sub_first)
            reached += programs * row_group
    return dict(pairs=pairs, streamed=streamed, reached=reached)


def solve_cost(name: str, tiles: dict, batch_heads: int, has_beta: bool, has_doc: bool) -> Cost:
    """The executed cost of one solve kernel, summed over its launches in one call (the module
    docstring's formulas, with the products split between the span kernels and the spans' own)."""
    c, k, v, n = tiles["block_t"], tiles["block_k"], tiles["block_v"], tiles["blocks"]
    # the operand tiles (x, y, U, db) of the span kernels, pushes and gradients: bf16 copies with bf16
    # operands, which the sequential kernels store as they solve; everything else (partials, sums, dx, dy) fp32
    shadowed = tiles["operands"] == "bf16"
    ob = BF16 if shadowed else FP32
    if name in ("solve_future_span", "solve_span_push_transposed"):  # the transposed span kernels' wider slices
        v = tiles["future_block_v"]
    elif name in ("solve_past_span", "solve_span_push", "solve_merge_partials"):  # the forward's, wider on tensor cores
        v = tiles["span_block_v"]
    # row (column) blocks per program of the forward's (transposed direction's) span kernels
    past_rows = tiles.get("past_block_r", tiles["span_block_r"])
    count = span_tiles(n, tiles["span_blocks"], past_rows // c, tiles["future_block_c"] // c)
    halves = tiles.get("past_splits", 1)  # the forward's across-span kernel's column halves, a program each
    slices = -(-tiles["dv"] // v)
    row_scalars = (1 + has_beta) * FP32 + has_doc * INT64  # per row: the log-normaliser, β, the document start
    spanned_rows = (n - min(n, tiles["span_blocks"])) * c  # rows after the first span
    spanned_columns = ((n - 1) // tiles["span_blocks"]) * tiles["span_blocks"] * c  # columns before the last span
    if name in ("solve_past_span", "solve_future_span"):
        past = name == "solve_past_span"
        side = "past" if past else "future"
        pairs, streamed = count[side], count[side + "_streamed"]
        flops = slices * pairs * (2 * c * c * k + 2 * c * c * v)
        # the streamed tiles (each column half streamed by its own program: as often in all); the forward: per
        # row its own tile and document start in and partials out, once per column half; the transposed: per
        # column its own tile in, its sums out
        if past:
            moved = slices * (streamed * c * (k + v) * ob
                              + halves * spanned_rows * (k * ob + (v + 2) * FP32 + has_doc * INT64))
        else:
            moved = slices * (streamed * c * ((k + v) * ob + row_scalars) + spanned_columns * (k * ob + v * FP32))
        if not past and tiles.get("fused_gradients"):  # the pairs' gradients on the same kernel tiles (one slice)
            flops += pairs * 2 * c * c * (2 * k + v)  # db·uᵀ, the products with x (dy) and y (dx)
            # per streamed row e in and dx's atomics; per column U in and dy out
            moved += streamed * c * (FP32 + k * FP32) + spanned_columns * (v * ob + k * FP32)
    elif name in ("solve_span_push", "solve_span_push_transposed"):
        transposed = name == "solve_span_push_transposed"
        push = push_tiles(n, tiles["span_blocks"], tiles["subspan_blocks"],
                          (tiles["future_block_c"] if transposed else tiles["span_block_r"]) // c)
        flops = slices * push["pairs"] * (2 * c * c * k + 2 * c * c * v)
        # per pair the streamed tile; per reached block its own tile (x or y) and the partials in and out
        # (the running max and sum and the mix; backward: the sums)
        streamed = (k + v) * ob + transposed * row_scalars
        carried = k * ob + ((2 * v + 4) * FP32 if name == "solve_span_push" else 2 * v * FP32)
        moved = slices * c * (push["streamed"] * streamed + push["reached"] * carried)
    elif name == "solve_merge_partials":  # per row after the first span: both halves' partials in, one out
        flops, moved = 0, slices * spanned_rows * 3 * (v + 2) * FP32
    elif name == "solve_subspan_logits":  # every row against its sub-span's columns up to its block
        flops, moved = _logits_cost(tiles, has_doc)
    elif name in ("solve_forward", "solve_transposed"):
        # the sub-spans' own rows, in substitution blocks of sub_t rows, value slices of sequential_v; the
        # logits read (solve_subspan_logits formed them)
        sub, v = tiles["sub_t"], tiles["sequential_v"]
        slices = -(-tiles["dv"] // v)
        blocks = n * c // sub
        inner = span_tiles(blocks, tiles["subspan_blocks"] * c // sub)
        flops = slices * (2 * sub * sub * v * inner["strict"] + sub * sub * v * blocks)
        scalars = (1 + has_beta) * FP32  # per row: the log-normaliser (stored, or read back), β
        # per tile on and below the diagonal its logits; per earlier tile its solved (or db) rows; per block:
        # b (dU) in, U (db) out, the row scalars, and the partials (sums) from outside the sub-span
        moved = slices * (inner["lower"] * sub * sub * FP32 + inner["strict"] * sub * v * FP32
                          + blocks * sub * (2 * v * FP32 + scalars)
                          + (n - min(n, tiles["subspan_blocks"])) * c * (v + 2 * (name == "solve_forward")) * FP32)
        if name == "solve_transposed":  # the later tiles load their row scalars too
            moved += slices * inner["strict"] * sub * scalars
        moved += shadowed * slices * blocks * sub * v * BF16  # the bf16 copy of U (db) stored
        if name == "solve_forward" and has_beta:  # DeltaFormer's K U (for e): K_II U_I and its store
            flops += slices * 2 * sub * sub * v * blocks
            moved += slices * blocks * sub * v * FP32
    elif name in ("solve_grad_rows", "solve_grad_columns"):
        flops, moved = _gradient_cost(name, tiles, ob, row_scalars)
    else:
        raise ValueError(f"no cost model for kernel {name!r}")
    return Cost(batch_heads * flops, batch_heads * moved)


def _logits_cost(tiles: dict, has_doc: bool) -> tuple[float, float]:
    """:func:`solve_cost`'s sub-span logits, per (batch, head), launched twice (the forward's, the
    backward's: not kept between): FLOPs and bytes."""
    # its programs' rows (the row block, or fewer at wide keys), counted in blocks of that many rows
    c, k = tiles.get("logit_rows", tiles["block_t"]), tiles["block_k"]
    n = tiles["blocks"] * tiles["block_t"] // c
    within = span_tiles(n, tiles["subspan_blocks"] * tiles["block_t"] // c)["lower"]  # (row, column) block pairs
    # per row its document start; per pair the column block's y in, the C × C logits out, and the row
    # block's x again for each of its column tiles (the product runs over parts of the head, reloaded)
    moved = n * c * has_doc * INT64 + within * c * (k + k * c // tiles["logit_stream"] + c) * FP32
    return 2 * 2 * c * c * k * within, 2 * moved


def _gradient_cost(name: str, tiles: dict, ob: int, row_scalars: int) -> tuple[float, float]:
    """:func:`solve_cost`'s gradient kernels, per (batch, head): FLOPs and bytes (operands of ``ob`` bytes,
    ``row_scalars`` bytes per row)."""
    c, k, dv, n = tiles["block_t"], tiles["block_k"], tiles["block_dv"], tiles["blocks"]
    if name == "solve_grad_rows":  # dx: every program streams the columns its rows see (y and U)
        pairs, streamed = row_group_tiles(n, tiles["gradient_group"] // c)
        flops = 2 * c * c * (2 * k + dv) * pairs
        # per streamed tile y and U; per row x, db, the row scalars and e in, dx out
        moved = streamed * c * (k + dv) * ob + n * c * ((k + dv) * ob + row_scalars + FP32 + k * FP32)
    else:  # dy; without the row kernel also dx, added by atomics
        atomics = not tiles["dx_rows"]
        within = tiles.get("fused_gradients", False)  # the spans' own rows only (the span kernel did the rest)
        pairs, streamed = column_group_tiles(n, tiles["gradient_group"] // c, tiles["span_blocks"] if within else n)
        flops = 2 * c * c * (2 * k + dv + atomics * k) * pairs
        # per streamed tile x and db, the row scalars and e (and dx's atomics, fp32); per column y and U in,
        # dy out (and in: added to the span kernel's)
        moved = (streamed * c * ((k + dv) * ob + row_scalars + FP32 + atomics * k * FP32)
                 + n * c * ((k + dv) * ob + (1 + within) * k * FP32))
    return flops, moved


def feature_cost(name: str, tiles: dict, batch_heads: int, value_blocks: int) -> Cost:
    """The executed cost of one launch of a random-feature kernel (the module docstring's formulas)."""
    if name in ("features_chain", "features_chain_rows", "features_chain_weights", "features_chain_norm"):
        return chain_cost(name, tiles, batch_heads)
    c, d, m, v, n = tiles["block_t"], tiles["block_d"], tiles["block_m"], tiles["block_v"], tiles["chunks"]
    norms = c * FP32 if tiles.get("has_transform") else 0  # DARKFormer's keys' half norms, read per chunk
    if name == "features_key_norms":  # ½‖M x̃‖² over a block of rows, fp32-accurate; M counted once per head
        rows = c * d  # read in the rows' dtype, one fp32 a row written
        moved = n * (rows * tiles.get("key_bytes", FP32) + c * FP32) + d * d * FP32
        return Cost(batch_heads * n * 2 * rows * d, batch_heads * moved, split_flops=batch_heads * n * 2 * rows * d)
    if name in ("features_state_scan", "features_reverse_scan"):
        steps = tiles["spans"]
        scan_m, scan_v = tiles["scan_tile"]
        state = -(-tiles["features"] // scan_m) * scan_m * -(-tiles["value_dim"] // scan_v) * scan_v
        normaliser = -(-tiles["features"] // scan_m) * scan_m
        per_step = 2 * (state + normaliser) * FP32 + 3 * FP32 + INT64  # the slot read, then overwritten
        return Cost(0.0, batch_heads * (steps * per_step + 2 * (state + normaliser) * FP32))
    if name == "features_logits":  # ℓ = W x̃ of a block of rows, fp32-accurate; W counted once per head
        moved = n * (c * (d * tiles.get("key_bytes", FP32) + m * FP32) + norms) + m * d * FP32
        return Cost(batch_heads * n * 2 * c * d * m, batch_heads * moved, split_flops=batch_heads * n * 2 * c * d * m)
    if name in ("features_chunk_states", "features_forward"):  # the forward's kernels form the logits from rows
        side = 2 * c * d * m  # one side's feature logits (DARKFormer's with W' = W M and the stored half norms)
        parameters = m * d * FP32  # W: the head's programs share it through L2, counted once per head below
        rows = c * d * tiles.get("key_bytes", FP32)  # one side's rows
    else:  # the backward's read the stored logits (``features_logits``): they form none
        side, parameters = 0, 0
        rows = c * m * FP32  # one side's logits, this program's block of features
    values = c * v * tiles.get("value_bytes", FP32)  # v, g, the output, dv: in the rows' dtype
    state = (m * v + m) * FP32
    scalars = 3 * c * FP32 + c * INT64  # shift, query max or c_i, and document starts
    walk = 2 * c * m * v if name in ("features_forward", "features_query_grad", "features_key_grad",
                                     "features_value_grad") else 0
    if name == "features_chunk_states":
        logits, products = side, 2 * c * m * v
        per_chunk = rows + values + scalars + norms
    elif name in ("features_forward", "features_query_grad"):
        logits, products = 2 * side, 2 * c * c * (m + v) + 2 * c * m * v + walk
        # the forward stores the output, and at fp32 too when the rows are narrower (the backward's c)
        kept = c * v * FP32 if tiles.get("value_bytes", FP32) < FP32 else 0
        stored = values + kept if name == "features_forward" else c * m * FP32
        per_chunk = 2 * rows + (2 if name == "features_query_grad" else 1) * values + scalars + stored
        per_chunk += norms if name == "features_forward" else 0
    elif name == "features_reverse_states":  # with forms_c it also reads the fp32 output and stores c
        logits, products = side, 2 * c * m * v
        per_chunk = rows + values + scalars + tiles.get("forms_c", False) * (c * v * FP32 + c * FP32)
    elif name == "features_key_grad":  # ĝ vᵀ, its transpose against φq, v Rᵀ, and the walk's R update
        logits, products = 2 * side, 2 * c * c * (m + v) + 2 * c * m * v + walk
        per_chunk = 2 * rows + 2 * values + scalars + c * m * FP32
    elif name == "features_value_grad":  # the scores, their transpose against ĝ, φk R, and the walk's R update
        logits, products = 2 * side, 2 * c * c * (m + v) + 2 * c * m * v + walk
        per_chunk = 2 * rows + 2 * values + scalars
    else:
        raise ValueError(f"no cost model for kernel {name!r}")
    chunk_programs = batch_heads * value_blocks * n  # the span programs' walks over their chunks, in all
    # a span program loads or stores its state once per span; the forward stores the scale entering
    # each chunk and the key gradient reads it back (one number per chunk)
    scales = chunk_programs * FP32 if name in ("features_forward", "features_key_grad", "features_value_grad") else 0
    once = batch_heads * value_blocks * tiles["spans"] * state + scales
    return Cost(chunk_programs * (logits + products), chunk_programs * per_chunk + once + batch_heads * parameters,
                split_flops=chunk_programs * logits)


def chain_cost(name: str, tiles: dict, batch_heads: int) -> Cost:
    """One launch of the backward's chain through the feature map, per (batch, head) over all T rows: the
    row kernel's G W (2·T·m·d, G read in fp32, x read for the keys' term, out written; W once per head,
    shared through L2; DARKFormer's keys' term x Σ, 2·T·d² more, Σ once per head and the row sums
    written), the weight kernel's span parts of Gᵀ x (2·T·m·d; each block of G's columns reads x again;
    the parts written, one m × d per span), and DARKFormer's C = Σ s x xᵀ (the same kernel with
    G = s x: 2·T·d², s and x read, x again per block of its columns). The fused pass does the row and
    weight kernels' products on one read of G and x (with the x term, x's columns again as out's
    columns are formed), out and the parts written."""
    length, m, d = tiles["length"], tiles["features"], tiles["block_d"]
    key_bytes = tiles.get("key_bytes", FP32)
    if name == "features_chain":
        moved = length * (m * FP32 + d * key_bytes * (1 + tiles.get("x_term", False))
                          + d * tiles.get("value_bytes", FP32)) + m * d * FP32 + tiles["chain_spans"] * m * d * FP32
        return Cost(batch_heads * 4 * length * m * d, batch_heads * moved)
    if name == "features_chain_rows":
        flops = 2 * length * m * d
        moved = length * (m * FP32 + d * key_bytes + d * tiles.get("value_bytes", FP32)) + m * d * FP32
        if tiles.get("has_transform"):
            flops += 2 * length * d * d
            moved += length * FP32 + d * d * FP32
        return Cost(batch_heads * flops, batch_heads * moved)
    width = tiles.get("chain_width", m)  # G's columns: m, or d for C
    blocks = -(-width // tiles["chain_columns"])
    # G: dℓ in fp32, or for C each column block's s and its columns of x
    read = blocks * (FP32 + tiles["chain_columns"] * key_bytes) if name == "features_chain_norm" else width * FP32
    moved = length * (read + blocks * d * key_bytes) + tiles["chain_spans"] * width * d * FP32
    return Cost(batch_heads * 2 * length * width * d, batch_heads * moved)


def recurrence_cost(name: str, tiles: dict, batch_heads: int, value_blocks: int) -> Cost:
    """The executed cost of one launch of Cubit-RF's state recurrence: per program and chunk, the forward's
    two products (A_c R, K_cᵀ(X_c − A_c R): 4 C m v) with X_c, A_c, K_c read and R_{c−1} stored; the
    backward's walk two (K_c G, A_cᵀ W_c: 4 C m v) with A_c, K_c and dL/dR_{c−1} read and G_c stored
    (the chunks' own gradients are torch products after it, not counted here)."""
    c, m, v, n = tiles["block_c"], tiles["block_m"], tiles["block_v"], tiles["chunks"]
    rows, features, state = c * v * FP32, 2 * c * m * FP32, m * v * FP32
    if name == "cubit_rf_recurrence":
        flops, moved = 4 * c * m * v, rows + features + state + FP32
    elif name == "cubit_rf_recurrence_backward":
        flops, moved = 4 * c * m * v, features + 2 * state + FP32
    else:
        raise ValueError(f"no cost model for kernel {name!r}")
    programs = batch_heads * value_blocks
    return Cost(programs * n * flops, programs * n * moved)


def roofline_seconds(cost: Cost, programs: int, peak_flops: float, machine: dict = H200) -> float:
    """A launch's roofline time: its FLOPs at the peak that the programs can occupy (a grid of fewer
    programs than SMs leaves the rest idle; ``cost.split_flops`` as three TF32 products, the rest at
    ``peak_flops``) or its bytes at the HBM bandwidth, whichever is slower. Its compute term is optimistic
    (one program per SM rarely reaches the SM's peak); its byte term is not a bound either way: the bytes
    count every tile a program streams as asked of HBM again, where L2 serves part of them on a GPU. So
    it is a lower bound on a machine whose L2 served no re-read, not on an H200."""
    busy = min(1.0, programs / machine["sms"])
    compute = (cost.flops - cost.split_flops) / peak_flops + 3 * cost.split_flops / machine["tf32_flops"]
    return max(compute / busy, cost.bytes / machine["hbm_bytes_per_s"])


def sdpa_cost(batch: int, heads: int, length: int, head_dim: int) -> tuple[Cost, Cost]:
    """Causal flash attention's forward and backward (FLOPs over the causal half; the backward's five
    products against the forward's two: 2.5×), bytes of q, k, v, o in bf16 (and their gradients)."""
    forward = 4 * batch * heads * length * length * head_dim / 2
    tensors = batch * heads * length * head_dim * 2  # one [B, H, T, d] tensor in bf16
    return Cost(forward, 4 * tensors), Cost(2.5 * forward, 8 * tensors)


def sdpa_streamed_cost(batch: int, heads: int, length: int, head_dim: int, block: int = 128) -> tuple[Cost, Cost]:
    """:func:`sdpa_cost` with its bytes counted by this model's rule for our kernels: every tile a
    program streams asked of memory again. Flash attention's forward in programs of ``block`` query
    rows, each streaming the K and V tiles of the columns it sees; its backward as two kernels (as
    FlashAttention-2's, after its pass forming dO·O per row): programs of ``block`` columns streaming
    the q, dO rows (bf16) and their log-normaliser and dO·O (fp32) of the rows that see them (dK, dV),
    and programs of ``block`` rows streaming K and V again (dQ); each also reads its own tiles and
    writes its outputs once."""
    forward, _ = sdpa_cost(batch, heads, length, head_dim)
    blocks = -(-length // block)
    tiles = blocks * (blocks + 1) // 2  # (row block, column block) pairs on and below the diagonal
    row = head_dim * BF16  # one row of q, k, v, o or a gradient, in bf16
    own = length * (2 * row + FP32)  # q in, o and the log-normaliser out (k and v: the streamed tiles)
    moved = tiles * block * 2 * row + own
    # o and dO in, dO·O out (its pass); k, v in, dk, dv out (dK, dV); q, dO, the two row scalars in, dq out (dQ)
    backward_own = length * (2 * row + FP32) + length * 4 * row + length * (3 * row + 2 * FP32)
    backward_moved = tiles * block * (2 * row + 2 * FP32) + tiles * block * 2 * row + backward_own
    bh = batch * heads
    return Cost(forward.flops, bh * moved), Cost(2.5 * forward.flops, bh * backward_moved)


__all__ = ["Cost", "FP32", "H200", "PROGRAMS_PER_SM_TARGET", "feature_cost", "roofline_seconds",
           "sdpa_cost", "sdpa_streamed_cost", "push_tiles", "solve_cost", "span_tiles", "row_group_tiles",
           "column_group_tiles"]
