"""``kernelmix eval``: loss by length and position, and zero-shot tasks, of a trained run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any

from ..config import Arg, Choice, Field, NonNegativeInt, PositiveInt, check
from ..evaluate import BACKENDS, TASKS, build_tasks, cap_split, evaluate_loss, score_tasks
from ..training import load_run
from ..training import CheckpointError
from ..output import write_json_atomic
from .options import add_options, from_args


@dataclass
class EvalOptions:
    run: Annotated[str, Arg(positional=True), Field(description="a run directory (kernelmix train --out) or a checkpoint directory")]
    data: Annotated[str, Field(description="val (default) or train: the run's own split; or a text file/dir/glob/.jsonl")] = "val"
    lengths: Annotated[list[Annotated[int, Field(ge=2)]], Field(min_length=1, description=(
        "context lengths, e.g. 128,256,512,1024 (default: the training length)"))] | None = None
    buckets: Annotated[list[NonNegativeInt], Field(description=(
        "position-bucket edges, e.g. 0,64,256,1024 (default ×4 from 64)"))] | None = None
    batch_size: PositiveInt = 8
    max_docs: Annotated[PositiveInt | None, Field(description="evaluate only the first N documents")] = None
    doc_tokens: Annotated[PositiveInt | None, Field(description="evaluate only the first N tokens of each document")] = None
    tasks: Annotated[list[str], Choice((*TASKS, "all", "none"), "task"), Field(
        description=f"zero-shot tasks: {','.join(TASKS)} | all | none (default)")] = field(default_factory=lambda: ["none"])
    items: Annotated[PositiveInt, Field(description="items per zero-shot task")] = 100
    context_tokens: Annotated[PositiveInt, Field(description="context of a zero-shot item (tokens)")] = 256
    backend: Annotated[str, Choice(BACKENDS, "backend"), Field(
        description="zero-shot scorer (lm-eval: pip install 'kernelmix[eval]')")] = "builtin"
    seed: Annotated[int, Field(description="seed of the zero-shot task construction")] = 0
    device: str = "cpu"
    json: Annotated[str | None, Field(description="also write the results as JSON to this path")] = None

    def __post_init__(self) -> None:
        check(self)


def add_command(sub) -> None:
    """Register ``kernelmix eval``."""
    p = sub.add_parser(
        "eval", help="loss/perplexity of a trained run at several context lengths, by position, + zero-shot tasks",
        description="Evaluate a `kernelmix train` run (its newest checkpoint, or a checkpoint directory): loss and "
        "perplexity at each --lengths (up to the model's max_seq_len; beyond the training length is marked), loss by "
        "position bucket within each window, and zero-shot continuation/cloze tasks built from held-out documents.",
    )
    add_options(p, EvalOptions)
    p.set_defaults(func=_cli_eval, parser=p)


def _fail(message: str) -> int:
    print(f"kernelmix eval: error: {message}", file=sys.stderr)
    return 2


def _cli_eval(args) -> int:
    try:
        opts = from_args(EvalOptions, args)
    except ValueError as error:
        args.parser.error(str(error))
    try:
        run = load_run(opts.run, device=opts.device)
        split = run.split(opts.data)
        if opts.max_docs or opts.doc_tokens:
            split = cap_split(split, doc_tokens=opts.doc_tokens, max_docs=opts.max_docs)
        lengths = opts.lengths or [run.train_seq_len or run.config.max_seq_len]
        tasks = list(TASKS) if "all" in opts.tasks else [t for t in opts.tasks if t != "none"]
    except (CheckpointError, ValueError) as error:
        return _fail(str(error))
    print(f"kernelmix eval: {run.checkpoint} (step {run.step}, trained at T={run.train_seq_len}, "
          f"max_seq_len {run.config.max_seq_len}) on {opts.data}: {len(split)} documents, {split.num_tokens:,} tokens")
    try:
        reports = evaluate_loss(run.model, split, lengths, batch_size=opts.batch_size, buckets=opts.buckets,
                                train_seq_len=run.train_seq_len)
    except ValueError as error:
        return _fail(str(error))
    for r in reports:
        beyond = "  (beyond the training length)" if r.beyond_training_length else ""
        bpb = f", {r.bits_per_byte:.3f} bits/byte" if r.bits_per_byte is not None else ""
        print(f"T={r.seq_len:>5}: loss {r.loss:.4f}, perplexity {r.perplexity:.3f}{bpb} over {r.tokens:,} tokens{beyond}")
        for b in r.buckets:
            print(f"    positions [{b.start}, {b.end}): loss {b.loss:.4f} ({b.tokens:,} tokens)")
    output: dict[str, Any] = {"run": str(run.checkpoint), "step": run.step, "data": opts.data,
                              "losses": [r.to_dict() for r in reports]}
    if tasks:
        try:
            built = build_tasks(split, run.tokenizer, tasks=tasks, items=opts.items,
                                context_tokens=opts.context_tokens, seed=opts.seed)
            scores = score_tasks(run.model, run.tokenizer, built, batch_size=opts.batch_size, backend=opts.backend)
        except (ValueError, ImportError) as error:
            return _fail(str(error))
        for name, entry in scores.items():
            print(f"{name} ({opts.backend}): " + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
        output["tasks"] = scores
    if opts.json:
        write_json_atomic(opts.json, output, indent=1)
        print(f"wrote {opts.json}")
    return 0
