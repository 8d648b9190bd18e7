"""Input validation, the precision policy and small numerics helpers shared by the ops.

Every op takes ``[B, T, H, d]`` tensors. Keys and values may have fewer heads than the
queries (grouped-query attention) as long as the query head count is a multiple; they are
expanded to the query heads inside the op.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import Tensor

from ..errors import KernelmixError
from ..lazy import after_import

# ---------------------------------------------------------------------------------------------
# Precision policy (bf16 inputs, bf16 autocast)
#
# 1. Solves (Cubit, DeltaFormer), random-feature logits and recurrent states run in
#    ``compute_dtype`` — float32, or float64 when an input is float64 — with autocast switched
#    off around them (``autocast_off``): bf16 rounding there compounds along the sequence, and
#    exp of a bf16 logit loses the ratio's accuracy. The ops return their output in the input
#    (value) dtype.
# 2. The softmax read-out (SDPA: the softmax mixer, and Cubit's / DeltaFormer's read-out of U)
#    follows the input dtype, except on a CPU whose matrix units have no bf16 support (no
#    AVX512-BF16 / AMX / AVX512 core, e.g. AVX2 machines): there oneDNN and the SDPA kernels
#    emulate bf16 products and run them 5–7× slower than fp32, so the read-out is computed in
#    fp32 — inputs cast up, autocast off — and the result cast back to bf16, the dtype the bf16
#    path (or bf16 autocast) would have returned. The result is at least as accurate as the bf16
#    computation (it rounds once, at the end). Never applied on CUDA or other accelerators, nor on
#    CPUs with native bf16 support: there bf16 is the fast path (``bf16_attention_in_fp32``).


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype solves, feature logits and states run in: float64 if any input is, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def autocast_off(x: Tensor):
    """A context in which autocast does not reach the computation on ``x``'s device (policy 1)."""
    return torch.autocast(x.device.type, enabled=False)


def _native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (oneDNN's own check: AVX512 core /
    AVX512-BF16 / AMX on x86, the bf16 extension on Arm)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: decide from the vector unit
        return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


cpu_has_native_bf16 = functools.lru_cache(maxsize=None)(_native_bf16)


def _constant_for_the_compiler() -> None:
    """torch.compile takes :func:`cpu_has_native_bf16` as a constant, not a graph break per call
    (``torch.compiler.assume_constant_result``), applied when torch._dynamo is imported (it always is
    before anything compiles) rather than at this module's import, which it would slow by seconds."""
    global cpu_has_native_bf16
    cpu_has_native_bf16 = functools.lru_cache(maxsize=None)(torch.compiler.assume_constant_result(_native_bf16))


after_import("torch._dynamo", _constant_for_the_compiler)


def bf16_attention_in_fp32(x: Tensor) -> bool:
    """True where the attention products of ``x`` (bf16, or fp32 under bf16 autocast) should run in
    fp32: a CPU tensor on a CPU without native bf16 support (policy 2)."""
    if x.device.type != "cpu" or cpu_has_native_bf16():
        return False
    if x.dtype == torch.bfloat16:
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def readout_values(q: Tensor, u: Tensor) -> Tensor:
    """Solved values U (fp32+) for the read-out: in q's dtype, or kept as they are where the
    read-out runs in fp32 under the CPU bf16 policy (no needless bf16 rounding of U)."""
    return u if bf16_attention_in_fp32(q) else u.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Input validation and shared numerics


