"""Saving and loading converted models, and loading any prepared or local host.

A converted model is saved with ``save_pretrained`` (safetensors: the host's weights and the
kernels' W, M, F; the conversion settings in ``config.json`` under ``kernelmix_conversion``).
:func:`load_converted` loads the host with ``from_pretrained`` and re-applies the conversion;
loading never executes code from the directory (safetensors only: a pickled ``.bin`` is refused).

Saving is all or nothing: the files are written into a hidden staging folder inside the target,
under the target's run-directory lock, and moved into place only when every one is complete —
``config.json`` last, since a directory without it is no model at all. A full disk or a
permission problem therefore leaves no directory that looks like a model, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import oserror
from ..errors import KernelmixError
from ..locks import HOLDER_NAME, LOCK_NAME, run_directory_lock
from .convert import CONFIG_KEY, ConversionConfig, attach_kernels, conversion_config, legacy_defaults
from .hosts import check_model_dir, require, resolve

STAGING_PREFIX = ".kernelmix-partial-"
# files of a previous save that a new one replaces even when it does not write them itself (fewer shards)
_STALE_SUFFIXES = (".safetensors",)
_STALE_NAMES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def directory_entries(directory: str | Path) -> list[str]:
    """What ``directory`` holds besides kernelmix's own lock files and staging folders (sorted names)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    ours = (LOCK_NAME, HOLDER_NAME)
    return sorted(p.name for p in directory.iterdir() if p.name not in ours and not p.name.startswith(STAGING_PREFIX))


def save_converted(model, directory: str | Path, tokenizer=None, *, overwrite: bool = True) -> Path:
    """``save_pretrained`` (safetensors; W, M, F included; settings in config.json) plus the tokenizer,
    written all or nothing under ``directory``'s run-directory lock (see the module's notes).
    Raises :class:`~kernelmix.errors.KernelmixError` for a ``directory`` that is a file, a non-empty one
    without ``overwrite``, another writer, a full disk or a permission problem.

    Args:
        model: a converted model (:func:`convert`); a plain one is refused.
        directory: where to save (created if needed).
        tokenizer: saved beside the model when given (None: none).
        overwrite: replace the model files of a directory that already holds some; ``overwrite=False``
            refuses a directory that already holds anything.

    Returns:
        ``directory``, as a Path."""
    directory = Path(directory)
    if conversion_config(model) is None:
        raise KernelmixError("the model is not converted; use model.save_pretrained for a plain model")
    if directory.exists() and not directory.is_dir():
        raise KernelmixError(f"{directory} is a file, not a directory: choose a directory to save the converted model "
                             "in (it is created if needed)")
    try:
        with run_directory_lock(directory, "save_converted"):
            existing = directory_entries(directory)
            if existing and not overwrite:
                raise KernelmixError(
                    f"{directory} is not empty ({', '.join(existing[:5])}{', ...' if len(existing) > 5 else ''}): "
                    "choose a new directory, or pass --overwrite to replace the model files in it")
            _save_staged(model, directory, tokenizer)
    except OSError as error:
        raise KernelmixError(f"could not save the converted model to {directory}: "
                             f"{oserror.describe(error, path=directory)} (the partly written files were removed; "
                             "no new model is there)") from error
    return directory


def _save_staged(model, directory: Path, tokenizer) -> None:
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
    try:
        try:
            model.save_pretrained(str(staging))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staging))
        except Exception as error:  # safetensors reports a full disk as its own error type
            inner = oserror.from_safetensors(error)
            if inner is None:
                raise
            raise inner from error
        written = sorted(p.name for p in staging.iterdir())
        if "config.json" not in written:  # transformers logs some refusals instead of raising: never claim a save
            raise KernelmixError(f"saving to {directory} wrote no config.json (only: "
                                 f"{', '.join(written) or 'nothing'}); see transformers' messages above")
        _publish(staging, directory, written)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, directory: Path, written: list[str]) -> None:
    """Move the complete files of ``staging`` into ``directory``: first take away the old config.json (an
    interrupted move then leaves no directory that loads as a mix of two models), then the stale weights of
    a previous save, then the new files, config.json last. Renames within one file system need no space."""
    for name in _STALE_NAMES:
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    for old in directory.iterdir():
        if old.suffix in _STALE_SUFFIXES and old.name not in written and old.is_file():
            old.unlink()  # load_converted reads every *.safetensors: a shard of another save must not stay
    for name in sorted(written, key=lambda n: n == "config.json"):
        target = directory / name
        if target.is_dir():  # a folder of a previous save (os.replace cannot put anything over a non-empty one)
            shutil.rmtree(target)
        os.replace(staging / name, target)


