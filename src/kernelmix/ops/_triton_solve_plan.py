"""The launch plan of the Triton solve (Cubit and DeltaFormer): the kernels one differentiated call
launches at given sizes, with the grids, blocks and warps ``_triton_solve`` launches them with (its
``SolveLayout``, built on meta tensors), for ``kernelmix gpu-check --plan`` to compile ahead of time."""

from __future__ import annotations

import torch

from ..errors import KernelmixError
from ._backend import KernelLaunch, aot_signature
from ._triton_solve import MERGE_ROWS, SolveLayout, triton

if triton is not None:
    from ._triton_solve_kernels import (
        future_span_kernel,
        grad_columns_kernel,
        grad_rows_kernel,
        merge_split_partials_kernel,
        past_span_kernel,
    )
    from ._triton_solve_sequential import solve_forward_kernel, solve_transposed_kernel, subspan_logits_kernel

__all__ = ["solve_launches"]

_POINTER_TYPES = {"ds_ptr": "*i64", "end_ptr": "*i32", "u16_ptr": "*bf16", "db16_ptr": "*bf16"}
_FLOAT_ARGS = {"scale", "scale2"}
# the kernels that read the bf16 copies with bf16 operands (the sequential ones read fp32, store the copies)
_SHADOW_READERS = ("solve_past_span", "solve_span_push", "solve_future_span", "solve_span_push_transposed",
                   "solve_grad_rows", "solve_grad_columns")
_SHADOW_POINTERS = {name: "*bf16" for name in ("x_ptr", "y_ptr", "u_ptr", "db_ptr")}