def softmax_scale(q: Tensor, scale: float | None) -> float:
    """The softmax logits' scale: ``scale``, or 1/√d for queries of head dim d when it is None."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    try:
        return float(scale)
    except (TypeError, ValueError, RuntimeError):  # a list, a string, a tensor of several elements
        raise KernelmixError(f"scale must be a float (or None for 1/√d), got {type(scale).__name__}") from None


def check_tensor(name: str, x, shape: str, dtype: str = "torch.float32") -> None:
    """A KernelmixError naming ``name`` when ``x`` is not a tensor (a list, a NumPy array, ...)."""
    if not isinstance(x, Tensor):
        raise KernelmixError(
            f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}; pass a torch.Tensor "
            f"(e.g. torch.as_tensor({name}, dtype={dtype}))"
        )


def check_4d(name: str, x: Tensor) -> None:
    check_tensor(name, x, "[B, T, H, d]")
    if x.dim() != 4:
        raise KernelmixError(
            f"{name} must have shape [B, T, H, d] (4 dims), got {x.dim()} dims with shape {tuple(x.shape)}; "
            "reshape [B, T, H*d] inputs with x.view(B, T, H, d)"
        )
    if not x.is_floating_point():
        raise KernelmixError(f"{name} must be a floating tensor (float64, float32 or bfloat16), got {x.dtype}")


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``: how a user writes it."""
    return str(dtype).removeprefix("torch.")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, v_heads_follow_q: bool = False, same_length: bool = True,
              same_dtype: bool = False) -> None:
    """Check q, k, v agree on batch, length and head grouping; raise KernelmixError naming the fix.
    ``same_length=False`` (masked attention over a cache): only k and v need the same length.
    ``same_dtype=True``: q, k, v must share a dtype (the ops that hand them to SDPA or a solve, which
    would fail naming internal tensors); the random-feature ops take a float32 query fold beside
    bf16 keys, so the check is the caller's choice. Devices must always agree."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_4d(name, x)
    if same_dtype and not (q.dtype == k.dtype == v.dtype):
        raise KernelmixError(
            f"dtypes differ: q {dtype_name(q.dtype)}, k {dtype_name(k.dtype)}, v {dtype_name(v.dtype)}; give q, k, v "
            "one dtype, e.g. k.to(q.dtype) and v.to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise KernelmixError(f"devices differ: q on {q.device}, k on {k.device}, v on {v.device}; move them to one "
                             f"device (e.g. k.to(q.device))")
    bq, tq, hq, dq = q.shape
    bk, tk, hk, dk = k.shape
    bv, tv, hv, _ = v.shape
    if not (bq == bk == bv):
        raise KernelmixError(f"batch sizes differ: q {bq}, k {bk}, v {bv}; all of q, k, v need the same B")
    if same_length and not (tq == tk == tv):
        raise KernelmixError(f"sequence lengths differ: q {tq}, k {tk}, v {tv}; all of q, k, v need the same T")
    if tk != tv:
        raise KernelmixError(f"sequence lengths differ: k {tk}, v {tv}; k and v need the same length")
    if dq != dk:
        raise KernelmixError(f"head dims differ: q has d={dq}, k has d={dk}; q and k need the same head dim")
    if hk != hv and not v_heads_follow_q:
        raise KernelmixError(f"k has {hk} heads but v has {hv}; k and v need the same number of heads")
    for name, h in (("k", hk), ("v", hv)):
        if h <= 0 or hq % h != 0:
            raise KernelmixError(
                f"q has {hq} heads but {name} has {h}; the query head count must be a multiple of the "
                f"key/value head count (grouped-query attention)"
            )


def check_mask(mask: Tensor, q: Tensor, k: Tensor) -> None:
    """Check an attention mask for queries ``[B, T, ...]`` and keys ``[B, L, ...]``: bool
    ``[B, T, L]`` (or ``[1, T, L]``, shared by the batch), True where query t reads key l."""
    expected = (q.shape[0], q.shape[1], k.shape[1])
    check_tensor("mask", mask, f"[B, T, L] = {expected} (True: visible)", "torch.bool")
    if mask.dtype != torch.bool or mask.dim() != 3:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise KernelmixError(f"mask must be a bool tensor [B, T, L] = {expected} (True: visible), got {got}")
    if mask.shape[0] not in (1, expected[0]) or tuple(mask.shape[1:]) != expected[1:]:
        raise KernelmixError(f"mask must have shape [B, T, L] = {expected} (or [1, T, L]), got {tuple(mask.shape)}")


def check_per_token_heads(name: str, x: Tensor | None, q: Tensor) -> None:
    """Check a per-token, per-head tensor such as rho or beta has shape [B, T, H]."""
    if x is None:
        return
    expected = tuple(q.shape[:3])
    check_tensor(name, x, f"[B, T, H] = {expected}")
    if tuple(x.shape) != expected:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise KernelmixError(f"{name} must have shape [B, T, H] = {expected}, got {got}")


def check_per_token_range(name: str, x: Tensor | None, *, upper: float | None, zero: bool, fix: str) -> None:
    """Check a per-token, per-head factor ``x`` ``[B, T, H]`` lies in (0, upper] — [0, upper] with
    ``zero``, (0, ∞) when ``upper`` is None: a KernelmixError naming the first value outside, the range
    and ``fix``. Non-finite entries are left to the non-finite guard (they make the rows that see them
    NaN). The check syncs, so it runs only where :func:`scan_syncs` allows one (the CPU, eagerly): on
    an accelerator or under ``torch.compile`` every layer of every step would wait for it."""
    if x is None or not scan_syncs(x.device):
        return
    values = x.detach()
    outside = values < 0 if zero else values <= 0
    if upper is not None:
        outside = outside | (values > upper)
    outside = outside & torch.isfinite(values)
    if not bool(outside.any()):
        return
    b, t, h = (int(i) for i in outside.nonzero()[0])
    valid = ("[0, " if zero else "(0, ") + ("∞)" if upper is None else f"{upper:g}]")
    raise KernelmixError(
        f"{name} must lie in {valid} for every token and head, got {float(values[b, t, h]):g} at "
        f"[b, t, h] = [{b}, {t}, {h}] ({int(outside.sum())} of {values.numel()} values outside); {fix}"
    )


def per_head(name: str, value: float | Tensor, num_heads: int, like: Tensor, *, positive: bool) -> Tensor:
    """Turn a float or a [H] tensor into a [H] tensor in the compute dtype (keeps autograd).
    A tensor's positivity is checked eagerly only: under torch.compile the check would break the graph."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            value = value.expand(num_heads)
        if tuple(value.shape) != (num_heads,):
            raise KernelmixError(f"{name} must be a float or a tensor of shape [H] = "
                                 f"({num_heads},), got {tuple(value.shape)}")
        # the value check syncs: under torch.compile it would break the graph, so it runs eagerly only
        if positive and not torch.compiler.is_compiling() and bool((value.detach() <= 0).any()):
            raise KernelmixError(f"{name} must be > 0 for every head, got min {value.detach().min().item():g}")
        return value.to(dtype=like.dtype, device=like.device)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelmixError(f"{name} must be a float or a torch.Tensor of shape [H] = ({num_heads},), "
                             f"got {type(value).__name__}")
    value = float(value)
    if positive and not value > 0:
        raise KernelmixError(f"{name} must be > 0, got {value:g}")
    return torch.full((num_heads,), value, dtype=like.dtype, device=like.device)


