"""The per-layer kernels of a converted model, attached as ``self_attn.kernelmix_rf``.

:class:`RandomFeatureKernel` (Performer / DARKFormer) matches the host's scaling exactly: the op
computes exp(q'·k/√d), so it is fed q' = q·(scaling·√d), giving exp(scaling·q·k). Grouped
key/value heads are expanded inside the op. It is a :class:`~kernelmix.layers.RandomFeatureMap`,
the one the Performer/DARKFormer layers use; its tensors live on the attention module, so
``save_pretrained`` saves them: ``projection`` W ``[H, m, d]`` (buffer) and, for DARKFormer,
``transform`` M ``[H, d, d]`` (parameter) and ``query_fold`` F ``[H, d, d]`` (buffer).

With ``window`` w > 0 a converted layer attends exactly (the host's own softmax) to the last w
tokens and through the features to the tokens before them, in one normalisation
(:func:`kernelmix.ops.window_features.window_feature_attention`); w = 0 is features only.
:class:`HedgehogKernel` is LoLCATs' learned feature map (softmax over a learned projection and its
negation) in the same place, a peer for attention transfer (:mod:`.transfer`).

Decoding: a converted global layer keeps the window's keys/values and the feature state in its
own cache layer (:mod:`.window_cache`), O(w·d + m·d) whatever the length; the cache layer hands
itself to the kernel in ``update`` (:attr:`WindowedAttention.active_cache`), just before the
attention call of the same layer. Without it (a host's sliding-window layer, or a plain HF cache
that already holds tokens) the kernel reads the host's cached keys densely.
:class:`CubitKernel` is the experimental Cubit conversion.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from ..layers import RandomFeatureMap
from ..layers.base import check_choice
from ..ops import expand_heads
from ..ops.random_features import feature_logits, orthogonal_random_features
from ..ops.window_features import ABSENT, window_feature_attention, window_feature_attention_masked
from .attention import left_padding_doc_start, visible_from_mask


def pad_queries_left(q: Tensor, length: int) -> Tensor:
    """Zero queries in front of ``q`` ``[B, T, H, d]`` up to ``length`` positions, so a chunked
    causal op sees the new queries at the end of the cached keys (the padding rows are dropped).

    Args:
        q: queries ``[B, T, H, d]``.
        length: the number of positions to pad to (the keys', ≥ T).

    Returns:
        ``[B, length, H, d]``: ``length - T`` zero rows, then ``q``."""
    pad = q.new_zeros(q.shape[0], length - q.shape[1], *q.shape[2:])
    return torch.cat([pad, q], dim=1)



class WindowedAttention:
    """What a converted layer with a window needs besides its feature map (a mixin of the kernels):
    ``window`` w, ``relative_features`` (LoLCATs' normalisation, for maps that do not estimate
    exp(q·k)), the handshake with its decode cache (``active_cache``) and :meth:`attend_window`.
    The kernel class provides ``log_features(q, k, **overrides)``: the op's log-features of the
    (scaled) queries and of the keys, both ``[B, T, H, m]``."""

    window: int = 0
    sinks: int = 0
    relative_features: bool = False
    active_cache = None  # set by the layer's WindowFeatureCacheLayer.update, taken by the next attention call

    def take_cache(self):
        cache, self.active_cache = self.active_cache, None
        return cache

    def attend_window(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None, position_ids: Tensor | None = None, **overrides) -> Tensor:
        """Window + features on HF tensors (``query`` ``[B, H, T, d]``, ``key``/``value``
        ``[B, H_kv, L, d]``) → ``[B, T, H, d_v]``; continues the layer's decode cache when one is active.
        ``position_ids`` (the queries' positions, as HF passes them) place the sinks on a dense path."""
        cache = self.take_cache()
        if cache is None and attention_mask is None and 1 < query.shape[2] < key.shape[2]:
            # SDPA's upper-left causal convention (prefill into an empty static cache)
            key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
        scaling = self.head_dim**-0.5 if scaling is None else scaling
        q = query.transpose(1, 2) * (scaling * math.sqrt(self.head_dim))  # the op's exact logits: q·k/√d
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        q_features, k_features = self.log_features(q, k, **overrides)
        options = dict(window=self.window, sinks=self.sinks, relative_features=self.relative_features)
        length_q, length_k = q.shape[1], k.shape[1]
        if cache is not None:  # our own cache: only the new tokens come in, the window and features are in its state
            if cache.state is None and cache.seen > length_k:
                raise KernelmixError("this decode cache was started under exact_attention(), which keeps no window or "
                                     "features: start generation again with a new cache")
            doc_start = None
            if attention_mask is not None and cache.state is None:
                visible = _visible(attention_mask, q.shape[0])[..., -length_k:]
                doc_start = left_padding_doc_start(visible, 0)
                if doc_start is None:
                    raise KernelmixError("a converted layer's decode cache takes causal masks with left padding only "
                                         "(what generate builds); run other masks without a cache (use_cache=False)")
            out, cache.state = window_feature_attention(q, k, v, q_features, k_features, doc_start=doc_start,
                                                        chunk_size=self.chunk_size, initial_state=cache.state,
                                                        return_state=True, **options)
            return out.to(v.dtype)
        if attention_mask is None and length_q == length_k:
            return window_feature_attention(q, k, v, q_features, k_features, chunk_size=self.chunk_size,
                                            **options).to(v.dtype)
        if attention_mask is None:  # decode over a host cache: every cached key
            visible = torch.ones(1, 1, length_k, dtype=torch.bool, device=q.device)
        else:
            visible = _visible(attention_mask, q.shape[0])
            if length_q == length_k:
                doc_start = left_padding_doc_start(visible, 0)
                if doc_start is not None:
                    return window_feature_attention(q, k, v, q_features, k_features, doc_start=doc_start,
                                                    chunk_size=self.chunk_size, **options).to(v.dtype)
        key_positions = _key_positions(position_ids, length_q, length_k, q.device)
        return window_feature_attention_masked(q, k, v, q_features, k_features, visible, key_positions=key_positions,
                                               **options).to(v.dtype)


def _key_positions(position_ids: Tensor | None, length_q: int, length_k: int, device) -> Tensor | None:
    """The keys' positions in their document, ``[B or 1, L]``: the keys end at the last query, one
    position each (a KV cache); from the queries' ``position_ids``, or 0 … L − 1 when the queries are
    the keys and no positions were given."""
    offsets = torch.arange(length_k, device=device) - (length_k - 1)
    if position_ids is not None:
        return position_ids[:, -1:].to(device) + offsets
    return (offsets + (length_k - 1))[None] if length_q == length_k else None


def _visible(attention_mask: Tensor, batch: int) -> Tensor:
    visible = visible_from_mask(attention_mask)
    return visible.expand(batch, -1, -1) if visible.shape[0] != batch else visible


class HedgehogKernel(WindowedAttention, nn.Module):
    """LoLCATs' learned feature map (Hedgehog) for one converted layer, attached as
    ``self_attn.kernelmix_rf``: φ(x) = [softmax(x P), softmax(−x P)] ∈ R^m per head, with separate
    learned projections for queries (``query_map`` ``[H, d, m/2]``) and keys (``key_map``), trained
    by attention transfer. Its φ(q)·φ(k) ≤ 2 estimates nothing, so beside a window it is scaled
    relative to the window's largest weight (``relative_features``), as in LoLCATs; w = 0 is plain
    Hedgehog linear attention. Initialised with orthonormal random columns."""

    mixer = "hedgehog"
    transform = None
    query_fold = None
    relative_features = True

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, num_features: int, window: int = 0,
                 sinks: int = 0, chunk_size: int = 64, generator: torch.Generator | None = None):
        super().__init__()
        self.sinks = sinks
        if num_features < 2 or num_features % 2:
            raise KernelmixError("a hedgehog conversion needs an even num_features ≥ 2 "
                                 f"(m/2 per softmax), got {num_features}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_features, self.window, self.chunk_size = num_features, window, chunk_size
        half = num_features // 2

        def draw():  # [H, d, m/2]: orthonormal directions (unit norm: softmax of O(‖x‖) logits at first)
            rows = orthogonal_random_features(half, head_dim, num_heads=num_heads, generator=generator,
                                              dtype=torch.float64)
            return (rows / rows.norm(dim=-1, keepdim=True)).transpose(1, 2).float()

        self.query_map = nn.Parameter(draw())
        self.key_map = nn.Parameter(draw())

    def extra_repr(self) -> str:
        return (f"mixer='hedgehog', num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_features={self.num_features}, window={self.window}")

    def trainable(self) -> list[nn.Parameter]:
        return [self.query_map, self.key_map]

    def log_features(self, q: Tensor, k: Tensor, *, query_map: Tensor | None = None, key_map: Tensor | None = None):
        """log φ of the scaled queries ``[B, T, H, d]`` and the keys ``[B, L, H_kv, d]`` → ``[B, *, H, m]``
        (float32)."""
        query_map = self.query_map if query_map is None else query_map
        key_map = self.key_map if key_map is None else key_map

        def log_phi(x, projection):
            z = torch.einsum("bthd,hdm->bthm", x.float(), projection.float())
            return torch.cat([torch.log_softmax(z, -1), torch.log_softmax(-z, -1)], dim=-1)

        return log_phi(q, query_map), log_phi(expand_heads(k, self.num_heads), key_map)

    def attend(self, query, key, value, attention_mask, scaling, position_ids=None, **overrides) -> Tensor:
        return self.attend_window(query, key, value, attention_mask, scaling, position_ids, **overrides)


class WindowOnlyKernel(WindowedAttention, nn.Module):
    """The window alone (a peer, not a conversion to keep): exact softmax over the last w tokens and
    nothing before them — what the window gives by itself, the bar a feature map has to clear. Its
    one "feature" is absent on every key (log-feature ``ABSENT``), so the feature part is exactly 0
    beside the window; nothing is trained."""

    mixer = "window"
    transform = None
    query_fold = None

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, window: int, sinks: int = 0,
                 chunk_size: int = 64):
        super().__init__()
        self.sinks = sinks
        if window < 1:
            raise KernelmixError("the window-only peer needs window ≥ 1 (with 0 it would attend to nothing)")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_features, self.window, self.chunk_size = 1, window, chunk_size

    def extra_repr(self) -> str:
        return f"mixer='window', num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}"

    def trainable(self) -> list[nn.Parameter]:
        return []

    def log_features(self, q: Tensor, k: Tensor):
        keys = expand_heads(k, self.num_heads)
        return q.new_zeros(*q.shape[:3], 1, dtype=torch.float32), keys.new_full((*keys.shape[:3], 1), ABSENT,
                                                                                 dtype=torch.float32)

    def attend(self, query, key, value, attention_mask, scaling, position_ids=None, **overrides) -> Tensor:
        return self.attend_window(query, key, value, attention_mask, scaling, position_ids)


class RandomFeatureKernel(WindowedAttention, RandomFeatureMap):
    """Random-feature attention of one converted layer (attached as ``self_attn.kernelmix_rf``):
    a :class:`~kernelmix.layers.RandomFeatureMap` — buffer ``projection`` W ``[H, m, d]``; for
    DARKFormer parameter ``transform`` M ``[H, d, d]`` and buffer ``query_fold`` F ``[H, d, d]``
    (both identity at first); ``redraw_``, ``whiten_`` — with what the host needs around it: its
    scaling (:meth:`feature_queries`), its masks and its KV cache (:meth:`attend`)."""

    def __init__(self, *, mixer: str, num_heads: int, num_kv_heads: int, head_dim: int, num_features: int,
                 projection: str = "orthogonal", chunk_size: int = 64, window: int = 0, sinks: int = 0,
                 generator: torch.Generator | None = None):
        check_choice("mixer", mixer, ("performer", "darkformer"))
        super().__init__(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, num_features=num_features,
                         projection=projection, data_aware=mixer == "darkformer", chunk_size=chunk_size,
                         generator=generator)
        self.mixer = mixer
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return (f"mixer={self.mixer!r}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_features={self.num_features}, projection={self.projection_kind!r}, "
                f"window={self.window}, sinks={self.sinks}")

    def trainable(self) -> list[nn.Parameter]:
        """The kernel's own finetunable parameters: M for DARKFormer, none for Performer (W is fixed)."""
        return [] if self.transform is None else [self.transform]

    def feature_queries(self, query: Tensor, scaling: float | None, fold: Tensor | None = None) -> Tensor:
        """HF query ``[B, H, T, d]`` → the op's queries ``[B, T, H, d]``: q·(scaling·√d), then F q for
        DARKFormer (``fold`` overrides the buffer, e.g. while training it)."""
        scaling = self.head_dim**-0.5 if scaling is None else scaling
        q = query.transpose(1, 2) * (scaling * math.sqrt(self.head_dim))
        return self.fold_queries(q, fold)

    def log_features(self, q: Tensor, k: Tensor, *, transform: Tensor | None = None, fold: Tensor | None = None):
        """log φ of the scaled queries ``[B, T, H, d]`` (folded here) and of the keys ``[B, L, H_kv, d]``
        → ``[B, *, H, m]``: W(M x̃) − ½‖M x̃‖² − ½ log m, in float32 (E[φ(q)·φ(k)] = exp((Fq)ᵀMᵀMk/√d))."""
        transform = self.transform if transform is None else transform
        projection = self.projection.float()
        m = None if transform is None else transform.float()
        offset = 0.5 * math.log(self.num_features)
        q_logits = feature_logits(self.fold_queries(q, fold).float(), projection, m) - offset
        k_logits = feature_logits(expand_heads(k, self.num_heads).float(), projection, m) - offset
        return q_logits, k_logits

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None,
               position_ids: Tensor | None = None, *, transform: Tensor | None = None,
               fold: Tensor | None = None) -> Tensor:
        """Random-feature attention on HF tensors (``query`` ``[B, H, T, d]``, ``key``/``value``
        ``[B, H_kv, L, d]``, HF mask or None) → ``[B, T, H, d_v]`` (HF's attention output layout).
        ``transform`` and ``fold`` override M and F (e.g. while training copies of them). With a
        window, or a decode cache of this layer's own, :meth:`attend_window`."""
        if self.window > 0 or self.sinks > 0 or self.active_cache is not None:
            return self.attend_window(query, key, value, attention_mask, scaling, position_ids, transform=transform,
                                      fold=fold)
        q = self.feature_queries(query, scaling, fold)
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        length_q, length_k = q.shape[1], k.shape[1]
        if attention_mask is None:
            if length_q == length_k:
                return self._chunked(q, k, v, transform, None)
            if length_q > 1:  # SDPA's upper-left causal convention (prefill into an empty static cache)
                return self._chunked(q, k[:, :length_q], v[:, :length_q], transform, None)
            # decode: the new token sees every cached key
            return self._chunked(pad_queries_left(q, length_k), k, v, transform, None)[:, -1:]
        visible = visible_from_mask(attention_mask)
        if visible.shape[0] != q.shape[0]:
            visible = visible.expand(q.shape[0], -1, -1)
        doc_start = left_padding_doc_start(visible, length_k - length_q)
        if doc_start is not None:
            q_full = pad_queries_left(q, length_k) if length_k > length_q else q
            return self._chunked(q_full, k, v, transform, doc_start)[:, length_k - length_q:]
        out, _ = self.attend_masked(q, k, v, visible, transform=transform)
        return out

    def _chunked(self, q, k, v, transform, doc_start) -> Tensor:
        return self.attend_causal(q, k, v, doc_start=doc_start, transform=transform).to(v.dtype)


