"""The Python side of the Triton solve (Cubit and DeltaFormer): input checks, the launches of the
kernels in ``_triton_solve_kernels`` (whose docstring derives the forward and the backward) and the
autograd function (``_triton_solve_plan`` lists the launches for ``kernelmix gpu-check --plan``).

    A U = b,   A = diag(β) K + γ_h I,   K_ij = softmax over visible j of (scale · x_i·y_j).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..errors import KernelmixError
from ._backend import SOLVE_OPERAND_CHOICES, chosen_solve_operands, defined_for_the_interpreter

try:
    import triton
    from ._triton_solve_kernels import (
        future_span_kernel,
        grad_columns_kernel,
        grad_rows_kernel,
        merge_split_partials_kernel,
        past_span_kernel,
    )
    from ._triton_solve_sequential import solve_forward_kernel, solve_transposed_kernel, subspan_logits_kernel
except ImportError:  # the module imports without Triton; triton_kernel_solve then says what to install
    triton = None

LOG2E = 1.0 / math.log(2.0)
# The chunk-parallel solve cuts the rows into spans of SPAN_ROWS (whole row blocks): per span, one
# launch computes every row's products with all earlier spans in parallel (the bulk of the work, on
# tensor cores with SPAN_OPERANDS), then the span's own rows are solved (SUBSPAN_ROWS below).
# SPAN_OPERANDS: "tf32" (measured against float64 under the interpreter, operands rounded as the GPU
# does: relative error ≤ 1.3e-4 in U and db, 8.6e-4 in dx, dy, dβ; 1.5e-3 in dγ at Cubit's tiny
# ridge), "bf16" (≤ 1.1e-3, 7.9e-3; 1.3e-2 in dγ; read from bf16 copies of x, y, U and db: half the
# bytes, at the bf16 peak) or "fp32" (CUDA cores, 1e-7). T ≤ SPAN_ROWS is one span: full fp32.
SPAN_ROWS = 1024
SPAN_OPERANDS = "tf32"
# Inside a span, the sequential launch solves SUBSPAN_ROWS rows at a time (whole row blocks); after
# each sub-span, one parallel launch pushes its solved rows into the online softmax of the span's
# later rows (forward; backward: into the sums of the span's earlier columns). The sequential work,
# on B·H·(value slices) programs only, is then ∝ T·SUBSPAN_ROWS instead of T·SPAN_ROWS (plan.md: 3.2
# ms of 21.3 per direction at the target shape with whole spans), for 2·(SPAN_ROWS / SUBSPAN_ROWS − 1)
# more launches per span. The pushes' products take SPAN_OPERANDS like the span kernels'.
SUBSPAN_ROWS = 128
# A program of the forward's span kernel holds SPAN_ROW_BLOCKS row blocks against each streamed column
# tile: the products per byte streamed grow with its rows, and these kernels are bound by their bytes.
# ptxas (sm_90, d = 128, 8 warps) at 128 rows and one 128-column slice: 214 registers with either
# operands, no spill. Its pushes do the same, merging their rows with the stored partials a quarter of
# the value columns at a time (``quarters`` in ``_triton_solve_tiles``: 109-218 registers; merged whole,
# 128 rows of a 128-column slice spilled 72-128 B, so they kept one row block until then).
SPAN_ROW_BLOCKS = 2
# With bf16 operands (heads up to 128 wide) the forward's across-span kernel holds PAST_ROW_BLOCKS row blocks
# (256 rows) streaming the columns 16 at a time (ptxas, sm_90, d = 128, 8 warps: 236 registers, no spill;
# with TF32 operands 944 B spilled, at 16 warps 500 B), and cuts the earlier spans' columns in
# PAST_SPLITS halves, a program each, so that the launch keeps its 128 programs; a small kernel then
# merges the halves' partials (``merge_split_partials_kernel``). Each streamed tile serves twice the rows:
# at the target the kernel's bytes fall from 1,969 to about 1,100 MB (0.41 ms, bound by them, to its
# products' 0.25). Its pushes, which reach at most a span's rows, keep SPAN_ROW_BLOCKS (programs of 256
# rows would leave most SMs idle).
PAST_ROW_BLOCKS = 4
PAST_SPLITS = 2
PAST_STREAM_COLUMNS = 16
MERGE_ROWS = 32  # rows per program of the merge (512 programs a span at the target)
# The forward's span kernel and pushes stream the columns SPAN_STREAM_COLUMNS at a time and hold up to 128
# value columns with either tensor-core operands: with TF32 ones, 64-column tiles spilled 68 B at 128
# value columns (216 B with 64-bit in-block offsets), so they took two slices of 64, each forming the
# logits again; 32-column tiles: 214-218 registers, no spill (ptxas, sm_90, d = 128). With TF32 operands
# and 256-wide keys (WIDE_KEYS: the plan's gemma3 shape) 128 value columns spilled 76-348 B however streamed, and
# 64 in tiles of 32 or 64 spilled 28-300 B: there 64 value columns streamed 16 at a time (230-236, none).
SPAN_STREAM_COLUMNS = 32
# A program of the transposed direction's span kernel and of its pushes holds SPAN_COLUMN_BLOCKS column
# blocks against each streamed row tile, for the same reason as SPAN_ROW_BLOCKS, streaming the rows in
# tiles of FUTURE_STREAM_ROWS (ptxas, sm_90, 8 warps: 202-238 registers, no spill; at 128-wide heads
# with TF32 operands 210 since its tiles' offsets inside a block are 32-bit, where 64-bit ones spilled
# 96-176 B). The pushes add to the stored sums a quarter of the value columns at a time (at 128-wide
# heads, adding the whole tile spilled 84-104 B with two column blocks, so they kept one until then).
# With TF32 operands at WIDE_KEYS they hold one column block, still streaming 16 rows at a time.
SPAN_COLUMN_BLOCKS = 2
FUTURE_STREAM_ROWS = 16
# Rows per block of the in-span substitutions (the rest tile by BLOCK_T): at 64 rows of a 128-wide head
# ptxas (sm_90) spilled 15-22 KB per thread; at 16, 0-1.5 KB.
SUBSTITUTION_ROWS = 16
# The sequential kernels read their rows' logits against the sub-span (one parallel launch forms them
# all first) and split the value columns into slices of SUBSTITUTION_VALUES: each slice repeats only
# the softmax and the substitution, not the logits, so narrow slices give the sequential launches more
# programs for little more work (the plan's cost model, T = 8,192: 32 the fastest of 16, 32 and 64 at
# d = 128, within 1% of 16 at d = 64). The logits launch: a program per row block, column tiles of
# SUBSTITUTION_LOGIT_COLUMNS, fp32 products over SUBSTITUTION_LOGIT_CHUNK of the head at a time (ptxas,
# sm_90, d = 128, 64 rows, 8 warps: 184 registers, no spill; the whole head at once spilled 3.4 KB).
# At WIDE_KEYS, programs of SUBSTITUTION_LOGIT_WIDE_ROWS rows and column tiles of SUBSTITUTION_LOGIT_WIDE_COLUMNS,
# still at 8 warps (at 64 rows 24-64 B spilled however the head or the columns were cut; at 32 rows and 16
# columns 173 registers, none).
SUBSTITUTION_VALUES = 32
SUBSTITUTION_LOGIT_COLUMNS = 32
SUBSTITUTION_LOGIT_CHUNK = 16
SUBSTITUTION_LOGIT_WIDE_ROWS = 32
SUBSTITUTION_LOGIT_WIDE_COLUMNS = 16
# Padded key width from which the kernels take the narrower blocks that compile there (keys of 129-256: Gemma
# 3's head; ptxas, sm_90, results/gpu-plan's gemma3 shape)
WIDE_KEYS = 256
# The gradients, given e (Cubit: e_i = db_i·(b − γU)_i; DeltaFormer: db_i·(K U)_i, K U stored by its
# forward). With TF32 operands at heads up to 64 wide they are two passes over the pairs (ptxas, sm_90,
# 8 warps, GRADIENT_GROUP_BLOCKS row (column) blocks a program: 128 rows or columns, 179-252 registers):
# the row kernel forms dx (own: x, db and the dx accumulator; streams y, U) and the column kernel dy
# (own: y, U and the dy accumulator; streams x, db), each writing its rows once: no atomics, the same
# bits on every run. Elsewhere the column kernel also forms dx, adding each (column group, row tile)
# pair's part by fp32 atomics, streaming GRADIENT_WIDE_STREAM_ROWS rows (at 128-wide heads, and with bf16
# operands at any):
# - bf16 operands: 128 columns a program, its tiles transposed (``COLUMN_MAJOR``: 246 registers at
#   d = 128, no spill). One pass forms each pair's logits and db·uᵀ once where two passes form them
#   twice: 2/3 of the two passes' products (the plan: 0.95 ms against 0.48 + 0.50 at the target; the
#   solve's products alone, 2.69× SDPA with two passes, fell to 2.40×). At heads up to 128 wide the
#   pairs across spans are then summed by the transposed solve's span kernel (FUSED_GRADIENTS in
#   ``SolveLayout``: 254 registers, no spill), the column kernel only the spans' own rows (212): 0.42 + 0.95
#   ms became 0.83 + 0.17 at the target, the products alone 2.46× → 2.35× SDPA.
# - TF32 operands at 128-wide heads (the row kernel spilled 1.0-1.6 KB at 64 rows): a column block a
#   program (202-255 registers; streaming 32 rows spilled 24-216 B; transposed tiles 1.1-1.6 KB);
# - fp32 operands (one span; the row kernel spilled 3.4 KB at 64-wide heads).
GRADIENT_STREAM_ROWS = 32
GRADIENT_WIDE_STREAM_ROWS = 16  # the column kernel with dx: at 128-wide heads, and with bf16 operands
GRADIENT_GROUP_BLOCKS = 2
# The kernels offset a tile's rows and columns inside its block in 32 bits (``load_block``): a tensor
# whose strides could overflow that (a block of up to MAX_BLOCK rows or columns) is made contiguous first.
MAX_BLOCK = 256


def row_block_size(chunk_size: int) -> int:
    """The kernels' row block for a requested ``chunk_size``: a power of two in [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(max(1, int(chunk_size)))))


