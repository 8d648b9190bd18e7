"""Every layer initialises its own parameters (``reset_parameters``): nothing above a layer needs
to know a mixer class to initialise a model."""

from __future__ import annotations

import math

import pytest
import torch

from kernelmix.layers import MIXERS, SHARED_OPTIONS, build_mixer, mixer_options

from .common import BASE, CASE_IDS, CASES, HEADS, make_layer


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reset_parameters_restores_the_initial_values(case):
    _, name, options, setup = case
    torch.manual_seed(0)
    fresh = build_mixer(name, **BASE, **options)
    layer = make_layer(name, options, setup)  # moved away from every initial value
    layer.reset_parameters()
    own = {key: value for key, value in fresh.state_dict().items() if "_proj." not in key or "rho_proj" in key}
    for key, value in own.items():
        if key != "projection":  # W is kept (redraw_ changes it)
            actual = layer.state_dict()[key]  # float64; the fresh layer is float32
            torch.testing.assert_close(actual, value.to(actual), rtol=1e-6, atol=1e-7, msg=key)
    if name in ("cubit", "cubit-rf") and options.get("lrr", True):
        rho = 0.5 + 1.5 * torch.sigmoid(layer.rho_proj.bias)
        assert torch.allclose(rho, torch.ones(HEADS, dtype=rho.dtype))  # ρ = 1: Cubit-NoLRR at init
        assert torch.allclose(layer.log_ridge.exp(), torch.full((HEADS,), 1e-6, dtype=rho.dtype))


@pytest.mark.parametrize("name", list(MIXERS))
def test_reset_parameters_with_a_std_draws_every_projection(name):
    layer = build_mixer(name, **{**BASE, "bias": True})
    layer.reset_parameters(0.5, 0.25)
    for module_name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "rho_proj":
            expected = 0.25 if module_name == "o_proj" else 0.5
            std = float(module.weight.detach().std())
            assert abs(std - expected) < 0.3 * expected, module_name
            assert module.bias is None or not module.bias.any(), module_name


def test_the_shared_options_are_spelled_once():
    assert SHARED_OPTIONS == ("hidden_size", "num_heads", "head_dim", "num_kv_heads", "rope_theta", "bias",
                              "chunk_size", "backend")
    for name in MIXERS:
        assert mixer_options(name)[: len(SHARED_OPTIONS)] == SHARED_OPTIONS
    with pytest.raises(TypeError, match="ridg"):
        MIXERS["cubit"](**BASE, ridg=1.0)  # a misspelt own option is an error too
    assert math.isclose(MIXERS["cubit"](**BASE, ridge=2.0).log_ridge[0].item(), math.log(2.0), rel_tol=1e-6)
