"""Decode cost of a converted model against its host: the cache's bytes and the time per token
at given context lengths (:func:`decode_costs`, part of ``kernelmix report conversion``).

The caches are filled to the context length directly, not by a prefill of that many tokens (32k
tokens of prefill would take most of the report's time on a CPU): the host's layers receive random
keys and values of the context's length through their own ``update`` (a sliding-window layer keeps
its last window, a global layer everything), a converted layer a feature state made from a short
random prefix and marked as having seen the whole context. Neither a cache's size nor the work of a
decode step depends on what the keys hold, only on how many there are, so both are measured as
generation would meet them. Time: the median over ``decode_tokens`` greedy steps after one warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from ..ops.window_features import window_feature_attention
from ..pretrained.attention import decoder_layers, is_local, kernels
from ..pretrained.window_cache import decode_cache_bytes, window_feature_cache_layer


def filled_cache(model, context: int, *, seed: int = 0):
    """A transformers cache for ``model`` holding ``context`` tokens (random contents, module docstring)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    converted = kernels(model)
    for i, layer in enumerate(decoder_layers(model)):
        attn = layer.self_attn
        kv_heads = model.config.num_key_value_heads
        shape = (1, kv_heads, context, attn.head_dim)
        if i in converted and not is_local(attn):
            cache.layers[i] = _converted_layer(converted[i], context, kv_heads, attn.head_dim, gen)
            continue
        keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        cache.layers[i].update(keys, values)
    return cache


def _converted_layer(kernel, context: int, kv_heads: int, head_dim: int, gen):
    prefix = min(context, 2 * max(kernel.window, 1) + 8)
    q = torch.randn(1, prefix, kernel.num_heads, head_dim, generator=gen)
    k = torch.randn(1, prefix, kv_heads, head_dim, generator=gen)
    v = torch.randn(1, prefix, kv_heads, head_dim, generator=gen)
    with torch.no_grad():
        q_features, k_features = kernel.log_features(q, k)
        _, state = window_feature_attention(q, k, v, q_features, k_features, window=kernel.window, sinks=kernel.sinks,
                                            return_state=True)
    held = state.keys.shape[1]
    state = replace(state, length=context, features=replace(state.features, length=context - held))
    layer = window_feature_cache_layer(kernel)
    layer.state, layer.seen, layer.is_initialized, layer.device = state, context, True, q.device
    return layer


def decode_costs(host, settings, converted) -> dict:
    """``{"contexts": [...], "host": {"bytes": [...], "ms_per_token": [...]}, "converted": {...}}``."""
    result = {"contexts": list(settings.decode_contexts)}
    for name, model in (("host", host), ("converted", converted)):
        sizes, times = [], []
        for context in settings.decode_contexts:
            cache = filled_cache(model, context)
            sizes.append(decode_cache_bytes(cache))
            times.append(_ms_per_token(model, cache, settings.decode_tokens))
        result[name] = {"bytes": sizes, "ms_per_token": times}
    return result


def _ms_per_token(model, cache, tokens: int) -> float:
    token = torch.tensor([[2]])
    steps = []
    with torch.no_grad():
        for step in range(tokens + 1):
            t = time.perf_counter()
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            if step:  # the first is a warm-up
                steps.append(1000 * (time.perf_counter() - t))
    return statistics.median(steps)


__all__ = ["decode_costs", "filled_cache"]