def load_converted(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: Any = None):
    """Load a model saved by :func:`save_converted` (or any plain local causal LM, returned
    unconverted): the host loads with ``from_pretrained``, the conversion recorded in
    ``config.json`` is re-applied and the kernels' W/M/F are loaded from the safetensors files
    (a missing one is an error).

    Args:
        directory: a model directory (config.json and safetensors weights; see :func:`check_model_dir`).
        dtype: the host weights' dtype (the kernels stay float32).
        device: where the host is moved before the kernels are attached (None: where ``from_pretrained``
            puts it).

    Returns:
        The model: converted when its config.json records a conversion, else the plain host."""
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
    config = None if conversion is None else recorded_conversion(conversion, directory)
    try:  # use_safetensors: never fall back to a pickle (check_model_dir has refused those already)
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, use_safetensors=True)
    except Exception as error:
        raise _unreadable(error, directory) from error
    finally:
        hf_logging.set_verbosity(verbosity)
    if device is not None:
        model = model.to(device)
    if config is None:
        return model
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    attach_kernels(model, config)
    state = _read_kernel_tensors(directory)
    expected = {name for name, _ in _kernel_tensors(model)}
    missing = sorted(expected - set(state))
    if missing:
        raise KernelmixError(f"{directory} lacks {len(missing)} converted-layer tensors (e.g. {missing[0]}): save the "
                             "converted model again with save_converted (or kernelmix convert)")
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
                raise KernelmixError(f"{name} in {directory}: saved shape {tuple(state[name].shape)} does not fit "
                                     f"{tuple(target.shape)}; "
                                     "the weights are not those of this conversion: save it again")
            target.copy_(state[name].to(target))
    return model


def recorded_conversion(raw: Any, directory: str | Path) -> ConversionConfig:
    """The :class:`ConversionConfig` recorded in ``directory``'s config.json, checked: a damaged or
    foreign record is a :class:`~kernelmix.errors.KernelmixError`, not a TypeError deep inside."""
    where = f"{Path(directory) / 'config.json'} ({CONFIG_KEY})"
    if not isinstance(raw, dict):
        raise KernelmixError(f"{where} must be a mapping of conversion settings, got {raw!r}: "
                             "save the model again with save_converted (or delete the key to load the host)")
    known = {f.name for f in dataclasses.fields(ConversionConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise KernelmixError(f"{where} has unknown setting(s) {unknown} (known: {', '.join(sorted(known))}): was it "
                             "written by a newer kernelmix? Upgrade kernelmix, or convert the host again")
    try:
        config = ConversionConfig(**legacy_defaults(raw))
        config.validate()
    except ValueError as error:
        raise KernelmixError(f"{where}: {error}; save the model again with save_converted") from None
    return config


def _unreadable(error: Exception, directory: Path) -> Exception:
    """What to raise when transformers cannot load ``directory``: a file-system problem stays an OSError
    (the command line explains those), a damaged weights file says so; anything else is left as it is."""
    inner = oserror.from_safetensors(error)
    if inner is not None:
        return inner
    if type(error).__name__ == "SafetensorError":  # e.g. a truncated download: the header or the data is cut
        return KernelmixError(f"the weights in {directory} cannot be read ({error}): the file is damaged or "
                              "incomplete; copy or save the model again")
    return error


def _kernel_tensors(model):
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".kernelmix_rf." in name:
            yield name, t


def _read_kernel_tensors(directory: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    state = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise KernelmixError(f"{directory} holds no .safetensors weights")
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
    """Load a pretrained model, offline, from a prepared name or a local directory.

    Args:
        name_or_path: a name prepared by ``kernelmix pretrained prepare`` (e.g. ``gemma3-270m``) or a
            directory with config.json and safetensors weights. A directory saved by
            :func:`save_converted` is loaded converted (see :func:`load_converted`).
        root: where prepared names live (default: the cache directory, :func:`cache_dir`).
        dtype: the weights' dtype.
        tokenizer: also load the directory's tokenizer.

    Returns:
        ``(model, tokenizer)``; the tokenizer is None when ``tokenizer=False`` or the directory has none."""
    require("transformers", "safetensors")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve(name_or_path, root=root)
    from transformers import AutoTokenizer

    model = load_converted(path, dtype=dtype)
    tok = None
    if tokenizer and any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


__all__ = ["STAGING_PREFIX", "directory_entries", "load_converted", "load_pretrained", "recorded_conversion",
           "save_converted"]
