"""Bad input is an error that names the problem: unknown names and options, wrong shapes, caches
from another layer."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernelmix.layers import MIXERS, LayerCache, MixerLayer, build_mixer, mixer_options

from .common import BASE, HIDDEN, inputs, make_layer

ALL = list(MIXERS)


def test_registry_names():
    assert list(MIXERS) == ["softmax", "cubit", "deltaformer", "performer", "darkformer", "cubit-rf"]


def test_unknown_mixer_names_the_accepted_ones():
    with pytest.raises(ValueError) as err:
        build_mixer("cubt", **BASE)
    message = str(err.value)
    assert "'cubt'" in message
    assert "softmax, cubit, deltaformer, performer, darkformer, cubit-rf" in message


@pytest.mark.parametrize("name", ALL)
def test_constructors_are_keyword_only_without_catch_all(name):
    # keyword-only; the one ``**shared`` goes on to MixerLayer.__init__, which has no catch-all
    params = list(inspect.signature(MIXERS[name].__init__).parameters.values())[1:]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params if p.name != "shared")
    shared = list(inspect.signature(MixerLayer.__init__).parameters.values())[1:]
    assert shared and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in shared)
    with pytest.raises(TypeError):
        MIXERS[name](HIDDEN, 4)  # positional


@pytest.mark.parametrize("name", ALL)
def test_unknown_option_is_an_error(name):
    with pytest.raises(ValueError) as err:
        build_mixer(name, **BASE, num_head=4)
    message = str(err.value)
    assert "'num_head'" in message
    for option in mixer_options(name):
        assert option in message
    with pytest.raises(TypeError):
        MIXERS[name](**BASE, num_head=4)


def test_options_belong_to_their_mixer():
    # an option of another mixer is unknown too, not silently dropped
    with pytest.raises(ValueError, match="'w'"):
        build_mixer("cubit", **BASE, w="q")
    with pytest.raises(ValueError, match="'num_features'"):
        build_mixer("softmax", **BASE, num_features=8)
    assert "lrr" in mixer_options("cubit") and "w" in mixer_options("deltaformer")
    assert mixer_options("darkformer") == mixer_options("performer")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\).*num_kv_heads \(3\)"),
        (dict(num_heads=0), "num_heads"),
        (dict(hidden_size=-1), "hidden_size"),
        (dict(head_dim=7), "even"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(bias="no"), "bias"),
        (dict(hidden_size=30, num_heads=4, head_dim=None), "divisible"),
    ],
)
def test_bad_shared_arguments(name, bad, match):
    with pytest.raises(ValueError, match=match):
        build_mixer(name, **{**BASE, **bad})


@pytest.mark.parametrize(
    "name,bad,match",
    [
        ("cubit", dict(reference="keys"), "reference"),
        ("cubit", dict(lrr="yes"), "lrr"),
        ("cubit", dict(reference_rope=1), "reference_rope"),
        ("cubit", dict(lrr_range=(2.0, 0.5)), "lrr_range"),
        ("cubit", dict(lrr_range=(0.0, 2.0)), "lrr_range"),
        ("cubit", dict(lrr_range=1.0), "lrr_range"),
        ("cubit", dict(ridge=0.0), "ridge"),
        ("deltaformer", dict(w="v"), "'k', 'q'"),
        ("performer", dict(num_features=0), "num_features"),
        ("performer", dict(num_features=-3), "num_features"),
        ("darkformer", dict(num_features=0), "num_features"),
        ("performer", dict(projection="gaussian"), "'orthogonal', 'iid'"),
        ("darkformer", dict(num_features=2.5), "num_features"),
        ("cubit-rf", dict(num_features=0), "num_features"),
        ("cubit-rf", dict(reference="query"), "reference"),
        ("cubit-rf", dict(ridge=0.0), "ridge"),
        ("cubit-rf", dict(projection="gaussian"), "'orthogonal', 'iid'"),
    ],
)
def test_bad_mixer_options(name, bad, match):
    with pytest.raises(ValueError, match=match):
        build_mixer(name, **{**BASE, **bad})


@pytest.mark.parametrize("name", ALL)
def test_bad_hidden_states(name):
    layer = make_layer(name, {}, None)
    x = inputs()
    with pytest.raises(ValueError, match=f"hidden_size = {HIDDEN}"):
        layer(x[..., :-1])
    with pytest.raises(ValueError, match="3 dims"):
        layer(x[0])
    with pytest.raises(ValueError, match="3 dims"):
        layer(x[None])
    with pytest.raises(ValueError, match="T = 0"):
        layer(x[:, :0])
    with pytest.raises(ValueError, match="tensor"):
        layer(x.tolist())
    with pytest.raises(ValueError, match="floating"):
        layer(x.long())


@pytest.mark.parametrize("name", ALL)
def test_cache_from_another_mixer(name):
    other = "cubit" if name != "cubit" else "softmax"
    _, foreign = make_layer(other, {}, None)(inputs(length=3))
    layer = make_layer(name, {}, None)
    with pytest.raises(ValueError, match=f"cache was built by a '{other}' layer, this is a '{name}' layer"):
        layer(inputs(length=1), foreign)


@pytest.mark.parametrize("name", ALL)
def test_cache_from_a_differently_shaped_layer(name):
    _, cache = make_layer(name, {}, None, num_kv_heads=4)(inputs(length=3))
    layer = make_layer(name, {}, None)
    with pytest.raises(ValueError, match="num_kv_heads"):
        layer(inputs(length=1), cache)


@pytest.mark.parametrize("name", ALL)
def test_bad_cache_objects(name):
    layer = make_layer(name, {}, None)
    _, cache = layer(inputs(length=3))
    with pytest.raises(ValueError, match="batch size 2"):
        layer(inputs(batch=3, length=1), cache)
    with pytest.raises(ValueError, match="LayerCache"):
        layer(inputs(length=1), cache.state)
    stale = LayerCache(**{**cache.__dict__, "position": 5})
    with pytest.raises(ValueError, match="inconsistent"):
        layer(inputs(length=1), stale)


def test_cache_with_another_number_of_features():
    _, cache = make_layer("performer", {"num_features": 8}, None)(inputs(length=3))
    with pytest.raises(ValueError, match="num_features=16"):
        make_layer("performer", {"num_features": 16}, None)(inputs(length=1), cache)


def test_whiten_rejects_bad_samples():
    layer = make_layer("darkformer", {"num_features": 8}, None)
    q = torch.randn(50, 4, 8, dtype=torch.float64)
    k = torch.randn(50, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="heads"):
        layer.whiten_(q[:, :3], k)
    with pytest.raises(ValueError, match="heads"):
        layer.whiten_(q, k[:, :1].expand(-1, 3, -1))
    with pytest.raises(ValueError, match="head dim"):
        layer.whiten_(q[..., :6], k[..., :6])
    with pytest.raises(ValueError, match=r"\[N, H, d\]"):
        layer.whiten_(q[0], k)
    with pytest.raises(ValueError, match="eps"):
        layer.whiten_(q, k, eps=0.0)
