"""Saving and loading converted models, and loading any prepared or local host.

A converted model is saved with ``save_pretrained`` (safetensors: the host's weights and the
kernels' W, M, F; the conversion settings in ``config.json`` under ``kernelmix_conversion``).
:func:`load_converted` loads the host with ``from_pretrained`` and re-applies the conversion;
loading never executes code from the directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .convert import CONFIG_KEY, ConversionConfig, attach_kernels, conversion_config
from .hosts import check_model_dir, require, resolve



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
    attach_kernels(model, config)
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


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
):
    """Load ``(model, tokenizer)`` (tokenizer None when ``tokenizer=False`` or absent) from a prepared
    name or a local directory, offline. A directory saved by :func:`save_converted`
    is loaded converted (see :func:`load_converted`)."""
    require("transformers", "safetensors")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve(name_or_path, root=root)
    from transformers import AutoTokenizer

    model = load_converted(path, dtype=dtype)
    tok = None
    if tokenizer and any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


__all__ = ["load_converted", "load_pretrained", "save_converted"]
