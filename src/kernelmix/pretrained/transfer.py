"""Attention transfer (LoLCATs' first stage): train each converted layer's kernel so that its
output matches the host's exact attention output, with the host frozen.

One pass of the host (exact attention) over the calibration windows records every converted
layer's q, k and v (:func:`~.calibration.capture`): each layer is then trained on the host's own
inputs, independently of the others, so nothing the earlier layers' kernels do reaches a later
layer's data. The target is exact causal softmax attention on those q, k, v, over pieces of
``min(seq_len, sliding window)`` tokens for a host's sliding-window layers (inside such a piece the
host's window sees every earlier token, so the chunked op runs) and the whole window for global
layers. The loss is a relative MSE ‖f(out) − f(target)‖² / ‖f(target)‖² (f below), minimised
with Adam on the kernel's own parameters (:meth:`trainable`: DARKFormer's M, Hedgehog's query and
key maps; Performer has none, and is skipped). W stays the layer's own: it is
the feature map the converted model keeps, so fitting M to it is the point, not overfitting.

Where the outputs are compared (``TransferConfig.objective``): ``"attention"`` takes f = identity,
the attention output before o_proj (LoLCATs' choice). ``"residual"`` takes f = what the layer
writes into the residual stream (:func:`~.attention.residual_write`): o_proj, then, in Gemma 2 / 3,
the post-attention RMSNorm of each token. That norm rescales every token's output to the same size,
so tokens with a small attention output, whose relative error the first objective barely weighs,
count as much as the rest. On Gemma 3 270M's layer 11 after an ``"attention"`` transfer the error
was 0.077 before the norm and 0.34 after it, yet training on the second made the held-out loss
worse (+0.207 over the host against +0.182; results/conversion-objective): ``"attention"`` stays
the default.

DARKFormer starts cooler than its conversion: M is multiplied by ``darkformer_start`` (0.1) first.
The whitened M reproduces the host's kernel exactly, but at a pretrained model's logit scale the
positive-feature estimate of that kernel is useless: on Gemma 3 270M's global layers its typical
value was e^-14 of the true mass beyond the window (heavy tails: the mean lives in features m = 64
draws never hit), so the feature part weighed nothing and its gradient was noise (transfer from
there left the error at the window's own, 0.20–0.22). From M/10 the estimate is usable and transfer
brings the error to 0.07–0.16.

Interruption: with ``out_dir`` an atomic checkpoint (every kernel's trained tensors, Adam's state,
where the run is, the losses so far; :mod:`kernelmix.training.checkpoint`) is written every
``checkpoint_every`` steps and after each layer, and ``resume=True`` continues from the newest valid
one exactly (the steps are deterministic: step s of a layer uses piece s mod N). A non-finite loss
or gradient undoes the step and halves the learning rate of that layer.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..errors import KernelmixError
from ..output import progress_bar, write_json_atomic
from ..training import checkpoint as ckpt
from .attention import decoder_layers, is_local, kernels, residual_write
from .calibration import Captured, capture
from .settings import DEFAULT_LR, TRANSFER_FILES, TransferConfig  # torch-free: exported here as before


@dataclass
class Piece:
    """One training piece of a layer: the host's q ``[1, H, T, d]``, k, v ``[1, H_kv, T, d]`` and the
    exact attention output ``[1, T, H, d_v]`` on them."""

    query: Tensor
    key: Tensor
    value: Tensor
    target: Tensor
    scaling: float
    written: Tensor | None = None  # the host's residual write of ``target`` (objective "residual")


def layer_pieces(items: list[Captured], length: int) -> list[Piece]:
    """Cut a layer's captured windows into pieces of ``length`` tokens (the last shorter piece of a
    window is dropped unless it is the only one) with their exact causal attention as targets."""
    pieces = []
    for c in items:
        total = c.query.shape[2]
        starts = list(range(0, max(total - length, 0) + 1, length)) if total >= length else [0]
        for b in range(c.query.shape[0]):
            for s in starts:
                q, k, v = (x[b:b + 1, :, s:s + length].float() for x in (c.query, c.key, c.value))
                groups = q.shape[1] // k.shape[1]
                target = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True, scale=c.scaling)
                pieces.append(Piece(q, k, v, target.transpose(1, 2), c.scaling))
    return pieces


def relative_error(kernel, piece: Piece, write: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """‖f(kernel(q, k, v)) − f(exact)‖² / ‖f(exact)‖² on one piece (the transfer loss): f = identity,
    or with ``write`` the layer's residual write (``piece.written`` holds f(exact))."""
    out = kernel.attend(piece.query, piece.key, piece.value, None, piece.scaling).float()
    target = piece.target
    if write is not None:
        out, target = write(out), piece.written
    return (out - target).pow(2).mean() / target.pow(2).mean()


