"""kernelmix.training.parallelize and what it applies: activation checkpointing changes no number
(bitwise, every mixer), the blocks really are recomputed, meta-device build + init_weights equals
the eager build, torch.compile gives the eager numbers without recompiling per step."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.training import parallelize
from kernelmix.training.parallelize import FULLGRAPH_MIXERS, block_checkpoints
from tests.utils import rel_rmse

MIXERS = ["softmax", "cubit", "deltaformer", "performer", "darkformer", "cubit-rf"]
MODES = ["full", "selective", "mixers"]


def tiny(mixer: str, **overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", mixer=mixer, **{"num_layers": 3, **overrides})


def loss_and_grads(model: CausalLM, length: int = 37, seed: int = 7):
    """One training forward and backward of a fixed batch (T odd: not a multiple of the chunk size)
    packing two documents per row, as training does; the RNG is seeded first, so dropout draws the
    same masks in every run."""
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    split = length // 2 + 1
    positions = torch.cat([torch.arange(split), torch.arange(length - split)]).expand(2, -1)
    torch.manual_seed(seed)
    loss = model(ids, labels=ids, position_ids=positions, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# activation checkpointing


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_activation_checkpointing_changes_no_number(mixer, dropout):
    """Bitwise, not within a tolerance: the recomputation runs the same kernels on the same inputs
    in the same order (the random features read the fixed buffer W, no op draws from the RNG, and
    checkpoint restores the RNG state, so dropout draws the same masks), so on the CPU every
    gradient is the same float."""
    eager_loss, eager_grads = loss_and_grads(CausalLM(tiny(mixer, dropout=dropout), seed=3).train())
    for mode in MODES:
        model = parallelize(CausalLM(tiny(mixer, dropout=dropout), seed=3).train(), activation_checkpointing=mode)
        loss, grads = loss_and_grads(model)
        assert torch.equal(loss, eager_loss), mode
        different = [name for name in eager_grads if not torch.equal(grads[name], eager_grads[name])]
        assert not different, (mode, different)


@pytest.mark.parametrize("mode, recomputed", [("none", [1, 1, 1]), ("full", [2, 2, 2]), ("selective", [1, 2, 1]),
                                              ("mixers", [2, 2, 2])])
def test_checkpointed_mixers_run_again_in_the_backward(mode, recomputed):
    model = parallelize(CausalLM(tiny("cubit"), seed=0).train(), activation_checkpointing=mode)
    calls = [0] * len(model.blocks)
    for index, block in enumerate(model.blocks):
        block.mixer.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    loss_and_grads(model)
    assert calls == recomputed
    mlp_calls = []
    model.blocks[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))  # (a recomputation stops
    # early, inside the MLP, once it has what the backward needs: a hook after the forward would not run)
    loss_and_grads(model)
    # "mixers" keeps the MLP's activations; "full" recomputes the whole block
    assert len(mlp_calls) == (2 if mode == "full" else 1)


def test_block_checkpoints_every_kth_block():
    assert block_checkpoints("selective", 6, 3) == ["none", "none", "block"] * 2
    assert block_checkpoints("selective", 4, 1) == ["block"] * 4
    assert block_checkpoints("mixers", 2) == ["mixer"] * 2


def test_no_graph_no_recomputation():
    model = parallelize(CausalLM(tiny("softmax"), seed=0).eval(), activation_checkpointing="full")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        out = model(ids)
    assert out.cache is not None and out.logits.shape == (1, 9, 256)


@pytest.mark.parametrize("kwargs, message", [
    (dict(activation_checkpointing="some"), "activation_checkpointing must be one of none, full, selective, mixers"),
    (dict(activation_checkpointing="selective", activation_checkpointing_every=0), "positive integer"),
    (dict(compile="yes"), "compile must be True or False"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(KernelmixError, match=message):
        parallelize(CausalLM(tiny("softmax")), **kwargs)


def test_parallelize_takes_a_causal_lm():
    with pytest.raises(KernelmixError, match="pass its .model"):
        parallelize(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# meta-device build + init_weights


def tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("mixer", MIXERS + ["hybrid"])
def test_meta_build_then_init_weights_equals_the_eager_build(mixer):
    config = tiny(mixer) if mixer != "hybrid" else tiny("softmax", mixers=["darkformer", "cubit", "performer"])
    eager = CausalLM(config, seed=11)
    state = torch.get_rng_state()
    with torch.device("meta"):
        model = CausalLM(config)
    assert torch.equal(torch.get_rng_state(), state)  # a meta build draws nothing
    model.to_empty(device="cpu")
    for tensor in tensors(model).values():  # to_empty's memory may hold anything: make reading it fail
        tensor.data.fill_(float("nan"))
    state = torch.get_rng_state()
    assert model.init_weights(seed=11) is model
    assert torch.equal(torch.get_rng_state(), state)  # init_weights leaves the global RNG alone
    expected, got = tensors(eager), tensors(model)
    assert got.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []
    assert model.lm_head.weight is model.embed.weight  # tied again after to_empty
    if mixer in ("performer", "darkformer"):
        assert "blocks.0.mixer.projection" in got  # the random-feature projections are compared too


def test_init_weights_depends_on_the_seed_and_the_global_rng_on_nothing():
    config = tiny("performer")
    torch.manual_seed(0)
    first = CausalLM(config, seed=1)
    torch.manual_seed(123)
    again, other = CausalLM(config, seed=1), CausalLM(config, seed=2)
    for name, tensor in tensors(first).items():
        assert torch.equal(tensor, tensors(again)[name]), name
        if "norm" not in name:  # norm gains start at 1 whatever the seed
            assert not torch.equal(tensor, tensors(other)[name]), name
    # the projections differ between layers (one generator per layer)
    assert not torch.equal(first.blocks[0].mixer.projection, first.blocks[1].mixer.projection)


def test_init_weights_on_the_meta_device_names_the_fix():
    with torch.device("meta"):
        model = CausalLM(tiny("softmax"))
    with pytest.raises(KernelmixError, match=r"to_empty\(device='cpu'\)"):
        model.init_weights(0)
    with pytest.raises(KernelmixError, match="seed must be an integer"):
        CausalLM(tiny("softmax"), seed=-1)


# ---------------------------------------------------------------------------------------------
# torch.compile


def compiled_matches_eager(mixer: str, backend: str, *, activation_checkpointing: str = "none", lengths=(37,)):
    """Compiled per block: the loss and gradients of the eager run within fp32 tolerance (a fused
    kernel may sum in another order), and a second step of the same shape compiles nothing new."""
    import torch._dynamo

    torch._dynamo.reset()
    eager = loss_and_grads(CausalLM(tiny(mixer, num_layers=2), seed=5).train(), lengths[0])
    model = parallelize(CausalLM(tiny(mixer, num_layers=2), seed=5).train(), compile=True,
                        activation_checkpointing=activation_checkpointing, compile_options={"backend": backend})
    loss, grads = loss_and_grads(model, lengths[0])
    torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=1e-6)
    for name, grad in eager[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for parameter in model.parameters():
        parameter.grad = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss_and_grads(model, lengths[0])
    for length in lengths[1:]:  # another length: compiled at most once more (then dynamic), not per step
        loss_and_grads(model, length)
        with torch._dynamo.config.patch(error_on_recompile=True):
            loss_and_grads(model, length)
    return model


def test_compiled_blocks_give_the_eager_numbers_and_do_not_recompile():
    """The default suite's one compile test: Performer (its random-feature op compiles into one graph),
    aot_eager (dynamo and autograd tracing without inductor's C++ build, seconds instead of a minute)."""
    model = compiled_matches_eager("performer", "aot_eager")
    assert "blocks.0.mixer.projection" in dict(model.named_buffers())  # in place: no _orig_mod. in the keys


@pytest.mark.slow
@pytest.mark.parametrize("mixer", MIXERS)
def test_compiled_with_inductor_gives_the_eager_numbers(mixer):
    compiled_matches_eager(mixer, "inductor", lengths=(37, 45, 61))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", MIXERS)
def test_compiled_and_checkpointed(mixer):
    compiled_matches_eager(mixer, "aot_eager", activation_checkpointing="selective")


@pytest.mark.slow
@pytest.mark.parametrize("mixer", sorted(FULLGRAPH_MIXERS))
def test_fullgraph_holds_where_it_is_claimed(mixer):
    import torch._dynamo

    torch._dynamo.reset()
    block = CausalLM(tiny(mixer, num_layers=1), seed=0).blocks[0]
    explained = torch._dynamo.explain(block)(torch.randn(2, 37, 64, requires_grad=True), None, None, None)
    assert explained.graph_break_count == 0, explained.break_reasons


# ---------------------------------------------------------------------------------------------
# FSDP2's options: mixed precision and resharding (fully_shard over a one-rank gloo group)


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo group (an in-memory store: no port) and its 1-D CPU mesh, destroyed after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_forward(model: CausalLM, length: int = 19):
    """One forward and backward; returns (loss, the q projection's dtype inside the forward, whether
    the first block's parameters were resharded after it)."""
    from torch.distributed.tensor import DTensor

    seen = []
    model.blocks[0].mixer.register_forward_pre_hook(lambda module, args: seen.append(module.q_proj.weight.dtype))
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids, use_cache=False).loss
    resharded = isinstance(model.blocks[0].mixer.q_proj.weight, DTensor)
    loss.backward()
    return loss.detach(), seen[0], resharded


