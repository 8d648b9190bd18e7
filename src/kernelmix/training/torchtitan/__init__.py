"""kernelmix models for torchtitan 0.3 (``pip install "kernelmix[torchtitan]"``).

torchtitan finds a model through ``--module`` (a fully qualified module path: it imports
``<module>.config_registry``) and ``--config`` (a function there returning a ``Trainer.Config``
whose ``model_spec`` is a :class:`torchtitan.protocols.model_spec.ModelSpec`)::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module kernelmix.training.torchtitan --config kernelmix_125m_cubit \\
        --hf_assets_path ./assets/gpt2 --dataloader.dataset_path ./data/c4_test

The spec (:func:`model_registry`): the model is :class:`KernelmixTitanModel` (a kernelmix
``CausalLM`` built from a preset and mixer(s), in ``model.lm``), the ``parallelize_fn`` is
:func:`parallelize_kernelmix` (torchtitan's AC/compile/FSDP settings mapped onto
:func:`kernelmix.training.parallelize`); no pipelining, no optimizer hook, no Hugging Face
state-dict adapter. This package is the only part of kernelmix that imports torchtitan.
"""

from __future__ import annotations

from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

from .model import KernelmixTitanModel, check_parallelism
from .parallelize import activation_checkpointing_mode, data_parallel_mesh, parallelize_kernelmix

#: the name the spec carries (torchtitan logs it and saves it with the job config)
SPEC_NAME = "kernelmix"


def model_registry(preset: str = "tiny", mixer: str = "softmax", **model_fields: Any) -> ModelSpec:
    """The torchtitan ``ModelSpec`` of a kernelmix preset with ``mixer`` in every layer.

    ``model_fields`` are further :class:`KernelmixTitanModel.Config` fields: ``mixers`` (one name
    per layer, for hybrids), ``mixer_options``, ``overrides`` (other ``ModelConfig`` fields),
    ``seed``, ``selective_ac``, ``selective_ac_every``, ``vocab_size``."""
    config = KernelmixTitanModel.Config(preset=preset, mixer=mixer, **model_fields)
    flavor = f"{preset}-{'hybrid' if config.mixers is not None else mixer}"
    return ModelSpec(
        name=SPEC_NAME, flavor=flavor, model=config, parallelize_fn=parallelize_kernelmix,
        pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None,
    )


__all__ = [
    "KernelmixTitanModel", "SPEC_NAME", "activation_checkpointing_mode", "check_parallelism", "data_parallel_mesh",
    "model_registry", "parallelize_kernelmix",
]
