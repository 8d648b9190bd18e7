"""Constant-memory decoding of a converted model: a cache layer that holds a converted global
layer's window and feature state instead of every key and value.

Transformers builds its cache (``DynamicCache``) with one growing layer per full-attention layer.
For each converted global layer, :func:`install_decode_cache` (called by ``convert`` and
``load_converted``) registers a forward pre-hook on the attention module that swaps that layer's
still-empty ``DynamicLayer`` for a :class:`WindowFeatureCacheLayer`, in place: ``generate``, a
model-made cache or one a user passes all get it, with nothing to change in the calling code.

The layer's ``update`` returns the new keys and values only (nothing else is kept of them) and hands
itself to the layer's kernel (``kernel.active_cache``); the kernel's attention, called next in the
same layer, continues :attr:`WindowFeatureCacheLayer.state` (a
:class:`~kernelmix.ops.window_features.WindowFeatureState`: the last w − 1 keys, values and key
features and the feature sums before them) and stores the new one. ``get_mask_sizes`` reports
every token seen, as a growing layer would, so that unconverted full-attention layers sharing the
mask are unaffected. A host's sliding-window layers keep their own (bounded) cache. Beam search
(reordering a state) is not supported and says so.
"""

from __future__ import annotations

import functools

from torch import nn

from ..errors import KernelmixError
from .attention import decoder_layers, is_local


def window_feature_cache_layer(kernel: nn.Module):
    """A new :class:`WindowFeatureCacheLayer` for ``kernel`` (the class is built on first use, so that
    importing this module does not import transformers)."""
    return _layer_class()(kernel)


@functools.cache
def _layer_class():
    from transformers.cache_utils import CacheLayerMixin as base

    class WindowFeatureCacheLayer(base):
        """One converted global layer's decode cache: its :class:`~kernelmix.ops.window_features.WindowFeatureState`
        (``state``, None before the first token) and the number of tokens seen."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, kernel: nn.Module):
            super().__init__()
            self.kernel = kernel
            self.state = None
            self.seen = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.seen += key_states.shape[-2]
            self.kernel.active_cache = self  # taken by this layer's attention call, next
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return -1

        def nbytes(self) -> int:
            """Bytes held: the window's keys, values and key features and the feature state."""
            if self.state is None:
                return 0
            s = self.state
            tensors = (s.keys, s.values, s.key_features, s.features.S, s.features.z, s.features.shift, s.doc_start)
            return sum(t.numel() * t.element_size() for t in tensors)

        def reset(self) -> None:
            self.state, self.seen, self.is_initialized = None, 0, False

        def offload(self) -> None:  # nothing large to move
            return None

        def prefetch(self) -> None:
            return None

        def reorder_cache(self, beam_idx) -> None:
            raise KernelmixError("beam search is not supported with a converted layer's decode cache: use greedy or "
                                 "sampled generation (num_beams=1)")

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.reorder_cache(None)

        def batch_select_indices(self, indices) -> None:
            self.reorder_cache(None)

    return WindowFeatureCacheLayer


def _swap_in(module: nn.Module, args, kwargs):
    """Forward pre-hook of a converted global layer's attention: give it a window/feature cache
    layer when the cache it is about to use still has none with tokens for this layer."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    kernel = getattr(module, "kernelmix_rf", None)
    if cache is None or kernel is None or not hasattr(cache, "layers"):
        return None
    index = module.layer_idx
    layer_class = _layer_class()
    layers = cache.layers
    if index < len(layers):
        current = layers[index]
        if isinstance(current, layer_class):
            return None
        if current.get_seq_length() == 0 and not getattr(current, "is_sliding", False):
            layers[index] = layer_class(kernel)
    elif index == len(layers) and getattr(cache, "layer_class_to_replicate", None) is not None:
        layers.append(layer_class(kernel))
    return None


def install_decode_cache(model) -> list[int]:
    """Make every converted global layer of ``model`` decode from a :class:`WindowFeatureCacheLayer`
    (idempotent); returns those layers' indices. Cubit conversions keep the host's cache."""
    installed = []
    for i, layer in enumerate(decoder_layers(model)):
        attn = layer.self_attn
        kernel = getattr(attn, "kernelmix_rf", None)
        if kernel is None or is_local(attn) or not hasattr(kernel, "attend_window"):
            continue
        if not getattr(attn, "_kernelmix_cache_hook", None):
            attn._kernelmix_cache_hook = attn.register_forward_pre_hook(_swap_in, with_kwargs=True)
        installed.append(i)
    return installed


def decode_cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: keys and values of its ordinary layers plus the state of
    every :class:`WindowFeatureCacheLayer`."""
    layer_class = _layer_class()
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, layer_class):
            total += layer.nbytes()
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
    return total


__all__ = ["decode_cache_bytes", "install_decode_cache", "window_feature_cache_layer"]
