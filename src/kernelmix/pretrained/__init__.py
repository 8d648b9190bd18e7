"""Real pretrained causal LMs (Llama and Gemma families), offline, and their conversion to
kernelmix's mixers.

- :mod:`.hosts` — prepared models: GGUF files shipped in PyPI packages → safetensors
  (:func:`prepare`), :func:`resolve`, :func:`check_model_dir`.
- :mod:`.attention` — the ``kernelmix`` attention implementation registered with transformers,
  exact mode (:func:`exact_attention`), recorders, masks.
- :mod:`.layer_kernels` — the per-layer kernels a conversion attaches (:class:`RandomFeatureKernel`,
  :class:`CubitKernel`).
- :mod:`.calibration` — capture the host's attention inputs, whiten, distill.
- :mod:`.convert` — :class:`ConversionConfig`, :func:`convert`, :func:`initialise`, :func:`set_trainable`.
- :mod:`.load` — :func:`save_converted`, :func:`load_converted`, :func:`load_pretrained`.
- :mod:`.finetune` — :func:`finetune` a host or a converted model on token windows.

Needs the ``pretrained`` extra: ``pip install "kernelmix[pretrained]"``. Nothing is downloaded.
"""

from .attention import (
    ATTENTION_NAME,
    decoder_layers,
    exact_attention,
    is_local,
    kernelmix_attention,
    kernels,
    left_padding_doc_start,
    record_attention,
    register,
    visible_from_mask,
)
from .calibration import Captured, capture, distill, exact_output, token_samples, whiten
from .convert import (
    CONFIG_KEY,
    INITS,
    LAYER_CHOICES,
    MIXERS,
    PROJECTIONS,
    ConversionConfig,
    attach_kernels,
    conversion_config,
    convert,
    initialise,
    resolve_layers,
    set_num_features,
    set_trainable,
)
from .finetune import MODES, FinetuneConfig, finetune, finished_model, prepare_trainable
from .hosts import KNOWN_MODELS, PRETRAINED_EXTRA, SUPPORTED_MODEL_TYPES, KnownModel, cache_dir, check_model_dir, prepare, require, resolve
from .layer_kernels import CubitKernel, RandomFeatureKernel, pad_queries_left
from .load import load_converted, load_pretrained, save_converted

__all__ = [
    "ATTENTION_NAME", "CONFIG_KEY", "INITS", "KNOWN_MODELS", "LAYER_CHOICES", "MIXERS", "MODES", "PRETRAINED_EXTRA",
    "PROJECTIONS", "SUPPORTED_MODEL_TYPES", "Captured", "ConversionConfig", "CubitKernel", "FinetuneConfig", "KnownModel",
    "RandomFeatureKernel", "attach_kernels", "cache_dir", "capture", "check_model_dir", "conversion_config", "convert",
    "decoder_layers", "distill", "exact_attention", "exact_output", "finetune", "finished_model", "initialise", "is_local",
    "kernelmix_attention", "kernels", "left_padding_doc_start", "load_converted", "load_pretrained", "pad_queries_left",
    "prepare", "prepare_trainable", "record_attention", "register", "require", "resolve", "resolve_layers",
    "save_converted", "set_num_features", "set_trainable", "token_samples",
    "visible_from_mask", "whiten",
]
