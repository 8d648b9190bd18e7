"""Cubit-RF's dense ablation (ops/cubit_rf_parts): each of its four settings against a float64
composition written here from the definition (explicit features, no log-sum-exp), the two ends against
the library's own references (Cubit-RF's and Cubit's), float32 against float64 in values and gradients,
documents, grouped heads, non-finite tokens, and the layer and registry entries that use it."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.layers import registry
from kernelmix.layers.cubit_rf import CubitRFMixer
from kernelmix.ops import cubit_rf_attention_naive
from kernelmix.ops.cubit import cubit_attention_naive
from kernelmix.ops.cubit_rf_parts import ESTIMATES, cubit_rf_parts_attention
from tests.utils import rel_rmse

F64 = torch.float64
B, T, H, H_KV, D, M = 2, 11, 4, 2, 8, 16


def inputs(seed: int = 0, transform: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=F64)

    return {
        "q": randn(B, T, H, D), "k": randn(B, T, H_KV, D), "v": randn(B, T, H_KV, D), "r": randn(B, T, H, D, scale=0.7),
        "projection": randn(H, M, D), "rho": 0.5 + torch.rand(B, T, H, generator=g, dtype=F64),
        "ridge": torch.tensor([1e-3, 1e-2, 0.1, 0.5], dtype=F64),
        "ref_scale": torch.tensor([1.0, 0.5, 2.0, 1.5], dtype=F64),
        "transform": torch.eye(D, dtype=F64) + 0.1 * randn(H, D, D) if transform else None,
    }


DOCS = torch.tensor([[0] * 4 + [4] * 7, [0] * T])  # two documents in the first row


def composed(x: dict, estimate: str, doc_start=None, readout: str = "keys") -> torch.Tensor:
    """The definition, float64: φ(x)_m = exp(w_mᵀ M x̃ − ½‖M x̃‖²)/√m, x̃ = d^{-1/4} x; each kernel
    exact or Σ_m φ·φ, masked, row-normalised; U = (G + λI)⁻¹ (ρ v); o = A U."""
    q, r, w, tr = x["q"], x["r"], x["projection"], x["transform"]
    k, v = (x[n].repeat_interleave(H // H_KV, dim=2) for n in ("k", "v"))
    eye = torch.eye(D, dtype=F64).expand(H, D, D) if tr is None else tr
    r_hat = x["ref_scale"][:, None] * r / r.norm(dim=-1, keepdim=True)

    def phi(z):
        z = torch.einsum("hed,bthd->bthe", eye, z * D**-0.25)
        return torch.exp(torch.einsum("bthd,hmd->bthm", z, w) - 0.5 * z.pow(2).sum(-1, keepdim=True)) / M**0.5

    def kernel(left, right, scale, estimated):
        if estimated:
            root = (scale * D**0.5) ** 0.5
            return torch.einsum("bihm,bjhm->bhij", phi(left * root), phi(right * root))
        ml, mr = (torch.einsum("hed,bthd->bthe", eye, z) for z in (left, right))
        return torch.exp(scale * torch.einsum("bihd,bjhd->bhij", ml, mr))

    visible = torch.ones(T, T, dtype=torch.bool).tril()
    if doc_start is not None:
        visible = visible & (torch.arange(T)[None, None, :] >= doc_start[:, :, None])[:, None]

    def normalised(kern):
        kern = kern.masked_fill(~visible, 0.0)
        return kern / kern.sum(-1, keepdim=True)

    gram = normalised(kernel(r, r_hat, 1.0, estimate in ("both", "gram")))
    system = gram + x["ridge"][:, None, None] * torch.eye(T, dtype=F64)
    u = torch.linalg.solve(system, (x["rho"][..., None] * v).transpose(1, 2))
    if readout == "linear":
        weights = (torch.einsum("bihd,bjhd->bhij", q, k) / D**0.5).masked_fill(~visible, 0.0)
    elif readout == "reference":
        weights = normalised(kernel(q, r_hat, 1.0, estimate in ("both", "readout")))
    else:
        weights = normalised(kernel(q, k, D**-0.5, estimate in ("both", "readout")))
    return (weights @ u).transpose(1, 2)


def call(x: dict, estimate: str, **kw) -> torch.Tensor:
    names = ("rho", "ridge", "ref_scale", "transform")
    return cubit_rf_parts_attention(x["q"], x["k"], x["v"], x["r"], x["projection"], estimate=estimate,
                                    **{n: x[n] for n in names}, **kw)


@pytest.mark.parametrize("estimate", ESTIMATES)
@pytest.mark.parametrize("docs", [False, True])
def test_each_setting_equals_the_composed_definition(estimate, docs):
    x = inputs()
    doc_start = DOCS if docs else None
    torch.testing.assert_close(call(x, estimate, doc_start=doc_start), composed(x, estimate, doc_start), rtol=1e-9,
                               atol=1e-10)


@pytest.mark.parametrize(("estimate", "readout"), [("both", "reference"), ("none", "reference"), ("gram", "linear"),
                                                   ("none", "linear")])
def test_the_other_readouts_equal_the_composed_definition(estimate, readout):
    x = inputs(seed=2)
    torch.testing.assert_close(call(x, estimate, doc_start=DOCS, readout=readout),
                               composed(x, estimate, DOCS, readout=readout), rtol=1e-9, atol=1e-10)


def test_a_linear_readout_has_no_estimate_to_make():
    with pytest.raises(KernelmixError, match="readout='linear' has no kernel to estimate"):
        call(inputs(), "both", readout="linear")
    with pytest.raises(KernelmixError, match="readout must be one of keys, reference, linear"):
        call(inputs(), "both", readout="values")


def test_both_is_cubit_rf_and_none_is_cubit():
    x = inputs()
    rates = {n: x[n] for n in ("rho", "ridge", "ref_scale")}
    rf = cubit_rf_attention_naive(x["q"], x["k"], x["v"], x["r"], x["projection"], transform=x["transform"],
                                  doc_start=DOCS, **rates)
    torch.testing.assert_close(call(x, "both", doc_start=DOCS), rf, rtol=1e-9, atol=1e-10)
    plain = inputs(transform=False)
    exact = cubit_attention_naive(plain["q"], plain["k"], plain["v"], plain["r"], doc_start=DOCS,
                                  **{n: plain[n] for n in ("rho", "ridge", "ref_scale")})
    torch.testing.assert_close(call(plain, "none", doc_start=DOCS), exact, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("estimate", ESTIMATES)
def test_float32_values_and_gradients_match_float64(estimate):
    x = inputs(seed=1)
    leaves = ("q", "k", "v", "r", "rho", "ridge", "ref_scale", "transform")
    grads = {}
    for dtype in (F64, torch.float32):
        y = {n: t.detach().to(dtype).requires_grad_(n in leaves) for n, t in x.items()}
        out = call(y, estimate, doc_start=DOCS)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        grads[dtype] = (out.detach(), {n: y[n].grad for n in leaves})
    assert grads[torch.float32][0].dtype == torch.float32
    assert rel_rmse(grads[torch.float32][0], grads[F64][0]) < 1e-5
    for name in leaves:
        assert rel_rmse(grads[torch.float32][1][name], grads[F64][1][name]) < 1e-4, name


def test_a_non_finite_value_reaches_only_the_rows_that_see_it():
    x = inputs()
    x["v"] = x["v"].clone()
    x["v"][0, 6, 1, 0] = float("nan")  # second document of row 0, kv head 1 → query heads 2, 3
    out = call(x, "gram", doc_start=DOCS)
    bad = out.isnan().any(-1)
    assert bad[0, 6:, 2:].all() and not bad[0, :6].any() and not bad[0, :, :2].any() and not bad[1].any()


def test_bad_estimate_is_named():
    with pytest.raises(KernelmixError, match="estimate must be one of both, gram, readout, none"):
        call(inputs(), "exact")


# ---------------------------------------------------------------------------------------------
# The layer option and the registry's variants


def layer(estimate: str) -> CubitRFMixer:
    torch.manual_seed(0)
    return CubitRFMixer(hidden_size=16, num_heads=2, num_features=8, estimate=estimate)


def test_an_ablation_layer_trains_and_refuses_a_decode_cache():
    x = torch.randn(2, 9, 16)
    mixer = layer("readout")
    out, cache = mixer(x)
    out.square().mean().backward()
    assert out.shape == (2, 9, 16) and mixer.r_proj.weight.grad.abs().sum() > 0
    assert "estimate='readout'" in repr(mixer)
    with pytest.raises(KernelmixError,
                       match="estimate='readout', readout='keys', a dense training ablation with no decode cache"):
        mixer(x[:, :1], cache)
    with pytest.raises(KernelmixError, match="a dense training ablation"):  # nor is its cache read by a decoding layer
        layer("both")(x[:, :1], cache)


def test_exact_ablation_layer_equals_cubit_with_the_same_weights():
    from kernelmix.layers.cubit import CubitMixer

    x = torch.randn(2, 9, 16, dtype=F64)
    exact = layer("none").double()
    torch.manual_seed(1)
    cubit = CubitMixer(hidden_size=16, num_heads=2).double()
    cubit.load_state_dict({n: p for n, p in exact.state_dict().items() if n in cubit.state_dict()})
    torch.testing.assert_close(exact(x)[0], cubit(x)[0], rtol=1e-9, atol=1e-10)


def test_the_ablation_variants_are_trainable_choices_but_not_defaults_or_demo_cases():
    from kernelmix.studies.demo import mixer_cases

    names = {"cubit-rf-exact-readout": "gram", "cubit-rf-exact-gram": "readout", "cubit-rf-exact": "none"}
    for name, estimate in names.items():
        assert registry.variants()[name] == ("cubit-rf", {"cubit-rf": {"estimate": estimate}})
        assert name not in registry.default_variants()
    cases, _ = mixer_cases(1, 5, 2, 4, 4)
    assert ("cubit (no LRR)", "cubit", {"lrr": False}) in cases  # an op-level variant stays
    assert not [options for _, _, options in cases if "estimate" in options]
