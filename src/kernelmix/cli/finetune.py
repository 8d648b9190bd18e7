"""``kernelmix finetune``: converted models finetuned on real text at equal m and budget."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from .. import pretrained as cv
from ..config import Arg, Choice, Distinct, Field, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..errors import Interrupted
from ..locks import run_directory_lock
from ..output import write_json_atomic
from ..pretrained.settings import INITS, FinetuneConfig, LayerSelection
from ..studies.finetune_settings import DEFAULT_VARIANTS, VARIANTS
from .commands import summary
from .options import add_options, from_args


@dataclass
class FinetuneOptions:
    """The study around the finetuning recipe (:class:`~kernelmix.pretrained.FinetuneConfig`):
    which model, variants, learning rates and text."""

    model: Annotated[str, Arg(positional=True), Field(
        description="a prepared name (gemma3-270m, smollm2-135m), a local HF causal-LM directory, or a converted one")]
    out: Annotated[str, Field(description="output directory")]
    variants: Annotated[list[str], Choice(VARIANTS, "variant"), Distinct("variant"), Field(
        min_length=1, description="softmax,performer,darkformer (and cubit, experimental)")] = (
        field(default_factory=lambda: list(DEFAULT_VARIANTS)))
    num_features: Annotated[PositiveInt, Field(description="m for performer and darkformer (equal m)")] = 64
    layers: LayerSelection = "all"
    init: Annotated[str, Choice(INITS, "init"), Field(description="DARKFormer initialisation")] = "whiten"
    text: Annotated[str, Field(description="corpus name, dir, glob or file (split by document)")] = "shakespeare"
    val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    lrs: Annotated[list[PositiveFloat], Arg(flag="--lr"), Distinct("learning rate"), Field(
        min_length=1, title="learning rates",
        description="learning rate, or several (comma-separated) for a sweep")] = (
        field(default_factory=lambda: [1e-4]))
    calib_seqs: Annotated[PositiveInt, Field(description="training windows used to whiten/distill")] = 2
    distill_steps: NonNegativeInt = 100
    resume: Annotated[bool, Field(description="converted MODEL only: continue from OUT/run's last checkpoint")] = False

    def __post_init__(self) -> None:
        check(self)


def _finetune_converted(host, tok, train_w, val_w, config: FinetuneConfig, opts: FinetuneOptions) -> None:
    """An already converted model: finetune it as it is and save it."""
    from ..pretrained import finetune
    from ..training.checkpoint import writing

    if len(opts.lrs) != 1:
        raise ValueError("an already converted model is finetuned at one learning rate; give one --lr")
    out = Path(opts.out)
    model, result = finetune(host, train_w, val_w, config, out_dir=out / "run", resume=opts.resume,
                             progress=True, label="converted")
    with writing(out):
        cv.save_converted(model, out / "model", tok)
        write_json_atomic(out / "result.json", result, indent=1)
    start = "after transfer" if (Path(opts.model) / "transfer.json").is_file() else "as converted"
    print(f"val loss {result['initial']['loss']:.4f} ({start}) → {result['final']['loss']:.4f} (after {config.mode}) "
          f"(acc {result['final']['accuracy']:.3f}), {result['num_spikes']} spikes; saved the model to {out / 'model'}")


def _cli_finetune(args) -> int:
    try:
        opts = from_args(FinetuneOptions, args)
        config = from_args(FinetuneConfig, args, lr=opts.lrs[0])
        from ..training.checkpoint import writing  # torch: once the options are known to be right

        # OUT is locked before the model and the text are read: a busy OUT (or one that is a file) fails at once
        with contextlib.ExitStack() as stack:
            with writing(opts.out, "create the output directory"):
                stack.enter_context(run_directory_lock(opts.out, "kernelmix finetune"))
            report = _run(opts, config)
    except Interrupted as stop:  # the run in progress saved its step; the message says how to continue
        print(f"kernelmix finetune: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ValueError, ImportError) as exc:
        print(f"kernelmix finetune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C pressed twice, or while loading
        print("kernelmix finetune: stopped by Ctrl-C without saving the run in progress; finished runs are kept",
              file=sys.stderr)
        return 130
    if report is None:  # an already converted model, finetuned and saved
        return 0
    from ..studies.finetune import markdown

    print(markdown(report))
    print(f"wrote {opts.out}/finetune.json, finetune.md and finetune_curves.png ({report['wall_s']:.0f} s)")
    return 0


def _run(opts: FinetuneOptions, config: FinetuneConfig) -> dict | None:
    """Load MODEL and the text, then finetune: the comparison's report, or None for a converted MODEL."""
    from ..data import load_text_windows
    from ..pretrained import load_pretrained
    from ..studies.finetune import compare_finetune

    host, tok = load_pretrained(opts.model)
    if tok is None:
        raise ValueError(f"{opts.model} has no tokenizer files; finetune needs one")
    train_w, val_w = load_text_windows(tok, opts.text, config.seq_len, val_fraction=opts.val_fraction,
                                       eval_seqs=config.eval_seqs, seed=config.seed)
    if cv.kernels(host):
        _finetune_converted(host, tok, train_w, val_w, config, opts)
        return None
    return compare_finetune(host, train_w, val_w, config, variants=opts.variants, lrs=opts.lrs,
                            num_features=opts.num_features, layers=opts.layers, init=opts.init,
                            calib_windows=opts.calib_seqs, distill_steps=opts.distill_steps, out_dir=opts.out,
                            progress=True, log=lambda msg: print(f"  {msg}", flush=True))


def add_command(sub) -> None:
    """Register ``kernelmix finetune``."""
    p = sub.add_parser(
        "finetune",
        help=summary("finetune"),
        description="Convert MODEL per variant (softmax = the host unchanged), finetune each with the same data, "
                    "steps, m and seed at each learning rate, and write finetune.json/md and curves. A MODEL directory "
                    "that is already converted (kernelmix convert) is finetuned as it is and saved to OUT/model. "
                    "Finished runs in OUT are reused; an interrupted run continues from its last checkpoint.",
    )
    add_options(p, FinetuneOptions, FinetuneConfig, exclude=("lr",))
    p.set_defaults(func=_cli_finetune, parser=p)
