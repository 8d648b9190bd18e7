"""The per-layer kernels of a converted model, attached as ``self_attn.kernelmix_rf``.

:class:`RandomFeatureKernel` (Performer / DARKFormer) matches the host's scaling exactly: the op
computes exp(q'·k/√d), so it is fed q' = q·(scaling·√d), giving exp(scaling·q·k). Grouped
key/value heads are expanded inside the op. It is a :class:`~kernelmix.layers.RandomFeatureMap`,
the one the Performer/DARKFormer layers use; its tensors live on the attention module, so
``save_pretrained`` saves them: ``projection`` W ``[H, m, d]`` (buffer) and, for DARKFormer,
``transform`` M ``[H, d, d]`` (parameter) and ``query_fold`` F ``[H, d, d]`` (buffer).

Decoding uses the host's KV cache; each new token recomputes random-feature attention over the
cached keys, O(t·m·d) per token (not the O(m·d) recurrent state of
:func:`kernelmix.ops.random_features.random_feature_attention_step`; wiring that state into HF's
cache is future work). :class:`CubitKernel` is the experimental Cubit conversion.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..layers import RandomFeatureMap
from ..layers.base import check_choice
from ..ops import expand_heads
from .attention import left_padding_doc_start, visible_from_mask


def pad_queries_left(q: Tensor, length: int) -> Tensor:
    """Zero queries in front of ``q`` ``[B, T, H, d]`` up to ``length`` positions, so a chunked
    causal op sees the new queries at the end of the cached keys (the padding rows are dropped)."""
    pad = q.new_zeros(q.shape[0], length - q.shape[1], *q.shape[2:])
    return torch.cat([pad, q], dim=1)



class RandomFeatureKernel(RandomFeatureMap):
    """Random-feature attention of one converted layer (attached as ``self_attn.kernelmix_rf``):
    a :class:`~kernelmix.layers.RandomFeatureMap` — buffer ``projection`` W ``[H, m, d]``; for
    DARKFormer parameter ``transform`` M ``[H, d, d]`` and buffer ``query_fold`` F ``[H, d, d]``
    (both identity at first); ``redraw_``, ``whiten_`` — with what the host needs around it: its
    scaling (:meth:`feature_queries`), its masks and its KV cache (:meth:`attend`)."""

    def __init__(self, *, mixer: str, num_heads: int, num_kv_heads: int, head_dim: int, num_features: int,
                 projection: str = "orthogonal", chunk_size: int = 64, generator: torch.Generator | None = None):
        check_choice("mixer", mixer, ("performer", "darkformer"))
        super().__init__(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, num_features=num_features,
                         projection=projection, data_aware=mixer == "darkformer", chunk_size=chunk_size,
                         generator=generator)
        self.mixer = mixer

    def extra_repr(self) -> str:
        return (f"mixer={self.mixer!r}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_features={self.num_features}, projection={self.projection_kind!r}")

    def trainable(self) -> list[nn.Parameter]:
        """The kernel's own finetunable parameters: M for DARKFormer, none for Performer (W is fixed)."""
        return [] if self.transform is None else [self.transform]

    def feature_queries(self, query: Tensor, scaling: float | None, fold: Tensor | None = None) -> Tensor:
        """HF query ``[B, H, T, d]`` → the op's queries ``[B, T, H, d]``: q·(scaling·√d), then F q for
        DARKFormer (``fold`` overrides the buffer, e.g. while training it)."""
        scaling = self.head_dim**-0.5 if scaling is None else scaling
        q = query.transpose(1, 2) * (scaling * math.sqrt(self.head_dim))
        return self.fold_queries(q, fold)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None,
               *, transform: Tensor | None = None, fold: Tensor | None = None) -> Tensor:
        """Random-feature attention on HF tensors (``query`` ``[B, H, T, d]``, ``key``/``value``
        ``[B, H_kv, L, d]``, HF mask or None) → ``[B, T, H, d_v]`` (HF's attention output layout).
        ``transform`` and ``fold`` override M and F (e.g. while training copies of them)."""
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
        self.num_heads, self.num_kv_heads, self.head_dim, self.chunk_size = num_heads, num_kv_heads, head_dim, chunk_size
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
                raise ValueError("the cubit conversion supports causal masks with left padding only (no sliding windows "
                                 "or packed sequences); convert the global layers only (layers='global')")
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

