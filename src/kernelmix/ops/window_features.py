"""Exact softmax over a sliding window beside positive features for the tokens before it
(docs/math.md §11): the attention a converted pretrained layer runs, with a constant-size state.

Per batch element and query head, with the window w ≥ 0, the sinks s ≥ 0, token i's document
start δ_i, the exact logits ℓ_ij = scale · q_i·k_j and log-features (log φ(q_i), log φ(k_j) ∈ R^m,
any positive map), for δ_i ≤ j ≤ i:

    κ_ij = exp(ℓ_ij)                    if i − j < w or j − δ_i < s     (the window and the sinks, exact)
    κ_ij = φ(q_i)·φ(k_j) · c_i          otherwise                        (the features)
    o_i  = Σ_j κ_ij v_j / Σ_j κ_ij                                      (one normalisation)

The sinks are a document's first s tokens: pretrained models put much of their attention on the
first token (Gemma 3 270M's global layers about 40% on BOS), a single key that random features
estimate badly, so it is kept exact (StreamingLLM's attention sinks).

c_i = 1 for a feature map that estimates exp(ℓ) (Performer, DARKFormer: the two parts are on one
scale); with ``relative_features`` c_i = exp(max_window ℓ_ij), LoLCATs' normalisation for a map
that does not (Hedgehog: its weights are relative to the window's largest one). w = 0 is features
only (plain causal linear attention); a w larger than the sequence is exact softmax.

The parallel form never builds a T×T matrix: the window is a banded product over blocks of w
queries (each reads its own and the previous block of keys), the features are the chunked causal
sums of :func:`~kernelmix.ops.random_features.causal_feature_sums` run on the keys with every
query moved w rows back (query i reads the prefix ending at key i − w). Both parts come with their
own log scale (the window's row max, the features' a_i + s_i) and are added at the larger one, so
nothing overflows and no shift reads the future.

Decode keeps the last w − 1 keys, values and key features and the feature sums of everything
before them (:class:`WindowFeatureState`): O(w·d + m·d) per layer whatever the length, and
:func:`window_feature_attention_step` continues it one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
from torch import Tensor

from ..errors import KernelmixError
from ._common import (
    autocast_off,
    check_4d,
    check_chunk_size,
    check_doc_start,
    check_qkv,
    compute_dtype,
    expand_heads,
    find_nonfinite,
    scan_syncs,
)
from .random_features import RandomFeatureState, causal_feature_sums, safe_ratio, underflow_floor

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Required, Unpack


@dataclass
class WindowFeatureState:
    """What decoding needs after ``length`` tokens: the last ``P = min(w − 1, length)`` keys
    ``[B, P, H_kv, d]``, values ``[B, P, H_kv, d_v]`` and key log-features ``[B, P, H, m]`` (the
    window), the feature sums of the tokens before them (``features``, whose ``length`` is
    ``length − P``), the start of the last token's document ``doc_start`` ``[B]`` (absolute) and
    that document's first s keys and values (``sink_keys`` ``[B, s, H_kv, d]``, ``sink_values``;
    zeros where it has fewer tokens)."""

    keys: Tensor
    values: Tensor
    key_features: Tensor
    features: RandomFeatureState
    doc_start: Tensor
    length: int
    sink_keys: Tensor
    sink_values: Tensor


#: the log-feature of a key the features must not count (a sink): exp of it is 0 beside any real key,
#: and, unlike −inf, a running max over such keys alone stays finite
ABSENT = -1e4


def _check_window(window, sinks=0) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise KernelmixError("window must be an int ≥ 0 "
                             f"(exact softmax over the last w tokens; 0: features only), got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise KernelmixError("sinks must be an int ≥ 0 (a document's first tokens, "
                             f"kept exact; 0: none), got {sinks!r}")
    return window


def _check_features(q: Tensor, k: Tensor, q_features: Tensor, k_features: Tensor) -> None:
    check_4d("q_features", q_features)
    check_4d("k_features", k_features)
    batch, length, heads = q.shape[:3]
    if tuple(q_features.shape[:3]) != (batch, length, heads):
        raise KernelmixError(f"q_features must be [B, T, H, m] = {(batch, length, heads, '*')}, "
                             f"got {tuple(q_features.shape)}")
    if tuple(k_features.shape[:3]) != (batch, k.shape[1], heads) or k_features.shape[3] != q_features.shape[3]:
        raise KernelmixError(
            f"k_features must be [B, T, H, m] = {(batch, k.shape[1], heads, q_features.shape[3])} (keys on the query "
            f"heads, the same m as q_features), got {tuple(k_features.shape)}"
        )


class WindowFeatureOptions(TypedDict, total=False):
    """The keywords of :func:`window_feature_attention` besides ``return_state`` (its overloads' ``**options``)."""

    window: Required[int]
    sinks: int
    scale: float | None
    relative_features: bool
    doc_start: Tensor | None
    chunk_size: int
    initial_state: WindowFeatureState | None


@overload
def window_feature_attention(
    q: Tensor, k: Tensor, v: Tensor, q_features: Tensor, k_features: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[WindowFeatureOptions],
) -> Tensor: ...


@overload
def window_feature_attention(
    q: Tensor, k: Tensor, v: Tensor, q_features: Tensor, k_features: Tensor, *, return_state: Literal[True],
    **options: Unpack[WindowFeatureOptions],
) -> tuple[Tensor, WindowFeatureState]: ...


def window_feature_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    *,
    window: int,
    sinks: int = 0,
    scale: float | None = None,
    relative_features: bool = False,
    doc_start: Tensor | None = None,
    chunk_size: int = 64,
    initial_state: WindowFeatureState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, WindowFeatureState]:
    """Causal attention, exact over the last ``window`` tokens and through positive features before
    them, in one normalisation (module docstring). O(T·(w + m)·d), never a T×T matrix.

    Args:
        q: ``[B, T, H, d]``.
        k, v: ``[B, T, H_kv, d]`` (grouped heads expanded inside).
        q_features, k_features: ``[B, T, H, m]``, the *log* of the positive features (keys on the
            query heads).
        window: w ≥ 0, the tokens each row reads exactly (0: features only).
        sinks: s ≥ 0, a document's first tokens, also read exactly.
        scale: of the exact logits (1/√d by default).
        relative_features: the features' weights relative to the window's largest logit (LoLCATs'
            normalisation, for a map such as Hedgehog's), instead of absolute.
        doc_start: ``[B, T]`` or None; keeps packed documents and left padding apart (absolute indices,
            counting ``initial_state``'s tokens; a token whose document began before them continues the
            state's document).
        chunk_size: tokens per chunk.
        initial_state: a :class:`WindowFeatureState` to continue from, or None.
        return_state: also return the state after the last token.

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, or ``(out, WindowFeatureState)`` with ``return_state``; computed in
        float32 (float64 for float64 inputs) with autocast off. A NaN or ±inf key, value or key feature
        makes the rows that see it NaN, the others exact.
    """
    window = _check_window(window, sinks)
    check_chunk_size(chunk_size)
    check_qkv(q, k, v)
    _check_features(q, k, q_features, k_features)
    heads, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else float(scale)
    start = 0 if initial_state is None else initial_state.length
    check_doc_start(doc_start, q.shape[0], q.shape[1], offset=start)
    guard = find_nonfinite({"k": k, "v": v, "k_features": k_features}, heads)
    if guard is not None:
        k, v, k_features = guard.zeroed("k", k), guard.zeroed("v", v), guard.zeroed("k_features", k_features)
    with autocast_off(q):
        dtype = compute_dtype(q, k, v, q_features, k_features)
        out, state = _attend(q.to(dtype), k.to(dtype), v.to(dtype), q_features.to(dtype), k_features.to(dtype),
                             window, sinks, scale, relative_features, doc_start, chunk_size, initial_state)
    if guard is not None:
        out = guard.poison_causal(out, None if doc_start is None else _continuing(doc_start, start, initial_state),
                                  offset=start)
    out = out.to(v.dtype)
    return (out, state) if return_state else out


