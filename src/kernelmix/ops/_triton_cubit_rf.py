"""The Triton kernels of Cubit-RF's state recurrence, the one part of its chunked solve that runs
chunk after chunk (``cubit_rf._chunked_solve``; docs/math.md §12).

Every chunk's C × C triangular system is solved for all chunks at once (batched, by torch): for chunk
c it gives X_c = L_c⁻¹ ρV_c ``[C, d_v]`` and A_c = L_c⁻¹ diag(f/n) A_c ``[C, m]``, and the chunk's
solved rows are U_c = X_c − A_c R_{c−1}. What remains is the Gram side's state, an m × d_v matrix:

    R_c = a_c R_{c−1} + K_cᵀ (X_c − A_c R_{c−1}),

K_c ``[C, m]`` the chunk's key features at the chunk's scale and a_c the rescale from the previous
chunk's scale (0 where a document begins in the chunk). The forward kernel walks the chunks with
R in fp32 registers, one program per (batch · head, block of value columns) — the columns of R
never mix — and stores R_{c−1} for every chunk (the solve's rows need it, and the backward).

Backward, with G_c = dL/dR_c (from the later chunks and from R_c's own uses) and W_c = K_c G_c:
dX_c = W_c, dA_c = −W_c R_{c−1}ᵀ, dK_c = (X_c − A_c R_{c−1}) G_cᵀ, da_c = ⟨G_c, R_{c−1}⟩ and
G_{c−1} = a_c G_c − A_cᵀ W_c + dL/dR_{c−1} (its direct use); dR_{−1} is the initial state's gradient.
The kernel walks the chunks from the last, carrying G alone and storing G_c for every chunk; the
chunks' own gradients then come from G_c and R_{c−1} by batched torch products, all chunks at once.
(The first design computed them in the walk too: at m = d_v = 128 it held R_{c−1}, X_c and three
more products per row block and spilled 0.4 KB per thread on sm_90.) Products are full fp32
(``input_precision="ieee"``, and torch's fp32 products): the state is carried through every chunk,
so its errors would compound.

Loops over chunks are ``while`` loops (Triton 3.6's interpreter passes a run-time scalar as a
1-element array, which ``range`` cannot take under NumPy ≥ 2.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..errors import KernelmixError
from ._backend import KernelLaunch, aot_signature, defined_for_the_interpreter

#: Value columns per program (its part of R is m × VALUE_BLOCK fp32, held twice: R_{c−1} and R_c).
VALUE_BLOCK = 16
#: Rows of a chunk read at a time (ROW_BLOCK × m tiles of A_c and K_c: whole C × m tiles spilled tens of KB).
ROW_BLOCK = 16
#: Warps per program: the states R_{c−1} and R_c (or G_c and G_{c−1} with R_{c−1}) spread over 256 threads
WARPS = 8
#: Largest number of features the kernels hold in one tile (m × VALUE_BLOCK and C × m).
MAX_FEATURES = 256


@triton.jit
def _chunk_tile(ptr, c, first, width, cols, cols_ok, ROWS: tl.constexpr, C):
    """Rows first … first + ROWS − 1 of chunk c of a ``[N, C, width]`` tensor (this head's), columns ``cols``."""
    rows = first + tl.arange(0, ROWS)
    offsets = (c * C + rows).to(tl.int64)[:, None] * width + cols[None, :]
    return tl.load(ptr + offsets, mask=(rows < C)[:, None] & cols_ok[None, :], other=0.0)


@triton.jit
def _head_pointers(x_ptr, a_ptr, k_ptr, N, C, m, dv):
    """This program's head in X ``[B·H, N, C, d_v]``, A and K ``[B·H, N, C, m]``."""
    bh = tl.program_id(0).to(tl.int64)
    return x_ptr + bh * N * C * dv, a_ptr + bh * N * C * m, k_ptr + bh * N * C * m


@triton.jit
def _recurrence_forward_kernel(x_ptr, a_ptr, k_ptr, rescale_ptr, r0_ptr, before_ptr, final_ptr, N, C, m, dv,
                               BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """R_c = a_c R_{c−1} + K_cᵀ (X_c − A_c R_{c−1}) over the chunks, storing R_{c−1} for each. A chunk's
    rows are independent given R_{c−1}, so they are read BLOCK_R at a time (C × m tiles would spill)."""
    bh = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols_ok = cols < dv
    feats = tl.arange(0, BLOCK_M)
    feats_ok = feats < m
    x_head, a_head, k_head = _head_pointers(x_ptr, a_ptr, k_ptr, N, C, m, dv)
    state_offsets = feats[:, None] * dv + cols[None, :]
    state_mask = feats_ok[:, None] & cols_ok[None, :]
    state = tl.load(r0_ptr + bh * m * dv + state_offsets, mask=state_mask, other=0.0)
    c = 0
    while c < N:  # (a while loop: see the note at the top)
        tl.store(before_ptr + (bh * N + c) * m * dv + state_offsets, state, mask=state_mask)
        carried = tl.load(rescale_ptr + bh * N + c) * state
        first = 0
        while first < C:
            x = _chunk_tile(x_head, c, first, dv, cols, cols_ok, BLOCK_R, C)
            a = _chunk_tile(a_head, c, first, m, feats, feats_ok, BLOCK_R, C)
            k = _chunk_tile(k_head, c, first, m, feats, feats_ok, BLOCK_R, C)
            solved = x - tl.dot(a, state, input_precision="ieee")  # these rows of U_c
            carried += tl.dot(tl.trans(k), solved, input_precision="ieee")
            first += BLOCK_R
        state = carried
        c += 1
    tl.store(final_ptr + bh * m * dv + state_offsets, state, mask=state_mask)


@triton.jit
def _recurrence_backward_kernel(a_ptr, k_ptr, rescale_ptr, g_before_ptr, g_final_ptr, g_after_ptr, dr0_ptr,
                                N, C, m, dv, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """The chunks from the last: stores G_c = dL/dR_c for every chunk and walks G_{c−1} = a_c G_c −
    A_cᵀ (K_c G_c) + dL/dR_{c−1} (its direct use); dR_{−1} at the end. Only this walk is sequential:
    the chunks' own gradients (dX_c, dA_c, dK_c, da_c) follow from G_c and R_{c−1} in parallel, by
    torch (module docstring). Rows BLOCK_R at a time, as the forward."""
    bh = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols_ok = cols < dv
    feats = tl.arange(0, BLOCK_M)
    feats_ok = feats < m
    a_head = a_ptr + bh * N * C * m
    k_head = k_ptr + bh * N * C * m
    state_offsets = feats[:, None] * dv + cols[None, :]
    state_mask = feats_ok[:, None] & cols_ok[None, :]
    grad = tl.load(g_final_ptr + bh * m * dv + state_offsets, mask=state_mask, other=0.0)
    step = 0
    while step < N:  # (a while loop: see the note at the top)
        c = N - 1 - step
        tl.store(g_after_ptr + (bh * N + c) * m * dv + state_offsets, grad, mask=state_mask)
        direct = tl.load(g_before_ptr + (bh * N + c) * m * dv + state_offsets, mask=state_mask, other=0.0)
        earlier = tl.load(rescale_ptr + bh * N + c) * grad + direct
        first = 0
        while first < C:
            a = _chunk_tile(a_head, c, first, m, feats, feats_ok, BLOCK_R, C)
            k = _chunk_tile(k_head, c, first, m, feats, feats_ok, BLOCK_R, C)
            weighted = tl.dot(k, grad, input_precision="ieee")  # these rows of W_c = K_c G_c
            earlier -= tl.dot(tl.trans(a), weighted, input_precision="ieee")
            first += BLOCK_R
        grad = earlier
        step += 1
    tl.store(dr0_ptr + bh * m * dv + state_offsets, grad, mask=state_mask)


class _Blocks:
    """The kernels' tile sizes for C rows, m features and d_v value columns (powers of two ≥ 16): rows
    ROW_BLOCK at a time, all m features, VALUE_BLOCK value columns per program."""

    def __init__(self, chunk: int, features: int, value_dim: int) -> None:
        self.block_r = ROW_BLOCK
        self.rows = triton.cdiv(chunk, ROW_BLOCK) * ROW_BLOCK  # the rows a chunk's loop reads, padding included
        self.block_m = max(16, triton.next_power_of_2(features))
        self.block_v = min(VALUE_BLOCK, max(16, triton.next_power_of_2(value_dim)))
        self.value_blocks = triton.cdiv(value_dim, self.block_v)

    def constexprs(self) -> dict:
        return dict(BLOCK_R=self.block_r, BLOCK_M=self.block_m, BLOCK_V=self.block_v)


def _check(x: Tensor, a: Tensor, keys: Tensor, rescale: Tensor, initial: Tensor) -> None:
    named = {"X": x, "A": a, "K": keys, "rescale": rescale, "R0": initial}
    for name, tensor in named.items():
        if tensor.dtype != torch.float32:
            raise KernelmixError(f"the Triton Cubit-RF recurrence takes float32 tensors, but {name} is {tensor.dtype}; "
                                 "use backend=\"torch\" for other dtypes")
    if x.device.type == "cpu" and not defined_for_the_interpreter(_recurrence_forward_kernel):
        raise KernelmixError("the Triton Cubit-RF recurrence got CPU tensors but Triton's interpreter is off; set "
                             "TRITON_INTERPRET=1 before triton is imported, move the tensors to a GPU, or use "
                             "backend=\"torch\"")
    if a.shape[-1] > MAX_FEATURES:
        raise KernelmixError(f"the Triton Cubit-RF recurrence holds at most {MAX_FEATURES} features (got "
                             f"m={a.shape[-1]}); use backend=\"torch\"")


class _Recurrence(torch.autograd.Function):
    """(R before each chunk ``[B, H, N, m, d_v]``, the final R) from X, A, K ``[B, H, N, C, *]``, the
    rescales ``[B, H, N]`` and R₀ ``[B, H, m, d_v]``; differentiable in all five."""

    @staticmethod
    def forward(ctx, x, a, keys, rescale, initial):
        x, a, keys, rescale, initial = (t.contiguous() for t in (x, a, keys, rescale, initial))
        batch, heads, n, chunk, dv = x.shape
        m = a.shape[-1]
        blocks = _Blocks(chunk, m, dv)
        before = x.new_empty(batch, heads, n, m, dv)
        final = torch.empty_like(initial)
        _recurrence_forward_kernel[(batch * heads, blocks.value_blocks)](
            x, a, keys, rescale, initial, before, final, n, chunk, m, dv, **blocks.constexprs(), num_warps=WARPS)
        ctx.save_for_backward(x, a, keys, rescale, before)
        ctx.blocks = blocks
        return before, final

    @staticmethod
    def backward(ctx, g_before, g_final):
        x, a, keys, rescale, before = ctx.saved_tensors
        blocks = ctx.blocks
        batch, heads, n, chunk, dv = x.shape
        m, bh, parts = a.shape[-1], batch * heads, blocks.value_blocks
        g_before = torch.zeros_like(before) if g_before is None else g_before.contiguous()
        g_final = before.new_zeros(batch, heads, m, dv) if g_final is None else g_final.contiguous()
        g_after = torch.empty_like(before)  # G_c = dL/dR_c, the state after chunk c
        dr0 = x.new_empty(batch, heads, m, dv)
        _recurrence_backward_kernel[(bh, parts)](
            a, keys, rescale, g_before, g_final, g_after, dr0, n, chunk, m, dv, **blocks.constexprs(),
            num_warps=WARPS)
        # every chunk's own gradients at once (batched fp32 products, in parallel over the chunks)
        weighted = keys @ g_after  # W_c = K_c G_c
        solved = x - a @ before  # U_c = X_c − A_c R_{c−1}
        grad_a = -(weighted @ before.transpose(-1, -2))
        grad_keys = solved @ g_after.transpose(-1, -2)
        grad_rescale = (g_after * before).sum((-1, -2))
        return weighted, grad_a, grad_keys, grad_rescale, dr0


def recurrence_launches(batch: int, heads: int, length: int, features: int, value_dim: int, *,
                        chunk_size: int) -> list[KernelLaunch]:
    """The recurrence's launches in one differentiated Cubit-RF call at these sizes (for ``gpu-check
    --plan``): the forward twice (the solve is recomputed in the backward) and the backward once, with the
    grids and blocks of the launches above. Cubit-RF's read-out adds the random-feature kernels."""
    chunk = min(chunk_size, length)
    blocks = _Blocks(chunk, features, value_dim)
    grid = (batch * heads, blocks.value_blocks)
    constexprs = blocks.constexprs()
    tiles = dict(block_c=blocks.rows, block_m=blocks.block_m, block_v=blocks.block_v,
                 chunks=triton.cdiv(length, chunk), features=features, value_dim=value_dim)
    return [KernelLaunch(name, kernel, grid, constexprs, WARPS, aot_signature(kernel, constexprs, {}, set()),
                         tiles, calls)
            for name, kernel, calls in (("cubit_rf_recurrence", _recurrence_forward_kernel, 2),
                                        ("cubit_rf_recurrence_backward", _recurrence_backward_kernel, 1))]


def triton_state_recurrence(x: Tensor, a: Tensor, keys: Tensor, rescale: Tensor,
                            initial: Tensor) -> tuple[Tensor, Tensor]:
    """R_c = a_c R_{c−1} + K_cᵀ (X_c − A_c R_{c−1}) over the chunks by the Triton kernels: ``x``
    ``[B, H, N, C, d_v]``, ``a`` and ``keys`` ``[B, H, N, C, m]``, ``rescale`` ``[B, H, N]``, ``initial``
    R₀ ``[B, H, m, d_v]``, all float32. Returns (R_{c−1} for every chunk ``[B, H, N, m, d_v]``, the
    final R), differentiable w.r.t. every input."""
    _check(x, a, keys, rescale, initial)
    return _Recurrence.apply(x, a, keys, rescale, initial)
