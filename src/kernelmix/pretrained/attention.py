"""How a converted Hugging Face model runs its attention: transformers' attention interface.

:func:`kernelmix.pretrained.convert` attaches a kernel module (:mod:`.layer_kernels`) as
``self_attn.kernelmix_rf`` to each chosen decoder layer and switches the model to the attention
implementation ``"kernelmix"``, registered here with ``AttentionInterface`` *and*
``AttentionMaskInterface`` (the mask function is transformers' ``sdpa_mask``; without it the
sliding-window masks would silently disappear). Transformers still computes everything up to the
attention: q/k/v projections, QK-norm, RoPE, the KV cache; :func:`kernelmix_attention` replaces
only softmax(q kᵀ·scaling) v, per layer: layers without a kernel (and every layer inside
:func:`exact_attention`) run transformers' SDPA unchanged.

Masks. Without a mask (plain causal) the chunked linear-time op runs. A mask that is causal plus
left padding (HF ``generate`` with a padded batch) is turned into ``doc_start`` and also runs
chunked (:func:`left_padding_doc_start`). Any other mask — sliding windows (Gemma local layers),
packed sequences — runs a dense O(T·L·m) path that applies the mask exactly, so a converted local
layer keeps its window.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from .hosts import SUPPORTED_MODEL_TYPES

ATTENTION_NAME = "kernelmix"



def visible_from_mask(mask: Tensor) -> Tensor:
    """An HF attention mask (bool: True = visible, or float additive) → bool ``[B, T, L]`` (heads share it).

    Args:
        mask: the mask transformers passes to the attention function, ``[B, 1, T, L]`` or ``[B, T, L]``; in a
            float mask an entry above half the dtype's minimum (0 rather than -inf) is visible.

    Returns:
        The bool mask ``[B, T, L]``, True where query t may see key l (of a 4-D mask, the first head's)."""
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.dim() == 4:
        mask = mask[:, 0]
    return mask


def left_padding_doc_start(visible: Tensor, query_offset: int) -> Tensor | None:
    """If ``visible`` ``[B, T, L]`` is exactly causal (queries at absolute positions
    ``query_offset + i``) plus left padding, return ``doc_start`` ``[B, L]`` for the padded-q
    chunked op (padding tokens form their own leading document); else None.

    Args:
        visible: a bool mask ``[B, T, L]`` (:func:`visible_from_mask`), True where query i sees key j.
        query_offset: the absolute position of the first query among the L keys (``L - T`` when the
            queries are the last T positions; 0 for a prefill).

    Returns:
        ``doc_start`` ``[B, L]`` (int64): for each key, the row's padding length (where its real tokens
        start), 0 on the padding itself; or None when the mask is anything else (a sliding window, packed
        sequences, a row whose last query sees no key)."""
    batch, length_q, length_k = visible.shape
    last = visible[:, -1]  # the last query sees every real key
    if not bool(last.any(-1).all()):
        return None
    pad = last.to(torch.int64).argmax(-1)  # first visible key per row
    cols = torch.arange(length_k, device=visible.device)
    rows = query_offset + torch.arange(length_q, device=visible.device)
    expected = (cols[None, None, :] <= rows[None, :, None]) & (cols[None, None, :] >= pad[:, None, None])
    # Padding query rows may be anything in HF masks; only compare real query rows.
    real_rows = rows[None, :] >= pad[:, None]
    if not bool(((expected == visible) | ~real_rows[:, :, None]).all()):
        return None
    return torch.where(cols[None, :] >= pad[:, None], pad[:, None],
                       torch.zeros_like(pad)[:, None]).expand(batch, length_k)


# ---------------------------------------------------------------------------------------------
# The registered attention function, exact mode and recorders

_STATE = threading.local()


def _exact_depth() -> int:
    return getattr(_STATE, "exact", 0)


def _recorders() -> list:
    if not hasattr(_STATE, "recorders"):
        _STATE.recorders = []
    return _STATE.recorders


@contextlib.contextmanager
def exact_attention():
    """Inside this context every converted layer runs the host's exact (SDPA) attention: the
    converted model computes exactly the original model (same weights)."""
    _STATE.exact = _exact_depth() + 1
    try:
        yield
    finally:
        _STATE.exact = _exact_depth() - 1


@contextlib.contextmanager
def record_attention(fn: Callable):
    """Call ``fn(module, query, key, value, attention_mask, scaling)`` on every attention call
    (HF layouts) of models running the ``kernelmix`` implementation.

    Args:
        fn: the recorder, called before each attention is computed, with the layer's ``self_attn``, query
            ``[B, H, T, d]``, key and value ``[B, H_kv, L, d]``, the HF mask (or None) and the scaling (or
            None); removed again on exit.

    Returns:
        A context manager (entering it gives None); recorders are per thread."""
    _recorders().append(fn)
    try:
        yield
    finally:
        _recorders().remove(fn)


def kernelmix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``kernelmix`` attention function: random-feature attention on layers with a kernel,
    transformers' SDPA on the others (and everywhere inside :func:`exact_attention`).

    Args:
        module: the layer's ``self_attn`` module; its ``kernelmix_rf`` (if any) is the layer's kernel.
        query: ``[B, H, T, d]``, after the projections, QK-norm and RoPE.
        key, value: ``[B, H_kv, L, d]``, the KV cache's keys and values included.
        attention_mask: transformers' mask (bool, or additive float; see :func:`visible_from_mask`), or None
            for plain causal attention.
        dropout: attention dropout, passed to SDPA only (the kernels apply none).
        scaling: the logits' scale (None: ``head_dim ** -0.5``).
        kwargs: the rest of what transformers passes, given to SDPA as it is; on a converted layer
            ``position_ids`` places a windowed kernel's sinks and a ``softcap`` is refused (ValueError).

    Returns:
        ``(output, None)``: the attention output ``[B, T, H, d_v]`` (HF's layout) and no attention weights."""
    for fn in list(_recorders()):
        fn(module, query, key, value, attention_mask, scaling)
    rf = getattr(module, "kernelmix_rf", None)
    if rf is not None and _exact_depth() > 0 and getattr(rf, "active_cache", None) is not None:
        # its window cache hands over only the new keys: exact attention sees them all only in a first call
        if rf.take_cache().seen <= key.shape[2]:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        raise KernelmixError("exact_attention() cannot continue a converted layer's window cache (it keeps the window "
                         "and the features, not every key): run the exact model with use_cache=False, or generate "
                         "outside exact_attention()")
    if rf is None or _exact_depth() > 0:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping is not supported by random-feature attention")
    if hasattr(rf, "attend_window"):  # the positions place a windowed kernel's sinks on its dense path
        return rf.attend(query, key, value, attention_mask, scaling, kwargs.get("position_ids")), None
    return rf.attend(query, key, value, attention_mask, scaling), None


def register() -> None:
    """Register the ``kernelmix`` attention function and its mask function (SDPA's) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kernelmix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# ---------------------------------------------------------------------------------------------
# Conversion


def decoder_layers(model) -> Sequence[nn.Module]:
    """The decoder layers of a Hugging Face Llama / Gemma causal LM, ``model.model.layers``.

    Args:
        model: a Hugging Face causal LM whose ``config.model_type`` is one of :data:`SUPPORTED_MODEL_TYPES`
            (another is a ValueError, as is a model without ``model.layers[*].self_attn``).

    Returns:
        ``model.model.layers``, each layer with a ``self_attn``."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)}; "
            "the Llama and Gemma families)"
        )
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"{type(model).__name__} is not a decoder-only causal LM with model.layers[*].self_attn")
    return layers


