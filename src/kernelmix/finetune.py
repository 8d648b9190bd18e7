"""Finetune a converted pretrained causal LM (Gemma / Llama families) on real text, and compare
exact softmax, Performer and DARKFormer at equal m and equal budget.

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
stops. :func:`compare_finetune` with several learning rates is the learning-rate sweep of the
stability claim.

Data: documents are split into train / validation by document (:func:`kernelmix.data.split_documents`),
tokenized with the model's tokenizer, joined with BOS between documents and cut into windows of
``seq_len``. Training windows are drawn with a generator seeded by (seed, step), so a resumed run
sees exactly the batches it would have seen. Validation is fixed: the first ``eval_seqs`` windows of
the validation documents.

Interruption: :func:`finetune` with ``out_dir`` writes an atomic checkpoint (trainable weights,
optimizer, step; :mod:`kernelmix.training.checkpoint`) every ``checkpoint_every`` steps and
``resume=True`` continues from the newest one. :func:`compare_finetune` keeps each finished run's
result and skips it on the next call.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from . import convert as cv

MODES = ("partial", "lora", "full")
VARIANTS = ("softmax", "performer", "darkformer", "cubit")  # cubit: the experimental conversion
DEFAULT_VARIANTS = ("softmax", "performer", "darkformer")
INITS = ("identity", "whiten", "distill", "whiten+distill")


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

    @property
    def min_lr(self) -> float:  # what kernelmix.training.loop.lr_at reads
        return self.lr * self.min_lr_ratio

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
# Data


def split_texts(documents, val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Train / validation texts from :class:`kernelmix.data.Document` s, split by document."""
    from .data.corpus import split_documents

    documents = list(documents)
    if len(documents) < 2:
        raise ValueError(f"finetuning needs at least 2 documents (one for validation), got {len(documents)}; "
                         "give a directory or corpus with more documents")
    train, val = split_documents([d.name for d in documents], val_fraction, seed)
    return [documents[i].text for i in train], [documents[i].text for i in val]


