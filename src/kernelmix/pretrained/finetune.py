"""Finetune a pretrained causal LM (Gemma / Llama families, converted or not) on real text.

What is trained (``mode``):

* ``partial`` — the attention inputs of the chosen layers: q/k/v projections, the QK-norm scales
  (Gemma) and the DARKFormer metric M. Everything else, W included, stays fixed.
* ``lora`` — low-rank adapters (``peft``) on the same q/k/v projections plus M; merged back into
  the weights after training, so the result is a plain converted model.
* ``full`` — every parameter except the token embedding and the LM head tied to it (they hold
  most of a small model's parameters and are not what the conversion changed;
  ``train_embeddings=True`` trains them too).

The softmax variant (the host, unconverted) is finetuned with the same mode, layers and budget:
finetuning on the text also adapts any model to its domain, so the honest ceiling for a converted
model is the host finetuned the same way, not the host as it was. Both are reported.

Stability: a *loss spike* is an update whose training loss exceeds the median of the previous
``spike_window`` losses by more than max(``spike_nats``, 4σ) — σ a robust (MAD) estimate of the
batch-to-batch noise in those losses — or is not finite, or has a non-finite gradient (such an
update is skipped); after ``max_bad_steps`` skipped updates in a row the run is marked diverged and
stops. The rule is :func:`kernelmix.training.spikes.is_spike`, the bookkeeping
:class:`kernelmix.training.spikes.SpikeGuard`; the loop is the trainer of ``kernelmix train``
(:class:`kernelmix.training.trainer.Trainer`) with finetuning's batches, parameter groups and
checkpoint contents (:class:`FinetuneTrainer`).

Data: ``[N, T]`` token windows (:func:`kernelmix.data.windows.text_windows`). Training windows are
drawn with a generator seeded by (seed, step), so a resumed run sees exactly the batches it would
have seen. Validation is fixed: the first ``eval_seqs`` windows of
the validation documents.

Interruption: :func:`finetune` with ``out_dir`` writes an atomic checkpoint (trainable weights,
optimizer, step; :mod:`kernelmix.training.checkpoint`) every ``checkpoint_every`` steps and
``resume=True`` continues from the newest valid one, exactly. SIGINT/SIGTERM finish the step, save
it and raise :class:`kernelmix.errors.Interrupted` (:mod:`kernelmix.training.signals`). While it
writes, ``out_dir`` is locked against a second writer (:func:`kernelmix.locks.run_directory_lock`).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import Interrupted, KernelmixError
from ..evaluate import evaluate_windows
from ..locks import run_directory_lock
from ..training import checkpoint as ckpt
from ..training.schedule import derived_seed, warmup_cosine
from ..training.reporter import Reporter, truncate_metrics
from ..training.signals import signal_name
from ..training.spikes import SpikeGuard
from ..training.trainer import Schedule, StepOutcome, Trainer
from .attention import decoder_layers, kernels
from .convert import resolve_layers, set_trainable
from .settings import MODES, FinetuneConfig  # torch-free: exported here as before


# ---------------------------------------------------------------------------------------------
# What is trained


def _layer_indices(model, layers: Any) -> list[int]:
    found = kernels(model)
    return list(found) if found else resolve_layers(model, layers)


def prepare_trainable(model, config: FinetuneConfig, layers: Any = "all"):
    """Freeze / unfreeze ``model`` for ``config.mode`` (wrapping it with LoRA adapters for ``lora``).
    The kernels' own parameters (DARKFormer's M, Cubit's λ and s) train in every mode when
    ``config.train_kernels``.

    Args:
        model: a Hugging Face causal LM, converted or not.
        config: the :class:`FinetuneConfig` (``mode``, ``train_embeddings``, ``train_kernels``, ``lora_rank``,
            ``lora_alpha``).
        layers: whose q/k/v projections train in ``partial`` and ``lora`` (``"all"``, ``"global"``,
            ``"local"`` or indices; :func:`resolve_layers`); ignored for a converted model, whose converted
            layers are used. ``full`` trains every layer.

    Returns:
        ``(model, trainable parameters)``: for ``lora`` the returned model is the peft wrapper. Nothing
        to train is a ValueError."""
    indices = _layer_indices(model, layers)
    for p in model.parameters():
        p.requires_grad_(False)
    names = ("q_proj", "k_proj", "v_proj")
    if config.mode == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ImportError("mode='lora' needs peft: pip install peft (or kernelmix[pretrained])") from None
        prefix = _decoder_prefix(model)
        pattern = rf"{re.escape(prefix)}\.({'|'.join(map(str, indices))})\.self_attn\.({'|'.join(names)})"
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=pattern,
                          bias="none")
        with warnings.catch_warnings():
            # peft (0.21) reads the model's `is_gradient_checkpointing`, which transformers 5 deprecated
            # in favour of `is_activation_checkpointing`; the call is peft's, not ours, so only this
            # one warning is silenced, and only here
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            model = get_peft_model(model, lora)
    elif config.mode == "partial":
        set_trainable(model, layers=indices)
    else:  # full
        embedding_ids = {id(p) for p in model.get_input_embeddings().parameters()}
        head = model.get_output_embeddings()
        if head is not None:
            embedding_ids |= {id(p) for p in head.parameters()}
        for p in model.parameters():
            if config.train_embeddings or id(p) not in embedding_ids:
                p.requires_grad_(True)
    for kernel in kernels(_base(model)).values():  # the DARKFormer metric M (Cubit's λ, s) train in every mode
        for p in kernel.trainable():
            p.requires_grad_(config.train_kernels)
    seen, params = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("nothing to train: the chosen layers have no q/k/v projections")
    return model, params


def _decoder_prefix(model) -> str:
    layers = decoder_layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise ValueError("could not find the decoder layers of the model")


def _base(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def finished_model(model):
    """Merge LoRA adapters into the weights (a no-op for other modes) and freeze everything.

    Args:
        model: what :func:`prepare_trainable` returned (for ``lora``, the peft wrapper).

    Returns:
        The plain model (the peft wrapper merged and unloaded), every parameter with ``requires_grad`` False."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    return model



