"""What pystdlib's code-page tables (``encodings/cp*.py``) do to validation numbers.

Five of pystdlib's validation documents are generated code-page tables (256-entry decoding tables).
This loads the seed-0 runs of the main job (``kernelmix compare``, default settings, run directories
under ``--runs``) and evaluates each on the whole validation split, on its code-page tables alone and
on the rest, and on the compare's own evaluation set (the first 512 tokens of the first 8 documents).
Writes ``--out`` (markdown). Usage, after the main job:

    python3 results/compare/code_pages.py --runs runs/compare --out results/compare/code-pages.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kernelmix.data import TokenizedSplit, prepare_dataset
from kernelmix.evaluate import cap_split, evaluate_loss
from kernelmix.studies.compare import CompareConfig
from kernelmix.training import load_run


def is_code_page(name: str) -> bool:
    return "encodings/cp" in name.replace("\\", "/")


def subset(split: TokenizedSplit, keep) -> TokenizedSplit:
    indices = [i for i in range(len(split)) if keep(split.doc_names[i])]
    return TokenizedSplit.from_token_lists([np.asarray(split.document(i), dtype=np.int64) for i in indices],
                                           name=split.name, names=[split.doc_names[i] for i in indices])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/compare", help="the main job's --out")
    parser.add_argument("--out", default="results/compare/code-pages.md")
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    config = CompareConfig(out_dir=args.runs)
    dataset = prepare_dataset(config.corpus, config.tokenizer)
    val = dataset.val
    whole, pages, own = "whole validation split", "code-page tables (encodings/cp*.py)", "compare's evaluation set"
    parts = {whole: val, pages: subset(val, is_code_page), "the rest": subset(val, lambda n: not is_code_page(n)),
             own: cap_split(val, doc_tokens=max(config.lengths), max_docs=config.eval_docs)}
    tokens = {label: int(np.maximum(split.doc_lengths - 1, 0).sum()) for label, split in parts.items()}
    started = time.perf_counter()
    rows = []
    for mixer in config.mixers:
        run_dir = config.run_dir(mixer, args.length, 0)
        if not run_dir.exists():
            raise SystemExit(f"{run_dir} does not exist: run the main job (kernelmix compare --out {args.runs}) first")
        model = load_run(run_dir, device="cpu").model
        losses = {label: evaluate_loss(model, split, args.length)[0].loss for label, split in parts.items()}
        rows.append((mixer, losses))
        print(mixer, {k: round(v, 4) for k, v in losses.items()}, flush=True)
    names = [n for n in val.doc_names if is_code_page(n)]
    lines = [
        "# The code-page tables in pystdlib's validation split",
        "",
        f"Made by `python3 results/compare/code_pages.py --runs {args.runs} --length {args.length}` from the seed-0 runs "
        f"of the main job (`kernelmix compare`, default settings) in {(time.perf_counter() - started) / 60:.1f} min. "
        f"Loss in nats per byte (byte tokens) at the runs' training length T = {args.length}, every window of "
        "each document (the evaluation of `kernelmix eval`).",
        "",
        f"The validation split has {len(val)} documents and {tokens[whole]:,} tokens to predict; {len(names)} are "
        f"generated code-page tables ({', '.join(sorted(names))}): {tokens[pages]:,} tokens, "
        f"{tokens[pages] / tokens[whole]:.1%} of the split. The compare's own evaluation set ({tokens[own]:,} tokens: "
        f"the first {max(config.lengths)} tokens of the first {config.eval_docs} documents) holds none of them.",
        "",
        "| mixer | " + " | ".join(f"{label} ({tokens[label]:,} tokens)" for label in parts) + " | whole − rest |",
        "|---|" + "---:|" * (len(parts) + 1),
    ]
    for mixer, losses in rows:
        gap = losses[whole] - losses["the rest"]
        lines.append(f"| {mixer} | " + " | ".join(f"{losses[label]:.4f}" for label in parts) + f" | {gap:+.4f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