def check_state(op: str, state, cls: type, fields: dict[str, tuple[tuple, str]], *, same_length: tuple[str, ...] = (),
                optional: tuple[str, ...] = ()) -> None:
    """Check a decode state handed to ``op``: an instance of ``cls`` whose tensor fields have the
    expected shapes (``fields``: name → (shape with None for a free dim, its layout in words)); the
    fields named in ``same_length`` must agree on dim 1 (the cached tokens); those in ``optional``
    may be None."""
    if not isinstance(state, cls):
        raise KernelmixError(
            f"{op}: state must be a {cls.__name__} (returned by the parallel op with return_state=True or by the "
            f"previous step), or None to start a sequence; got {type(state).__name__}"
        )
    for name, (expected, layout) in fields.items():
        value = getattr(state, name)
        if value is None and name in optional:
            continue
        fits = isinstance(value, Tensor) and value.dim() == len(expected)
        fits = fits and all(e is None or e == g for e, g in zip(expected, value.shape))
        if not fits:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            want = "(" + ", ".join("t" if e is None else str(e) for e in expected) + ")"
            raise KernelmixError(
                f"{op}: the state does not fit: state.{name} has shape {got}, expected {layout} = {want}; "
                "it was built for another batch size, number of heads, head dim or projection — pass the "
                "state this op (this layer) returned for the same sequence"
            )
    lengths = {name: getattr(state, name).shape[1] for name in same_length if getattr(state, name) is not None}
    if len(set(lengths.values())) > 1:
        raise KernelmixError(f"{op}: the state is inconsistent: "
                             f"its cached lengths differ ({lengths}); pass an unmodified state")


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise KernelmixError(f"chunk_size must be a positive int, got {chunk_size!r}")