def _continuing(doc_start: Tensor, start: int, state: WindowFeatureState | None) -> Tensor:
    """``doc_start`` with every token whose document began before ``start`` set to the state's document."""
    if state is None:
        return doc_start
    return torch.where(doc_start < start, state.doc_start[:, None].to(doc_start), doc_start)


def _attend(q, k, v, q_features, k_features, window, sinks, scale, relative, doc_start, chunk_size, state):
    batch, length, heads, _ = q.shape
    kept = max(window - 1, 0)  # keys the window still needs after the last token
    if _steady(state, length, window, sinks, doc_start, q.device):
        return _steady_step(q, k, v, q_features, k_features, window, sinks, scale, relative, state)
    if state is None:
        held, start = 0, 0
        features = None
        keys, values, key_features = k, v, k_features
        held_doc = torch.zeros(batch, 0, dtype=torch.long, device=q.device)
        last_doc = torch.zeros(batch, dtype=torch.long, device=q.device)
    else:
        _check_state(state, q, k, v, q_features, window, sinks)
        held, start = state.keys.shape[1], state.length
        features = state.features
        keys = torch.cat([state.keys.to(k), k], dim=1)
        values = torch.cat([state.values.to(v), v], dim=1)
        key_features = torch.cat([state.key_features.to(k_features), k_features], dim=1)
        held_pos = torch.arange(start - held, start, device=q.device)
        # a held key of an earlier document is its own one-token document: never visible again
        held_doc = torch.where(held_pos[None] >= state.doc_start[:, None], state.doc_start[:, None], held_pos[None])
        last_doc = state.doc_start
    new_doc = last_doc[:, None].expand(batch, length) if doc_start is None else _continuing(doc_start, start, state)
    docs = torch.cat([held_doc, new_doc.long()], dim=1)  # [B, L]: every row of the concatenation
    total = held + length
    positions = start - held + torch.arange(total, device=q.device)
    values_h = expand_heads(values, heads)
    if state is None:
        bank_keys = k.new_zeros(batch, sinks, *k.shape[2:])
        bank_values = v.new_zeros(batch, sinks, *v.shape[2:])
    else:
        bank_keys, bank_values = state.sink_keys.to(k), state.sink_values.to(v)

    if length == 0:  # nothing to mix: an empty output, the state as it was (a slice: autograd sees v)
        return values_h[:, :0], state if state is not None else WindowFeatureState(
            keys=k, values=v, key_features=k_features, features=_empty_features(batch, heads, q_features.shape[3],
                                                                                 v.shape[3], 0, v),
            doc_start=last_doc, length=0, sink_keys=bank_keys, sink_values=bank_values)
    if sinks:  # a sink is exact: the features leave it out
        is_sink = (positions[None] - docs < sinks)[..., None, None]
        key_features = key_features.masked_fill(is_sink, ABSENT)
    parts = [_window_part(q, expand_heads(keys, heads), values_h, window, scale, docs, positions, held, relative)]
    win_max = parts[0][2]
    if sinks:
        parts.append(_sink_part(q, keys, values, bank_keys, bank_values, sinks, window, scale, docs, positions, held))
    feat_sums, feat_scale, features = _feature_part(q_features, key_features, values_h, window, docs, positions,
                                                    held, start, features, chunk_size)
    if relative and window > 0:  # c_i = exp(max of the window's logits), differentiated as a max
        feat_scale = feat_scale + win_max
    out = _combine([(sums, scale) for sums, scale, *_ in parts], feat_sums, feat_scale, relative and window > 0)

    new_held = min(kept, total)
    last = docs[:, -1]
    bank_keys, bank_values = _sink_bank(bank_keys, bank_values, keys, values, last, positions, sinks)
    new_state = WindowFeatureState(
        keys=keys[:, total - new_held:], values=values[:, total - new_held:],
        key_features=key_features[:, total - new_held:], features=features,
        doc_start=last, length=start + length, sink_keys=bank_keys, sink_values=bank_values,
    )
    return out, new_state


