"""Running a compare: every (mixer, length, seed) trained and evaluated, or reused from its
``result.json`` (:func:`run_one`), then the whole comparison (:func:`run_compare`) with its
summary over seeds and its outputs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import Interrupted
from ...evaluate import ngram_losses
from ...locks import run_directory_lock
from ...output import write_json_atomic, write_text_atomic
from ...training.checkpoint import latest_checkpoint, writing
from ...training.signals import catch_stop_signals, signal_name
from ..flops import training_flops_per_token
from .budget import BudgetPlan, plan_budget
from .calibration import calibrate
from .plots import write_plots
from .report import flop_text, format_markdown
from .settings import REFERENCE_MIXER, RESULT_FORMAT, CompareConfig

def run_one(config: CompareConfig, mixer: str, length: int, seed: int, *, steps: int | None = None,
            flops_per_token: float | None = None, val_split=None, progress: bool | None = None,
            note: Callable[[str], None] = print, env=None) -> tuple[dict[str, Any], bool]:
    """Train and evaluate one (mixer, length, seed), or reuse its result. Returns (result, reused).
    ``steps``: the run's steps under the budget (default ``config.steps``); ``flops_per_token``:
    its training FLOPs per token (default: counted for the model in its ``config.json``). Under
    torchrun (``env``: the joined process group) every process trains its share and evaluates;
    only rank 0 touches the run directory's files outside training."""
    from ...evaluate import evaluate_loss
    from ...training import load_run
    from ...training import distributed as distrib

    env = env if env is not None else distrib.DistEnv()
    key, run_dir = config.run_key(mixer, length, seed, steps), config.run_dir(mixer, length, seed, steps)
    result_path = run_dir / "result.json"
    saved = saved_result(result_path, key)
    if saved is not None:
        return with_costs(saved, config.tokens_per_step, flops_per_token), True
    train_config = config.train_config(mixer, length, seed, run_dir, world_size=env.world_size, steps=steps)
    resume = latest_checkpoint(run_dir) is not None
    distrib.barrier(env)  # every process has decided before rank 0 changes anything
    if not resume and run_dir.exists() and env.is_main:  # interrupted before its only checkpoint: start over
        shutil.rmtree(run_dir)
    distrib.barrier(env)
    if resume:
        note(f"  resuming {run_dir}")
    trained = _train(train_config, resume, f"{mixer} T={length} seed {seed}", progress if env.is_main else False)
    distrib.barrier(env)  # the final checkpoint is on disk for every process

    started = time.perf_counter()
    run = load_run(run_dir, device=train_config.device if train_config.device != "auto" else "cpu")
    report = evaluate_loss(run.model, val_split, length, batch_size=config.eval_batch_size, buckets=config.buckets,
                           train_seq_len=length)[0]
    eval_s = time.perf_counter() - started

    curve, rates = _read_curve(run_dir / "metrics.jsonl")
    train_wall, tokens_per_s = trained.wall_s, trained.tokens_per_s
    if rates and (resume or not tokens_per_s):  # a resumed run: over all its logged steps, not this call's
        tokens_per_s = len(rates) / sum(1 / max(r, 1e-9) for r in rates)  # seconds per token, averaged per step
    result = {
        "format": RESULT_FORMAT,
        "key": key,
        "mixer": mixer,
        "length": length,
        "seed": seed,
        "batch_size": train_config.batch_size,
        "steps": trained.final_step,
        "tokens": trained.final_step * config.tokens_per_step,
        "parameters": run.model.num_parameters(),
        "val_loss": report.loss,
        "val_perplexity": report.perplexity,
        "val_tokens": report.tokens,
        "buckets": [{"start": b.start, "end": b.end, "loss": b.loss, "tokens": b.tokens} for b in report.buckets],
        "final_train_loss": curve[-1][2] if curve else None,
        "tokens_per_s": tokens_per_s,
        "train_wall_s": train_wall,
        "eval_s": eval_s,
        # not in the run's key (the settings are the same), but the rounding differs with the thread
        # count and the solve mixers' final loss moves with it (results/rounding)
        "threads": torch.get_num_threads(),
        "curve": curve,
        "run_dir": str(run_dir),
    }
    if flops_per_token is None:
        flops_per_token = training_flops_per_token(run.model.config, length)
    result = with_costs(result, config.tokens_per_step, flops_per_token)
    if env.is_main:
        with writing(result_path):
            write_json_atomic(result_path, result, indent=1)
    distrib.barrier(env)
    return result, False


