"""``kernelmix compare``: train every mixer the same way and compare them — the README's main job.

    from kernelmix.studies.compare import CompareConfig, run_compare
    summary = run_compare(CompareConfig(mixers=["softmax", "cubit"], lengths=[256, 512], steps=60))

For every (mixer, training length, seed) one run of :func:`kernelmix.training.train` with the
same preset, corpus, tokenizer, optimizer settings and **budget**. Every step sees
``tokens_per_step`` tokens at every length (``batch = tokens_per_step / length``); ``budget``
says what is equal between the mixers at one length:

* ``"tokens"`` (default): every run trains ``steps`` steps, the same tokens.
* ``"flops"``: every run gets the training FLOPs softmax spends on ``steps × tokens_per_step``
  tokens at that length (analytic counts, :mod:`kernelmix.studies.flops`, the ones ``kernelmix
  bench`` reports): ``round(those FLOPs / (its FLOPs per token × tokens_per_step))`` steps. A budget
  that rounds to no step for some mixer is refused (one step would exceed it, under either budget).
* ``"time"``: every run gets the same seconds of training on this machine: ``seconds``, or by
  default the seconds softmax takes for ``steps`` steps at that length. Each mixer's seconds per
  step are measured first (a calibration: ``calibration_steps`` timed steps after
  :data:`CALIBRATION_WARMUP` untimed ones, the median; kept in ``calibration.json`` so that the
  same command reuses them and its finished runs), and it trains ``round(seconds / its seconds
  per step)`` steps. Measured time is noisy (±10–30% on a shared machine), so the seconds the runs
  actually took are reported beside the target.

A run of other steps than ``steps`` scales its warmup to its own steps (the cosine decay always
ends at its last step). Whatever the budget, every run reports its tokens, training FLOPs and
training seconds. The seed sets the initial weights and the order of the training windows;
different mixers with the same seed see exactly the same training windows (a longer run sees
more of them).

Each finished run is evaluated on the same held-out tokens (the first ``max(lengths)`` tokens of
``eval_docs`` validation documents; :func:`kernelmix.evaluate.evaluate_loss`) at its training
length: loss, perplexity and loss by token position in the window.

Output (``out_dir``, default ``runs/compare/``)::

    results.json              settings, the budget, every run, the mean ± spread over seeds per (mixer, length)
    results.md                which budget was equal, the tables
    val_loss_vs_length.png    validation loss vs training length per mixer
    loss_curves.png           training loss vs tokens, one panel per length
    throughput.png            training tokens/s per mixer and length
    loss_by_position.png      validation loss by position bucket at the longest length
    calibration.json          --budget time: the measured seconds per step of each mixer and length
    runs/<mixer>-T<len>-s<seed>-<hash>/   each run's train() directory + result.json

Resumable: a run whose ``result.json`` exists for the same settings (the hash in its directory
name: the training settings, its steps, the evaluation and, unless it is tokens, the budget) is
reused; one that was interrupted after a checkpoint is resumed (bitwise on CPU); an interrupted
one without a checkpoint is started again. SIGINT (Ctrl-C) or SIGTERM during a run's training
finishes its step and checkpoints it; during its evaluation, the evaluation is finished and saved;
either way the compare stops with :class:`kernelmix.errors.Interrupted` and the same command
continues it. One writer at a time: ``out_dir`` is locked (:func:`kernelmix.locks.run_directory_lock`)
while a compare writes it.

Mixer names: the registry's (softmax, cubit, deltaformer, performer, darkformer) and
``cubit-nolrr`` (Cubit with ``mixer_options cubit.lrr=false``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

import torch

from ..config import Arg, Choice, Distinct, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..errors import Interrupted, KernelmixError
from ..evaluate import ngram_losses, parse_buckets
from ..locks import run_directory_lock
from ..model import PRESETS
from ..output import pyplot, write_json_atomic, write_text_atomic
from ..training.checkpoint import latest_checkpoint, writing
from ..training.config import ACTIVATION_CHECKPOINTING
from ..training.signals import catch_stop_signals, signal_name
from .flops import training_flops_per_token

# name → (registry mixer, mixer_options)
MIXER_VARIANTS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "softmax": ("softmax", {}),
    "cubit": ("cubit", {}),
    "cubit-nolrr": ("cubit", {"cubit": {"lrr": False}}),
    "deltaformer": ("deltaformer", {}),
    "performer": ("performer", {}),
    "darkformer": ("darkformer", {}),
}
DEFAULT_MIXERS = list(MIXER_VARIANTS)
RESULT_FORMAT = "kernelmix.compare/1"
CALIBRATION_FORMAT = "kernelmix.compare.calibration/1"
BUDGETS = ("tokens", "flops", "time")
# The TrainConfig fields a run key has always held. A field added to TrainConfig later enters the
# key only when it is not at its default, so adding one (activation checkpointing, compile, ...)
# does not change the keys of finished runs, and they stay reusable.
KEYED_TRAIN_FIELDS = frozenset({
    "batch_size", "betas", "bf16", "checkpoint_every", "corpus", "cross_documents", "device", "eval_batches",
    "eval_every", "fsdp", "grad_accum", "grad_clip", "keep_checkpoints", "log_every", "lr", "min_lr", "model",
    "preset", "redraw_every", "seed", "seq_len", "steps", "tokenizer", "tokens", "val_fraction", "warmup_steps",
    "weight_decay",
})
#: the mixer whose cost for ``steps × tokens_per_step`` tokens is the FLOP and time budgets
REFERENCE_MIXER = "softmax"
#: untimed training steps before a calibration's timed ones (first-call allocations, warm caches)
CALIBRATION_WARMUP = 2


@dataclass
class CompareConfig:
    """What ``kernelmix compare`` trains. The defaults (the ``mini`` preset: 4 layers, width 128,
    ~0.8–0.9M parameters; byte-level ``pystdlib``; 6 mixers × lengths 256 and
    512 × 1 seed; 300 steps × 2,048 tokens per run, equal tokens — ``budget``: see the module
    docstring) are the cheapest measured setting in which softmax ends at least 0.3 nats below the
    bigram line at every length, i.e. past the regime where only byte statistics are learned
    (results/compare-frontier); the README states how long they take."""

    mixers: Annotated[list[str], Choice(MIXER_VARIANTS, "mixer"), Distinct("mixer"), Field(min_length=1, description="comma-separated")] = (
        field(default_factory=lambda: list(DEFAULT_MIXERS)))
    lengths: Annotated[list[Annotated[int, Field(ge=2)]], Distinct("length"), Field(min_length=1, description="training lengths")] = (
        field(default_factory=lambda: [256, 512]))
    seeds: Annotated[list[NonNegativeInt], Distinct("seed"), Field(min_length=1, description="seeds, e.g. 0,1,2 (mean ± spread over them)")] = (
        field(default_factory=lambda: [0]))
    # "mini", not "tiny": tiny's 2 × 64 stayed between the unigram and bigram lines in any budget of
    # minutes (results/compare-frontier)
    preset: Annotated[str, Choice(PRESETS, "preset")] = "mini"
    model: Annotated[dict[str, Any], Arg(cli=False), Field(examples=["model.hidden_size=128"])] = (
        field(default_factory=dict))  # extra ModelConfig overrides for every run
    corpus: str = "pystdlib"
    tokenizer: str = "byte"
    tokens_per_step: Annotated[PositiveInt, Field(description="tokens per step at every length (batch = this / length)")] = 2048
    steps: Annotated[PositiveInt, Field(description=(
        "optimizer steps per run (--budget flops/time: softmax's, which sets the budget)"))] = 300
    budget: Annotated[str, Choice(BUDGETS, "budget"), Field(description=(
        "what every mixer gets the same of at a length: tokens (--steps × --tokens-per-step), flops (the training "
        "FLOPs softmax spends on those tokens, analytic) or time (the seconds softmax takes for them here, or "
        "--seconds; measured, so noisy)"))] = "tokens"
    seconds: Annotated[PositiveFloat | None, Field(description=(
        "--budget time: training seconds per run at every length (default: softmax's seconds for --steps steps "
        "at that length)"))] = None
    calibration_steps: Annotated[PositiveInt, Field(description=(
        f"--budget time: timed training steps that measure each mixer's seconds per step at each length (after "
        f"{CALIBRATION_WARMUP} untimed ones; the median is used)"))] = 5
    lr: Annotated[PositiveFloat, Field(description="peak learning rate")] = 3e-3
    min_lr: Annotated[NonNegativeFloat | None, Field(description="the cosine decay's end (default: lr / 10)")] = None
    warmup_steps: NonNegativeInt = 20
    eval_docs: Annotated[PositiveInt, Field(
        description="validation documents evaluated (their first max(lengths) tokens each)")] = 8
    eval_batch_size: PositiveInt = 4
    buckets: Annotated[list[NonNegativeInt], Field(description="position-bucket edges, e.g. 0,64,256 (default 0,64,256,1024,…)")] | None = None
    out_dir: Annotated[str, Arg(flag="--out"), Field(description="output directory")] = "runs/compare"
    device: Annotated[str, Choice(("auto", "cpu", "cuda"), "device")] = "cpu"
    activation_checkpointing: Annotated[str, Choice(ACTIVATION_CHECKPOINTING, "activation_checkpointing"), Field(
        description="recompute in the backward instead of storing (as kernelmix train's); same numbers, less memory")] = "none"
    activation_checkpointing_every: Annotated[PositiveInt, Field(
        description="with activation_checkpointing=selective: every k-th block is recomputed")] = 2
    compile: Annotated[bool, Field(description="torch.compile each block (as kernelmix train's)")] = False

    def __post_init__(self) -> None:
        check(self)
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if self.buckets is not None:  # now, not after the first run has trained
            parse_buckets(self.buckets, max(self.lengths))
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be at most lr, got min_lr={self.min_lr}, lr={self.lr}; lower min_lr or leave it out (lr / 10)")
        for length in self.lengths:
            if self.tokens_per_step % length:
                raise ValueError(
                    f"tokens_per_step {self.tokens_per_step} is not a multiple of length {length}: every length must get "
                    f"the same tokens per step (batch = tokens_per_step / length); use lengths that divide it"
                )
        self.lengths = sorted(self.lengths)
        if self.seconds is not None and self.budget != "time":
            raise KernelmixError(f"--seconds sets the time budget, but the budget is {self.budget!r}: add --budget time, "
                                 "or drop --seconds")
        if "model" in self.model:
            raise KernelmixError("compare's model overrides are model fields without a 'model.' prefix: write "
                                 "--set hidden_size=128, not --set model.hidden_size=128")
        if {"mixer", "mixers"} & set(self.model):
            raise KernelmixError("compare sets each run's mixer from --mixers, so a model override of mixer/mixers "
                                 "would be overwritten: drop it and pass --mixers (e.g. --mixers softmax,cubit)")
        bases = sorted({MIXER_VARIANTS[mixer][0] for mixer in self.mixers})
        unused = sorted(set(self.model.get("mixer_options", {})) - set(bases))
        if unused:
            raise KernelmixError(
                f"mixer_options for {', '.join(unused)}, which no compared run uses (the runs' mixers: "
                f"{', '.join(bases)}); drop those options or add the mixer to --mixers")
        for mixer in self.mixers:  # a bad model override fails now, not after the first runs
            self.train_config(mixer, self.lengths[-1], self.seeds[0], "unused")

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.tokens_per_step

    def model_overrides(self, mixer: str) -> dict[str, Any]:
        base, options = MIXER_VARIANTS[mixer]
        overrides = json.loads(json.dumps(self.model))
        overrides["mixer"] = base
        merged = dict(overrides.get("mixer_options", {}))
        for name, opts in options.items():
            merged[name] = {**merged.get(name, {}), **opts}
        # --model options for another compared mixer (mixer_options.performer.* while this run is
        # cubit) are that mixer's: the model would refuse options for a mixer it does not have
        merged = {name: opts for name, opts in merged.items() if name == base}
        if merged:
            overrides["mixer_options"] = merged
        else:
            overrides.pop("mixer_options", None)
        # every run has the same model (positions up to the longest length), whatever its length
        overrides.setdefault("max_seq_len", max(max(self.lengths), PRESETS[self.preset]["max_seq_len"]))
        return overrides

    def warmup_for(self, steps: int) -> int:
        """The warmup of a run of ``steps`` steps: ``warmup_steps`` scaled to them (``steps`` itself: unchanged)."""
        return self.warmup_steps if steps == self.steps else round(self.warmup_steps * steps / self.steps)

    def train_config(self, mixer: str, length: int, seed: int, out_dir: str | Path, world_size: int = 1,
                     steps: int | None = None):
        """The run's TrainConfig (``steps``: its own step count under the FLOP or time budget, default
        ``self.steps``); under torchrun each of ``world_size`` processes takes an equal share of the
        step's windows, so the global batch (and the budget) does not depend on the process count."""
        from ..training import TrainConfig

        steps = self.steps if steps is None else steps
        windows = self.tokens_per_step // length
        if windows % world_size:
            raise ValueError(f"{windows} windows per step at length {length} do not split over {world_size} processes; "
                             f"choose --tokens-per-step a multiple of {length * world_size}")
        return TrainConfig(
            preset=self.preset, model=self.model_overrides(mixer), corpus=self.corpus, tokenizer=self.tokenizer,
            seq_len=length, batch_size=windows // world_size, steps=steps, lr=self.lr,
            min_lr=self.min_lr, warmup_steps=self.warmup_for(steps), seed=seed, device=self.device,
            eval_every=0, eval_batches=1, log_every=max(1, steps // 10), checkpoint_every=0,
            keep_checkpoints=1, out_dir=str(out_dir), activation_checkpointing=self.activation_checkpointing,
            activation_checkpointing_every=self.activation_checkpointing_every, compile=self.compile,
        )

    def run_key(self, mixer: str, length: int, seed: int, steps: int | None = None) -> str:
        """A hash of everything that defines the run and its evaluation (not out_dir)."""
        train_config = self.train_config(mixer, length, seed, "", steps=steps)
        defaults = type(train_config)().to_dict()
        # where a run is and what it recomputes (bitwise the same numbers): not what it computes. Every
        # other field is keyed, max_bad_steps too: it decides whether a run with skipped steps finishes
        unkeyed = {"out_dir", "activation_checkpointing", "activation_checkpointing_every"}
        settings = {name: value for name, value in train_config.to_dict().items()
                    if name not in unkeyed and (name in KEYED_TRAIN_FIELDS or value != defaults[name])}
        settings["eval"] = {"docs": self.eval_docs, "doc_tokens": max(self.lengths), "buckets": self.buckets}
        if self.budget != "tokens":  # (the token budget's keys are those of the runs made before budgets existed)
            settings["budget"] = self.budget
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]

    def run_dir(self, mixer: str, length: int, seed: int, steps: int | None = None) -> Path:
        return Path(self.out_dir) / "runs" / f"{mixer}-T{length}-s{seed}-{self.run_key(mixer, length, seed, steps)}"

    def flops_per_token(self, mixer: str, length: int, vocab_size: int) -> float:
        """Training FLOPs per token of ``mixer``'s model at ``length`` (:mod:`kernelmix.studies.flops`)."""
        model = self.train_config(mixer, length, 0, "").model_config(vocab_size)
        return training_flops_per_token(model, length)

    def calibration_config(self, mixer: str, length: int, out_dir: str | Path, world_size: int = 1):
        """The TrainConfig that measures ``mixer``'s seconds per step at ``length`` (--budget time):
        the run's settings, :data:`CALIBRATION_WARMUP` + ``calibration_steps`` steps, each one logged."""
        steps = CALIBRATION_WARMUP + self.calibration_steps
        run = self.train_config(mixer, length, self.seeds[0], out_dir, world_size)
        return dataclasses.replace(run, steps=steps, warmup_steps=0, log_every=1)

    def calibration_key(self, mixer: str, length: int, world_size: int = 1) -> str:
        """A hash of what a calibration's speed depends on: its training settings, processes and threads."""
        settings = self.calibration_config(mixer, length, "", world_size).to_dict()
        settings.pop("out_dir")
        settings.update(processes=world_size, threads=torch.get_num_threads())
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Budgets


