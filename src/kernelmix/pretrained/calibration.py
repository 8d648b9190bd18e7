"""Calibration of a converted model's DARKFormer layers on real text: capture the host's attention
inputs, whiten (the data-aware transform, kernel preserved) and distill (fit M so each layer's
output matches exact softmax attention on the same q/k/v; host weights untouched)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from ..output import progress_bar
from .attention import ATTENTION_NAME, decoder_layers, exact_attention, kernels, record_attention, register
from .layer_kernels import RandomFeatureKernel



@dataclass
class Captured:
    """One layer's attention inputs on calibration text (HF layouts) and its scaling."""

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    scaling: float


@torch.no_grad()
def capture(model, input_ids: Tensor, attention_mask: Tensor | None = None, layers: Iterable[int] | None = None,
            batch_size: int = 1) -> dict[int, list[Captured]]:
    """Run the *original* model (exact attention) on ``input_ids`` ``[B, T]`` and return the
    attention inputs of ``layers`` (default: the converted ones), one :class:`Captured` per batch.

    Args:
        model: a Hugging Face causal LM, converted or not (it runs inside :func:`exact_attention`, with the
            ``kernelmix`` implementation switched on for the call).
        input_ids: calibration token ids ``[B, T]``, on the model's device.
        attention_mask: ``[B, T]`` (1: token, 0: padding), passed to the model; or None.
        layers: the decoder-layer indices to record (None: the converted layers, :func:`kernels`).
        batch_size: rows of ``input_ids`` per forward.

    Returns:
        ``{layer index: [Captured, ...]}``: per forward of ``batch_size`` rows, one :class:`Captured` (the
        detached query, key and value in HF layouts, the mask, the scaling)."""
    register()
    wanted = set(kernels(model) if layers is None else layers)
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(decoder_layers(model))}
    out: dict[int, list[Captured]] = {i: [] for i in wanted}

    def hook(module, query, key, value, mask, scaling):
        i = layer_of.get(id(module))
        if i in wanted:
            out[i].append(Captured(query.detach(), key.detach(), value.detach(),
                                   None if mask is None else mask.detach(),
                                   float(scaling if scaling is not None else module.head_dim**-0.5)))

    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION_NAME
    try:
        with exact_attention(), record_attention(hook):
            for b0 in range(0, input_ids.shape[0], batch_size):
                am = None if attention_mask is None else attention_mask[b0:b0 + batch_size]
                model(input_ids=input_ids[b0:b0 + batch_size], attention_mask=am, use_cache=False)
    finally:
        model.config._attn_implementation = previous
    return out


def token_samples(items: list[Captured], kernel: RandomFeatureKernel) -> tuple[Tensor, Tensor]:
    """Feature-space query samples ``[N, H, d]`` (before the fold) and key samples ``[N, H_kv, d]``.

    Args:
        items: one layer's captured inputs (:func:`capture`).
        kernel: that layer's :class:`RandomFeatureKernel` (its ``head_dim`` gives the op's scale).

    Returns:
        ``(q, k)`` in float32: every captured position's query as the op receives it (times
        ``scaling · √d``), ``[N, H, d]``, and its key, ``[N, H_kv, d]``; N is the sum of B·T over ``items``."""
    qs, ks = [], []
    for c in items:
        scale = c.scaling * math.sqrt(kernel.head_dim)
        qs.append((c.query.transpose(1, 2) * scale).reshape(-1, c.query.shape[1], c.query.shape[3]).float())
        ks.append(c.key.transpose(1, 2).reshape(-1, c.key.shape[1], c.key.shape[3]).float())
    return torch.cat(qs), torch.cat(ks)


def whiten(model, captured: dict[int, list[Captured]], eps: float = 1e-3) -> None:
    """Set every DARKFormer layer's M, F from captured statistics (docs/math.md §7; kernel preserved).

    Args:
        model: a converted model; layers of other mixers are left as they are.
        captured: :func:`capture`'s inputs, with an entry for every DARKFormer layer.
        eps: regularises the second moments, relative to their trace (``RandomFeatureMap.whiten_``).

    Returns:
        None; each DARKFormer kernel's ``transform`` (M) and ``query_fold`` (F) are set in place."""
    for i, kernel in kernels(model).items():
        if kernel.mixer == "darkformer":
            q, k = token_samples(captured[i], kernel)
            kernel.whiten_(q, k, eps)


