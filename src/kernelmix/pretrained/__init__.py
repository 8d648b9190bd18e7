"""Real pretrained causal LMs (Llama and Gemma families), offline, and their conversion to
kernelmix's mixers.

- :mod:`.settings` — the configs and the names they choose from (:class:`ConversionConfig`,
  :class:`FinetuneConfig`, :data:`KNOWN_MODELS`, ...): no torch, what the command line reads.
- :mod:`.hosts` — prepared models: GGUF files shipped in PyPI packages → safetensors
  (:func:`prepare`), :func:`resolve`, :func:`check_model_dir`.
- :mod:`.attention` — the ``kernelmix`` attention implementation registered with transformers,
  exact mode (:func:`exact_attention`), recorders, masks.
- :mod:`.layer_kernels` — the per-layer kernels a conversion attaches (:class:`RandomFeatureKernel`,
  :class:`CubitKernel`).
- :mod:`.calibration` — capture the host's attention inputs, whiten, distill.
- :mod:`.convert` — :func:`convert`, :func:`initialise`, :func:`set_trainable`.
- :mod:`.load` — :func:`save_converted`, :func:`load_converted`, :func:`load_pretrained`.
- :mod:`.finetune` — :func:`finetune` a host or a converted model on token windows.

Needs the ``pretrained`` extra: ``pip install "kernelmix[pretrained]"``. Nothing is downloaded.
Every name is importable from ``kernelmix.pretrained`` as before; a submodule is imported when one
of its names is first used (``convert`` and ``finetune`` stay the functions, not the submodules).
"""

from __future__ import annotations

from ..lazy import lazy_names

MODULES = {
    "settings": ["CONFIG_KEY", "INITS", "KNOWN_MODELS", "LAYER_CHOICES", "MIXERS", "MODES", "PROJECTIONS",
                 "ConversionConfig", "FinetuneConfig", "KnownModel", "cache_dir"],
    "attention": ["ATTENTION_NAME", "decoder_layers", "exact_attention", "is_local", "kernelmix_attention", "kernels",
                  "left_padding_doc_start", "record_attention", "register", "visible_from_mask"],
    "calibration": ["Captured", "capture", "distill", "exact_output", "token_samples", "whiten"],
    "convert": ["attach_kernels", "conversion_config", "convert", "initialise", "resolve_layers", "set_num_features",
                "set_trainable"],
    "finetune": ["finetune", "finished_model", "prepare_trainable"],
    "hosts": ["PRETRAINED_EXTRA", "SUPPORTED_MODEL_TYPES", "check_model_dir", "prepare", "require", "resolve"],
    "layer_kernels": ["CubitKernel", "RandomFeatureKernel", "pad_queries_left"],
    "load": ["load_converted", "load_pretrained", "save_converted"],
}
__getattr__, __dir__ = lazy_names(__name__, MODULES, keep=["convert", "finetune"])
__all__ = sorted(name for names in MODULES.values() for name in names)
