"""The model's config: :class:`ModelConfig`, plain data saved as JSON beside the weights (its
presets: :mod:`kernelmix.presets`).

This module imports no torch (``mixer_options`` is checked against the option names in the mixers'
registry entries, not their layer classes), so that ``kernelmix train`` reads and checks its settings without the model
code; :mod:`kernelmix.model` exports everything here as before (``from kernelmix.model import ModelConfig``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError, WrapValidator

from .backends import BACKENDS
from .config import Choice, Field, NonNegativeFloat, PositiveFloat, PositiveInt, check
from .errors import KernelmixError
from .layers import MIXERS, mixer_options
from .layers.settings import SHARED_OPTIONS, check_head_geometry
from .presets import PRESETS


def _not_a_string(value: Any) -> Any:
    if isinstance(value, str):  # a list would take it letter by letter
        raise ValueError(f"mixers must be a list of mixer names (one per layer), got the string {value!r}")
    return value


def _options_message(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(
            "mixer_options must map a mixer name to a dict of options, e.g. "
            f"{{'cubit': {{'lrr': False}}}}; got {value!r}"
        ) from None


MixerName = Annotated[str, Choice(MIXERS, "mixer")]


@dataclass
class ModelConfig:
    """Everything that defines a model; plain data, saved as JSON beside the weights.

    ``mixer`` names the token mixer of every layer; ``mixers`` (one name per layer) overrides it
    for hybrids such as softmax every 4th layer. ``mixer_options`` maps a mixer name to extra
    keyword arguments of that mixer's layer (e.g. ``{"cubit": {"lrr": False}}``,
    ``{"performer": {"num_features": 128}}``).
    """

    vocab_size: PositiveInt = 256
    hidden_size: PositiveInt = 256
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    num_kv_heads: Annotated[PositiveInt | None, Field(
        description="key/value heads; None: = num_heads; fewer gives grouped-query attention")] = None
    head_dim: Annotated[PositiveInt | None, Field(description="None: hidden_size // num_heads")] = None
    intermediate_size: Annotated[PositiveInt | None, Field(
        description="SwiGLU hidden size; None: 8/3 · hidden, rounded up to 64")] = None
    norm_eps: NonNegativeFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    max_seq_len: Annotated[PositiveInt, Field(
        description="a hard limit on positions: longer inputs are refused, not extrapolated")] = 1024
    tie_embeddings: bool = True
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    initializer_range: NonNegativeFloat = 0.02
    mixer: MixerName = "softmax"
    mixers: Annotated[list[MixerName] | None, BeforeValidator(_not_a_string)] = None
    mixer_options: Annotated[dict[str, dict[str, Any]], WrapValidator(_options_message)] = field(default_factory=dict)
    chunk_size: PositiveInt = 64
    backend: Annotated[str, Choice(BACKENDS, "backend"), Field(
        description="the mixers' kernels: auto (Triton on CUDA where it imports, the PyTorch paths elsewhere), "
                    "torch, or triton (CUDA; CPU only under TRITON_INTERPRET=1)")] = "auto"

    def __post_init__(self) -> None:
        check(self)
        self.head_dim, self.num_kv_heads = check_head_geometry(
            self.hidden_size, self.num_heads, self.head_dim, self.num_kv_heads
        )
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.mixers is not None and len(self.mixers) != self.num_layers:
            raise KernelmixError(
                f"mixers lists {len(self.mixers)} names but num_layers is {self.num_layers}; "
                "give one mixer per layer (or use mixer= for all layers)"
            )
        for name, options in self.mixer_options.items():
            if name not in MIXERS:
                raise KernelmixError(f"mixer_options names unknown mixer {name!r} (choose from: {', '.join(MIXERS)})")
            accepted = set(mixer_options(name)) - set(layer_args_from_config())
            unknown = sorted(set(options) - accepted)
            if unknown:
                raise KernelmixError(
                    f"mixer_options[{name!r}] has unknown option(s) {unknown}; accepted: {', '.join(sorted(accepted))} "
                    f"(the shared ones — {', '.join(layer_args_from_config())} — come from the model config)"
                )
        self._check_options_are_used()

    def _check_options_are_used(self) -> None:
        # options for a mixer no layer has would be dropped without a word (a typo'd mixer= or a
        # hybrid's list that lost that mixer); an empty dict drops nothing, so it is accepted
        present = self.layer_mixers()
        for name, options in self.mixer_options.items():
            if options and name not in present:
                given = ", ".join(f"mixer_options.{name}.{option}" for option in sorted(options))
                verb = "is" if len(options) == 1 else "are"
                raise KernelmixError(
                    f"{given} {verb} given, but no layer of this model is {name!r} (its layers' mixers: "
                    f"{', '.join(present)}), so the option would be ignored; use the mixer (mixer={name!r}, or name it "
                    f"in mixers= for the layers that should have it) or remove mixer_options[{name!r}]"
                )

    def layer_mixers(self) -> list[str]:
        """The mixer name of every layer."""
        return list(self.mixers) if self.mixers is not None else [self.mixer] * self.num_layers

    # -- presets and serialisation ------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named size (see :data:`PRESETS`) with any field overridden."""
        if not isinstance(name, str) or name not in PRESETS:
            raise KernelmixError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise KernelmixError(f"unknown config field(s) {unknown}; fields are: {', '.join(sorted(fields))}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise KernelmixError(f"unknown config field(s) {unknown}; is this a kernelmix model config?")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# The shared layer arguments that are also config fields (hidden_size, num_heads, head_dim,
# num_kv_heads, rope_theta, chunk_size, backend) come from the config, for every layer; the others
# (bias) may be set per mixer in mixer_options.
# (:data:`kernelmix.model.LAYER_ARGS_FROM_CONFIG`)
@functools.cache
def layer_args_from_config() -> tuple[str, ...]:
    return tuple(name for name in SHARED_OPTIONS if name in {f.name for f in dataclasses.fields(ModelConfig)})


__all__ = ["MixerName", "ModelConfig", "layer_args_from_config"]
