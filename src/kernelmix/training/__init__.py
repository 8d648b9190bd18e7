"""Training and evaluation on real text: ``kernelmix train``.

    from kernelmix.training import TrainConfig, build_config, train

    config = build_config("run.toml", ["model.mixer=cubit", "lr=3e-4"])   # or TrainConfig(...)
    result = train(config)                    # result.losses, result.val_losses, result.tokens_per_s
    result = train(config, resume=True)       # continue from the newest checkpoint in config.out_dir

- :mod:`~kernelmix.training.config` — :class:`TrainConfig` (one dataclass; TOML/YAML/JSON files and
  ``key=value`` overrides; unknown keys are errors that list the valid ones).
- :mod:`~kernelmix.training.loop` — :func:`train`: AdamW, warmup + cosine, clipping, accumulation,
  bf16 autocast, evaluation, metrics (JSONL, TensorBoard if installed), DDP/FSDP under torchrun.
- :mod:`~kernelmix.training.parallelize` — :func:`parallelize`: activation checkpointing, ``torch.compile``
  and FSDP2/DDP per block then at the root (torchtitan's order); the trainer's, and any other trainer's.
- :mod:`~kernelmix.training.trainer` — the pieces of every loop here (one optimizer step over
  micro-batches, the schedule of evaluations and checkpoints, :class:`Trainer` and its hooks);
  ``kernelmix train`` and :func:`kernelmix.pretrained.finetune` both run on them.
- :mod:`~kernelmix.training.checkpoint` — atomic, verified checkpoints (safetensors + weights-only
  torch state + JSON config) for exact resumption; never one holding NaN or Inf.
- :mod:`~kernelmix.training.signals` — SIGINT/SIGTERM finish the step, save and raise
  :class:`kernelmix.errors.Interrupted`.
- :mod:`~kernelmix.training.reporter` (metrics.jsonl, TensorBoard, progress) and
  :mod:`~kernelmix.training.spikes` (loss spikes, skipped updates).

Run output (``out_dir``): ``config.json`` (the resolved train + model config), ``metrics.jsonl``
(one line per log step and per evaluation), ``checkpoints/step_<N>/``, ``tensorboard/``.

Every name is importable from ``kernelmix.training`` as before; a submodule is imported when one of its
names is first used, so ``kernelmix.training.config`` (no torch) is what ``kernelmix train``'s options
read (``parallelize`` stays the function, not the submodule).
"""

from __future__ import annotations

from ..lazy import lazy_names

MODULES = {
    "config": ["ACTIVATION_CHECKPOINTING", "TrainConfig", "apply_override", "build_config", "parse_value",
               "read_config_file", "run_config"],
    "checkpoint": ["CheckpointDamaged", "CheckpointError", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
                   "load_latest_valid", "load_weights"],
    "parallelize": ["parallelize"],
    "loop": ["TrainResult", "train"],
    "schedule": ["derived_seed", "lr_at", "param_groups", "redraw_random_features", "warmup_cosine"],
    "runs": ["LoadedRun", "find_checkpoint", "load_run"],
    "trainer": ["Schedule", "StepOutcome", "Trainer", "optimizer_step"],
}
__getattr__, __dir__ = lazy_names(__name__, MODULES, keep=["parallelize"])
__all__ = sorted(name for names in MODULES.values() for name in names)
