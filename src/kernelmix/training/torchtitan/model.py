"""The kernelmix model as torchtitan 0.3 sees it: a ``BaseModel`` around a :class:`~kernelmix.model.CausalLM`.

torchtitan builds a model from its ``Config`` on the meta device (``config.build()``), hands it
to the spec's ``parallelize_fn``, moves it with ``to_empty`` and calls ``init_weights``; each
training step calls ``model(tokens, positions=...)`` and expects logits ``[B, T, vocab]`` (its
labels are already shifted; the loss is torchtitan's). :class:`KernelmixTitanModel` does exactly
that and nothing else: the network is ``self.lm``, an ordinary ``CausalLM``, so parameter names
are ours under the prefix ``lm.``, and ``model.lm`` can be saved, evaluated or decoded with the
rest of kernelmix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.model import BaseModel

from ...errors import KernelmixError
from ...model import PRESETS, CausalLM, ModelConfig

#: torchtitan parallelisms that need per-module sharding plans kernelmix's mixers do not have
#: (tensor and context parallel split heads or the sequence inside the ops; pipeline stages and
#: experts have no counterpart in CausalLM)
UNSUPPORTED_DEGREES = {
    "tensor_parallel_degree": "tensor parallelism",
    "context_parallel_degree": "context parallelism",
    "pipeline_parallel_degree": "pipeline parallelism",
    "expert_parallel_degree": "expert parallelism",
}


#: what ``selective_ac`` in the model config may name: kernelmix's per-block checkpointing modes
SELECTIVE_AC_MODES = ("selective", "mixers")


def check_parallelism(parallelism: Any) -> None:
    """Refuse the torchtitan parallelisms kernelmix cannot apply (only data parallelism is mapped)."""
    for name, what in UNSUPPORTED_DEGREES.items():
        degree = getattr(parallelism, name, 1)
        if degree != 1:
            raise KernelmixError(
                f"parallelism.{name} = {degree}: kernelmix models support only data parallelism (FSDP2 "
                f"over data_parallel_shard_degree, HSDP with data_parallel_replicate_degree), not {what}; "
                f"set --parallelism.{name} 1"
            )


def tokenizer_vocab_size(trainer_config: Any) -> int | None:
    """The vocabulary size of the tokenizer torchtitan will build, or None where it cannot be read
    here (no tokenizer config, or no tokenizer files at ``hf_assets_path``)."""
    tokenizer = getattr(trainer_config, "tokenizer", None)
    path = getattr(trainer_config, "hf_assets_path", None)
    if tokenizer is None or path is None:
        return None
    try:
        return int(tokenizer.build(tokenizer_path=path).get_vocab_size())
    except Exception:  # torchtitan raises several kinds for a missing or partial asset folder
        return None


@torch.no_grad()
def init_sharded_weights(lm: CausalLM, seed: int) -> CausalLM:
    """``lm.init_weights(seed)`` for a model whose parameters FSDP has made DTensors.

    Drawing into the shards directly would not give the unsharded model's tensors (and on a CPU
    mesh, where DTensor has no RNG tracker, every rank would draw the same numbers into its own
    shard). So the full model is initialised once per rank, on the shards' device, and each rank
    keeps its slice (``distribute_tensor(..., src_data_rank=None)``: no communication, every rank
    holds the same full tensor). Costs one unsharded copy of the model per rank, transiently."""
    device = next(t for t in lm.parameters()).device
    with torch.device(device):
        full = CausalLM(lm.config, seed=seed)
    for target, source in ((dict(lm.named_parameters()), dict(full.named_parameters())),
                           (dict(lm.named_buffers()), dict(full.named_buffers()))):
        for name, tensor in target.items():
            value = source[name].to(tensor.dtype)
            if isinstance(tensor, DTensor):
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.copy_(value)
    return lm


class KernelmixTitanModel(BaseModel):
    """A kernelmix :class:`~kernelmix.model.CausalLM` (``self.lm``) behind torchtitan's model protocol."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        """The model as torchtitan's ``ModelSpec.model``: a kernelmix preset and mixer(s).

        ``overrides`` are further :class:`~kernelmix.model.ModelConfig` fields (``dropout``,
        ``backend``, ``num_layers``, ...). ``vocab_size``/``max_seq_len`` None: set by
        :meth:`update_from_config` from torchtitan's tokenizer and ``training.seq_len``.
        ``seed``: the initialisation seed (``debug.seed`` replaces it when set).
        ``selective_ac``/``selective_ac_every``: what torchtitan's ``SelectiveAC`` maps to
        (see :func:`kernelmix.training.torchtitan.parallelize_kernelmix`)."""

        preset: str = "tiny"
        mixer: str = "softmax"
        mixers: list[str] | None = None
        mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
        overrides: dict[str, Any] = field(default_factory=dict)
        vocab_size: int | None = None
        max_seq_len: int | None = None
        seed: int = 0
        selective_ac: str = "selective"
        selective_ac_every: int = 2

        def __post_init__(self) -> None:
            if self.selective_ac not in SELECTIVE_AC_MODES:
                raise KernelmixError(
                    f"selective_ac must be one of {', '.join(SELECTIVE_AC_MODES)} (what torchtitan's SelectiveAC maps "
                    f"to), got {self.selective_ac!r}"
                )
            self.model_config()  # a typo'd preset, mixer or option fails here, not at build time

        def model_config(self) -> ModelConfig:
            """The kernelmix config these settings describe."""
            if self.preset not in PRESETS:
                raise KernelmixError(f"unknown preset {self.preset!r} (choose from: {', '.join(PRESETS)})")
            fields = dict(self.overrides, mixer=self.mixer, mixers=self.mixers, mixer_options=self.mixer_options)
            for name in ("vocab_size", "max_seq_len"):
                if getattr(self, name) is not None:
                    fields[name] = getattr(self, name)
            return ModelConfig.preset(self.preset, **fields)

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            """Take the sequence length, the vocabulary and the seed from torchtitan's trainer config."""
            check_parallelism(config.parallelism)
            training = getattr(config, "training", None)
            if training is not None:
                # positions never pass training.seq_len - 1 (torchtitan restarts them per document)
                self.max_seq_len = int(training.seq_len)
            vocab = tokenizer_vocab_size(config)
            if vocab is not None:
                if self.vocab_size is None:
                    self.vocab_size = vocab
                elif vocab > self.vocab_size:
                    raise KernelmixError(
                        f"the tokenizer at {config.hf_assets_path} has {vocab} tokens but the model's vocab_size is "
                        f"{self.vocab_size}; leave vocab_size unset to take the tokenizer's, or raise it"
                    )
            debug = getattr(config, "debug", None)
            if debug is not None and debug.seed is not None:
                self.seed = int(debug.seed)
            self.model_config()

        def get_nparams_and_flops(self, model: Any, seq_len: int) -> tuple[int, int]:
            """Parameters (a tied embedding once) and training FLOPs per token: ``6 · N`` for the
            matmuls with the weights (forward 2, backward 4 per weight and token; a tied LM head
            counts once, an untied embedding, a lookup, not at all) plus the token mixing. Softmax layers mix over the
            whole prefix, ``6 · 2 · heads · head_dim · seq_len`` as torchtitan counts attention (no causal discount);
            the chunked mixers mix inside a chunk of ``chunk_size`` tokens the same way and
            carry a state between chunks, counted as one more chunk. An estimate for MFU, not
            the analytic counts of :mod:`kernelmix.studies.flops`."""
            lm = model.lm if isinstance(model, KernelmixTitanModel) else model
            config = lm.config
            nparams = sum(p.numel() for p in lm.parameters())
            matmul_params = nparams if config.tie_embeddings else nparams - lm.embed.weight.numel()
            per_layer_width = 2 * config.num_heads * config.head_dim
            mixing = 0
            for mixer in config.layer_mixers():
                span = seq_len if mixer == "softmax" else min(seq_len, 2 * config.chunk_size)
                mixing += 6 * per_layer_width * span
            return nparams, 6 * matmul_params + mixing

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        # on torchtitan's meta device this allocates and draws nothing; init_weights does both
        self.lm = CausalLM(config.model_config())

    # -- torchtitan's protocol ---------------------------------------------------------------

    def verify_module_protocol(self) -> None:
        """kernelmix's modules are plain ``nn.Module``s, not torchtitan ``Module``s: they take no
        per-module ``param_init`` or sharding plan, the whole model is initialised at once by
        :meth:`init_states` (``CausalLM.init_weights``). What must hold is that ``lm`` is one."""
        if not isinstance(self.lm, CausalLM):
            raise KernelmixError(f"KernelmixTitanModel.lm must be a kernelmix CausalLM, got {type(self.lm).__name__}")

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """Every parameter and buffer from ``config.seed``: the same tensors as
        ``CausalLM(model_config, seed=seed)`` on this device, sharded or not (see
        :func:`init_sharded_weights`). The buffers (random-feature projections, RoPE tables) stay
        where ``to_empty`` put them: ``buffer_device`` (for torchtitan's CPU offload) is not used."""
        del buffer_device
        if any(isinstance(t, DTensor) for t in (*self.lm.parameters(), *self.lm.buffers())):
            init_sharded_weights(self.lm, self.config.seed)
        else:
            self.lm.init_weights(self.config.seed)

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output projection (torchtitan's trainer reads it for its chunked loss)."""
        return self.lm.lm_head

    @property
    def _skip_lm_head(self) -> bool:
        return False

    @_skip_lm_head.setter
    def _skip_lm_head(self, value: bool) -> None:
        # torchtitan sets this for ChunkedLossWrapper, which applies lm_head itself per chunk;
        # CausalLM returns logits, so the chunked loss would apply the head twice
        if value:
            raise KernelmixError(
                "torchtitan's ChunkedLossWrapper is not supported by kernelmix models (they return logits, the "
                "chunked loss expects hidden states); use loss=CrossEntropyLoss.Config() as the kernelmix configs do"
            )

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, vocab]``. ``positions`` (torchtitan's, restarting at 0 at each packed
        document) become kernelmix's ``position_ids``: no token reads across a document boundary."""
        return self.lm(tokens, position_ids=positions, use_cache=False).logits


__all__ = ["KernelmixTitanModel", "SELECTIVE_AC_MODES", "UNSUPPORTED_DEGREES", "check_parallelism",
           "init_sharded_weights", "tokenizer_vocab_size"]
