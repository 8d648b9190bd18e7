"""``kernelmix recall``: multi-query associative recall (MQAR) per mixer, model width and difficulty.

    from kernelmix.studies.recall import RecallConfig, run_recall
    results = run_recall(RecallConfig(mixers=["softmax", "performer"], pairs=[4, 16], steps=200))

For every (mixer, width, sequence length T, number of pairs) cell a fresh small
:class:`~kernelmix.model.CausalLM` (``layers`` blocks, ``heads`` heads, vocabulary
``vocab_size``) is trained on MQAR batches generated on the fly
(:func:`kernelmix.data.recall.mqar_batch`) and then scored on a held-out set: the fraction of
queried values it predicts exactly, on the query positions only
(:func:`~kernelmix.data.recall.query_accuracy`). The budget is equal per cell: ``steps`` updates
of ``batch_size`` sequences. Every mixer and width sees the same training batches and the same
held-out set for a (T, pairs): the training stream is seeded by (``seed``, T, pairs), the
held-out set by (``eval_seed``, T, pairs) — different seeds, so no held-out sequence is trained on
(except by a chance collision of random sequences). The initial weights come from ``seed``.

Output (``out_dir``, default ``runs/recall/``)::

    results.json                     settings, every cell (accuracy, final train loss, steps, tokens, seconds, seeds)
    results.md                       accuracy table: mixer × (T, pairs), one table per width
    accuracy_vs_pairs.png            accuracy against pairs, one panel per width, one line per mixer (and T)
    cells/<mixer>-w<W>-T<T>-p<N>-<hash>.json   each finished cell

A cell whose file exists for the same settings (the hash) is reused, so the same command run
again into the same ``out_dir`` only trains what is missing. SIGINT (Ctrl-C) or SIGTERM stops at
the next step: the cell in progress is dropped, the finished ones are kept, and
:class:`~kernelmix.errors.Interrupted` says to run the command again. ``out_dir`` is locked
(:func:`kernelmix.locks.run_directory_lock`) while a recall writes it. Mixer names as in
:mod:`kernelmix.studies.compare` (``cubit-nolrr``: Cubit without LRR).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..data.recall import key_range, mqar_batch, query_accuracy, value_range
from ..errors import Interrupted, KernelmixError
from ..locks import run_directory_lock
from ..model import CausalLM
from ..output import progress_bar, pyplot, write_json_atomic, write_text_atomic
from ..training import derived_seed, param_groups, warmup_cosine
from ..training.signals import StopSignals, catch_stop_signals, signal_name
from ..training.trainer import optimizer_step, set_lr
from .settings import RECALL_FORMAT as RESULT_FORMAT, RecallConfig

TARGET = 0.95  # the accuracy results.md marks as "solved"


def train_seed(config: RecallConfig, length: int, pairs: int) -> int:
    """The seed of a cell's training batches (shared by every mixer and width)."""
    return derived_seed("recall-train", config.seed, length, pairs)


def eval_seed(config: RecallConfig, length: int, pairs: int) -> int:
    """The seed of the held-out set of a (T, pairs)."""
    return derived_seed("recall-eval", config.eval_seed, length, pairs)


