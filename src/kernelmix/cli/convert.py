"""``kernelmix convert``: a pretrained causal LM converted to random-feature (or Cubit) attention."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ..config import Arg, Field, NonNegativeInt, PositiveInt, check
from ..data import load_corpus, text_windows
from ..errors import KernelmixError
from ..pretrained import ConversionConfig, convert, load_pretrained, resolve, save_converted
from ..pretrained.load import directory_entries
from .options import add_options, from_args
from .paths import output_dir, user_errors


@dataclass
class ConvertOptions:
    """The model, where to save it, and the calibration text of ``--init whiten|distill``
    (what to convert and how: :class:`~kernelmix.pretrained.ConversionConfig`)."""

    model: Annotated[str, Arg(positional=True), Field(
        description="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")]
    out: Annotated[str, Field(description="directory for the converted model (save_pretrained + tokenizer); "
                                          "new or empty unless --overwrite")]
    overwrite: Annotated[bool, Field(
        description="replace the model files in a non-empty --out (other files there are kept)")] = False
    calib_text: Annotated[str, Field(description="corpus for whiten/distill (name, dir, glob or file)")] = "shakespeare"
    seq_len: PositiveInt = 512
    calib_seqs: PositiveInt = 2
    steps: Annotated[NonNegativeInt, Field(description="distillation steps per layer")] = 200

    def __post_init__(self) -> None:
        check(self)


def check_out(opts: ConvertOptions) -> Path:
    """``--out`` checked before the model is loaded: a directory (not a file), empty unless
    ``--overwrite``, and never the model being converted (the host would be lost)."""
    out = output_dir(opts.out, "--out")
    existing = directory_entries(out)
    if existing and not opts.overwrite:
        shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise KernelmixError(f"--out {out} is not empty ({shown}): choose a new directory, or pass --overwrite to "
                             "replace the model files in it")
    if out.is_dir() and out.resolve() == resolve(opts.model).resolve():
        raise KernelmixError(f"--out {out} is the model being converted: choose another directory (the original "
                             "stays as it is)")
    return out


def _cli_convert(args) -> int:
    try:
        opts = from_args(ConvertOptions, args)
        config = from_args(ConversionConfig, args)
    except ValueError as error:
        args.parser.error(str(error))
    out = check_out(opts)
    with user_errors():  # the library's ValueErrors about the input (an unknown corpus, a layer out of range, ...)
        model, tok = load_pretrained(opts.model)
        calibration = None
        if config.init != "identity":
            if tok is None:
                raise KernelmixError(f"--init {config.init} needs the model's tokenizer, and {opts.model} has no tokenizer "
                                     "files: copy them in, or use --init identity")
            docs = [d.text for d in load_corpus(opts.calib_text).documents()]
            calibration = text_windows(tok, docs, opts.seq_len, opts.calib_seqs, min_windows=opts.calib_seqs)
        convert(model, config, calibration=calibration, init=config.init, steps=opts.steps, progress=True,
                log=lambda msg: print(f"  {msg}", flush=True))
    save_converted(model, out, tok, overwrite=opts.overwrite)
    print(f"converted layers {config.layer_indices} to {config.mixer} (m={config.num_features}, init={config.init}); "
          f"saved to {out} — reload with kernelmix.pretrained.load_converted({str(out)!r})")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix convert``."""
    p = sub.add_parser("convert", help="convert a pretrained causal LM (prepared name or HF dir) to random-feature attention")
    add_options(p, ConvertOptions, ConversionConfig)
    p.set_defaults(func=_cli_convert, parser=p)
