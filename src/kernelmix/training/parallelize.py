"""``parallelize(model, mesh, ...)``: what a kernelmix model goes through before it trains, per
block and then at the root, in torchtitan's order:

1. activation checkpointing per block (:attr:`kernelmix.model.Block.recompute`): ``"full"``
   recomputes every block in the backward, ``"selective"`` every ``activation_checkpointing_every``-th block
   (blocks ``k-1, 2k-1, ...``), ``"mixers"`` only the mixer (with its norm) of every block;
2. ``torch.compile`` per block (``nn.Module.compile``: in place, so parameter names and
   checkpoints keep their keys — no ``_orig_mod.``), graph breaks allowed where the
   ops read values (:data:`FULLGRAPH_MIXERS`), nothing recompiled per step;
3. data parallelism when a process group (or ``mesh``) spans more than one process: FSDP2's
   ``fully_shard`` per block, then the root, with ``fsdp=True`` (mixed precision and resharding
   from :class:`FSDPOptions`); else a DDP wrapper.

:func:`kernelmix.training.train` uses it, and so can any other trainer::

    model = CausalLM(config, seed=0)                       # or meta build + to_empty + init_weights
    model = parallelize(model, compile=True, activation_checkpointing="selective", activation_checkpointing_every=2)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import KernelmixError
from ..model import CausalLM
from .config import ACTIVATION_CHECKPOINTING  # torch-free, beside TrainConfig: exported here as before


def block_checkpoints(mode: str, num_blocks: int, every: int = 2) -> list[str]:
    """What each block recomputes (:data:`kernelmix.model.BLOCK_RECOMPUTE`) under ``mode``."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise KernelmixError(
            f"activation_checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, got {mode!r}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise KernelmixError("activation_checkpointing_every must be a positive integer "
                             f"(every k-th block), got {every!r}")
    if mode == "full":
        return ["block"] * num_blocks
    if mode == "mixers":
        return ["mixer"] * num_blocks
    if mode == "selective":  # as torchtitan's ac_freq: the k-th, 2k-th, ... block (1-based)
        return ["block" if (index + 1) % every == 0 else "none" for index in range(num_blocks)]
    return ["none"] * num_blocks


def apply_activation_checkpointing(model: CausalLM, mode: str, every: int = 2) -> CausalLM:
    """Set every block's :attr:`~kernelmix.model.Block.recompute` for ``mode`` (in place)."""
    for block, recompute in zip(model.blocks, block_checkpoints(mode, len(model.blocks), every)):
        block.recompute = recompute
    return model


#: The mixers whose blocks compile into one graph (``fullgraph=True``) for plain batches — not for
#: packed documents (``position_ids``), where every op checks its ``doc_start`` by reading it
#: (``ops._common.check_doc_start``). DeltaFormer's CPU solve branches on the values of β (rows with
#: β < BETA_EXACT, ``ops._solve_rectangles``) and runs outside the graph (one break per layer).
#: Those are graph breaks: each piece compiles once and nothing recompiles per step, so
#: ``fullgraph`` is off by default. (Cubit's positivity check of its ridge runs only eagerly.)
FULLGRAPH_MIXERS = frozenset({"softmax", "cubit", "performer", "darkformer"})


def apply_compile(model: CausalLM, *, backend: str = "inductor", fullgraph: bool = False, **options: Any) -> CausalLM:
    """Compile each block in place (``nn.Module.compile``; the model's own forward, with its input
    checks, stays eager). ``fullgraph=True`` refuses graph breaks: it holds for the mixers in
    :data:`FULLGRAPH_MIXERS` on plain batches. ``options`` go to ``torch.compile`` (e.g. ``mode``)."""
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph, **options)
    return model


def data_parallel_size(mesh: Any = None) -> int:
    """Processes the model is replicated or sharded over: the mesh's, else the default group's (1 without one)."""
    if mesh is not None:
        return int(mesh.size())
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


#: the dtypes FSDP's mixed precision may name, by the names torchtitan's config uses
FSDP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_dtype(name: str, value: Any) -> torch.dtype | None:
    """``value`` (a torch dtype, its name, or None) as a dtype of :data:`FSDP_DTYPES`."""
    if value is None or (isinstance(value, torch.dtype) and value in FSDP_DTYPES.values()):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in FSDP_DTYPES:
        return FSDP_DTYPES[value.removeprefix("torch.")]
    raise KernelmixError(
        f"{name} must be one of {', '.join(FSDP_DTYPES)} (or None: the parameters' own dtype), got {value!r}"
    )


