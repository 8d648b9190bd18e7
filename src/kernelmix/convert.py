"""Convert a pretrained Hugging Face causal LM (Llama / Gemma families) to random-feature attention.

Mechanism: transformers' attention interface. :func:`convert` attaches a
:class:`RandomFeatureKernel` as ``self_attn.kernelmix_rf`` to each chosen layer and switches the
model to the attention implementation ``"kernelmix"``, registered here with
``AttentionInterface`` *and* ``AttentionMaskInterface`` (the mask function is transformers'
``sdpa_mask``; without it the sliding-window masks would silently disappear). Transformers still
computes everything up to the attention: q/k/v projections, QK-norm, RoPE, the KV cache; our
function replaces only softmax(q kᵀ·scaling) v, per layer: layers without a kernel (and every
layer inside :func:`exact_attention`) run transformers' SDPA unchanged.

The host's scaling is matched exactly: the op computes exp(q'·k/√d), so it is fed
q' = q·(scaling·√d), giving exp(scaling·q·k). Grouped key/value heads are expanded inside the op.

Masks. Without a mask (plain causal) the chunked linear-time op runs. A mask that is causal plus
left padding (HF ``generate`` with a padded batch) is turned into ``doc_start`` and also runs
chunked. Any other mask — sliding windows (Gemma local layers), packed sequences — runs a dense
O(T·L·m) path that applies the mask exactly, so a converted local layer keeps its window.

Decoding. Generation uses the host's KV cache; each new token recomputes random-feature attention
over the cached keys, O(t·m·d) per token (not the O(m·d) recurrent state of
``kernelmix.ops.random_features.random_feature_attention_step``; wiring that state into HF's cache
is future work).

Per-layer parameters live on the attention module, so ``save_pretrained`` saves them:
``kernelmix_rf.projection`` W ``[H, m, d]`` (buffer) and, for DARKFormer, ``kernelmix_rf.transform``
M ``[H, d, d]`` (parameter) and ``kernelmix_rf.query_fold`` F ``[H, d, d]`` (buffer). The conversion
settings are stored in ``config.kernelmix_conversion``; reload with :func:`load_converted`.

DARKFormer initialisations (:func:`initialise`): ``identity`` (exactly Performer), ``whiten``
(SPEC §5's function-preserving data-aware transform from calibration statistics) and ``distill``
(train M, optionally F, so each layer's attention output matches exact softmax attention on the
same q/k/v; host weights untouched). ``cubit`` is experimental (:class:`CubitKernel`): the keys
serve as Cubit's reference, λ and s are learned, global (unwindowed) layers only.

For finetuning later: :func:`set_trainable` freezes the host except q/k/v projections (and the
QK-norm scales) of converted layers and the DARKFormer transforms.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .layers.random_features import data_aware_transform
from .ops._common import expand_heads
from .ops.random_features import (
    _feature_logits,
    safe_ratio,
    gaussian_random_features,
    orthogonal_random_features,
    random_feature_attention,
)

ATTENTION_NAME = "kernelmix"
MIXERS = ("performer", "darkformer", "cubit")  # cubit: experimental (see CubitKernel)
LAYER_CHOICES = ("all", "global", "local")
INITS = ("identity", "whiten", "distill", "whiten+distill")
PROJECTIONS = ("orthogonal", "iid")
CONFIG_KEY = "kernelmix_conversion"
CONVERSION_VERSION = 1


@dataclass
class ConversionConfig:
    """What to convert and how.

    * ``mixer``: ``performer`` or ``darkformer``.
    * ``layers``: ``all``, ``global`` (non-windowed layers; local ones keep exact softmax within
      their window), ``local`` (sliding-window layers only) or a list of layer indices.
    * ``num_features``: m per head. ``projection``: ``orthogonal`` or ``iid``. ``seed``: the draw of W
      (one generator, layers in order).
    * ``chunk_size``: chunk of the linear-time op.
    * ``ridge``: the initial λ of an (experimental) ``cubit`` conversion; larger is closer to the host.
    """

    mixer: str = "darkformer"
    layers: Any = "all"
    num_features: int = 256
    projection: str = "orthogonal"
    seed: int = 0
    chunk_size: int = 64
    ridge: float = 4.0
    # filled in by convert(): the resolved layer indices and the initialisation used
    layer_indices: list = field(default_factory=list)
    init: str = "identity"
    version: int = CONVERSION_VERSION

    def validate(self) -> None:
        if self.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {self.mixer!r} for conversion (choose from: {', '.join(MIXERS)})")
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, (int, float)) or not (self.ridge > 0 and math.isfinite(self.ridge)):
            raise ValueError(f"ridge must be a positive number, got {self.ridge!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"unknown projection {self.projection!r} (choose from: {', '.join(PROJECTIONS)})")
        if isinstance(self.num_features, bool) or not isinstance(self.num_features, int) or self.num_features <= 0:
            raise ValueError(f"num_features must be a positive int, got {self.num_features!r}")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if isinstance(self.layers, str):
            if self.layers not in LAYER_CHOICES:
                raise ValueError(f"unknown layer selection {self.layers!r} (choose from: {', '.join(LAYER_CHOICES)}, or a list of indices)")
        elif not isinstance(self.layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.layers):
            raise ValueError(f"layers must be one of {LAYER_CHOICES} or a list of ints, got {self.layers!r}")
        if self.init not in INITS:
            raise ValueError(f"unknown init {self.init!r} (choose from: {', '.join(INITS)})")


# ---------------------------------------------------------------------------------------------
# Dense reference paths (any mask): used for windowed / irregular masks and by the diagnostics


def _visible_from_mask(mask: Tensor) -> Tensor:
    """An HF attention mask (bool: True = visible, or float additive) → bool ``[B, T, L]`` (heads share it)."""
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.dim() == 4:
        mask = mask[:, 0]
    return mask


def rf_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, visible: Tensor, *, transform: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Random-feature attention with an arbitrary mask, densely: ``q`` ``[B, T, H, d]`` (already in
    feature space: exp(q·k/√d) is the kernel), ``k``/``v`` ``[B, L, H_kv, d]``, ``visible`` bool
    ``[B, T, L]``. Returns ``(out [B, T, H, d_v], weights [B, H, T, L])``. Stabilised like the
    chunked op: per-query max over features, per-key max and a per-row shift (the max over the
    row's visible keys), so nothing overflows and rows stay exact ratios. Rows with no visible key
    give 0."""
    with torch.autocast(q.device.type, enabled=False):
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        heads = q.shape[2]
        proj = projection.to(dtype)
        m = None if transform is None else transform.to(dtype)
        ql = _feature_logits(q.to(dtype), proj, m)  # [B, T, H, m]
        kl = _feature_logits(expand_heads(k, heads).to(dtype), proj, m)  # [B, L, H, m]
        qf = torch.exp(ql - ql.detach().amax(-1, keepdim=True)).transpose(1, 2)  # [B, H, T, m]
        kmax = kl.detach().amax(-1).transpose(1, 2)  # [B, H, L]
        kf = torch.exp(kl.transpose(1, 2) - kmax[..., None])  # [B, H, L, m]
        vis = visible[:, None]  # [B, 1, T, L]
        row_shift = kmax[:, :, None, :].masked_fill(~vis, float("-inf")).amax(-1, keepdim=True)  # [B, H, T, 1]
        row_shift = torch.where(torch.isfinite(row_shift), row_shift, torch.zeros_like(row_shift))
        decay = torch.exp((kmax[:, :, None, :] - row_shift).masked_fill(~vis, float("-inf")))
        scores = (qf @ kf.transpose(-1, -2)) * decay
        weights = safe_ratio(scores, scores.sum(-1, keepdim=True))
        values = expand_heads(v, heads).to(dtype).transpose(1, 2)
        out = (weights @ values).transpose(1, 2)
    return out.to(v.dtype), weights