def token_windows(tokenizer, texts: Sequence[str], seq_len: int, max_windows: int | None = None) -> Tensor:
    """``[N, seq_len]`` windows cut from the texts joined with BOS (when the tokenizer has one)
    before each document; the tail that does not fill a window is dropped."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids: list[int] = []
    limit = None if max_windows is None else seq_len * max_windows
    for text in texts:
        if bos is not None:
            ids.append(bos)
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if limit is not None and len(ids) >= limit:
            break
    count = len(ids) // seq_len if limit is None else min(len(ids) // seq_len, max_windows)
    if count == 0:
        raise ValueError(f"not enough text: {len(ids)} tokens, fewer than one window of {seq_len}; give more text or lower seq_len")
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


# ---------------------------------------------------------------------------------------------
# What is trained


def _layer_indices(model, layers: Any) -> list[int]:
    found = cv.kernels(model)
    return list(found) if found else cv.resolve_layers(model, layers)


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
        cv.set_trainable(model, layers=indices)
    else:  # full
        embedding_ids = {id(p) for p in model.get_input_embeddings().parameters()}
        head = model.get_output_embeddings()
        if head is not None:
            embedding_ids |= {id(p) for p in head.parameters()}
        for p in model.parameters():
            if config.train_embeddings or id(p) not in embedding_ids:
                p.requires_grad_(True)
    for kernel in cv.kernels(_base(model)).values():  # the DARKFormer metric M (Cubit's λ, s) train in every mode
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
    layers = cv._decoder_layers(model)
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
# Evaluation and spikes


@torch.no_grad()
def evaluate_windows(model, windows: Tensor, batch_size: int = 1) -> dict:
    """Next-token loss (nats/token) and accuracy of ``model`` over ``windows`` ``[N, T]``."""
    was_training = model.training
    model.eval()
    total, correct, count = 0.0, 0, 0
    for start in range(0, windows.shape[0], batch_size):
        x = windows[start:start + batch_size]
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        target = x[:, 1:]
        total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    model.train(was_training)
    return {"loss": total / count, "accuracy": correct / count, "tokens": count}


def is_spike(history: Sequence[float], loss: float, *, window: int, nats: float, noise_k: float = 4.0) -> bool:
    """A non-finite loss, or one above the median of the last ``window`` finite losses by more than
    ``max(nats, noise_k · σ)``, σ = 1.4826·MAD of those losses (a robust estimate of the batch-to-batch
    noise: with small batches some windows of text are simply harder, and those are not spikes)."""
    if not math.isfinite(loss):
        return True
    recent = [x for x in history[-window:] if math.isfinite(x)]
    if len(recent) < min(window, 5):
        return False
    centre = statistics.median(recent)
    sigma = 1.4826 * statistics.median([abs(x - centre) for x in recent])
    return loss > centre + max(nats, noise_k * sigma)


def find_spikes(losses: Sequence[float], *, window: int, nats: float) -> list[dict]:
    """Every spike of a loss history (:func:`is_spike` at each step against the steps before it)."""
    return [{"step": step, "loss": value} for step, value in enumerate(losses)
            if is_spike(losses[:step], value, window=window, nats=nats)]


# ---------------------------------------------------------------------------------------------
# Training


def _batch_indices(config: FinetuneConfig, step: int, count: int) -> Tensor:
    from .training.loop import derived_seed

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
    from .training import checkpoint as ckpt
    from .training.loop import _Reporter, _truncate_metrics, lr_at

    config.validate()
    if train_windows.dim() != 2 or val_windows.dim() != 2:
        raise ValueError(f"windows must be [N, T] token ids, got {tuple(train_windows.shape)} and {tuple(val_windows.shape)}")
    torch.manual_seed(config.seed)
    model, params = prepare_trainable(model, config, layers)
    # weight decay on weight matrices only; not on M, whose natural centre is the identity
    metric_ids = {id(k.transform) for k in cv.kernels(_base(model)).values() if k.transform is not None}
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
            _truncate_metrics(out / "metrics.jsonl", state["step"])  # lines written after that checkpoint
        elif not resume and ckpt.latest_checkpoint(out) is not None:
            raise ValueError(f"{out} already holds finetuning checkpoints; pass resume=True (--resume) or use another directory")
        else:  # a fresh start (a run killed before its first checkpoint leaves metrics behind)
            (out / "metrics.jsonl").unlink(missing_ok=True)
    reporter = _Reporter(out, config.steps, state["step"], progress, active=out is not None) if out is not None else None

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
        lr = lr_at(step, config, config.steps)
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


# ---------------------------------------------------------------------------------------------
# Comparison at equal m and budget (+ learning-rate sweep)


def build_variant(host, variant: str, *, num_features: int, layers: Any, init: str, calibration: Tensor | None,
                  seed: int = 0, distill_steps: int = 100, log: Callable | None = None):
    """A fresh copy of ``host`` as ``variant``: ``softmax`` (unchanged), ``performer`` or
    ``darkformer`` (converted with ``init``; the same W draw for both at equal m and seed), or the
    experimental ``cubit`` conversion (global layers only)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (choose from: {', '.join(VARIANTS)})")
    model = copy.deepcopy(host)
    if variant == "softmax":
        return model
    config = cv.ConversionConfig(mixer=variant, layers=layers, num_features=num_features, seed=seed)
    use_init = init if variant == "darkformer" else "identity"
    return cv.convert(model, config, calibration=calibration if use_init != "identity" else None, init=use_init,
                      steps=distill_steps, log=log)