def held_out(config: RecallConfig, length: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(eval_seed(config, length, pairs))
    return mqar_batch(config.vocab_size, length, pairs, config.eval_examples, generator, power_a=config.power_a)


# ---------------------------------------------------------------------------------------------
# One cell


@torch.no_grad()
def evaluate_recall(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int) -> tuple[int, int]:
    """``(correct, total)`` of ``model`` on the query positions of a held-out set, in batches."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = total = 0
    for start in range(0, len(input_ids), batch_size):
        ids = input_ids[start:start + batch_size].to(device)
        right, scored = query_accuracy(model(ids).logits, labels[start:start + batch_size].to(device))
        correct, total = correct + right, total + scored
    model.train(was_training)
    return correct, total


def train_cell(config: RecallConfig, mixer: str, width: int, length: int, pairs: int, *, device: torch.device,
               signals: StopSignals | None = None, on_step: Callable[[int, float | None], None] | None = None,
               ) -> dict[str, Any]:
    """Train and evaluate one cell; returns its result. A stop signal recorded in ``signals``
    ends it at the next step with :class:`Interrupted` (the cell is not finished, nothing is
    saved). ``on_step(step, loss)``: after every update (loss every 10th step, else None)."""
    started = time.perf_counter()
    torch.manual_seed(derived_seed("recall-init", config.seed))
    model = CausalLM(config.model_config(mixer, width, length))
    # a token's identity must stay visible in the residual beside the mixers' outputs (std ~0.3 at init
    # 0.1): with the embedding at 0.1 as well the jump to recall came later
    torch.nn.init.normal_(model.embed.weight, std=config.embed_std)
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(train_seed(config, length, pairs))
    # "all": every slot of the query region asks a key, several times the supervised positions of the
    # held-out form per sequence, which lets recall be learned in fewer steps
    queries = (length - 2 * pairs) // 2 if config.train_queries == "all" else None
    curve: list[list[float]] = []  # [step, loss] every 10 steps: the loss as it was learned
    losses: list[float] = []
    skipped = 0

    def loss_of(batch):
        ids, labels = batch
        return model(ids.to(device), labels=labels.to(device)).loss

    for step in range(config.steps):
        if signals is not None and signals.received is not None:
            raise Interrupted(f"stopped by {signal_name(signals.received)}", signals.received)
        set_lr(optimizer, warmup_cosine(step, lr=config.lr, min_lr=config.min_lr, warmup_steps=config.warmup_steps,
                                        total_steps=config.steps))
        batch = mqar_batch(config.vocab_size, length, pairs, config.batch_size, generator, power_a=config.power_a,
                           num_queries=queries)
        outcome = optimizer_step(optimizer, [batch], loss_of, params=params, grad_clip=1.0, skip_non_finite=True)
        skipped += not outcome.updated
        loss = None
        if step % 10 == 9 or step >= config.steps - 10:  # one device sync per 10 steps, and every one of the last 10
            loss = float(outcome.loss)
            if step >= config.steps - 10:
                losses.append(loss)
            if step % 10 == 9:
                curve.append([step + 1, loss])
        if on_step is not None:
            on_step(step + 1, loss)
    train_s = time.perf_counter() - started
    eval_ids, eval_labels = held_out(config, length, pairs)
    correct, total = evaluate_recall(model, eval_ids, eval_labels, max(config.batch_size, 64))
    return {
        "format": RESULT_FORMAT, "key": config.run_key(mixer, width, length, pairs),
        "mixer": mixer, "width": width, "length": length, "pairs": pairs,
        "accuracy": correct / total, "correct": correct, "queries": total,
        "final_train_loss": sum(losses) / len(losses) if losses else None,
        "steps": config.steps, "tokens": config.steps * config.batch_size * length, "skipped_updates": skipped,
        "parameters": model.num_parameters(), "seconds": time.perf_counter() - started, "train_s": train_s,
        "seed": config.seed, "eval_seed": config.eval_seed, "curve": curve,
    }


# ---------------------------------------------------------------------------------------------
# The grid


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise KernelmixError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def cell_path(config: RecallConfig, mixer: str, width: int, length: int, pairs: int) -> Path:
    key = config.run_key(mixer, width, length, pairs)
    return Path(config.out_dir) / "cells" / f"{mixer}-w{width}-T{length}-p{pairs}-{key}.json"


def saved_cell(path: Path, key: str) -> dict[str, Any] | None:
    """The finished cell stored at ``path`` for these settings, or None (absent, damaged, other settings)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (saved if isinstance(saved, dict) and saved.get("key") == key and saved.get("format") == RESULT_FORMAT
            else None)


def plan(config: RecallConfig) -> list[tuple[str, int, int, int]]:
    """Every (mixer, width, T, pairs) to run, easiest difficulty first within a mixer."""
    return [(m, w, t, n) for w in config.widths for m in config.mixers for (t, n) in config.cells()]


def run_recall(config: RecallConfig, *, progress: bool | None = None, note: Callable[[str], None] | None = None,
               ) -> dict[str, Any]:
    """Run (or reuse) every cell of the grid, then write results.json, results.md and
    accuracy_vs_pairs.png into ``config.out_dir``; returns the results.json content.
    ``progress`` (default: when stderr is a terminal) shows a bar with the cell running, which of
    how many, and the time left; ``note`` (default: stderr) gets one line per cell."""
    note = note or (lambda text: print(text, file=sys.stderr))
    progress = sys.stderr.isatty() if progress is None else progress
    device = resolve_device(config.device)
    with run_directory_lock(config.out_dir, "kernelmix recall"):
        started = time.perf_counter()
        cells, reused = _run_cells(config, device, progress, note)
        results = {
            "format": RESULT_FORMAT,
            "settings": config.to_dict(),
            "task": {
                "filler": 0, "keys": [key_range(config.vocab_size).start, key_range(config.vocab_size).stop - 1],
                "values": [value_range(config.vocab_size).start, value_range(config.vocab_size).stop - 1],
                "scored": "the value after each query key (every key of the prefix is asked once)",
                "budget": f"{config.steps} steps x {config.batch_size} sequences per cell",
            },
            "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "device": str(device)},
            "cells": cells,
            "skipped": [{"length": t, "pairs": n, "why": f"4 x {n} pairs > T={t}"} for t, n in config.skipped()],
            "wall_s": time.perf_counter() - started,  # this invocation (reused cells cost ~nothing)
            "cells_wall_s": sum(c["seconds"] for c in cells),
            "reused_cells": reused,
        }
        out = Path(config.out_dir)
        write_text_atomic(out / "results.md", format_markdown(results))
        results["plots"] = [write_plot(results, out)]
        write_json_atomic(out / "results.json", results, indent=1)
    note(f"wrote {out / 'results.json'}, {out / 'results.md'} and {results['plots'][0]} in "
         f"{results['wall_s'] / 60:.1f} min")
    return results


def _run_cells(config: RecallConfig, device: torch.device, progress: bool, note: Callable[[str], None]):
    """Every cell of :func:`plan`, reused or trained (each saved as it finishes); returns (cells, reused)."""
    todo = plan(config)
    bar = progress_bar(progress, "recall", len(todo) * config.steps, fields={"run": "{}", "loss": "loss {}"})
    say = bar.print if progress else note
    cells, reused = [], 0
    try:
        with catch_stop_signals() as signals:
            for index, (mixer, width, length, pairs) in enumerate(todo, start=1):
                label = f"[{index}/{len(todo)}] {mixer} width {width} T={length} pairs {pairs}"
                path = cell_path(config, mixer, width, length, pairs)
                cell = saved_cell(path, config.run_key(mixer, width, length, pairs))
                if cell is not None:
                    reused += 1
                    say(f"{label}: accuracy {cell['accuracy']:.3f} (reused)")
                else:
                    bar.update(run=label, loss="-")
                    cell = _train_and_save(config, (mixer, width, length, pairs), path, device, signals, bar,
                                           done=index - 1, total=len(todo))
                    say(f"{label}: accuracy {cell['accuracy']:.3f}, {cell['seconds']:.0f} s")
                bar.update(completed=index * config.steps)
                cells.append(cell)
    finally:
        bar.close()
    return cells, reused


def _train_and_save(config: RecallConfig, cell: tuple[str, int, int, int], path: Path, device: torch.device,
                    signals: StopSignals, bar, *, done: int, total: int) -> dict[str, Any]:
    """:func:`train_cell` with the bar following its steps; the result written to ``path``. A stop
    signal drops this cell and says that the ``done`` finished ones are kept."""
    mixer, width, length, pairs = cell

    def on_step(step: int, loss: float | None) -> None:
        bar.update(completed=done * config.steps + step, **({"loss": f"{loss:.3f}"} if loss is not None else {}))

    try:
        result = train_cell(config, mixer, width, length, pairs, device=device, signals=signals, on_step=on_step)
    except Interrupted as stop:
        raise Interrupted(
            f"kernelmix recall interrupted by {signal_name(stop.signal_number)} in cell {done + 1} of {total} ({mixer} "
            f"width {width} T={length} pairs {pairs}, dropped); the {done} finished cells are kept in {path.parent}: "
            "run the same command again to continue", stop.signal_number) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result, indent=1)
    return result