def softmax_attention_dense(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
    """Exact counterpart of :func:`rf_attention_dense`: weights ∝ exp(q·k/√d) over visible keys."""
    heads, d = q.shape[2], q.shape[3]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = torch.einsum("bthd,blhd->bhtl", q.to(dtype), expand_heads(k, heads).to(dtype)) / math.sqrt(d)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhtl,blhd->bthd", weights, expand_heads(v, heads).to(dtype))
    return out.to(v.dtype), weights


def _left_padding_doc_start(visible: Tensor, query_offset: int) -> Tensor | None:
    """If ``visible`` ``[B, T, L]`` is exactly causal (queries at absolute positions
    ``query_offset + i``) plus left padding, return ``doc_start`` ``[B, L]`` for the padded-q
    chunked op (padding tokens form their own leading document); else None."""
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
    return torch.where(cols[None, :] >= pad[:, None], pad[:, None], torch.zeros_like(pad)[:, None]).expand(batch, length_k)


# ---------------------------------------------------------------------------------------------
# The per-layer kernel module


class RandomFeatureKernel(nn.Module):
    """Random-feature attention parameters of one converted layer (attached as
    ``self_attn.kernelmix_rf``): buffer ``projection`` W ``[H, m, d]``; for DARKFormer parameter
    ``transform`` M ``[H, d, d]`` and buffer ``query_fold`` F ``[H, d, d]`` (both identity at first)."""

    def __init__(self, *, mixer: str, num_heads: int, num_kv_heads: int, head_dim: int, num_features: int,
                 projection: str = "orthogonal", chunk_size: int = 64, generator: torch.Generator | None = None):
        super().__init__()
        self.mixer, self.num_heads, self.num_kv_heads, self.head_dim = mixer, num_heads, num_kv_heads, head_dim
        self.num_features, self.projection_kind, self.chunk_size = num_features, projection, chunk_size
        self.register_buffer("projection", self._draw(generator, num_features), persistent=True)
        if mixer == "darkformer":
            eye = torch.eye(head_dim).expand(num_heads, -1, -1).clone()
            self.transform = nn.Parameter(eye.clone())
            self.register_buffer("query_fold", eye, persistent=True)
        else:
            self.transform = None
            self.query_fold = None

    def extra_repr(self) -> str:
        return (f"mixer={self.mixer!r}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_features={self.num_features}, projection={self.projection_kind!r}")

    def trainable(self) -> list[nn.Parameter]:
        """The kernel's own finetunable parameters: M for DARKFormer, none for Performer (W is fixed)."""
        return [] if self.transform is None else [self.transform]

    def _draw(self, generator, num_features: int) -> Tensor:
        draw = orthogonal_random_features if self.projection_kind == "orthogonal" else gaussian_random_features
        return draw(num_features, self.head_dim, num_heads=self.num_heads, generator=generator)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None, num_features: int | None = None) -> Tensor:
        """Draw a new W (optionally with another m) in place of the old one; caches become stale."""
        m = self.num_features if num_features is None else int(num_features)
        new = self._draw(generator, m).to(device=self.projection.device)
        self.num_features = m
        self.projection = new  # replaces the registered buffer (its shape may change)
        return self.projection

    def feature_queries(self, query: Tensor, scaling: float | None, fold: Tensor | None = None) -> Tensor:
        """HF query ``[B, H, T, d]`` → the op's queries ``[B, T, H, d]``: q·(scaling·√d), then F q for
        DARKFormer (``fold`` overrides the buffer, e.g. while training it)."""
        scaling = self.head_dim**-0.5 if scaling is None else scaling
        q = query.transpose(1, 2) * (scaling * math.sqrt(self.head_dim))
        fold = self.query_fold if fold is None else fold
        if fold is not None:
            dtype = torch.promote_types(q.dtype, torch.float32)
            q = torch.einsum("hij,bthj->bthi", fold.to(dtype), q.to(dtype))
        return q

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None,
               *, transform: Tensor | None = None, fold: Tensor | None = None) -> Tensor:
        """Random-feature attention on HF tensors (``query`` ``[B, H, T, d]``, ``key``/``value``
        ``[B, H_kv, L, d]``, HF mask or None) → ``[B, T, H, d_v]`` (HF's attention output layout)."""
        q = self.feature_queries(query, scaling, fold)
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        transform = self.transform if transform is None else transform
        length_q, length_k = q.shape[1], k.shape[1]
        if attention_mask is None:
            if length_q == length_k:
                return self._chunked(q, k, v, transform, None)
            if length_q > 1:  # SDPA's upper-left causal convention (prefill into an empty static cache)
                return self._chunked(q, k[:, :length_q], v[:, :length_q], transform, None)
            # decode: the new token sees every cached key
            return self._chunked(self._pad_queries(q, length_k), k, v, transform, None)[:, -1:]
        visible = _visible_from_mask(attention_mask)
        if visible.shape[0] != q.shape[0]:
            visible = visible.expand(q.shape[0], -1, -1)
        doc_start = _left_padding_doc_start(visible, length_k - length_q)
        if doc_start is not None:
            q_full = self._pad_queries(q, length_k) if length_k > length_q else q
            return self._chunked(q_full, k, v, transform, doc_start)[:, length_k - length_q:]
        out, _ = rf_attention_dense(q, k, v, self.projection, visible, transform=transform)
        return out

    @staticmethod
    def _pad_queries(q: Tensor, length: int) -> Tensor:
        pad = q.new_zeros(q.shape[0], length - q.shape[1], *q.shape[2:])
        return torch.cat([pad, q], dim=1)

    def _chunked(self, q, k, v, transform, doc_start) -> Tensor:
        out = random_feature_attention(q, k, v, self.projection, transform=transform, chunk_size=self.chunk_size, doc_start=doc_start)
        return out.to(v.dtype)

    @torch.no_grad()
    def whiten_(self, q_samples: Tensor, k_samples: Tensor, eps: float = 1e-3) -> None:
        """SPEC §5 data-aware initialisation from feature-space query samples ``[N, H, d]`` (q·scaling·√d,
        before the fold) and key samples ``[N, H_kv, d]``: M = S^{1/2}, F = S⁻¹; the kernel is unchanged."""
        if self.mixer != "darkformer":
            raise ValueError("whitening needs a darkformer layer (Performer has no transform)")
        m, fold = data_aware_transform(q_samples, k_samples, eps)
        self.transform.copy_(m.to(self.transform))
        self.query_fold.copy_(fold.to(self.query_fold))


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
        from .ops.cubit import cubit_attention

        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        length_q, length_k = q.shape[1], k.shape[1]
        doc_start = None
        if attention_mask is not None:
            visible = _visible_from_mask(attention_mask)
            if visible.shape[0] != q.shape[0]:
                visible = visible.expand(q.shape[0], -1, -1)
            doc_start = _left_padding_doc_start(visible, length_k - length_q)
            if doc_start is None:
                raise ValueError("the cubit conversion supports causal masks with left padding only (no sliding windows "
                                 "or packed sequences); convert the global layers only (layers='global')")
        elif length_q > 1 and length_q < length_k:  # SDPA's upper-left convention (prefill into a static cache)
            k, v, length_k = k[:, :length_q], v[:, :length_q], length_q
        if length_k > length_q:  # decoding: queries at the end of the cached keys
            q = RandomFeatureKernel._pad_queries(q, length_k)
        dtype = torch.promote_types(q.dtype, torch.float32)
        ridge = self.log_ridge.exp()
        reference = expand_heads(k, self.num_heads)
        out = cubit_attention(q.to(dtype), k.to(dtype), v.to(dtype), reference.to(dtype), ridge=ridge,
                              ref_scale=self.log_ref_scale.exp(), scale=scaling, chunk_size=self.chunk_size,
                              doc_start=doc_start)
        out = out * (1.0 + ridge)[:, None].to(out.dtype)
        return out[:, length_k - length_q:].to(v.dtype)


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
    (HF layouts) of models running the ``kernelmix`` implementation."""
    _recorders().append(fn)
    try:
        yield
    finally:
        _recorders().remove(fn)


def kernelmix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``kernelmix`` attention function: random-feature attention on layers with a kernel,
    transformers' SDPA on the others (and everywhere inside :func:`exact_attention`)."""
    for fn in list(_recorders()):
        fn(module, query, key, value, attention_mask, scaling)
    rf = getattr(module, "kernelmix_rf", None)
    if rf is None or _exact_depth() > 0:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping is not supported by random-feature attention")
    return rf.attend(query, key, value, attention_mask, scaling), None


