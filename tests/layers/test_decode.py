"""Layer contracts shared by every mixer: decode with the cache equals the full forward, causality,
grouped-query attention, dtypes and gradients."""

from __future__ import annotations

import pytest
import torch

from kernelmix.layers import MIXERS, LayerCache
from kernelmix.layers.rope import RopeTables

from .common import CASE_IDS, CASES, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LENGTH, PREFILL, inputs, make_layer, rel_err

TOL = 1e-10


def _token_by_token(layer, x, cache=None):
    outputs = []
    for t in range(x.shape[1]):
        out, cache = layer(x[:, t : t + 1], cache)
        outputs.append(out)
    return torch.cat(outputs, dim=1), cache


@pytest.mark.parametrize("name,options,setup", [c[1:] for c in CASES], ids=CASE_IDS)
def test_decode_equals_full_forward(name, options, setup):
    layer = make_layer(name, options, setup)
    x = inputs()
    with torch.no_grad():
        full, full_cache = layer(x)
        assert isinstance(full_cache, LayerCache)
        assert full_cache.mixer == name and full_cache.position == LENGTH

        stepped, cache = _token_by_token(layer, x)
        assert cache.position == LENGTH
        assert rel_err(stepped, full) <= TOL

        prefill_out, prefill_cache = layer(x[:, :PREFILL])
        assert prefill_cache.position == PREFILL
        assert rel_err(prefill_out, full[:, :PREFILL]) <= TOL

        # the same prefill cache continued twice: a cache is a value, forward never mutates it
        rest_steps, cache_a = _token_by_token(layer, x[:, PREFILL:], prefill_cache)
        rest_block, cache_b = layer(x[:, PREFILL:], prefill_cache)
        assert prefill_cache.position == PREFILL
        assert cache_a.position == cache_b.position == LENGTH
        assert rel_err(rest_steps, full[:, PREFILL:]) <= TOL
        assert rel_err(rest_block, full[:, PREFILL:]) <= TOL

        # and the full-sequence cache continues like the token-by-token one
        x_next = inputs(length=3, seed=7)
        after_full, _ = layer(x_next, full_cache)
        after_steps, _ = _token_by_token(layer, x_next, cache)
        assert rel_err(after_steps, after_full) <= TOL


@pytest.mark.parametrize("name,options,setup", [c[1:] for c in CASES], ids=CASE_IDS)
def test_a_stepped_cache_continued_twice_keeps_each_continuation(name, options, setup):
    """Decode caches grow in spare rows of a buffer; continuing one state a second time (two
    generations from one point) must not write over the first continuation's tokens."""
    layer = make_layer(name, options, setup)
    x = inputs()
    other = inputs(seed=11)
    with torch.no_grad():
        full, _ = layer(x)
        full_other, _ = layer(torch.cat([x[:, :PREFILL], other[:, PREFILL:]], dim=1))
        _, cache = _token_by_token(layer, x[:, :PREFILL])
        first, first_cache = _token_by_token(layer, x[:, PREFILL:], cache)
        second, _ = _token_by_token(layer, other[:, PREFILL:], cache)
        last, _ = layer(inputs(length=1, seed=3), first_cache)  # the first branch still continues, after the second
        first_again, _ = _token_by_token(layer, x[:, LENGTH - 1 :], _token_by_token(layer, x[:, PREFILL:-1], cache)[1])
        expected_last, _ = layer(torch.cat([x, inputs(length=1, seed=3)], dim=1))
    assert rel_err(first, full[:, PREFILL:]) <= TOL
    assert rel_err(second, full_other[:, PREFILL:]) <= TOL
    assert rel_err(first_again, full[:, LENGTH - 1 :]) <= TOL
    assert rel_err(last, expected_last[:, LENGTH:]) <= TOL


@pytest.mark.parametrize("name,options,setup", [c[1:] for c in CASES], ids=CASE_IDS)
def test_causal(name, options, setup):
    layer = make_layer(name, options, setup)
    x = inputs()
    t = 7
    y = x.clone()
    y[:, t + 1 :] += torch.randn_like(y[:, t + 1 :])
    with torch.no_grad():
        out_x, _ = layer(x)
        out_y, _ = layer(y)
    assert (out_x[:, : t + 1] - out_y[:, : t + 1]).abs().max().item() <= 1e-12
    assert (out_x[:, t + 1 :] - out_y[:, t + 1 :]).abs().max().item() > 1e-6