def _write_modules(layer) -> list:
    """The host modules of a layer's residual write (not the layer: its kernel is a submodule)."""
    return [m for m in (layer.self_attn.o_proj, getattr(layer, "post_attention_layernorm", None)) if m is not None]


@contextlib.contextmanager
def _frozen(modules):
    """The modules' parameters without gradients inside the block (the residual write's o_proj and
    norm: the loss differentiates through them, not into them), as they were afterwards."""
    params = [p for m in modules for p in m.parameters()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def transfer(model, calibration: Tensor, config: TransferConfig | None = None, *, attention_mask: Tensor | None = None,
             out_dir: str | Path | None = None, resume: bool = False, progress: bool = False,
             log: Callable[[str], None] | None = None) -> dict:
    """Train every converted layer's kernel to reproduce the host's attention on ``calibration``
    token ids ``[N, T]`` (module docstring). Returns ``{"layers": {i: {"losses": [...], "first":
    float, "last": float}}, "seconds": float}``; the kernels are trained in place."""
    config = TransferConfig() if config is None else config
    config.validate()
    todo = {i: k for i, k in kernels(model).items()}
    if not todo:
        raise KernelmixError("attention transfer needs a converted model (no layer has a kernel): convert it first "
                             "(kernelmix convert ... --transfer, or kernelmix.pretrained.convert)")
    if calibration.dim() != 2 or calibration.numel() == 0:
        raise KernelmixError("calibration must be token ids [N, T] with N, T ≥ 1, got shape "
                             f"{tuple(calibration.shape)}: give some calibration text")
    trained = {i: k for i, k in todo.items() if k.trainable() and hasattr(k, "attend_window")}
    started = time.perf_counter()
    record = {"layers": {}, "skipped": sorted(set(todo) - set(trained)), "config": asdict(config)}
    with torch.no_grad():  # before the resume, which loads the trained tensors over it
        for kernel in trained.values():
            if kernel.mixer == "darkformer":
                kernel.transform.mul_(config.darkformer_start)
    position = _resume(out_dir, resume, trained, record)
    total_steps = len(trained) * config.steps
    bar = progress_bar(progress, "transfer", total_steps, completed=position["done"], fields={"loss": "rel. error {}"})
    waiting = [i for i in trained if not record["layers"].get(str(i), {}).get("done")]
    captured = capture(model, calibration, attention_mask, layers=waiting, batch_size=1) if waiting else {}
    decoder = decoder_layers(model)
    try:
        with _frozen([m for i in trained for m in _write_modules(decoder[i])]):
            for i, kernel in trained.items():
                entry = record["layers"].setdefault(str(i), {"losses": []})
                if entry.get("done"):
                    continue
                attn = decoder[i].self_attn
                window = getattr(attn, "sliding_window", None) if is_local(attn) else None
                pieces = layer_pieces(captured[i], min(calibration.shape[1], window or calibration.shape[1]))
                write = residual_write(decoder[i]) if config.objective == "residual" else None
                if write is not None:
                    with torch.no_grad():
                        for piece in pieces:
                            piece.written = write(piece.target)
                _train_layer(i, kernel, pieces, write, config, entry, position, out_dir, trained, record, bar, log)
    finally:
        bar.close()
    record["seconds"] = record.get("seconds", 0.0) + time.perf_counter() - started
    if out_dir is not None:
        write_json_atomic(Path(out_dir) / "transfer.json", record)
    return record


def _train_layer(i, kernel, pieces, write, config, entry, position, out_dir, trained, record, bar, log) -> None:
    params = kernel.trainable()
    lr = config.lr if config.lr is not None else DEFAULT_LR[kernel.mixer]
    entry["lr"] = lr
    optimizer = torch.optim.Adam(params, lr=lr)
    start = 0
    if position.get("layer") == i and position.get("optimizer") is not None:
        optimizer.load_state_dict(position["optimizer"])
        start = position["step"]
    last_good = [p.detach().clone() for p in params]
    for step in range(start, config.steps):
        for group in optimizer.param_groups:  # cosine from lr to lr/10 (halved after a non-finite step)
            group["lr"] = lr * entry.get("lr_factor", 1.0) * (
                0.1 + 0.45 * (1 + math.cos(math.pi * step / config.steps)))
        loss = relative_error(kernel, pieces[step % len(pieces)], write)
        value = float(loss.detach())
        optimizer.zero_grad()
        if math.isfinite(value):
            loss.backward()
        grads_ok = math.isfinite(value) and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
        if grads_ok:
            last_good = [p.detach().clone() for p in params]
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
        else:  # undo: back to the last finite parameters, at half the rate
            with torch.no_grad():
                for p, good in zip(params, last_good):
                    p.copy_(good)
            optimizer.state.clear()
            entry["lr_factor"] = entry.get("lr_factor", 1.0) * 0.5
        entry["losses"].append(value)
        position["done"] += 1
        bar.advance()
        bar.update(loss=f"{value:.3f}")
        if log is not None and (step % 50 == 0 or step == config.steps - 1):
            log(f"layer {i} step {step}: relative error {value:.4f}")
        finished = step == config.steps - 1
        if finished:
            entry.update(done=True, first=entry["losses"][0],
                         last=float(sum(entry["losses"][-10:]) / len(entry["losses"][-10:])))
        if out_dir is not None and (finished or (step + 1) % config.checkpoint_every == 0):
            _save(out_dir, position["done"], trained, record, i, step + 1, None if finished else optimizer.state_dict())


def _save(out_dir, done, trained, record, layer, step, optimizer_state) -> None:
    weights = {f"{i}.{n}": p.detach().clone() for i, k in trained.items() for n, p in _named_trainable(k)}
    state = {"step": done, "layer": layer, "layer_step": step, "optimizer": optimizer_state}
    ckpt.save_checkpoint(Path(out_dir) / "transfer", done, weights, state, {"record": record})


def _named_trainable(kernel) -> list[tuple[str, Tensor]]:
    ids = {id(p) for p in kernel.trainable()}
    return [(n, p) for n, p in kernel.named_parameters() if id(p) in ids]


def _resume(out_dir, resume: bool, trained: dict, record: dict) -> dict:
    """Where to start: ``{"done": steps done in all, "layer", "step", "optimizer"}``; with ``resume``
    the newest valid checkpoint's kernels, record and position are loaded."""
    position = {"done": 0, "layer": None, "step": 0, "optimizer": None}
    if out_dir is None:
        if resume:
            raise KernelmixError("resume=True needs the out_dir of the interrupted transfer")
        return position
    root = Path(out_dir) / "transfer"
    found = ckpt.load_latest_valid(root) if root.exists() else None
    if found is None:
        if resume:
            raise KernelmixError(f"nothing to resume in {root}: run the transfer without resume")
        return position
    if not resume:
        raise KernelmixError(f"{root} holds an interrupted attention transfer: pass resume=True (--resume) to continue "
                             "it, or choose another output directory")
    _check_same_budget(root, found.config["record"].get("config", {}), record["config"])
    with torch.no_grad():
        for i, kernel in trained.items():
            for n, p in _named_trainable(kernel):
                p.copy_(found.weights[f"{i}.{n}"])
    record.update(found.config["record"])
    state = found.state
    layer = state["layer"] if state["optimizer"] is not None else None
    return {"done": state["step"], "layer": layer, "step": state["layer_step"], "optimizer": state["optimizer"]}



def _check_same_budget(root: Path, saved: dict, asked: dict) -> None:
    """A resumed transfer continues the one it was: the same steps, learning rate, objective, ...
    (a checkpoint written before a field existed had that field's default; checkpoint_every may change)."""
    saved = {**asdict(TransferConfig()), **saved}
    changed = sorted(k for k in asked if k != "checkpoint_every" and saved.get(k) != asked[k])
    if changed:
        what = ", ".join(f"{k}={saved.get(k)!r} (asked {asked[k]!r})" for k in changed)
        raise KernelmixError(f"{root} holds a transfer with another budget: {what}; resume it with the same settings, "
                             "or start afresh in another output directory")


__all__ = ["DEFAULT_LR", "TRANSFER_FILES", "Piece", "TransferConfig", "layer_pieces", "relative_error", "transfer"]
