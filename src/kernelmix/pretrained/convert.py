"""Convert a pretrained Hugging Face causal LM (Llama / Gemma families) to a linear-cost mixer:
``performer`` or ``darkformer`` (random features), ``hedgehog`` (a learned feature map), ``window``
(sliding window and sinks alone) or ``cubit`` (see ``ConversionConfig.mixer``).

:func:`convert` attaches a kernel (:mod:`.layer_kernels`) to each chosen layer and switches the
model to the ``kernelmix`` attention implementation (:mod:`.attention`). The host's parameters are
untouched; the conversion settings are stored in ``config.kernelmix_conversion`` so that
:func:`kernelmix.pretrained.load_converted` can re-apply them.

DARKFormer initialisations (:func:`initialise`): ``identity`` (exactly Performer), ``whiten``
(the function-preserving data-aware transform from calibration statistics) and ``distill``
(train M, optionally F, so each layer's attention output matches exact softmax attention on the
same q/k/v; host weights untouched); see :mod:`.calibration`. ``cubit`` is experimental
(:class:`~.layer_kernels.CubitKernel`): the keys serve as Cubit's reference, λ and s are
learned, global (unwindowed) layers only.

For finetuning later: :func:`set_trainable` freezes the host except q/k/v projections (and the
QK-norm scales) of converted layers and the kernels' own parameters.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from .attention import ATTENTION_NAME, decoder_layers, is_local, kernels, register
from .calibration import capture, distill, whiten
from .layer_kernels import CubitKernel, HedgehogKernel, RandomFeatureKernel, WindowOnlyKernel
from .settings import (  # noqa: F401 (the settings, torch-free, what the command line reads: exported here as before)
    CONFIG_KEY, CONVERSION_VERSION, DEFAULT_SINKS, DEFAULT_WINDOW, INITS, LAYER_CHOICES, MIXERS, PROJECTIONS,
    ConversionConfig, LayerSelection,
)
from .window_cache import install_decode_cache


def resolve_layers(model, layers: Any) -> list[int]:
    """``all`` / ``global`` / ``local`` / indices → sorted list of layer indices (a KernelmixError, which is a
    ValueError, when empty or out of range).

    Args:
        model: a Hugging Face causal LM (see :func:`decoder_layers`).
        layers: ``"all"``, ``"global"`` (layers without a sliding window), ``"local"`` (sliding-window layers)
            or an iterable of int layer indices (negative ones count from the end).

    Returns:
        The chosen layer indices in ``0..n-1``, sorted, each once."""
    decoder = decoder_layers(model)
    n = len(decoder)
    if isinstance(layers, str):
        if layers not in LAYER_CHOICES:
            raise KernelmixError(f"unknown layer selection {layers!r} "
                                 f"(choose from: {', '.join(LAYER_CHOICES)}, or a list of indices)")
        picked = [i for i, layer in enumerate(decoder)
                  if layers == "all" or (layers == "local") == is_local(layer.self_attn)]
        if not picked:
            raise KernelmixError(f"the model has no {layers} attention layers to convert: choose another layer "
                                 f"selection ({', '.join(c for c in LAYER_CHOICES if c != layers)}) "
                                 "or a list of indices")
        return picked
    indices = list(layers)
    if not indices:
        raise KernelmixError("empty layer list: choose at least one layer to convert")
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int):
            raise KernelmixError(f"layer indices must be ints, got {i!r}")
        if not -n <= i < n:
            raise KernelmixError(f"layer index {i} out of range: the model has {n} layers, "
                                 f"choose indices in 0..{n - 1}")
    return sorted({i % n for i in indices})


def convert(model, config: ConversionConfig | None = None, *, calibration: Tensor | None = None,
            init: str | None = None, attention_mask: Tensor | None = None, progress: bool = False,
            **init_options) -> nn.Module:
    """Convert ``model`` in place (and return it): the chosen layers get the kernel of ``config.mixer``
    (:class:`RandomFeatureKernel` for performer / darkformer, :class:`HedgehogKernel`,
    :class:`WindowOnlyKernel` or :class:`CubitKernel`) and the model runs the ``kernelmix`` attention
    implementation.

    Args:
        model: a Hugging Face Llama / Gemma causal LM; its parameters are untouched.
        config: what to convert and how (default ``ConversionConfig()``). Not modified: the settings
            as applied (the resolved ``layer_indices``, the init, cubit's window = sinks = 0) are
            recorded in the model's config, read back with :func:`conversion_config`.
        calibration: token ids ``[B, T]`` for the inits other than ``identity`` (None: ``identity`` only).
        init: DARKFormer's initialisation (default ``config.init``): ``identity``, ``whiten``,
            ``distill`` or ``whiten+distill``, the last three from ``calibration`` token ids ``[B, T]``
            (``attention_mask`` optional); any other mixer takes ``identity`` only.
        attention_mask: ``[B, T]`` padding mask of ``calibration`` (None: no padding).
        progress: show a progress bar while distilling.
        init_options: passed to :func:`initialise`.

    Returns:
        ``model``, converted."""
    config = ConversionConfig() if config is None else copy.deepcopy(config)  # the caller's stays as it was
    if init is not None:
        config.init = init
    init = config.init
    config.validate()
    if hasattr(model.config, CONFIG_KEY) and any(hasattr(l.self_attn, "kernelmix_rf") for l in decoder_layers(model)):
        raise KernelmixError("the model is already converted; load the original to convert it again")
    indices = resolve_layers(model, config.layers)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and config.window > context:
        raise KernelmixError(f"window {config.window} is longer than the host's context ({context} tokens): choose a "
                             f"window ≤ {context} (the default is {DEFAULT_WINDOW}; 0 = features only)")
    if config.mixer == "cubit":
        config.window = config.sinks = 0  # the cubit conversion has no feature part to put beside a window
    config.layer_indices = indices
    attach_kernels(model, config)
    if init != "identity":
        initialise(model, init, calibration, attention_mask=attention_mask, progress=progress, **init_options)
    return model


def attach_kernels(model, config: ConversionConfig) -> None:
    """Attach a fresh kernel of ``config.mixer`` (float32, on the model's device) to each layer of
    ``config.layer_indices``, switch the model (and any sub-config) to the ``kernelmix`` attention
    implementation, record ``config`` in ``model.config`` and install the decode cache. Neither checks
    nor initialises: :func:`convert` resolves and validates before, :func:`load_converted` loads the
    saved kernel tensors after.

    Args:
        model: a Hugging Face causal LM, not converted yet.
        config: a validated :class:`ConversionConfig` with its ``layer_indices`` resolved; the kernels' W
            come from one generator seeded with ``config.seed``, layers in that order.

    Returns:
        None; ``model`` is changed in place."""
    register()
    decoder = decoder_layers(model)
    generator = torch.Generator().manual_seed(config.seed)
    cfg = model.config
    param = next(model.parameters())
    for i in config.layer_indices:
        attn = decoder[i].self_attn
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if config.mixer == "cubit":
            kernel = CubitKernel(num_heads=heads, num_kv_heads=kv_heads, head_dim=attn.head_dim, ridge=config.ridge,
                                 chunk_size=config.chunk_size)
        elif config.mixer == "window":
            kernel = WindowOnlyKernel(num_heads=heads, num_kv_heads=kv_heads, head_dim=attn.head_dim,
                                      window=config.window, sinks=config.sinks, chunk_size=config.chunk_size)
        elif config.mixer == "hedgehog":
            kernel = HedgehogKernel(num_heads=heads, num_kv_heads=kv_heads, head_dim=attn.head_dim,
                                    num_features=config.num_features, window=config.window, sinks=config.sinks,
                                    chunk_size=config.chunk_size, generator=generator)
        else:
            kernel = RandomFeatureKernel(mixer=config.mixer, num_heads=heads, num_kv_heads=kv_heads,
                                         head_dim=attn.head_dim, num_features=config.num_features,
                                         projection=config.projection, chunk_size=config.chunk_size,
                                         window=config.window, sinks=config.sinks, generator=generator)
        attn.kernelmix_rf = kernel.to(device=param.device)  # float32 whatever the host dtype
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # sub-configs (some models keep their own) follow
        sub_cfg = getattr(sub, "config", None)
        if sub_cfg is not None and sub_cfg is not cfg and hasattr(sub_cfg, "_attn_implementation"):
            sub_cfg._attn_implementation = ATTENTION_NAME
    setattr(model.config, CONFIG_KEY, {k: v for k, v in asdict(config).items()})
    install_decode_cache(model)


def legacy_defaults(raw: dict) -> dict:
    """A recorded conversion with the settings that did not exist when it was written filled in as
    they then were (version 1 had no window: features only)."""
    return {"window": 0, "sinks": 0, **raw} if "window" not in raw else raw


def conversion_config(model) -> ConversionConfig | None:
    """The conversion recorded in ``model.config`` (under ``kernelmix_conversion``), with the settings an
    older record lacks filled in as they then were.

    Args:
        model: a Hugging Face causal LM.

    Returns:
        The recorded :class:`ConversionConfig` (not validated), or None when the model is not converted."""
    raw = getattr(model.config, CONFIG_KEY, None)
    return None if raw is None else ConversionConfig(**legacy_defaults(raw))


def set_num_features(model, num_features: int, seed: int = 0) -> None:
    """Redraw every converted layer's W with ``num_features`` rows (M and F are kept).

    Args:
        model: a performer or darkformer conversion (a cubit, hedgehog or window layer is a KernelmixError).
        num_features: the new m per head.
        seed: seeds the one generator every layer draws from, in layer order.

    Returns:
        None; the new ``num_features`` and ``seed`` are recorded in the model's conversion config."""
    todo = kernels(model)
    if not todo:  # every check before the first redraw, so a refused call changes nothing
        raise KernelmixError("set_num_features needs a converted model (no layer has a kernel): convert it first")
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
        raise KernelmixError(f"num_features must be a positive int, got {num_features!r}")
    for kernel in todo.values():
        if kernel.mixer in ("cubit", "hedgehog", "window"):
            raise KernelmixError(f"a {kernel.mixer} conversion has no random features to redraw")
    generator = torch.Generator().manual_seed(seed)
    for kernel in todo.values():
        kernel.redraw_(generator, num_features)
    raw = getattr(model.config, CONFIG_KEY)
    raw.update(num_features=int(num_features), seed=int(seed))


def initialise(model, init: str, calibration: Tensor | None, *, attention_mask: Tensor | None = None,
               eps: float = 1e-3, steps: int = 200, lr: float = 5e-3, train_fold: bool = False,
               batch_size: int = 1, seed: int | None = None, progress: bool = False,
               log: Callable | None = None) -> dict:
    """(Re-)initialise the DARKFormer layers of a converted model: ``identity``, ``whiten``,
    ``distill`` or ``whiten+distill`` from ``calibration`` token ids ``[B, T]``.

    Args:
        model: a converted model (:func:`convert`); its DARKFormer layers are first reset to M = F = I.
        init: ``identity``, ``whiten``, ``distill`` or ``whiten+distill``; all but ``identity`` need a
            darkformer conversion.
        calibration: token ids ``[B, T]`` the statistics and teachers come from (required unless ``identity``).
        attention_mask: ``[B, T]`` padding mask of ``calibration``, or None.
        eps: whitening's regularisation (:func:`whiten`).
        steps, lr, train_fold: distillation's steps per layer, learning rate and whether F trains too
            (:func:`distill`).
        batch_size: calibration rows per forward while capturing (:func:`capture`).
        seed: seeds distillation's redraws of W; None: the conversion's own ``seed`` (its config).
        progress: show a progress bar while distilling.
        log: distillation's message callback (:func:`distill`).

    Returns:
        ``{"distill": {layer: losses}}`` when distilling, else ``{}``; ``init`` is recorded in the model's
        conversion config."""
    if init not in INITS:
        raise KernelmixError(f"unknown init {init!r} (choose from: {', '.join(INITS)})")
    ks = kernels(model)
    if not ks:
        raise KernelmixError("the model is not converted (no kernelmix_rf layers); call convert() first")
    if init != "identity":  # checked before the reset, so a refused call leaves the model as it was
        if calibration is None:
            raise KernelmixError(f"init={init!r} needs calibration token ids [B, T]")
        if any(k.mixer != "darkformer" for k in ks.values()):
            raise KernelmixError(f"init={init!r} applies to darkformer conversions (performer has no transform): use "
                                 "mixer darkformer, or init identity")
    result: dict = {}
    for k in ks.values():
        if k.mixer == "darkformer":
            k.reset_parameters()  # M = F = I, W kept
    if init != "identity":
        captured = capture(model, calibration, attention_mask, batch_size=batch_size)
        if init.startswith("whiten"):
            whiten(model, captured, eps)
        if init.endswith("distill"):
            if seed is None:
                seed = int(getattr(model.config, CONFIG_KEY).get("seed", 0))
            result["distill"] = distill(model, captured, steps=steps, lr=lr, train_fold=train_fold, seed=seed,
                                        progress=progress, log=log)
    raw = getattr(model.config, CONFIG_KEY)
    raw["init"] = init
    return result


def set_trainable(model, *, qkv: bool = True, transform: bool = True, norms: bool = True,
                  layers: Iterable[int] | None = None) -> list[nn.Parameter]:
    """Freeze the host except, in ``layers`` (default: the converted ones), the q/k/v projections,
    the QK-norm scales and the kernels' own parameters (DARKFormer's M, Cubit's λ and s; ``transform``).
    Unconverted layers may be listed too (a softmax baseline finetuned the same way).

    Args:
        model: a Hugging Face causal LM, converted or not.
        qkv: unfreeze the layers' ``q_proj``, ``k_proj`` and ``v_proj``.
        transform: unfreeze the kernels' own parameters (``kernel.trainable()``).
        norms: unfreeze the QK-norm scales (``q_norm``, ``k_norm``) where a layer has them.
        layers: decoder-layer indices (None: the converted layers).

    Returns:
        The trainable parameters (for a finetuning optimizer); every other parameter has
        ``requires_grad`` False."""
    for p in model.parameters():
        p.requires_grad_(False)
    decoder = decoder_layers(model)
    indices = list(kernels(model)) if layers is None else list(layers)
    names = (["q_proj", "k_proj", "v_proj"] if qkv else []) + (["q_norm", "k_norm"] if norms else [])
    trainable = []
    for i in indices:
        attn = decoder[i].self_attn
        for name in names:
            sub = getattr(attn, name, None)
            if sub is not None:
                trainable.extend(sub.parameters())
        kernel = getattr(attn, "kernelmix_rf", None)
        if transform and kernel is not None:
            trainable.extend(kernel.trainable())
    for p in trainable:
        p.requires_grad_(True)
    return trainable