def saved_result(path: Path, key: str) -> dict[str, Any] | None:
    """The finished run's ``result.json`` at ``path`` if it is one of these settings (``key``), else
    None (missing or damaged: the run, or its evaluation, is done again)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(saved, dict) and saved.get("key") == key and saved.get("format") == RESULT_FORMAT:
        return saved
    return None


def with_costs(result: dict[str, Any], tokens_per_step: int, flops_per_token: float | None) -> dict[str, Any]:
    """``result`` with what the run cost, whatever the budget: ``tokens``, ``flops`` (training
    FLOPs: tokens × ``flops_per_token``, analytic), ``flops_per_token`` and ``train_s`` (seconds of
    training steps: tokens / tokens/s). Runs saved before these were recorded get them here."""
    result = dict(result)
    result.setdefault("tokens", result["steps"] * tokens_per_step)
    if flops_per_token is None:
        flops_per_token = result.get("flops_per_token")
    if flops_per_token is None:
        flops_per_token = _flops_per_token_of(Path(result["run_dir"]), result["length"])
    result["flops_per_token"] = flops_per_token
    result["flops"] = None if flops_per_token is None else result["tokens"] * flops_per_token
    rate = result.get("tokens_per_s")
    result.setdefault("train_s", result["tokens"] / rate if rate else None)
    return result


def _flops_per_token_of(run_dir: Path, length: int) -> float | None:
    """Training FLOPs per token of the model a run directory's ``config.json`` describes (None: unreadable)."""
    from ...model import ModelConfig

    try:
        record = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        return training_flops_per_token(ModelConfig.from_dict(record["model"]), length)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _train(train_config, resume: bool, label: str, progress: bool | None):
    """:func:`kernelmix.training.train`; an interrupted run's error says how to continue the compare."""
    from ...training import train

    try:
        return train(train_config, resume=resume, progress=progress)
    except Interrupted as stop:  # the step is finished and checkpointed
        saved = latest_checkpoint(train_config.out_dir)
        where = f"its progress is saved in {str(saved)!r}" if saved is not None else "it had not finished a step"
        raise Interrupted(
            f"kernelmix compare interrupted by {signal_name(stop.signal_number)} while training {label}: {where}; run "
            "the same command again to continue (finished runs are reused, this one resumes)", stop.signal_number,
        ) from None


def _read_curve(metrics: Path) -> tuple[list[list], list[float]]:
    """``([step, tokens, loss], ...)`` and the tokens/s of each logged training step of a run."""
    curve, rates = [], []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train" and record.get("loss") is not None:  # null: a skipped, non-finite step
            curve.append([record["step"], record["tokens"], record["loss"]])
            rates.append(record["tokens_per_s"])
    return curve, rates