@dataclass(frozen=True)
class FSDPOptions:
    """What ``fully_shard`` applies besides the mesh (:func:`apply_fsdp`, ``parallelize(fsdp_options=...)``).

    Args:
        param_dtype: the dtype the parameters are gathered and computed in (``"bfloat16"``: mixed
            precision; the sharded parameters, their gradients and the optimizer stay in the
            parameters' own dtype). None: no cast.
        reduce_dtype: the dtype gradients are reduced in. None: ``param_dtype`` (or the gradients' own).
        reshard_after_forward: free each block's gathered parameters after its forward and gather
            them again in the backward (True, FSDP2's default: less memory), or keep them (False:
            one all-gather fewer per block and step)."""

    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        # names become dtypes here, so a typo fails when the options are made, not at the first step
        object.__setattr__(self, "param_dtype", fsdp_dtype("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", fsdp_dtype("reduce_dtype", self.reduce_dtype))
        if not isinstance(self.reshard_after_forward, bool):  # fully_shard's int (a smaller mesh) is not offered
            raise KernelmixError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")

    @classmethod
    def of(cls, options: FSDPOptions | dict[str, Any] | None) -> FSDPOptions:
        """``options`` as FSDPOptions: itself, a dict of its fields (an unknown key is an error), or None
        (the defaults)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise KernelmixError(f"fsdp_options must be an FSDPOptions or a dict, got {type(options).__name__}")
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise KernelmixError(
                f"unknown fsdp_options {', '.join(map(repr, unknown))} "
                f"(choose from: {', '.join(cls.__dataclass_fields__)})"
            )
        return cls(**options)

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``fully_shard`` (besides ``mesh``)."""
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        return {
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            "reshard_after_forward": self.reshard_after_forward,
        }


def apply_fsdp(model: CausalLM, mesh: Any = None, options: FSDPOptions | dict[str, Any] | None = None) -> CausalLM:
    """FSDP2 in place: ``fully_shard`` on each block, then on the root (the embedding, final norm
    and head), with ``options`` (:class:`FSDPOptions`); ``model`` stays a CausalLM."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    kwargs = FSDPOptions.of(options).fully_shard_kwargs()
    # FSDP2 warns about views returned by wrapped modules; our blocks return fresh tensors
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def apply_ddp(model: nn.Module, mesh: Any = None) -> nn.Module:
    """A DDP wrapper over the mesh's group (or the default one), on the model's device."""
    device = next(model.parameters()).device
    # broadcast_buffers=False: buffers (random-feature projections) are identical on every rank by
    # construction (same seed, same seeded redraws), so they need no broadcast each step
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
        process_group=None if mesh is None else mesh.get_group(),
    )


def parallelize(
    model: CausalLM,
    mesh: Any = None,
    *,
    compile: bool = False,
    activation_checkpointing: str = "none",
    activation_checkpointing_every: int = 2,
    fsdp: bool = False,
    ddp: bool = True,
    compile_options: dict[str, Any] | None = None,
    fsdp_options: FSDPOptions | dict[str, Any] | None = None,
) -> nn.Module:
    """Prepare ``model`` (a :class:`~kernelmix.model.CausalLM` on its training device) for training:
    activation checkpointing, then ``torch.compile``, then FSDP2 per block and at the root — or DDP
    — (see the module docstring). With one process ``fsdp`` and ``ddp`` change nothing.

    Args:
        model: a :class:`~kernelmix.model.CausalLM` (for a KernelMixForCausalLM, pass its ``.model``).
        mesh: a 1-D ``DeviceMesh`` to shard or replicate over (None: the default process group,
            when one is initialised).
        compile: ``torch.compile`` each block in place (:func:`apply_compile`).
        activation_checkpointing: ``"none"``, ``"full"``, ``"selective"`` or ``"mixers"``
            (:data:`ACTIVATION_CHECKPOINTING`; the module docstring says what each recomputes).
        activation_checkpointing_every: with ``"selective"``, every k-th block is recomputed.
        fsdp: with more than one process, FSDP2 instead of DDP.
        ddp: with more than one process and no ``fsdp``, wrap the model in DDP (``ddp=False``:
            ``model``, for a trainer that syncs gradients itself).
        compile_options: for ``torch.compile`` (default ``backend="inductor", fullgraph=False``:
            see :data:`FULLGRAPH_MIXERS`).
        fsdp_options: for ``fully_shard`` (:class:`FSDPOptions`, or a dict of its fields: mixed
            precision, resharding); only with ``fsdp=True``.

    Returns:
        What the training forwards go through: ``model`` itself (changed in place) in one process or
        under FSDP, else a DDP wrapper of it (``ddp=False``: ``model``)."""
    if not isinstance(model, CausalLM):
        raise KernelmixError(
            f"parallelize takes a kernelmix CausalLM, got {type(model).__name__}; for a KernelMixForCausalLM "
            "pass its .model"
        )
    for name, value in (("compile", compile), ("fsdp", fsdp), ("ddp", ddp)):
        if not isinstance(value, bool):
            raise KernelmixError(f"{name} must be True or False, got {value!r}")
    if fsdp_options is not None and not fsdp:
        raise KernelmixError("fsdp_options apply to FSDP only: pass fsdp=True with them, or leave them out")
    fsdp_options = FSDPOptions.of(fsdp_options)  # checked before anything changes the model
    apply_activation_checkpointing(model, activation_checkpointing, activation_checkpointing_every)
    if compile:
        apply_compile(model, **(compile_options or {}))
    if data_parallel_size(mesh) <= 1:
        return model
    if fsdp:
        return apply_fsdp(model, mesh, fsdp_options)
    return apply_ddp(model, mesh) if ddp else model


__all__ = [
    "ACTIVATION_CHECKPOINTING", "FSDP_DTYPES", "FSDPOptions", "FULLGRAPH_MIXERS", "apply_activation_checkpointing",
    "apply_compile", "apply_ddp", "apply_fsdp", "block_checkpoints", "data_parallel_size", "fsdp_dtype", "parallelize",
]