@pytest.mark.parametrize("name,options,setup", [c[1:] for c in CASES], ids=CASE_IDS)
def test_grouped_query_equals_repeated_heads(name, options, setup):
    """A layer with H_kv = 2 equals one with H_kv = H whose k/v weights repeat each group's rows:
    query head h reads kv head h // (H / H_kv) in every mixer."""
    gqa = make_layer(name, options, setup)
    mha = make_layer(name, options, None, num_kv_heads=HEADS)
    state = dict(gqa.state_dict())
    group = HEADS // KV_HEADS
    for proj in ("k_proj", "v_proj"):
        weight = state[f"{proj}.weight"].view(KV_HEADS, HEAD_DIM, HIDDEN)
        state[f"{proj}.weight"] = weight.repeat_interleave(group, dim=0).reshape(HEADS * HEAD_DIM, HIDDEN)
    mha.load_state_dict(state)
    x = inputs()
    with torch.no_grad():
        assert rel_err(mha(x)[0], gqa(x)[0]) <= 1e-12


@pytest.mark.parametrize("name", list(MIXERS))
def test_without_grouping(name):
    layer = make_layer(name, {}, None, num_kv_heads=None)
    assert layer.num_kv_heads == layer.num_heads
    x = inputs(length=9)
    with torch.no_grad():
        full, _ = layer(x)
        _, cache = layer(x[:, :4])
        rest, _ = layer(x[:, 4:], cache)
    assert rel_err(rest, full[:, 4:]) <= TOL


@pytest.mark.parametrize("name", list(MIXERS))
def test_float32_close_to_float64(name):
    layer64 = make_layer(name, {}, None)
    layer32 = make_layer(name, {}, None, dtype=torch.float32)
    x = inputs()
    with torch.no_grad():
        out64, _ = layer64(x)
        out32, cache32 = layer32(x.float())
        assert out32.dtype == torch.float32
        step32, _ = layer32(x[:, :1].float(), cache32)
    assert torch.isfinite(step32).all()
    assert rel_err(out32.double(), out64) <= 1e-4


@pytest.mark.parametrize("name", list(MIXERS))
def test_bf16_autocast_runs(name):
    layer = make_layer(name, {}, None, dtype=torch.float32)
    x = inputs(dtype=torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, cache = layer(x)
        step, _ = layer(x[:, :1], cache)
    assert out.shape == x.shape and step.shape == (x.shape[0], 1, HIDDEN)
    assert torch.isfinite(out.float()).all() and torch.isfinite(step.float()).all()
    with torch.no_grad():
        reference, _ = layer(x)
    assert rel_err(out.float(), reference) <= 0.1


@pytest.mark.parametrize("name,options,setup", [c[1:] for c in CASES], ids=CASE_IDS)
def test_gradients_reach_every_parameter(name, options, setup):
    layer = make_layer(name, options, setup)
    x = inputs().requires_grad_(True)
    out, cache = layer(x[:, :PREFILL])
    rest, _ = layer(x[:, PREFILL:], cache)  # through the cache too
    (out.pow(2).sum() + rest.pow(2).sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad is not None, f"no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {pname}"
        assert p.grad.abs().max() > 0, f"zero gradient for {pname}"


def test_mixer_specific_parameters_exist():
    base = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}

    def names(name, **options):
        return {n for n, _ in make_layer(name, options, None).named_parameters()}

    assert names("softmax") == base
    assert names("cubit") == base | {
        "r_proj.weight", "rho_proj.weight", "rho_proj.bias", "log_ref_scale", "log_ridge"
    }
    assert names("cubit", reference="key", lrr=False) == base | {"log_ref_scale", "log_ridge"}
    assert names("deltaformer") == base | {"beta_proj.weight"}
    assert names("performer") == base
    assert names("darkformer") == base | {"transform"}
    assert names("cubit-rf") == names("cubit")  # its W is a buffer
    assert names("cubit-rf", data_aware=True) == names("cubit") | {"transform"}


def test_cubit_initial_values():
    torch.manual_seed(0)
    layer = MIXERS["cubit"](hidden_size=HIDDEN, num_heads=HEADS, ridge=1e-3, lrr_range=(0.25, 4.0))
    assert torch.allclose(layer.log_ref_scale.exp(), torch.ones(HEADS))
    assert torch.allclose(layer.log_ridge.exp(), torch.full((HEADS,), 1e-3))
    rho = 0.25 + 3.75 * torch.sigmoid(layer.rho_proj(torch.randn(3, HIDDEN)))
    assert torch.allclose(rho, torch.ones_like(rho))  # a fresh layer starts as Cubit-NoLRR


def test_cubit_lrr_range_bounds_rho():
    layer = make_layer("cubit", {"lrr_range": (0.5, 2.0)}, None)
    with torch.no_grad():
        layer.rho_proj.weight.mul_(100.0)
        x = inputs()
        extras = layer._extras(x, q=None, k=None, k_raw=None,
                                rotary=RopeTables.at(torch.arange(x.shape[1]), layer.head_dim))
    assert extras["rho"].min() >= 0.5 and extras["rho"].max() <= 2.0
    assert extras["rho"].shape == (2, LENGTH, HEADS)