def _steady(state, length: int, window: int, sinks: int, doc_start, device) -> bool:
    """Whether a decode step can take :func:`_steady_step`: one token continuing a document whose
    window is full, whose sinks are all held and whose feature sums are under way (checked with a
    sync, so on the CPU only; anything else takes the general path)."""
    if state is None or length != 1 or window < 1 or state.keys.shape[1] != window - 1 or not scan_syncs(device):
        return False
    origin = state.length - state.keys.shape[1]  # the first held key's position
    if doc_start is not None and not bool((doc_start < state.length).all()):
        return False
    return bool((state.doc_start + sinks <= origin).all()) and bool((state.doc_start < origin).all())


def _steady_step(q, k, v, q_features, k_features, window, sinks, scale, relative, state):
    """One token in the steady state, in a few products instead of the general path's hundreds of
    small ops (the same numbers): the sinks and the w − 1 held keys plus the new one are exact, the
    feature sums are read as they are, then the oldest held key moves into them."""
    heads = q.shape[2]
    keys, values = torch.cat([state.keys.to(k), k], 1), torch.cat([state.values.to(v), v], 1)
    key_features = torch.cat([state.key_features.to(k_features), k_features], 1)
    exact_keys = expand_heads(torch.cat([state.sink_keys.to(k), keys], 1), heads)  # [B, s + w, H, d]
    exact_values = expand_heads(torch.cat([state.sink_values.to(v), values], 1), heads)
    ones = exact_values.new_ones(()).expand(*exact_values.shape[:-1], 1)
    logits = scale * torch.einsum("bhd,bjhd->bhj", q[:, 0], exact_keys)  # [B, H, s + w]
    row_max = logits.detach().amax(-1, keepdim=True)
    win_sums = torch.einsum("bhj,bjhe->bhe", torch.exp(logits - row_max), torch.cat([exact_values, ones], -1))
    win_scale = row_max[..., 0]
    features = state.features
    feat_sums, feat_scale = _read_state(q_features, features, state.doc_start[:, None], features.length,
                                        values.shape[-1], win_sums)
    if relative:
        feat_scale = feat_scale + logits[..., sinks:].amax(-1)[:, None]
    out = _combine([(win_sums[:, None], win_scale[:, None])], feat_sums, feat_scale, relative)  # [B, 1, H, d_v]
    # the oldest held key leaves the window: into the feature sums at their running shift
    leaving, leaving_v = key_features[:, 0], expand_heads(values[:, :1], heads)[:, 0]  # [B, H, m], [B, H, d_v]
    new_shift = torch.maximum(features.shift.to(win_sums), leaving.detach().amax(-1))
    rescale = torch.exp(features.shift.to(win_sums) - new_shift)
    weight = torch.exp(leaving - new_shift[..., None])
    new_features = RandomFeatureState(
        S=rescale[..., None, None] * features.S.to(win_sums) + weight[..., None] * leaving_v[..., None, :],
        z=rescale[..., None] * features.z.to(win_sums) + weight, shift=new_shift, length=features.length + 1)
    new_state = WindowFeatureState(
        keys=keys[:, 1:], values=values[:, 1:], key_features=key_features[:, 1:], features=new_features,
        doc_start=state.doc_start, length=state.length + 1, sink_keys=state.sink_keys, sink_values=state.sink_values)
    return out, new_state