def register() -> None:
    """Register the ``kernelmix`` attention function and its mask function (SDPA's) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kernelmix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# ---------------------------------------------------------------------------------------------
# Conversion


def _decoder_layers(model) -> Sequence[nn.Module]:
    from .pretrained import SUPPORTED_MODEL_TYPES

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
    """A sliding-window (local) attention layer?"""
    return getattr(attn, "sliding_window", None) is not None


def resolve_layers(model, layers: Any) -> list[int]:
    """``all`` / ``global`` / ``local`` / indices → sorted list of layer indices (ValueError when empty or out of range)."""
    decoder = _decoder_layers(model)
    n = len(decoder)
    if isinstance(layers, str):
        if layers not in LAYER_CHOICES:
            raise ValueError(f"unknown layer selection {layers!r} (choose from: {', '.join(LAYER_CHOICES)}, or a list of indices)")
        picked = [i for i, layer in enumerate(decoder)
                  if layers == "all" or (layers == "local") == is_local(layer.self_attn)]
        if not picked:
            raise ValueError(f"the model has no {layers} attention layers to convert")
        return picked
    indices = list(layers)
    if not indices:
        raise ValueError("empty layer list: choose at least one layer to convert")
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"layer indices must be ints, got {i!r}")
        if not -n <= i < n:
            raise ValueError(f"layer index {i} out of range: the model has {n} layers (0..{n - 1})")
    return sorted({i % n for i in indices})


def convert(model, config: ConversionConfig | None = None, *, calibration: Tensor | None = None,
            init: str = "identity", attention_mask: Tensor | None = None, progress: bool = False,
            **init_options) -> nn.Module:
    """Convert ``model`` in place (and return it): the chosen layers get a
    :class:`RandomFeatureKernel` and the model runs the ``kernelmix`` attention implementation.

    The host's parameters are untouched. ``init`` (DARKFormer): ``identity``, ``whiten``,
    ``distill`` or ``whiten+distill``, the last three from ``calibration`` token ids ``[B, T]``
    (``attention_mask`` optional); ``init_options`` go to :func:`initialise`."""
    config = ConversionConfig() if config is None else config
    config.init = init
    config.validate()
    if hasattr(model.config, CONFIG_KEY) and any(hasattr(l.self_attn, "kernelmix_rf") for l in _decoder_layers(model)):
        raise ValueError("the model is already converted; load the original to convert it again")
    indices = resolve_layers(model, config.layers)
    config.layer_indices = indices
    _attach(model, config)
    if init != "identity":
        initialise(model, init, calibration, attention_mask=attention_mask, progress=progress, **init_options)
    return model


def _attach(model, config: ConversionConfig) -> None:
    register()
    decoder = _decoder_layers(model)
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
        else:
            kernel = RandomFeatureKernel(mixer=config.mixer, num_heads=heads, num_kv_heads=kv_heads, head_dim=attn.head_dim,
                                         num_features=config.num_features, projection=config.projection,
                                         chunk_size=config.chunk_size, generator=generator)
        attn.kernelmix_rf = kernel.to(device=param.device)  # float32 whatever the host dtype
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # sub-configs (some models keep their own) follow
        sub_cfg = getattr(sub, "config", None)
        if sub_cfg is not None and sub_cfg is not cfg and hasattr(sub_cfg, "_attn_implementation"):
            sub_cfg._attn_implementation = ATTENTION_NAME
    setattr(model.config, CONFIG_KEY, {k: v for k, v in asdict(config).items()})


def conversion_config(model) -> ConversionConfig | None:
    raw = getattr(model.config, CONFIG_KEY, None)
    return None if raw is None else ConversionConfig(**raw)


def kernels(model) -> dict[int, "RandomFeatureKernel | CubitKernel"]:
    """Layer index → its :class:`RandomFeatureKernel` / :class:`CubitKernel` (converted layers only)."""
    return {i: layer.self_attn.kernelmix_rf for i, layer in enumerate(_decoder_layers(model))
            if getattr(layer.self_attn, "kernelmix_rf", None) is not None}


def set_num_features(model, num_features: int, seed: int = 0) -> None:
    """Redraw every converted layer's W with ``num_features`` rows (M and F are kept)."""
    generator = torch.Generator().manual_seed(seed)
    for kernel in kernels(model).values():
        if kernel.mixer == "cubit":
            raise ValueError("a cubit conversion has no random features to redraw")
        kernel.redraw(generator, num_features)
    raw = getattr(model.config, CONFIG_KEY)
    raw.update(num_features=int(num_features), seed=int(seed))


