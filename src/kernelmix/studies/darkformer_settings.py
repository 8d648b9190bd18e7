"""What ``kernelmix report darkformer`` runs: :class:`DarkformerReportSettings` (the full run's sizes;
``quick()`` a smoke run).

Plain data: this module imports neither torch nor the pretrained-model code, so that the command line
builds and checks the options without them; :mod:`kernelmix.studies.darkformer_report` exports it as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..config import Arg, Choice, Field, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..pretrained.settings import INITS, MODES, LayerSelection
from .finetune_settings import VARIANTS as FT_VARIANTS


@dataclass
class DarkformerReportSettings:
    model: Annotated[str,
                     Field(description="a known name (prepared on first use) or a local HF causal-LM directory")] = (
        "gemma3-270m")
    text: Annotated[str, Field(description="corpus name, dir, glob or file (split by document)")] = "shakespeare"
    val_fraction: Annotated[float, Field(gt=0, lt=1, description="share of documents held out")] = 0.1
    seed: int = 0
    # diagnostics
    diag_layers: Annotated[LayerSelection,
                           Field(description="layers to diagnose: all | global | local | indices")] = "all"
    diag_m: Annotated[tuple[PositiveInt, ...], Arg(flag="--m"),
                      Field(min_length=1, description="diagnostic feature counts")] = (
        16, 64, 256, 1024)
    diag_seq_len: PositiveInt = 512
    diag_seeds: PositiveInt = 1
    diag_distill_steps: NonNegativeInt = 60
    diag_e2e_m: tuple[PositiveInt, ...] = (64, 256)
    # finetuning comparison
    num_features: Annotated[PositiveInt, Field(description="m of the finetuning comparison")] = 64
    ft_layers: Annotated[LayerSelection,
                         Field(description="layers to finetune: all | global | local | indices")] = "all"
    ft_mode: Annotated[str, Choice(MODES, "finetuning mode")] = "partial"
    ft_steps: Annotated[PositiveInt, Arg(flag="--steps"), Field(description="finetuning steps per run")] = 40
    ft_seq_len: PositiveInt = 256
    ft_lrs: Annotated[tuple[PositiveFloat, ...], Arg(flag="--lrs"), Field(
        min_length=1, title="learning rates", description="learning rates of the sweep")] = (1e-3, 3e-3)
    ft_eval_every: PositiveInt = 20
    ft_eval_seqs: PositiveInt = 4
    ft_variants: Annotated[tuple[str, ...], Choice(FT_VARIANTS, "variant")] = ("softmax", "performer", "darkformer")
    init: Annotated[str, Choice(INITS, "init"), Field(description="DARKFormer initialisation")] = "whiten"

    def __post_init__(self) -> None:
        check(self)

    @classmethod
    def quick(cls, **overrides) -> "DarkformerReportSettings":
        """A smoke-sized run (minutes on a tiny model; still the whole pipeline)."""
        small = dict(diag_m=(16, 64), diag_seq_len=64, diag_distill_steps=5, diag_e2e_m=(32,), ft_steps=4,
                     ft_seq_len=32, ft_lrs=(1e-3, 1e-2), ft_eval_every=2, ft_eval_seqs=1, num_features=16)
        small.update(overrides)
        return cls(**small)


__all__ = ["DarkformerReportSettings"]
