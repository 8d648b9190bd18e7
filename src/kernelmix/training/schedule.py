"""The pieces of a training run that depend on nothing but their arguments: the optimizer's
parameter groups, the learning-rate schedule, seeds derived from a run's seed, redraws of the random
features, and the RNG states a checkpoint keeps (:mod:`.loop` puts them together)."""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import torch
from torch import nn

from ..model import CausalLM
from .config import TrainConfig


def param_groups(model: CausalLM, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on the weight matrices of linear layers only. Not decayed:
    embeddings (and the LM head tied to them: decay would shrink rare tokens' vectors, which get
    few gradients), norm gains and biases (decaying them towards 0 changes the function, not its
    complexity), and mixer parameters that are not linear maps — Cubit's per-head scales, the
    DARKFormer metric M, whose natural centre is the identity it starts at, not 0.

    Args:
        model: a :class:`~kernelmix.model.CausalLM` (``model.embed`` is its embedding).
        weight_decay: the decay of the first group.

    Returns:
        Two groups, ``{"params": decayed, "weight_decay": weight_decay}`` and ``{"params": the rest,
        "weight_decay": 0.0}``, each parameter in one of them once."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay_ids.discard(id(model.embed.weight))  # a tied LM head is the embedding
    decay, no_decay = [], []
    for param in model.parameters():  # each shared (tied) parameter once
        (decay if id(param) in decay_ids else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of update ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then cosine decay reaching ``min_lr`` at the last update.

    Args:
        step: the update, 0-based.
        lr: the peak rate, reached at update ``warmup_steps - 1`` (or at once without warmup).
        min_lr: the rate of the last update (and of any beyond it).
        warmup_steps: updates of linear warmup (0: none).
        total_steps: the run's number of updates.

    Returns:
        The learning rate."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (lr - min_lr)


def lr_at(step: int, config: TrainConfig, total_steps: int) -> float:
    """:func:`warmup_cosine` with a run's settings.

    Args:
        step: the update, 0-based.
        config: the run's :class:`TrainConfig` (``lr``, ``min_lr``, ``warmup_steps``).
        total_steps: the run's number of updates (``steps``, or what ``tokens`` makes of it).

    Returns:
        The learning rate of update ``step``."""
    return warmup_cosine(step, lr=config.lr, min_lr=config.min_lr, warmup_steps=config.warmup_steps,
                         total_steps=total_steps)


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed from any values (the same on every process and every Python run).

    Args:
        parts: values whose ``repr`` is hashed (SHA-256), e.g. ``(seed, "redraw", step, index)``.

    Returns:
        An int in ``[0, 2**63)``."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def redraw_random_features(model: nn.Module, seed: int, step: int) -> int:
    """New projections for every Performer/DARKFormer layer, from a generator seeded by
    (seed, step, layer): identical on every process without communication, different per layer.

    Args:
        model: any module; each submodule with a ``redraw_`` method is redrawn.
        seed: the run's seed.
        step: the step the redraw happens at.

    Returns:
        The number of layers redrawn."""
    count = 0
    for index, module in enumerate(model.modules()):
        redraw = getattr(module, "redraw_", None)
        if callable(redraw):
            redraw(torch.Generator().manual_seed(derived_seed(seed, "redraw", step, index)))
            count += 1
    return count


def rng_state() -> dict[str, Any]:
    """This process's RNG states in types that ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover - numpy comes with the data module
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
