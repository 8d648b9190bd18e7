"""The one list of mixers: each registered name with what the rest of kernelmix needs to know about it.

Plain data and the standard library only (no torch, no pydantic): the command line reads the names
and their metadata to build its choices and defaults without importing torch, and ``kernelmix
gpu-check`` runs where pydantic is missing. The layer classes are named by their import path and
imported at first use (:func:`layer_class`, what :func:`kernelmix.layers.build_mixer` builds).

Every command that lists mixers derives its choices and defaults from here: ``compare`` and
``recall`` (every mixer and its :class:`Variant`), ``bench``, ``demo`` and ``gpu-check`` (every mixer
with an ``op``), ``generate-bench`` and ``model-info`` (every mixer).

**Adding a mixer** is one entry here, next to the layer and op files it names (``cubit-rf``'s, at
the end of this module)::

    register(MixerInfo(
        name="cubit-rf", layer="kernelmix.layers.cubit_rf:CubitRFMixer", family="random-features",
        constant_cache=True, options=CUBIT_RF_OPTIONS, op="kernelmix.ops.calls:cubit_rf",
        step="kernelmix.ops.calls:cubit_rf_step", leaves=("q", "k", "v", "r", "rho"), in_defaults=False,
    ))

``options`` names the layer's own keyword arguments (its class's ``OPTIONS``; the shared ones are
:data:`~kernelmix.layers.settings.SHARED_OPTIONS`), as plain strings so that a config's
``mixer_options`` is checked without importing the layer (``kernelmix train --set
model.mixer_options.cubit.lrrr=false`` is refused without torch); :func:`kernelmix.layers.build_mixer`
refuses a class whose ``OPTIONS`` differ from it, and a test compares both with each ``__init__``.

``op`` and ``step`` (optional) are the functions :mod:`kernelmix.ops.calls` writes for each mixer:
its op on the studies' one dict of inputs (``call(x, *, chunk_size=None, backend="auto",
reference=False, return_state=False, **variant_options)``) and one decode token after a prefill
(``step(x_last, state) -> (out, state)``); add the new mixer's two there. Without them the mixer is
trained, evaluated and generated with, but not measured at the op level. Name it in the
``variants``, ``family`` and ``constant_cache`` and every command lists it; a test can
:func:`register` a mixer and :func:`unregister` it after.

``in_defaults=False`` keeps a mixer (and its variants) out of the *default* mixer lists of the
trained studies, ``compare`` and ``recall`` (:func:`default_variants`), while it stays one of their
choices (``--mixers ...``): their defaults are what the committed results/compare and results/recall
and the README's main job were made with, so a new mixer joins them when its results are committed
with them, not silently. A :class:`Variant` takes ``in_defaults=False`` too (Cubit-RF's dense
ablations). The measuring commands (bench, demo, gpu-check, generate-bench, model-info) list every
registered mixer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import KernelmixError

FAMILIES = ("softmax", "solve", "random-features")


@dataclass(frozen=True)
class Variant:
    """Another setting of a mixer that compare and recall train as a mixer of its own: ``name``
    (``cubit-nolrr``), the layer ``options`` it sets and a ``note`` for tables (``no LRR``); ``op_level=False``
    for a setting the op-level call does not take (Cubit-RF's dense ablation), which demo then leaves out."""

    name: str
    options: Mapping[str, Any]
    note: str
    op_level: bool = True  # the op call takes its options too (demo checks it there); False: a layer-only setting
    in_defaults: bool = True  # False: a choice of compare and recall, not one of their defaults (a slow ablation)


@dataclass(frozen=True)
class MixerInfo:
    """One registered mixer (the module docstring says what each field is for)."""

    name: str
    layer: str  # "module:Class" of its nn.Module (a MixerLayer)
    family: str  # one of FAMILIES: what its cost grows like and which peers it is compared with
    constant_cache: bool  # its decode state has a constant size (no key/value cache growing with the context)
    options: tuple[str, ...] = ()  # the layer's own keyword arguments (= its class's OPTIONS), beyond SHARED_OPTIONS
    op: str | None = None  # "module:function": the op as bench, demo and gpu-check call it
    step: str | None = None  # "module:function": one decode token after ``op(..., return_state=True)``
    leaves: tuple[str, ...] = ("q", "k", "v")  # the inputs a forward+backward of the op differentiates
    variants: tuple[Variant, ...] = field(default=())
    in_defaults: bool = True  # in compare's and recall's default mixers (False: a choice only; the module docstring)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise KernelmixError(f"mixer {self.name!r}: "
                                 f"unknown family {self.family!r} (choose from: {', '.join(FAMILIES)})")