def _sink_index(bank_size: int, sink_pos: Tensor, origin: int, total: int) -> Tensor:
    """Where sink position ``sink_pos`` is in [the bank of the state's sinks ++ this call's keys]:
    bank slot r for a position before this call's first key (the state's document), else its key."""
    slot = torch.arange(bank_size, device=sink_pos.device)
    slot = slot.view(*([1] * (sink_pos.dim() - 1)), bank_size).expand_as(sink_pos)
    return torch.where(sink_pos < origin, slot, bank_size + sink_pos - origin).clamp(0, bank_size + total - 1)


def _sink_part(q, keys, values, bank_keys, bank_values, sinks, window, scale, docs, positions, held):
    """The exact part over each new query's sinks outside its window (j − δ_i < s, i − j ≥ w):
    (Σ e^{ℓ−b}[v, 1] ``[B, T, H, d_v + 1]``, b ``[B, T, H]``). Each query gathers its own s sink keys."""
    batch, length, heads, head_dim = q.shape
    total = keys.shape[1]
    origin = int(positions[0])
    ext_keys = expand_heads(torch.cat([bank_keys, keys], 1), heads)
    ones = values.new_ones(()).expand(*values.shape[:-1], 1)
    ext_values = expand_heads(torch.cat([torch.cat([bank_values, values], 1),
                                         torch.cat([bank_values.new_ones(()).expand(*bank_values.shape[:-1], 1),
                                                    ones], 1)],
                                        -1), heads)
    query_docs, query_pos = docs[:, held:], positions[held:]
    sink_pos = query_docs[..., None] + torch.arange(sinks, device=q.device)  # [B, T, s]
    index = _sink_index(sinks, sink_pos, origin, total).reshape(batch, length * sinks)

    def gather(x):  # [B, S + L, H, e] → [B, T, s, H, e]
        return x.gather(1, index[..., None, None].expand(-1, -1, heads, x.shape[-1])).view(
            batch, length, sinks, heads, -1)

    logits = scale * torch.einsum("bthd,btshd->bths", q, gather(ext_keys))
    outside = (sink_pos <= query_pos[None, :, None] - window)[:, :, None, :]  # [B, T, 1, s]: not in the window
    row_max = logits.detach().masked_fill(~outside, float("-inf")).amax(-1, keepdim=True)
    weights = torch.exp((logits - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
                        .masked_fill(~outside, float("-inf")))
    return torch.einsum("bths,btshe->bthe", weights, gather(ext_values)), row_max[..., 0]


def _sink_bank(bank_keys, bank_values, keys, values, last_doc, positions, sinks):
    """The first ``sinks`` keys and values of each row's last document (zeros where it has fewer)."""
    if not sinks:
        return bank_keys, bank_values
    total = keys.shape[1]
    sink_pos = last_doc[:, None] + torch.arange(sinks, device=keys.device)  # [B, s]
    index = _sink_index(sinks, sink_pos, int(positions[0]), total)
    seen = (sink_pos <= positions[-1])[..., None, None]

    def pick(bank, x):
        ext = torch.cat([bank, x], 1)
        got = ext.gather(1, index[..., None, None].expand(-1, -1, *x.shape[2:]))
        return torch.where(seen, got, torch.zeros_like(got))

    return pick(bank_keys, keys), pick(bank_values, values)


def _combine(exact_parts, feat_sums: Tensor, feat_scale: Tensor, relative: bool) -> Tensor:
    """The output from the exact parts and the feature part, each ``(sums [..., d_v + 1], log scale)``.

    The parts are added at the larger of their actual magnitudes (log scale + log of the stabilised
    denominator): a + s bounds the feature sum only loosely from above (the query's and the key's
    largest features need not coincide), so exp(b − a − s) could underflow the window beside a
    feature sum that is itself tiny. Each part enters as sums · exp(magnitude − top) / denominator
    (the factor detached), which is sums · exp(scale − top) without its overflow. With ``relative``
    the feature scale holds c_i's differentiable max; the factor 1 (in value) carries its gradient."""
    if relative:
        live = torch.where(torch.isfinite(feat_scale), feat_scale, torch.zeros_like(feat_scale))
        feat_sums = feat_sums * torch.exp(live - live.detach())[..., None]
    parts = list(exact_parts) + [(feat_sums, feat_scale)]
    magnitudes = [_magnitude(sums, scale) for sums, scale in parts]
    top = torch.stack(magnitudes).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sums = sum(part * _weight(part, magnitude, top) for (part, _), magnitude in zip(parts, magnitudes))
    return safe_ratio(sums[..., :-1], sums[..., -1:])


def _magnitude(sums: Tensor, scale: Tensor) -> Tensor:
    """log of a part's denominator, detached: its log scale plus the log of its stabilised sum
    (−inf where that sum is below √tiny: numerically nothing)."""
    denominator = sums[..., -1].detach()
    visible = denominator > underflow_floor(denominator.dtype)
    return torch.where(visible, scale.detach() + torch.log(denominator.clamp_min(underflow_floor(denominator.dtype))),
                       torch.full_like(denominator, float("-inf")))


def _weight(sums: Tensor, magnitude: Tensor, top: Tensor) -> Tensor:
    """exp(magnitude − top) / denominator ``[B, T, H, 1]`` (detached), 0 where the part is empty."""
    denominator = sums[..., -1].detach()
    present = torch.isfinite(magnitude)
    ratio = torch.exp(magnitude - top) / torch.where(present, denominator, torch.ones_like(denominator))
    return torch.where(present, ratio, torch.zeros_like(ratio))[..., None]


def _window_part(q, keys, values, window, scale, docs, positions, held, live_max=False):
    """The exact part for the last T rows of the concatenation: (Σ e^{ℓ−b}[v, 1] ``[B, T, H, d_v + 1]``,
    its log scale b ``[B, T, H]`` (detached; −inf where no key is in the window), and with
    ``live_max`` the same max with its gradient, else None). Blocks of w queries read their own and
    the previous block of keys: a banded product, O(T·w·d)."""
    batch, length, heads, _ = q.shape
    dv = values.shape[-1]
    if window == 0:
        return (values.new_zeros(batch, length, heads, dv + 1), values.new_full((batch, length, heads), float("-inf")),
                None)
    total = keys.shape[1]
    block = window
    n_blocks = -(-total // block)
    pad = n_blocks * block - total
    queries = torch.cat([q.new_zeros(batch, held, heads, q.shape[3]), q], dim=1)  # rows of the held keys: no query

    def blocks(x, fill=0.0):  # [B, L, H, *] → [B, H, N, C, *]
        x = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, pad), value=fill)
        return x.reshape(batch, heads, n_blocks, block, x.shape[-1])

    ones = values.new_ones(()).expand(*values.shape[:-1], 1)
    qb, kb, vb = blocks(queries), blocks(keys), blocks(torch.cat([values, ones], dim=-1))
    previous = lambda x: torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)  # noqa: E731
    kb2, vb2 = torch.cat([previous(kb), kb], dim=3), torch.cat([previous(vb), vb], dim=3)  # [B, H, N, 2C, *]
    logits = scale * (qb @ kb2.transpose(-1, -2))  # [B, H, N, C, 2C]

    index = torch.arange(n_blocks * block, device=q.device).view(n_blocks, block)
    key_index = torch.cat([index - block, index], dim=1)  # [N, 2C]
    distance = index[:, :, None] - key_index[:, None, :]  # [N, C, 2C]
    in_band = (distance >= 0) & (distance < window) & (key_index[:, None, :] >= 0) & (key_index[:, None, :] < total)
    padded_docs = torch.nn.functional.pad(docs, (0, pad), value=0)
    key_pos = (positions[0] if total else 0) + key_index  # absolute (< 0 in the zero block: never in band)
    row_docs = padded_docs.view(batch, n_blocks, block)
    seen = in_band[None] & (key_pos[None, :, None, :] >= row_docs[..., None])  # [B, N, C, 2C]
    seen = seen[:, None]
    row_max = logits.detach().masked_fill(~seen, float("-inf")).amax(-1, keepdim=True)
    weights = torch.exp(
        (logits - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))).masked_fill(
            ~seen, float("-inf")))
    sums = (weights @ vb2).reshape(batch, heads, n_blocks * block, dv + 1)[:, :, held:total]

    def rows(x):  # [B, H, N, C, 1] → [B, T, H]
        return x.reshape(batch, heads, n_blocks * block)[:, :, held:total].transpose(1, 2)

    live = rows(logits.masked_fill(~seen, float("-inf")).amax(-1, keepdim=True)) if live_max else None
    return sums.transpose(1, 2), rows(row_max), live


