"""The training loop: ``train(config) -> TrainResult``, readable top to bottom (nanoGPT style).

One process or many (``torchrun --nproc_per_node=N``, detected from RANK/WORLD_SIZE/LOCAL_RANK;
DDP, or FSDP2 with ``fsdp=true``; gloo on CPU, nccl on CUDA). The order of things:

1. hold the run directory's lock (one writer per directory: :func:`kernelmix.locks.run_directory_lock`),
   then refuse to overwrite a run, or load and check the checkpoint to resume — before anything is
   written (:func:`open_run`);
2. tokenize the corpus (cached) and build the model, AdamW and the samplers (:func:`load_dataset`,
   :func:`build_model`, :func:`~.parallelize.parallelize`, :func:`build_optimizer`, :func:`build_samplers`);
3. loop (:class:`PretrainTrainer`, run by :meth:`.trainer.Trainer.run`, whose docstring lists
   every call of one step in order): log (``before_boundary``) → evaluate → checkpoint (``save``) →
   (stop?) → redraw random features (``before_step``) → one optimizer step (``step``: ``lr``,
   ``micro_batches``, ``loss`` per micro-batch under ``sync``) → queue its loss (``after_step``).
   Everything a step reads is set in ``PretrainTrainer.__init__``; :meth:`PretrainTrainer.train`
   opens the outputs, starts the clocks and runs the loop.

Data: the batch of step s is a pure function of (seed, s) and the *global* batch
``batch_size × grad_accum × world_size``: process r's micro-step a reads the sampler shard
``r·grad_accum + a`` of ``world_size·grad_accum`` shards, so the global batch is the same
sequence of windows however it is split into processes and micro-steps (one process with
``grad_accum=2`` trains on exactly what two processes with ``grad_accum=1`` do), and a resumed run
sees exactly the batches it would have seen.

Numerics: an update whose loss or gradient norm is not finite is skipped (parameters and optimizer
untouched) and counted; ``max_bad_steps`` of them in a row stop the run with a
:class:`~kernelmix.errors.KernelmixError`, and no checkpoint holding NaN or Inf is ever written.
SIGINT/SIGTERM finish the step, checkpoint it and raise :class:`~kernelmix.errors.Interrupted`;
``--resume`` continues bitwise (on CPU) as if nothing had happened.

The loss of a step is the mean over its micro-batches (and processes) of each micro-batch's mean
token loss, as in nanoGPT; with ``cross_documents`` windows every micro-batch predicts nearly the
same number of tokens, so this is close to the mean over all tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import Interrupted, KernelmixError
from ..evaluate import sum_token_losses
from ..locks import run_directory_lock
from ..model import CausalLM, ModelConfig
from ..output import write_json_atomic
from . import distributed as distrib
from .checkpoint import (
    Checkpoint, CheckpointError, list_checkpoints, load_latest_valid, load_weights, save_checkpoint, writing,
)
from .config import RESOLVED_FORMAT, TrainConfig
from .parallelize import parallelize
from .reporter import Reporter, truncate_metrics
from .schedule import (  # noqa: F401  (param_groups, lr_at, ... were defined here: kept importable)
    derived_seed, lr_at, param_groups, redraw_random_features, rng_state, seed_everything, set_rng_state,
    warmup_cosine,
)
from .signals import signal_name
from .trainer import Due, Schedule, StepOutcome, Trainer

# Settings that may change when a run is resumed: budgets, bookkeeping, and how the global batch
# is split over processes and micro-steps (the data depend only on the global batch).
MAY_CHANGE_ON_RESUME = frozenset(
    {"steps", "tokens", "eval_every", "eval_batches", "log_every", "checkpoint_every", "keep_checkpoints",
     "out_dir", "device", "batch_size", "grad_accum", "fsdp", "max_bad_steps",
     # how the same numbers are computed: recomputed activations, compiled blocks
     "activation_checkpointing", "activation_checkpointing_every", "compile"}
)
#: Model fields that say only which kernels compute the same numbers (a CPU run resumed on a GPU).
MODEL_MAY_CHANGE_ON_RESUME = frozenset({"backend"})


@dataclass
class TrainResult:
    """What a call to :func:`train` did. ``losses``/``val_losses`` map a step (optimizer updates
    done) to the training loss of that update / the validation loss after it, for the steps run
    in this call. ``tokens_per_s``: training tokens (all processes) per second of training steps
    (evaluation and checkpointing excluded). ``skipped_steps``: the steps of this call whose update
    was skipped (non-finite loss or gradient). ``checkpoint``: the newest checkpoint of the run (the
    one it resumed from when this call saved none)."""

    start_step: int
    final_step: int
    total_steps: int
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    tokens_seen: int = 0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    out_dir: Path = Path(".")
    checkpoint: Path | None = None
    metrics_path: Path = Path(".")
    config_path: Path = Path(".")


# ---------------------------------------------------------------------------------------------
# Pieces of the loop


def resolved_config(config: TrainConfig, model_config, env, total_steps: int, dataset,
                    parameters: int) -> dict[str, Any]:
    """The full record of a run, saved as ``config.json`` beside its checkpoints and metrics."""
    from .. import __version__

    global_batch = config.batch_size * config.grad_accum * env.world_size
    return {
        "format": RESOLVED_FORMAT,
        "train": config.to_dict(),
        "model": json.loads(model_config.to_json()),
        "run": {
            "world_size": env.world_size,
            "global_batch": global_batch,
            "tokens_per_step": global_batch * config.seq_len,
            "total_steps": total_steps,
            "parameters": parameters,
            "device": str(env.device),
            "data": {
                "path": str(dataset.path),
                "key": dataset.meta.get("key"),
                "vocab_size": dataset.vocab_size,
                "train_tokens": dataset.train.num_tokens,
                "val_tokens": dataset.val.num_tokens,
            },
            "kernelmix": __version__,
            "torch": torch.__version__,
        },
    }


def check_resumable(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose model or training settings differ from this run's (except
    :data:`MAY_CHANGE_ON_RESUME`), naming every difference and the fix."""
    fix = (
        "resume with the run's own settings (`kernelmix train --resume --out DIR` without --config/--set reuses "
        "them) or start a fresh run with another --out"
    )
    if saved.get("format") != RESOLVED_FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no kernelmix training config; {fix}")

    def diff(a: dict, b: dict, skip=frozenset()) -> list[str]:
        keys = sorted((set(a) | set(b)) - skip)
        return [f"{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} now" for k in keys if a.get(k) != b.get(k)]

    # a field added to ModelConfig after the checkpoint was written has its default there
    saved_model = {**ModelConfig.from_dict(saved["model"]).to_dict(), **saved["model"]}
    model_diff = diff(saved_model, current["model"], MODEL_MAY_CHANGE_ON_RESUME)
    if model_diff:
        raise CheckpointError(f"checkpoint {str(path)!r} is from another model config ({'; '.join(model_diff)}); {fix}")
    # the model overrides are compared through the resolved model above
    train_diff = diff(saved["train"], current["train"], MAY_CHANGE_ON_RESUME | {"model"})
    if train_diff:
        raise CheckpointError(f"checkpoint {str(path)!r} was trained with other settings "
                              f"({'; '.join(train_diff)}); {fix}")
    before, now = saved["run"]["global_batch"], current["run"]["global_batch"]
    if before != now:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was trained with a global batch of {before} sequences (batch_size × grad_accum "
            f"× processes), this run has {now}; keep the global batch to resume exactly (e.g. with half the processes, "
            "double grad_accum)"
        )


