"""The torchtitan model spec (``kernelmix.training.torchtitan``), where torchtitan imports.

Skipped without the ``[torchtitan]`` extra (the default CI run). The spec is built the way
torchtitan's own CLI builds it (``ConfigManager.parse_args(["--module", ..., "--config", ...])``),
the model on the meta device, initialised and parallelised as torchtitan's trainer does, and one
forward/backward through it is compared with a plain ``CausalLM(config, seed=...)``: the same
parameters, and torchtitan's loss (sum over shifted labels / valid tokens) equal to CausalLM's own
mean next-token loss, gradients included. torchtitan's Trainer itself needs an accelerator (see
``test_trainer_needs_an_accelerator``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")

import torch  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss, IGNORE_INDEX  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.layers import MIXERS  # noqa: E402
from kernelmix.model import CausalLM  # noqa: E402
from kernelmix.training.torchtitan import KernelmixTitanModel, config_registry  # noqa: E402
from tests.utils import rel_rmse  # noqa: E402

MODULE = "kernelmix.training.torchtitan"


def trainer_config(name: str, *cli: str, tmp_path=None):
    """torchtitan's ``Trainer.Config`` as ``torchtitan.train --module ... --config name *cli`` parses it
    (an ``activation_checkpoint:<policy>`` subcommand goes last: options after it would be its own)."""
    args = ["--module", MODULE, "--config", name]
    if tmp_path is not None:  # no tokenizer there: the model keeps the preset's vocabulary
        args += ["--hf_assets_path", str(tmp_path), "--dump_folder", str(tmp_path / "out")]
    return ConfigManager().parse_args([*args, *cli])


def titan_model(config, tmp_path, parallel_dims=None):
    """What torchtitan's Trainer does with the spec, in its order: update the model config from the
    trainer config, build on the meta device, verify, parallelize, to_empty, init_weights."""
    spec = config.model_spec
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=str(tmp_path),
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def packed_batch(vocab: int, batch: int = 2, length: int = 37, seed: int = 1):
    """Tokens and torchtitan-style positions (restarting at 0 at each packed document), and its
    shifted labels with the last one ignored (CausalLM's own loss never predicts past T-1)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator)
    positions = torch.cat([torch.arange(15), torch.arange(length - 15)]).expand(batch, length).clone()
    positions[1] = torch.arange(length)  # the second row is one document
    labels = tokens[:, 1:].clone()
    labels[:, -1] = IGNORE_INDEX
    return tokens[:, :length], positions, labels


def compare_with_causal_lm(model: KernelmixTitanModel, seed: int = 0) -> tuple[float, float]:
    """(loss error, worst gradient rel. RMSE) of the torchtitan model against ``CausalLM(config, seed)``."""
    reference = CausalLM(model.lm.config, seed=seed).train()
    titan_state = {name.removeprefix("lm."): t for name, t in model.state_dict().items()}
    assert titan_state.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(titan_state[name], tensor), name
    tokens, positions, labels = packed_batch(model.lm.config.vocab_size)

    valid = (labels != IGNORE_INDEX).sum()
    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(model(tokens, positions=positions), labels, valid)
    loss.backward()
    # CausalLM shifts labels inside: labels[:, 1:] are the targets of positions 0..T-2
    reference_labels = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    expected = reference(tokens, labels=reference_labels, position_ids=positions, use_cache=False).loss
    expected.backward()
    gradients = dict(model.lm.named_parameters())
    worst = max(rel_rmse(gradients[name].grad, p.grad) for name, p in reference.named_parameters())
    return abs(loss.item() - expected.item()) / expected.item(), worst


def test_registry_has_a_config_per_preset_and_mixer():
    for suffix in config_registry.RECIPES:
        for mixer in MIXERS:
            function = getattr(config_registry, f"kernelmix_{suffix}_{mixer}")
            assert function.__name__ == f"kernelmix_{suffix}_{mixer}"
    spec = config_registry.kernelmix_125m(mixer="performer").model_spec
    assert (spec.name, spec.flavor, spec.model.mixer, spec.model.preset) == ("kernelmix", "125m-performer", "performer", "125m")
    assert config_registry.kernelmix_1p3b_cubit().model_spec.model.preset == "1.3b"
    with pytest.raises(KernelmixError, match="unknown mixer 'cubt'"):
        config_registry.kernelmix_tiny(mixer="cubt")
    with pytest.raises(KernelmixError, match="mixer_options"):
        config_registry.kernelmix_tiny(mixer="softmax", mixer_options={"cubit": {"lrr": False}})


def test_torchtitan_cli_finds_the_spec(tmp_path):
    config = trainer_config("kernelmix_tiny_deltaformer", "--training.steps", "3", "--training.seq_len", "64",
                            "--compile.enable", "activation_checkpoint:full", tmp_path=tmp_path)
    assert config.model_spec.flavor == "tiny-deltaformer"
    assert config.training.steps == 3 and config.compile.enable
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    config.model_spec.model.update_from_config(config=config)
    assert config.model_spec.model.model_config().max_seq_len == 64  # from training.seq_len
    assert config.model_spec.model.model_config().vocab_size == 256  # no tokenizer: the preset's
    with pytest.raises(ValueError, match="Config function 'kernelmix_tiny_cubt' not found"):
        trainer_config("kernelmix_tiny_cubt")


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_meta_build_and_step_equal_causal_lm(mixer, tmp_path):
    config = trainer_config(f"kernelmix_tiny_{mixer}", "--training.seq_len", "64", "activation_checkpoint:none",
                            tmp_path=tmp_path)
    model = titan_model(config, tmp_path)
    assert all(block.recompute == "none" for block in model.lm.blocks)
    loss_error, gradient_error = compare_with_causal_lm(model)
    assert loss_error <= 1e-6 and gradient_error <= 1e-5, (loss_error, gradient_error)


def test_checkpointing_and_compile_options_change_no_number(tmp_path):
    # torchtitan's SelectiveAC -> kernelmix's every-2nd-block checkpointing; compile with the eager
    # backend (dynamo traces the blocks, inductor's minutes of C++ building are left out)
    config = trainer_config("kernelmix_tiny_cubit", "--training.seq_len", "64", "--compile.enable",
                            "--compile.backend", "eager", "activation_checkpoint:selective", tmp_path=tmp_path)
    model = titan_model(config, tmp_path, ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))
    assert [block.recompute for block in model.lm.blocks] == ["none", "block"]
    assert all(block._compiled_call_impl is not None for block in model.lm.blocks)
    assert [name for name, _ in model.named_parameters()][0].startswith("lm.")  # no _orig_mod. or wrapper prefixes
    loss_error, gradient_error = compare_with_causal_lm(model)
    assert loss_error <= 1e-5 and gradient_error <= 1e-4, (loss_error, gradient_error)


