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
update is skipped); after ``max_bad_steps`` non-finite losses in a row the run is marked diverged and
stops. The rule is :func:`kernelmix.training.spikes.is_spike`.

Data: ``[N, T]`` token windows (:func:`kernelmix.data.text_windows`). Training windows are drawn with a generator seeded by (seed, step), so a resumed run
sees exactly the batches it would have seen. Validation is fixed: the first ``eval_seqs`` windows of
the validation documents.

Interruption: :func:`finetune` with ``out_dir`` writes an atomic checkpoint (trainable weights,
optimizer, step; :mod:`kernelmix.training.checkpoint`) every ``checkpoint_every`` steps and
``resume=True`` continues from the newest one. 
"""

from __future__ import annotations

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..evaluate import evaluate_windows
from ..training import checkpoint as ckpt
from ..training.loop import Reporter, derived_seed, truncate_metrics, warmup_cosine
from ..training.spikes import is_spike
from .attention import decoder_layers, kernels
from .convert import resolve_layers, set_trainable

MODES = ("partial", "lora", "full")


@dataclass
class FinetuneConfig:
    """The training budget and recipe (shared by every variant of a comparison)."""

    mode: str = "partial"
    steps: int = 100
    seq_len: int = 256
    batch_size: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 25
    eval_seqs: int = 4
    checkpoint_every: int = 0  # 0: at every evaluation
    train_embeddings: bool = False
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0
    spike_nats: float = 0.5
    spike_window: int = 20
    max_bad_steps: int = 5

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown finetuning mode {self.mode!r} (choose from: {', '.join(MODES)})")
        for name in ("steps", "seq_len", "batch_size", "eval_every", "eval_seqs", "lora_rank", "spike_window", "max_bad_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip < 0 or self.weight_decay < 0 or self.spike_nats <= 0:
            raise ValueError("grad_clip and weight_decay must be ≥ 0 and spike_nats > 0")

    @classmethod
    def from_dict(cls, data: dict) -> "FinetuneConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown finetune option(s) {unknown} (known: {', '.join(sorted(known))})")
        config = cls(**data)
        config.validate()
        return config



# ---------------------------------------------------------------------------------------------
# What is trained


def _layer_indices(model, layers: Any) -> list[int]:
    found = kernels(model)
    return list(found) if found else resolve_layers(model, layers)


def prepare_trainable(model, config: FinetuneConfig, layers: Any = "all"):
    """Freeze / unfreeze ``model`` for ``config.mode`` (wrapping it with LoRA adapters for ``lora``).
    Returns ``(model, trainable parameters)``: for ``lora`` the returned model is the peft wrapper."""
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
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=pattern, bias="none")
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
            p.requires_grad_(True)
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
    """Merge LoRA adapters into the weights (a no-op for other modes) and freeze everything."""
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
    """Finetune ``model`` (converted or not) on ``train_windows`` ``[N, T]``; evaluate on
    ``val_windows`` every ``config.eval_every`` steps. Returns ``(model, result)``: the model with
    LoRA merged and parameters frozen, and a dict with the per-step losses, evaluations, spikes,
    wall time and tokens/s. ``stop_at`` ends early after that many steps (for resume tests)."""

    config.validate()
    if train_windows.dim() != 2 or val_windows.dim() != 2:
        raise ValueError(f"windows must be [N, T] token ids, got {tuple(train_windows.shape)} and {tuple(val_windows.shape)}")
    torch.manual_seed(config.seed)
    model, params = prepare_trainable(model, config, layers)
    # weight decay on weight matrices only; not on M, whose natural centre is the identity
    metric_ids = {id(k.transform) for k in kernels(_base(model)).values() if k.transform is not None}
    decay = [p for p in params if p.dim() >= 2 and id(p) not in metric_ids]
    decay_ids = {id(p) for p in decay}
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": [p for p in params if id(p) not in decay_ids], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    out = Path(out_dir) if out_dir is not None else None
    state = {"step": 0, "losses": [], "evals": [], "spikes": [], "skipped": 0, "train_s": 0.0}
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        latest = ckpt.latest_checkpoint(out) if resume else None
        if latest is not None:
            saved = ckpt.load_checkpoint(latest)
            if saved.config.get("finetune") != asdict(config):
                raise ValueError(f"{latest} was written with another finetune config; use another --out or drop --resume")
            own = dict(model.named_parameters())
            missing = [n for n in trainable_names if n not in saved.weights]
            if missing:
                raise ValueError(f"{latest} lacks trainable tensors (e.g. {missing[0]}); it is from another model or mode")
            with torch.no_grad():
                for n in trainable_names:
                    own[n].copy_(saved.weights[n])
            optimizer.load_state_dict(saved.state["optimizer"])
            state = saved.state["progress"]
            truncate_metrics(out / "metrics.jsonl", state["step"])  # lines written after that checkpoint
        elif not resume and ckpt.latest_checkpoint(out) is not None:
            raise ValueError(f"{out} already holds finetuning checkpoints; pass resume=True (--resume) or use another directory")
        else:  # a fresh start (a run killed before its first checkpoint leaves metrics behind)
            (out / "metrics.jsonl").unlink(missing_ok=True)
    reporter = Reporter(out, config.steps, state["step"], progress, active=out is not None) if out is not None else None

    def save(step: int) -> None:
        if out is None:
            return
        weights = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        ckpt.save_checkpoint(out, step, weights, {"step": step, "optimizer": optimizer.state_dict(), "progress": state},
                             {"finetune": asdict(config), "label": label})

    def run_eval(step: int) -> None:
        metrics = evaluate_windows(model, val_windows)
        state["evals"].append({"step": step, **metrics})
        if reporter is not None:
            reporter.write({"kind": "eval", "step": step, **metrics})
            reporter.show(f"{label} step {step}: val loss {metrics['loss']:.4f}", val=f"{metrics['loss']:.3f}")

    if state["step"] == 0 and not state["evals"]:
        run_eval(0)
    model.train()
    bad_in_a_row = 0
    diverged = False
    t_start = time.perf_counter() - state["train_s"]
    end = config.steps if stop_at is None else min(config.steps, stop_at)
    while state["step"] < end:
        step = state["step"]
        lr = warmup_cosine(step, lr=config.lr, min_lr=config.lr * config.min_lr_ratio,
                          warmup_steps=config.warmup_steps, total_steps=config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x = train_windows[_batch_indices(config, step, train_windows.shape[0])]
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        value = float(loss.detach())
        spike = is_spike(state["losses"], value, window=config.spike_window, nats=config.spike_nats)
        if spike:
            state["spikes"].append({"step": step, "loss": value})
        optimizer.zero_grad(set_to_none=True)
        finite = math.isfinite(value)
        if finite:
            loss.backward()
            # A finite loss can still have a non-finite gradient; stepping on it would turn every
            # parameter into NaN. Such an update is skipped like a non-finite loss.
            norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else float("inf"))
            finite = bool(torch.isfinite(norm))
            if finite:
                bad_in_a_row = 0
                optimizer.step()
            else:
                if spike:  # already counted for its loss: mark why the update was skipped
                    state["spikes"][-1]["gradient"] = "non-finite"
                else:
                    state["spikes"].append({"step": step, "loss": value, "gradient": "non-finite"})
                    spike = True
        if not finite:  # skip the update; too many in a row and the run has diverged
            bad_in_a_row += 1
            state["skipped"] += 1
            if bad_in_a_row >= config.max_bad_steps:
                diverged = True
        state["losses"].append(value)
        state["step"] = step + 1
        state["train_s"] = time.perf_counter() - t_start
        if reporter is not None:
            tokens = state["step"] * config.batch_size * config.seq_len
            reporter.write({"kind": "train", "step": state["step"], "loss": value, "lr": lr, "spike": spike,
                            "tokens": tokens, "wall_s": state["train_s"]})
            reporter.show(f"{label} step {state['step']}: loss {value:.4f}", loss=f"{value:.3f}",
                          tps=f"{tokens / max(state['train_s'], 1e-9):.0f}")
            reporter.advance(state["step"])
        if diverged:
            break
        if state["step"] % config.eval_every == 0 or state["step"] == config.steps:
            run_eval(state["step"])
            model.train()
        every = config.checkpoint_every or config.eval_every
        if state["step"] % every == 0 or state["step"] == config.steps:
            save(state["step"])
    if reporter is not None:
        reporter.close()
    model.eval()
    done = state["step"] >= config.steps or diverged
    if diverged and (not state["evals"] or state["evals"][-1]["step"] != state["step"]):
        state["evals"].append({"step": state["step"], **evaluate_windows(model, val_windows)})
    tokens = state["step"] * config.batch_size * config.seq_len
    result = {
        "label": label,
        "config": asdict(config),
        "steps_done": state["step"],
        "finished": done,
        "diverged": diverged,
        "losses": state["losses"],
        "evals": state["evals"],
        "spikes": state["spikes"],
        "num_spikes": len(state["spikes"]),
        "skipped_updates": state["skipped"],
        "trainable_parameters": sum(p.numel() for p in params),
        "train_s": state["train_s"],
        "tokens": tokens,
        "tokens_per_s": tokens / max(state["train_s"], 1e-9),
        "final": state["evals"][-1] if state["evals"] else None,
        "initial": state["evals"][0] if state["evals"] else None,
    }
    return finished_model(model), result


__all__ = ["FinetuneConfig", "MODES", "finetune", "finished_model", "prepare_trainable"]