# The chunked PyTorch paths of the random-feature ops under autograd keep every chunk's tiles
# (features, intra-chunk scores, carried states) for the backward: ~6× SDPA's peak at T = 8192. Cut
# into segments of about this many tokens (a whole number of chunks, so the chunks are the same),
# each segment's activations are recomputed in the backward from its inputs and the state it
# started from: the peak holds one segment's tiles, for one more forward pass of compute.
RECOMPUTE_SEGMENT_TOKENS = 1024


def recompute_segments(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` token ranges of about :data:`RECOMPUTE_SEGMENT_TOKENS` tokens, each a
    whole number of ``chunk_size`` chunks (the last one shorter), covering ``range(length)``."""
    tokens = max(1, RECOMPUTE_SEGMENT_TOKENS // chunk_size) * chunk_size
    return [(start, min(start + tokens, length)) for start in range(0, length, tokens)] or [(0, 0)]


def split_segments(x: Tensor | None, segments: list[tuple[int, int]], dim: int = 1) -> list[Tensor | None]:
    """``x`` cut along ``dim`` into the :func:`recompute_segments` ranges (None → Nones). One
    ``torch.split``, not a slice per segment: a slice's backward writes its gradient into a zeroed
    tensor of the whole input, so T / 1,024 slices cost O(T²) in fills and adds (3× per doubling of T
    at 16k); the split's backward is one concatenation."""
    if x is None:
        return [None] * len(segments)
    return list(torch.split(x, [end - start for start, end in segments], dim=dim))


def recompute_in_segments(*tensors) -> bool:
    """Cut the call into checkpointed segments: autograd records it (grad mode on, one of ``tensors``
    — None skipped — requires grad) and it runs eagerly (under ``torch.compile`` the partitioner
    chooses what to keep and recompute, and one graph per call stays one graph)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def expand_heads(x: Tensor, num_heads: int, dim: int = 2) -> Tensor:
    """Repeat grouped key/value heads so there is one per query head (no copy when equal)."""
    check_tensor("x", x, "[B, T, H, ...]")
    h = x.shape[dim]
    if h == num_heads:
        return x
    return x.repeat_interleave(num_heads // h, dim=dim)


# ---------------------------------------------------------------------------------------------
# Decode caches that grow in amortised O(1) per token
#
# A decode step appends one token to the cached keys (values, u, r̂). ``torch.cat`` copies the
# whole cache to do it: O(t) per token, O(T²) for a generation, and at long positions the copy
# costs as much as the attention read itself. ``append_rows`` instead writes into spare rows of a
# buffer the cache is a prefix view of, and reallocates (× 1.5) only when it is full. A state stays
# a value: its tensors are never written where it can see — the rows past a view's end are written
# only while that view is the newest one handed out from its buffer (``_ROWS_HANDED_OUT``), so a
# cache continued twice (two generations from one prompt) copies on the second continuation.

#: id(buffer) → (a weak reference to it, how many of its rows views have been handed out for)
_ROWS_HANDED_OUT: dict[int, tuple[weakref.ref, int]] = {}
#: rows a fresh buffer holds beyond what is needed now: at least this many, or half as many again
MIN_SPARE_ROWS = 64


def _handed_out(buffer: Tensor) -> int | None:
    entry = _ROWS_HANDED_OUT.get(id(buffer))
    return entry[1] if entry is not None and entry[0]() is buffer else None


def _hand_out(buffer: Tensor, rows: int) -> Tensor:
    key = id(buffer)
    ref = _ROWS_HANDED_OUT[key][0] if _handed_out(buffer) is not None else (
        weakref.ref(buffer, lambda _ref, key=key: _ROWS_HANDED_OUT.pop(key, None)))
    _ROWS_HANDED_OUT[key] = (ref, rows)
    return buffer[:, :rows]


def append_rows(cached: Tensor | None, new: Tensor) -> Tensor:
    """``torch.cat([cached, new], dim=1)`` (``new`` alone when ``cached`` is None), as a prefix
    view of a buffer with spare rows: amortised O(new) instead of O(cached + new). The result has
    the values, dtype and shape of the concatenation; the inputs are not modified."""
    if cached is None:
        cached = new[:, :0]
    t, n = cached.shape[1], new.shape[1]
    buffer = cached._base
    grows_in_place = (
        buffer is not None and _handed_out(buffer) == t and t + n <= buffer.shape[1]
        and buffer.shape[0] == cached.shape[0] and buffer.shape[2:] == cached.shape[2:]
        and cached.data_ptr() == buffer.data_ptr() and cached.stride() == buffer.stride()
        and new.dtype == buffer.dtype and new.device == buffer.device
        and not (new.requires_grad or buffer.requires_grad)  # autograd would see an in-place write
        and (torch.is_inference_mode_enabled() or not buffer.is_inference())
    )
    if not grows_in_place:
        dtype = torch.promote_types(cached.dtype, new.dtype)
        if new.requires_grad or cached.requires_grad:  # keep the graph: a plain concatenation
            return torch.cat([cached.to(dtype), new.to(dtype)], dim=1)
        rows = t + n + max(MIN_SPARE_ROWS, (t + n) // 2)
        buffer = new.new_empty((new.shape[0], rows, *new.shape[2:]), dtype=dtype)
        buffer[:, :t] = cached
    buffer[:, t : t + n] = new
    return _hand_out(buffer, t + n)


def query_rows_per_kv_head(q_t: Tensor, kv_heads: int) -> Tensor:
    """One token's queries ``[B, H, d]`` as ``[B, H_kv, G, d]``: the G = H / H_kv query heads that
    share a key/value head become G query rows of that head (the order :func:`expand_heads`
    pairs them in), so a decode step reads the cached keys and values once as they are instead of
    copying them G times over."""
    batch, heads, dim = q_t.shape
    return q_t.reshape(batch, kv_heads, heads // kv_heads, dim)


def decode_logits(q_t: Tensor, keys: Tensor, dtype: torch.dtype) -> Tensor:
    """One token's query–key products: ``q_t`` ``[B, H, d]`` against the cached ``keys``
    ``[B, t, H_kv, d]``, ``[B, H, t]`` in ``dtype``; each cached key is read once for the query
    heads that share it (:func:`query_rows_per_kv_head`), not repeated per head."""
    rows = query_rows_per_kv_head(q_t.to(dtype), keys.shape[2])
    return torch.einsum("bkgd,bjkd->bkgj", rows, keys.to(dtype)).flatten(1, 2)


def check_doc_start(doc_start: Tensor | None, batch: int, length: int, offset: int = 0) -> None:
    """Check document starts ``[B, T]``: integers with 0 ≤ doc_start[b, i] ≤ offset + i, describing
    contiguous documents (each token starts one, doc_start = its index, or continues the previous's).

    ``doc_start[b, i]`` is the absolute index of the first token of token i's document (token i sits
    at absolute index ``offset + i``); token i reads token j only if doc_start[b, i] ≤ j ≤ i.
    Packed documents and left padding are both expressed this way."""
    if doc_start is None:
        return
    if torch.compiler.is_compiling():  # a traced memo would guard on module state and recompile every call
        _check_doc_start(doc_start, batch, length, offset)
        return
    if _checked_already(doc_start, (batch, length, offset)):
        return
    _check_doc_start(doc_start, batch, length, offset)
    _LAST_CHECKED_DOC_START[:] = [weakref.ref(doc_start), doc_start._version, (batch, length, offset)]


#: the doc_start checked last — a model hands one tensor to every layer, so layers 2…L of a forward
#: skip the check and its device sync: [weak reference, its version counter (bumped by any in-place
#: change), (batch, length, offset)]
_LAST_CHECKED_DOC_START: list = [None, None, None]


def _checked_already(doc_start: Tensor, key: tuple[int, int, int]) -> bool:
    ref, version, checked_key = _LAST_CHECKED_DOC_START
    return ref is not None and ref() is doc_start and version == doc_start._version and checked_key == key


def _check_doc_start(doc_start: Tensor, batch: int, length: int, offset: int) -> None:
    check_tensor("doc_start", doc_start, f"[B, T] = {(batch, length)}", "torch.long")
    if tuple(doc_start.shape) != (batch, length):
        raise KernelmixError(f"doc_start must have shape [B, T] = {(batch, length)}, got {tuple(doc_start.shape)}")
    if doc_start.is_floating_point() or doc_start.dtype == torch.bool:
        raise KernelmixError(f"doc_start must be an integer tensor (absolute token indices), got {doc_start.dtype}")
    index = offset + torch.arange(length, device=doc_start.device)
    out_of_range = (doc_start < 0) | (doc_start > index)
    # Documents are contiguous runs: every token starts one or continues the previous token's. The
    # fast paths rely on it (a token's document never starts before an earlier token's); anything
    # else, e.g. a sliding window, would give each path a different answer.
    previous, current = doc_start[:, :-1], doc_start[:, 1:]
    broken = ~((current == previous) | (current == index[1:]))
    if not bool(out_of_range.any() | broken.any()):  # one device sync for both checks
        return
    if bool(out_of_range.any()):
        raise KernelmixError(
            "doc_start[b, i] must lie in [0, i] (the first token of token i's document, in absolute indices "
            f"starting at {offset}); got values outside that range"
        )
    b, i = (int(x) for x in broken.nonzero()[0])
    raise KernelmixError(
        f"doc_start must describe contiguous documents, but in batch row {b} the token at index {offset + i + 1} "
        f"has doc_start {int(current[b, i])} after {int(previous[b, i])}; a CausalLM derives it from position_ids, "
        "which must count up by one inside each document"
    )


def solve_backward_buffers(needs_input_grad, x: Tensor, u: Tensor, grad_u: Tensor, beta: Tensor | None,
                           y_scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The buffers both CPU solves' backward passes start from: ``grad_b`` ``[B, H, T, d_v]`` (a view of a
    [B, T, H, d_v] buffer, so db comes out in the inputs' layout), holding dU at first: it is the right-hand
    side of the transposed solve, and its rows turn into db as the solve reaches them; dγ ``[H]`` at zero;
    and dβ / d(y_scale) ``[B, H, T]`` where those inputs exist and want a gradient (their
    ``needs_input_grad`` slots 3 and 5), else None."""
    batch, heads, length, _ = x.shape
    grad_b = u.new_empty(batch, length, heads, u.shape[-1]).transpose(1, 2)
    grad_b.copy_(grad_u)
    grad_beta = None if beta is None or not needs_input_grad[3] else x.new_empty(batch, heads, length)
    grad_y_scale = None if y_scale is None or not needs_input_grad[5] else x.new_empty(batch, heads, length)
    return grad_b, x.new_zeros(heads), grad_beta, grad_y_scale


def causal_hidden(size: int, strict: bool, device) -> Tensor:
    """``[size, size]`` booleans, True where column j is not visible from row i: j > i, or j ≥ i
    when ``strict`` (a diagonal block of the causal mask, inverted)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(0 if strict else 1)


def visible(rows: Tensor, cols: Tensor, doc_start: Tensor | None, *, strict: bool = False) -> Tensor:
    """Which (row, column) pairs may interact: ``[B or 1, 1, R, C]`` booleans.

    ``rows``/``cols`` are absolute token indices; causal (j ≤ i, or j < i when ``strict``) and, with
    ``doc_start`` ``[B, R]`` (for the rows), within the row's document (j ≥ doc_start[b, i])."""
    mask = cols[None, :] < rows[:, None] if strict else cols[None, :] <= rows[:, None]
    mask = mask[None, None]
    if doc_start is not None:
        mask = mask & (cols[None, None, None, :] >= doc_start[:, None, :, None])
    return mask


def masked_softmax(logits: Tensor, hidden: Tensor) -> Tensor:
    """Softmax over the last dim ignoring ``hidden`` entries; a row with nothing visible is all
    zeros (the empty sum), with finite gradients — not the NaN a plain −inf fill would give."""
    empty = hidden.all(dim=-1, keepdim=True)
    logits = logits.masked_fill(hidden, float("-inf")).masked_fill(empty, 0.0)
    return logits.softmax(dim=-1).masked_fill(hidden, 0.0)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs (NaN, ±inf)
#
# A dense masked product gives a hidden entry the weight 0, and 0 · NaN = NaN: a NaN value at
# position t (or a NaN key behind an additive −inf mask) reached rows < t and other documents in
# every op, and the random-feature ratio then turned whole rows into exact zeros. So the fast paths
# zero the (token, head) inputs that hold a NaN or ±inf before computing — a row that cannot see them
# is then bitwise what the clean input gives, since every op is causal for finite inputs — and set
# to NaN afterwards every row that can see one: a later row of the same document for the causal ops,
# a row whose mask shows it for the masked ones. That is what the math gives (one NaN in a sum makes
# it NaN) and what SDPA does for the rows it should reach. A whole row is set, not just the
# affected value columns: a NaN key spoils every column anyway.
#
# Cost: on the CPU one reduction per input and a sync (free there) decide, so finite inputs run
# exactly as before; elsewhere nothing syncs and the masks are always built: a few elementwise passes
# over the inputs, O(T·H·d), beside the op's own O(T·C·d) or more.


def scan_syncs(device: torch.device) -> bool:
    """Whether the non-finite scan may sync to skip the guard for finite inputs: on the CPU, where a
    sync is free, unless ``torch.compile`` traces (a data-dependent branch would break the graph)."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


class NonFinite:
    """The (token, head) pairs of an op's inputs that hold a NaN or ±inf (see :func:`find_nonfinite`).

    ``masks``: per input name, ``[B, T, H_x]`` booleans; ``bad``: their union on the ``heads`` query
    heads, ``[B, T, H]``."""

    def __init__(self, masks: dict[str, Tensor], heads: int):
        self.masks = masks
        bad = None
        for mask in masks.values():
            mask = expand_heads(mask, heads)
            bad = mask if bad is None else bad | mask
        self.bad = bad

    def only(self, *names: str) -> "NonFinite | None":
        """The same scan restricted to the inputs ``names`` (None when none of them was scanned)."""
        masks = {name: mask for name, mask in self.masks.items() if name in names}
        return NonFinite(masks, self.bad.shape[2]) if masks else None

    def zeroed(self, name: str, x: Tensor | None) -> Tensor | None:
        """``x`` (the input called ``name``) with its non-finite tokens set to 0 (a select: its
        backward keeps only the boolean mask)."""
        if x is None or name not in self.masks:
            return x
        mask = self.masks[name]
        return x.masked_fill(mask[..., None] if x.dim() == mask.dim() + 1 else mask, 0.0)

    def poison_causal(self, out: Tensor, doc_start: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """``out`` ``[B, T, H, d]`` with NaN rows wherever a causal row sees a non-finite token: the
        token itself and every later token of its document (``doc_start`` ``[B, T]`` in absolute
        indices; token i sits at ``offset + i``)."""
        return out.masked_fill(reaches_causal(self.bad, doc_start, offset)[..., None], float("nan"))

    def poison_visible(self, out: Tensor, visible: Tensor) -> Tensor:
        """``out`` ``[B, T, H, d]`` with NaN rows where ``visible`` ``[B or 1, H or 1, T, L]`` shows a
        non-finite key token (``bad`` is ``[B, L, H]`` here)."""
        reached = (visible & self.bad.transpose(1, 2)[:, :, None, :]).any(-1)  # [B, H, T]
        return out.masked_fill(reached.transpose(1, 2)[..., None], float("nan"))


def _token_mask(x: Tensor) -> Tensor:
    """``[B, T, H]`` True where the token's head holds a NaN or ±inf (``x`` ``[B, T, H, d]`` or ``[B, T, H]``).

    Over a head's d entries by their min and max (one reduction, which propagates NaN; ±inf is the max
    or the min): one read of x, where isfinite(x).all(-1) is five passes over it in eager PyTorch (it
    is abs, two comparisons and a product before the reduction); on a GPU this guard runs on every call."""
    x = x.detach()
    if x.dim() != 4:
        return ~torch.isfinite(x)
    if x.shape[-1] == 0:  # no entries: nothing non-finite
        return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x, dim=-1)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def find_nonfinite(inputs: dict[str, Tensor | None], heads: int, *, always: bool = False) -> NonFinite | None:
    """The non-finite tokens of ``inputs`` (name → ``[B, T, H_x, d]`` or ``[B, T, H_x]``, None
    skipped), or None when :func:`scan_syncs` allows a check and every entry is finite (never None
    with ``always``: the dense references build the masks unconditionally)."""
    present = {name: x for name, x in inputs.items() if x is not None}
    device = next(iter(present.values())).device
    # a sum is non-finite whenever an entry is (inf + finite = inf, NaN wins, inf − inf = NaN); a
    # finite input whose sum overflows only takes the exact path below. (.item() of each sum: 4× less
    # overhead than isfinite and bool on 0-dim tensors, which matters at small T.)
    if not always and scan_syncs(device) and math.isfinite(sum(x.detach().sum().item() for x in present.values())):
        return None
    return NonFinite({name: _token_mask(x) for name, x in present.items()}, heads)


def segmented_cummax(x: Tensor, doc_start: Tensor | None) -> Tensor:
    """The running max of ``x`` ``[B, H, T]`` over j ∈ [doc_start_i, i]: causal and per document.

    Without documents this is a plain cummax. With them, a segmented cummax: documents are
    contiguous and doc_start is non-decreasing, so the running max of the integer key
    doc_start·T + rank(value) is, within each document, the rank of the document's running max
    (earlier documents' keys are smaller). Exact — the values are gathered, never offset and
    subtracted, so a token's result depends on its own document alone — and without a device sync."""
    if doc_start is None:
        return torch.cummax(x, dim=-1).values
    length = x.shape[-1]
    ordered, order = x.sort(dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=x.device).expand_as(order))
    best = torch.cummax(doc_start.long()[:, None, :] * length + rank, dim=-1).values % length
    return ordered.gather(-1, best)


def zero_nonfinite(inputs: dict[str, Tensor | None], heads: int) -> tuple[NonFinite, tuple[Tensor | None, ...]]:
    """The dense references' policy: (the guard of ``inputs``, built unconditionally, and every input with its
    non-finite tokens zeroed, in the order of ``inputs``); the reference then sets the rows that see one to NaN."""
    guard = find_nonfinite(inputs, heads, always=True)
    return guard, tuple(guard.zeroed(name, x) for name, x in inputs.items())


def reaches_causal(bad: Tensor, doc_start: Tensor | None, offset: int = 0) -> Tensor:
    """``[B, T, H]``: True where token i sees a token j ≤ i of its own document with ``bad[b, j, h]``
    (``doc_start`` ``[B, T]`` absolute; token i at index ``offset + i``). The latest bad index so far
    (a cummax) against the document's start: O(T) per head, no T×T mask."""
    index = offset + torch.arange(bad.shape[1], device=bad.device)
    latest = torch.where(bad, index[None, :, None], -1).cummax(dim=1).values
    start = 0 if doc_start is None else doc_start[:, :, None]
    return latest >= start


# ---------------------------------------------------------------------------------------------
# Non-finite inputs in decode steps
#
# A step reads every cached row, the hidden ones (earlier documents, left padding) with weight 0,
# and 0 · NaN = NaN: a NaN cached in one document reached every later document. So a decode state
# caches what the guarded parallel form computes with, never a non-finite row: a non-finite key or
# value is cached as 0 (softmax), a solved u that sees one as 0 (Cubit, DeltaFormer), and the state's
# ``nonfinite`` flags ``[B, t, H]`` mark the tokens whose rows see a non-finite input (their own, or
# an earlier token's of their document). A step flags its own token when one of its inputs is
# non-finite or it sees a flagged token, and sets its row to NaN: what the parallel form gives.
# No device sync: on the CPU the scan of the new token decides (no flags while everything is
# finite); elsewhere the flags are always kept, O(t·H) booleans per step beside the O(t·H·d) read.


def cached_nonfinite(guard: NonFinite | None, doc_start: Tensor | None) -> Tensor | None:
    """The ``nonfinite`` flags of a state returned by a parallel op: ``[B, T, H]``, True where a
    token's row sees a non-finite input (None when the guard found none)."""
    return None if guard is None else reaches_causal(guard.bad, doc_start)


def step_nonfinite(guard: NonFinite | None, cached: Tensor | None, hidden: Tensor | None,
                   position: int) -> tuple[Tensor | None, Tensor | None]:
    """One decode token's ``(flag [B, 1, H], the state's new flags [B, t+1, H])``: the token sees a
    non-finite input where its own (``guard``, the scan of its cached inputs) is or where it sees a
    flagged cached token (``cached`` ``[B, t, H]``; ``hidden`` ``[B, 1, t+1]``: True for cached
    tokens of earlier documents, None when all are visible). ``(None, None)`` when neither has one."""
    if guard is None and cached is None:
        return None, None
    own = guard.bad if guard is not None else None
    if cached is None:
        cached = own.new_zeros((own.shape[0], position, own.shape[2]))
    seen = cached if hidden is None else cached & ~hidden[:, 0, :position, None]
    flag = seen.any(1, keepdim=True)
    if own is not None:
        flag = flag | own
    return flag, append_rows(cached, flag)
