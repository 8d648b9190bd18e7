"""``kernelmix model-info``: a preset's config and parameter count."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

from ..config import Arg, Choice, Field, check
from ..layers import MIXERS
from ..presets import PRESETS
from .commands import summary
from .options import add_options, from_args


@dataclass
class ModelInfoOptions:
    preset: Annotated[str, Choice(PRESETS, "preset"), Arg(positional=True, metavar="PRESET"),
                      Field(description=f"one of: {', '.join(PRESETS)}")]
    mixer: Annotated[str, Choice(MIXERS, "mixer"), Arg(group="mixer"),
                     Field(description="the mixer of every layer")] = (
        "softmax")
    mixers: Annotated[list[str], Choice(MIXERS, "mixer"), Arg(group="mixer"),
                      Field(min_length=1, description="one mixer per layer, comma-separated (a hybrid)")] | None = None

    def __post_init__(self) -> None:
        check(self)


def _model_info(args: argparse.Namespace) -> int:
    import torch

    from ..model import CausalLM, ModelConfig

    try:
        opts = from_args(ModelInfoOptions, args)
        config = ModelConfig.preset(opts.preset, **({"mixers": opts.mixers} if opts.mixers else {"mixer": opts.mixer}))
    except ValueError as err:  # e.g. a --mixers list of the wrong length
        args.parser.error(str(err))
    with torch.device("meta"):  # shapes only: instant and no memory, even for 1.3b
        model = CausalLM(config)
    total = model.num_parameters()
    embedding = model.embed.weight.numel()
    mixer = sum(p.numel() for block in model.blocks for p in block.mixer.parameters())
    mlp = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    names = config.layer_mixers()
    layout = f"{names[0]} x {len(names)}" if len(set(names)) == 1 else ", ".join(names)
    print(f"preset {opts.preset}: {config.num_layers} layers ({layout})")
    print(config.to_json())
    head = 0 if config.tie_embeddings else model.lm_head.weight.numel()
    tied = "tied with the LM head, counted once" if config.tie_embeddings else f"LM head separate: {head:,}"
    print(f"embedding: {embedding:,} ({tied})")
    print(f"mixers: {mixer:,}  MLPs: {mlp:,}  norms: {total - embedding - head - mixer - mlp:,}")
    print(f"parameters: {total:,} ({total / 1e6:.1f}M)")
    return 0


def add_command(sub) -> None:
    info = sub.add_parser("model-info", help=summary("model-info"))
    add_options(info, ModelInfoOptions)
    info.set_defaults(func=_model_info, parser=info)