REGISTRY: dict[str, MixerInfo] = {}

# the layers' own options (each class's OPTIONS, spelt again here so that reading them needs no torch)
CUBIT_OPTIONS = ("reference", "reference_rope", "lrr", "lrr_range", "ridge")
RANDOM_FEATURE_OPTIONS = ("num_features", "projection")
CUBIT_RF_OPTIONS = ("num_features", "projection", "data_aware", *CUBIT_OPTIONS, "estimate", "readout")


def register(info: MixerInfo) -> MixerInfo:
    """Add ``info`` to the registry; a name (or variant name) that is taken is an error."""
    taken = {info.name, *(v.name for v in info.variants)} & set(variants())
    if taken:
        raise KernelmixError(f"mixer name(s) {', '.join(sorted(taken))} already registered")
    REGISTRY[info.name] = info
    return info


def unregister(name: str) -> None:
    """Remove the mixer ``name`` (a test's throwaway mixer)."""
    REGISTRY.pop(name, None)


def mixer_names() -> tuple[str, ...]:
    """Every registered mixer, in registration order."""
    return tuple(REGISTRY)


def op_mixers() -> tuple[str, ...]:
    """The mixers with an op-level call: what bench, demo and gpu-check measure."""
    return tuple(name for name, info in REGISTRY.items() if info.op is not None)


def mixer_info(name: str) -> MixerInfo:
    if name not in REGISTRY:
        raise KernelmixError(f"unknown mixer {name!r} (choose from: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def variants() -> dict[str, tuple[str, dict[str, dict[str, Any]]]]:
    """Every mixer and variant compare and recall train: name → (registry mixer, its ``mixer_options``)."""
    out: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}
    for name, info in REGISTRY.items():
        out[name] = (name, {})
        for variant in info.variants:
            out[variant.name] = (name, {name: dict(variant.options)})
    return out


def default_variants() -> dict[str, tuple[str, dict[str, dict[str, Any]]]]:
    """What compare and recall train when no mixers are given: :func:`variants` of the mixers registered
    with ``in_defaults=True``, less their variants with ``in_defaults=False``."""
    left_out = {variant.name for info in REGISTRY.values() for variant in info.variants if not variant.in_defaults}
    return {name: value for name, value in variants().items()
            if REGISTRY[value[0]].in_defaults and name not in left_out}