@pytest.mark.parametrize(("cli", "selective_ac", "expected"), [
    (["activation_checkpoint:full"], "selective", ["block", "block"]),
    (["activation_checkpoint:selective"], "mixers", ["mixer", "mixer"]),
    (["--compile.enable", "activation_checkpoint:memory-budget"], "selective", ["none", "none"]),
])
def test_activation_checkpointing_is_mapped(cli, selective_ac, expected, tmp_path):
    config = trainer_config("kernelmix_tiny_performer", *cli, tmp_path=tmp_path)
    config.model_spec.model.selective_ac = selective_ac
    config.compile.enable = False  # memory-budget asks for compile at parse time; not needed here
    model = titan_model(config, tmp_path)
    assert [block.recompute for block in model.lm.blocks] == expected


def test_unsupported_parallelisms_and_losses_are_refused(tmp_path):
    config = trainer_config("kernelmix_tiny_softmax", tmp_path=tmp_path)
    config.parallelism.tensor_parallel_degree = 2
    with pytest.raises(KernelmixError, match="tensor_parallel_degree 1"):
        config.model_spec.model.update_from_config(config=config)
    model = titan_model(trainer_config("kernelmix_tiny_softmax", tmp_path=tmp_path), tmp_path)
    assert model.lm_head is model.lm.lm_head
    model._skip_lm_head = False  # what torchtitan's plain losses leave
    with pytest.raises(KernelmixError, match="ChunkedLossWrapper"):
        model._skip_lm_head = True  # what torchtitan does for its chunked loss


def test_vocabulary_follows_the_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<unk>": 26}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = trainer_config("kernelmix_tiny_softmax", tmp_path=tmp_path)
    config.model_spec.model.update_from_config(config=config)
    assert config.model_spec.model.vocab_size == 27
    config = trainer_config("kernelmix_tiny_softmax", tmp_path=tmp_path)
    config.model_spec.model.vocab_size = 20
    with pytest.raises(KernelmixError, match="has 27 tokens but the model's vocab_size is 20"):
        config.model_spec.model.update_from_config(config=config)


def test_parameters_and_flops():
    spec = config_registry.kernelmix_tiny(mixers=["softmax", "cubit"]).model_spec
    with torch.device("meta"):
        model = spec.model.build()
    nparams, flops = spec.model.get_nparams_and_flops(model, 256)
    assert nparams == model.lm.num_parameters() == sum(p.numel() for p in model.parameters())
    config = model.lm.config
    width = 2 * config.num_heads * config.head_dim
    # softmax mixes over the 256 tokens, Cubit within two chunks of 16
    assert flops == 6 * nparams + 6 * width * 256 + 6 * width * 32
    assert spec.model.get_nparams_and_flops(model, 512)[1] - flops == 6 * width * 256


def test_trainer_needs_an_accelerator():
    """torchtitan 0.3's Trainer runs on an accelerator only: ``torchtitan.tools.utils`` takes
    ``device_type = _get_available_device_type() or "cuda"``, and ``Trainer.__init__`` starts with
    ``device_module.set_device(...)`` — ``torch.cuda.set_device`` on a machine without one. Where
    that holds, the Trainer is not run here; this test fails once a release changes it."""
    from torchtitan.tools import utils

    if torch.cuda.is_available() or utils.device_type != "cuda":
        pytest.skip(f"an accelerator ({utils.device_type}) is available: the Trainer could run here")
    assert utils.device_module is torch.cuda
