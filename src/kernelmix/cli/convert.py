"""``kernelmix convert``: a pretrained causal LM converted to random-feature (or Cubit) attention."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated

from ..config import Arg, Field, NonNegativeInt, PositiveInt, check
from ..data import load_corpus, text_windows
from ..pretrained import ConversionConfig, convert, load_pretrained, save_converted
from .options import add_options, from_args


@dataclass
class ConvertOptions:
    """The model, where to save it, and the calibration text of ``--init whiten|distill``
    (what to convert and how: :class:`~kernelmix.pretrained.ConversionConfig`)."""

    model: Annotated[str, Arg(positional=True), Field(
        description="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")]
    out: Annotated[str, Field(description="directory for the converted model (save_pretrained + tokenizer)")]
    calib_text: Annotated[str, Field(description="corpus for whiten/distill (name, dir, glob or file)")] = "shakespeare"
    seq_len: PositiveInt = 512
    calib_seqs: PositiveInt = 2
    steps: Annotated[NonNegativeInt, Field(description="distillation steps per layer")] = 200

    def __post_init__(self) -> None:
        check(self)


def _cli_convert(args) -> int:
    try:
        opts = from_args(ConvertOptions, args)
        config = from_args(ConversionConfig, args)
        model, tok = load_pretrained(opts.model)
        calibration = None
        if config.init != "identity":
            if tok is None:
                raise ValueError(f"init={config.init!r} needs the model's tokenizer in {opts.model}")
            docs = [d.text for d in load_corpus(opts.calib_text).documents()]
            calibration = text_windows(tok, docs, opts.seq_len, opts.calib_seqs, min_windows=opts.calib_seqs)
        convert(model, config, calibration=calibration, init=config.init, steps=opts.steps, progress=True,
                log=lambda msg: print(f"  {msg}", flush=True))
        save_converted(model, opts.out, tok)
    except (ValueError, ImportError) as exc:
        print(f"kernelmix convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted layers {config.layer_indices} to {config.mixer} (m={config.num_features}, init={config.init}); "
          f"saved to {opts.out} — reload with kernelmix.pretrained.load_converted({str(opts.out)!r})")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix convert``."""
    p = sub.add_parser("convert", help="convert a pretrained causal LM (prepared name or HF dir) to random-feature attention")
    add_options(p, ConvertOptions, ConversionConfig)
    p.set_defaults(func=_cli_convert, parser=p)