def load(path: str) -> Any:
    """The object ``"module:attribute"`` names (a layer class, an op call), imported now."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def layer_class(name: str) -> type:
    """The nn.Module class of the mixer ``name`` (its module imported at first use)."""
    return load(mixer_info(name).layer)


def step_call(name: str) -> Callable[..., Any]:
    """The one-token decode call of the mixer ``name``: ``step(x_last, state) -> (out, state)``."""
    info = mixer_info(name)
    if info.step is None:
        raise KernelmixError(f"mixer {name!r} has no decode step call (MixerInfo.step)")
    return load(info.step)


def op_call(name: str) -> Callable[..., Any]:
    """The op-level call of the mixer ``name`` (see the module docstring)."""
    info = mixer_info(name)
    if info.op is None:
        raise KernelmixError(f"mixer {name!r} has no op-level call (MixerInfo.op): it is not measured by bench, demo "
                             f"or gpu-check (those that are: {', '.join(op_mixers())})")
    return load(info.op)


def _with_op() -> dict[str, MixerInfo]:
    return {name: info for name, info in REGISTRY.items() if info.op is not None}


class View(Mapping):
    """A read-only mapping that always reflects the registry now: ``View(variants)``, or the mixers'
    layer classes (``kernelmix.layers.MIXERS``), so that a name registered later is in it too."""

    def __init__(self, items: Callable[[], Mapping[str, Any]], value: Callable[[str], Any] | None = None) -> None:
        self._items, self._value = items, value

    def __getitem__(self, name: str) -> Any:
        items = self._items()
        if name not in items:
            raise KeyError(name)
        return self._value(name) if self._value is not None else items[name]

    def __contains__(self, name: object) -> bool:  # without building the value (a layer class: torch)
        return name in self._items()

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items()))

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return f"View({list(self)})"

    # a view is itself, not its current items: hashable, so that it can sit in an annotation (config.Choice)
    __eq__ = object.__eq__
    __hash__ = object.__hash__


#: name → MixerInfo of every mixer with an op-level call (bench, demo and gpu-check measure these), live
OP_MIXERS = View(_with_op)

register(MixerInfo("softmax", "kernelmix.layers.softmax:SoftmaxMixer", "softmax", constant_cache=False,
                   op="kernelmix.ops.calls:softmax", step="kernelmix.ops.calls:softmax_step"))
register(MixerInfo("cubit", "kernelmix.layers.cubit:CubitMixer", "solve", constant_cache=False,
                   options=(*CUBIT_OPTIONS, "solve_operands"),
                   op="kernelmix.ops.calls:cubit", step="kernelmix.ops.calls:cubit_step",
                   leaves=("q", "k", "v", "r", "rho"), variants=(Variant("cubit-nolrr", {"lrr": False}, "no LRR"),)))
register(MixerInfo("deltaformer", "kernelmix.layers.deltaformer:DeltaFormerMixer", "solve", constant_cache=False,
                   options=("w", "solve_operands"), op="kernelmix.ops.calls:deltaformer",
                   step="kernelmix.ops.calls:deltaformer_step",
                   leaves=("q", "k", "v", "beta")))
register(MixerInfo("performer", "kernelmix.layers.random_features:PerformerMixer", "random-features",
                   constant_cache=True, options=RANDOM_FEATURE_OPTIONS, op="kernelmix.ops.calls:performer",
                   step="kernelmix.ops.calls:performer_step"))
register(MixerInfo("darkformer", "kernelmix.layers.random_features:DarkFormerMixer", "random-features",
                   constant_cache=True, options=RANDOM_FEATURE_OPTIONS, op="kernelmix.ops.calls:darkformer",
                   step="kernelmix.ops.calls:darkformer_step", leaves=("q", "k", "v", "transform")))
# Cubit-RF (docs/math.md §12): Cubit's ridge solve, but on random features. Its family is
# "random-features", not "solve": a family says what the cost grows like and which targets and peers
# a mixer is measured against (gpu-check part (b): the "solve" family gets the T² targets — within
# 2.5× of SDPA, run at the long length — and "random-features" the linear ones — several times faster
# than SDPA, a decode step that does not grow with the position). Cubit-RF is O(T·m·d) with an
# O(m·d) state, and issue 27's targets for it are the linear ones. In the defaults of compare and recall
# (issue 27; its rows are in results/compare and results/recall-cubit-rf); its dense ablations are not.
register(MixerInfo("cubit-rf", "kernelmix.layers.cubit_rf:CubitRFMixer", "random-features", constant_cache=True,
                   options=CUBIT_RF_OPTIONS, op="kernelmix.ops.calls:cubit_rf",
                   step="kernelmix.ops.calls:cubit_rf_step", leaves=("q", "k", "v", "r", "rho"),
                   # the ablation of results/recall-cubit-rf: which estimate costs the recall (dense, no decode)
                   variants=(Variant("cubit-rf-exact-readout", {"estimate": "gram"}, "Gram estimated, exact read-out",
                                     op_level=False, in_defaults=False),
                             Variant("cubit-rf-exact-gram", {"estimate": "readout"}, "exact Gram, read-out estimated",
                                     op_level=False, in_defaults=False),
                             Variant("cubit-rf-exact", {"estimate": "none"}, "both kernels exact (dense Cubit)",
                                     op_level=False, in_defaults=False))))


__all__ = [
    "CUBIT_OPTIONS", "CUBIT_RF_OPTIONS", "FAMILIES", "RANDOM_FEATURE_OPTIONS", "REGISTRY", "MixerInfo", "Variant",
    "View", "default_variants", "layer_class", "load", "mixer_info", "mixer_names", "OP_MIXERS", "op_call", "op_mixers",
    "register", "step_call", "unregister", "variants",
]