@dataclass
class BudgetPlan:
    """What every (mixer, length) trains under a config's budget: ``steps``; ``flops_per_token``
    (training FLOPs); ``reference``: per length, the equal amount per run (tokens, FLOPs or
    seconds); ``seconds_per_step``: the time budget's calibration (else empty)."""

    budget: str
    steps: dict[tuple[str, int], int]
    flops_per_token: dict[tuple[str, int], float]
    reference: dict[int, float]
    seconds_per_step: dict[tuple[str, int], float] = field(default_factory=dict)

    def to_dict(self, config: CompareConfig) -> dict[str, Any]:
        """The ``budget`` record of results.json (the token budget's has the fields it always had)."""
        tokens = config.tokens_per_run
        if self.budget == "tokens":
            return {"equal": "tokens", "tokens_per_run": tokens, "tokens_per_step": config.tokens_per_step,
                    "steps": config.steps, "note": "equal training tokens per run; mixers differ in cost per token, "
                    "see each run's flops and train_s"}
        record = {
            "equal": self.budget, "tokens_per_step": config.tokens_per_step, "steps": config.steps,
            "reference": "--seconds" if config.seconds is not None else REFERENCE_MIXER,
            ("flops_per_run" if self.budget == "flops" else "seconds_per_run"): {str(t): v for t, v in self.reference.items()},
            "steps_per_run": {m: {str(t): self.steps[m, t] for t in config.lengths} for m in config.mixers},
        }
        if self.budget == "flops":
            record["note"] = (f"equal training FLOPs per run: {REFERENCE_MIXER}'s for {config.steps} steps × "
                              f"{config.tokens_per_step:,} tokens at each length (analytic counts, kernelmix.studies.flops); "
                              "each mixer trains round(those FLOPs / its FLOPs per step) steps, its warmup scaled to them")
        else:
            record["seconds_per_step"] = {m: {str(t): v for (m2, t), v in self.seconds_per_step.items() if m2 == m}
                                          for m in sorted({m for m, _ in self.seconds_per_step})}
            record["note"] = ("equal training seconds per run on this machine, from a calibration of each mixer's seconds "
                              "per step; measured, so noisy (±10-30% on a shared machine): compare each run's train_s")
        return record