# ---------------------------------------------------------------------------------------------
# Training


def _batch_indices(config: FinetuneConfig, step: int, count: int) -> Tensor:
    gen = torch.Generator().manual_seed(derived_seed(config.seed, "finetune-batch", step))
    return torch.randint(0, count, (config.batch_size,), generator=gen)


def finetune_param_groups(model, params: list, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable ``params``: weight decay on weight matrices only; not on M,
    whose natural centre is the identity."""
    metric_ids = {id(k.transform) for k in kernels(_base(model)).values() if k.transform is not None}
    decay = [p for p in params if p.dim() >= 2 and id(p) not in metric_ids]
    decay_ids = {id(p) for p in decay}
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) not in decay_ids], "weight_decay": 0.0}]


def finetune(
    model,
    train_windows: Tensor,
    val_windows: Tensor,
    config: FinetuneConfig,
    *,
    layers: Any = "all",
    out_dir: str | Path | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    progress: bool | None = False,
    label: str = "finetune",
):
    """Finetune ``model`` (converted or not) and evaluate it every ``config.eval_every`` steps.

    Args:
        model: a Hugging Face causal LM, converted by :func:`convert` or the host itself.
        train_windows, val_windows: ``[N, T]`` token ids.
        config: the :class:`FinetuneConfig` (mode, steps, lr, sequence length, seed, ...).
        layers: the layers whose parameters train (``"all"``, ``"global"``, indices; see
            :func:`resolve_layers`); a converted model's converted layers take precedence.
        out_dir: where checkpoints go (None: none, no resume).
        resume: continue from the newest valid checkpoint in ``out_dir``, exactly.
        stop_at: end early after that many steps (for resume tests).
        progress: a bar (True), nothing (False), or plain lines unless stderr is a terminal (None).
        label: the run's name in the progress bar and log.

    Returns:
        ``(model, result)``: the model with LoRA merged and parameters frozen, and a dict with the
        per-step losses, evaluations, spikes, wall time and tokens/s."""

    config.validate()
    if train_windows.dim() != 2 or val_windows.dim() != 2:
        raise ValueError(f"windows must be [N, T] token ids, got {tuple(train_windows.shape)} and "
                         f"{tuple(val_windows.shape)}")
    out = Path(out_dir) if out_dir is not None else None
    with contextlib.ExitStack() as stack:
        if out is not None:  # one writer per run directory, from before anything of it is read
            with ckpt.writing(out, "create the run directory"):
                stack.enter_context(run_directory_lock(out, "kernelmix finetune"))
        torch.manual_seed(config.seed)
        model, params = prepare_trainable(model, config, layers)
        optimizer = torch.optim.AdamW(finetune_param_groups(model, params, config.weight_decay), lr=config.lr,
                                      betas=(0.9, 0.95))
        state = open_finetune_run(out, resume, model, optimizer, config)
        reporter = Reporter(out, config.steps, state["step"], progress, active=True) if out is not None else None
        trainer = FinetuneTrainer(model, optimizer, params, train_windows, val_windows, config, state,
                                  out=out, stop_at=stop_at, label=label, reporter=reporter)
        model.train()
        try:
            trainer.run()
        finally:
            if reporter is not None:
                reporter.close()
    model.eval()
    result = trainer.result()  # before LoRA is merged: a diverged run is evaluated as it stopped
    return finished_model(model), result


def open_finetune_run(out: Path | None, resume: bool, model, optimizer, config: FinetuneConfig) -> dict:
    """The progress to start from: a fresh one, or (``resume``) that of the newest checkpoint in
    ``out``, whose trainable weights and optimizer state are loaded into ``model``/``optimizer``
    after checking that it is from this config and model. Refuses to start afresh over
    checkpoints; a fresh start drops the metrics a run killed before its first checkpoint left."""
    fresh = {"step": 0, "losses": [], "evals": [], "spikes": [], "skipped": 0, "train_s": 0.0}
    if out is None:
        return fresh
    out.mkdir(parents=True, exist_ok=True)
    if ckpt.latest_checkpoint(out) is not None and not resume:
        raise KernelmixError(f"{out} already holds finetuning checkpoints; pass resume=True (--resume) or use another "
                             "directory")
    saved = ckpt.load_latest_valid(out) if resume else None  # a damaged newest one: warned about, skipped
    if saved is None:  # nothing to continue (a run killed before its first checkpoint): start over
        (out / "metrics.jsonl").unlink(missing_ok=True)
        return fresh
    latest = saved.path
    # a run saved before the option trained them
    stored = {"train_kernels": True, **(saved.config.get("finetune") or {})}
    if stored != asdict(config):
        raise KernelmixError(f"{latest} was written with another finetune config; use another --out or drop --resume")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if n not in saved.weights]
    if missing:
        raise KernelmixError(f"{latest} lacks trainable tensors (e.g. {missing[0]}); it is from another model or mode")
    own = dict(model.named_parameters())
    with torch.no_grad():
        for n in trainable:
            own[n].copy_(saved.weights[n])
    optimizer.load_state_dict(saved.state["optimizer"])
    truncate_metrics(out / "metrics.jsonl", saved.state["progress"]["step"])  # lines written after that checkpoint
    return saved.state["progress"]


class FinetuneTrainer(Trainer):
    """:func:`finetune` on the pieces of :class:`kernelmix.training.trainer.Trainer`: each step one
    batch of random training windows drawn by (seed, step); a plain forward (one process, no
    autocast); an update whose loss or gradient is not finite is skipped and spikes are booked
    (:class:`~kernelmix.training.spikes.SpikeGuard`), ``max_bad_steps`` skipped in a row stop the
    run as diverged; an evaluation is :func:`kernelmix.evaluate.evaluate_windows` of the
    validation windows; a checkpoint holds the trainable weights, the optimizer and ``state``
    (the progress: step, losses, evaluations, spikes, skipped updates, seconds)."""

    skip_non_finite = True

    def __init__(self, model, optimizer, params, train_windows: Tensor, val_windows: Tensor, config: FinetuneConfig,
                 state: dict, *, out: Path | None, stop_at: int | None, label: str, reporter: Reporter | None):
        self.model, self.optimizer, self.params, self.grad_clip = model, optimizer, params, config.grad_clip
        self.train_windows, self.val_windows, self.config, self.state = train_windows, val_windows, config, state
        self.out, self.label, self.reporter = out, label, reporter
        self.guard = SpikeGuard(window=config.spike_window, nats=config.spike_nats, max_bad_steps=config.max_bad_steps,
                                losses=state["losses"], spikes=state["spikes"], skipped=state["skipped"])
        start = state["step"]
        self.schedule = Schedule(
            total_steps=config.steps, start_step=start, resumed=start > 0 or bool(state["evals"]),
            eval_every=config.eval_every, checkpoint_every=config.checkpoint_every or config.eval_every,
            stop_at=None if stop_at is None else max(start, min(stop_at, config.steps)), save_at_stop=False,
        )
        self.t_start: float | None = None  # train_s counts from the first step (not the first evaluation)
        self.saved: Path | None = None  # the checkpoint this call wrote last

    def lr(self, step: int) -> float:
        config = self.config
        return warmup_cosine(step, lr=config.lr, min_lr=config.lr * config.min_lr_ratio,
                             warmup_steps=config.warmup_steps, total_steps=config.steps)

    def micro_batches(self, step: int) -> list[Tensor]:
        return [self.train_windows[_batch_indices(self.config, step, self.train_windows.shape[0])]]

    def loss(self, batch: Tensor) -> Tensor:
        return self.model(input_ids=batch, labels=batch, use_cache=False).loss

    def evaluate(self, step: int) -> None:
        metrics = evaluate_windows(self.model, self.val_windows)
        self.state["evals"].append({"step": step, **metrics})
        if self.reporter is not None:
            self.reporter.write({"kind": "eval", "step": step, **metrics})
            self.reporter.show(f"{self.label} step {step}: val loss {metrics['loss']:.4f}",
                               val=f"{metrics['loss']:.3f}")

    def save(self, step: int) -> None:
        if self.out is None:
            return
        weights = {n: p.detach().contiguous() for n, p in self.model.named_parameters() if p.requires_grad}
        self.saved = ckpt.save_checkpoint(
            self.out, step, weights, {"step": step, "optimizer": self.optimizer.state_dict(), "progress": self.state},
            {"finetune": asdict(self.config), "label": self.label})

    def interrupted(self, step: int, signal_number: int) -> Interrupted:
        name, steps = signal_name(signal_number), self.config.steps
        if self.out is None:
            where = "nothing was saved (finetune was called without out_dir)"
        elif self.saved is not None:
            where = f"saved {str(self.saved)!r}; continue with resume=True (kernelmix finetune --resume)"
        else:
            where = "no update was done since it started, so there was nothing new to save; run it again"
        return Interrupted(f"{self.label} interrupted by {name} at step {step}/{steps}: {where}", signal_number)

    def before_step(self, step: int) -> None:
        if self.t_start is None:
            self.t_start = time.perf_counter() - self.state["train_s"]

    def after_step(self, step: int, outcome: StepOutcome) -> bool:
        """Book the update (spike, skipped), log it; stop when the run has diverged."""
        state, value = self.state, float(outcome.loss)
        grad_finite = outcome.updated if math.isfinite(value) else None  # None: the loss itself was not finite
        spike = self.guard.record(step - 1, value, grad_finite=grad_finite, updated=outcome.updated)
        state["skipped"], state["step"] = self.guard.skipped, step
        state["train_s"] = time.perf_counter() - self.t_start
        if self.reporter is not None:
            tokens = step * self.config.batch_size * self.train_windows.shape[1]  # the windows as given
            self.reporter.write({"kind": "train", "step": step, "loss": value, "lr": self.lr(step - 1), "spike": spike,
                                 "tokens": tokens, "wall_s": state["train_s"]})
            self.reporter.show(f"{self.label} step {step}: loss {value:.4f}", loss=f"{value:.3f}",
                               tps=f"{tokens / max(state['train_s'], 1e-9):.0f}")
            self.reporter.advance(step)
        return self.guard.diverged

    def result(self) -> dict:
        """The result dict of :func:`finetune` (a diverged run is evaluated where it stopped)."""
        state, config, diverged = self.state, self.config, self.guard.diverged
        if diverged and (not state["evals"] or state["evals"][-1]["step"] != state["step"]):
            state["evals"].append({"step": state["step"], **evaluate_windows(self.model, self.val_windows)})
        tokens = state["step"] * config.batch_size * self.train_windows.shape[1]
        return {
            "label": self.label,
            "config": asdict(config),
            "steps_done": state["step"],
            "finished": state["step"] >= config.steps or diverged,
            "diverged": diverged,
            "losses": state["losses"],
            "evals": state["evals"],
            "spikes": state["spikes"],
            "num_spikes": len(state["spikes"]),
            "skipped_updates": state["skipped"],
            "trainable_parameters": sum(p.numel() for p in self.params),
            "train_s": state["train_s"],
            "tokens": tokens,
            "tokens_per_s": tokens / max(state["train_s"], 1e-9),
            "final": state["evals"][-1] if state["evals"] else None,
            "initial": state["evals"][0] if state["evals"] else None,
        }


__all__ = ["FinetuneConfig", "FinetuneTrainer", "MODES", "finetune", "finetune_param_groups", "finished_model",
           "open_finetune_run", "prepare_trainable"]
