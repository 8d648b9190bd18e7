"""A finished (or interrupted) ``kernelmix train`` run, loaded for evaluation or generation.

    from kernelmix.training import load_run

    run = load_run("runs/train")        # a run directory or one checkpoint directory
    run.model, run.tokenizer, run.step, run.split("val")
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import TokenizedSplit, load_tokenizer, prepare_dataset
from ..evaluate import text_split
from ..model import CausalLM, ModelConfig
from .checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, load_latest_valid, load_weights



@dataclass
class LoadedRun:
    """A trained model with what is needed to evaluate it. ``record`` is the run's resolved
    config (``config.json``: ``train``/``model``/``run`` sections); ``train_seq_len`` the length
    it was trained at."""

    model: CausalLM
    tokenizer: Any
    checkpoint: Path
    step: int
    record: dict[str, Any]

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def train_seq_len(self) -> int | None:
        return self.record.get("train", {}).get("seq_len")

    def dataset(self):
        """The run's tokenized corpus (the same split as in training; cached)."""
        train = self.record.get("train", {})
        return prepare_dataset(train.get("corpus", "pystdlib"), train.get("tokenizer", "byte"),
                               val_fraction=train.get("val_fraction", 0.05))

    def split(self, name: str = "val") -> TokenizedSplit:
        """``"val"``/``"train"``: a split of the run's own corpus; anything else: a corpus spec
        (a text file, directory, glob, .jsonl; see :func:`kernelmix.data.load_corpus`) tokenized
        with the run's tokenizer, every document of it evaluated."""
        if name in ("val", "train"):
            return self.dataset().split(name)
        return text_split(name, self.tokenizer)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory of ``path``: ``path`` itself if it is one (holds
    ``manifest.json``), else the newest ``checkpoints/step_N`` of the run directory ``path``.

    Args:
        path: a checkpoint directory or a run directory.

    Returns:
        The checkpoint directory (not verified). A ``path`` that does not exist or holds no checkpoint
        is a ValueError."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"run directory {str(path)!r} does not exist; "
                         "give a `kernelmix train --out` directory or a checkpoint")
    if (path / "manifest.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"{str(path)!r} holds no checkpoint (no checkpoints/step_N/ inside, and it is not a checkpoint directory "
            "itself); train one with `kernelmix train --out DIR` (or let the run finish: it saves at its last step)"
        )
    return latest


def _load_newest_valid(path: str | Path) -> Checkpoint:
    """A checkpoint directory as given, or a run directory's newest checkpoint that verifies (a
    damaged newer one is skipped with a warning naming it: a kill or a full disk after the save is
    no reason to lose the run)."""
    newest = find_checkpoint(path)
    if newest == Path(path):
        return load_checkpoint(newest)
    ckpt = load_latest_valid(path, warn=False)
    if ckpt.path != newest:
        warnings.warn(f"the newest checkpoint {str(newest)!r} is damaged; loading the newest valid one "
                      f"{str(ckpt.path)!r} (step {ckpt.step}) instead", stacklevel=3)
    return ckpt


def load_run(path: str | Path, *, device: str | torch.device = "cpu") -> LoadedRun:
    """Load the newest checkpoint of a run directory (or a given checkpoint directory) as a
    :class:`LoadedRun`, in eval mode. Verified like any checkpoint (manifest sizes and hashes;
    safetensors and JSON only, no code executed). The tokenizer is the one saved with the run's
    tokenized corpus, re-created from the corpus if that cache is gone.

    Args:
        path: a run directory (its newest checkpoint that verifies; a damaged newer one is skipped with a
            warning) or a checkpoint directory (loaded as given).
        device: where the model is put.

    Returns:
        The :class:`LoadedRun`: model, tokenizer, checkpoint directory, step and the run's record."""
    ckpt = _load_newest_valid(path)
    record = ckpt.config
    if not isinstance(record, dict) or "model" not in record:
        raise ValueError(f"checkpoint {str(ckpt.path)!r} holds no kernelmix model config; "
                         "is it from `kernelmix train`?")
    model = CausalLM(ModelConfig.from_dict(record["model"]))
    load_weights(model, ckpt.weights, ckpt.path)
    model.to(device).eval()
    run = LoadedRun(model=model, tokenizer=None, checkpoint=ckpt.path, step=ckpt.step, record=record)
    data_path = record.get("run", {}).get("data", {}).get("path")
    try:
        run.tokenizer = load_tokenizer(data_path) if data_path else None
    except ValueError:
        run.tokenizer = None
    if run.tokenizer is None:
        run.tokenizer = run.dataset().tokenizer
    if run.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the run's tokenizer has {run.tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}; "
            "the tokenized corpus changed since training"
        )
    return run


__all__ = ["LoadedRun", "find_checkpoint", "load_run"]