def _full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Unsharded model and optimizer state on the CPU, keyed by parameter name (so a checkpoint of
    a DDP run resumes under FSDP and vice versa). Under FSDP every process must call this."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = (get_model_state_dict(model, options=options) if fsdp
               else {k: v.detach().cpu() for k, v in model.state_dict().items()})
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


# ---------------------------------------------------------------------------------------------
# train()


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    stop_at: int | None = None,
    progress: bool | None = None,
    reschedule: bool = False,
) -> TrainResult:
    """Train (or, with ``resume``, continue from the newest checkpoint in ``config.out_dir``).

    Args:
        config: the run's :class:`~kernelmix.training.config.TrainConfig` (model, data, schedule, out_dir).
        resume: continue from the newest valid checkpoint in ``config.out_dir``.
        stop_at: checkpoint and return after this step although the schedule runs to the last step
            (for time-sliced jobs; continue later with ``resume=True``).
        progress: a rich bar (True), nothing printed (False), or plain lines unless stderr is a
            terminal (None).
        reschedule: a resumed run may have another number of steps (``steps`` / ``tokens``) than its
            checkpoint's run; the warmup + cosine schedule is then laid over the new total, so the
            learning rate jumps at the resumed step. Without it such a resume is refused, naming both.

    Returns:
        :class:`TrainResult`: what this call did (its losses and validation losses per step, tokens/s,
        skipped steps, the newest checkpoint)."""
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise ValueError(f"stop_at must be a step >= 1 (or None to train to the end), got {stop_at!r}")
    env = distrib.setup(config.device)
    try:
        result = run_training(config, env, resume=resume, stop_at=stop_at, progress=progress, reschedule=reschedule)
    except BaseException:
        distrib.teardown(env, wait_for_peers=False)  # the others may never reach the barrier
        raise
    distrib.teardown(env, wait_for_peers=True)  # every process leaves the group together
    return result


