"""The Python side of the Triton random-feature attention (Performer, DARKFormer): input checks,
the launches of the span kernels in ``_triton_features_kernels`` (whose docstring gives the design:
three forward launches with the feature map fused, the backward's five and a scan on the logits
formed once) and of the kernels around them in ``_triton_features_chain`` (DARKFormer's keys' half
norms, the logits, the chain through the feature map), the autograd function, and the launch plan that
``kernelmix gpu-check --plan`` compiles.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from ..errors import KernelmixError
from ._backend import KernelLaunch, aot_signature, defined_for_the_interpreter
from ._triton_features_chain import (
    chain_kernel,
    chain_rows_kernel,
    chain_weights_kernel,
    key_norm_kernel,
    logits_kernel,
)
from ._triton_features_kernels import (
    chunk_state_kernel,
    forward_kernel,
    key_grad_kernel,
    query_grad_kernel,
    reverse_scan_kernel,
    reverse_state_kernel,
    state_scan_kernel,
    value_grad_kernel,
)

#: Largest block of value columns of the forward's programs (its part of the state is m × VALUE_BLOCK
#: fp32), a quarter of it at large tiles: at d = m = d_v = 128 ptxas (sm_90) spilled 72 B per thread
#: with 64 columns, none with 32 (docs/gpu.md).
VALUE_BLOCK = 64
#: The logit-gradient kernels hold every value column and a block of features instead: most
#: features × value columns of their part of the state (64 × 128 fp32; more features at d_v < 128):
#: at d = m = d_v = 128 ptxas spilled 132–224 B per thread with all 128 features, none with 64.
FEATURE_TILE = 64 * 128
#: Largest block of value columns of the kernels that hold every feature but carry less than the
#: forward (the span states of both directions, the value gradient): at d = m = d_v = 128 one block
#: compiled without a spill (254–255 registers).
WIDE_VALUE_BLOCK = 128
#: From m = WIDE_M (padded) the span states take half of WIDE_VALUE_BLOCK and the value gradient
#: VALUE_GRAD_WIDE_M_BLOCK columns (ptxas, sm_90, m = 256 at d = d_v = 64-256: 128 columns spilled 700–930 B per
#: thread in the span states, 32–64 300–500 B in the value gradient); from d_v = WIDE_HEAD the logit gradients
#: half of FEATURE_TILE (32 features spilled 192 B), from d = WIDE_HEAD the chain's weight kernel half of
#: CHAIN_COLUMNS and the keys' half norms 8 warps (616 B, 224 B): none spill at these.
WIDE_M, VALUE_GRAD_WIDE_M_BLOCK, WIDE_HEAD = 256, 16, 256
#: From this padded m or d on, chunks are 16 rows, not 64 (8 warps), and the logits' step over the head
#: is 32 columns, not 16; from LARGE_TILE on, 8: with the walks' running states, what ptxas (sm_90)
#: compiled without a spill at d = m = 64 and 128 with rows of every dtype (32- and 64-row chunks
#: spilled up to 1.1 KB per thread; at d = 64 with bf16 rows, steps of 16 spilled 64 B; docs/gpu.md).
WIDE_TILE = 64
WIDE_TILE_ROWS = 16
WIDE_TILE_LOGIT_STEP = 32
LARGE_TILE = 128
LARGE_TILE_LOGIT_STEP = 8
#: Largest number of random features, head dim and value dim the kernels hold in one register tile.
MAX_FEATURES = 256
MAX_HEAD_DIM = 256
#: Elementwise tile (features × value columns) of one program of the scans over spans.
SCAN_TILE = (16, 16)
#: Chunks per span: a program of the span kernels walks its span's chunks in order (the reverse
#: direction from the last), carrying the state in registers, so the m × d_v states reach memory
#: once per span, not once per chunk (256 rows at the 16-row chunks of large tiles).
SPAN_BLOCKS = 16
#: Fewest programs a span kernel's grid should have (2 per SM of a 132-SM H100/H200): spans are
#: halved from SPAN_BLOCKS chunks until the grid has this many, or are single chunks.
MIN_PROGRAMS = 264
#: Operands of the products of features, states and values: "tf32" (tensor cores; the error against
#: float64 is measured in tests/ops/test_triton_features.py and docs/gpu.md), "bf16" or "fp32".
FEATURE_OPERANDS = "tf32"
#: Head columns per step of the feature logits' product (a K loop: small tiles, few registers).
LOGIT_STEP = 16
#: Rows per program of DARKFormer's keys' half norms ½‖M x̃‖² and of the feature logits (their own
#: kernels, before the span kernels).
LOGIT_ROWS = 32
#: The backward's chain through the feature map (after the span kernels): rows per program of its row
#: kernel (dx = dℓ W with the keys' norm term) and columns per step of its products; rows per program and
#: columns per block of its weight-gradient kernel (the parts of dW = Σ dℓᵀ x̃, one per span of rows:
#: CHAIN_SPAN_ROWS, doubled while the grid keeps MIN_PROGRAMS, so that torch adds fewer parts).
CHAIN_ROWS = 32
CHAIN_STEP = 16
CHAIN_SPAN_ROWS = 256
CHAIN_COLUMNS = 128
#: The fused chain kernel (both halves of a side in one pass, ``chain_kernel``) holds dW's span part of
#: m × d fp32 beside its rows: it runs where that is at most this many numbers (padded) and there is no
#: product in the keys' term (Performer's), with blocks of FUSED_CHAIN_ROWS rows, out formed FUSED_CHAIN_STEP
#: columns at a time: at d = m = 128 what ptxas (sm_90) compiled without a spill (223 registers; 174–181
#: at d = 256, m ≤ 64; 32 rows spilled 56 B per thread, DARKFormer's x Σ term beside it 128–344 B), for at
#: most FUSED_CHAIN_FEATURES (padded) features (m = 256 spilled 52–180 B at d = 32–64).
FUSED_CHAIN_TILE, FUSED_CHAIN_FEATURES = 128 * 128, 128
FUSED_CHAIN_ROWS = 16
FUSED_CHAIN_STEP = 16
#: √tiny(float32): a denominator at or below it gives a zero row (as ``safe_ratio``).
UNDERFLOW_FLOOR = math.sqrt(torch.finfo(torch.float32).tiny)

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Python side: checks, launches, autograd


class _Geometry:
    """Sizes, block sizes and grids of one call (pure data)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, projection: Tensor, chunk_size: int, start: int,
                 has_transform: bool) -> None:
        self.batch, self.length, self.heads, self.head_dim = q.shape
        self.kv_heads, self.value_dim = k.shape[2], v.shape[3]
        self.scale = self.head_dim ** -0.25  # x̃ = d^{-1/4} x; the kernels read q and k as given
        self.features = projection.shape[-2]
        self.start = start
        self.block_d = max(16, triton.next_power_of_2(self.head_dim))
        self.block_m = max(16, triton.next_power_of_2(self.features))
        wide = max(self.block_m, self.block_d) >= WIDE_TILE
        large = max(self.block_m, self.block_d) >= LARGE_TILE
        self.block_t = min(WIDE_TILE_ROWS if wide else 64, max(16, triton.next_power_of_2(chunk_size)))
        self.logit_step = min(self.block_d, LARGE_TILE_LOGIT_STEP if large else
                              WIDE_TILE_LOGIT_STEP if wide else LOGIT_STEP)
        self.block_dv = max(16, triton.next_power_of_2(self.value_dim))
        self.block_v = min(self.block_dv, max(16, VALUE_BLOCK))
        # the logit-gradient kernels: every value column, features in blocks (one block up to FEATURE_TILE)
        feature_tile = FEATURE_TILE // 2 if self.block_dv >= WIDE_HEAD else FEATURE_TILE
        self.block_f = min(self.block_m, max(16, feature_tile // self.block_dv))
        self.wide_block_v = min(self.block_dv, WIDE_VALUE_BLOCK // 2 if self.block_m >= WIDE_M else WIDE_VALUE_BLOCK)
        # the value gradient: as the span states', narrower at WIDE_M
        self.value_grad_block_v = min(self.wide_block_v, VALUE_GRAD_WIDE_M_BLOCK) if self.block_m >= WIDE_M \
            else self.wide_block_v
        self.n_chunks = triton.cdiv(self.length, self.block_t)
        self.value_blocks = triton.cdiv(self.value_dim, self.block_v)
        self.wide_value_blocks = triton.cdiv(self.value_dim, self.wide_block_v)
        self.value_grad_blocks = triton.cdiv(self.value_dim, self.value_grad_block_v)
        self.feature_blocks = triton.cdiv(self.features, self.block_f)
        self.span_blocks = SPAN_BLOCKS
        fewest_blocks = min(self.value_blocks, self.wide_value_blocks, self.feature_blocks)  # the smallest grid's
        while self.span_blocks > 1 and (triton.cdiv(self.n_chunks, self.span_blocks) * self.batch * self.heads
                                        * fewest_blocks < MIN_PROGRAMS):
            self.span_blocks //= 2
        self.n_spans = triton.cdiv(self.n_chunks, self.span_blocks)
        self.operands = FEATURE_OPERANDS
        # a shared projection [m, d] is read by every head: a head stride of 0 (W' = W M is per head)
        self.w_head_stride = 0 if projection.dim() == 2 and not has_transform else self.features * self.head_dim

    @property
    def grid(self) -> tuple[int, int, int]:
        """The span kernels': every span of every (batch, head), per block of value columns."""
        return (self.n_spans, self.batch * self.heads, self.value_blocks)

    @property
    def wide_grid(self) -> tuple[int, int, int]:
        """The span states': value blocks of ``wide_block_v`` columns (WIDE_VALUE_BLOCK, half at WIDE_M)."""
        return (self.n_spans, self.batch * self.heads, self.wide_value_blocks)

    @property
    def value_grad_grid(self) -> tuple[int, int, int]:
        """The value gradient's: value blocks of ``value_grad_block_v`` columns."""
        return (self.n_spans, self.batch * self.heads, self.value_grad_blocks)

    @property
    def feature_grid(self) -> tuple[int, int, int]:
        """The logit-gradient kernels': every span of every (batch, head), per block of features."""
        return (self.n_spans, self.batch * self.heads, self.feature_blocks)

    @property
    def row_grid(self) -> tuple[int, int]:
        """The row kernels' (the logits, the keys' half norms, the chain's rows): every block of LOGIT_ROWS
        rows of every (batch, head)."""
        return (triton.cdiv(self.length, LOGIT_ROWS), self.batch * self.heads)

    @property
    def forms_c(self) -> bool:
        """Whether the reverse-state kernel forms c = −g·o/den itself: its one block holds every value column."""
        return self.wide_value_blocks == 1

    @property
    def scan_grid(self) -> tuple[int, int, int]:
        """The scans': one program per elementwise tile of every (batch, head)'s m × d_v state."""
        return (self.batch * self.heads, triton.cdiv(self.features, SCAN_TILE[0]),
                triton.cdiv(self.value_dim, SCAN_TILE[1]))

    def sizes(self) -> tuple:
        """The backward's span kernels' sizes (they read the stored logits, never q, k or W)."""
        return (self.length, self.heads, self.kv_heads, self.value_dim, self.features, self.start, self.n_chunks,
                self.n_spans)

    def row_sizes(self) -> tuple:
        """The forward's span kernels' sizes (they form the logits from q, k and W)."""
        return (self.length, self.heads, self.kv_heads, self.head_dim, self.value_dim, self.features,
                self.start, self.n_chunks, self.w_head_stride, self.scale, self.n_spans)

    def scan_sizes(self) -> tuple:
        return (self.length, self.heads, self.value_dim, self.features, self.start, self.n_spans)

    def blocks(self, kind: str = "values", rows: bool = False) -> dict:
        """The span kernels' block sizes, chunks per span, products and warps per program (8 for tiles of
        64 or more: chosen by the compiler's report, see ``LARGE_TILE``; the interpreter ignores warps).
        ``kind``: "values" (the forward: every feature, VALUE_BLOCK columns), "wide" (the span states: every
        feature, ``wide_block_v`` columns), "value_grad" (every feature, ``value_grad_block_v`` columns) or
        "features" (the logit gradients: a block of features, every column);
        ``rows``: the forward's kernels, which form the logits from the rows (the head's tile and steps too)."""
        warps = 8 if max(self.block_m, self.block_d) >= 64 else 4
        block_v = dict(values=self.block_v, wide=self.wide_block_v, value_grad=self.value_grad_block_v,
                       features=self.block_dv)[kind]
        features = kind == "features"
        blocks = dict(OPERANDS=self.operands, BLOCK_T=self.block_t, BLOCK_M=self.block_f if features else self.block_m,
                      BLOCK_V=block_v, SPAN_BLOCKS=self.span_blocks, num_warps=warps)
        return dict(blocks, BLOCK_D=self.block_d, D_STEP=self.logit_step) if rows else blocks

    def logit_blocks(self) -> dict:
        """The logits kernel's: rows per program, the head and the features in one tile, the head in steps."""
        return dict(BLOCK_T=LOGIT_ROWS, BLOCK_D=self.block_d, BLOCK_M=self.block_m, D_STEP=self.logit_step,
                    num_warps=8 if max(self.block_m, self.block_d) >= 64 else 4)

    def scan_blocks(self) -> dict:
        """The scans' tiles; they run over spans (a scan's "chunk" is a span's rows)."""
        return dict(BLOCK_T=self.block_t * self.span_blocks, SCAN_M=SCAN_TILE[0], SCAN_V=SCAN_TILE[1], num_warps=1)

    def state_buffers(self, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per span: the state ``[B·H, spans, m, d_v]`` and its normaliser ``[B·H, spans, m]`` (first each
        span's own part, then, after the scan, the state entering it), the local scale and the scale of
        the entering state ``[B·H, spans]``."""
        bh, n, m = self.batch * self.heads, self.n_spans, self.features
        f32 = dict(dtype=torch.float32)
        return (like.new_empty(bh, n, m, self.value_dim, **f32), like.new_empty(bh, n, m, **f32),
                like.new_empty(bh, n, **f32), like.new_empty(bh, n, **f32))


def _interpreted() -> bool:
    """Whether the kernels were defined under the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return defined_for_the_interpreter(forward_kernel)


#: What the kernels read q, k, v in (and write the output and dv in): they compute in fp32 either way.
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, transform: Tensor | None, state) -> None:
    if q.dtype not in ROW_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelmixError(
            f"the Triton random-feature kernel takes q, k, v of one dtype among float32, bfloat16 and float16 "
            f"(got {q.dtype}, {k.dtype}, {v.dtype}); cast them to one (random_feature_attention does) or use "
            "backend=\"torch\""
        )
    named = {"projection": projection}
    if transform is not None:
        named["transform"] = transform
    if state is not None:
        named.update({"initial_state.S": state[0], "initial_state.z": state[1], "initial_state.shift": state[2]})
    for name, tensor in named.items():
        if tensor.dtype != torch.float32:
            raise KernelmixError(
                f"the Triton random-feature kernel takes a float32 {name}, but it is {tensor.dtype}; "
                "cast to float32 first (random_feature_attention does) or use backend=\"torch\""
            )
    if state is not None and any(x.requires_grad for x in state[:3]):
        raise KernelmixError(
            "the Triton random-feature kernel does not differentiate through initial_state (S, z or shift "
            "requires grad); use backend=\"torch\" or detach the state"
        )
    if q.device.type == "cpu" and not _interpreted():
        raise KernelmixError(
            "the Triton random-feature kernel got CPU tensors but Triton's interpreter is off; set "
            "TRITON_INTERPRET=1 in the environment before triton is imported, move the tensors to a GPU, "
            "or use backend=\"torch\""
        )
    if projection.shape[-2] > MAX_FEATURES or max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise KernelmixError(
            f"the Triton random-feature kernel holds at most {MAX_FEATURES} features and head and value dims of "
            f"{MAX_HEAD_DIM} (got m={projection.shape[-2]}, d={q.shape[-1]}, d_v={v.shape[-1]}); use "
            "backend=\"torch\""
        )


def _state_tensors(state, geometry: _Geometry, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(S, z, shift) to start from, detached and contiguous: the given state or an empty one."""
    batch, heads, m, dv = geometry.batch, geometry.heads, geometry.features, geometry.value_dim
    if state is None:
        f32 = dict(dtype=torch.float32)
        return (like.new_zeros(batch, heads, m, dv, **f32), like.new_zeros(batch, heads, m, **f32),
                like.new_full((batch, heads), NEG_INF, **f32))
    return tuple(x.detach().contiguous() for x in state[:3])


def _as_tuple(state):
    """``initial_state`` as (S, z, shift, length): a tuple, or a RandomFeatureState-like object."""
    if state is None or isinstance(state, (tuple, list)):
        return state
    return (state.S, state.z, state.shift, state.length)




def _folded(projection: Tensor, transform: Tensor | None) -> Tensor:
    """The projection the kernels read: W, or with DARKFormer's transform W'_h = W_h M_h ``[H, m, d]``
    (ℓ = W (M x̃) = W' x̃: no kernel writes x' = M x̃). Formed in float64 so that it is fp32-accurate
    whatever torch's TF32 setting: the logits it gives are exponentiated."""
    if transform is None:
        return projection
    return torch.matmul(projection.double(), transform.double()).float()


def _key_norms(k: Tensor, transform: Tensor | None, geometry: _Geometry) -> Tensor | None:
    """DARKFormer's ½‖M_h (d^{-1/4} k)‖² ``[B, H, T]`` fp32 per query head (``key_norm_kernel``: keys read
    per kv head, M x̃ formed in registers at the logits' accuracy), or None without a transform."""
    if transform is None:
        return None
    batch, length, heads, d = geometry.batch, geometry.length, geometry.heads, geometry.head_dim
    out = k.new_empty(batch, heads, length, dtype=torch.float32)
    key_norm_kernel[geometry.row_grid](k, transform, out, length, heads, k.shape[2], d, geometry.scale,
                                       **_key_norm_blocks(geometry))
    return out


def _key_norm_blocks(geometry: _Geometry) -> dict:
    # 8 warps at 256-wide heads: at 4, ptxas (sm_90) spilled 224 B per thread
    return dict(BLOCK_T=LOGIT_ROWS, BLOCK_D=geometry.block_d, D_STEP=min(geometry.block_d, LOGIT_STEP),
                num_warps=8 if geometry.block_d >= WIDE_HEAD else 4)


def _feature_logits(q, k, weights, norms, geometry: _Geometry) -> tuple[Tensor, Tensor]:
    """The queries' and the keys' feature logits ``[B, T, H, m]`` fp32 (keys minus their half norms), once for
    all the span kernels of a pass (``logits_kernel``): q per query head, the keys per their own head."""
    batch, length, heads = geometry.batch, geometry.length, geometry.heads
    logits = []
    for x, is_key in ((q, False), (k, True)):
        out = x.new_empty(batch, length, heads, geometry.features, dtype=torch.float32)
        logits_kernel[geometry.row_grid](x, weights, x if norms is None else norms, out, length, heads, x.shape[2],
                                         geometry.head_dim, geometry.features, geometry.w_head_stride, geometry.scale,
                                         IS_KEY=is_key, STORED_NORM=norms is not None, **geometry.logit_blocks())
        logits.append(out)
    return logits[0], logits[1]


def _launch_states(k, v, weights, norms, doc, state, geometry: _Geometry):
    """The states entering every span (the span-state kernel, then the scan over spans):
    (S per span, z per span, the entering scales, the final (S, z, shift))."""
    span_s, span_z, local, carried = geometry.state_buffers(v)
    doc_arg = k if doc is None else doc
    chunk_state_kernel[geometry.wide_grid](
        k, v, weights, k if norms is None else norms, doc_arg, span_s, span_z, local, *geometry.row_sizes(),
        HAS_DOC=doc is not None, STORED_NORM=norms is not None, **geometry.blocks("wide", rows=True))
    final = (torch.empty_like(state[0]), torch.empty_like(state[1]), torch.empty_like(state[2]))
    state_scan_kernel[geometry.scan_grid](
        span_s, span_z, local, doc_arg, *state, carried, *final, *geometry.scan_sizes(),
        HAS_DOC=doc is not None, **geometry.scan_blocks())
    return span_s, span_z, carried, final


def _launch_forward(q, k, v, weights, norms, doc, state, geometry: _Geometry):
    """The forward: (out in v's dtype, out in fp32 (the same tensor for fp32 rows), denominator, key
    shift, query max, scale entering each chunk, the states entering each span (S, z, scale), the final
    S, z, shift)."""
    batch, length, heads = geometry.batch, geometry.length, geometry.heads
    span_s, span_z, carried, final = _launch_states(k, v, weights, norms, doc, state, geometry)
    out = v.new_empty(batch, length, heads, geometry.value_dim)  # in the rows' dtype
    f32 = dict(dtype=torch.float32)
    row_scalars = [v.new_empty(batch, heads, length, **f32) for _ in range(3)]  # denominator, key shift, query max
    fine = v.new_empty(batch * heads, geometry.n_chunks, **f32)
    keep = v.dtype != torch.float32
    kept = out.new_empty(out.shape, **f32) if keep else out
    forward_kernel[geometry.grid](
        q, k, v, weights, q if norms is None else norms, q if doc is None else doc, span_s, span_z, carried, out,
        kept, *row_scalars, fine, *geometry.row_sizes(), UNDERFLOW_FLOOR, HAS_DOC=doc is not None,
        STORED_NORM=norms is not None, KEEP_FP32=keep, **geometry.blocks(rows=True),
    )
    return (out, kept, *row_scalars, fine, (span_s, span_z, carried), *final)


def triton_random_feature_attention(q, k, v, projection, transform, *, chunk_size: int, doc_start,
                                    initial_state=None):
    """Causal random-feature attention by the Triton kernels: the function of the chunked CPU path.

    ``q`` ``[B, T, H, d]``; ``k``, ``v`` ``[B, T, H_kv, d]`` / ``[B, T, H_kv, d_v]``; ``projection``
    ``[m, d]`` or ``[H, m, d]``; ``transform`` ``[H, d, d]`` or None; ``doc_start`` ``[B, T]``
    (absolute) or None; ``initial_state`` None or (S, z, shift, length) — all float32, finite.
    Returns ``(out [B, T, H, d_v], denominator [B, H, T], (S, z, shift, length))``; ``out`` is
    differentiable w.r.t. q, k, v, projection and transform, the rest is not."""
    state = _as_tuple(initial_state)
    _check_inputs(q, k, v, projection, transform, state)
    start = 0 if state is None else int(state[3])
    geometry = _Geometry(q, k, v, projection, chunk_size, start, transform is not None)
    s0, z0, shift0 = _state_tensors(state, geometry, v)
    if geometry.length == 0 or geometry.batch == 0:  # nothing to mix: no launch, the state as it was
        out = v.repeat_interleave(geometry.heads // geometry.kv_heads, dim=2)  # empty, and autograd sees v
        return (out, v.new_zeros(geometry.batch, geometry.heads, geometry.length, dtype=torch.float32),
                (s0, z0, shift0, start + geometry.length))
    doc = None if doc_start is None else doc_start.to(device=q.device, dtype=torch.int64).contiguous()
    out, denominator, s, z, shift = _RandomFeatureAttention.apply(
        q, k, v, projection, transform, doc, (s0, z0, shift0), geometry)
    return out, denominator, (s, z, shift, start + geometry.length)


class _RandomFeatureAttention(torch.autograd.Function):
    """The kernels' forward and backward; saves q, k, v, W, M (and W' = W M, the keys' half norms), O(T) row
    scalars and the span states, never features."""

    @staticmethod
    def forward(ctx, q, k, v, projection, transform, doc, state, geometry):
        q, k, v, projection = (x.contiguous() for x in (q, k, v, projection))
        transform = None if transform is None else transform.contiguous()
        weights, norms = _folded(projection, transform), _key_norms(k, transform, geometry)
        out, kept, denominator, shift_rows, q_max, fine, spans, s, z, shift = _launch_forward(
            q, k, v, weights, norms, doc, state, geometry)
        # the span states are kept (B·H·n_spans·m·d_v numbers: 1/256 of a T × m × d_v at 256-row spans),
        # not recomputed: the backward launches no state kernel in the forward direction; the output at fp32
        ctx.save_for_backward(q, k, v, projection, transform, weights, norms, doc, kept, denominator, shift_rows,
                              q_max, fine, *spans)
        ctx.geometry = geometry
        ctx.mark_non_differentiable(denominator, s, z, shift)
        return out, denominator, s, z, shift

    @staticmethod
    def backward(ctx, grad_out, *_):
        q, k, v, projection, transform, weights, norms, doc, out, denominator, shift_rows, q_max, fine, *spans = (
            ctx.saved_tensors)
        grads = _backward(q, k, v, (projection, transform, weights, norms), doc, spans, fine, out, denominator,
                          shift_rows, q_max, grad_out, ctx.geometry)
        return (*grads, None, None, None)


def _backward(q, k, v, parameters, doc, spans, fine, out, denominator, shift_rows, q_max, grad_out,
              geometry: _Geometry):
    """dL/d(q, k, v, projection, transform) (``parameters``: W, M, W' = W M and the keys' half norms, the
    last two as the forward formed them): the backward kernels give dv and the per-row gradients of the
    feature logits; the chain kernels take those through the feature map (:func:`_chain_feature_map`).
    torch's work over all rows is kept to what cannot be fused: every op here reads and writes T-long
    tensors (``kernelmix gpu-check --plan`` counts it from these very ops)."""
    g = grad_out.contiguous()  # in the output's dtype: the kernels read it so
    empty = denominator <= UNDERFLOW_FLOOR  # [B, H, T]: zero rows have zero gradients (as safe_ratio)
    # 1/den (0 on empty rows): the kernels form ĝ = g / den as they load g
    inv = torch.where(empty, torch.zeros_like(denominator), 1.0 / denominator).contiguous()
    if geometry.forms_c:
        c_row = torch.empty_like(inv)
    else:
        c_row = (g * out).sum(-1).transpose(1, 2).neg_().mul_(inv).contiguous()  # c_i = −(g_i · o_i)/den_i (o fp32)
    batch, length, heads, d = q.shape
    m = geometry.features
    f32 = dict(dtype=torch.float32)
    d_logits = (q.new_empty(batch, length, heads, m, **f32), q.new_empty(batch, length, heads, m, **f32))
    groups = heads // geometry.kv_heads
    # dv per query head: in v's dtype when it is dv itself, fp32 when grouped heads add up into it
    dv = v.new_empty(batch, length, heads, geometry.value_dim, **(f32 if groups > 1 else {}))
    lq, lk = _feature_logits(q, k, parameters[2], parameters[3], geometry)
    doc_arg = q if doc is None else doc
    span_s, span_z, carried = spans
    rows = (g, inv, c_row, shift_rows, q_max)
    # reverse direction first (its span kernel forms c): each span's part of R, the scan from the last span
    reverse_s, reverse_z, _, _ = geometry.state_buffers(v)
    reverse_state_kernel[geometry.wide_grid](
        lq, doc_arg, *rows, carried, reverse_s, reverse_z, out, *geometry.sizes(), HAS_DOC=doc is not None,
        FORMS_C=geometry.forms_c, **geometry.blocks("wide"))
    reverse_scan_kernel[geometry.scan_grid](
        reverse_s, reverse_z, doc_arg, shift_rows, carried, *geometry.scan_sizes(), HAS_DOC=doc is not None,
        **geometry.scan_blocks())
    # forward direction: each span's chunks walked from the forward's saved span states
    query_grad_kernel[geometry.feature_grid](
        lq, lk, v, doc_arg, span_s, span_z, carried, *rows, d_logits[0],
        *geometry.sizes(), HAS_DOC=doc is not None, **geometry.blocks("features"))
    # the keys walked back
    key_grad_kernel[geometry.feature_grid](
        lq, lk, v, doc_arg, reverse_s, reverse_z, fine, *rows, d_logits[1],
        *geometry.sizes(), HAS_DOC=doc is not None, **geometry.blocks("features"))
    value_grad_kernel[geometry.value_grad_grid](
        lq, lk, doc_arg, reverse_s, fine, g, inv, shift_rows, q_max, dv, *geometry.sizes(),
        HAS_DOC=doc is not None, **geometry.blocks("value_grad"))
    d_q, d_k, d_w, d_m = _chain_feature_map(q, k, d_logits, parameters[:3], groups)
    if groups > 1:  # query head h read kv head h // groups
        d_k = d_k.view(batch, length, geometry.kv_heads, groups, d).sum(3).to(k.dtype)
        dv = dv.view(batch, length, geometry.kv_heads, groups, geometry.value_dim).sum(3).to(v.dtype)
    return d_q, d_k, dv, d_w, d_m


def _chain_feature_map(q: Tensor, k: Tensor, d_logits: tuple[Tensor, Tensor], parameters, groups: int):
    """From dL/dℓ ``[B, T, H, m]`` of both sides' logits ℓ = W' x̃ (keys minus ½‖M x̃‖², ½‖x̃‖² without a
    transform; x̃ = d^{-1/4} x, W' = W M or W) to dL/dq, dL/dk per query head (the keys' in fp32 when
    grouped heads add up into them), dL/dW and dL/dM (``parameters``: W ``[H, m, d]`` or ``[m, d]``, M
    ``[H, d, d]`` or None, W'): the chain kernels (:func:`_chain_side`: dx = d^{-1/4} dℓ W' with the keys'
    norm term and the scales fused, and the span parts of dW'; ``chain_weights_kernel`` with scaled rows:
    DARKFormer's C = Σ_i s_i x_i x_iᵀ, s_i = Σ_f dℓ^k_if), at the kernels' operands (``FEATURE_OPERANDS``:
    their input dℓ already carries the span kernels' TF32 error). Each T-long tensor is read once per pass
    and written once, in place of per-program [m, d] and [d, d] accumulators in the span kernels (those
    spilled on sm_90 at m = d = 128). Then, on [H, m, d] and [H, d, d] tensors only: dW = dW' Mᵀ and
    dM = Wᵀ dW' − d^{-1/2} M C (the norm's gradient ½‖M x̃‖² → M x̃ x̃ᵀ)."""
    projection, transform, weights = parameters
    scale = q.shape[-1] ** -0.25
    d_q, dw_q = _chain_side(d_logits[0], q, weights, q.dtype, scale, None)
    key_dtype = k.dtype if groups == 1 else torch.float32
    if transform is None:  # ½‖x̃‖²: d/dx̃ = x̃, so −Σ dℓ · scale² x
        d_k, dw_k = _chain_side(d_logits[1], k, weights, key_dtype, scale, scale * scale)
        d_weights = (dw_q + dw_k) * scale  # [H, m, d]
        return d_q, d_k, d_weights.sum(0) if projection.dim() == 2 else d_weights, None
    # ½‖M x̃‖²: d/dx̃ = Σ x̃ with Σ = MᵀM; the row kernel keeps s_i = Σ_f dℓ^k_if for C
    sums = d_logits[1].new_empty(d_logits[1].shape[:3])
    d_k = _chain_rows(d_logits[1], k, weights, key_dtype, scale, scale * scale,
                      sigma=torch.matmul(transform.transpose(1, 2), transform).contiguous(), sums=sums)
    d_weights = (dw_q + _chain_weights(d_logits[1], k)) * scale
    d_w = torch.matmul(d_weights, transform.transpose(1, 2))
    d_m = (torch.matmul(projection.transpose(-1, -2), d_weights)
           - (scale * scale) * torch.matmul(transform, _chain_weights(sums, k, scaled_rows=True)))
    return d_q, d_k, d_w.sum(0) if projection.dim() == 2 else d_w, d_m


def _fuses_chain(features: int, head_dim: int) -> bool:
    """Whether a side's chain (with no product in its norm term) runs as one ``chain_kernel`` pass."""
    block_m = max(16, triton.next_power_of_2(features))
    return block_m <= FUSED_CHAIN_FEATURES and block_m * max(16, triton.next_power_of_2(head_dim)) <= FUSED_CHAIN_TILE


def _chain_side(g: Tensor, x: Tensor, weights: Tensor, out_dtype: torch.dtype, w_scale: float,
                x_coef: float | None) -> tuple[Tensor, Tensor]:
    """One side's dx = w_scale · (G W_h) − x_coef · (Σ_f G_f) x ``[B, T, H, d]`` (no x term for x_coef None)
    and Σ over rows of G_iᵀ x_i ``[H, m, d]``: one ``chain_kernel`` pass where its block fits
    (:func:`_fuses_chain`), else the row and weight kernels apart."""
    batch, length, heads, m_g = g.shape
    d = x.shape[-1]
    if not _fuses_chain(m_g, d):
        return (_chain_rows(g, None if x_coef is None else x, weights, out_dtype, w_scale, x_coef or 0.0),
                _chain_weights(g, x))
    spans, span_rows = _chain_spans(length, batch * heads)
    out = g.new_empty(batch, length, heads, d, dtype=out_dtype)
    part = g.new_empty(spans, batch * heads, m_g, d)
    chain_kernel[(spans, batch * heads)](
        g, x, weights, out, part, length, heads, x.shape[2], m_g, d, span_rows, 0 if weights.dim() == 2 else m_g * d,
        w_scale, x_coef or 0.0, **_fused_chain_blocks(m_g, d, x_coef is not None))
    return out, part.view(spans, batch, heads, m_g, d).sum((0, 1))


def _fused_chain_blocks(features: int, head_dim: int, has_x_term: bool) -> dict:
    return dict(HAS_X_TERM=has_x_term, OPERANDS=FEATURE_OPERANDS, BLOCK_T=FUSED_CHAIN_ROWS,
                BLOCK_F=max(16, triton.next_power_of_2(features)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                D_STEP=FUSED_CHAIN_STEP, num_warps=8)


def _chain_spans(length: int, programs_per_span: int) -> tuple[int, int]:
    """(spans, rows per span) of the chain's weight parts: CHAIN_SPAN_ROWS rows, doubled while the grid
    keeps MIN_PROGRAMS programs (fewer parts for torch to add), and no longer than the rows."""
    rows = CHAIN_SPAN_ROWS
    while rows < length and triton.cdiv(length, 2 * rows) * programs_per_span >= MIN_PROGRAMS:
        rows *= 2
    return triton.cdiv(length, rows), rows


def _chain_rows(g: Tensor, x: Tensor | None, weights: Tensor, out_dtype: torch.dtype, w_scale: float,
                x_coef: float, sigma: Tensor | None = None, sums: Tensor | None = None) -> Tensor:
    """w_scale · (G W_h) − x_coef · (Σ_f G_f) x ``[B, T, H, d]`` (no x term for x None; x Σ_h for x with
    ``sigma`` ``[H, d, d]``, the row sums Σ_f G_f then written into ``sums`` ``[B, T, H]``)."""
    batch, length, heads, m_g = g.shape
    d = weights.shape[-1]
    out = g.new_empty(batch, length, heads, d, dtype=out_dtype)
    x_arg = g if x is None else x
    chain_rows_kernel[(triton.cdiv(length, CHAIN_ROWS), batch * heads)](
        g, x_arg, weights, g if sigma is None else sigma, out, g if sums is None else sums, length, heads,
        heads if x is None else x.shape[2], m_g, d, 0 if weights.dim() == 2 else m_g * d, w_scale, x_coef,
        HAS_X_TERM=x is not None, X_THROUGH_SIGMA=sigma is not None, OPERANDS=FEATURE_OPERANDS,
        BLOCK_T=CHAIN_ROWS, BLOCK_D=max(16, triton.next_power_of_2(d)), F_STEP=CHAIN_STEP, num_warps=8)
    return out


def _chain_columns(columns: int, block_d: int) -> int:
    """Columns of G per program of the weight-gradient kernel: up to CHAIN_COLUMNS, half at 256-wide heads
    (ptxas, sm_90: 128 spilled 616 B per thread at d = 256, none at 64)."""
    widest = CHAIN_COLUMNS if block_d < WIDE_HEAD else CHAIN_COLUMNS // 2
    return min(widest, max(16, triton.next_power_of_2(columns)))


def _chain_weights(g: Tensor, x: Tensor, scaled_rows: bool = False) -> Tensor:
    """Σ over rows of G_iᵀ x_i per query head ``[H, m_g, d]`` (fp32): the kernel's span parts, added. With
    ``scaled_rows``, ``g`` is s ``[B, T, H]`` and G_i = s_i x_i: Σ_i s_i x_i x_iᵀ ``[H, d, d]``."""
    batch, length, heads = g.shape[:3]
    d = x.shape[-1]
    m_g = d if scaled_rows else g.shape[3]
    block_d = max(16, triton.next_power_of_2(d))
    block_f = _chain_columns(m_g, block_d)
    spans, span_rows = _chain_spans(length, batch * heads * triton.cdiv(m_g, block_f))
    part = g.new_empty(spans, batch * heads, m_g, d)
    chain_weights_kernel[(spans, batch * heads, triton.cdiv(m_g, block_f))](
        g, x, part, length, heads, x.shape[2], m_g, d, span_rows, SCALED_ROWS=scaled_rows,
        OPERANDS=FEATURE_OPERANDS, BLOCK_T=CHAIN_ROWS, BLOCK_F=block_f, BLOCK_D=block_d, num_warps=8)
    return part.view(spans, batch, heads, m_g, d).sum((0, 1))


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def feature_launches(batch: int, heads: int, kv_heads: int, length: int, head_dim: int, value_dim: int,
                     features: int, *, chunk_size: int, has_transform: bool, has_doc: bool,
                     row_dtype: torch.dtype = torch.float32) -> list[KernelLaunch]:
    """The kernels one differentiated call launches at these sizes on q, k, v of ``row_dtype`` (forward:
    DARKFormer's keys' half norms, the span states, the scan over spans, the outputs; backward: the logits,
    the query logits' gradients from the saved span states, the reverse span states, their scan, the key
    logits' and the value gradients, the chain through the feature map), with the grids, blocks and warps
    of the launches above (the same ``_Geometry``, built on meta tensors: no memory, no GPU)."""
    q = torch.empty(batch, length, heads, head_dim, device="meta", dtype=row_dtype)
    k = torch.empty(batch, length, kv_heads, head_dim, device="meta", dtype=row_dtype)
    v = torch.empty(batch, length, kv_heads, value_dim, device="meta", dtype=row_dtype)
    projection = torch.empty(heads, features, head_dim, device="meta")  # per head (a shared one launches the same)
    geometry = _Geometry(q, k, v, projection, chunk_size, 0, has_transform)
    rows = _POINTER_TYPES[row_dtype]
    # q, k, v, g, the output in the rows' dtype; the stored logits lq, lk, W, M and the half norms: fp32
    pointers = {"doc_ptr": "*i64", "q_ptr": rows, "k_ptr": rows, "v_ptr": rows, "g_ptr": rows, "out_ptr": rows,
                "dv_ptr": rows if heads == kv_heads else "*fp32"}
    width = {"*fp32": 4, "*bf16": 2, "*fp16": 2}
    tiles = dict(block_t=geometry.block_t, block_d=geometry.block_d, block_m=geometry.block_m,
                 block_v=geometry.block_v, block_f=geometry.block_f, block_dv=geometry.block_dv,
                 chunks=geometry.n_chunks, spans=geometry.n_spans,
                 span_blocks=geometry.span_blocks, has_transform=has_transform, features=features,
                 value_dim=value_dim, scan_tile=SCAN_TILE, key_bytes=width[rows], value_bytes=width[rows],
                 forms_c=geometry.forms_c)
    launches = []
    for name, kernel in (("features_chunk_states", chunk_state_kernel), ("features_state_scan", state_scan_kernel),
                         ("features_forward", forward_kernel), ("features_query_grad", query_grad_kernel),
                         ("features_reverse_states", reverse_state_kernel),
                         ("features_reverse_scan", reverse_scan_kernel), ("features_key_grad", key_grad_kernel),
                         ("features_value_grad", value_grad_kernel)):
        scan = kernel in (state_scan_kernel, reverse_scan_kernel)
        kind = ("features" if kernel in (query_grad_kernel, key_grad_kernel) else "value_grad"
                if kernel is value_grad_kernel else "wide" if kernel in (chunk_state_kernel, reverse_state_kernel)
                else "values")
        blocks = geometry.scan_blocks() if scan else geometry.blocks(kind, rows=kernel in (chunk_state_kernel,
                                                                                           forward_kernel))
        warps = blocks.pop("num_warps")
        constexprs = dict(HAS_DOC=has_doc, STORED_NORM=has_transform, KEEP_FP32=row_dtype != torch.float32,
                          FORMS_C=geometry.forms_c) | blocks
        constexprs = {key: value for key, value in constexprs.items() if key in kernel.arg_names}
        # the reverse states read the output kept at fp32 (to form c), the forward writes it in the rows' dtype
        kernel_pointers = dict(pointers, out_ptr="*fp32") if kernel is reverse_state_kernel else pointers
        grid = geometry.scan_grid if scan else dict(features=geometry.feature_grid, wide=geometry.wide_grid,
                                                    value_grad=geometry.value_grad_grid).get(kind, geometry.grid)
        launches.append(KernelLaunch(name, kernel, grid, constexprs, warps,
                                     aot_signature(kernel, constexprs, kernel_pointers, {"scale", "floor"}),
                                     dict(tiles, block_v=blocks.get("BLOCK_V", geometry.block_v),
                                          block_m=blocks.get("BLOCK_M", geometry.block_m)), 1))
    # the feature logits of both sides, in the backward; compiled as the keys'
    logit_blocks = geometry.logit_blocks()
    warps = logit_blocks.pop("num_warps")
    logit_blocks.update(IS_KEY=True, STORED_NORM=has_transform)
    launches.insert(0, KernelLaunch(
        "features_logits", logits_kernel, geometry.row_grid, logit_blocks, warps,
        aot_signature(logits_kernel, logit_blocks, {"x_ptr": rows}, {"scale"}),
        dict(tiles, block_t=LOGIT_ROWS, chunks=geometry.row_grid[0]), 2))
    launches += _chain_launches(geometry, rows, width[rows], has_transform)
    if has_transform:  # DARKFormer's keys' half norms, once in the forward (the backward reads them)
        blocks = _key_norm_blocks(geometry)
        warps = blocks.pop("num_warps")
        launches.insert(0, KernelLaunch("features_key_norms", key_norm_kernel, geometry.row_grid, blocks, warps,
                                        aot_signature(key_norm_kernel, blocks, {"x_ptr": rows}, {"scale"}),
                                        dict(tiles, block_t=blocks["BLOCK_T"], chunks=geometry.row_grid[0]), 1))
    return launches


def _chain_launches(geometry: _Geometry, rows: str, row_bytes: int, has_transform: bool) -> list[KernelLaunch]:
    """The chain through the feature map, per side: the fused pass (dx = dℓ W' and the span parts of dW';
    Performer's compiled and costed as the keys', with the norm term) where its block fits, else the row
    kernel (compiled and costed as the keys', the heavier: DARKFormer's through Σ) and the weight kernel;
    and DARKFormer's C = Σ s x xᵀ (the weight kernel with scaled rows)."""
    batch_heads, length, features, d = geometry.batch * geometry.heads, geometry.length, geometry.features, \
        geometry.head_dim
    tiles = dict(block_d=geometry.block_d, features=features, has_transform=has_transform, length=length,
                 key_bytes=row_bytes, value_bytes=row_bytes)
    pointers = {"g_ptr": "*fp32", "x_ptr": rows, "out_ptr": rows}
    fused = _fuses_chain(features, d)
    launches = []
    if fused:  # the queries' (DARKFormer's), or both sides' (Performer's)
        blocks = _fused_chain_blocks(features, d, not has_transform)
        warps = blocks.pop("num_warps")
        spans, _ = _chain_spans(length, batch_heads)
        launches.append(KernelLaunch(
            "features_chain", chain_kernel, (spans, batch_heads), blocks, warps,
            aot_signature(chain_kernel, blocks, pointers, {"w_scale", "x_coef"}),
            dict(tiles, chain_spans=spans, chain_rows=FUSED_CHAIN_ROWS, x_term=not has_transform),
            1 if has_transform else 2))
    apart = 1 if fused else 2  # sides whose row and weight halves run apart
    if has_transform or not fused:
        row_blocks = dict(OPERANDS=FEATURE_OPERANDS, BLOCK_T=CHAIN_ROWS, BLOCK_D=geometry.block_d, HAS_X_TERM=True,
                          X_THROUGH_SIGMA=has_transform, F_STEP=CHAIN_STEP)
        launches.append(KernelLaunch(
            "features_chain_rows", chain_rows_kernel, (triton.cdiv(length, CHAIN_ROWS), batch_heads), row_blocks, 8,
            aot_signature(chain_rows_kernel, row_blocks, pointers, {"w_scale", "x_coef"}),
            dict(tiles, chain_rows=CHAIN_ROWS), apart))
    weight_kernels = [("features_chain_weights", False, features, apart)] if has_transform or not fused else []
    if has_transform:
        weight_kernels.append(("features_chain_norm", True, d, 1))
    for name, scaled, columns, calls in weight_kernels:
        block_f = _chain_columns(columns, geometry.block_d)
        blocks = dict(OPERANDS=FEATURE_OPERANDS, BLOCK_T=CHAIN_ROWS, BLOCK_D=geometry.block_d, SCALED_ROWS=scaled,
                      BLOCK_F=block_f)
        spans, _ = _chain_spans(length, batch_heads * triton.cdiv(columns, block_f))
        launches.append(KernelLaunch(
            name, chain_weights_kernel, (spans, batch_heads, triton.cdiv(columns, block_f)), blocks, 8,
            aot_signature(chain_weights_kernel, blocks, pointers, set()),
            dict(tiles, chain_spans=spans, chain_columns=block_f, chain_width=columns), calls))
    return launches