def padded_dim(d: int) -> int:
    """A head dimension padded to a tl.dot operand size (a power of two ≥ 16)."""
    return max(16, triton.next_power_of_2(d))


def _warps(rows: int, width: int) -> int:
    """Warps of a kernel holding ``rows`` × ``width`` tiles: 8 from 64 × 128 up, else 4."""
    return 8 if rows * width >= 64 * 128 else 4


def interpreter_enabled() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter (how they were defined)."""
    return triton is not None and defined_for_the_interpreter(solve_forward_kernel)


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


class SolveLayout:
    """Block sizes, strides and flags shared by the launches of one solve."""

    def __init__(self, x, b, beta, doc_start, scale, strict, chunk_size, operands=None):
        self.batch, self.heads, self.length, self.dk = x.shape
        self.dv = b.shape[-1]
        self.block_t = row_block_size(chunk_size)
        self.block_k = padded_dim(self.dk)
        self.block_v = min(64, padded_dim(self.dv))
        self.block_dv = padded_dim(self.dv)
        self.blocks = triton.cdiv(self.length, self.block_t)
        # spans of the chunk-parallel solve: whole row blocks, SPAN_ROWS rows or fewer
        self.span_blocks = max(1, SPAN_ROWS // self.block_t)
        self.spans = triton.cdiv(self.blocks, self.span_blocks)
        self.subspan_blocks = max(1, min(self.span_blocks, SUBSPAN_ROWS // self.block_t))
        # partials (forward) and sums (backward) from outside a sub-span: needed unless one sub-span is all
        self.has_partials = self.blocks > self.subspan_blocks
        # the sequential kernels' sub-span logits ([B, H, T, subspan_rows], fp32) and value slices
        self.subspan_rows = self.subspan_blocks * self.block_t
        self.sequential_v = min(SUBSTITUTION_VALUES, padded_dim(self.dv))
        self.slices = triton.cdiv(self.dv, self.sequential_v)
        # the transposed direction's span kernels (and pushes) take slices of up to 128 value columns: one
        # slice forms each kernel tile once (ptxas, sm_90, d = 128: 203-238 registers, no spill); its
        # sequential kernel takes sequential_v
        self.future_block_v = min(128, self.block_dv)
        self.future_slices = triton.cdiv(self.dv, self.future_block_v)
        # tensor cores for the products across spans, the pushes' and the gradients'; one span: all fp32
        # (the launch plan's ``operands``, else kernelmix.ops.solve_operands's choice, else the default)
        chosen = operands or chosen_solve_operands() or SPAN_OPERANDS
        if chosen not in SOLVE_OPERAND_CHOICES:
            raise KernelmixError(f"the solve's span operands are {chosen!r}: choose one of "
                                 f"{', '.join(SOLVE_OPERAND_CHOICES)} (kernelmix.ops.solve_operands)")
        self.operands = chosen if self.spans > 1 else "fp32"
        # bf16 operands are read from bf16 copies of x, y, U and db (half the bytes of fp32 tiles rounded
        # in registers, the same values): the sequential kernels store U's and db's as they solve them
        self.shadowed = self.operands == "bf16"
        # the forward's span kernels and pushes: slices of up to 128 value columns on tensor cores (one slice
        # forms each kernel tile once), streaming the columns SPAN_STREAM_COLUMNS at a time; BLOCK_V with fp32
        # operands (one span); the sequential kernel takes sequential_v and reads the partials of the span
        # slice its columns lie in
        # (TF32 with keys wider than 128: 64 value columns streamed 16 at a time, see SPAN_STREAM_COLUMNS)
        self.wide_keys = self.block_k >= WIDE_KEYS
        tf32_wide_keys = self.operands == "tf32" and self.wide_keys
        self.span_block_v = self.block_v if self.operands == "fp32" or tf32_wide_keys else min(128, self.block_dv)
        self.span_stream_t = min(self.block_t, 16 if tf32_wide_keys else SPAN_STREAM_COLUMNS)
        self.span_slices = triton.cdiv(self.dv, self.span_block_v)
        # rows per program of the forward's span kernel and its pushes (see SPAN_ROW_BLOCKS), at 8 warps from
        # 64 × 128 tiles up (at 4, 128 rows of a 64-wide head spilled 120-600 B per thread; ptxas, sm_90)
        self.span_block_r = SPAN_ROW_BLOCKS * self.block_t
        self.span_warps = _warps(self.span_block_r, max(self.block_k, self.span_block_v))
        # the forward's across-span kernel: PAST_ROW_BLOCKS a program in PAST_SPLITS column halves with bf16
        # operands (heads up to 128 wide), else as its pushes
        wide_past = self.shadowed and self.block_k <= 128 and self.span_block_v <= 128
        self.past_block_r = (PAST_ROW_BLOCKS if wide_past else SPAN_ROW_BLOCKS) * self.block_t
        self.past_splits = PAST_SPLITS if wide_past else 1
        self.past_stream_t = min(self.block_t, PAST_STREAM_COLUMNS) if wide_past else self.span_stream_t
        # columns per program of the transposed direction's span kernel and its pushes (see SPAN_COLUMN_BLOCKS),
        # streaming rows FUTURE_STREAM_ROWS at a time where it holds several column blocks or keys wider than
        # 128, else its row block (one block with TF32 operands at keys wider than 128: two spilled 24-120 B
        # there, one streamed 16 rows at a time none, its whole row block 168-356 B)
        self.future_block_c = self.block_t * (1 if tf32_wide_keys else SPAN_COLUMN_BLOCKS)
        self.future_stream_t = min(self.block_t, FUTURE_STREAM_ROWS) \
            if self.future_block_c > self.block_t or self.wide_keys else self.block_t
        self.future_warps = _warps(self.future_block_c, max(self.block_k, self.future_block_v))
        # the in-span substitution walks rows in smaller blocks: its C×C system lives in registers
        self.sub_t = min(self.block_t, SUBSTITUTION_ROWS)
        # the sub-spans' logits: a program per row block (SUBSTITUTION_LOGIT_WIDE_ROWS rows at keys wider than 128)
        self.logit_rows = min(self.block_t, SUBSTITUTION_LOGIT_WIDE_ROWS) if self.wide_keys else self.block_t
        self.sub_blocks = triton.cdiv(self.length, self.sub_t)
        self.scale, self.scale2, self.strict = float(scale), float(scale) * LOG2E, bool(strict)
        self.has_beta, self.has_doc = beta is not None, doc_start is not None
        self.beta_strides = (0, 0, 0) if beta is None else tuple(beta.stride())
        self.ds_strides = (0, 0) if doc_start is None else tuple(doc_start.stride())
        # 64-row tiles of 128-wide head dims spill heavily at 4 warps (ptxas, sm_90: 25-37 KB stack
        # frames per kernel; 6-15 KB at 8 warps): a first guess, for a GPU run to tune
        self.num_warps = _warps(self.block_t, max(self.block_k, self.block_dv))
        self._gradient_blocks()

    def _gradient_blocks(self) -> None:
        """The gradient kernels' blocks (see GRADIENT_STREAM_ROWS): dx by the row kernel, or by the column
        kernel's atomics; with bf16 operands β folded and the gradients fused (below)."""
        width = max(self.block_k, self.block_dv)
        wide = width >= 128
        self.dx_rows = self.operands == "tf32" and not wide
        # bf16 operands: one pass, dx by atomics, the column kernel's tiles transposed (GRADIENT_STREAM_ROWS)
        self.column_major = self.shadowed and width <= 128
        self.row_stream_t = min(self.block_t, GRADIENT_STREAM_ROWS)
        self.column_stream_t = min(self.block_t, GRADIENT_WIDE_STREAM_ROWS if (wide or self.column_major)
                                   and not self.dx_rows else GRADIENT_STREAM_ROWS)
        self.gradient_group = self.block_t * (GRADIENT_GROUP_BLOCKS if self.dx_rows or self.column_major else 1)
        self.gradient_warps = 8 if self.gradient_group * width >= 64 * 64 else 4
        # FOLDED: with bf16 operands db's copy holds β ⊙ db and the kernels that read it take β e for e, so
        # that they multiply by no β (the fused gradients below spilled 16 B with one β multiply more)
        self.kernel_beta = self.has_beta and not self.shadowed
        # FUSED_GRADIENTS: with bf16 operands (heads up to 128 wide) the transposed solve's span kernel forms
        # the gradients of its pairs (the later spans') on its own kernel tiles; the column kernel then sums the
        # spans' own rows only
        # (a program of either kernel must not straddle two spans: whole groups of blocks in a span)
        self.fused_gradients = (self.shadowed and self.future_slices == 1 and self.block_k <= 128
                                and self.span_blocks % SPAN_COLUMN_BLOCKS == 0
                                and self.span_blocks % GRADIENT_GROUP_BLOCKS == 0)

    def flags(self) -> dict:
        return dict(BLOCK_T=self.block_t, BLOCK_K=self.block_k, STRICT=self.strict, HAS_BETA=self.has_beta,
                    HAS_DOC=self.has_doc, num_warps=self.num_warps)

    def substitution_flags(self) -> dict:
        """The sequential kernels' flags: rows in blocks of ``sub_t``, value slices of ``sequential_v``; 4
        warps (their tiles are at most 16 × 32)."""
        return dict(BLOCK_T=self.sub_t, BLOCK_V=self.sequential_v, WIDTH=self.subspan_rows, HAS_BETA=self.has_beta,
                    SHADOW=self.shadowed, num_warps=4)

    def logits_flags(self) -> dict:
        """:func:`subspan_logits_kernel`'s: a program per row block, column tiles of up to
        SUBSTITUTION_LOGIT_COLUMNS, the head in parts of SUBSTITUTION_LOGIT_CHUNK; 8 warps from 64-row blocks
        on (also where WIDE_KEYS take 32-row programs)."""
        columns = SUBSTITUTION_LOGIT_WIDE_COLUMNS if self.wide_keys else SUBSTITUTION_LOGIT_COLUMNS
        return dict(BLOCK_T=self.logit_rows, BLOCK_K=self.block_k, CHUNK_K=min(self.block_k, SUBSTITUTION_LOGIT_CHUNK),
                    WIDTH=self.subspan_rows, SPAN=self.span_blocks * self.block_t,
                    STREAM_T=min(self.logit_rows, columns), STRICT=self.strict,
                    HAS_DOC=self.has_doc, num_warps=8 if self.block_t >= 64 else 4)

    @property
    def logits_grid(self) -> tuple[int, int]:
        return (self.batch * self.heads, triton.cdiv(self.length, self.logit_rows))

    @property
    def sequential_grid(self) -> tuple[int, int]:
        """The in-span forward and transposed solves: one program per (batch · head, value slice)."""
        return (self.batch * self.heads, self.slices)

    def span_blocks_of(self, span: int) -> tuple[int, int]:
        """The row blocks [first, stop) of span ``span``."""
        first = span * self.span_blocks
        return first, min(first + self.span_blocks, self.blocks)

    def subspans_of(self, span: int) -> list[tuple[int, int]]:
        """The row blocks [first, stop) of each sub-span of span ``span``, in order."""
        first, stop = self.span_blocks_of(span)
        return [(i, min(i + self.subspan_blocks, stop)) for i in range(first, stop, self.subspan_blocks)]

    def span_grid(self, span: int, transposed: bool = False) -> tuple[int, int, int]:
        """The past / future span kernels over a whole span: see :meth:`push_grid`."""
        first, stop = self.span_blocks_of(span)
        return self.push_grid(stop - first, transposed)

    def past_grid(self, span: int) -> tuple[int, int, int]:
        """The forward's across-span kernel over span ``span``: one program per (batch · head, ``past_block_r``
        rows, value slice · column half)."""
        first, stop = self.span_blocks_of(span)
        return (self.batch * self.heads, triton.cdiv((stop - first) * self.block_t, self.past_block_r),
                self.span_slices * self.past_splits)

    def merge_grid(self, span: int) -> tuple[int, int, int]:
        """The merge of the across-span kernel's column halves over span ``span``'s rows."""
        first, stop = self.span_blocks_of(span)
        return (self.batch * self.heads, triton.cdiv((stop - first) * self.block_t, MERGE_ROWS), self.span_slices)

    def push_grid(self, blocks: int, transposed: bool = False) -> tuple[int, int, int]:
        """The span kernels over ``blocks`` row (or column) blocks: one program per (batch · head, block
        (forward: ``span_block_r`` rows; transposed: ``future_block_c`` columns), value slice; the
        transposed direction's slices are wider)."""
        if transposed:
            return (self.batch * self.heads, triton.cdiv(blocks * self.block_t, self.future_block_c),
                    self.future_slices)
        return (self.batch * self.heads, triton.cdiv(blocks * self.block_t, self.span_block_r), self.span_slices)

    @property
    def gradient_grid(self) -> tuple[int, int]:
        """The row and column gradient kernels: one program per (batch · head, ``gradient_group`` rows or
        columns)."""
        return (self.batch * self.heads, triton.cdiv(self.blocks * self.block_t, self.gradient_group))

    def gradient_flags(self, rows: bool) -> dict:
        """The row (``rows``: dx) or column gradient kernel's blocks and warps; the column kernel adds dx
        by atomics (``ROW_GRAD``) unless the row kernel forms it."""
        flags = self.flags() | dict(BLOCK_DV=self.block_dv, OPERANDS=self.operands, num_warps=self.gradient_warps,
                                    STREAM_T=self.row_stream_t if rows else self.column_stream_t,
                                    HAS_BETA=self.kernel_beta)
        if rows:
            return flags | dict(BLOCK_R=self.gradient_group)
        return flags | dict(BLOCK_C=self.gradient_group, ROW_GRAD=not self.dx_rows, COLUMN_MAJOR=self.column_major,
                            WITHIN_SPAN=self.fused_gradients)


