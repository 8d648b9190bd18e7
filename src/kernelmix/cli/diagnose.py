"""``kernelmix diagnose``: kernel diagnostics of a pretrained model converted to random features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..config import Arg, Field, check
from ..errors import KernelmixError
from ..studies.diagnose_settings import DiagnoseConfig
from .commands import summary
from .options import add_options, from_args
from .paths import output_dir, user_errors


@dataclass
class DiagnoseInputs:
    """Which model and text ``kernelmix diagnose`` reads and where it writes (what it measures:
    :class:`~kernelmix.studies.diagnose.DiagnoseConfig`)."""

    model: Annotated[str, Arg(positional=True), Field(
        description="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")]
    out: Annotated[str, Field(description="output directory")] = "diagnostics"
    text: Annotated[str, Field(description="real text: corpus name, dir, glob or file (calibration + held-out)")] = (
        "shakespeare")

    def __post_init__(self) -> None:
        check(self)


def _cli_diagnose(args) -> int:
    try:
        opts, config = from_args(DiagnoseInputs, args), from_args(DiagnoseConfig, args)
    except ValueError as error:
        args.parser.error(str(error))
    output_dir(opts.out, "--out")  # before the model is loaded and measured
    from ..data import load_corpus
    from ..pretrained import load_pretrained
    from ..studies.diagnose import diagnose, markdown

    with user_errors():  # the library's ValueErrors about the input (an unknown corpus, a converted model, ...)
        model, tok = load_pretrained(opts.model)
        if tok is None:
            raise KernelmixError(f"{opts.model} has no tokenizer files (tokenizer.json, tokenizer_config.json, ...); "
                                 "diagnose needs one: copy them into the model directory")
        docs = [d.text for d in load_corpus(opts.text).documents()]
        result = diagnose(model, tok, docs, opts.out, config, progress=True,
                          log=lambda msg: print(f"  {msg}", flush=True))
    print(markdown(result))
    print(f"wrote {opts.out}/diagnostics.json, diagnostics.md and PNG plots")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix diagnose``."""
    p = sub.add_parser("diagnose", help=summary("diagnose"))
    add_options(p, DiagnoseInputs, DiagnoseConfig)
    p.set_defaults(func=_cli_diagnose, parser=p)
