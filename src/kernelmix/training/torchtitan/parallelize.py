"""torchtitan's ``parallelize_fn`` for kernelmix models: its config mapped onto
:func:`kernelmix.training.parallelize`.

What is mapped:

- ``activation_checkpoint``: ``None`` -> ``"none"``; ``FullAC`` -> ``"full"`` (every block
  recomputed); ``SelectiveAC`` -> the model config's ``selective_ac`` — ``"selective"`` (every
  ``selective_ac_every``-th block, the default) or ``"mixers"`` (only the mixers). torchtitan's
  SelectiveAC is an op-level policy (save matmul outputs, recompute the rest); kernelmix
  checkpoints whole blocks or mixers, because its mixers' custom autograd functions keep their own
  state. ``MemoryBudgetAC`` sets its compiler budget (torchtitan's own ``apply``) and checkpoints
  no block: the compiled graphs' partitioner does the trade.
- ``compile``: ``enable`` with ``"model"`` in ``components`` -> each block compiled in place with
  ``compile.backend`` (``fullgraph`` off: see :data:`kernelmix.training.FULLGRAPH_MIXERS`).
  ``"loss"`` is torchtitan's own.
- data parallelism: when the data-parallel mesh (``dp_replicate`` x the shard axis) spans more
  than one rank, FSDP2 ``fully_shard`` per block then at the root over that mesh (HSDP when
  ``dp_replicate`` > 1; with ``dp_shard`` = 1 that is plain replication), with
  :func:`fsdp_options`: ``training.mixed_precision_param`` -> ``param_dtype`` (torchtitan's
  default ``bfloat16``: the blocks compute in bf16, the sharded parameters and the optimizer stay
  in ``training.dtype``), ``training.mixed_precision_reduce`` -> ``reduce_dtype``,
  ``parallelism.fsdp_reshard_after_forward`` ``always``/``default`` -> ``reshard_after_forward=True``
  (no pipelining, so ``default`` is ``always``), ``never`` -> ``False``. On one rank nothing is
  sharded, so mixed precision does not apply either: the model trains in ``training.dtype``.

Not mapped: CPU offload, the AC ``preserve_rng_state``/``determinism_check``/``debug``
options (kernelmix always restores the RNG state). Tensor, context, pipeline and expert
parallelism are refused with a message.
"""

from __future__ import annotations

from typing import Any

from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

from ...errors import KernelmixError
from ..parallelize import ACTIVATION_CHECKPOINTING, FSDPOptions, parallelize
from .model import KernelmixTitanModel, check_parallelism

#: torchtitan's ``parallelism.fsdp_reshard_after_forward`` -> ``fully_shard(reshard_after_forward=...)``
#: ("default" reshards unless pipelining, which kernelmix models do not have)
RESHARD_AFTER_FORWARD = {"default": True, "always": True, "never": False}


def fsdp_options(training: Any, parallelism: Any) -> FSDPOptions:
    """kernelmix's :class:`~kernelmix.training.parallelize.FSDPOptions` for torchtitan's
    ``training`` (mixed precision) and ``parallelism`` (resharding) configs; either may be None
    (then FSDP2's defaults: no cast, reshard after forward)."""
    param_dtype = getattr(training, "mixed_precision_param", None)
    reduce_dtype = getattr(training, "mixed_precision_reduce", None)
    policy = getattr(parallelism, "fsdp_reshard_after_forward", "default")
    if policy not in RESHARD_AFTER_FORWARD:
        raise KernelmixError(
            f"parallelism.fsdp_reshard_after_forward = {policy!r}: choose from {', '.join(RESHARD_AFTER_FORWARD)}"
        )
    try:
        return FSDPOptions(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           reshard_after_forward=RESHARD_AFTER_FORWARD[policy])
    except KernelmixError as error:  # name torchtitan's option, not ours
        raise KernelmixError(
            f"training.mixed_precision_param / mixed_precision_reduce ({param_dtype!r} / {reduce_dtype!r}): {error}"
        ) from None


def activation_checkpointing_mode(ac_config: Any, model_config: KernelmixTitanModel.Config) -> tuple[str, int]:
    """kernelmix's ``(activation_checkpointing, every)`` for torchtitan's ``activation_checkpoint`` config."""
    every = model_config.selective_ac_every
    if ac_config is None:
        return "none", every
    if isinstance(ac_config, FullAC.Config):
        return "full", every
    if isinstance(ac_config, SelectiveAC.Config):  # Config checks selective_ac names a kernelmix mode
        return model_config.selective_ac, every
    if isinstance(ac_config, MemoryBudgetAC.Config):  # the compiler's partitioner trades, no block is wrapped
        return "none", every
    raise KernelmixError(
        f"activation_checkpoint {type(ac_config).__qualname__} has no kernelmix counterpart; use none, full or "
        f"selective (kernelmix modes: {', '.join(ACTIVATION_CHECKPOINTING)})"
    )


def data_parallel_mesh(parallel_dims: Any) -> Any:
    """The mesh FSDP shards (and replicates) over, or None when data parallelism is off."""
    if parallel_dims is None or not parallel_dims.dp_enabled:
        return None
    # partial_dtensor names the shard axis "fsdp"; full_dtensor and spmd_types keep it as "dp_shard"
    shard_axis = "fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard"
    names = ["dp_replicate", shard_axis] if parallel_dims.dp_replicate_enabled else [shard_axis]
    mesh = parallel_dims.get_optional_mesh(names)
    if mesh is None:
        raise KernelmixError(f"torchtitan has no data-parallel mesh {names} although data parallelism is on")
    return mesh


def parallelize_kernelmix(
    model: KernelmixTitanModel,
    *,
    parallel_dims: Any = None,
    training: Any = None,
    parallelism: Any = None,
    compile_config: Any = None,
    ac_config: Any = None,
    dump_folder: str = "",
    **unused: Any,
) -> KernelmixTitanModel:
    """torchtitan's ``ModelSpec.parallelize_fn``: activation checkpointing, compile and FSDP2 as
    torchtitan's config asks (see the module docstring), applied by
    :func:`kernelmix.training.parallelize` to ``model.lm``, in place. Returns ``model``.

    Called by torchtitan's trainer on the meta-device model (FSDP2 shards meta parameters; the
    trainer then calls ``to_empty`` and ``init_weights``); also callable on a real model, without a
    mesh (``parallel_dims=None``)."""
    del unused  # nothing in them changes what kernelmix applies (see "Not mapped")
    if not isinstance(model, KernelmixTitanModel):
        raise KernelmixError(f"parallelize_kernelmix takes a KernelmixTitanModel, got {type(model).__name__}")
    if parallelism is not None:
        check_parallelism(parallelism)
    mode, every = activation_checkpointing_mode(ac_config, model.config)
    if isinstance(ac_config, MemoryBudgetAC.Config):
        ac_config.build(dump_folder=dump_folder).apply(model)  # sets torch._functorch's budget; wraps no module
    compile_model = bool(compile_config is not None and compile_config.enable and "model" in compile_config.components)
    compile_options = {"backend": compile_config.backend} if compile_model else None
    parallelize(
        model.lm, data_parallel_mesh(parallel_dims), compile=compile_model, activation_checkpointing=mode,
        activation_checkpointing_every=every, fsdp=True, ddp=False, compile_options=compile_options,
        fsdp_options=fsdp_options(training, parallelism),
    )
    return model


__all__ = ["RESHARD_AFTER_FORWARD", "activation_checkpointing_mode", "data_parallel_mesh", "fsdp_options",
           "parallelize_kernelmix"]
