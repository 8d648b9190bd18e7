"""The Cubit-RF layer, constructed directly (its registration: test_cubit_rf_registered.py): shapes,
decode equals the parallel forward, a cache of constant size, gradients, options, redraw and
whitening, errors."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.layers import SHARED_OPTIONS
from kernelmix.layers.cubit_rf import CubitRFMixer
from kernelmix.ops import CubitRFState
from tests.layers.common import BASE, F64, HIDDEN, LENGTH, PREFILL, inputs, randomize_, rel_err

OPTIONS = {
    "default": {},
    "key": {"reference": "key"},
    "nolrr-norefrope": {"lrr": False, "reference_rope": False},
    "iid": {"projection": "iid"},
    "data-aware": {"data_aware": True},
}


def make(options: dict | None = None, *, seed: int = 0, dtype=F64, **overrides) -> CubitRFMixer:
    torch.manual_seed(seed)
    layer = CubitRFMixer(**{**BASE, "num_features": 16, **overrides, **(options or {})}).to(dtype)
    return randomize_(layer, seed)


@pytest.mark.parametrize("case", list(OPTIONS))
def test_forward_shapes_and_metadata(case):
    layer = make(OPTIONS[case])
    out, cache = layer(inputs())
    assert out.shape == (2, LENGTH, HIDDEN) and torch.isfinite(out).all()
    assert cache.mixer == "cubit-rf" and cache.position == LENGTH and isinstance(cache.state, CubitRFState)
    assert layer.mixer_name == "cubit-rf" and layer.constant_cache and layer.family == "random-features"
    params = [p.name for p in inspect.signature(CubitRFMixer.__init__).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert params == list(CubitRFMixer.OPTIONS) and not set(params) & set(SHARED_OPTIONS)
    assert set(params) >= {"num_features", "projection", "data_aware", "reference", "reference_rope", "lrr", "ridge"}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_decode_token_by_token_equals_the_parallel_forward(case):
    layer = make(OPTIONS[case])
    x = inputs()
    full, _ = layer(x)
    out, cache = layer(x[:, :PREFILL])
    outs = [out]
    for t in range(PREFILL, LENGTH):
        o_t, cache = layer(x[:, t : t + 1], cache)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), full) <= 1e-10
    # several tokens at once continue the state as well
    first, cache = layer(x[:, :4])
    rest, _ = layer(x[:, 4:], cache)
    assert rel_err(torch.cat([first, rest], dim=1), full) <= 1e-10


def test_float32_decode_equals_parallel():
    layer = make(dtype=torch.float32)
    x = inputs(dtype=torch.float32)
    full, _ = layer(x)
    _, cache = layer(x[:, :PREFILL])
    outs = []
    for t in range(PREFILL, LENGTH):
        o_t, cache = layer(x[:, t : t + 1], cache)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), full[:, PREFILL:]) <= 1e-5


def test_cache_size_does_not_grow():
    layer = make()
    x = inputs(batch=1, length=40)
    _, cache = layer(x[:, :3])
    sizes = []
    for t in range(3, 40):
        _, cache = layer(x[:, t : t + 1], cache)
        sizes.append(sum(t_.numel() for part in (cache.state.reference, cache.state.readout)
                         for t_ in (part.S, part.z, part.shift)))
    assert len(set(sizes)) == 1 and cache.position == 40


def test_packed_documents_equal_separate_sequences():
    layer = make()
    x = inputs(batch=1)
    split = 5
    doc_start = torch.tensor([[0] * split + [split] * (LENGTH - split)])
    positions = torch.tensor([list(range(split)) + list(range(LENGTH - split))])
    packed, _ = layer(x, doc_start=doc_start, position_ids=positions)
    first, _ = layer(x[:, :split])
    second, _ = layer(x[:, split:])
    assert rel_err(packed, torch.cat([first, second], dim=1)) <= 1e-10


def test_gradients_reach_every_parameter():
    layer = make({"data_aware": True}, dtype=torch.float32)
    out, _ = layer(inputs(dtype=torch.float32))
    out.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_reset_redraw_and_whiten():
    layer = make({"data_aware": True})
    x = inputs()
    before, _ = layer(x)
    w = layer.projection.clone()
    layer.redraw_(torch.Generator().manual_seed(5))
    assert not torch.equal(w, layer.projection)
    again = layer.projection.clone()
    layer.redraw_(torch.Generator().manual_seed(5))
    assert torch.equal(again, layer.projection)  # a seeded generator draws the same W
    assert rel_err(layer(x)[0], before) > 1e-6
    q, k = layer.qk_samples(x)
    layer.whiten_(q, k, eps=1e-2)
    assert not torch.allclose(layer.transform, torch.eye(layer.head_dim, dtype=F64))
    layer.reset_parameters(std=0.02)
    assert torch.equal(layer.transform, torch.eye(layer.head_dim, dtype=F64).expand_as(layer.transform))
    assert torch.allclose(layer.log_ridge.exp(), torch.full_like(layer.log_ridge, 1e-6))
    assert torch.equal(layer.projection, again)  # reset keeps W
    fresh = make(num_features=24)
    assert fresh.projection.shape == (BASE["num_heads"], 24, BASE["head_dim"])


def test_bad_options_and_caches():
    with pytest.raises(TypeError):
        CubitRFMixer(**BASE, num_featurs=8)
    with pytest.raises(KernelmixError, match="num_features must be a positive int"):
        CubitRFMixer(**BASE, num_features=0)
    with pytest.raises(KernelmixError, match="reference must be one of"):
        CubitRFMixer(**BASE, reference="query")
    layer, other = make(), make(num_features=8)
    x = inputs()
    _, cache = other(x[:, :4])
    with pytest.raises(KernelmixError, match="cache holds 8 random features"):
        layer(x[:, 4:5], cache)
    _, cubit_cache = layer(x[:, :4])
    with pytest.raises(KernelmixError, match="built for batch size 2, hidden_states has batch size 1"):
        layer(x[:1, 4:5], cubit_cache)
    cubit_cache.state = object()
    with pytest.raises(KernelmixError, match="must be a CubitRFState"):
        layer(x[:, 4:5], cubit_cache)