def compare_finetune(
    host,
    train_windows: Tensor,
    val_windows: Tensor,
    config: FinetuneConfig,
    *,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    lrs: Sequence[float] | None = None,
    num_features: int = 64,
    layers: Any = "all",
    init: str = "whiten",
    calib_windows: int = 2,
    distill_steps: int = 100,
    out_dir: str | Path | None = None,
    progress: bool | None = False,
    log: Callable | None = None,
) -> dict:
    """Finetune every variant at every learning rate with the same data, steps, m and seed.
    Returns (and writes to ``out_dir``: ``finetune.json``, ``finetune.md``, PNG plots) the results.
    Finished runs found in ``out_dir`` are reused."""
    say = log or (lambda msg: None)
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r} (choose from: {', '.join(VARIANTS)})")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r} (choose from: {', '.join(INITS)})")
    lrs = list(lrs) if lrs else [config.lr]
    out = Path(out_dir) if out_dir is not None else None
    calibration = train_windows[:calib_windows]
    runs = []
    t_all = time.perf_counter()
    for variant in variants:
        for lr in lrs:
            name = f"{variant}-lr{lr:g}"
            run_dir = out / "runs" / name if out is not None else None
            done_file = run_dir / "result.json" if run_dir is not None else None
            if done_file is not None and done_file.is_file():
                saved = json.loads(done_file.read_text())
                # spikes are a function of the logged losses: recount with the current rule
                by_loss = find_spikes(saved["losses"], window=config.spike_window, nats=config.spike_nats)
                by_gradient = [sp for sp in saved["spikes"] if sp.get("gradient")]
                steps = {sp["step"] for sp in by_loss}
                saved["spikes"] = sorted(by_loss + [sp for sp in by_gradient if sp["step"] not in steps], key=lambda sp: sp["step"])
                saved["num_spikes"] = len(saved["spikes"])
                runs.append(saved)
                say(f"{name}: reusing the finished run in {run_dir}")
                continue
            t = time.perf_counter()
            model = build_variant(host, variant, num_features=num_features, layers=layers, init=init,
                                  calibration=calibration, seed=config.seed, distill_steps=distill_steps, log=log)
            setup_s = time.perf_counter() - t
            run_config = dataclasses.replace(config, lr=lr)
            resume = run_dir is not None and (run_dir / "checkpoints").is_dir()
            model, result = finetune(model, train_windows, val_windows, run_config, layers=layers, out_dir=run_dir,
                                     resume=resume, progress=progress, label=name)
            result.update({"variant": variant, "lr": lr, "num_features": num_features if variant in ("performer", "darkformer") else None,
                           "init": None if variant == "softmax" else (init if variant == "darkformer" else "identity"),
                           "setup_s": setup_s})
            say(f"{name}: val loss {result['initial']['loss']:.3f} → {result['final']['loss']:.3f}, "
                f"acc {result['final']['accuracy']:.3f}, {result['num_spikes']} spikes, {result['train_s']:.0f} s")
            if done_file is not None:
                tmp = done_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(result, indent=1))
                tmp.replace(done_file)
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the run is done; its result is kept
            runs.append(result)
            del model
    report = {
        "format": "kernelmix-finetune-1",
        "settings": {"finetune": asdict(config), "variants": list(variants), "lrs": lrs, "num_features": num_features,
                     "layers": layers, "init": init, "calib_windows": calib_windows,
                     "train_windows": int(train_windows.shape[0]), "val_windows": int(val_windows.shape[0]),
                     "val_tokens": int(val_windows.shape[0] * (val_windows.shape[1] - 1))},
        "runs": runs,
        "wall_s": time.perf_counter() - t_all,
    }
    if out is not None:
        write_report(report, out)
    return report


# ---------------------------------------------------------------------------------------------
# Output


def markdown(report: dict) -> str:
    s = report["settings"]
    f = s["finetune"]
    lines = [
        f"Finetuning ({f['mode']}, {f['steps']} steps × {f['batch_size']} × {f['seq_len']} tokens, warmup {f['warmup_steps']}, "
        f"cosine to {f['min_lr_ratio']}·lr, seed {f['seed']}); m = {s['num_features']}, layers {s['layers']}, "
        f"DARKFormer init {s['init']}; validation {s['val_windows']} held-out windows ({s['val_tokens']} predicted tokens). "
        f"Spike: loss > median of the previous {f['spike_window']} + max({f['spike_nats']} nats, 4σ), σ = 1.4826·MAD of those "
        f"losses (batch noise), or not finite.",
        "",
        "| variant | lr | val loss before | val loss after | val acc after | spikes | diverged | trainable params | train s | tok/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['variant']} | {r['lr']:g} | {r['initial']['loss']:.3f} | {r['final']['loss']:.3f} | {r['final']['accuracy']:.3f} | "
            f"{r['num_spikes']} | {'yes' if r['diverged'] else 'no'} | {r['trainable_parameters']:,} | {r['train_s']:.0f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path, *, plots: bool = True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("finetune.json", json.dumps(report, indent=1)), ("finetune.md", markdown(report))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    if plots:
        try:
            _plots(report, out)
        except ImportError:
            pass
    return out


def _smooth(values: Sequence[float], width: int = 10) -> list[float]:
    finite = [v if math.isfinite(v) else float("nan") for v in values]
    out = []
    for i in range(len(finite)):
        window = [v for v in finite[max(0, i - width + 1): i + 1] if v == v]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def _plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for r in report["runs"]:
        label = f"{r['variant']} lr {r['lr']:g}"
        ax_train.plot(range(1, len(r["losses"]) + 1), _smooth(r["losses"]), label=label)
        ax_val.plot([e["step"] for e in r["evals"]], [e["loss"] for e in r["evals"]], marker="o", label=label)
    ax_train.set(xlabel="step", ylabel="train loss (10-step mean)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss (nats/token)", title="held-out loss")
    ax_val.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "finetune_curves.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI: kernelmix finetune


def _float_list(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"learning rates must be positive numbers, got {text!r}")
    return values


def load_text_windows(tokenizer, text: str, seq_len: int, *, val_fraction: float, eval_seqs: int, seed: int = 0):
    """``(train_windows, val_windows)`` from a corpus name / directory / glob / file, split by document."""
    from .data.corpus import load_corpus

    train_texts, val_texts = split_texts(load_corpus(text).documents(), val_fraction, seed)
    return token_windows(tokenizer, train_texts, seq_len), token_windows(tokenizer, val_texts, seq_len, max_windows=eval_seqs)


def _cli_finetune(args) -> int:
    import sys

    from .pretrained import load_pretrained

    try:
        config = FinetuneConfig(mode=args.mode, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                                lr=_float_list(args.lr)[0], warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                                eval_seqs=args.eval_seqs, train_embeddings=args.train_embeddings, lora_rank=args.lora_rank,
                                seed=args.seed, spike_nats=args.spike_nats)
        config.validate()
        lrs = _float_list(args.lr)
        variants = [v for v in args.variants.split(",") if v]
        layers = cv.parse_layers(args.layers)
        torch.set_num_threads(args.threads) if args.threads else None
        host, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer files; finetune needs one")
        train_w, val_w = load_text_windows(tok, args.text, config.seq_len, val_fraction=args.val_fraction,
                                           eval_seqs=config.eval_seqs, seed=args.seed)
        say = (lambda msg: print(f"  {msg}", flush=True))
        if cv.kernels(host):  # an already converted model: finetune it as it is and save it
            if len(lrs) != 1:
                raise ValueError("an already converted model is finetuned at one learning rate; give one --lr")
            out = Path(args.out)
            model, result = finetune(host, train_w, val_w, config, out_dir=out / "run", resume=args.resume,
                                     progress=True, label="converted")
            cv.save_converted(model, out / "model", tok)
            (out / "result.json").write_text(json.dumps(result, indent=1))
            print(f"val loss {result['initial']['loss']:.4f} → {result['final']['loss']:.4f} "
                  f"(acc {result['final']['accuracy']:.3f}), {result['num_spikes']} spikes; saved the model to {out / 'model'}")
            return 0
        report = compare_finetune(host, train_w, val_w, config, variants=variants, lrs=lrs, num_features=args.num_features,
                                  layers=layers, init=args.init, calib_windows=args.calib_seqs, distill_steps=args.distill_steps,
                                  out_dir=args.out, progress=True, log=say)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"wrote {args.out}/finetune.json, finetune.md and finetune_curves.png ({report['wall_s']:.0f} s)")
    return 0


