"""``kernelmix compare``: every mixer trained on the same data, tokens and seeds."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ..model import PRESETS
from ..studies.compare import DEFAULT_MIXERS, MIXER_VARIANTS, CompareConfig, format_markdown, run_compare
from ..training import CheckpointError
from ..training.config import apply_override

def add_command(sub) -> None:
    """Register ``kernelmix compare``."""
    defaults = CompareConfig.__dataclass_fields__
    p = sub.add_parser(
        "compare", help="train every mixer with the same data, tokens and seeds at several lengths; table + plots",
        description="Train every mixer (softmax, cubit, cubit-nolrr, deltaformer, performer, darkformer) with the same "
        "preset, data, tokenizer, token budget and seeds at each training length, evaluate them (val loss at the "
        "training length, loss by position), and write results.json, results.md and PNG plots. Finished runs in the "
        "output directory are reused, so an interrupted compare continues where it stopped.",
    )
    p.add_argument("--mixers", default=",".join(DEFAULT_MIXERS), help=f"comma-separated (default: all: {', '.join(DEFAULT_MIXERS)})")
    p.add_argument("--lengths", default="256,512,1024", help="training lengths (default 256,512,1024)")
    p.add_argument("--seeds", default="0", help="seeds, e.g. 0,1,2 (mean ± spread over them)")
    p.add_argument("--preset", default=defaults["preset"].default)
    p.add_argument("--corpus", default=defaults["corpus"].default)
    p.add_argument("--tokenizer", default=defaults["tokenizer"].default)
    p.add_argument("--steps", type=int, default=defaults["steps"].default, help="optimizer steps per run")
    p.add_argument("--tokens-per-step", type=int, default=defaults["tokens_per_step"].default,
                   help="tokens per step at every length (batch = this / length)")
    p.add_argument("--lr", type=float, default=defaults["lr"].default, help="peak learning rate (min: lr / 10)")
    p.add_argument("--warmup-steps", type=int, default=defaults["warmup_steps"].default)
    p.add_argument("--eval-docs", type=int, default=defaults["eval_docs"].default)
    p.add_argument("--buckets", default=None, help="position-bucket edges, e.g. 0,64,256 (default 0,64,256,1024,…)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model override for every run, e.g. hidden_size=128 or mixer_options.performer.num_features=64")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=defaults["out_dir"].default, help="output directory (default runs/compare)")
    p.set_defaults(func=_cli_compare, parser=p)


def _cli_compare(args) -> int:
    def ints(text: str, what: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            args.parser.error(f"{what} must be comma-separated integers, got {text!r}")

    model: dict[str, Any] = {}
    try:
        wrapper: dict[str, Any] = {}
        for assignment in args.set:
            apply_override(wrapper, "model." + assignment)
        model = wrapper.get("model", {})
        config = CompareConfig(
            mixers=[m.strip() for m in args.mixers.split(",") if m.strip()], lengths=ints(args.lengths, "--lengths"),
            seeds=ints(args.seeds, "--seeds"), preset=args.preset, model=model, corpus=args.corpus,
            tokenizer=args.tokenizer, tokens_per_step=args.tokens_per_step, steps=args.steps, lr=args.lr,
            min_lr=args.lr / 10, warmup_steps=args.warmup_steps, eval_docs=args.eval_docs,
            buckets=ints(args.buckets, "--buckets") if args.buckets else None, out_dir=args.out, device=args.device,
        )
    except ValueError as error:
        args.parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        results = run_compare(config)
    except (CheckpointError, ValueError) as error:  # an unknown corpus, a damaged run directory, ...
        print(f"kernelmix compare: error: {error}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 reports
        print(format_markdown(results))
    return 0