def exact_output(c: Captured) -> Tensor:
    """Exact softmax attention on captured inputs, ``[B, T, H, d_v]`` (host semantics incl. mask).

    Args:
        c: one :class:`Captured` (query ``[B, H, T, d]``, key/value ``[B, H_kv, L, d]``); without a mask,
            plain causal attention.

    Returns:
        SDPA's output with the key/value heads repeated to the query heads, ``[B, T, H, d_v]``, in the
        inputs' dtype."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = c.query.shape[1] // c.key.shape[1]
    mask = c.mask  # SDPA takes the host's mask as it is: bool (True = visible) or additive
    out = torch.nn.functional.scaled_dot_product_attention(
        c.query, repeat_kv(c.key, groups), repeat_kv(c.value, groups), attn_mask=mask,
        is_causal=mask is None, scale=c.scaling)
    return out.transpose(1, 2)


def distill(model, captured: dict[int, list[Captured]], *, steps: int = 200, lr: float = 5e-3,
            train_fold: bool = False, redraw: bool = True, seed: int = 0, progress: bool = False,
            log: Callable | None = None) -> dict[int, list[float]]:
    """Per-layer attention-output distillation: train each DARKFormer layer's M (and F when
    ``train_fold``) with Adam to minimise ‖RF(q, k, v) − softmax(q, k, v)‖² / ‖softmax‖² on the
    captured calibration inputs (teacher under no-grad; host weights untouched).

    ``redraw`` (default): a fresh W every step (seeded by ``seed``), so M is fitted to the
    estimator in expectation over W — with one fixed W, M overfits that draw and a fresh W (any
    other m or seed) does worse than the whitened start (measured on Gemma 3 270M). The layer's
    own W is restored afterwards. With redraws the per-step loss is noisy, so the final M is kept
    (non-finite steps are still undone); with a fixed W the lowest-loss M is kept.

    Args:
        model: a converted model; its DARKFormer layers are trained one after another, the others untouched.
        captured: :func:`capture`'s inputs, with an entry for every DARKFormer layer (step s uses its
            item ``s % len(items)``).
        steps: Adam steps per layer.
        lr: Adam's learning rate (halved after each non-finite step); gradients are clipped to norm 1.
        train_fold: train F as well as M.
        redraw: a fresh W every step (see above); False: the layer's own W throughout.
        seed: seeds each layer's redraws (``seed * 1000003 + layer``).
        progress: show a progress bar over every layer's steps.
        log: called with a message every 50 steps and at each layer's last step; None: silent.

    Returns:
        The loss history per layer: ``{layer index: [relative MSE of each step]}``, non-finite ones included."""
    history: dict[int, list[float]] = {}
    todo = [(i, k) for i, k in kernels(model).items() if k.mixer == "darkformer"]
    bar = progress_bar(progress, "distill", len(todo) * steps)
    for i, kernel in todo:
        history[i] = _distill_layer(i, kernel, captured[i], steps=steps, lr=lr, train_fold=train_fold, redraw=redraw,
                                    seed=seed, bar=bar, log=log)
    bar.close()
    return history


def _distill_layer(i, kernel, items, *, steps, lr, train_fold, redraw, seed, bar, log) -> list[float]:
    """One layer of :func:`distill`: trains ``kernel``'s M (and F) in place, returns its losses."""
    with torch.no_grad():
        teachers = [exact_output(c).float() for c in items]
        norms = [t.pow(2).mean() for t in teachers]
    transform = nn.Parameter(kernel.transform.detach().float().clone())
    params = [transform]
    fold = None
    if train_fold:
        fold = nn.Parameter(kernel.query_fold.detach().float().clone())
        params.append(fold)
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    # Guard against blow-ups (real models give the estimator a huge variance): clip the
    # gradient, undo a step whose loss or parameters are not finite (and halve the rate),
    # and (fixed W only) keep the parameters with the lowest loss seen.
    best = (float("inf"), [p.detach().clone() for p in params])
    last_good = [p.detach().clone() for p in params]
    own_projection = kernel.projection
    generator = torch.Generator().manual_seed(seed * 1000003 + i)
    for step in range(steps):
        if redraw:
            kernel.projection = kernel.draw_projection(generator, kernel.num_features).to(own_projection)
        c = items[step % len(items)]
        t = teachers[step % len(items)]
        out = kernel.attend(c.query.float(), c.key.float(), c.value.float(), c.mask, c.scaling, transform=transform,
                            fold=fold)
        loss = (out.float() - t).pow(2).mean() / norms[step % len(items)]
        value = float(loss.detach())
        if not math.isfinite(value):
            with torch.no_grad():
                for p, b in zip(params, last_good if redraw else best[1]):
                    p.copy_(b)
            for group in opt.param_groups:
                group["lr"] *= 0.5
            opt.state.clear()
            losses.append(value)
            bar.advance()
            continue
        if value < best[0]:
            best = (value, [p.detach().clone() for p in params])
        last_good = [p.detach().clone() for p in params]
        if loss.requires_grad:  # not when every key is inside the window: the features then weigh nothing
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        losses.append(value)
        bar.advance()
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(f"layer {i} step {step}: relative MSE {value:.4g} (best {best[0]:.4g})")
    kernel.projection = own_projection
    with torch.no_grad():
        if not redraw or not all(bool(torch.isfinite(p).all()) for p in params):
            for p, b in zip(params, last_good if redraw else best[1]):
                p.copy_(b)
        kernel.transform.copy_(transform.to(kernel.transform))
        if fold is not None:
            kernel.query_fold.copy_(fold.to(kernel.query_fold))
    return losses


__all__ = ["Captured", "capture", "distill", "exact_output", "token_samples", "whiten"]