def is_local(attn: nn.Module) -> bool:
    """A sliding-window (local) attention layer?

    Args:
        attn: a decoder layer's ``self_attn`` module.

    Returns:
        True when ``attn.sliding_window`` is set (not None)."""
    return getattr(attn, "sliding_window", None) is not None



def residual_write(layer: nn.Module) -> Callable[[Tensor], Tensor]:
    """What a decoder layer adds to its residual stream, as a function of its attention output.

    Gemma 2 and 3 put a norm on each branch's output (their layers also have a
    ``pre_feedforward_layernorm``): there the write is ``post_attention_layernorm(o_proj(a))``, an
    RMSNorm per token, so a token whose attention output is small in norm has its error scaled up.
    Llama's ``post_attention_layernorm`` normalises the residual before the MLP instead, so its write
    is ``o_proj(a)`` alone.

    Args:
        layer: one of :func:`decoder_layers`' layers.

    Returns:
        A function of an attention output ``[B, T, H, d_v]`` (float32) returning the write ``[B, T,
        hidden]`` in float32; gradients flow to its input (the layer's own weights are the caller's
        to freeze)."""
    attn = layer.self_attn
    sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_attention_layernorm")

    def write(out: Tensor) -> Tensor:
        batch, length = out.shape[:2]
        projected = attn.o_proj(out.reshape(batch, length, -1).to(attn.o_proj.weight.dtype))
        return (layer.post_attention_layernorm(projected) if sandwich else projected).float()

    return write


def kernels(model) -> dict[int, nn.Module]:
    """Layer index → its attached kernel (:class:`~.layer_kernels.RandomFeatureKernel` or
    :class:`~.layer_kernels.CubitKernel`), converted layers only.

    Args:
        model: a Hugging Face causal LM, converted or not (see :func:`decoder_layers`).

    Returns:
        ``{layer index: self_attn.kernelmix_rf}`` in layer order (any kernel of :mod:`.layer_kernels`,
        Hedgehog and window-only ones too); empty for an unconverted model."""
    return {i: layer.self_attn.kernelmix_rf for i, layer in enumerate(decoder_layers(model))
            if getattr(layer.self_attn, "kernelmix_rf", None) is not None}
