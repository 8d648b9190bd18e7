"""Analytic FLOP counts: each mixer's op (what ``kernelmix bench`` reports) and a whole
:class:`~kernelmix.model.CausalLM` per training token (what ``kernelmix compare --budget flops``
makes equal).

    from kernelmix.model import ModelConfig
    from kernelmix.studies.flops import model_flops
    count = model_flops(ModelConfig.preset("tiny", mixer="cubit"), length=512)
    count.forward, count.training, count.to_dict()        # FLOPs per token, and by part

**What is counted.** Matrix products only (matmul, einsum, linear, attention products), one
multiply-add = 2 FLOPs. Not counted: the elementwise work — RMSNorm, RoPE, SiLU and the gate
product, the residual adds and the cross-entropy, O(hidden) per token and layer against the
products' O(hidden²); the softmax exps and sums of the T² mixers, O(T) per token and head against
their products' O(T·d) —, the embedding lookup (a gather), and the optimizer's update (per
parameter, not per token). Training is counted as
3 × forward: the backward of a product is two products of the same size (the gradients of both
operands); ``kernelmix bench`` uses the same convention. The tests check every count against
``torch.utils.flop_counter.FlopCounterMode`` (tests/test_flops.py).

**Per token and layer, forward** (D hidden, H query heads, H_kv key/value heads, d head dim,
I the SwiGLU width, V the vocabulary, T the sequence length):

    q, k, v, o projections     2·D·d·(2·H + 2·H_kv)
    SwiGLU MLP                 6·D·I
    LM head (once per model)   2·D·V
    the mixer's own products   Cubit and Cubit-RF: r projection 2·D·H·d (reference="separate")
                               and the ρ gate 2·D·H (lrr); DeltaFormer: the β gate 2·D·H;
                               DARKFormer (and Cubit-RF with data_aware): the query fold F q,
                               2·H·d²; softmax and Performer: none
    the op                     H · forward_flops(mixer, T, d, m, C) / T (below)

**The ops** (forward, per sequence and query head; the causal pairs j ≤ i are T(T+1)/2, those
with j < i T(T−1)/2; C = min(chunk size, T), T_C = T rounded up to whole chunks):

    softmax       2·T·(T+1)·d      q·k and A·v over the causal pairs
    cubit         2·T·(2T+1)·d     Gram r·r̂ over j ≤ i (T(T+1)·d), the forward substitution over
                                   j < i (T(T−1)·d), read-out as softmax (2·T·(T+1)·d)
    deltaformer   4·T²·d           w·k and the combination over j < i (2·T(T−1)·d), read-out
    performer     4·T·m·d + 4·T_C·m·(d+1) + 2·T_C·C·(m+d+1)
                                   features of q and k; every chunk's state and its read-out
                                   (values carry a ones column for the denominator); the
                                   intra-chunk scores and their read-out (dense C×C blocks)
    darkformer    performer + 4·T·d²   (M applied to q̃ and k̃)
    cubit-rf      4·T·m·d + 2·T_C·C·m + 2·T_C·m + 6·T_C·m·d + N·C·(C−1)·(d+m) + performer
                                   (N = T_C / C chunks) the Gram's features of r and r̂ (W, 2·T·m·d
                                   each); per chunk the C×C Gram numerators (2·C²·m) and their
                                   carried normaliser (2·C·m); the state products of the
                                   substitution: the carried state read by the chunk's solved
                                   features, the state update and U's correction (3 × 2·C·m·d);
                                   the triangular solve of each chunk, C(C−1)/2 pairs j < i for the
                                   d value columns and the m feature columns solved with them; then
                                   Performer's read-out of U (features of q and k, chunked). With
                                   ``data_aware`` (M, not in the op call): + 8·T·d² (M on r, r̂, q̃, k̃)

The T² terms count the pairs the causal mask keeps, as a per-row loop computes them; the fast
paths compute them in blocks (the CPU attention kernel skips whole masked blocks, the chunked
solves work in tiles), which does about the same work at long lengths. The random-feature ops
are counted as implemented: they are nothing but products, and FlopCounterMode sees all of them.
So is Cubit-RF, linear in T at whole chunks: every product as it runs (what FlopCounterMode sees)
plus its per-chunk ``solve_triangular`` (which it does not), counted over the pairs j < i as
Cubit's substitution is.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any

from ..errors import KernelmixError
from ..layers import MIXERS
from ..model import ModelConfig

#: training FLOPs per forward FLOP: the forward and a backward of twice its products
TRAINING_FACTOR = 3


def forward_flops(mixer: str, length: int, head_dim: int, num_features: int, chunk_size: int) -> float:
    """Forward FLOPs of ``mixer``'s op on one sequence of ``length`` tokens, per (batch, query
    head) — see the module docstring for the counts."""
    t, d, m = length, head_dim, num_features
    if mixer == "softmax":
        return 2.0 * t * (t + 1) * d
    if mixer == "cubit":
        return 2.0 * t * (2 * t + 1) * d
    if mixer == "deltaformer":
        return 4.0 * t * t * d
    if mixer in ("performer", "darkformer", "cubit-rf"):
        c = min(chunk_size, t)
        padded = math.ceil(t / c) * c if t else 0
        count = 4.0 * t * m * d + 4.0 * padded * m * (d + 1) + 2.0 * padded * c * (m + d + 1)  # features + read-out
        if mixer == "cubit-rf":  # + the solve: Gram features, chunk numerators and normaliser, state products, solves
            chunks = padded // c if t else 0
            count += (4.0 * t * m * d + 2.0 * padded * c * m + 2.0 * padded * m + 6.0 * padded * m * d
                      + chunks * c * (c - 1) * (d + m))
        return count + (4.0 * t * d * d if mixer == "darkformer" else 0.0)
    raise KernelmixError(f"unknown mixer {mixer!r} (choose from: {', '.join(MIXERS)})")


def mixer_option(config: ModelConfig, mixer: str, name: str) -> Any:
    """The value of the layer option ``name`` that ``mixer``'s layers of a model built from
    ``config`` get: from ``config.mixer_options``, else the layer's default."""
    options = config.mixer_options.get(mixer, {})
    if name in options:
        return options[name]
    return inspect.signature(MIXERS[mixer].__init__).parameters[name].default