def plan_budget(config: CompareConfig, vocab_size: int, seconds_per_step: dict[tuple[str, int], float] | None = None) -> BudgetPlan:
    """The steps of every (mixer, length) under ``config.budget``: ``config.steps`` for tokens; for
    FLOPs and time ``round(reference / cost of one step)`` (a KernelmixError where that is 0), the reference being what
    :data:`REFERENCE_MIXER` spends on ``steps × tokens_per_step`` tokens (time: ``config.seconds``
    when given). ``seconds_per_step``: the time budget's calibration, per (mixer, length)."""
    if config.budget == "time" and seconds_per_step is None:
        raise ValueError("the time budget needs the calibration's seconds_per_step (see calibrate)")
    tokens = config.steps * config.tokens_per_step
    mixers = list(dict.fromkeys([*config.mixers, REFERENCE_MIXER]))
    flops = {(m, t): config.flops_per_token(m, t, vocab_size) for m in mixers for t in config.lengths}
    steps: dict[tuple[str, int], int] = {}
    reference: dict[int, float] = {}
    for length in config.lengths:
        if config.budget == "tokens":
            reference[length] = float(tokens)
            steps.update({(m, length): config.steps for m in config.mixers})
            continue
        if config.budget == "flops":
            reference[length] = tokens * flops[REFERENCE_MIXER, length]
            step_cost = {m: flops[m, length] * config.tokens_per_step for m in config.mixers}
        else:
            reference[length] = (config.seconds if config.seconds is not None
                                 else config.steps * seconds_per_step[REFERENCE_MIXER, length])
            step_cost = {m: seconds_per_step[m, length] for m in config.mixers}
        short = {m: step_cost[m] for m in config.mixers if round(reference[length] / step_cost[m]) < 1}
        if short:  # one step would be over the budget, and the results would claim the budget
            raise KernelmixError(_budget_below_one_step(config, length, reference[length], short))
        for mixer in config.mixers:  # round() ties to even
            steps[mixer, length] = round(reference[length] / step_cost[mixer])
    return BudgetPlan(config.budget, steps, flops, reference, dict(seconds_per_step or {}))