def _feature_part(q_features, key_features, values, window, docs, positions, held, start, features, chunk_size):
    """The feature part for the T new queries: (sums ``[B, T, H, d_v + 1]``, log scale ``[B, T, H]``
    (−inf: no feature key), the feature state after every key but the last w − 1).

    Query i reads the keys j ≤ i − w of its document: the causal sums over the keys, with query i
    placed on row i − w. Queries whose row falls before this call's keys read the carried state alone."""
    batch, length, heads, m = q_features.shape
    dv = values.shape[-1]
    total = key_features.shape[1]
    n_rows = total - min(max(window - 1, 0), total)  # keys that leave the window by the end: the rows of the sums
    lag = window - held  # ≥ 0: new query t sits on row t − lag
    state_only = min(length, lag)  # queries before the first row
    if n_rows:
        row_queries = q_features[:, lag:lag + n_rows]
        if row_queries.shape[1] < n_rows:  # the last rows have no query (yet): zeros, discarded
            row_queries = torch.cat(
                [row_queries, row_queries.new_zeros(batch, n_rows - row_queries.shape[1], heads, m)], 1)
        rows, row_scale, new_features = causal_feature_sums(
            row_queries, key_features[:, :n_rows], values[:, :n_rows], chunk_size=chunk_size,
            doc_start=docs[:, :n_rows], initial_state=features)
    else:
        rows, row_scale = values.new_zeros(batch, 0, heads, dv + 1), values.new_zeros(batch, 0, heads)
        new_features = features if features is not None else _empty_features(batch, heads, m, dv, start - held, values)
    answered = length - state_only  # queries on rows 0 … answered − 1
    by_rows, by_rows_scale = rows[:, :answered], row_scale[:, :answered]
    in_document = positions[:answered][None] >= docs[:, held + state_only:]  # the row's key is in the query's document
    by_rows_scale = by_rows_scale.masked_fill(~in_document[..., None], float("-inf"))
    if state_only == 0:
        return by_rows, by_rows_scale, new_features
    so_sums, so_scale = _read_state(q_features[:, :state_only], features, docs[:, held:held + state_only],
                                    start - held, dv, values)
    return torch.cat([so_sums, by_rows], 1), torch.cat([so_scale, by_rows_scale], 1), new_features