def bf16_copy(t: Tensor) -> Tensor:
    """``t`` (fp32) in bf16, rounded to nearest with ties away from zero, as the kernels round (the
    ``rounded`` of ``_triton_products``; torch's own cast breaks ties to even), in ``t``'s layout."""
    bits = (t.view(torch.int32) + 0x8000) & -0x10000
    return bits.view(torch.float32).to(torch.bfloat16)


def _operand_copies(lay: SolveLayout, *tensors: Tensor) -> tuple[Tensor, ...]:
    """What the span kernels, pushes and gradient kernels read for x and y: bf16 copies with bf16
    operands, else the tensors themselves."""
    return tuple(bf16_copy(t) for t in tensors) if lay.shadowed else tensors


def _shadow_like(t: Tensor, lay: SolveLayout) -> Tensor:
    """A bf16 tensor laid out as ``t`` (a [B, H, T, dv] view of [B, T, H, dv]) for the sequential kernel
    to store its solved rows in, with bf16 operands; else ``t`` (the kernels then store no copy)."""
    if not lay.shadowed:
        return t
    return t.new_empty(lay.batch, lay.length, lay.heads, t.shape[-1], dtype=torch.bfloat16).transpose(1, 2)


def _subspan_logits(x, y, doc_start, lay: SolveLayout) -> Tensor:
    """Every row's base-2 logits against its sub-span's columns ([B, H, T, subspan_rows] fp32, −inf
    where hidden; the columns after a row's block unwritten), for the sequential kernels: one launch,
    parallel over all rows."""
    logits = x.new_empty(lay.batch, lay.heads, lay.length, lay.subspan_rows)
    subspan_logits_kernel[lay.logits_grid](
        x, y, x if doc_start is None else doc_start, logits, *_strides4(x), *_strides4(y), *lay.ds_strides,
        lay.heads, lay.length, lay.dk, lay.scale2, **lay.logits_flags(),
    )
    return logits