def run_training(
    config: TrainConfig, env: distrib.DistEnv, *, resume: bool, stop_at: int | None, progress: bool | None,
    reschedule: bool = False,
) -> TrainResult:
    """:func:`train` in a process group that is already set up. Rank 0 holds the run directory's
    lock throughout: a second writer is refused at once, naming this one."""
    out_dir = Path(config.out_dir)
    if resume and not out_dir.exists():  # before the lock would create it: a mistyped --out
        raise CheckpointError(f"nothing to resume: {str(out_dir)!r} does not exist; check --out, or run without "
                              "--resume to start a run there")
    with contextlib.ExitStack() as stack:
        if env.is_main:
            with writing(out_dir, "create the run directory"):
                stack.enter_context(run_directory_lock(out_dir, "kernelmix train"))
        ckpt = open_run(out_dir, resume, main=env.is_main)
        dataset = load_dataset(config, env)
        return PretrainTrainer(config, env, dataset, ckpt, stop_at=stop_at, reschedule=reschedule).train(progress)


# ---------------------------------------------------------------------------------------------
# Setup, in the order it happens


def open_run(out_dir: Path, resume: bool, *, main: bool = True) -> Checkpoint | None:
    """Nothing is written before we know we may: a fresh run must not clobber an old one, a
    resumed one starts from the newest checkpoint that verifies (returned, loaded and verified; a
    damaged newer one is named in a warning). A run killed before its first checkpoint left nothing
    to continue: with or without ``resume`` it is started over in place, with a note (``main``:
    this process speaks and cleans up)."""
    ckpt = load_latest_valid(out_dir, warn=main) if resume else None
    if ckpt is not None:
        return ckpt
    found = list_checkpoints(out_dir)
    if found:
        raise KernelmixError(
            f"{str(out_dir)!r} already holds a training run (checkpoints up to step {found[-1][0]}); pass --resume to "
            "continue it, or choose another --out"
        )
    record = out_dir / "config.json"
    if not record.exists():
        if resume:
            raise CheckpointError(f"nothing to resume: {str(out_dir)!r} holds no training run; run without --resume to "
                                  "start one")
        return None
    try:
        ours = json.loads(record.read_text(encoding="utf-8")).get("format") == RESOLVED_FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:  # someone else's config.json: never overwrite it
        raise KernelmixError(f"{str(out_dir)!r} holds a config.json that is not a kernelmix training run; choose "
                             "another --out (an empty or new directory)")
    if main:
        print(f"note: {out_dir} holds a run that stopped before its first checkpoint, so there is nothing to resume; "
              "starting it over from step 0", file=sys.stderr)
        with writing(out_dir / "metrics.jsonl", "remove"):
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)  # its scalars would overlap the new run's
    return None


def load_dataset(config: TrainConfig, env: distrib.DistEnv):
    """The tokenized corpus. Rank 0 tokenizes first (into the cache); the others then open it."""
    from ..data import prepare_dataset

    if not env.is_main:
        distrib.barrier(env)
    dataset = prepare_dataset(config.corpus, config.tokenizer, val_fraction=config.val_fraction)
    if env.is_main:
        distrib.barrier(env)
    return dataset