def _mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def summarize(config: CompareConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mixer, length): mean and spread (sample std over seeds) of val loss, tokens/s, wall;
    the mean steps, tokens, training FLOPs and training seconds."""
    rows = []
    for mixer in config.mixers:
        for length in config.lengths:
            group = [r for r in runs if r["mixer"] == mixer and r["length"] == length]
            if not group:
                continue
            loss, loss_sd = _mean_spread([r["val_loss"] for r in group])
            tps, tps_sd = _mean_spread([r["tokens_per_s"] for r in group])
            wall, _ = _mean_spread([r["train_wall_s"] for r in group])
            costs = {name: _mean_or_none([r.get(name) for r in group])
                     for name in ("steps", "tokens", "flops", "train_s")}
            buckets = []
            for i, b in enumerate(group[0]["buckets"]):
                mean, sd = _mean_spread([r["buckets"][i]["loss"] for r in group])
                buckets.append({"start": b["start"], "end": b["end"], "loss": mean, "loss_sd": sd})
            rows.append({
                "mixer": mixer, "length": length, "seeds": len(group), "val_loss": loss, "val_loss_sd": loss_sd,
                "val_perplexity": math.exp(loss), "tokens_per_s": tps, "tokens_per_s_sd": tps_sd,
                "train_wall_s": wall, "buckets": buckets, "parameters": group[0]["parameters"], **costs,
            })
    return rows


def run_compare(config: CompareConfig, *, progress: bool | None = None, console=None) -> dict[str, Any]:
    """Run (or reuse) every (mixer, length, seed), then write results.json, results.md and the
    plots into ``config.out_dir``. Returns the results.json content.

    Under ``torchrun --nproc_per_node=N -m kernelmix.cli compare ...`` the processes share every
    run (DDP, each a 1/N share of the step's windows: the same global batch and budget) and rank 0
    writes the outputs."""
    from ...training import distributed as distrib

    env = distrib.setup(config.device)
    try:
        with contextlib.ExitStack() as stack:
            if env.is_main:  # one compare per directory; refused before any data is read
                with writing(config.out_dir, "create the output directory"):
                    stack.enter_context(run_directory_lock(config.out_dir, "kernelmix compare"))
            return _run_compare(config, env, progress=progress, console=console)
    finally:
        distrib.teardown(env)


class TimeLeft:
    """The progress line's times: elapsed since the command started, and the time left. A run whose
    mixer and length already trained once in this invocation is expected to take what those took
    (their mean); any other run its expected cost (training FLOPs; under the time budget its
    calibrated seconds) at the seconds per unit of cost measured so far. Runs already finished on
    disk cost nothing. (One pooled rate for every mixer swung the estimate early: Cubit's many small
    ops cost several times their FLOPs' share of softmax's seconds.)"""

    def __init__(self, started: float, keys: list[tuple], weights: list[float], finished: list[bool]) -> None:
        self.started, self.keys, self.weights, self.finished = started, keys, weights, finished
        self.done_weight = self.done_seconds = 0.0
        self.measured: dict[tuple, list[float]] = {}

    def record(self, index: int, reused: bool, seconds: float) -> None:
        if not reused:
            self.done_weight += self.weights[index]
            self.done_seconds += seconds
            self.measured.setdefault(self.keys[index], []).append(seconds)

    def seconds_left(self, index: int) -> float | None:
        """Expected seconds of the run at ``index`` and every later one not finished on disk (None:
        nothing trained yet to estimate from; 0: the rest is reused)."""
        todo = [i for i in range(index, len(self.keys)) if not self.finished[i]]
        if not todo:
            return 0.0
        if not self.done_weight:
            return None
        rate = self.done_seconds / self.done_weight
        return sum(statistics.fmean(self.measured[self.keys[i]]) if self.keys[i] in self.measured
                   else self.weights[i] * rate for i in todo)

    def status(self, index: int) -> str:
        """Before the run at ``index`` (0-based): elapsed, and the time left for it and every later run."""
        elapsed = f"{_duration(time.perf_counter() - self.started)} elapsed"
        left = self.seconds_left(index)
        if left == 0:
            return f"{elapsed}, the rest reused"
        if left is None:
            return f"{elapsed}, time left known after the first run"
        return f"{elapsed}, about {_duration(left)} left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _run_plan(config: CompareConfig, plan: list, budget: BudgetPlan, val, env, progress: bool | None, note,
              started: float) -> tuple[list[dict], int]:
    """Every run of ``plan`` (reused or trained and evaluated); returns (results, how many were reused).
    A stop signal outside a run's training steps (its evaluation) lets that run's result be written
    first; inside them, train() checkpoints the step and :func:`_train` says how to continue."""
    from ...training import distributed as distrib

    steps = [budget.steps[m, t] for m, t, _ in plan]
    weights = [n * (budget.seconds_per_step[m, t] if budget.budget == "time"
                    else budget.flops_per_token[m, t] * config.tokens_per_step) for (m, t, _), n in zip(plan, steps)]
    finished = [saved_result(config.run_dir(m, t, s, n) / "result.json", config.run_key(m, t, s, n)) is not None
                for (m, t, s), n in zip(plan, steps)]
    clock, runs, reused_count = TimeLeft(started, [(m, t) for m, t, _ in plan], weights, finished), [], 0
    with catch_stop_signals() as signals:
        for index, (mixer, length, seed) in enumerate(plan, start=1):
            note(f"[bold cyan][{index}/{len(plan)}][/] {mixer} T={length} seed {seed} "
                 f"(batch {config.tokens_per_step // length} × {length}, {steps[index - 1]} steps) "
                 f"· {clock.status(index - 1)}")
            t0 = time.perf_counter()
            result, reused = run_one(config, mixer, length, seed, steps=steps[index - 1], val_split=val,
                                     progress=progress, flops_per_token=budget.flops_per_token[mixer, length],
                                     note=note, env=env)
            clock.record(index - 1, reused, time.perf_counter() - t0)
            runs.append(result)
            reused_count += reused
            note(
                f"      {'reused' if reused else 'done'}: eval loss {result['val_loss']:.4f}; {result['tokens']:,} "
                f"tokens, {flop_text(result['flops'])}, "
                f"train {result['train_s']:.1f} s ({result['tokens_per_s']:,.0f} tok/s)"
                + ("" if reused else f"; total {time.perf_counter() - t0:.0f} s")
            )
            number = distrib.agree_on_signal(env, signals.received)
            if number is not None and index < len(plan):
                raise Interrupted(f"kernelmix compare interrupted by {signal_name(number)} after {index} of "
                                  f"{len(plan)} runs (each one saved); run the same command again to continue", number)
    return runs, reused_count


def _budget_line(config: CompareConfig) -> str:
    """The start line's words for the equal budget."""
    tokens = f"{config.steps} steps × {config.tokens_per_step:,} tokens"
    if config.budget == "tokens":
        return f"equal budget: {config.tokens_per_run:,} tokens per run ({tokens})"
    if config.budget == "flops":
        return f"equal budget: training FLOPs, {REFERENCE_MIXER}'s for {tokens} at each length (analytic)"
    target = f"{config.seconds:g} s" if config.seconds is not None else f"{REFERENCE_MIXER}'s seconds for {tokens}"
    return f"equal budget: training time, {target} per run at each length (measured: noisy)"


def _check_data(config: CompareConfig, dataset, val) -> None:
    if val.num_tokens - len(val) <= 0:
        raise ValueError(f"corpus {config.corpus!r} has no validation text to evaluate on; use a larger corpus")
    if dataset.train.num_tokens < max(config.lengths) * 2:
        raise ValueError(
            f"corpus {config.corpus!r} has {dataset.train.num_tokens} training tokens, "
            f"too few for length {max(config.lengths)}"
        )


def _run_compare(config: CompareConfig, env, *, progress: bool | None, console) -> dict[str, Any]:
    from ...data import prepare_dataset
    from ...evaluate import cap_split
    from ...training import distributed as distrib

    if console is None:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
    # soft_wrap: a long status line is wrapped by the terminal, never cut mid-sentence at 80 columns
    note = (lambda text: console.print(text, soft_wrap=True)) if env.is_main else (lambda *a, **k: None)
    started = time.perf_counter()
    out = Path(config.out_dir)
    if not env.is_main:
        distrib.barrier(env)  # rank 0 builds the token cache first
    dataset = prepare_dataset(config.corpus, config.tokenizer)  # fails early on an unknown corpus
    if env.is_main:
        distrib.barrier(env)
    val = cap_split(dataset.val, doc_tokens=max(config.lengths), max_docs=config.eval_docs)
    _check_data(config, dataset, val)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(m, length, s) for s in config.seeds for length in config.lengths for m in config.mixers]
    note(
        f"[bold]kernelmix compare[/]: {len(config.mixers)} mixers × lengths {config.lengths} × seeds {config.seeds} = "
        f"{len(plan)} runs; preset {config.preset}, {config.corpus} / {config.tokenizer}; {_budget_line(config)}; "
        f"{torch.get_num_threads()} torch threads" + (f" × {env.world_size} processes" if env.enabled else "")
        + f"; output {out}. "
        "Each run's 'eval loss' is its final evaluation on the validation tokens, the figure results.md reports; the "
        "training log's 'val loss' lines are the run's own periodic check, on its own validation batches"
    )
    speeds = calibrate(config, env, note) if config.budget == "time" else None
    budget = plan_budget(config, dataset.vocab_size, speeds)
    runs, reused_count = _run_plan(config, plan, budget, val, env, progress, note, started)
    reference = ngram_losses(dataset.train, val, dataset.vocab_size)
    results = {
        "format": RESULT_FORMAT,
        "settings": config.to_dict(),
        "budget": budget.to_dict(config),
        "evaluation": {"split": "val", "documents": len(val), "tokens_per_document": max(config.lengths),
                       "predicted_tokens": int(val.num_tokens - len(val)), "at": "each run's training length"},
        # what a table of token frequencies / of which token follows which gets on the same tokens
        "reference": {**reference, "counted_on": "train split, add-one smoothing"},
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "device": config.device, "processes": env.world_size},
        "runs": runs,
        "summary": summarize(config, runs),
        "wall_s": time.perf_counter() - started,  # this invocation (reused runs cost ~nothing)
        "runs_wall_s": sum(r["train_wall_s"] + r["eval_s"] for r in runs),  # training + evaluation of all runs
        "reused_runs": reused_count,
    }
    if not env.is_main:
        return results
    with writing(out):
        results["plots"] = write_plots(results, out)  # first: results.md links the ones written
        write_text_atomic(out / "results.md", format_markdown(results))
        write_json_atomic(out / "results.json", results, indent=1)
    note(f"wrote {out / 'results.json'}, {out / 'results.md'} and {len(results['plots'])} plots "
         f"in {results['wall_s'] / 60:.1f} min")
    return results
