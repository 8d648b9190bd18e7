"""End-to-end distillation of a converted model's kernels: the host's next-token distribution as the target.

Attention transfer (:mod:`.transfer`) fits each converted layer to the host's attention output on the
host's own inputs, one layer at a time. What it cannot see is how the layers' remaining errors add up:
on Gemma 3 270M's global layers a per-layer error of 0.05–0.13 still cost 0.2 nats/token. This stage
trains the same kernel parameters (DARKFormer's M, Hedgehog's maps; the host stays frozen) on the
quantity the user measures: KL(host ‖ converted) of the next-token distributions on calibration text.

The target needs no second model: the converted model run under
:func:`~.attention.exact_attention` *is* the host. Only positions beyond the window carry a signal
(inside it a converted layer is exact), and the vocabulary projection dominates the cost, so each step
scores ``positions`` positions drawn from the rest of one calibration window.

Interruption: as in transfer, an atomic checkpoint every ``checkpoint_every`` steps (the kernels'
tensors, Adam's state, the losses) and ``resume=True`` continues exactly (step s uses window s mod N
and positions drawn from a generator seeded by ``seed`` and s).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..errors import KernelmixError
from ..output import progress_bar, write_json_atomic
from ..training import checkpoint as ckpt
from .attention import exact_attention, kernels
from .settings import DISTILL_FILES, DistillConfig  # torch-free: exported here as before

def scored_positions(length: int, skip: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` sorted positions in ``[skip, length - 1)`` (each predicts the next token), all of them
    when fewer; ``skip`` is the converted layers' exact part (window and sinks), where they equal the host."""
    first = min(skip, length - 2)
    choices = torch.arange(first, length - 1)
    if choices.numel() > count:
        choices = choices[torch.randperm(choices.numel(), generator=generator)[:count]]
    return choices.sort().values


def kl_to_host(model, window: Tensor, positions: Tensor) -> Tensor:
    """KL(host ‖ model) of the next-token distributions at ``positions`` of one window ``[1, T]``,
    averaged over them (the host: the same model under exact attention, no gradient)."""
    with torch.no_grad(), exact_attention():
        target = torch.log_softmax(
            model(input_ids=window, logits_to_keep=positions, use_cache=False).logits.float(), -1)
    logits = model(input_ids=window, logits_to_keep=positions, use_cache=False).logits.float()
    return (target.exp() * (target - torch.log_softmax(logits, -1))).sum(-1).mean()


def distill(model, calibration: Tensor, config: DistillConfig | None = None, *, out_dir: str | Path | None = None,
            resume: bool = False, progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Train the converted kernels of ``model`` to match the host's next-token distribution on
    ``calibration`` token ids ``[N, T]`` (module docstring); in place. Returns ``{"losses": [...],
    "first": float, "last": float, "seconds": float, "config": {...}}``."""
    config = DistillConfig() if config is None else config
    config.validate()
    found = kernels(model)
    params = [p for k in found.values() for p in k.trainable()]
    if not params:
        raise KernelmixError("logit distillation needs a converted model with trainable kernels (darkformer or "
                             "hedgehog): convert it first, with one of those mixers")
    if calibration.dim() != 2 or calibration.shape[0] == 0 or calibration.shape[1] < 3:
        raise KernelmixError(f"calibration must be token ids [N, T] with N ≥ 1 and T ≥ 3, got shape "
                             f"{tuple(calibration.shape)}: give some calibration text")
    skip = max(getattr(k, "window", 0) + getattr(k, "sinks", 0) for k in found.values())
    started = time.perf_counter()
    optimizer = torch.optim.Adam(params, lr=config.lr)
    record = {"losses": [], "config": asdict(config)}
    start = _resume(out_dir, resume, found, optimizer, record)
    flags = [p.requires_grad for p in params]
    bar = progress_bar(progress, "distill", config.steps, completed=start, fields={"loss": "KL {}"})
    try:
        for p in params:
            p.requires_grad_(True)
        for step in range(start, config.steps):
            value = _step(model, calibration, config, params, optimizer, step, skip, record)
            bar.advance()
            bar.update(loss=f"{value:.4f}")
            if log is not None and (step % 10 == 0 or step == config.steps - 1):
                log(f"distill step {step}: KL {value:.4f}")
            if out_dir is not None and ((step + 1) % config.checkpoint_every == 0 or step == config.steps - 1):
                _save(out_dir, step + 1, found, optimizer, record)
    finally:
        bar.close()
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    tail = record["losses"][-10:]
    record.update(first=record["losses"][0], last=sum(tail) / len(tail))
    record["seconds"] = record.get("seconds", 0.0) + time.perf_counter() - started
    if out_dir is not None:
        write_json_atomic(Path(out_dir) / "distill.json", record)
    return record


def _step(model, calibration, config, params, optimizer, step, skip, record) -> float:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    window = calibration[step % calibration.shape[0]][None]
    positions = scored_positions(window.shape[1], skip, config.positions, generator)
    for group in optimizer.param_groups:  # cosine from lr to lr/10
        group["lr"] = config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / config.steps)))
    loss = kl_to_host(model, window, positions)
    value = float(loss.detach())
    optimizer.zero_grad()
    if math.isfinite(value):
        loss.backward()
    if math.isfinite(value) and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
    else:  # a non-finite step changes nothing (the parameters are as before it)
        optimizer.zero_grad()
    record["losses"].append(value)
    return value


def _named(found: dict) -> dict[str, Tensor]:
    ids = {i: {id(p) for p in k.trainable()} for i, k in found.items()}
    return {f"{i}.{n}": p for i, k in found.items() for n, p in k.named_parameters() if id(p) in ids[i]}


def _save(out_dir, step: int, found: dict, optimizer, record: dict) -> None:
    weights = {n: p.detach().clone() for n, p in _named(found).items()}
    ckpt.save_checkpoint(Path(out_dir) / "distill", step, weights, {"step": step, "optimizer": optimizer.state_dict()},
                         {"record": record})


def _resume(out_dir, resume: bool, found: dict, optimizer, record: dict) -> int:
    """The step to start from; with ``resume`` the newest valid checkpoint's kernels, Adam state and record."""
    if out_dir is None:
        if resume:
            raise KernelmixError("resume=True needs the out_dir of the interrupted distillation")
        return 0
    root = Path(out_dir) / "distill"
    saved = ckpt.load_latest_valid(root) if root.exists() else None
    if saved is None:
        if resume:
            raise KernelmixError(f"nothing to resume in {root}: run the distillation without resume")
        return 0
    if not resume:
        raise KernelmixError(f"{root} holds an interrupted logit distillation: pass resume=True (--resume) to continue "
                             "it, or choose another output directory")
    with torch.no_grad():
        for name, p in _named(found).items():
            p.copy_(saved.weights[name])
    optimizer.load_state_dict(saved.state["optimizer"])
    record.update(saved.config["record"])
    return saved.state["step"]


__all__ = ["DISTILL_FILES", "DistillConfig", "distill", "kl_to_host", "scored_positions"]
