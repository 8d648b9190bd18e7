"""Performer / DARKFormer layers: the projection buffer (saved, reloaded, redrawn only explicitly),
DARKFormer at the identity equals Performer, and DARKFormer's data-aware initialisation (whiten_)."""

from __future__ import annotations

import pytest
import torch

from kernelmix.layers import DarkFormerMixer, PerformerMixer, RandomFeatureMap

from ..ops.test_data_aware import correlated_samples
from .common import BASE, F64, HEAD_DIM, HEADS, KV_HEADS, inputs, make_layer, rel_err

RF = ["performer", "darkformer"]


@pytest.mark.parametrize("name", RF)
@pytest.mark.parametrize("kind", ["orthogonal", "iid"])
def test_projection_buffer(name, kind):
    layer = make_layer(name, {"num_features": 12, "projection": kind}, None)
    assert layer.projection.shape == (HEADS, 12, HEAD_DIM)
    assert layer.projection.dtype == F64
    assert "projection" not in dict(layer.named_parameters())
    if kind == "orthogonal":  # blocks of d orthogonal rows
        block = layer.projection[:, :HEAD_DIM]
        gram = block @ block.transpose(-1, -2)
        assert torch.allclose(gram, torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1)), atol=1e-5)


@pytest.mark.parametrize("name", RF)
def test_state_dict_round_trip(name):
    layer = make_layer(name, {"num_features": 16}, "whiten" if name == "darkformer" else None)
    state = layer.state_dict()
    assert "projection" in state
    if name == "darkformer":
        assert "query_fold" in state and "transform" in state
    fresh = make_layer(name, {"num_features": 16}, None, seed=123)
    assert not torch.equal(fresh.projection, layer.projection)
    fresh.load_state_dict(state)
    x = inputs()
    with torch.no_grad():
        assert torch.equal(fresh(x)[0], layer(x)[0])


@pytest.mark.parametrize("name", RF)
def test_redraw_is_explicit_and_reproducible(name):
    a = make_layer(name, {"num_features": 16}, None, seed=0)
    b = make_layer(name, {"num_features": 16}, None, seed=1)
    before = a.projection.clone()
    a.redraw_(torch.Generator().manual_seed(42))
    b.redraw_(torch.Generator().manual_seed(42))
    assert torch.equal(a.projection, b.projection)
    assert a.projection.dtype == F64
    assert not torch.equal(a.projection, before)
    # the draw does not depend on the layer dtype
    c = make_layer(name, {"num_features": 16}, None, dtype=torch.float32)
    c.redraw_(torch.Generator().manual_seed(42))
    assert torch.allclose(c.projection.double(), a.projection, atol=1e-6)

    # forward (training mode, with backward and with a cache) never touches W
    a.train()
    snapshot = a.projection.clone()
    out, cache = a(inputs())
    out2, _ = a(inputs(length=2), cache)
    (out.sum() + out2.sum()).backward()
    assert torch.equal(a.projection, snapshot)
    assert a.projection.grad is None


def test_darkformer_at_identity_equals_performer():
    performer = make_layer("performer", {"num_features": 16}, None)
    dark = DarkFormerMixer(**BASE, num_features=16).double()
    missing, unexpected = dark.load_state_dict(performer.state_dict(), strict=False)
    assert sorted(missing) == ["query_fold", "transform"] and not unexpected
    assert torch.equal(dark.transform, torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1))
    assert torch.equal(dark.query_fold, torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1))
    x = inputs()
    with torch.no_grad():
        out_p, cache_p = performer(x[:, :6])
        out_d, cache_d = dark(x[:, :6])
        assert rel_err(out_d, out_p) <= 1e-12
        assert rel_err(dark(x[:, 6:], cache_d)[0], performer(x[:, 6:], cache_p)[0]) <= 1e-12


def test_whiten_sets_transform_and_fold_and_keeps_the_kernel():
    layer = make_layer("darkformer", {"num_features": 16}, None)
    with torch.no_grad():
        layer.transform.copy_(torch.eye(HEAD_DIM).expand(HEADS, -1, -1))
    x = inputs(batch=4, length=13)
    q, k = layer.qk_samples(x)
    assert q.shape == (4 * 13, HEADS, HEAD_DIM) and k.shape == (4 * 13, KV_HEADS, HEAD_DIM)
    with torch.no_grad():
        layer.q_proj.weight[:2].zero_()  # an exactly-zero query dimension, as in real models
    q, k = layer.qk_samples(x)
    assert layer.whiten_(q, k, eps=1e-3) is layer
    m, fold = layer.transform.detach(), layer.query_fold
    assert not torch.allclose(m, torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1))
    assert torch.isfinite(m).all() and torch.isfinite(fold).all()
    k_full = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    qf = torch.einsum("hij,nhj->nhi", fold, q)
    whitened = torch.einsum("nhi,hji,hjk,mhk->hnm", qf, m, m, k_full)
    plain = torch.einsum("nhi,mhi->hnm", q, k_full)
    assert rel_err(whitened, plain) <= 1e-8
    # and the layer still decodes consistently
    with torch.no_grad():
        full, _ = layer(x)
        _, cache = layer(x[:, :6])
        assert rel_err(layer(x[:, 6:], cache)[0], full[:, 6:]) <= 1e-10


