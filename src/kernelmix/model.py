"""A GPT-style causal language model with a token mixer chosen per layer.

Read top to bottom: the config (its presets: :mod:`kernelmix.presets`), the two sub-blocks (RMSNorm,
SwiGLU), the block, the cache and output, the model and its forward and loss, then the checks of
forward's inputs. The mixers themselves live in :mod:`kernelmix.layers`.

    config = ModelConfig.preset("small", mixer="cubit")
    model = CausalLM(config)
    out = model(input_ids, labels=input_ids)          # out.logits, out.loss, out.cache

Batches with left padding (``attention_mask``) and rows packing several documents
(``position_ids`` that restart at 0 at each document) are both supported: every mixer receives
``doc_start`` — for each token the index of its document's first token — and never reads across
a document boundary or from padding. This module does not import transformers (see
:mod:`kernelmix.hf`).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .errors import KernelmixError
from .layers import LayerCache, build_mixer
from .model_config import ModelConfig, layer_args_from_config
from .ops import keep_solve_operands
from .presets import PRESETS

# ---------------------------------------------------------------------------------------------
# Config: kernelmix.model_config (no torch: what the command line checks train's settings with), and
# its named sizes (GPT-3's widths and depths): kernelmix.presets

# The shared layer arguments that are also config fields (hidden_size, num_heads, head_dim,
# num_kv_heads, rope_theta, chunk_size, backend) come from the config, for every layer; the others
# (bias) may be set per mixer in mixer_options.
LAYER_ARGS_FROM_CONFIG: tuple[str, ...] = layer_args_from_config()


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # normalise in float32 at least: bf16 mean-of-squares loses too much
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = x.to(dtype)
        y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """gate and up ~ N(0, std²), down (a residual output) ~ N(0, out_std²)."""
        nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.up_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


#: What a block recomputes in the backward instead of keeping it from the forward (activation
#: checkpointing, set per block by :func:`kernelmix.training.parallelize`): nothing, the whole block
#: (only its input is kept), or its mixer with the mixer's norm (the part whose activations grow
#: with the sequence: attention weights, Cubit's solves, random features).
BLOCK_RECOMPUTE = ("none", "block", "mixer")


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + SwiGLU(norm(x)).

    ``recompute`` (one of :data:`BLOCK_RECOMPUTE`, default ``"none"``) recomputes the block or
    its mixer in the backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved so
    dropout draws the same masks): the same numbers, less memory, one more forward of that part."""

    def __init__(self, config: ModelConfig, mixer_name: str) -> None:
        super().__init__()
        self.recompute = "none"
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer = build_mixer(
            mixer_name,
            **{name: getattr(config, name) for name in LAYER_ARGS_FROM_CONFIG},
            **config.mixer_options.get(mixer_name, {}),
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Norms at 1; the mixer's and the MLP's projections ~ N(0, std²), the residual output
        projections (``o_proj``, ``down_proj``) ~ N(0, out_std²); the mixer initialises its own
        parameters (Cubit's ρ gate and ridge, DARKFormer's M, ...) and keeps its random projection."""
        self.mixer_norm.reset_parameters()
        self.mixer.reset_parameters(std, out_std)
        self.mlp_norm.reset_parameters()
        self.mlp.reset_parameters(std, out_std)

    def forward(self, x: Tensor, cache: LayerCache | None, position_ids: Tensor | None, doc_start: Tensor | None):
        # only a forward that builds a graph has activations to save (not decoding under no_grad)
        mode = self.recompute if torch.is_grad_enabled() else "none"
        if mode == "block":
            return checkpoint(self._forward, x, cache, position_ids, doc_start, "none", use_reentrant=False,
                              context_fn=keep_solve_operands)
        return self._forward(x, cache, position_ids, doc_start, mode)

    def _forward(self, x: Tensor, cache: LayerCache | None, position_ids: Tensor | None, doc_start: Tensor | None,
                 recompute: str):
        if recompute == "mixer":
            mixed, cache = checkpoint(self._mix, x, cache, position_ids, doc_start, use_reentrant=False,
                                      context_fn=keep_solve_operands)
        else:
            mixed, cache = self._mix(x, cache, position_ids, doc_start)
        x = x + self.dropout(mixed)
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))
        return x, cache

    def _mix(self, x: Tensor, cache: LayerCache | None, position_ids: Tensor | None, doc_start: Tensor | None):
        return self.mixer(self.mixer_norm(x), cache, position_ids=position_ids, doc_start=doc_start)


# ---------------------------------------------------------------------------------------------
# Cache and output


@dataclass
class ModelCache:
    """Per-layer caches plus what the model needs to continue each row.

    ``length``: tokens seen (the index of the next token); ``next_position``/``doc_start``
    ``[B]``: the next token's RoPE position and its document's first index in each row (they
    differ from ``length`` under left padding or packing); ``layer_mixers``: which model built it."""

    layers: list[LayerCache]
    length: int
    next_position: Tensor
    doc_start: Tensor
    layer_mixers: tuple[str, ...]


@dataclass
class CausalLMOutput:
    logits: Tensor
    loss: Tensor | None
    cache: ModelCache | None


# ---------------------------------------------------------------------------------------------
# The model


def _derived_seed(seed: int, index: int) -> int:
    """A 63-bit seed per (seed, module index): one projection draw never shares a stream with another."""
    return int.from_bytes(hashlib.sha256(f"kernelmix.init {seed} {index}".encode()).digest()[:8], "little") >> 1


class CausalLM(nn.Module):
    """Decoder-only LM: embedding → blocks → RMSNorm → LM head (tied to the embedding by default).

    ``CausalLM(config)`` draws its initial weights (and the random-feature projections) from
    torch's global RNG; ``CausalLM(config, seed=s)`` from ``s`` alone (:meth:`init_weights`), so
    that a model built without memory gives the same tensors::

        with torch.device("meta"):
            model = CausalLM(config)           # shapes only: nothing allocated, nothing drawn
        model.to_empty(device="cpu")           # (or "cuda"): uninitialised memory
        model.init_weights(seed=s)             # == CausalLM(config, seed=s), parameters and buffers
    """

    def __init__(self, config: ModelConfig, *, seed: int | None = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise KernelmixError(f"config must be a ModelConfig, got {type(config).__name__}")
        if seed is not None:
            self._check_seed(seed)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, name) for name in config.layer_mixers())
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if seed is None:
            self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if seed is not None:
            self.init_weights(seed)

    @staticmethod
    def _check_seed(seed: Any) -> int:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise KernelmixError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        return seed

    @torch.no_grad()
    def init_weights(self, seed: int) -> "CausalLM":
        """Initialise every parameter and buffer from ``seed`` alone, as :meth:`reset_parameters`
        does (GPT-2's init, each mixer its own) and with new random-feature projections — a pure
        function of (config, seed, device type), whatever the tensors held before (a model built
        under ``torch.device("meta")`` and moved with ``to_empty``). torch's global RNG is left as
        it was. Returns the model.

        The projections are drawn on the CPU from a generator per layer (so they are the same on
        every device); the other tensors from torch's RNG of their device, seeded with ``seed``."""
        self._check_seed(seed)
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            raise KernelmixError(
                "init_weights needs real tensors, this model is on the meta device; allocate them first with "
                "model.to_empty(device='cpu') (or 'cuda')"
            )
        if self.config.tie_embeddings and self.lm_head.weight is not self.embed.weight:
            # to_empty (like any move that swaps parameters) makes the head a parameter of its own
            self.lm_head.weight = self.embed.weight
        cuda = sorted({t.device.index or 0 for t in self.parameters() if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            self.reset_parameters()
        for index, module in enumerate(self.modules()):
            redraw = getattr(module, "redraw_", None)
            if callable(redraw):  # Performer/DARKFormer: W is a buffer reset_parameters keeps
                redraw(torch.Generator().manual_seed(_derived_seed(seed, index)))
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: embedding, LM head and projections ~ N(0, initializer_range²),
        biases 0, norms 1. Every block passes the std on to its mixer, which initialises its own
        parameters. The random-feature projections are kept (``redraw_`` changes them)."""
        std = self.config.initializer_range
        # GPT-2: residual output projections scaled by 1/√(2·layers) so the residual stream's
        # variance does not grow with depth.
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        nn.init.normal_(self.embed.weight, std=std)
        if self.lm_head.weight is not self.embed.weight:  # a tied head is the embedding
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            block.reset_parameters(std, residual_std)
        self.norm.reset_parameters()

    def num_parameters(self) -> int:
        """Trainable parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: ModelCache | None = None,
        use_cache: bool = True,
    ) -> CausalLMOutput:
        """Logits ``[B, T, vocab]``; with ``labels`` ``[B, T]`` the mean next-token loss (labels are
        shifted inside; -100 is ignored; labels that leave no token to predict give a loss of 0
        and a warning, see :meth:`loss`); with ``use_cache`` the cache to continue from. The
        checks of the inputs (``_check_*``, ``_positions_and_documents``) follow :meth:`loss`."""
        input_ids = self._check_input_ids(input_ids)
        batch, length = input_ids.shape
        if not isinstance(use_cache, bool):
            raise KernelmixError(f"use_cache must be True or False, got {use_cache!r}")
        if cache is not None:
            self._check_cache(cache, batch)
        nothing_to_predict = False
        if labels is not None:
            labels, nothing_to_predict = self._check_labels(labels, input_ids)
        position_ids, doc_start, next_position = self._positions_and_documents(
            input_ids, attention_mask, position_ids, cache
        )
        offset = 0 if cache is None else cache.length
        furthest = offset + length - 1 if position_ids is None else int(position_ids.max())
        if furthest >= self.config.max_seq_len:
            raise KernelmixError(
                f"position {furthest} is beyond max_seq_len = {self.config.max_seq_len}; shorten the input or "
                "raise max_seq_len in the config (positions beyond the trained length are extrapolation)"
            )

        x = self.dropout(self.embed(input_ids))
        layer_caches = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, None if cache is None else cache.layers[i], position_ids, doc_start)
            layer_caches.append(layer_cache)
        logits = self.lm_head(self.norm(x))
        loss = None if labels is None else self.loss(logits, labels, nothing_to_predict)

        new_cache = None
        if use_cache:
            if position_ids is None:
                next_position = torch.full((batch,), offset + length, dtype=torch.long, device=input_ids.device)
                last_doc = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
            else:
                last_doc = doc_start[:, -1]
            new_cache = ModelCache(
                layers=layer_caches,
                length=offset + length,
                next_position=next_position,
                doc_start=last_doc,
                layer_mixers=tuple(self.config.layer_mixers()),
            )
        return CausalLMOutput(logits=logits, loss=loss, cache=new_cache)

    @staticmethod
    def loss(logits: Tensor, labels: Tensor, nothing_to_predict: bool) -> Tensor:
        """Mean next-token cross-entropy over the labels that are not -100 (in float32 at least;
        float64 stays float64). Rows that are all -100 just add no tokens to the mean.

        When no label at all is left to predict (every ``labels[:, 1:]`` is -100, or T = 1), the
        mean over zero tokens would be nan, and one nan loss makes every parameter and the
        optimizer's moments nan at the next step. A batch like that is legitimate (a prompt mask
        that covers a whole window) and must not stop a run, so the loss is defined as the sum over
        its tokens, 0 — what such a batch adds to a token-weighted sum, the convention of
        transformers' Trainer (``num_items_in_batch``) — still in the graph, so ``backward()``
        gives zero gradients; a warning says it happened."""
        flat_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
        targets = labels[:, 1:].reshape(-1)
        if not nothing_to_predict:
            return F.cross_entropy(flat_logits, targets, ignore_index=-100)
        warnings.warn(
            "labels leave no token to predict: every label after the first position is -100 (labels are shifted "
            "inside the model, so labels[:, 0] is never predicted); the loss is 0 with zero gradients instead of "
            "nan. If this batch should train the model, check how its labels are masked (a prompt mask covering "
            "the whole window, or sequences of one token)",
            UserWarning,
            stacklevel=2,
        )
        return F.cross_entropy(flat_logits, targets, ignore_index=-100, reduction="sum")

    # -- the checks of forward's inputs, in the order it calls them ----------------------------

    def _check_input_ids(self, input_ids: Any) -> Tensor:
        """``input_ids`` as int64 (any integer dtype is accepted: the embedding takes only int32/int64)."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise KernelmixError(f"input_ids must be a [B, T] tensor of token ids, got {got}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise KernelmixError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}; pass ids.long()")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise KernelmixError(
                f"input_ids must hold at least one row and one token, got shape {tuple(input_ids.shape)}"
            )
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            raise KernelmixError(
                f"token ids must lie in [0, {self.config.vocab_size}) (vocab_size), got min {low} and max {high}; "
                "is the tokenizer the one this model was built for?"
            )
        return input_ids.long()

    def _check_cache(self, cache: Any, batch: int) -> None:
        if not isinstance(cache, ModelCache):
            raise KernelmixError("cache must be a ModelCache returned by this model (or None), "
                                 f"got {type(cache).__name__}")
        mixers = tuple(self.config.layer_mixers())
        if cache.layer_mixers != mixers:
            raise KernelmixError(
                f"cache was built by a model with {len(cache.layer_mixers)} layers {list(cache.layer_mixers)}, "
                f"this model has {len(mixers)} layers {list(mixers)}; pass the cache of this model"
            )
        if cache.next_position.shape != (batch,):
            raise KernelmixError(f"cache holds {cache.next_position.shape[0]} rows, input_ids has {batch}")

    def _check_labels(self, labels: Any, input_ids: Tensor) -> tuple[Tensor, bool]:
        """``labels`` as int64 and whether they leave no token to predict (all -100 after the shift)."""
        if not isinstance(labels, Tensor) or labels.shape != input_ids.shape:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise KernelmixError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise KernelmixError(
                f"labels must be integer token ids (or -100 to ignore), got dtype {labels.dtype}; pass labels.long()"
            )
        labels = labels.long()  # cross_entropy takes int64 targets only
        bad = ((labels < 0) & (labels != -100)) | (labels >= self.config.vocab_size)
        # one device sync for both questions
        any_bad, nothing = torch.stack([bad.any(), (labels[:, 1:] == -100).all()]).tolist()
        if any_bad:
            raise KernelmixError(
                f"labels must lie in [0, {self.config.vocab_size}) (vocab_size) or be -100 (ignored), got "
                f"{labels[bad].unique()[:5].tolist()}"
            )
        return labels, nothing

    def _positions_and_documents(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None, cache: ModelCache | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """RoPE positions and document starts ``[B, T]`` and each row's next position ``[B]``
        (None, None, None for a plain unpadded batch).

        Real token at index a with position p belongs to the document starting at a − p (positions
        restart at 0 per document); a padding token (mask 0) is a one-token document of its own,
        so nobody reads it. Only left (or right) padding is meaningful: a gap of padding between
        real tokens is refused, since real tokens after it would still have to read those before."""
        batch, length = input_ids.shape
        offset = 0 if cache is None else cache.length
        index = offset + torch.arange(length, device=input_ids.device)
        if attention_mask is None and position_ids is None and cache is None:
            return None, None, None
        real = None
        if attention_mask is not None:
            real = self._current_mask(attention_mask, batch, length, offset)
        if position_ids is not None:
            self._check_position_ids(position_ids, batch, length)
        if position_ids is None:
            if cache is not None:
                start = cache.next_position[:, None]
            else:
                start = torch.zeros(batch, 1, dtype=torch.long, device=input_ids.device)
            if real is None:
                position_ids = start + torch.arange(length, device=input_ids.device)
                next_position = start[:, 0] + length
            else:
                position_ids = start + (real.long().cumsum(dim=1) - 1).clamp_min(0)
                # not position_ids[:, -1] + 1: a chunk that is all left padding leaves the next position at start
                next_position = start[:, 0] + real.long().sum(dim=1)
        else:
            next_position = position_ids[:, -1].long() + 1
        position_ids = position_ids.long()
        doc_start = (index - position_ids).clamp(min=0)
        if cache is not None:  # the document of the last cached token may go on
            doc_start = torch.maximum(doc_start, cache.doc_start[:, None])
        # documents are contiguous: a later token never starts its document before an earlier one
        doc_start = torch.cummax(doc_start, dim=1).values
        if real is not None:
            doc_start = torch.where(real, doc_start, index.expand(batch, length))
        return position_ids, doc_start, next_position

    @staticmethod
    def _current_mask(attention_mask: Any, batch: int, length: int, offset: int) -> Tensor:
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != batch or (
            attention_mask.shape[1] not in (length, offset + length)
        ):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise KernelmixError(
                f"attention_mask must have shape [B, T] = {(batch, length)} (or [B, past + T] = "
                f"{(batch, offset + length)}), got {got}"
            )
        mask = attention_mask.bool()
        if mask.shape[1] != length:
            mask = mask[:, -length:]
        # a 0 between two 1s in a row is a gap of padding inside the sequence
        seen_real = mask.long().cummax(dim=1).values.bool()
        remaining_real = mask.flip(1).long().cummax(dim=1).values.flip(1).bool()
        not_binary = ~((attention_mask == 0) | (attention_mask == 1))
        has_gap, any_not_binary = torch.stack([(seen_real & remaining_real & ~mask).any(), not_binary.any()]).tolist()
        if any_not_binary:  # .bool() would read 0.5 or 2 as a real token without a word
            raise KernelmixError(
                "attention_mask must hold only 0 (padding) and 1 (real token), "
                f"got {attention_mask[not_binary][:5].tolist()}"
            )
        if has_gap:
            raise KernelmixError(
                "attention_mask has padding between real tokens; only left padding (for batched generation) "
                "or right padding is supported — pack documents with position_ids instead"
            )
        return mask

    @staticmethod
    def _check_position_ids(position_ids: Any, batch: int, length: int) -> None:
        if not isinstance(position_ids, Tensor) or tuple(position_ids.shape) != (batch, length) or (
            position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool
        ):
            got = (f"{tuple(position_ids.shape)} {position_ids.dtype}" if isinstance(position_ids, Tensor)
                   else type(position_ids).__name__)
            raise KernelmixError(
                f"position_ids must be an integer tensor of shape [B, T] = {(batch, length)}, got {got}; "
                "give each token its position in its document (0, 1, 2, ... restarting at 0 per document)"
            )
        if int(position_ids.min()) < 0:
            raise KernelmixError(
                f"position_ids must be >= 0, got a minimum of {int(position_ids.min())}; positions count 0, 1, 2, ... "
                "from the first token of each document (left padding: leave position_ids out and pass attention_mask)"
            )


__all__ = ["PRESETS", "Block", "CausalLM", "CausalLMOutput", "ModelCache", "ModelConfig", "RMSNorm", "SwiGLU"]