def build_model(config: TrainConfig, env: distrib.DistEnv, dataset, ckpt: Checkpoint | None, total_steps: int,
                reschedule: bool = False):
    """``(model, record, start_step)``: the model with the same initial weights on every process
    (or the checkpoint's, once it is known to fit), the run's record (``config.json``) and the
    step the run starts from."""
    model_config = config.model_config(dataset.vocab_size)
    seed_everything(config.seed)
    model = CausalLM(model_config)
    record = resolved_config(config, model_config, env, total_steps, dataset, model.num_parameters())
    if ckpt is None:
        return model, record, 0
    check_resumable(ckpt.config, record, ckpt.path)
    if not reschedule:
        check_same_schedule(ckpt, config, total_steps)
    if ckpt.config["run"]["data"]["key"] != record["run"]["data"]["key"] and env.is_main:
        warnings.warn(
            f"the tokenized corpus changed since {str(ckpt.path)!r} was written (the files or the tokenizer "
            "differ); training continues on the new data", stacklevel=3,
        )
    load_weights(model, ckpt.weights, ckpt.path)
    if ckpt.step > total_steps:
        raise CheckpointError(
            f"checkpoint {str(ckpt.path)!r} is at step {ckpt.step}, beyond this run's {total_steps} steps; "
            f"raise steps (e.g. --set steps={ckpt.step + config.steps} --reschedule) to train further"
        )
    return model, record, ckpt.step


def check_same_schedule(ckpt: Checkpoint, config: TrainConfig, total_steps: int) -> None:
    """Refuse resuming ``ckpt`` on another number of steps than its run had: the learning rate
    (warmup, then cosine to ``min_lr`` at the last step) is laid over the run's steps, so another
    total would silently move it at the resumed step (a finished run extended from 6 to 10 steps
    went from min_lr back up to 3.8× it). The message names both totals, both rates and the fixes."""
    before = ckpt.config.get("run", {}).get("total_steps")
    if not isinstance(before, int) or before == total_steps:
        return
    step = ckpt.step
    was = lr_at(min(step, before - 1), config, before)
    now = lr_at(min(step, total_steps - 1), config, total_steps)
    raise CheckpointError(
        f"checkpoint {str(ckpt.path)!r} is from a run of {before} steps, this one asks for {total_steps}: update "
        f"{step + 1} would use lr {now:.3g} where the run's own schedule is at {was:.3g}; keep steps/tokens, use "
        "another --out, or accept the new schedule with --reschedule (train(..., reschedule=True))"
    )