def layer_flops(config: ModelConfig, mixer: str, length: int) -> dict[str, float]:
    """Forward FLOPs per token of one block whose mixer is ``mixer``, at ``length``:
    ``{"projections", "mixer_layer", "mixer_op", "mlp"}`` (see the module docstring)."""
    if mixer not in MIXERS:
        raise KernelmixError(f"unknown mixer {mixer!r} (choose from: {', '.join(MIXERS)})")
    hidden, heads, kv_heads, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    own = 0.0  # the mixer's products outside its op
    # Cubit-RF's data_aware M (and fold F): not in its op call's count (forward_flops), added here
    data_aware = mixer == "cubit-rf" and mixer_option(config, mixer, "data_aware")
    if mixer in ("cubit", "cubit-rf"):
        if mixer_option(config, mixer, "reference") == "separate":
            own += 2.0 * hidden * heads * d
        if mixer_option(config, mixer, "lrr"):
            own += 2.0 * hidden * heads
    elif mixer == "deltaformer":
        own += 2.0 * hidden * heads
    if mixer == "darkformer" or data_aware:
        own += 2.0 * heads * d * d
    features = mixer_option(config, mixer, "num_features") if mixer in ("performer", "darkformer", "cubit-rf") else 0
    op = forward_flops(mixer, length, d, features, config.chunk_size) + (8.0 * length * d * d if data_aware else 0.0)
    return {
        "projections": 2.0 * hidden * d * (2 * heads + 2 * kv_heads),
        "mixer_layer": own,
        "mixer_op": heads * op / length,
        "mlp": 6.0 * hidden * config.intermediate_size,
    }


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per token of a whole model at one sequence length, by part (every layer
    summed): ``projections`` (q, k, v, o), ``mixer_layer`` (the mixers' own products outside their
    ops), ``mixer_op`` (the ops), ``mlp``, ``lm_head``; ``embedding`` is a lookup, 0."""

    length: int
    projections: float
    mixer_layer: float
    mixer_op: float
    mlp: float
    lm_head: float
    embedding: float = 0.0

    @property
    def forward(self) -> float:
        return self.projections + self.mixer_layer + self.mixer_op + self.mlp + self.lm_head + self.embedding

    @property
    def training(self) -> float:
        """Forward + backward FLOPs per training token (:data:`TRAINING_FACTOR` × forward)."""
        return TRAINING_FACTOR * self.forward

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "forward": self.forward, "training": self.training}


def model_flops(config: ModelConfig, length: int) -> ModelFlops:
    """The FLOPs per token of a :class:`~kernelmix.model.CausalLM` built from ``config`` on
    sequences of ``length`` tokens (hybrids: every layer with its own mixer)."""
    if not isinstance(config, ModelConfig):
        raise KernelmixError(f"config must be a ModelConfig, got {type(config).__name__}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise KernelmixError(f"length must be a positive int (tokens per sequence), got {length!r}")
    parts = {"projections": 0.0, "mixer_layer": 0.0, "mixer_op": 0.0, "mlp": 0.0}
    for mixer in config.layer_mixers():
        for name, value in layer_flops(config, mixer, length).items():
            parts[name] += value
    return ModelFlops(length=length, lm_head=2.0 * config.hidden_size * config.vocab_size, **parts)


def training_flops_per_token(config: ModelConfig, length: int) -> float:
    """Forward + backward FLOPs per training token at ``length`` (:attr:`ModelFlops.training`)."""
    return model_flops(config, length).training


__all__ = ["TRAINING_FACTOR", "ModelFlops", "forward_flops", "layer_flops", "mixer_option", "model_flops",
           "training_flops_per_token"]