# ---------------------------------------------------------------------------------------------
# Calibration, whitening, distillation


@dataclass
class Captured:
    """One layer's attention inputs on calibration text (HF layouts) and its scaling."""

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    scaling: float


@torch.no_grad()
def capture(model, input_ids: Tensor, attention_mask: Tensor | None = None, layers: Iterable[int] | None = None,
            batch_size: int = 1) -> dict[int, list[Captured]]:
    """Run the *original* model (exact attention) on ``input_ids`` ``[B, T]`` and return the
    attention inputs of ``layers`` (default: the converted ones), one :class:`Captured` per batch."""
    register()
    wanted = set(kernels(model) if layers is None else layers)
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(_decoder_layers(model))}
    out: dict[int, list[Captured]] = {i: [] for i in wanted}

    def hook(module, query, key, value, mask, scaling):
        i = layer_of.get(id(module))
        if i in wanted:
            out[i].append(Captured(query.detach(), key.detach(), value.detach(),
                                   None if mask is None else mask.detach(), float(scaling if scaling is not None else module.head_dim**-0.5)))

    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION_NAME
    try:
        with exact_attention(), record_attention(hook):
            for b0 in range(0, input_ids.shape[0], batch_size):
                am = None if attention_mask is None else attention_mask[b0:b0 + batch_size]
                model(input_ids=input_ids[b0:b0 + batch_size], attention_mask=am, use_cache=False)
    finally:
        model.config._attn_implementation = previous
    return out