def build_optimizer(model: CausalLM, config: TrainConfig, device: torch.device, ckpt: Checkpoint | None):
    """AdamW over :func:`param_groups`, with the checkpoint's state (full, keyed by parameter
    name: it loads into DDP or FSDP shards alike)."""
    use_fused = device.type == "cuda" and not config.fsdp
    optimizer = torch.optim.AdamW(
        param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas, fused=use_fused or None
    )
    if ckpt is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        try:
            set_optimizer_state_dict(model, optimizer, ckpt.state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        except (KeyError, RuntimeError, ValueError) as error:
            raise CheckpointError(
                f"the optimizer state in {str(ckpt.path)!r} does not fit this model: {error}") from None
    return optimizer


def seed_process(config: TrainConfig, env: distrib.DistEnv, ckpt: Checkpoint | None, start_step: int) -> None:
    """This process's RNG (dropout): restored from the checkpoint; or, for a fresh run, seeded per
    rank (dropout masks should differ between processes, which see different data anyway)."""
    if ckpt is None:
        torch.manual_seed(derived_seed(config.seed, "rank", env.rank))
    elif env.rank < len(ckpt.state["rng"]):
        set_rng_state(ckpt.state["rng"][env.rank])
    else:  # more processes than before: a fresh but deterministic stream for the new ones
        torch.manual_seed(derived_seed(config.seed, "rank", env.rank, start_step))


def build_samplers(dataset, config: TrainConfig, env: distrib.DistEnv) -> list:
    """One sampler per micro-step: process r's micro-step a reads shard ``r·grad_accum + a`` of
    ``world_size·grad_accum`` (see the module docstring)."""
    from ..data import WindowSampler

    shards = env.world_size * config.grad_accum
    return [
        WindowSampler(
            dataset.train, config.seq_len, config.batch_size, cross_documents=config.cross_documents,
            seed=config.seed, rank=env.rank * config.grad_accum + micro, world_size=shards,
        )
        for micro in range(config.grad_accum)
    ]


def validation_batches(dataset, config: TrainConfig) -> list:
    """The fixed validation batches (every process holds all; each evaluates its share)."""
    from ..data import eval_batches

    if dataset.val.num_tokens - len(dataset.val) <= 0:
        return []
    return list(eval_batches(dataset.val, config.seq_len, config.batch_size, config.eval_batches or None))


def validation_coverage(dataset, config: TrainConfig) -> str:
    """What the periodic check evaluates, for its log line: predicted tokens and documents."""
    from ..data.sampling import eval_windows, spread_windows, window_documents

    if config.eval_batches:
        windows = spread_windows(dataset.val, config.seq_len, config.eval_batches * config.batch_size)
    else:
        windows = list(eval_windows(dataset.val, config.seq_len))
    tokens = sum(length - 1 for _, length in windows)
    return f"{tokens:,} tokens from {window_documents(dataset.val, windows)} of {len(dataset.val)} validation documents"


def warn_no_validation(dataset, config: TrainConfig) -> None:
    """Say that a run asked for validation (``val_fraction`` > 0) gets none: the split by document
    held nothing out (one document) or only documents without a token to predict. A warning, not an
    error: the training itself is sound (a smoke test, one book), only the validation loss is missing."""
    total = len(dataset.train) + len(dataset.val)
    why = (f"the corpus {config.corpus!r} has {total} document{'s' if total != 1 else ''} and the split is by "
           "document, so none was held out" if len(dataset.val) == 0 else
           f"the {len(dataset.val)} held-out document(s) have no token to predict")
    warnings.warn(
        f"no validation: {why} (val_fraction={config.val_fraction:g}); this run reports no validation loss, "
        f"eval_every={config.eval_every} included. Split the text into several documents (files of a directory, "
        "or lines of a .jsonl), or set --set val_fraction=0 to train without validation on purpose",
        stacklevel=3,
    )


# ---------------------------------------------------------------------------------------------
# The run


class PretrainTrainer(Trainer):
    """``kernelmix train`` on the pieces of :class:`~kernelmix.training.trainer.Trainer`: batches
    from the samplers, bf16 autocast, DDP/FSDP gradient sync after the last micro-batch, random
    features redrawn every ``redraw_every`` steps, the validation loss summed over processes, and
    metrics logged every ``log_every`` steps (one all-reduce per log, not per step). An update
    whose loss or gradient norm is not finite is skipped (one device sync per step decides it, the
    same on every process) and counted; ``max_bad_steps`` in a row stop the run."""

    skip_non_finite = True

    def __init__(self, config: TrainConfig, env: distrib.DistEnv, dataset, ckpt: Checkpoint | None, *,
                 stop_at: int | None, reschedule: bool = False):
        self.config, self.env, self.ckpt, self.out_dir = config, env, ckpt, Path(config.out_dir)
        self.global_batch = config.batch_size * config.grad_accum * env.world_size
        self.tokens_per_step = self.global_batch * config.seq_len
        total_steps = math.ceil(config.tokens / self.tokens_per_step) if config.tokens else config.steps
        if config.warmup_steps >= total_steps and env.is_main:
            warnings.warn(
                f"warmup_steps={config.warmup_steps} is not below the run's {total_steps} steps: the learning rate "
                f"never reaches lr={config.lr:g} (its last step uses "
                f"{lr_at(total_steps - 1, config, total_steps):.2g}); set fewer warmup steps, e.g. "
                f"--set warmup_steps={max(1, total_steps // 10)}", stacklevel=3,
            )
        self.raw_model, self.record, start_step = build_model(config, env, dataset, ckpt, total_steps, reschedule)
        self.raw_model.to(env.device)
        self.model = parallelize(
            self.raw_model, compile=config.compile, activation_checkpointing=config.activation_checkpointing,
            activation_checkpointing_every=config.activation_checkpointing_every, fsdp=config.fsdp,
        )
        self.optimizer = build_optimizer(self.raw_model, config, env.device, ckpt)
        seed_process(config, env, ckpt, start_step)
        self.params, self.grad_clip = list(self.raw_model.parameters()), config.grad_clip
        self.samplers = build_samplers(dataset, config, env)
        self.val_batches = validation_batches(dataset, config)
        self.val_coverage = validation_coverage(dataset, config) if self.val_batches else ""
        if not self.val_batches and config.val_fraction > 0 and env.is_main:
            warn_no_validation(dataset, config)
        self.autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=config.bf16)
        self.schedule = Schedule(
            total_steps=total_steps, start_step=start_step, resumed=ckpt is not None, eval_every=config.eval_every,
            checkpoint_every=config.checkpoint_every, stop_at=stop_at, can_evaluate=bool(self.val_batches),
        )
        self.result = TrainResult(
            start_step=start_step, final_step=start_step, total_steps=total_steps, out_dir=self.out_dir,
            metrics_path=self.out_dir / "metrics.jsonl", config_path=self.out_dir / "config.json",
            checkpoint=ckpt.path if ckpt is not None and env.is_main else None,  # until this call saves one
        )
        # the skipped updates of the whole run (the checkpoint's, then this call's): a run resumed
        # in the middle of a streak of bad steps stops where the uninterrupted one would
        self.skipped: list[int] = list(ckpt.state.get("skipped_steps", [])) if ckpt is not None else []
        self.wall_before = float(ckpt.state.get("wall_s", 0.0)) if ckpt is not None else 0.0  # earlier sessions
        self.pending: list[torch.Tensor] = []  # [loss, grad norm] of the steps not yet logged
        self.train_time = 0.0  # seconds of optimizer steps (tokens/s excludes evaluation and checkpoints)
        self.saved_step: int | None = ckpt.step if ckpt is not None else None  # the last step checkpointed
        # set by train(), when the run may write and its clock starts
        self.reporter: Reporter | None = None
        self.started = self.window_start = 0.0  # perf_counter at train() / at the start of the unlogged steps

    def train(self, progress: bool | None) -> TrainResult:
        """Write the run's record, then run the loop; returns the :class:`TrainResult`."""
        self.reporter = self.open_outputs(progress)
        self.started = self.window_start = time.perf_counter()
        self.model.train()
        try:
            step = self.run()
        finally:
            self.reporter.close()
        result, start_step = self.result, self.schedule.start_step
        result.final_step = step
        result.tokens_seen = step * self.tokens_per_step
        result.tokens_per_s = ((step - start_step) * self.tokens_per_step / self.train_time if self.train_time > 0
                               else 0.0)
        result.wall_s = time.perf_counter() - self.started
        return result

    def open_outputs(self, progress: bool | None) -> Reporter:
        """Now we may write: the resolved config, metrics cut back to the checkpoint, the reporter."""
        env, start_step, total_steps = self.env, self.schedule.start_step, self.schedule.total_steps
        if env.is_main:
            with writing(self.out_dir / "config.json"):
                self.out_dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(self.out_dir / "config.json", self.record, sort_keys=True)
            if self.ckpt is not None:
                with writing(self.out_dir / "metrics.jsonl"):
                    truncate_metrics(self.out_dir / "metrics.jsonl", start_step)
        reporter = Reporter(self.out_dir, total_steps, start_step, progress, active=env.is_main)
        if env.is_main and start_step == 0:
            config, model_config = self.config, self.raw_model.config
            reporter.note(
                f"training {model_config.num_layers}-layer {'/'.join(sorted(set(model_config.layer_mixers())))} model "
                f"({self.record['run']['parameters']:,} parameters) on {config.corpus} with {config.tokenizer} tokens: "
                f"{total_steps} steps × {self.global_batch} sequences × {config.seq_len} tokens, "
                f"{env.world_size} process(es)"
            )
        elif env.is_main:
            reporter.note(f"resuming {str(self.out_dir)!r} from step {start_step} of {total_steps}")
        return reporter

    def wall(self) -> float:
        """Seconds of training over every session of this run."""
        return self.wall_before + time.perf_counter() - self.started

    # -- the pieces Trainer.run drives --------------------------------------------------------

    def lr(self, step: int) -> float:
        return lr_at(step, self.config, self.schedule.total_steps)

    def micro_batches(self, step: int) -> list:
        return [sampler.batch(step).to(self.env.device, non_blocking=True) for sampler in self.samplers]

    def loss(self, batch) -> torch.Tensor:
        with self.autocast:
            return self.model(**batch.model_inputs(), use_cache=False).loss

    def sync(self, last: bool):
        """Gradients are averaged over processes only after the last micro-batch."""
        if self.env.enabled and self.config.fsdp:
            self.model.set_requires_gradient_sync(last)
        elif self.env.enabled and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def evaluate(self, step: int) -> None:
        """Mean validation loss per predicted token, over every process's share of the batches."""
        env = self.env
        sums = sum_token_losses(
            self.raw_model, self.val_batches, autocast=self.autocast, rank=env.rank, world_size=env.world_size,
            all_reduce=lambda totals: distrib.all_reduce_sum(env, totals), same_forwards=self.config.fsdp,
        )
        self.result.val_losses[step] = sums.mean
        self.reporter.write({"kind": "eval", "step": step, "tokens": step * self.tokens_per_step,
                             "val_loss": sums.mean, "wall_s": round(self.wall(), 3)})
        self.reporter.show(f"step {step:>6}/{self.schedule.total_steps} | "
                           f"val loss {sums.mean:.4f} ({self.val_coverage})",
                           val=f"{sums.mean:.4f}")

    def save(self, step: int) -> None:
        """A checkpoint: full weights and optimizer state (every process takes part under FSDP),
        every process's RNG states, the schedule and data position; written by rank 0. When rank 0
        cannot write it (non-finite tensors, a full disk) every process stops, not only rank 0
        (the others would wait for it forever)."""
        config, env, total_steps = self.config, self.env, self.schedule.total_steps
        weights, optim_state = _full_state_dicts(self.raw_model, self.optimizer, config.fsdp)
        rngs = distrib.all_gather_object(env, rng_state())
        failure: CheckpointError | None = None
        if env.is_main:
            if self.raw_model.config.tie_embeddings:
                weights.pop("lm_head.weight", None)  # the embedding, stored once
            state = {
                "step": step,
                "tokens_seen": step * self.tokens_per_step,
                "optimizer": optim_state,
                "scheduler": {"name": "warmup_cosine", "step": step, "total_steps": total_steps,
                              "lr": lr_at(min(step, total_steps - 1), config, total_steps)},
                "data": {"step": step, "seed": config.seed, "global_batch": self.global_batch},
                "rng": rngs,
                "wall_s": self.wall(),
                "skipped_steps": [s for s in self.skipped if s <= step],
            }
            try:
                self.result.checkpoint = save_checkpoint(self.out_dir, step, weights, state, self.record,
                                                         keep=config.keep_checkpoints)
            except CheckpointError as error:
                failure = error
        if env.enabled and bool(self.agree(torch.tensor(float(failure is not None), device=env.device))):
            failure = failure or CheckpointError(f"rank 0 could not write the checkpoint of step {step}; its message "
                                                 "says why and what to do")
        if failure is not None:
            raise failure
        self.saved_step = step
        distrib.barrier(env)

    def before_boundary(self, step: int, due: Due) -> None:
        # log before evaluating or saving, so metrics.jsonl is complete up to every checkpoint
        if self.pending and (step % self.config.log_every == 0 or due.evaluate or due.save or due.stop):
            self.log_pending(step)

    def before_step(self, step: int) -> None:
        if not self.pending:  # a new throughput window: evaluation and checkpointing stay outside
            self.window_start = time.perf_counter()
        # redraw random features at the start of every redraw_every-th step (before its data)
        if self.config.redraw_every and step > 0 and step % self.config.redraw_every == 0:
            redraw_random_features(self.raw_model, self.config.seed, step)

    def after_step(self, step: int, outcome: StepOutcome) -> bool:
        self.pending.append(torch.stack([outcome.loss, outcome.grad_norm.to(outcome.loss.dtype)]))
        self.reporter.advance(step)
        if not outcome.updated:  # known without another sync: optimizer_step decided it
            self.skipped.append(step)
            self.result.skipped_steps.append(step)
            streak = self.bad_streak(step)
            if streak >= self.config.max_bad_steps:
                self.log_pending(step)
                raise self.diverged(step, streak)
        return False

    def bad_streak(self, step: int) -> int:
        """How many updates in a row, ending with the one that reached ``step``, were skipped."""
        skipped, count = set(self.skipped), 0
        while step - count in skipped:
            count += 1
        return count

    def diverged(self, step: int, streak: int) -> KernelmixError:
        config, last = self.config, self.result.checkpoint
        retry = f"resume from {str(last)!r} (--resume)" if last is not None else "start it again"
        return KernelmixError(
            f"training stopped at step {step}: the last {streak} updates (steps {step - streak + 1}-{step}) had a "
            f"non-finite loss or gradient norm and were skipped, the weights left as they were. Start again with a "
            f"lower lr (now {config.lr:g}), grad_clip > 0 (now {config.grad_clip:g}) or bf16 off and another --out; if "
            f"the cause was passing, {retry}; --set max_bad_steps=N (now {config.max_bad_steps}) sets how many skipped "
            "updates in a row stop a run"
        )

    def agree(self, count: torch.Tensor) -> torch.Tensor:
        return distrib.all_reduce_sum(self.env, count)

    def agree_on_signal(self, received: int | None) -> int | None:
        return distrib.agree_on_signal(self.env, received)

    def interrupted(self, step: int, signal_number: int) -> Interrupted:
        """One line: where the run's state is and how to continue it."""
        total, name = self.schedule.total_steps, signal_name(signal_number)
        again = f"`kernelmix train --resume --out {self.out_dir}`"
        if self.saved_step == step and self.result.checkpoint is not None:
            where = f"the run is saved in {str(self.result.checkpoint)!r}; continue with {again}"
        elif self.saved_step is not None:
            where = f"no update was done since {str(self.result.checkpoint)!r}; continue with {again}"
        else:
            where = "before its first update, so there was nothing to save; run the same command again to start it"
        if step == total:
            where = f"the run had finished and is saved in {str(self.result.checkpoint)!r}"
        return Interrupted(f"interrupted by {name} at step {step}/{total}: {where}", signal_number)

    def log_pending(self, step: int) -> None:
        """Log the steps since the last log: one device sync and one all-reduce, not one per step."""
        env, total_steps = self.env, self.schedule.total_steps
        rows = (distrib.all_reduce_sum(env, torch.stack(self.pending).float()) / env.world_size).tolist()
        elapsed = time.perf_counter() - self.window_start
        self.train_time += elapsed
        tokens_per_s = len(rows) * self.tokens_per_step / max(elapsed, 1e-9)
        wall = round(self.wall(), 3)
        skipped = set(self.skipped)
        for s, (loss_value, norm_value) in enumerate(rows, start=step - len(rows) + 1):
            self.result.losses[s] = loss_value
            self.reporter.write({
                "kind": "train", "step": s, "tokens": s * self.tokens_per_step, "loss": _finite_or_none(loss_value),
                "lr": self.lr(s - 1), "grad_norm": _finite_or_none(norm_value), "skipped": s in skipped,
                "tokens_per_s": round(tokens_per_s, 1), "wall_s": wall,
            })
        eta = (total_steps - step) * elapsed / len(rows)
        self.reporter.show(
            f"step {step:>6}/{total_steps} | loss {rows[-1][0]:.4f} | lr {self.lr(step - 1):.2e} | "
            f"{tokens_per_s:,.0f} tok/s | ETA {eta / 60:.1f} min",
            loss=f"{rows[-1][0]:.4f}", tps=f"{tokens_per_s:,.0f}",
        )
        self.pending = []


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN or Inf (Python writes them, other readers choke): a skipped step's loss is null."""
    return value if math.isfinite(value) else None


__all__ = [
    "MAY_CHANGE_ON_RESUME", "PretrainTrainer", "TrainResult", "derived_seed", "lr_at", "param_groups",
    "redraw_random_features", "run_training", "train", "warmup_cosine",
]