def _budget_below_one_step(config: CompareConfig, length: int, budget: float, cost: dict[str, float]) -> str:
    """The message for a budget that buys some mixer less than half a training step at ``length``."""
    unit = "s" if config.budget == "time" else " FLOPs"
    worst = max(cost, key=cost.get)
    given = f"--seconds {config.seconds:g}" if config.seconds is not None else (
        f"--steps {config.steps} of {REFERENCE_MIXER} ({budget:.3g}{unit})")
    needed = f"--seconds {2 * cost[worst]:.2g} or more" if config.seconds is not None else (
        f"--steps {math.ceil(config.steps * cost[worst] / budget)} or more")
    each = ", ".join(f"{m} {c:.3g}{unit}" for m, c in cost.items())
    return (f"the {config.budget} budget at length {length}, {given}, is less than one training step of "
            f"{', '.join(cost)} (one step: {each}): each would train one step, over the budget, while the results "
            f"claim the budget; give {needed}")


def calibrate(config: CompareConfig, env, note: Callable[[str], None] = print) -> dict[tuple[str, int], float]:
    """--budget time: the seconds per training step of every compared mixer (and of
    :data:`REFERENCE_MIXER` unless ``config.seconds`` is given) at every length, measured in a short
    run of :meth:`CompareConfig.calibration_config` each, or read from ``calibration.json`` where it
    was measured before with the same settings (so the same command reuses its finished runs;
    delete the file to measure again). A stop signal keeps what was measured."""
    from ..training import distributed as distrib

    path = Path(config.out_dir) / "calibration.json"
    saved = _read_calibrations(path)
    distrib.barrier(env)  # every process has read it before rank 0 adds to it
    mixers = list(dict.fromkeys([*config.mixers, *([REFERENCE_MIXER] if config.seconds is None else [])]))
    keys = {(m, t): config.calibration_key(m, t, env.world_size) for t in config.lengths for m in mixers}
    known = sum(key in saved for key in keys.values())
    if known:
        note(f"  {known} of {len(keys)} speeds (seconds per step) from {path}, measured before with these settings; "
             "delete it to measure them again")
    measured = {}
    with catch_stop_signals() as signals:
        for length in config.lengths:
            for mixer in mixers:
                key = keys[mixer, length]
                if key not in saved:
                    saved[key] = _measure_step_seconds(config, mixer, length, env)
                    if env.is_main:
                        with writing(path):
                            write_json_atomic(path, {"format": CALIBRATION_FORMAT, "entries": saved}, indent=1)
                    note(f"  calibrated {mixer} T={length}: {saved[key]['seconds_per_step']:.3g} s per step (median of "
                         f"{config.calibration_steps} steps after {CALIBRATION_WARMUP} untimed)")
                    number = distrib.agree_on_signal(env, signals.received)
                    if number is not None:
                        raise Interrupted(f"kernelmix compare interrupted by {signal_name(number)} while measuring the "
                                          f"mixers' speeds for --budget time; the ones measured are kept in {str(path)!r}: "
                                          "run the same command again to continue", number)
                measured[mixer, length] = float(saved[key]["seconds_per_step"])
    if env.is_main:
        with contextlib.suppress(OSError):
            (Path(config.out_dir) / "calibration").rmdir()  # the calibrations' scratch space, if empty
    return measured