@pytest.mark.parametrize("mixer", MIXERS)
def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_parameters(mixer, one_rank_mesh):
    from kernelmix.training.parallelize import apply_fsdp

    reference = CausalLM(tiny(mixer, num_layers=2), seed=4)
    expected, _, _ = sharded_forward(reference)
    model = apply_fsdp(CausalLM(tiny(mixer, num_layers=2), seed=4), one_rank_mesh,
                       {"param_dtype": "bfloat16", "reduce_dtype": torch.float32})
    loss, dtype, resharded = sharded_forward(model)
    assert dtype == torch.bfloat16 and resharded
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    # bf16's 8-bit mantissa: measured 0.5-2.4e-5 relative on the loss, gradients 1.0-1.7e-2 relative
    # RMSE (cubit the worst), so a 1e-3 / 5e-2 bound, far below what a fp32-vs-bf16 mix-up of
    # shapes or an unsynchronised shard gives
    assert abs(loss.item() - expected.item()) <= 1e-3 * expected.item(), (loss, expected)
    full = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    worst = max(rel_rmse(full[name], p.grad) for name, p in reference.named_parameters())
    assert worst <= 5e-2, worst


def test_fsdp_defaults_change_no_number_and_reshard_is_an_option(one_rank_mesh, monkeypatch):
    import importlib

    parallelize_module = importlib.import_module("kernelmix.training.parallelize")  # the package's name is the function
    expected, _, _ = sharded_forward(CausalLM(tiny("cubit", num_layers=2), seed=4))
    # parallelize applies FSDP only over more than one process: let it take the one-rank mesh for two
    monkeypatch.setattr(parallelize_module, "data_parallel_size", lambda mesh=None: 2)
    model = parallelize(CausalLM(tiny("cubit", num_layers=2), seed=4), one_rank_mesh, fsdp=True,
                        fsdp_options=parallelize_module.FSDPOptions(reshard_after_forward=False))
    loss, dtype, resharded = sharded_forward(model)
    assert dtype == torch.float32 and not resharded  # gathered parameters kept for the backward
    assert torch.equal(loss, expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(fsdp_options={"param_dtype": "bf16"}),
     r"param_dtype must be one of float32, bfloat16, float16 \(or None: the parameters' own dtype\), got 'bf16'"),
    (dict(fsdp_options={"reduce_dtype": torch.int8}), "reduce_dtype must be one of float32, bfloat16, float16"),
    (dict(fsdp_options={"reshard_after_forward": 2}), "reshard_after_forward must be True or False, got 2"),
    (dict(fsdp_options={"mp_policy": None}), r"unknown fsdp_options 'mp_policy' \(choose from: param_dtype, "
                                             r"reduce_dtype, reshard_after_forward\)"),
    (dict(fsdp_options=["bfloat16"]), "fsdp_options must be an FSDPOptions or a dict, got list"),
])
def test_bad_fsdp_options_are_named(kwargs, message):
    with pytest.raises(KernelmixError, match=message):
        parallelize(CausalLM(tiny("softmax")), fsdp=True, **kwargs)


def test_fsdp_options_need_fsdp():
    with pytest.raises(KernelmixError, match="fsdp_options apply to FSDP only: pass fsdp=True"):
        parallelize(CausalLM(tiny("softmax")), fsdp_options={"param_dtype": "bfloat16"})