def add_commands(sub) -> None:
    """Register ``kernelmix finetune``."""
    p = sub.add_parser(
        "finetune",
        help="finetune converted models on real text: softmax vs Performer vs DARKFormer at equal m and budget (+ lr sweep)",
        description="Convert MODEL per variant (softmax = the host unchanged), finetune each with the same data, steps, m "
                    "and seed at each learning rate, and write finetune.json/md and curves. A MODEL directory that is "
                    "already converted (kernelmix convert) is finetuned as it is and saved to OUT/model. Finished runs "
                    "in OUT are reused; an interrupted run continues from its last checkpoint.",
    )
    p.add_argument("model", help="a prepared name (gemma3-270m, smollm2-135m), a local HF causal-LM directory, or a converted one")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="softmax,performer,darkformer (and cubit, experimental)")
    p.add_argument("--mode", choices=MODES, default="partial")
    p.add_argument("--num-features", type=int, default=64, help="m for performer and darkformer (equal m)")
    p.add_argument("--layers", default="all", help="all | global | local | comma-separated indices")
    p.add_argument("--init", choices=INITS, default="whiten", help="DARKFormer initialisation")
    p.add_argument("--text", default="shakespeare", help="corpus name, dir, glob or file (split by document)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", default="1e-4", help="learning rate, or several (comma-separated) for a sweep")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-seqs", type=int, default=4)
    p.add_argument("--calib-seqs", type=int, default=2, help="training windows used to whiten/distill")
    p.add_argument("--distill-steps", type=int, default=100)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--train-embeddings", action="store_true", help="mode=full: train the embedding / LM head too")
    p.add_argument("--spike-nats", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--resume", action="store_true", help="converted MODEL only: continue from OUT/run's last checkpoint")
    p.set_defaults(func=_cli_finetune)


__all__ = [
    "FinetuneConfig",
    "MODES",
    "VARIANTS",
    "build_variant",
    "compare_finetune",
    "evaluate_windows",
    "finetune",
    "finished_model",
    "find_spikes",
    "is_spike",
    "load_text_windows",
    "markdown",
    "prepare_trainable",
    "split_texts",
    "token_windows",
    "write_report",
]