def _solve_forward(x, y, b, beta, gamma, doc_start, lay: SolveLayout, keep_mix: bool = False):
    """U, the row log-normalisers, U's bf16 copy (bf16 operands; else None) and, with β and
    ``keep_mix`` (a backward will need e), K U (else None), span by span: the
    past spans' products in parallel (:func:`past_span_kernel`), then the span's own rows, a sub-span
    at a time: its substitution (:func:`solve_forward_kernel`), then a push of its solved rows into
    the span's later rows."""
    # U laid out [B, T, H, dv] (the callers' layout), seen as [B, H, T, dv]
    u = b.new_empty(lay.batch, lay.length, lay.heads, lay.dv).transpose(1, 2)
    lse = x.new_empty(lay.batch, lay.heads, lay.length)  # base-2 row log-normalisers
    if lay.has_partials:  # the running max and sum (per span value slice) and mix of each row so far
        row_max = x.new_empty(lay.span_slices, lay.batch, lay.heads, lay.length)
        row_sum = x.new_empty(lay.span_slices, lay.batch, lay.heads, lay.length)
        acc = b.new_empty(lay.batch, lay.heads, lay.length, lay.dv)
    else:
        row_max = row_sum = lse
        acc = u
    # the across-span kernel's second column half, merged into the first after it (PAST_SPLITS)
    halves = (torch.empty_like(row_max), torch.empty_like(row_sum), torch.empty_like(acc)) if lay.past_splits > 1 \
        else (row_max, row_sum, acc)
    beta_arg = x if beta is None else beta
    ds_arg = x if doc_start is None else doc_start
    xs, ys = _operand_copies(lay, x, y)
    u16 = _shadow_like(u, lay)
    keep_mix = keep_mix and beta is not None
    ku = torch.empty_like(u) if keep_mix else u  # laid out as U (the kernel reads U's strides for it)
    logits = _subspan_logits(x, y, doc_start, lay)

    def mix(span, row_start, row_stop, column_start, column_stop, carry_on):
        """Rows [row_start, row_stop) against the solved columns [column_start, column_stop): across spans
        (``span`` given: ``past_block_r`` rows a program, in ``past_splits`` column halves), or a push (the
        grid of the rows it reaches; ``carry_on`` from the stored partials)."""
        push = span is None
        grid = lay.push_grid((row_stop - row_start) // lay.block_t) if push else lay.past_grid(span)
        past_span_kernel[grid](
            xs, ys, u16, ds_arg, row_max, row_sum, acc, *halves, *_strides4(xs), *_strides4(ys), *_strides4(u16),
            *_strides4(acc), *lay.ds_strides, lay.heads, lay.length, lay.dk, lay.dv, lay.scale2, row_start,
            row_stop, column_start, column_stop, BLOCK_T=lay.block_t, BLOCK_K=lay.block_k, BLOCK_V=lay.span_block_v,
            BLOCK_R=lay.span_block_r if push else lay.past_block_r, STRICT=lay.strict, HAS_DOC=lay.has_doc,
            OPERANDS=lay.operands, CONTINUE=carry_on, STREAM_T=lay.span_stream_t if push else lay.past_stream_t,
            SPLITS=1 if push else lay.past_splits, num_warps=lay.span_warps,
        )

    for span in range(lay.spans):
        first, stop = lay.span_blocks_of(span)
        if span > 0:  # every row of the span against all earlier spans
            mix(span, first * lay.block_t, stop * lay.block_t, 0, first * lay.block_t, False)
            if lay.past_splits > 1:
                merge_split_partials_kernel[lay.merge_grid(span)](
                    row_max, row_sum, acc, *halves, *_strides4(acc), lay.heads, lay.length, lay.dv,
                    first * lay.block_t, stop * lay.block_t, BLOCK_T=MERGE_ROWS, BLOCK_V=lay.span_block_v,
                    num_warps=4,
                )
        subspans = lay.subspans_of(span)
        for index, (sub_first, sub_stop) in enumerate(subspans):
            start, end = sub_first * lay.block_t, min(sub_stop * lay.block_t, lay.length)
            seen = span > 0 or index > 0  # partials stored for these rows
            solve_forward_kernel[lay.sequential_grid](
                logits, b, u, u16, ku, beta_arg, gamma, ds_arg, lse, row_max, row_sum, acc,
                *_strides4(b), *_strides4(u), *_strides4(acc), *lay.beta_strides, *lay.ds_strides, lay.heads,
                lay.length, lay.dv, start, end, PARTIAL_V=lay.span_block_v, HAS_PAST=seen, STORE_MIX=keep_mix,
                HAS_DOC=lay.has_doc, **lay.substitution_flags(),
            )
            if sub_stop < stop:  # push the solved rows into the span's later rows
                mix(None, sub_stop * lay.block_t, stop * lay.block_t, start, sub_stop * lay.block_t, seen)
    return u, lse, (u16 if lay.shadowed else None), (ku if keep_mix else None)


@dataclass
class _FusedGradients:
    """What the transposed solve's span kernel needs to form its pairs' gradients too (``SolveLayout.fused_gradients``):
    U's bf16 copy, K U (``mixed``) and β for e, e and β e (filled span by span, as the spans' db are solved),
    and dx (zeroed: atomics, where ``row_grad``) and dy (zeroed: the spans' own rows add theirs after)."""

    u16: Tensor
    mixed: Tensor
    beta: Tensor | None
    e: Tensor
    e_kernel: Tensor
    grad_x: Tensor
    grad_y: Tensor
    row_grad: bool

    def fill_e(self, grad_b: Tensor, start: int, stop: int) -> None:
        """e_i = db_i·(K U)_i (and β_i e_i, what the kernels read: FOLDED) for rows [start, stop)."""
        part = (grad_b[:, :, start:stop] * self.mixed[:, :, start:stop]).sum(-1)
        self.e[:, :, start:stop] = part
        if self.beta is not None:
            self.e_kernel[:, :, start:stop] = self.beta[:, :, start:stop] * part


def _transposed_solve(x, y, grad_u, beta, gamma, doc_start, lse, ends, sub_ends, lay: SolveLayout, operands,
                      fused: _FusedGradients | None = None):
    """db = A^{-T} dU, span by span from the last: the later spans' products in parallel
    (:func:`future_span_kernel`), then the span's own rows a sub-span at a time from the last: its back
    substitution (:func:`solve_transposed_kernel`), then a push of its db into the span's earlier columns.
    ``operands``: the x and y the span kernels read (:func:`_operand_copies`). With ``fused``, the span
    kernel over the later spans also forms those pairs' parts of dy and dx (the spans' e filled first).
    Returns db and its bf16 copy (bf16 operands: β ⊙ db, FOLDED; else db again)."""
    grad_b = grad_u.new_empty(lay.batch, lay.length, lay.heads, lay.dv).transpose(1, 2)
    xs, ys = operands
    db16 = _shadow_like(grad_b, lay)
    future = grad_u.new_empty(lay.batch, lay.heads, lay.length, lay.dv) if lay.has_partials else grad_b
    beta_arg = x if beta is None else beta
    ds_arg = x if doc_start is None else doc_start
    common = (*lay.beta_strides, *lay.ds_strides)
    logits = _subspan_logits(x, y, doc_start, lay)

    def gather(column_first, columns, row_first, row_stop, accumulate, gradients=False):
        us, e, gy, gx = ((fused.u16, fused.e_kernel, fused.grad_y, fused.grad_x) if gradients
                         else (xs, lse, grad_b, grad_b))  # (not read without gradients)
        future_span_kernel[lay.push_grid(columns, transposed=True)](
            xs, ys, db16, beta_arg, ds_arg, lse, ends, future, us, e, gy, gx, *_strides4(xs), *_strides4(ys),
            *_strides4(db16), *_strides4(future), *common, *_strides4(us), *_strides4(gy), *_strides4(gx),
            lay.heads, lay.length, lay.blocks, lay.dk, lay.dv, lay.scale, lay.scale2,
            column_first, column_first + columns, row_first, row_stop, BLOCK_T=lay.block_t, BLOCK_K=lay.block_k,
            BLOCK_V=lay.future_block_v, BLOCK_C=lay.future_block_c,
            STREAM_T=lay.future_stream_t, STRICT=lay.strict, HAS_BETA=lay.kernel_beta, HAS_DOC=lay.has_doc,
            OPERANDS=lay.operands, ACCUMULATE=accumulate, GRAD=gradients, ROW_GRAD=gradients and fused.row_grad,
            num_warps=lay.future_warps,
        )

    ratio = lay.block_t // lay.sub_t  # bounds in substitution blocks
    for span in reversed(range(lay.spans)):
        first, stop = lay.span_blocks_of(span)
        later = span < lay.spans - 1
        if later:  # every column of the span against all later spans
            gather(first, stop - first, stop, lay.blocks, False, fused is not None)
        subspans = lay.subspans_of(span)
        for index in reversed(range(len(subspans))):
            sub_first, sub_stop = subspans[index]
            seen = later or index < len(subspans) - 1  # sums stored for these columns
            solve_transposed_kernel[lay.sequential_grid](
                logits, grad_u, grad_b, db16, beta_arg, gamma, lse, sub_ends, future, *_strides4(grad_u),
                *_strides4(grad_b), *_strides4(future), *lay.beta_strides, lay.heads, lay.length, lay.sub_blocks,
                lay.dv, sub_first * ratio, min(sub_stop * ratio, lay.sub_blocks), HAS_FUTURE=seen,
                **lay.substitution_flags(),
            )
            if sub_first > first:  # push the solved db into the span's earlier columns
                gather(first, sub_first - first, sub_first, sub_stop, seen)
        if fused is not None:  # the span's e, for the earlier spans' gradients
            fused.fill_e(grad_b, first * lay.block_t, min(stop * lay.block_t, lay.length))
    return grad_b, db16


def _solve_backward(grad_u, x, y, b, beta, gamma, doc_start, u, u16, ku, lse, lay: SolveLayout, need_x: bool,
                    need_y: bool):
    """db (the gradient of b), dx, dy and e (−dβ) of one solve. e_i = db_i·(K U)_i is O(T·d): Cubit's
    K U = b − γ U (β = 1), DeltaFormer's as its forward stored it (``ku``; (b − γU)/β would amplify
    rounding where β is small). Then dx and dy: two passes over the T² pairs, the row kernel's dx and the
    column kernel's dy, where ``SolveLayout.dx_rows`` (TF32 operands at heads up to 64 wide); elsewhere the
    column kernel alone, adding dx by fp32 atomics (``ROW_GRAD``): with bf16 operands in one pass by
    choice (each pair's logits formed once), with TF32 at wider heads and fp32 ones because the row
    kernel spills there. With bf16 operands the kernels read the bf16 copies of x, y, U (``u16``, the
    forward's) and β ⊙ db, and (``SolveLayout.fused_gradients``) the pairs across spans are summed by the
    transposed solve's span kernel on its own kernel tiles, the column kernel summing the spans' own rows."""
    ends = _row_block_ends(doc_start, lay.batch, lay.length, lay.block_t, x.device)
    sub_ends = ends if lay.sub_t == lay.block_t else _row_block_ends(doc_start, lay.batch, lay.length, lay.sub_t,
                                                                     x.device)
    xs, ys = _operand_copies(lay, x, y)
    us = u if u16 is None else u16
    mixed = b - gamma[None, :, None, None] * u if beta is None else ku  # (ku None: no gradient needs e)
    atomics = need_x and not lay.dx_rows
    grad_x = grad_y = fused = None
    if need_x or need_y:  # laid out [B, T, H, dk] as the callers' tensors; zeroed where kernels add to them
        grad_x = (x.new_zeros if atomics else x.new_empty)(lay.batch, lay.length, lay.heads, lay.dk).transpose(1, 2)
        grad_y = (x.new_zeros if lay.fused_gradients else x.new_empty)(lay.batch, lay.length, lay.heads,
                                                                       lay.dk).transpose(1, 2)
        if lay.fused_gradients:
            e = x.new_empty(lay.batch, lay.heads, lay.length)
            fused = _FusedGradients(us, mixed, beta, e, e if beta is None else torch.empty_like(e), grad_x, grad_y,
                                    atomics)
    grad_b, db16 = _transposed_solve(x, y, grad_u, beta, gamma, doc_start, lse, ends, sub_ends, lay, (xs, ys), fused)
    if fused is not None:
        e, e_kernel = fused.e, fused.e_kernel
    else:
        e = None if mixed is None else (grad_b * mixed).sum(-1).contiguous()
        # FOLDED: the kernels that read β ⊙ db (bf16 operands) take β e
        e_kernel = e if e is None or beta is None or lay.kernel_beta else (beta * e).contiguous()
    if need_x or need_y:
        beta_arg = x if beta is None else beta
        ds_arg = x if doc_start is None else doc_start
        common = (*lay.beta_strides, *lay.ds_strides)
        if need_x and lay.dx_rows:
            grad_rows_kernel[lay.gradient_grid](
                xs, ys, us, db16, beta_arg, ds_arg, lse, e_kernel, grad_x, *_strides4(xs), *_strides4(ys),
                *_strides4(us), *_strides4(db16), *common, *_strides4(grad_x), lay.heads, lay.length, lay.dk, lay.dv,
                lay.scale, lay.scale2, **lay.gradient_flags(rows=True),
            )
        if need_y or atomics:
            grad_columns_kernel[lay.gradient_grid](
                xs, ys, us, db16, beta_arg, ds_arg, lse, e_kernel, grad_y, grad_x, ends, *_strides4(xs),
                *_strides4(ys), *_strides4(us), *_strides4(db16), *common, *_strides4(grad_y), *_strides4(grad_x),
                lay.heads, lay.length, lay.blocks, lay.dk, lay.dv, lay.scale, lay.scale2,
                lay.span_blocks * lay.block_t, **(lay.gradient_flags(rows=False) | dict(ROW_GRAD=atomics)),
            )
    return grad_b, (grad_x if need_x else None), (grad_y if need_y else None), e


def _small_strides(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy where its row and column strides could overflow the kernels' 32-bit
    offsets inside a block of MAX_BLOCK rows or columns (never with the callers' usual layouts)."""
    # the largest offset inside a block: its last row (of at most MAX_BLOCK) and the head's last column
    largest = (MAX_BLOCK - 1) * abs(t.stride(-2)) + (padded_dim(t.shape[-1]) - 1) * abs(t.stride(-1))
    return t if largest < 2**31 else t.contiguous()


def _launch_device(x: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class _TritonSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, b, beta, gamma, doc_start, scale, strict, chunk_size, grad_enabled):
        lay = SolveLayout(x, b, beta, doc_start, scale, strict, chunk_size)
        gamma = gamma.contiguous()  # the kernels read γ_h at gamma_ptr + h
        if lay.length == 0:  # nothing to solve: no launch
            u, lse, u16, ku = b.new_empty(b.shape), x.new_empty(x.shape[:3]), None, None
        else:
            # DeltaFormer's e needs K U where a gradient of x, y or β will be asked for (needs_input_grad
            # says what requires a gradient, also under no_grad: hence grad mode, from outside forward)
            keep_mix = grad_enabled and any(ctx.needs_input_grad[i] for i in (0, 1, 3))
            with _launch_device(x):
                u, lse, u16, ku = _solve_forward(x, y, b, beta, gamma, doc_start, lay, keep_mix)
        ctx.save_for_backward(x, y, b if beta is None else None, beta, gamma, doc_start, u, u16, ku, lse)
        ctx.layout = lay
        return u

    @staticmethod
    @once_differentiable  # a gradient of this gradient is not implemented: say so clearly
    def backward(ctx, grad_u):
        x, y, b, beta, gamma, doc_start, u, u16, ku, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if ctx.layout.length == 0:
            return (torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(u), None if beta is None else
                    torch.zeros_like(beta), torch.zeros_like(gamma), None, None, None, None, None)
        with _launch_device(x):
            grad_b, grad_x, grad_y, e = _solve_backward(
                _small_strides(grad_u.float()), x, y, b, beta, gamma, doc_start, u, u16, ku, lse, ctx.layout, needs[0],
                needs[1],
            )
        grad_beta = -e if beta is not None and needs[3] else None  # (e is there: the forward kept K U)
        grad_gamma = -(grad_b * u).sum(dim=(0, 2, 3)) if needs[4] else None
        return grad_x, grad_y, grad_b if needs[2] else None, grad_beta, grad_gamma, None, None, None, None, None


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
    x, y, b = (_small_strides(t) for t in (x, y, b))
    return _TritonSolve.apply(x, y, b, beta, gamma, doc_start, float(scale), bool(strict), int(chunk_size),
                              torch.is_grad_enabled())