def _read_calibrations(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of ``calibration.json`` (none when it is missing or damaged: measured again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("seconds_per_step"), (int, float))}


def _measure_step_seconds(config: CompareConfig, mixer: str, length: int, env) -> dict[str, Any]:
    """Train ``mixer`` at ``length`` for the calibration's steps in a scratch directory (removed
    after) and return its seconds per step: the median over the timed steps of each step's time as
    train() logs it (the same clock as a run's tokens/s: optimizer steps only)."""
    from ..training import distributed as distrib
    from ..training import train

    directory = Path(config.out_dir) / "calibration" / f"{mixer}-T{length}"
    train_config = config.calibration_config(mixer, length, directory, env.world_size)
    if env.is_main and directory.exists():  # a calibration interrupted earlier: measured again from the start
        shutil.rmtree(directory)
    distrib.barrier(env)
    try:
        train(train_config, progress=False)
    except Interrupted as stop:
        raise Interrupted(
            f"kernelmix compare interrupted by {signal_name(stop.signal_number)} while measuring the speed of {mixer} at "
            f"T={length} for --budget time; the speeds measured before are kept in calibration.json: run the same "
            "command again to continue", stop.signal_number) from None
    distrib.barrier(env)
    rates = _step_rates(directory / "metrics.jsonl")[CALIBRATION_WARMUP:]
    distrib.barrier(env)  # every process has read the metrics
    if env.is_main:
        shutil.rmtree(directory, ignore_errors=True)
    if not rates:
        raise KernelmixError(f"the calibration of {mixer} at T={length} logged no timed step; raise --calibration-steps")
    step_seconds = [config.tokens_per_step / rate for rate in rates]
    return {"mixer": mixer, "length": length, "seconds_per_step": statistics.median(step_seconds),
            "step_seconds": step_seconds, "untimed_steps": CALIBRATION_WARMUP, "threads": torch.get_num_threads(),
            "processes": env.world_size, "device": config.device}


def _step_rates(metrics: Path) -> list[float]:
    """The tokens/s of every logged training step of a run, in order (skipped updates too: they took the time)."""
    rates = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == "train" and record.get("tokens_per_s"):
                rates.append(float(record["tokens_per_s"]))
    return rates


# ---------------------------------------------------------------------------------------------
# One run