def _token_samples(items: list[Captured], kernel: RandomFeatureKernel) -> tuple[Tensor, Tensor]:
    """Feature-space query samples ``[N, H, d]`` (before the fold) and key samples ``[N, H_kv, d]``."""
    qs, ks = [], []
    for c in items:
        scale = c.scaling * math.sqrt(kernel.head_dim)
        qs.append((c.query.transpose(1, 2) * scale).reshape(-1, c.query.shape[1], c.query.shape[3]).float())
        ks.append(c.key.transpose(1, 2).reshape(-1, c.key.shape[1], c.key.shape[3]).float())
    return torch.cat(qs), torch.cat(ks)


def whiten(model, captured: dict[int, list[Captured]], eps: float = 1e-3) -> None:
    """Set every DARKFormer layer's M, F from captured statistics (SPEC §5; kernel preserved)."""
    for i, kernel in kernels(model).items():
        if kernel.mixer == "darkformer":
            q, k = _token_samples(captured[i], kernel)
            kernel.whiten_(q, k, eps)


def exact_output(c: Captured) -> Tensor:
    """Exact softmax attention on captured inputs, ``[B, T, H, d_v]`` (host semantics incl. mask)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = c.query.shape[1] // c.key.shape[1]
    mask = c.mask
    if mask is not None and mask.dtype == torch.bool:
        pass
    out = torch.nn.functional.scaled_dot_product_attention(
        c.query, repeat_kv(c.key, groups), repeat_kv(c.value, groups), attn_mask=mask,
        is_causal=mask is None, scale=c.scaling)
    return out.transpose(1, 2)


def distill(model, captured: dict[int, list[Captured]], *, steps: int = 200, lr: float = 5e-3,
            train_fold: bool = False, redraw: bool = True, seed: int = 0, progress: bool = False,
            log: Callable | None = None) -> dict[int, list[float]]:
    """Per-layer attention-output distillation: train each DARKFormer layer's M (and F when
    ``train_fold``) with Adam to minimise ‖RF(q, k, v) − softmax(q, k, v)‖² / ‖softmax‖² on the
    captured calibration inputs (teacher under no-grad; host weights untouched).

    ``redraw`` (default): a fresh W every step (seeded by ``seed``), so M is fitted to the
    estimator in expectation over W — with one fixed W, M overfits that draw and a fresh W (any
    other m or seed) does worse than the whitened start (measured on Gemma 3 270M). The layer's
    own W is restored afterwards. With redraws the per-step loss is noisy, so the final M is kept
    (non-finite steps are still undone); with a fixed W the lowest-loss M is kept.
    Returns the loss history per layer."""
    history: dict[int, list[float]] = {}
    todo = [(i, k) for i, k in kernels(model).items() if k.mixer == "darkformer"]
    bar = _progress(progress, "distill", len(todo) * steps)
    for i, kernel in todo:
        items = captured[i]
        with torch.no_grad():
            teachers = [exact_output(c).float() for c in items]
            norms = [t.pow(2).mean() for t in teachers]
        transform = nn.Parameter(kernel.transform.detach().float().clone())
        params = [transform]
        fold = None
        if train_fold:
            fold = nn.Parameter(kernel.query_fold.detach().float().clone())
            params.append(fold)
        opt = torch.optim.Adam(params, lr=lr)
        losses = []
        # Guard against blow-ups (real models give the estimator a huge variance): clip the
        # gradient, undo a step whose loss or parameters are not finite (and halve the rate),
        # and (fixed W only) keep the parameters with the lowest loss seen.
        best = (float("inf"), [p.detach().clone() for p in params])
        last_good = [p.detach().clone() for p in params]
        own_projection = kernel.projection
        generator = torch.Generator().manual_seed(seed * 1000003 + i)
        for step in range(steps):
            if redraw:
                kernel.projection = kernel._draw(generator, kernel.num_features).to(own_projection)
            c = items[step % len(items)]
            t = teachers[step % len(items)]
            out = kernel.attend(c.query.float(), c.key.float(), c.value.float(), c.mask, c.scaling, transform=transform, fold=fold)
            loss = (out.float() - t).pow(2).mean() / norms[step % len(items)]
            value = float(loss.detach())
            if not math.isfinite(value):
                with torch.no_grad():
                    for p, b in zip(params, last_good if redraw else best[1]):
                        p.copy_(b)
                for group in opt.param_groups:
                    group["lr"] *= 0.5
                opt.state.clear()
                losses.append(value)
                bar.advance()
                continue
            if value < best[0]:
                best = (value, [p.detach().clone() for p in params])
            last_good = [p.detach().clone() for p in params]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(value)
            bar.advance()
            if log is not None and (step % 50 == 0 or step == steps - 1):
                log(f"layer {i} step {step}: relative MSE {value:.4g} (best {best[0]:.4g})")
        kernel.projection = own_projection
        with torch.no_grad():
            if not redraw or not all(bool(torch.isfinite(p).all()) for p in params):
                for p, b in zip(params, last_good if redraw else best[1]):
                    p.copy_(b)
            kernel.transform.copy_(transform.to(kernel.transform))
            if fold is not None:
                kernel.query_fold.copy_(fold.to(kernel.query_fold))
        history[i] = losses
    bar.close()
    return history


def initialise(model, init: str, calibration: Tensor | None, *, attention_mask: Tensor | None = None,
               eps: float = 1e-3, steps: int = 200, lr: float = 5e-3, train_fold: bool = False,
               batch_size: int = 1, progress: bool = False, log: Callable | None = None) -> dict:
    """(Re-)initialise the DARKFormer layers of a converted model: ``identity``, ``whiten``,
    ``distill`` or ``whiten+distill`` from ``calibration`` token ids ``[B, T]``. Returns
    ``{"distill": {layer: losses}}`` when distilling."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r} (choose from: {', '.join(INITS)})")
    ks = kernels(model)
    if not ks:
        raise ValueError("the model is not converted (no kernelmix_rf layers); call convert() first")
    result: dict = {}
    with torch.no_grad():
        for k in ks.values():
            if k.mixer == "darkformer":
                eye = torch.eye(k.head_dim, device=k.transform.device).expand_as(k.transform)
                k.transform.copy_(eye)
                k.query_fold.copy_(eye)
    if init != "identity":
        if calibration is None:
            raise ValueError(f"init={init!r} needs calibration token ids [B, T]")
        if any(k.mixer != "darkformer" for k in ks.values()):
            raise ValueError(f"init={init!r} applies to darkformer conversions; performer has no transform")
        captured = capture(model, calibration, attention_mask, batch_size=batch_size)
        if init.startswith("whiten"):
            whiten(model, captured, eps)
        if init.endswith("distill"):
            result["distill"] = distill(model, captured, steps=steps, lr=lr, train_fold=train_fold, progress=progress, log=log)
    raw = getattr(model.config, CONFIG_KEY)
    raw["init"] = init
    return result