def _read_state(q_features, features, query_docs, covered, dv, like):
    """The carried feature state read by queries ``[B, t, H, m]`` that see nothing else: (sums, log scale)."""
    batch, length, heads, _ = q_features.shape
    if features is None:
        return like.new_zeros(batch, length, heads, dv + 1), like.new_full((batch, length, heads), float("-inf"))
    q_max = q_features.detach().amax(-1, keepdim=True)
    q_feat = torch.exp(q_features - q_max)
    state = torch.cat([features.S.to(like), features.z.to(like)[..., None]], dim=-1)  # [B, H, m, d_v + 1]
    sums = torch.einsum("bthm,bhme->bthe", q_feat, state)
    scale = q_max[..., 0] + features.shift.to(like)[:, None, :]
    reads = (query_docs < covered)[..., None]  # the query's document began before the state ends
    return sums, scale.masked_fill(~reads, float("-inf"))


def _empty_features(batch, heads, m, dv, length, like) -> RandomFeatureState:
    return RandomFeatureState(S=like.new_zeros(batch, heads, m, dv), z=like.new_zeros(batch, heads, m),
                              shift=like.new_full((batch, heads), float("-inf")), length=length)


def _check_state(state, q, k, v, q_features, window, sinks) -> None:
    if not isinstance(state, WindowFeatureState):
        raise KernelmixError("initial_state must be a WindowFeatureState (from return_state=True), "
                             f"got {type(state).__name__}")
    batch, _, heads, _ = q.shape
    held = state.keys.shape[1]
    expected = {"keys": (batch, held, k.shape[2], k.shape[3]), "values": (batch, held, v.shape[2], v.shape[3]),
                "key_features": (batch, held, heads, q_features.shape[3]),
                "sink_keys": (batch, sinks, k.shape[2], k.shape[3]),
                "sink_values": (batch, sinks, v.shape[2], v.shape[3])}
    for name, shape in expected.items():
        got = tuple(getattr(state, name).shape)
        if got != shape:
            raise KernelmixError(f"initial_state.{name} has shape {got}, expected {shape}: the state is from another "
                                 "layer, batch or number of sinks")
    if held != min(max(window - 1, 0), state.length) or state.features.length != state.length - held:
        raise KernelmixError(f"initial_state holds {held} window keys after {state.length} tokens, which does not fit "
                             f"window={window}: continue a state with the window it was made with")