def run_one(config: CompareConfig, mixer: str, length: int, seed: int, *, steps: int | None = None,
            flops_per_token: float | None = None, val_split=None, progress: bool | None = None,
            note: Callable[[str], None] = print, env=None) -> tuple[dict[str, Any], bool]:
    """Train and evaluate one (mixer, length, seed), or reuse its result. Returns (result, reused).
    ``steps``: the run's steps under the budget (default ``config.steps``); ``flops_per_token``:
    its training FLOPs per token (default: counted for the model in its ``config.json``). Under
    torchrun (``env``: the joined process group) every process trains its share and evaluates;
    only rank 0 touches the run directory's files outside training."""
    from ..evaluate import evaluate_loss
    from ..training import load_run
    from ..training import distributed as distrib

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
    from ..model import ModelConfig

    try:
        record = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        return training_flops_per_token(ModelConfig.from_dict(record["model"]), length)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _train(train_config, resume: bool, label: str, progress: bool | None):
    """:func:`kernelmix.training.train`; an interrupted run's error says how to continue the compare."""
    from ..training import train

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


# ---------------------------------------------------------------------------------------------
# The whole comparison


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
            costs = {name: _mean_or_none([r.get(name) for r in group]) for name in ("steps", "tokens", "flops", "train_s")}
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
    from ..training import distributed as distrib

    env = distrib.setup(config.device)
    try:
        with contextlib.ExitStack() as stack:
            if env.is_main:  # one compare per directory; refused before any data is read
                with writing(config.out_dir, "create the output directory"):
                    stack.enter_context(run_directory_lock(config.out_dir, "kernelmix compare"))
            return _run_compare(config, env, progress=progress, console=console)
    finally:
        distrib.teardown(env)


class _Clock:
    """The progress line's times: elapsed since the command started, and the time left estimated
    from the runs trained so far, each run weighted by its expected cost (its training FLOPs;
    under the time budget its calibrated seconds). Runs already finished on disk cost nothing."""

    def __init__(self, started: float, weights: list[float], finished: list[bool]) -> None:
        self.started, self.weights, self.finished = started, weights, finished
        self.done_weight = self.done_seconds = 0.0

    def record(self, index: int, reused: bool, seconds: float) -> None:
        if not reused:
            self.done_weight += self.weights[index]
            self.done_seconds += seconds

    def status(self, index: int) -> str:
        """Before the run at ``index`` (0-based): elapsed, and the time left for it and every later run."""
        elapsed = f"{_duration(time.perf_counter() - self.started)} elapsed"
        left = sum(w for w, done in zip(self.weights[index:], self.finished[index:]) if not done)
        if not left:
            return f"{elapsed}, the rest reused"
        if not self.done_weight:
            return f"{elapsed}, time left known after the first run"
        return f"{elapsed}, about {_duration(self.done_seconds * left / self.done_weight)} left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _flop_text(flops: float | None) -> str:
    """FLOPs with an SI prefix: 1.23 GFLOP."""
    if flops is None:
        return "? FLOP"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"


def _run_plan(config: CompareConfig, plan: list, budget: BudgetPlan, val, env, progress: bool | None, note,
              started: float) -> tuple[list[dict], int]:
    """Every run of ``plan`` (reused or trained and evaluated); returns (results, how many were reused).
    A stop signal outside a run's training steps (its evaluation) lets that run's result be written
    first; inside them, train() checkpoints the step and :func:`_train` says how to continue."""
    from ..training import distributed as distrib

    steps = [budget.steps[m, t] for m, t, _ in plan]
    weights = [n * (budget.seconds_per_step[m, t] if budget.budget == "time"
                    else budget.flops_per_token[m, t] * config.tokens_per_step) for (m, t, _), n in zip(plan, steps)]
    finished = [saved_result(config.run_dir(m, t, s, n) / "result.json", config.run_key(m, t, s, n)) is not None
                for (m, t, s), n in zip(plan, steps)]
    clock, runs, reused_count = _Clock(started, weights, finished), [], 0
    with catch_stop_signals() as signals:
        for index, (mixer, length, seed) in enumerate(plan, start=1):
            note(f"[bold cyan][{index}/{len(plan)}][/] {mixer} T={length} seed {seed} "
                 f"(batch {config.tokens_per_step // length} × {length}, {steps[index - 1]} steps) · {clock.status(index - 1)}")
            t0 = time.perf_counter()
            result, reused = run_one(config, mixer, length, seed, steps=steps[index - 1], val_split=val, progress=progress,
                                     flops_per_token=budget.flops_per_token[mixer, length], note=note, env=env)
            clock.record(index - 1, reused, time.perf_counter() - t0)
            runs.append(result)
            reused_count += reused
            note(
                f"      {'reused' if reused else 'done'}: eval loss {result['val_loss']:.4f}; {result['tokens']:,} tokens, "
                f"{_flop_text(result['flops'])}, train {result['train_s']:.1f} s ({result['tokens_per_s']:,.0f} tok/s)"
                + ("" if reused else f"; total {time.perf_counter() - t0:.0f} s")
            )
            number = distrib.agree_on_signal(env, signals.received)
            if number is not None and index < len(plan):
                raise Interrupted(f"kernelmix compare interrupted by {signal_name(number)} after {index} of {len(plan)} "
                                  "runs (each one saved); run the same command again to continue", number)
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
            f"corpus {config.corpus!r} has {dataset.train.num_tokens} training tokens, too few for length {max(config.lengths)}"
        )


def _run_compare(config: CompareConfig, env, *, progress: bool | None, console) -> dict[str, Any]:
    from ..data import prepare_dataset
    from ..evaluate import cap_split
    from ..training import distributed as distrib

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
        f"{torch.get_num_threads()} torch threads" + (f" × {env.world_size} processes" if env.enabled else "") + f"; output {out}. "
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
        write_text_atomic(out / "results.md", format_markdown(results))
        results["plots"] = write_plots(results, out)
        write_json_atomic(out / "results.json", results, indent=1)
    note(f"wrote {out / 'results.json'}, {out / 'results.md'} and {len(results['plots'])} plots "
         f"in {results['wall_s'] / 60:.1f} min")
    return results


