"""``kernelmix eval``: loss by length and position, and zero-shot tasks, of a trained run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..evaluate import BACKENDS, TASKS, build_tasks, cap_split, evaluate_loss, load_run, score_tasks
from ..training import CheckpointError

def add_command(sub) -> None:
    """Register ``kernelmix eval``."""
    p = sub.add_parser(
        "eval", help="loss/perplexity of a trained run at several context lengths, by position, + zero-shot tasks",
        description="Evaluate a `kernelmix train` run (its newest checkpoint, or a checkpoint directory): loss and "
        "perplexity at each --lengths (up to the model's max_seq_len; beyond the training length is marked), loss by "
        "position bucket within each window, and zero-shot continuation/cloze tasks built from held-out documents.",
    )
    p.add_argument("run", help="a run directory (kernelmix train --out) or a checkpoint directory")
    p.add_argument("--data", default="val", help="val (default) or train: the run's own split; or a text file/dir/glob/.jsonl")
    p.add_argument("--lengths", default=None, help="context lengths, e.g. 128,256,512,1024 (default: the training length)")
    p.add_argument("--buckets", default=None, help="position-bucket edges, e.g. 0,64,256,1024 (default ×4 from 64)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-docs", type=int, default=None, help="evaluate only the first N documents")
    p.add_argument("--doc-tokens", type=int, default=None, help="evaluate only the first N tokens of each document")
    p.add_argument("--tasks", default="none", help="zero-shot tasks: continuation,cloze | all | none (default)")
    p.add_argument("--items", type=int, default=100, help="items per zero-shot task")
    p.add_argument("--context-tokens", type=int, default=256, help="context of a zero-shot item (tokens)")
    p.add_argument("--backend", choices=BACKENDS, default="builtin", help="zero-shot scorer (lm-eval: pip install 'kernelmix[eval]')")
    p.add_argument("--seed", type=int, default=0, help="seed of the zero-shot task construction")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results as JSON to this path")
    p.set_defaults(func=_cli_eval, parser=p)


def _cli_eval(args) -> int:
    def fail(message: str) -> int:
        print(f"kernelmix eval: error: {message}", file=sys.stderr)
        return 2

    try:
        run = load_run(args.run, device=args.device)
        split = run.split(args.data)
        if args.max_docs or args.doc_tokens:
            split = cap_split(split, doc_tokens=args.doc_tokens, max_docs=args.max_docs)
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [run.train_seq_len or run.config.max_seq_len]
        tasks = list(TASKS) if args.tasks == "all" else [] if args.tasks == "none" else args.tasks.split(",")
    except (CheckpointError, ValueError) as error:
        return fail(str(error))
    print(f"kernelmix eval: {run.checkpoint} (step {run.step}, trained at T={run.train_seq_len}, "
          f"max_seq_len {run.config.max_seq_len}) on {args.data}: {len(split)} documents, {split.num_tokens:,} tokens")
    try:
        reports = evaluate_loss(run.model, split, lengths, batch_size=args.batch_size, buckets=args.buckets,
                                train_seq_len=run.train_seq_len)
    except ValueError as error:
        return fail(str(error))
    for r in reports:
        beyond = "  (beyond the training length)" if r.beyond_training_length else ""
        bpb = f", {r.bits_per_byte:.3f} bits/byte" if r.bits_per_byte is not None else ""
        print(f"T={r.seq_len:>5}: loss {r.loss:.4f}, perplexity {r.perplexity:.3f}{bpb} over {r.tokens:,} tokens{beyond}")
        for b in r.buckets:
            print(f"    positions [{b.start}, {b.end}): loss {b.loss:.4f} ({b.tokens:,} tokens)")
    output: dict[str, Any] = {"run": str(run.checkpoint), "step": run.step, "data": args.data,
                              "losses": [r.to_dict() for r in reports]}
    if tasks:
        try:
            built = build_tasks(split, run.tokenizer, tasks=tasks, items=args.items,
                                context_tokens=args.context_tokens, seed=args.seed)
            scores = score_tasks(run.model, run.tokenizer, built, batch_size=args.batch_size, backend=args.backend)
        except (ValueError, ImportError) as error:
            return fail(str(error))
        for name, entry in scores.items():
            print(f"{name} ({args.backend}): " + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
        output["tasks"] = scores
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0