def window_feature_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    state: WindowFeatureState | None,
    *,
    window: int,
    sinks: int = 0,
    scale: float | None = None,
    relative_features: bool = False,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, WindowFeatureState]:
    """Decode one token after ``state``: O(w·d + m·d) work and state whatever the position.

    Args:
        q: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        q_features, k_features: ``[B, 1, H, m]``, the log-features, as :func:`window_feature_attention`.
        state: the :class:`WindowFeatureState` of the tokens before, or None (the first token).
        window, sinks, scale, relative_features: as :func:`window_feature_attention` (the same values as
            the call that made ``state``).
        doc_start: ``[B, 1]`` or None, as :func:`window_feature_attention`.

    Returns:
        ``(out [B, 1, H, d_v], state)``."""
    check_qkv(q, k, v)
    if q.shape[1] != 1:
        raise KernelmixError(f"a decode step takes one token (T=1), got T={q.shape[1]}; "
                             "use window_feature_attention for prefill")
    return window_feature_attention(q, k, v, q_features, k_features, window=window, sinks=sinks, scale=scale,
                                    relative_features=relative_features, doc_start=doc_start, chunk_size=1,
                                    initial_state=state, return_state=True)


def window_feature_attention_masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    mask: Tensor,
    *,
    window: int,
    sinks: int = 0,
    key_positions: Tensor | None = None,
    scale: float | None = None,
    relative_features: bool = False,
) -> Tensor:
    """The same attention under any bool ``mask`` ``[B, T, L]`` (True: query t reads key l), densely,
    O(T·L·(m + d)): for a host's own sliding-window layers and irregular masks. The keys end at the
    last query (query t sits at key index L − T + t, as in a KV cache), which gives each pair's
    distance. ``key_positions`` ``[B, L]``: each key's position in its document, for the sinks
    (0 ≤ position < ``sinks``; without it there are none). Every weight is formed in log space and
    the row normalised by its own maximum, so nothing overflows. Rows with no visible key are 0."""
    window = _check_window(window, sinks)
    check_qkv(q, k, v, same_length=False)
    _check_features(q, k, q_features, k_features)
    heads, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else float(scale)
    length_q, length_k = q.shape[1], k.shape[1]
    with autocast_off(q):
        dtype = compute_dtype(q, k, v, q_features, k_features)
        keys = expand_heads(k, heads).to(dtype).transpose(1, 2)
        values = expand_heads(v, heads).to(dtype).transpose(1, 2)
        logits = scale * (q.to(dtype).transpose(1, 2) @ keys.transpose(-1, -2))  # [B, H, T, L]
        lq, lk = q_features.to(dtype).transpose(1, 2), k_features.to(dtype).transpose(1, 2)
        q_max, k_max = lq.detach().amax(-1, keepdim=True), lk.detach().amax(-1, keepdim=True)
        products = torch.exp(lq - q_max) @ torch.exp(lk - k_max).transpose(-1, -2)  # × e^{q_max + k_max}
        floor = underflow_floor(dtype)
        log_products = torch.where(products > floor, torch.log(products.clamp_min(floor)),
                                   torch.full_like(products, -torch.inf))
        feature_logits = log_products + q_max + k_max.transpose(-1, -2)
        distance = ((length_k - length_q) + torch.arange(length_q, device=q.device)[:, None]
                    - torch.arange(length_k, device=q.device))
        seen = mask[:, None] if mask.dim() == 3 else mask
        exact = seen & (distance < window)
        if sinks and key_positions is not None:
            exact = exact | (seen & ((key_positions >= 0) & (key_positions < sinks))[:, None, None, :])
        if relative_features and window > 0:  # c_i = exp(max of the window's logits)
            in_window = seen & (distance < window)
            feature_logits = feature_logits + logits.masked_fill(~in_window, float("-inf")).amax(-1, keepdim=True)
        combined = torch.where(exact, logits, feature_logits).masked_fill(~seen, float("-inf"))
        row_max = combined.detach().amax(-1, keepdim=True)
        weights = torch.exp(combined - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
        out = safe_ratio(weights @ values, weights.sum(-1, keepdim=True))
    return out.transpose(1, 2).to(v.dtype)


def window_feature_attention_naive(  # the fast path's parameters (same meanings), less chunking and state
    q: Tensor, k: Tensor, v: Tensor, q_features: Tensor, k_features: Tensor, *, window: int, sinks: int = 0,
    scale: float | None = None, relative_features: bool = False, doc_start: Tensor | None = None,
) -> Tensor:
    """Dense reference, written from the definition (module docstring): every κ_ij in float64,
    T×T, unstabilised. For tests on moderate logits.

    Args:
        q, k, v, q_features, k_features, window, sinks, scale, relative_features, doc_start: as
            :func:`window_feature_attention` (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype."""
    window = _check_window(window, sinks)
    check_qkv(q, k, v)
    _check_features(q, k, q_features, k_features)
    heads, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else float(scale)
    f64 = torch.float64
    length = q.shape[1]
    keys, values = expand_heads(k, heads).to(f64), expand_heads(v, heads).to(f64)
    exact = torch.exp(scale * torch.einsum("bihd,bjhd->bhij", q.to(f64), keys))
    features = torch.einsum("bihm,bjhm->bhij", q_features.to(f64).exp(), k_features.to(f64).exp())
    i = torch.arange(length, device=q.device)[:, None]
    j = torch.arange(length, device=q.device)[None, :]
    causal = j <= i
    doc_ok = torch.ones(q.shape[0], 1, length, length, dtype=torch.bool, device=q.device)
    if doc_start is not None:
        doc_ok = (j[None] >= doc_start[:, :, None])[:, None]
    in_window = causal & (i - j < window)
    if relative_features and window > 0:
        row_max = (scale * torch.einsum("bihd,bjhd->bhij", q.to(f64), keys)).masked_fill(
            ~(in_window & doc_ok), -math.inf)
        features = features * row_max.amax(-1, keepdim=True).exp()
    first = torch.zeros(q.shape[0], length, dtype=torch.long, device=q.device) if doc_start is None else doc_start
    # [B, 1, T, T]: key j is among its row's document's first s
    is_sink = (j[None] - first[:, :, None] < sinks)[:, None]
    kernel = torch.where(in_window | is_sink, exact, features)
    kernel = torch.where(causal & doc_ok, kernel, torch.zeros_like(kernel))
    return torch.einsum("bhij,bjhd->bihd", kernel, values) / kernel.sum(-1).transpose(1, 2)[..., None]


__all__ = [
    "WindowFeatureState",
    "window_feature_attention",
    "window_feature_attention_masked",
    "window_feature_attention_naive",
    "window_feature_attention_step",
]
