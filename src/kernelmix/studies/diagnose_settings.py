"""What ``kernelmix diagnose`` measures: :class:`DiagnoseConfig` and the variants it compares.

Plain data: this module imports neither torch nor the pretrained-model code, so that the command line
builds and checks the options without them; :mod:`kernelmix.studies.diagnose` exports both as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..config import Arg, Choice, Field, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..pretrained.settings import LayerSelection

VARIANTS = ("performer", "whiten", "distill")


@dataclass
class DiagnoseConfig:
    """What :func:`diagnose` measures (``kernelmix diagnose``'s options). Calibration and held-out
    text are disjoint: the first ``calib_seqs`` windows calibrate, the next ``eval_seqs`` are measured."""

    layers: LayerSelection = "all"
    m_values: Annotated[list[PositiveInt], Arg(flag="--m"), Field(min_length=1, description="feature counts")] = (
        field(default_factory=lambda: [16, 64, 256, 1024]))
    variants: Annotated[list[str], Choice(VARIANTS, "variant", "; identity ≡ performer"), Field(min_length=1)] = (
        field(default_factory=lambda: list(VARIANTS)))
    seq_len: PositiveInt = 512
    calib_seqs: PositiveInt = 2
    eval_seqs: PositiveInt = 1
    seeds: Annotated[PositiveInt, Field(description="draws of W per m")] = 2
    weight_rows: Annotated[PositiveInt, Field(description="query rows whose attention weights are compared")] = 64
    variance_pairs: Annotated[PositiveInt, Field(description="sampled causal (q, k) pairs for the variance check")] = 16
    variance_draws: Annotated[PositiveInt, Field(description="iid draws of W per pair")] = 256
    variance_m: Annotated[PositiveInt, Field(description="m of the variance check")] = 64
    distill_steps: NonNegativeInt = 100
    distill_m: Annotated[PositiveInt, Field(description="m while distilling M")] = 256
    distill_lr: PositiveFloat = 5e-3
    e2e_m: Annotated[list[PositiveInt], Field(min_length=1, description="feature counts for the end-to-end loss")] = (
        field(default_factory=lambda: [64, 256, 1024]))
    eps: Annotated[PositiveFloat, Field(description="regularisation of the second moments when whitening")] = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        check(self)


__all__ = ["VARIANTS", "DiagnoseConfig"]