class CubitKernel(nn.Module):
    """Experimental Cubit conversion of one layer (attached as ``self_attn.kernelmix_rf``).

    Cubit needs a reference projection; a converted layer has none, so the host's keys serve as
    the reference (r = k, per query head). Per head: ridge λ = exp(``log_ridge``) and reference
    scale s = exp(``log_ref_scale``), both trained by finetuning. The solve is rescaled,
    U = (1 + λ)(G + λI)⁻¹V: G's rows sum to 1, so constant values pass unchanged for any λ, and as
    λ → ∞, U → V — the host's exact attention (a per-head output scale the host's o_proj could
    equally absorb). No LRR (ρ ≡ 1: the host has no projection for it). Masks: causal, left
    padding and decoding with the host's cache; sliding windows are refused (convert global layers
    only, ``layers="global"``)."""

    mixer = "cubit"
    transform = None
    query_fold = None

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, ridge: float = 4.0, chunk_size: int = 64):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.chunk_size = (
            num_heads, num_kv_heads, head_dim, chunk_size)
        self.log_ridge = nn.Parameter(torch.full((num_heads,), math.log(ridge)))
        self.log_ref_scale = nn.Parameter(torch.zeros(num_heads))

    def extra_repr(self) -> str:
        return f"mixer='cubit', num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"

    def trainable(self) -> list[nn.Parameter]:
        return [self.log_ridge, self.log_ref_scale]

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None,
               **_unused) -> Tensor:
        """HF tensors (``query`` ``[B, H, T, d]``, ``key``/``value`` ``[B, H_kv, L, d]``) → ``[B, T, H, d_v]``."""
        from ..ops.cubit import cubit_attention

        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        length_q, length_k = q.shape[1], k.shape[1]
        doc_start = None
        if attention_mask is not None:
            visible = visible_from_mask(attention_mask)
            if visible.shape[0] != q.shape[0]:
                visible = visible.expand(q.shape[0], -1, -1)
            doc_start = left_padding_doc_start(visible, length_k - length_q)
            if doc_start is None:
                raise ValueError("the cubit conversion supports causal masks with left padding only (no sliding "
                                 "windows or packed sequences); convert the global layers only (layers='global')")
        elif length_q > 1 and length_q < length_k:  # SDPA's upper-left convention (prefill into a static cache)
            k, v, length_k = k[:, :length_q], v[:, :length_q], length_q
        if length_k > length_q:  # decoding: queries at the end of the cached keys
            q = pad_queries_left(q, length_k)
        dtype = torch.promote_types(q.dtype, torch.float32)
        ridge = self.log_ridge.exp()
        reference = expand_heads(k, self.num_heads)
        out = cubit_attention(q.to(dtype), k.to(dtype), v.to(dtype), reference.to(dtype), ridge=ridge,
                              ref_scale=self.log_ref_scale.exp(), scale=scaling, chunk_size=self.chunk_size,
                              doc_start=doc_start)
        out = out * (1.0 + ridge)[:, None].to(out.dtype)
        return out[:, length_k - length_q:].to(v.dtype)