def test_whitened_darkformer_estimates_the_pretrained_kernel():
    """With many features, whitened DARKFormer approximates the same function as Performer
    (both estimate exp(q·k/√d) attention) — whitening does not change the target."""
    torch.manual_seed(0)
    performer = PerformerMixer(**BASE, num_features=16384, projection="iid").double()
    dark = DarkFormerMixer(**BASE, num_features=16384, projection="iid").double()
    dark.load_state_dict(performer.state_dict(), strict=False)
    x = inputs(batch=1, length=8)
    q, k = dark.qk_samples(inputs(batch=8, length=13, seed=3))
    dark.whiten_(q, k, eps=1e-3)
    softmax = make_layer("softmax", {}, None)
    softmax.load_state_dict(performer.state_dict(), strict=False)
    with torch.no_grad():
        exact = softmax(x)[0]
        assert rel_err(dark(x)[0], exact) <= 0.05
        assert rel_err(performer(x)[0], exact) <= 0.05


# ---------------------------------------------------------------------------------------------
# The one random-feature map (shared with a converted model's kernels)


def test_the_layers_are_random_feature_maps():
    for name in RF:
        assert isinstance(make_layer(name, {"num_features": 8}, None), RandomFeatureMap)
    performer = make_layer("performer", {"num_features": 8}, None)
    assert performer.transform is None and performer.query_fold is None
    assert set(performer.state_dict()) == {"projection"} | {f"{p}_proj.weight" for p in "qkvo"}
    with pytest.raises(ValueError, match="data-aware"):
        performer.whiten_(*correlated_samples(20, HEADS, KV_HEADS, HEAD_DIM))


def test_a_standalone_map_draws_like_a_layer_and_redraws_another_m():
    torch.manual_seed(0)
    layer = PerformerMixer(**BASE, num_features=12)
    g = torch.Generator().manual_seed(7)
    feature_map = RandomFeatureMap(num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, num_features=12,
                                   generator=g)
    assert torch.equal(feature_map.projection, layer.redraw_(torch.Generator().manual_seed(7)))
    kept = feature_map.projection
    assert feature_map.redraw_(torch.Generator().manual_seed(8)) is kept  # same m: in place
    wider = feature_map.redraw_(torch.Generator().manual_seed(8), num_features=20)
    assert wider.shape == (HEADS, 20, HEAD_DIM) and feature_map.num_features == 20
    assert feature_map.state_dict()["projection"].shape == (HEADS, 20, HEAD_DIM)
    with pytest.raises(ValueError, match="num_features"):
        feature_map.redraw_(None, num_features=0)
    with pytest.raises(ValueError, match="projection"):
        RandomFeatureMap(num_heads=HEADS, head_dim=HEAD_DIM, projection="gaussian")


def test_map_attention_is_the_op_with_its_tensors():
    layer = make_layer("darkformer", {"num_features": 16}, "whiten")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, HEADS, HEAD_DIM, generator=g, dtype=F64)
    k = torch.randn(2, 9, KV_HEADS, HEAD_DIM, generator=g, dtype=F64)
    v = torch.randn(2, 9, KV_HEADS, HEAD_DIM, generator=g, dtype=F64)
    folded = layer.fold_queries(q)
    assert rel_err(folded, torch.einsum("hij,bthj->bthi", layer.query_fold, q)) <= 1e-15
    with torch.no_grad():
        causal = layer.attend_causal(folded, k, v)
        mask = torch.ones(9, 9, dtype=torch.bool).tril()[None].expand(2, -1, -1)
        dense, weights = layer.attend_masked(folded, k, v, mask)
        assert rel_err(dense, causal) <= 1e-10 and weights.shape == (2, HEADS, 9, 9)
        out, state = layer.attend_causal(folded[:, :5], k[:, :5], v[:, :5], return_state=True)
        step, _ = layer.attend_causal(folded[:, 5:6], k[:, 5:6], v[:, 5:6], state=state, return_state=True)
        assert rel_err(step, causal[:, 5:6]) <= 1e-10
        eye = torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1)
        assert not torch.allclose(layer.attend_causal(folded, k, v, transform=eye), causal)


def test_reset_parameters_returns_to_the_identity_and_keeps_w():
    layer = make_layer("darkformer", {"num_features": 16}, "whiten")
    projection = layer.projection.clone()
    eye = torch.eye(HEAD_DIM, dtype=F64).expand(HEADS, -1, -1)
    layer.reset_parameters(0.02, 0.01)
    assert torch.equal(layer.transform, eye) and torch.equal(layer.query_fold, eye)
    assert torch.equal(layer.projection, projection)
    assert abs(float(layer.o_proj.weight.detach().std()) - 0.01) < 0.003
    assert abs(float(layer.q_proj.weight.detach().std()) - 0.02) < 0.006
