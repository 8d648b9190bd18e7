"""``kernelmix eval``: loss by length and position, and zero-shot tasks, of a trained run.

Every option is checked, the run loaded, the scope cut and the tasks built before the first
forward, so a bad option never costs an evaluation; the evaluation itself shows a progress bar
with an ETA on a terminal (as ``kernelmix train`` does) and a line per finished length otherwise.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from ..config import Arg, Choice, Distinct, Field, NonNegativeInt, PositiveInt, check
from ..evaluate.settings import BACKENDS, DEFAULT_DOC_TOKENS, DEFAULT_MAX_DOCS, TASKS, check_backend, parse_buckets
from ..output import progress_bar, write_json_atomic
from ..studies.settings import check_device
from .commands import summary
from .options import add_options, from_args

if TYPE_CHECKING:  # the evaluation and the run are imported when the command runs, not to parse it
    from ..evaluate import LossReport

All = Annotated[str, Choice(("all",), "value", more="or a positive integer")]


@dataclass
class EvalOptions:
    run: Annotated[str, Arg(positional=True), Field(description="a run directory (kernelmix train --out) "
                                                                "or a checkpoint directory")]
    data: Annotated[str, Field(description="val (default) or train: the run's own split; "
                                           "or a text file/dir/glob/.jsonl")] = "val"
    lengths: Annotated[list[Annotated[int, Field(ge=2)]], Distinct("length"), Field(min_length=1, description=(
        "context lengths, e.g. 128,256,512,1024 (default: the training length)"))] | None = None
    buckets: Annotated[list[NonNegativeInt], Field(description=(
        "position-bucket edges, e.g. 0,64,256,1024 (default ×4 from 64)"))] | None = None
    batch_size: Annotated[PositiveInt | None, Field(description=(
        "windows per forward (default: up to 16, fewer for long windows or a large vocabulary); "
        "8 for the tasks"))] = None
    max_docs: Annotated[PositiveInt | All, Field(description=(
        f"evaluate the first N documents of the split, or all (default: {DEFAULT_MAX_DOCS}; with --doc-tokens' "
        "default about 10 s a length for the small preset on 2 CPU cores)"))] = DEFAULT_MAX_DOCS
    doc_tokens: Annotated[PositiveInt | All | None, Field(description=(
        f"evaluate the first N tokens of each document, or all (default: {DEFAULT_DOC_TOKENS:,} or the longest "
        "--lengths if longer; whole documents with --max-docs all)"))] = None
    tasks: Annotated[list[str], Choice((*TASKS, "all", "none"), "task"), Distinct("task"), Field(
        description=f"zero-shot tasks: {','.join(TASKS)} | all | none (default)")] = (
        field(default_factory=lambda: ["none"]))
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
        "eval", help=summary("eval"),
        description="Evaluate a `kernelmix train` run (its newest checkpoint, or a checkpoint directory): loss and "
        "perplexity at each --lengths (up to the model's max_seq_len; beyond the training length is marked), loss by "
        "position bucket within each window, and zero-shot continuation/cloze tasks built from held-out documents. "
        f"By default the first {DEFAULT_MAX_DOCS} documents, {DEFAULT_DOC_TOKENS:,} tokens of each, are evaluated "
        "(the output says so); --max-docs all evaluates the whole split.",
    )
    add_options(p, EvalOptions)
    p.set_defaults(func=_cli_eval, parser=p)


def _fail(message: str) -> int:
    print(f"kernelmix eval: error: {message}", file=sys.stderr)
    return 2


@dataclass
class _Plan:
    """Everything the evaluation needs, each part already checked."""

    run: Any
    split: Any
    scope: Any
    lengths: list[int]
    tasks: dict[str, list[dict[str, Any]]]


def _check_json_path(path: str | None) -> None:
    """Refuse an output path that cannot be written now, not after the evaluation."""
    if path is None:
        return
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"--json {path!r} is a directory; give a file path, e.g. {str(target / 'eval.json')!r}")
    if not parent.is_dir():
        raise ValueError(f"--json {path!r}: the directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--json {path!r}: the directory {str(parent)!r} is not writable; give another path")


def _prepare(opts: EvalOptions) -> _Plan:
    """Load and check everything (device, output path, backend, run, lengths, buckets, scope,
    tasks) before the first forward."""
    from ..evaluate import build_tasks, check_lengths, scope_split
    from ..training import load_run

    check_device(opts.device)
    _check_json_path(opts.json)
    check_backend(opts.backend)
    run = load_run(opts.run, device=opts.device)
    lengths = check_lengths(run.model, opts.lengths or [run.train_seq_len or run.config.max_seq_len])
    if opts.buckets is not None:
        for T in lengths:
            parse_buckets(opts.buckets, T)
    split, scope = scope_split(run.split(opts.data), lengths, max_docs=opts.max_docs, doc_tokens=opts.doc_tokens)
    names = list(TASKS) if "all" in opts.tasks else [t for t in opts.tasks if t != "none"]
    tasks = build_tasks(split, run.tokenizer, tasks=names, items=opts.items, context_tokens=opts.context_tokens,
                        seed=opts.seed) if names else {}
    return _Plan(run=run, split=split, scope=scope, lengths=lengths, tasks=tasks)


def _print_report(r: LossReport) -> None:
    beyond = "  (beyond the training length)" if r.beyond_training_length else ""
    bpb = f", {r.bits_per_byte:.3f} bits/byte" if r.bits_per_byte is not None else ""
    print(f"T={r.seq_len:>5}: loss {r.loss:.4f}, perplexity {r.perplexity:.3f}{bpb} over {r.tokens:,} tokens "
          f"in {r.windows:,} windows{beyond}", flush=True)
    if r.full_windows == 0:
        print(f"    no window has {r.seq_len} tokens (every evaluated document is shorter): this is the loss of "
              "shorter windows; raise --doc-tokens or evaluate longer documents", flush=True)
    for b in r.buckets:
        if b.tokens:
            print(f"    positions [{b.start}, {b.end}): loss {b.loss:.4f} ({b.tokens:,} tokens)", flush=True)
        else:
            print(f"    positions [{b.start}, {b.end}): no token (no evaluated window reaches position {b.start})",
                  flush=True)


def _evaluate_losses(plan: _Plan, opts: EvalOptions, show_bar: bool) -> list[LossReport]:
    """One length at a time (its lines printed when it is done), under one bar over all of them."""
    from ..evaluate import evaluate_loss, predicted_tokens

    per_length = predicted_tokens(plan.split)
    bar = progress_bar(show_bar, "eval loss, tokens", per_length * len(plan.lengths), fields={"length": "T={}"})
    reports = []
    try:
        for index, T in enumerate(plan.lengths):
            offset = index * per_length
            bar.update(completed=offset, length=str(T))
            (report,) = evaluate_loss(
                plan.run.model, plan.split, [T], batch_size=opts.batch_size, buckets=opts.buckets,
                train_seq_len=plan.run.train_seq_len,
                progress=lambda _, done, offset=offset: bar.update(completed=offset + done),
            )
            reports.append(report)
            _print_report(report)
    finally:
        bar.close()
    return reports


def _score_tasks(plan: _Plan, opts: EvalOptions, show_bar: bool) -> dict[str, dict[str, float]]:
    from ..evaluate import score_tasks, task_requests

    total = task_requests(plan.tasks)
    if not show_bar:
        print(f"scoring {', '.join(plan.tasks)}: {total:,} log-likelihood requests ({opts.backend})", flush=True)
    bar = progress_bar(show_bar, "tasks, requests", total)
    try:
        scores = score_tasks(plan.run.model, plan.run.tokenizer, plan.tasks, batch_size=opts.batch_size or 8,
                             backend=opts.backend, progress=bar.advance)
    finally:
        bar.close()
    for name, entry in scores.items():
        print(f"{name} ({opts.backend}): " + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
    return scores


def _cli_eval(args) -> int:
    try:
        opts = from_args(EvalOptions, args)
    except ValueError as error:
        args.parser.error(str(error))
    from ..training import CheckpointError

    try:
        plan = _prepare(opts)
    except (CheckpointError, ValueError) as error:
        return _fail(str(error))
    run = plan.run
    print(f"kernelmix eval: {run.checkpoint} (step {run.step}, trained at T={run.train_seq_len}, "
          f"max_seq_len {run.config.max_seq_len}) on {plan.scope.describe()}", flush=True)
    show_bar = sys.stderr.isatty()  # as kernelmix train: a bar on a terminal, plain lines in a log
    try:
        reports = _evaluate_losses(plan, opts, show_bar)
        output: dict[str, Any] = {"run": str(run.checkpoint), "step": run.step, "data": opts.data,
                                  "scope": plan.scope.to_dict(), "losses": [r.to_dict() for r in reports]}
        if plan.tasks:
            output["tasks"] = _score_tasks(plan, opts, show_bar)
    except (ValueError, ImportError) as error:
        return _fail(str(error))
    if opts.json:
        write_json_atomic(opts.json, output, indent=1)
        print(f"wrote {opts.json}")
    return 0