def set_trainable(model, *, qkv: bool = True, transform: bool = True, norms: bool = True,
                  layers: Iterable[int] | None = None) -> list[nn.Parameter]:
    """Freeze the host except, in ``layers`` (default: the converted ones), the q/k/v projections,
    the QK-norm scales and the kernels' own parameters (DARKFormer's M, Cubit's λ and s; ``transform``);
    returns the trainable parameters (for a finetuning optimizer). Unconverted layers may be listed
    too (a softmax baseline finetuned the same way)."""
    for p in model.parameters():
        p.requires_grad_(False)
    decoder = _decoder_layers(model)
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


# ---------------------------------------------------------------------------------------------
# Save / load


def save_converted(model, directory: str | Path, tokenizer=None) -> Path:
    """``save_pretrained`` (safetensors; W, M, F included; settings in config.json) plus the tokenizer."""
    directory = Path(directory)
    if conversion_config(model) is None:
        raise ValueError("the model is not converted; use model.save_pretrained for a plain model")
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


def load_converted(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: Any = None):
    """Load a model saved by :func:`save_converted` (or any plain local causal LM, returned
    unconverted): the host loads with ``from_pretrained``, the conversion recorded in
    ``config.json`` is re-applied and the kernels' W/M/F are loaded from the safetensors files
    (a missing one is an error)."""
    import os

    from .pretrained import check_model_dir, require

    require("transformers", "safetensors")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = Path(directory)
    raw_config = check_model_dir(directory)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    conversion = raw_config.get(CONFIG_KEY)
    verbosity = hf_logging.get_verbosity()
    if conversion is not None:
        hf_logging.set_verbosity_error()  # the kernel tensors are "unexpected" to the host class
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if device is not None:
        model = model.to(device)
    if conversion is None:
        return model
    config = ConversionConfig(**conversion)
    config.validate()
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    _attach(model, config)
    state = _read_kernel_tensors(directory)
    expected = {name for name, _ in _kernel_tensors(model)}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{directory} lacks {len(missing)} converted-layer tensors (e.g. {missing[0]}); was it saved with save_converted?")
    own = dict(_kernel_tensors(model))
    with torch.no_grad():
        for name in expected:
            target = own[name]
            if target.shape != state[name].shape:
                # W may have been redrawn with another m before saving
                owner_name, attr = name.rsplit(".", 1)
                owner = model.get_submodule(owner_name)
                if attr == "projection":
                    owner.projection = state[name].to(device=target.device, dtype=target.dtype)
                    owner.num_features = state[name].shape[1]
                    continue
                raise ValueError(f"{name}: saved shape {tuple(state[name].shape)} does not fit {tuple(target.shape)}")
            target.copy_(state[name].to(target))
    return model


