"""Token-mixer layers (``nn.Module``): projections, RoPE, per-mixer parameters and the decode cache.

One registry name per mixer (:mod:`.registry`: the names and their metadata, without torch)::

    from kernelmix.layers import build_mixer
    layer = build_mixer("cubit", hidden_size=256, num_heads=4, num_kv_heads=2, lrr=False)
    out, cache = layer(x)                  # x: [B, T, 256]
    out_t, cache = layer(x_next, cache)    # continue token by token (or several tokens at once)

Every constructor takes explicit keyword-only arguments: the shared ones (:data:`SHARED_OPTIONS`,
taken by :class:`MixerLayer`) and the mixer's own (its class's ``OPTIONS``, and its registry entry's
``MixerInfo.options``, which :func:`mixer_options` reads without importing torch); :func:`build_mixer` turns an unknown
mixer name or option into a ``KernelmixError`` (a ``ValueError``) that lists the accepted ones. Every layer initialises
its own parameters (``reset_parameters``); the random-feature layers share one
:class:`RandomFeatureMap` with a converted model's kernels (``redraw_``, ``whiten_``).
"""

from __future__ import annotations

from ..errors import KernelmixError
from ..lazy import lazy_names
from . import registry
from .settings import SHARED_OPTIONS

#: name → layer class of every registered mixer (:mod:`.registry`, the one list of mixers), a live
#: view: a mixer registered later is in it, and a class is imported when it is first looked up
MIXERS = registry.View(lambda: registry.REGISTRY, registry.layer_class)


def mixer_options(name: str) -> tuple[str, ...]:
    """The keyword arguments the mixer ``name`` accepts: the shared ones, then its own (from its
    registry entry, so no layer module and no torch is imported). An unknown name is a
    ``KernelmixError`` listing the registered ones."""
    return SHARED_OPTIONS + registry.mixer_info(name).options


def _mixer_class(name: str) -> type:
    cls = registry.layer_class(name)  # an unknown name: a KernelmixError listing the registered ones
    declared = registry.mixer_info(name).options
    if tuple(cls.OPTIONS) != declared:  # a registered mixer whose entry and class were changed apart
        raise KernelmixError(f"mixer {name!r}: its registry entry names the options {declared}, its class "
                             f"{cls.__name__} {tuple(cls.OPTIONS)}; "
                             f"make MixerInfo.options equal {cls.__name__}.OPTIONS")
    return cls


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
    "base": ["LayerCache", "MixerLayer"],
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
