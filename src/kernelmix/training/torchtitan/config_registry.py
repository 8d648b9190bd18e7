"""torchtitan ``--config`` functions for kernelmix models (``--module kernelmix.training.torchtitan``).

One function per preset takes the mixer as an argument, for Python (``kernelmix_125m(mixer="cubit")``,
or a hybrid: ``kernelmix_small(mixers=[...])``). torchtitan's command line calls a config function
*without* arguments and keeps ``model_spec`` out of its CLI (``tyro.conf.Suppress``), so the mixer
cannot be chosen there: every (preset, mixer) pair also has a function of its own,
``kernelmix_<preset>_<mixer>`` — ``kernelmix_tiny_cubit``, ``kernelmix_125m_performer``,
``kernelmix_1p3b_deltaformer`` — and the plain ``kernelmix_<preset>`` is softmax. Everything
else (steps, batch, learning rate, data, compile, activation checkpointing, parallelism) is set
on torchtitan's command line as usual (``--training.steps 100``, ``--compile.enable``,
``--activation_checkpoint full``, ...).

The settings that differ from torchtitan's defaults: the loss is ``CrossEntropyLoss`` (kernelmix
models return logits, so torchtitan's ``ChunkedLossWrapper`` does not apply), no activation
checkpointing (kernelmix's default), the ``partial_dtensor`` SPMD backend (classic FSDP2 over
plain parameters), and each preset's sequence length, batch and learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.trainer import Trainer

from ...layers import MIXERS
from . import model_registry


@dataclass(frozen=True)
class PresetRecipe:
    """The training defaults of one preset (any of them can be changed on torchtitan's CLI)."""

    preset: str
    seq_len: int
    local_batch_size: int
    steps: int
    lr: float
    warmup_steps: int


#: config-function suffix -> recipe; "1p3b" because a function name cannot hold "1.3b"
RECIPES: dict[str, PresetRecipe] = {
    "tiny": PresetRecipe("tiny", seq_len=256, local_batch_size=8, steps=20, lr=1e-3, warmup_steps=2),
    "small": PresetRecipe("small", seq_len=1024, local_batch_size=8, steps=2000, lr=1e-3, warmup_steps=100),
    "125m": PresetRecipe("125m", seq_len=2048, local_batch_size=8, steps=10000, lr=6e-4, warmup_steps=500),
    "350m": PresetRecipe("350m", seq_len=2048, local_batch_size=8, steps=20000, lr=3e-4, warmup_steps=1000),
    "1p3b": PresetRecipe("1.3b", seq_len=2048, local_batch_size=4, steps=40000, lr=2e-4, warmup_steps=2000),
}


def trainer_config(recipe: PresetRecipe, mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """torchtitan's ``Trainer.Config`` for ``recipe`` with a kernelmix ``mixer`` (see the module docstring)."""
    return Trainer.Config(
        model_spec=model_registry(recipe.preset, mixer, **model_fields),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=recipe.lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=recipe.warmup_steps, decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1,
        ),
        training=TrainingConfig(local_batch_size=recipe.local_batch_size, seq_len=recipe.seq_len, steps=recipe.steps),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=10),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=max(recipe.steps // 10, 1)),
        activation_checkpoint=None,
    )


def kernelmix_tiny(mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """The ``tiny`` preset (2 layers, width 64): smoke tests."""
    return trainer_config(RECIPES["tiny"], mixer, **model_fields)


def kernelmix_small(mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """The ``small`` preset (6 layers, width 256)."""
    return trainer_config(RECIPES["small"], mixer, **model_fields)


def kernelmix_125m(mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """The ``125m`` preset (GPT-3 Small: 12 layers, width 768, GPT-2 vocabulary)."""
    return trainer_config(RECIPES["125m"], mixer, **model_fields)


def kernelmix_350m(mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """The ``350m`` preset (GPT-3 Medium: 24 layers, width 1024)."""
    return trainer_config(RECIPES["350m"], mixer, **model_fields)


def kernelmix_1p3b(mixer: str = "softmax", **model_fields: Any) -> Trainer.Config:
    """The ``1.3b`` preset (GPT-3 XL: 24 layers, width 2048)."""
    return trainer_config(RECIPES["1p3b"], mixer, **model_fields)


def config_function(suffix: str, mixer: str) -> Callable[[], Trainer.Config]:
    """A no-argument config function for torchtitan's CLI: preset ``suffix`` with ``mixer``."""

    def config() -> Trainer.Config:
        return trainer_config(RECIPES[suffix], mixer)

    config.__name__ = config.__qualname__ = f"kernelmix_{suffix}_{mixer}"
    config.__doc__ = f"The {RECIPES[suffix].preset!r} preset with {mixer} in every layer."
    return config


#: every ``kernelmix_<preset>_<mixer>`` function torchtitan's ``--config`` can name
PER_MIXER_CONFIGS: dict[str, Callable[[], Trainer.Config]] = {
    f"kernelmix_{suffix}_{mixer}": config_function(suffix, mixer) for suffix in RECIPES for mixer in MIXERS
}
globals().update(PER_MIXER_CONFIGS)

__all__ = [
    "PER_MIXER_CONFIGS", "RECIPES", "PresetRecipe", "config_function", "kernelmix_125m", "kernelmix_1p3b",
    "kernelmix_350m", "kernelmix_small", "kernelmix_tiny", "trainer_config", *PER_MIXER_CONFIGS,
]
