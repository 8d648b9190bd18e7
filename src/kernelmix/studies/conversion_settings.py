"""What ``kernelmix report conversion`` measures: :class:`ConversionReportSettings` (the defaults: the
committed results/conversion; ``quick()`` a smoke run) and the names its rows choose from.

Plain data: this module imports neither torch nor the pretrained-model code, so that the command line
builds and checks the options without them; :mod:`kernelmix.studies.conversion_report` exports them as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..config import Choice, Distinct, Field, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..pretrained.settings import TRANSFER_OBJECTIVES

VARIANTS = ("window", "performer", "whiten", "darkformer", "hedgehog")
TRANSFERRED = ("darkformer", "hedgehog")
LAYER_SETS = ("global", "all")


@dataclass
class ConversionReportSettings:
    """What the conversion report measures (the defaults: the committed results/conversion)."""

    model: Annotated[str, Field(description="a prepared name or a local HF causal-LM directory")] = "gemma3-270m"
    text: Annotated[str, Field(description="corpus name, dir, glob or file (split by document)")] = "shakespeare"
    val_fraction: Annotated[float, Field(gt=0, lt=1, description="share of documents held out")] = 0.1
    seed: int = 0
    layers: Annotated[list[str], Choice(LAYER_SETS, "layer set"), Distinct("layer set"),
                      Field(min_length=1, description="layer sets to convert: global, all")] = LAYER_SETS
    variants: Annotated[list[str], Choice(VARIANTS, "variant"), Distinct("variant"),
                        Field(min_length=1,
                              description="rows: window, performer, whiten, darkformer, hedgehog")] = VARIANTS
    num_features: PositiveInt = 64
    window: PositiveInt = 64
    sinks: int = 4
    calib_seqs: Annotated[PositiveInt, Field(description="calibration windows (training documents)")] = 4
    calib_len: Annotated[PositiveInt, Field(description="calibration window length: the held-out one (fitted at "
                                                        "1,024, the error at 2,048 was 1.4-1.5x larger)")] = 2048
    eval_seqs: Annotated[PositiveInt, Field(description="held-out windows for the loss")] = 2
    eval_len: PositiveInt = 2048
    error_len: Annotated[PositiveInt, Field(description="held-out window for the per-layer attention error")] = 2048
    transfer_steps: PositiveInt = 200
    transfer_objective: Annotated[str, Choice(TRANSFER_OBJECTIVES, "transfer objective"), Field(
        description="where the transfer matches each layer: 'attention' (its output) or 'residual' (what it adds "
                    "to the residual stream, after o_proj and Gemma's post-attention norm)")] = "attention"
    kl_steps: Annotated[NonNegativeInt, Field(description="steps of end-to-end logit distillation after the transfer "
                                                          "(darkformer and hedgehog rows; 0 = none)")] = 0
    kl_lr: PositiveFloat = 1e-4
    feature_sweep: Annotated[list[PositiveInt], Distinct("m"), Field(
        description="more features for the global-layer DARKFormer after transfer (rows 'darkformer m=...'): how the "
                    "gap to the host falls with m (e.g. 128,256: +7 min; not in the default study)")] = ()
    lora_variants: Annotated[list[str], Choice(VARIANTS, "variant"), Distinct("variant"),
                             Field(description="variants finetuned with LoRA after their first stage")] = (
        "window", "darkformer", "hedgehog")
    lora_steps: PositiveInt = 40
    lora_seq_len: PositiveInt = 512
    lora_lr: PositiveFloat = 1e-3
    decode_contexts: Annotated[list[PositiveInt], Distinct("context"),
                               Field(description="context lengths of the decode measurement")] = (1024, 8192, 32768)
    decode_tokens: PositiveInt = 16
    layer_gaps: Annotated[bool, Field(description="also the held-out loss of the global-layer DARKFormer after "
                                                  "transfer with one converted layer at a time (the others exact): "
                                                  "which layer carries the gap")] = False

    estimator_check: Annotated[list[PositiveInt], Distinct("m"), Field(
        description="also the global layers' attention error with W redrawn at these m for the "
                    "transferred M (3 draws), and for the whitened M (the host's own kernel): is the feature part an "
                    "estimate of a kernel or a map fitted to its draw? (e.g. 256,1024,4096)")] = ()

    def __post_init__(self) -> None:
        check(self)

    @classmethod
    def quick(cls, **overrides) -> "ConversionReportSettings":
        """A smoke-sized run of the whole pipeline (minutes on a real model, seconds on a tiny one)."""
        base = dict(calib_seqs=2, calib_len=256, eval_seqs=1, eval_len=256, error_len=256, transfer_steps=5,
                    lora_steps=2, lora_seq_len=128, decode_contexts=(256, 1024), decode_tokens=2, feature_sweep=())
        base.update(overrides)
        return cls(**base)


__all__ = ["LAYER_SETS", "TRANSFERRED", "VARIANTS", "ConversionReportSettings"]