def _kernel_tensors(model):
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".kernelmix_rf." in name:
            yield name, t


def _read_kernel_tensors(directory: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    state = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no .safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if ".kernelmix_rf." in key:
                    state[key] = fh.get_tensor(key)
    return state


# ---------------------------------------------------------------------------------------------


class _NoBar:
    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, label: str, total: int):
        from rich.progress import Progress

        self._progress = Progress(transient=True)
        self._progress.start()
        self._task = self._progress.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()


def _progress(enabled: bool, label: str, total: int):
    return _RichBar(label, total) if enabled else _NoBar()


__all__ = [
    "ATTENTION_NAME",
    "Captured",
    "ConversionConfig",
    "CubitKernel",
    "RandomFeatureKernel",
    "capture",
    "conversion_config",
    "convert",
    "distill",
    "exact_attention",
    "exact_output",
    "initialise",
    "kernels",
    "load_converted",
    "record_attention",
    "register",
    "resolve_layers",
    "rf_attention_dense",
    "save_converted",
    "set_num_features",
    "set_trainable",
    "softmax_attention_dense",
    "whiten",
]


# ---------------------------------------------------------------------------------------------
# CLI: kernelmix convert


def parse_layers(text: str):
    """``all`` / ``global`` / ``local`` / ``0,5,11`` → the ``layers`` of :class:`ConversionConfig`."""
    if text in LAYER_CHOICES:
        return text
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--layers takes {', '.join(LAYER_CHOICES)} or comma-separated indices, got {text!r}") from None