def solve_launches(batch: int, heads: int, length: int, dk: int, dv: int, *, chunk_size: int, strict: bool,
                   has_beta: bool, has_doc: bool, operands: str | None = None) -> list[KernelLaunch]:
    """The kernels one differentiated solve launches at these sizes — the sub-spans' logits (once per
    direction), the forward (past spans in parallel, then each span's substitution), the backward's
    transposed solve (later spans, then each span's back substitution), row and column gradients —
    with the grids, blocks and warps the launches above use (the same ``SolveLayout``, built on meta
    tensors: no memory, no GPU). A span kernel's grid is
    that of a whole span; with one span (T ≤ SPAN_ROWS) they are not launched and not listed.
    ``operands``: the span products' (default ``SPAN_OPERANDS``); with "bf16" the kernels that read the
    bf16 copies take bf16 pointers for them."""
    if triton is None:
        raise KernelmixError("the Triton launch plan needs the triton package: pip install triton")
    x = torch.empty(batch, heads, length, dk, device="meta")
    b = torch.empty(batch, heads, length, dv, device="meta")
    beta = torch.empty(batch, heads, length, device="meta") if has_beta else None
    doc = torch.empty(batch, length, dtype=torch.int64, device="meta") if has_doc else None
    lay = SolveLayout(x, b, beta, doc, 1.0, strict, chunk_size, operands)
    flags = lay.flags()
    warps = flags.pop("num_warps")
    several = lay.has_partials
    logits = lay.logits_flags()
    logits_warps = logits.pop("num_warps")
    tiles = dict(block_t=lay.block_t, block_k=lay.block_k, block_v=lay.block_v, block_dv=lay.block_dv,
                 blocks=lay.blocks, span_blocks=lay.span_blocks, spans=lay.spans, sub_t=lay.sub_t, dk=dk, dv=dv,
                 operands=lay.operands, subspan_blocks=lay.subspan_blocks,
                 future_block_v=lay.future_block_v, span_block_v=lay.span_block_v, span_block_r=lay.span_block_r,
                 past_block_r=lay.past_block_r, past_splits=lay.past_splits, merge_rows=MERGE_ROWS,
                 future_block_c=lay.future_block_c,
                 gradient_group=lay.gradient_group, dx_rows=lay.dx_rows, subspan_rows=lay.subspan_rows,
                 fused_gradients=lay.fused_gradients,
                 sequential_v=lay.sequential_v, has_doc=lay.has_doc, logit_stream=logits["STREAM_T"],
                 logit_rows=logits["BLOCK_T"])
    span = dict(BLOCK_T=lay.block_t, BLOCK_K=lay.block_k, BLOCK_V=lay.span_block_v, STRICT=lay.strict,
                HAS_DOC=lay.has_doc, OPERANDS=lay.operands)
    # the pushes inside the spans: the rows (columns) each reaches, in blocks; the plan shows the median's grid
    reach = sorted(lay.span_blocks_of(index)[1] - sub_stop for index in range(lay.spans)
                   for _, sub_stop in lay.subspans_of(index)[:-1])
    subspans = sum(len(lay.subspans_of(index)) for index in range(lay.spans))
    median = reach[len(reach) // 2] if reach else 1
    push_grid, push_grid_transposed = lay.push_grid(median), lay.push_grid(median, transposed=True)
    row_gradient = lay.gradient_flags(rows=True)  # dx, where it compiles without spills (else atomics)
    column_gradient = lay.gradient_flags(rows=False)
    row_gradient.pop("num_warps"), column_gradient.pop("num_warps")  # both lay.gradient_warps
    substitution = lay.substitution_flags()
    sub_warps = substitution.pop("num_warps")
    forward_substitution = substitution | {"PARTIAL_V": lay.span_block_v, "HAS_PAST": several, "STORE_MIX": has_beta,
                                           "HAS_DOC": lay.has_doc}
    transposed = span | {"HAS_BETA": lay.kernel_beta, "BLOCK_V": lay.future_block_v, "ROW_GRAD": False}
    fused = {"GRAD": lay.fused_gradients, "ROW_GRAD": lay.fused_gradients}  # (the planned call asks for dx and dy)
    kernels = [("solve_subspan_logits", subspan_logits_kernel, lay.logits_grid, logits, 2),  # forward, backward
               ("solve_past_span", past_span_kernel, lay.past_grid(min(1, lay.spans - 1)),
                span | {"BLOCK_R": lay.past_block_r, "CONTINUE": False, "STREAM_T": lay.past_stream_t,
                        "SPLITS": lay.past_splits}, lay.spans - 1),
               ("solve_merge_partials", merge_split_partials_kernel, lay.merge_grid(min(1, lay.spans - 1)),
                {"BLOCK_T": MERGE_ROWS, "BLOCK_V": lay.span_block_v}, (lay.spans - 1) * (lay.past_splits > 1)),
               ("solve_forward", solve_forward_kernel, lay.sequential_grid, forward_substitution,
                subspans),
               ("solve_span_push", past_span_kernel, push_grid,
                span | {"BLOCK_R": lay.span_block_r, "CONTINUE": True, "STREAM_T": lay.span_stream_t, "SPLITS": 1},
                len(reach)),
               ("solve_future_span", future_span_kernel, lay.span_grid(0, transposed=True),
                transposed | {"BLOCK_C": lay.future_block_c, "STREAM_T": lay.future_stream_t,
                              "ACCUMULATE": False} | fused, lay.spans - 1),
               ("solve_transposed", solve_transposed_kernel, lay.sequential_grid,
                substitution | {"HAS_FUTURE": several}, subspans),
               ("solve_span_push_transposed", future_span_kernel, push_grid_transposed,
                transposed | {"BLOCK_C": lay.future_block_c, "STREAM_T": lay.future_stream_t, "ACCUMULATE": True,
                              "GRAD": False}, len(reach)),
               ("solve_grad_rows", grad_rows_kernel, lay.gradient_grid, row_gradient, int(lay.dx_rows)),
               ("solve_grad_columns", grad_columns_kernel, lay.gradient_grid, column_gradient, 1)]
    launch_warps = {"solve_past_span": lay.span_warps, "solve_span_push": lay.span_warps, "solve_merge_partials": 4,
                    "solve_future_span": lay.future_warps, "solve_span_push_transposed": lay.future_warps,
                    "solve_forward": sub_warps, "solve_transposed": sub_warps, "solve_subspan_logits": logits_warps,
                    "solve_grad_rows": lay.gradient_warps, "solve_grad_columns": lay.gradient_warps}
    def pointers(name: str) -> dict:
        return _POINTER_TYPES | (_SHADOW_POINTERS if lay.shadowed and name in _SHADOW_READERS else {})

    return [KernelLaunch(name, kernel, grid, constexprs, launch_warps.get(name, warps),
                         aot_signature(kernel, constexprs, pointers(name), _FLOAT_ARGS), tiles, calls)
            for name, kernel, grid, constexprs, calls in kernels if calls > 0]