# ---------------------------------------------------------------------------------------------
# Reports


def _difficulties(results: dict[str, Any]) -> list[tuple[int, int]]:
    return sorted({(c["length"], c["pairs"]) for c in results["cells"]})


def format_markdown(results: dict[str, Any]) -> str:
    """results.md: per width, accuracy on the query positions per mixer and (T, pairs)."""
    settings, cells = results["settings"], results["cells"]
    columns = _difficulties(results)
    by = {(c["mixer"], c["width"], c["length"], c["pairs"]): c for c in cells}
    lines = [
        f"# kernelmix recall — multi-query associative recall, {settings['layers']} layers, "
        f"{settings['heads']} head{'s' if settings['heads'] > 1 else ''}",
        "",
        f"Accuracy on the query positions of {settings['eval_examples']} held-out sequences per (T, pairs) "
        f"(eval seed {settings['eval_seed']}), after {settings['steps']} steps × {settings['batch_size']} sequences "
        f"(training seed {settings['seed']}, lr {settings['lr']}, vocabulary {settings['vocab_size']}). "
        f"**Bold**: ≥ {TARGET:.0%}; a model that only guesses one of the sequence's values scores about 1 / pairs. "
        f"Wall time {results['wall_s'] / 60:.1f} min for this invocation ({results['reused_cells']} of {len(cells)} "
        f"cells reused), {results['cells_wall_s'] / 60:.1f} min over all cells; {results['machine']['threads']} torch "
        f"thread{'s' if results['machine']['threads'] > 1 else ''} on {results['machine']['device']}.",
    ]
    for width in settings["widths"]:
        lines += ["", f"## width {width}", "",
                  "| mixer | " + " | ".join(f"T={t}, {n} pairs" for t, n in columns) + " | train s |",
                  "|---|" + "---:|" * (len(columns) + 1)]
        for mixer in settings["mixers"]:
            row = [by.get((mixer, width, t, n)) for t, n in columns]
            texts = ["–" if c is None else (f"**{c['accuracy']:.3f}**" if c["accuracy"] >= TARGET
                                            else f"{c['accuracy']:.3f}")
                     for c in row]
            seconds = sum(c["train_s"] for c in row if c is not None)
            lines.append(f"| {mixer} | " + " | ".join(texts) + f" | {seconds:.0f} |")
    if results["skipped"]:
        lines += ["", "Not run (a sequence of length T holds at most T / 4 pairs): "
                  + ", ".join(f"T={s['length']} with {s['pairs']} pairs" for s in results["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def write_plot(results: dict[str, Any], out: Path) -> str:
    """accuracy_vs_pairs.png: one panel per width, one line per mixer (a line style per T)."""
    plt = pyplot()
    settings, cells = results["settings"], results["cells"]
    widths, lengths = settings["widths"], sorted({c["length"] for c in cells})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(widths), figsize=(5.2 * len(widths), 4.2), sharey=True, squeeze=False)
    for ax, width in zip(axes[0], widths):
        for i, mixer in enumerate(settings["mixers"]):
            for j, length in enumerate(lengths):
                rows = sorted((c for c in cells if c["mixer"] == mixer and c["width"] == width
                               and c["length"] == length),
                              key=lambda c: c["pairs"])
                if rows:
                    ax.plot([c["pairs"] for c in rows], [c["accuracy"] for c in rows], marker="o", color=f"C{i}",
                            linestyle=styles[j % len(styles)],
                            label=mixer + (f" T={length}" if len(lengths) > 1 else ""))
        ax.axhline(TARGET, color="grey", linewidth=0.8, linestyle=":")
        chance = sorted({c["pairs"] for c in cells})
        ax.plot(chance, [1 / n for n in chance], color="grey", linewidth=1, linestyle="--", label="1 / pairs (a guess)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(settings["pairs"], [str(n) for n in settings["pairs"]])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("key-value pairs per sequence")
        ax.set_title(f"width {width}" + (f", T={lengths[0]}" if len(lengths) == 1 else ""))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall accuracy on query positions")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"MQAR, {settings['layers']}-layer models, {settings['steps']} steps x {settings['batch_size']} "
                 f"sequences per cell\n(dotted: {TARGET:.0%}; dashed: a guess among the values)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_pairs.png", dpi=110)
    plt.close(fig)
    return "accuracy_vs_pairs.png"


__all__ = [
    "RESULT_FORMAT", "RecallConfig", "cell_path", "eval_seed", "evaluate_recall", "format_markdown", "held_out", "plan",
    "run_recall", "train_cell", "train_seed", "write_plot",
]