# ---------------------------------------------------------------------------------------------
# Reports


def _fmt(mean: float, sd: float, seeds: int, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if seeds > 1 else f"{mean:.{digits}f}"


def format_markdown(results: dict[str, Any]) -> str:
    """The tables of results.md: val loss per mixer and length, throughput and wall time, loss by
    position at the longest length."""
    settings, summary = results["settings"], results["summary"]
    lengths, mixers = settings["lengths"], settings["mixers"]
    seeds = settings["seeds"]
    cell = {(r["mixer"], r["length"]): r for r in summary}
    spread = " (mean ± sample std over seeds)" if len(seeds) > 1 else ""
    lines = [
        f"# kernelmix compare — preset `{settings['preset']}`, {settings['corpus']} / {settings['tokenizer']} tokens",
        "",
        _budget_markdown(results),
        "",
        f"Every step: {settings['tokens_per_step']:,} tokens (batch = {settings['tokens_per_step']:,} / length); "
        f"seeds {seeds}; lr {settings['lr']}. Validation: {results['evaluation']['predicted_tokens']:,} predicted tokens "
        f"(first {results['evaluation']['tokens_per_document']} tokens of {results['evaluation']['documents']} held-out "
        f"documents) at each run's training length. Wall time {results['wall_s'] / 60:.1f} min for this invocation "
        f"({results['reused_runs']} of {len(results['runs'])} runs reused), {results['runs_wall_s'] / 60:.1f} min of "
        f"training + evaluation over all runs; {_threads_text(results)}.",
        "",
        f"## Validation loss (nats/token){spread}",
        "",
        "| mixer | " + " | ".join(f"T={t}" for t in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    best = {t: min((r["val_loss"] for r in summary if r["length"] == t), default=None) for t in lengths}
    for m in mixers:
        cells = []
        for t in lengths:
            r = cell.get((m, t))
            if r is None:
                cells.append("–")
                continue
            text = _fmt(r["val_loss"], r["val_loss_sd"], r["seeds"])
            cells.append(f"**{text}**" if r["val_loss"] == best[t] else text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    reference = results.get("reference")  # absent from results written before it existed
    if reference:
        lines += [
            "",
            f"Reference lines on the same validation tokens (counted on the training split, add-one smoothing): "
            f"unigram {reference['unigram']:.3f}, bigram {reference['bigram']:.3f}. A mixer above the bigram line has "
            "not yet learned what a table of which token follows which knows, let alone used its context.",
        ]
    lines += [
        "",
        "## Training throughput (tokens/s) and wall time per run (s)",
        "",
        "Measured on this machine while it ran: other jobs on the same cores lower every figure, the mixers made of "
        "many small ops (Cubit, DeltaFormer, the random-feature ones) most; `--threads 1` on a shared machine.",
        "",
        "| mixer | params | " + " | ".join(f"tok/s T={t}" for t in lengths) + " | " + " | ".join(f"s T={t}" for t in lengths) + " |",
        "|---|---:|" + "---:|" * (2 * len(lengths)),
    ]
    for m in mixers:
        rows = [cell.get((m, t)) for t in lengths]
        params = next((r["parameters"] for r in rows if r), 0)
        lines.append(
            f"| {m} | {params:,} | "
            + " | ".join(f"{r['tokens_per_s']:,.0f}" if r else "–" for r in rows) + " | "
            + " | ".join(f"{r['train_wall_s']:.0f}" if r else "–" for r in rows) + " |"
        )
    longest = lengths[-1]
    at_longest = [cell[(m, longest)] for m in mixers if (m, longest) in cell]
    if at_longest:
        ranges = [(b["start"], b["end"]) for b in at_longest[0]["buckets"]]
        lines += [
            "",
            f"## Validation loss by position in the window (T={longest})",
            "",
            "| mixer | " + " | ".join(f"[{a}, {b})" for a, b in ranges) + " |",
            "|---|" + "---:|" * len(ranges),
        ]
        for r in at_longest:
            lines.append(f"| {r['mixer']} | " + " | ".join(_fmt(b["loss"], b["loss_sd"], r["seeds"]) for b in r["buckets"]) + " |")
    return "\n".join(lines + _costs_markdown(results)) + "\n"


def _threads_text(results: dict[str, Any]) -> str:
    """The torch threads of this invocation, and those reused runs trained with where they differ
    (the solve mixers' losses move with the rounding a thread count brings: results/rounding)."""
    now = results["machine"]["threads"]
    counts = sorted({run["threads"] for run in results["runs"] if run.get("threads") is not None})
    if counts in ([], [now]):
        return f"{now} torch threads"
    return f"{now} torch threads now; the runs trained with {' / '.join(map(str, counts))}"


def _budget_markdown(results: dict[str, Any]) -> str:
    """The line at the top of results.md: which budget was equal, and how."""
    settings, budget = results["settings"], results["budget"]
    tokens = f"{settings['steps']} steps × {settings['tokens_per_step']:,} tokens"
    if budget["equal"] == "tokens":
        return (f"Equal budget: **{budget['tokens_per_run']:,} training tokens** per run ({tokens}); training FLOPs and "
                "seconds differ between the mixers (table at the end).")
    if budget["equal"] == "flops":
        return (f"Equal budget: **training FLOPs** — at each length every run gets the FLOPs {REFERENCE_MIXER} spends on "
                f"{tokens} (analytic counts, `kernelmix.studies.flops`), so its own number of steps; tokens and seconds "
                "differ (table at the end).")
    target = (f"{settings['seconds']:g} s" if settings.get("seconds") is not None
              else f"the seconds {REFERENCE_MIXER} takes for {tokens}")
    return (f"Equal budget: **training time** — at each length every run gets {target} of training on this machine, "
            f"its steps set by a calibration of its speed ({settings['calibration_steps']} timed steps). Measured time is "
            "noisy (±10–30% on a shared machine): the seconds each run took are in the table at the end.")


def _costs_markdown(results: dict[str, Any]) -> list[str]:
    """The table of what every run cost, whatever the budget (mean over seeds)."""
    settings, summary = results["settings"], results["summary"]
    lines = ["", f"## Cost per run: steps, training tokens, training FLOPs, training seconds (equal: {results['budget']['equal']})",
             "", "| mixer | T | steps | tokens | FLOPs | train s | tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    cell = {(r["mixer"], r["length"]): r for r in summary}
    for m in settings["mixers"]:
        for t in settings["lengths"]:
            r = cell.get((m, t))
            if r is None:
                continue
            seconds = "–" if r.get("train_s") is None else f"{r['train_s']:.1f}"
            lines.append(f"| {m} | {t} | {r['steps']:g} | {r['tokens']:,.0f} | {_flop_text(r['flops'])} | {seconds} | "
                         f"{r['tokens_per_s']:,.0f} |")
    return lines


def _loss_vs_length(plt, results: dict[str, Any]):
    """val_loss_vs_length.png's figure: each mixer's validation loss against its training length,
    with the unigram and bigram tables of the same tokens as reference lines."""
    summary, mixers, lengths = results["summary"], results["settings"]["mixers"], results["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in mixers:
        rows = sorted((r for r in summary if r["mixer"] == m), key=lambda r: r["length"])
        if rows:
            ax.errorbar([r["length"] for r in rows], [r["val_loss"] for r in rows], yerr=[r["val_loss_sd"] for r in rows],
                        marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(t) for t in lengths])
    reference = results.get("reference")
    if reference:
        for name, style in (("unigram", ":"), ("bigram", "--")):
            ax.axhline(reference[name], color="0.4", linestyle=style, linewidth=1, label=f"{name} table")
    ax.set_xlabel("training length (tokens)")
    ax.set_ylabel("validation loss (nats/token)")
    equal = results["budget"]["equal"]
    ax.set_title(f"{results['budget']['tokens_per_run']:,} training tokens per run" if equal == "tokens"
                 else f"equal training {'FLOPs' if equal == 'flops' else 'seconds'} per run")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """The PNGs (matplotlib, Agg backend); returns their file names."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    settings, summary, runs = results["settings"], results["summary"], results["runs"]
    mixers, lengths = settings["mixers"], settings["lengths"]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    save(_loss_vs_length(plt, results), "val_loss_vs_length.png")

    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.8), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], lengths):
        for m in mixers:
            group = [r for r in runs if r["mixer"] == m and r["length"] == t and r["curve"]]
            if not group:
                continue
            n = min(len(r["curve"]) for r in group)
            tokens = [group[0]["curve"][i][1] for i in range(n)]
            losses = [sum(r["curve"][i][2] for r in group) / len(group) for i in range(n)]
            ax.plot(tokens, losses, label=m)
        ax.set_title(f"T={t}")
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss" + (" (mean over seeds)" if len(settings["seeds"]) > 1 else ""))
    axes[0][-1].legend()
    save(fig, "loss_curves.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / len(lengths)
    for i, t in enumerate(lengths):
        values = [next((r["tokens_per_s"] for r in summary if r["mixer"] == m and r["length"] == t), 0) for m in mixers]
        ax.bar([x + (i - (len(lengths) - 1) / 2) * width for x in range(len(mixers))], values, width, label=f"T={t}")
    ax.set_xticks(range(len(mixers)), mixers, rotation=20)
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"throughput ({results['machine']['threads']} threads, {settings['device']})")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax.set_xlabel("measured on this machine while it ran: other jobs on its cores lower every bar,\n"
                  "the mixers made of many small ops most (see --threads)", fontsize=7, color="0.35")
    save(fig, "throughput.png")

    longest = lengths[-1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in mixers:
        r = next((r for r in summary if r["mixer"] == m and r["length"] == longest), None)
        if r:
            labels = [f"[{b['start']},{b['end']})" for b in r["buckets"]]
            ax.plot(range(len(labels)), [b["loss"] for b in r["buckets"]], marker="o", label=m)
            ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("position of the predicted token in the window")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"loss by position, T={longest}")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "loss_by_position.png")
    return written


__all__ = [
    "BUDGETS",
    "CALIBRATION_WARMUP",
    "DEFAULT_MIXERS",
    "MIXER_VARIANTS",
    "REFERENCE_MIXER",
    "BudgetPlan",
    "CompareConfig",
    "calibrate",
    "format_markdown",
    "plan_budget",
    "run_compare",
    "run_one",
    "saved_result",
    "summarize",
    "with_costs",
    "write_plots",
]
