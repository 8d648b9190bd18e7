"""Token-mixer layers (``nn.Module``): projections, RoPE, per-mixer parameters and the decode cache.

One registry name per mixer (:mod:`.registry`: the names and their metadata, without torch)::

    from kernelmix.layers import build_mixer
    layer = build_mixer("cubit", hidden_size=256, num_heads=4, num_kv_heads=2, lrr=False)
    out, cache = layer(x)                  # x: [B, T, 256]
    out_t, cache = layer(x_next, cache)    # continue token by token (or several tokens at once)

Every constructor takes explicit keyword-only arguments: the shared ones (:data:`SHARED_OPTIONS`,
defined once by :class:`MixerLayer`) and the mixer's own; :func:`build_mixer` turns an unknown
mixer name or option into a ``KernelmixError`` (a ``ValueError``) that lists the accepted ones. Every layer initialises
its own parameters (``reset_parameters``); the random-feature layers share one
:class:`RandomFeatureMap` with a converted model's kernels (``redraw_``, ``whiten_``).
"""

from __future__ import annotations

import inspect

from ..errors import KernelmixError
from ..lazy import lazy_names
from . import registry

#: name → layer class of every registered mixer (:mod:`.registry`, the one list of mixers), a live
#: view: a mixer registered later is in it, and a class is imported when it is first looked up
MIXERS = registry.View(lambda: registry.REGISTRY, registry.layer_class)


def mixer_options(name: str) -> tuple[str, ...]:
    """The keyword arguments the mixer ``name`` accepts, in constructor order (the shared ones first)."""
    cls = _mixer_class(name)
    params = inspect.signature(cls.__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _mixer_class(name: str) -> type:
    return registry.layer_class(name)  # an unknown name: a KernelmixError listing the registered ones


def build_mixer(name: str, **kwargs):
    """Construct the mixer layer registered as ``name`` with keyword arguments ``kwargs``.

    Raises ``KernelmixError`` (a ``ValueError``) for an unknown name (listing the registered ones) and for an option the
    mixer does not take (listing the ones it does) — an option is never silently ignored."""
    cls = _mixer_class(name)
    accepted = mixer_options(name)
    unknown = [key for key in kwargs if key not in accepted]
    if unknown:
        raise KernelmixError(
            f"mixer {name!r} got unknown option(s) {', '.join(repr(k) for k in unknown)}; "
            f"accepted options: {', '.join(accepted)}"
        )
    return cls(**kwargs)


__getattr__, __dir__ = lazy_names(__name__, {
    "base": ["SHARED_OPTIONS", "LayerCache", "MixerLayer"],
    "cubit": ["CubitMixer"],
    "cubit_rf": ["CubitRFMixer"],
    "deltaformer": ["DeltaFormerMixer"],
    "feature_map": ["PROJECTIONS", "RandomFeatureMap"],
    "random_features": ["DarkFormerMixer", "PerformerMixer"],
    "rope": ["apply_rope", "rope_cos_sin"],
    "softmax": ["SoftmaxMixer"],
})

__all__ = [
    "MIXERS",
    "PROJECTIONS",
    "SHARED_OPTIONS",
    "CubitMixer",
    "CubitRFMixer",
    "DarkFormerMixer",
    "DeltaFormerMixer",
    "LayerCache",
    "MixerLayer",
    "PerformerMixer",
    "RandomFeatureMap",
    "SoftmaxMixer",
    "apply_rope",
    "build_mixer",
    "mixer_options",
    "rope_cos_sin",
]