def _cli_convert(args) -> int:
    import sys

    from .pretrained import load_pretrained

    try:
        config = ConversionConfig(mixer=args.mixer, layers=parse_layers(args.layers), num_features=args.num_features,
                                  projection=args.projection, seed=args.seed, chunk_size=args.chunk_size, ridge=args.ridge)
        config.init = args.init
        config.validate()
        model, tok = load_pretrained(args.model)
        calibration = None
        if args.init != "identity":
            from .data.corpus import load_corpus
            from .diagnose import _tokens

            if tok is None:
                raise ValueError(f"init={args.init!r} needs the model's tokenizer in {args.model}")
            docs = [d.text for d in load_corpus(args.calib_text).documents()]
            calibration = _tokens(tok, docs, args.seq_len, args.calib_seqs)
        convert(model, config, calibration=calibration, init=args.init, steps=args.steps, progress=True,
                log=lambda msg: print(f"  {msg}", flush=True))
        save_converted(model, args.out, tok)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted layers {config.layer_indices} to {config.mixer} (m={config.num_features}, init={args.init}); "
          f"saved to {args.out} — reload with kernelmix.convert.load_converted({str(args.out)!r})")
    return 0


def add_commands(sub) -> None:
    """Register ``kernelmix convert``."""
    p = sub.add_parser("convert", help="convert a pretrained causal LM (prepared name or HF dir) to random-feature attention")
    p.add_argument("model", help="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")
    p.add_argument("--out", required=True, help="directory for the converted model (save_pretrained + tokenizer)")
    p.add_argument("--mixer", choices=MIXERS, default="darkformer")
    p.add_argument("--layers", default="all", help="all | global | local | comma-separated indices")
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--projection", choices=PROJECTIONS, default="orthogonal")
    p.add_argument("--init", choices=INITS, default="identity")
    p.add_argument("--calib-text", default="shakespeare", help="corpus for whiten/distill (name, dir, glob or file)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="distillation steps per layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--ridge", type=float, default=4.0, help="cubit (experimental): initial ridge λ")
    p.set_defaults(func=_cli_convert)
