"""``kernelmix diagnose``: kernel diagnostics of a pretrained model converted to random features."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated

from ..config import Arg, Choice, Field, NonNegativeInt, PositiveInt, check
from ..data import load_corpus
from ..pretrained import load_pretrained
from ..pretrained.convert import LayerSelection
from ..studies.diagnose import VARIANTS, diagnose, markdown
from .options import add_options, from_args


@dataclass
class DiagnoseOptions:
    """What :func:`kernelmix.studies.diagnose.diagnose` measures, on which model and text."""

    model: Annotated[str, Arg(positional=True), Field(
        description="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")]
    out: Annotated[str, Field(description="output directory")] = "diagnostics"
    text: Annotated[str, Field(description="real text: corpus name, dir, glob or file (calibration + held-out)")] = (
        "shakespeare")
    layers: LayerSelection = "all"
    m_values: Annotated[list[PositiveInt], Arg(flag="--m"), Field(min_length=1, description="feature counts")] = (
        field(default_factory=lambda: [16, 64, 256, 1024]))
    variants: Annotated[list[str], Choice(VARIANTS, "variant")] = field(default_factory=lambda: list(VARIANTS))
    seq_len: PositiveInt = 512
    calib_seqs: PositiveInt = 2
    eval_seqs: PositiveInt = 1
    seeds: PositiveInt = 2
    distill_steps: NonNegativeInt = 100
    e2e_m: Annotated[list[PositiveInt], Field(description="feature counts for the end-to-end loss")] = (
        field(default_factory=lambda: [64, 256, 1024]))

    def __post_init__(self) -> None:
        check(self)


def _cli_diagnose(args) -> int:
    try:
        opts = from_args(DiagnoseOptions, args)
        model, tok = load_pretrained(opts.model)
        if tok is None:
            raise ValueError(f"{opts.model} has no tokenizer files; diagnose needs one")
        docs = [d.text for d in load_corpus(opts.text).documents()]
        result = diagnose(model, tok, docs, opts.out, layers=opts.layers, m_values=opts.m_values,
                          variants=tuple(opts.variants), seq_len=opts.seq_len, calib_seqs=opts.calib_seqs,
                          eval_seqs=opts.eval_seqs, seeds=opts.seeds, distill_steps=opts.distill_steps,
                          e2e_m=opts.e2e_m, progress=True, log=lambda msg: print(f"  {msg}", flush=True))
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    print(f"wrote {opts.out}/diagnostics.json, diagnostics.md and PNG plots")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix diagnose``."""
    p = sub.add_parser("diagnose", help="kernel diagnostics of random-feature attention on a pretrained LM (JSON + md + PNG)")
    add_options(p, DiagnoseOptions)
    p.set_defaults(func=_cli_diagnose, parser=p)
