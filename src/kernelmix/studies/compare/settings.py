"""What ``kernelmix compare`` trains: :class:`CompareConfig` and the constants of the study.

Plain data: this module imports neither torch nor the model, the training code or the ops (those
are imported by the methods that build a run's TrainConfig or count its FLOPs), so that the
command line builds and checks compare's options without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from ...config import Arg, Choice, Distinct, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check
from ...errors import KernelmixError
from ...evaluate.settings import parse_buckets
from ...layers import registry
from ...presets import PRESETS

# kernelmix.training.parallelize's modes (that module imports torch): tests/test_compare.py keeps the two equal
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "mixers")

# name → (registry mixer, mixer_options): every registered mixer and its variants (cubit-nolrr), a live view
MIXER_VARIANTS = registry.View(registry.variants)
# what compare and recall train by default: those of the mixers and variants registered with in_defaults=True
# (all but Cubit-RF's dense ablations: kernelmix.layers.registry), a live view
DEFAULT_MIXERS = registry.View(registry.default_variants)
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

    mixers: Annotated[list[str], Choice(MIXER_VARIANTS, "mixer"), Distinct("mixer"),
                      Field(min_length=1, description="comma-separated")] = (
        field(default_factory=lambda: list(DEFAULT_MIXERS)))
    lengths: Annotated[list[Annotated[int, Field(ge=2)]], Distinct("length"),
                       Field(min_length=1, description="training lengths")] = (
        field(default_factory=lambda: [256, 512]))
    seeds: Annotated[list[NonNegativeInt], Distinct("seed"),
                     Field(min_length=1, description="seeds, e.g. 0,1,2 (mean ± spread over them)")] = (
        field(default_factory=lambda: [0]))
    # "mini", not "tiny": tiny's 2 × 64 stayed between the unigram and bigram lines in any budget of
    # minutes (results/compare-frontier)
    preset: Annotated[str, Choice(PRESETS, "preset")] = "mini"
    model: Annotated[dict[str, Any], Arg(cli=False), Field(examples=["model.hidden_size=128"])] = (
        field(default_factory=dict))  # extra ModelConfig overrides for every run
    corpus: str = "pystdlib"
    tokenizer: str = "byte"
    tokens_per_step: Annotated[PositiveInt,
                               Field(description="tokens per step at every length (batch = this / length)")] = 2048
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
    buckets: Annotated[list[NonNegativeInt], Field(description="position-bucket edges, e.g. "
                                                               "0,64,256 (default 0,64,256,1024,…)")] | None = None
    out_dir: Annotated[str, Arg(flag="--out"), Field(description="output directory")] = "runs/compare"
    device: Annotated[str, Choice(("auto", "cpu", "cuda"), "device")] = "cpu"
    activation_checkpointing: Annotated[str, Choice(ACTIVATION_CHECKPOINTING, "activation_checkpointing"), Field(
        description="recompute in the backward instead of storing (as kernelmix train's); "
                    "same numbers, less memory")] = "none"
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
            raise ValueError(f"min_lr must be at most lr, got min_lr={self.min_lr}, lr={self.lr}; "
                             "lower min_lr or leave it out (lr / 10)")
        for length in self.lengths:
            if self.tokens_per_step % length:
                raise ValueError(
                    f"tokens_per_step {self.tokens_per_step} is not a multiple of length {length}: every length must "
                    "get the same tokens per step (batch = tokens_per_step / length); use lengths that divide it"
                )
        self.lengths = sorted(self.lengths)
        if self.seconds is not None and self.budget != "time":
            raise KernelmixError(f"--seconds sets the time budget, but the budget is {self.budget!r}: add --budget "
                                 "time, or drop --seconds")
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
        from ...training import TrainConfig

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
        from ..flops import training_flops_per_token

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
        import torch

        settings.update(processes=world_size, threads=torch.get_num_threads())
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
