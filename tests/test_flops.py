"""kernelmix.studies.flops against brute-force counts of torch.utils.flop_counter.FlopCounterMode,
which counts the FLOPs of the matrix products (mm, bmm, addmm, baddbmm — einsum and linear run
as these) that an actual forward executes, 2 per multiply-add.

What FlopCounterMode does not see (torch 2.13, CPU): the CPU attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` is not in its registry, so softmax's op and
the read-outs and solve rectangles of Cubit and DeltaFormer count 0 in a model's forward; the GPU
attention kernels it knows it counts densely, ignoring ``is_causal``), ``solve_triangular``, and
every elementwise op (norms, RoPE, softmax, exp). So:

* the products around the mixers (q/k/v/o, Cubit's r and ρ, DeltaFormer's β, the MLP, the LM
  head) are checked exactly in a real model's forward, for every mixer;
* the random-feature ops are nothing but products: the whole op, and a whole Performer/DARKFormer
  model, are checked exactly (up to float rounding of the per-token division); so is Cubit-RF's op
  and model once its per-chunk triangular solves, which FlopCounterMode does not see, are added;
* the T² ops are checked exactly against a float64 per-row loop of their definition — only the
  causal pairs, as the analytic count takes them — that gives the fast op's output;
* training = 3 × forward: exactly so for the linear layers' forward + backward.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernelmix import ops
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.studies import bench
from kernelmix.studies.flops import TRAINING_FACTOR, forward_flops, layer_flops, model_flops, training_flops_per_token

MIXERS = ("softmax", "cubit", "deltaformer", "performer", "darkformer", "cubit-rf")


def counted(fn) -> tuple[object, dict[str, int]]:
    """``fn()``'s value and the FLOPs FlopCounterMode saw, per module path (and "Global")."""
    with FlopCounterMode(display=False, depth=None) as counter:
        value = fn()
    return value, {name: sum(ops_.values()) for name, ops_ in counter.get_flop_counts().items()}


# ---------------------------------------------------------------------------------------------
# The T² ops: a per-row loop over the causal pairs, float64


def softmax_loop(q, k, v):
    """o_i = Σ_{j≤i} softmax_j(q_i·k_j/√d) v_j, one query row at a time ([T, d] tensors)."""
    scale = q.shape[-1] ** -0.5
    rows = [torch.softmax(q[i:i + 1] @ k[:i + 1].T * scale, dim=-1) @ v[:i + 1] for i in range(q.shape[0])]
    return torch.cat(rows)


def cubit_loop(q, k, v, r, ridge):
    """U by forward substitution over the causal softmax Gram of r and r̂ = r/‖r‖, then softmax read-out."""
    r_hat = r / r.norm(dim=-1, keepdim=True)
    u = torch.zeros_like(v)
    for i in range(q.shape[0]):
        gram = torch.softmax(r[i:i + 1] @ r_hat[:i + 1].T, dim=-1)  # j ≤ i
        u[i] = ((v[i:i + 1] - gram[:, :i] @ u[:i]) / (gram[0, i] + ridge))[0]  # j < i
    return softmax_loop(q, k, u)


def deltaformer_loop(q, k, v, beta):
    """u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(k_i·k_j/√d) u_j (the K–K form), then softmax read-out."""
    scale = q.shape[-1] ** -0.5
    u = v.clone()
    for i in range(1, q.shape[0]):
        weights = torch.softmax(k[i:i + 1] @ k[:i].T * scale, dim=-1)
        u[i] = (v[i:i + 1] - beta[i] * (weights @ u[:i]))[0]
    return softmax_loop(q, k, u)


def one_head(length: int, d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = ("q", "k", "v", "r")
    return {n: torch.randn(length, d, generator=g, dtype=torch.float64) for n in names} | {
        "beta": torch.rand(length, generator=g, dtype=torch.float64)}


def as_bthd(x: torch.Tensor) -> torch.Tensor:
    return x[None, :, None]


class TestT2OpsCountTheCausalPairs:
    """Softmax, Cubit and DeltaFormer: the count is that of a float64 per-row loop over the causal pairs."""

    @pytest.mark.parametrize("length", [1, 2, 7, 12])
    def test_softmax_count_is_the_causal_loop_count(self, length):
        x = one_head(length, 4)
        out, seen = counted(lambda: softmax_loop(x["q"], x["k"], x["v"]))
        assert seen["Global"] == forward_flops("softmax", length, 4, 0, 4)
        torch.testing.assert_close(as_bthd(out), ops.softmax_attention(*(as_bthd(x[n]) for n in "qkv")))

    @pytest.mark.parametrize("length", [1, 2, 7, 12])
    def test_cubit_count_is_the_causal_loop_count(self, length):
        x, ridge = one_head(length, 4), 0.5
        out, seen = counted(lambda: cubit_loop(x["q"], x["k"], x["v"], x["r"], ridge))
        assert seen["Global"] == forward_flops("cubit", length, 4, 0, 4)
        fast = ops.cubit_attention(*(as_bthd(x[n]) for n in "qkvr"), ridge=ridge, chunk_size=4)
        torch.testing.assert_close(as_bthd(out), fast)

    @pytest.mark.parametrize("length", [1, 2, 7, 12])
    def test_deltaformer_count_is_the_causal_loop_count(self, length):
        x = one_head(length, 4)
        out, seen = counted(lambda: deltaformer_loop(x["q"], x["k"], x["v"], x["beta"]))
        assert seen["Global"] == forward_flops("deltaformer", length, 4, 0, 4)
        fast = ops.deltaformer_attention(*(as_bthd(x[n]) for n in "qkv"), beta=x["beta"][None, :, None], chunk_size=4)
        torch.testing.assert_close(as_bthd(out), fast)


# ---------------------------------------------------------------------------------------------
# The random-feature ops: all products, counted as they run


class TestRandomFeatureOpsAreCountedAsTheyRun:
    @pytest.mark.parametrize("mixer", ["performer", "darkformer"])
    @pytest.mark.parametrize("length, chunk", [(5, 16), (16, 16), (37, 16), (40, 8)])  # within one chunk, whole, padded
    def test_random_feature_op_counts_are_exact(self, mixer, length, chunk):
        batch, heads, kv_heads, d, m = 2, 4, 2, 8, 12
        g = torch.Generator().manual_seed(1)
        q = torch.randn(batch, length, heads, d, generator=g)
        k, v = (torch.randn(batch, length, kv_heads, d, generator=g) for _ in range(2))
        projection = ops.orthogonal_random_features(m, d, num_heads=heads, generator=g)
        transform = torch.eye(d) + 0.1 * torch.randn(heads, d, d, generator=g) if mixer == "darkformer" else None
        _, seen = counted(lambda: ops.random_feature_attention(q, k, v, projection, transform=transform,
                                                               chunk_size=chunk))
        assert seen["Global"] == forward_flops(mixer, length, d, m, chunk) * batch * heads  # per query head

    @pytest.mark.parametrize("length, chunk", [(5, 16), (16, 16), (37, 16), (40, 8)])
    @pytest.mark.parametrize("data_aware", [False, True], ids=["plain", "transform"])
    def test_cubit_rf_op_counts_are_its_products_and_its_triangular_solves(self, length, chunk, data_aware):
        batch, heads, kv_heads, d, m = 2, 4, 2, 8, 12
        g = torch.Generator().manual_seed(1)
        q, r = (torch.randn(batch, length, heads, d, generator=g) for _ in range(2))
        k, v = (torch.randn(batch, length, kv_heads, d, generator=g) for _ in range(2))
        rho = 0.5 + torch.rand(batch, length, heads, generator=g)
        projection = ops.orthogonal_random_features(m, d, num_heads=heads, generator=g)
        transform = torch.eye(d) + 0.1 * torch.randn(heads, d, d, generator=g) if data_aware else None
        with torch.no_grad():  # (with gradients the solve runs under checkpoint: the same products once)
            _, seen = counted(lambda: ops.cubit_rf_attention(q, k, v, r, projection, rho=rho, transform=transform,
                                                             chunk_size=chunk))
        c = min(chunk, length)
        solves = math.ceil(length / c) * c * (c - 1) * (d + m)  # per chunk: C(C-1)/2 pairs × (d + m) columns × 2
        expected = forward_flops("cubit-rf", length, d, m, chunk) + (8 * length * d * d if data_aware else 0)
        assert seen["Global"] + solves * batch * heads == expected * batch * heads
        # linear in T at whole chunks: per token the same at every multiple of the chunk
        per_token = [forward_flops("cubit-rf", t, d, m, 16) / t for t in (16, 64, 256)]
        assert all(math.isclose(p, per_token[0], rel_tol=1e-12) for p in per_token)


# ---------------------------------------------------------------------------------------------
# A real model's forward


MODELS = [
    ("softmax", {}),
    ("cubit", {}),
    ("cubit", {"cubit": {"lrr": False}}),  # cubit-nolrr: no ρ gate
    ("cubit", {"cubit": {"reference": "key"}}),  # no r projection
    ("deltaformer", {}),
    ("performer", {"performer": {"num_features": 24}}),
    ("darkformer", {}),
    ("cubit-rf", {}),
]


def tiny(mixer: str, options: dict, **overrides) -> ModelConfig:
    # the tiny preset has grouped-query attention (4 query, 2 key/value heads)
    return ModelConfig.preset("tiny", mixer=mixer, mixer_options=options, max_seq_len=64, **overrides)


class TestARealModelsForward:
    @pytest.mark.parametrize("mixer, options", MODELS)
    def test_the_products_around_the_mixer_are_counted_exactly(self, mixer, options):
        config = tiny(mixer, options)
        length, batch = 21, 2
        torch.manual_seed(0)
        model = CausalLM(config)
        _, seen = counted(lambda: model(torch.randint(0, config.vocab_size, (batch, length)), use_cache=False))
        tokens, per_layer = batch * length, layer_flops(config, mixer, length)
        assert seen["CausalLM.lm_head"] == model_flops(config, length).lm_head * tokens
        own_products = ("r_proj", "rho_proj", "beta_proj")
        for i in range(config.num_layers):
            layer = f"CausalLM.blocks.{i}"
            assert seen[f"{layer}.mlp"] == per_layer["mlp"] * tokens
            projections = sum(seen[f"{layer}.mixer.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            assert projections == per_layer["projections"] * tokens
            own = sum(seen.get(f"{layer}.mixer.{p}", 0) for p in own_products)
            if mixer in ("performer", "darkformer"):  # the whole mixer is products: its op (and the fold) too
                assert seen[f"{layer}.mixer"] - projections == pytest.approx(
                    (per_layer["mixer_layer"] + per_layer["mixer_op"]) * tokens, rel=1e-12)
            else:
                assert own == per_layer["mixer_layer"] * tokens
        if mixer in ("performer", "darkformer"):
            assert seen["Global"] == pytest.approx(model_flops(config, length).forward * tokens, rel=1e-12)

    @pytest.mark.parametrize("options", [{}, {"data_aware": True, "num_features": 24, "reference": "key"}],
                             ids=["default", "data-aware-key"])
    def test_cubit_rf_whole_mixer_is_counted_but_its_triangular_solves(self, options):
        config = tiny("cubit-rf", {"cubit-rf": options})
        length, batch = 21, 2
        torch.manual_seed(0)
        model = CausalLM(config)
        with torch.no_grad():
            _, seen = counted(lambda: model(torch.randint(0, config.vocab_size, (batch, length)), use_cache=False))
        tokens, per_layer = batch * length, layer_flops(config, "cubit-rf", length)
        c, d, m = min(config.chunk_size, length), config.head_dim, options.get("num_features", 64)
        solves = math.ceil(length / c) * c * (c - 1) * (d + m) * config.num_heads * batch  # not seen
        for i in range(config.num_layers):
            layer = f"CausalLM.blocks.{i}"
            projections = sum(seen[f"{layer}.mixer.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            assert projections == per_layer["projections"] * tokens
            assert seen[f"{layer}.mixer"] - projections + solves == pytest.approx(
                (per_layer["mixer_layer"] + per_layer["mixer_op"]) * tokens, rel=1e-12)

    def test_training_is_three_forwards_for_the_linear_layers(self):
        # in a softmax model FlopCounterMode sees only the linear layers (not the CPU attention
        # kernel), so its whole count is theirs; it splits a backward between modules unreliably
        config, length, batch = tiny("softmax", {}), 16, 2
        torch.manual_seed(0)
        model = CausalLM(config)
        ids = torch.randint(0, config.vocab_size, (batch, length))
        _, forward = counted(lambda: model(ids, use_cache=False))
        _, both = counted(lambda: model(ids, labels=ids, use_cache=False).loss.backward())
        count = model_flops(config, length)
        assert forward["Global"] == (count.forward - count.mixer_op) * batch * length
        assert both["Global"] == TRAINING_FACTOR * forward["Global"]


# ---------------------------------------------------------------------------------------------
# The whole count


class TestTheModelCount:
    @pytest.mark.parametrize("mixer, options", MODELS)
    def test_the_model_count_is_the_sum_of_its_parts(self, mixer, options):
        config, length = tiny(mixer, options), 48
        count = model_flops(config, length)
        per_layer = layer_flops(config, mixer, length)
        assert count.embedding == 0 and count.lm_head == 2 * config.hidden_size * config.vocab_size
        for part in ("projections", "mixer_layer", "mixer_op", "mlp"):
            assert getattr(count, part) == config.num_layers * per_layer[part]
        parts = count.projections + count.mixer_layer + count.mixer_op + count.mlp + count.lm_head
        assert count.forward == parts and count.training == 3 * parts == training_flops_per_token(config, length)
        features = options.get(mixer, {}).get("num_features", 64)  # the layers' default m
        op = forward_flops(mixer, length, config.head_dim, features, config.chunk_size)
        assert count.mixer_op == pytest.approx(config.num_layers * config.num_heads * op / length, rel=1e-12)
        assert count.to_dict()["training"] == count.training

    def test_a_hybrid_counts_each_layer_with_its_own_mixer(self):
        config = tiny("softmax", {}, num_layers=3, mixers=["softmax", "cubit", "performer"])
        count = model_flops(config, 32)
        parts = [layer_flops(config, m, 32) for m in ("softmax", "cubit", "performer")]
        assert count.mixer_op == sum(p["mixer_op"] for p in parts)
        assert count.forward == sum(sum(p.values()) for p in parts) + count.lm_head

    @pytest.mark.parametrize("mixer", ["softmax", "cubit", "deltaformer"])
    def test_the_t2_mixers_cost_more_per_token_at_every_longer_length(self, mixer):
        config = tiny(mixer, {})
        per_token = [model_flops(config, t).training for t in range(1, 65)]
        assert all(a < b for a, b in zip(per_token, per_token[1:]))
        ops_per_sequence = [forward_flops(mixer, t, 16, 0, 16) for t in range(1, 65)]
        # the op grows like T²: per sequence, doubling T more than triples it
        assert all(ops_per_sequence[2 * t - 1] > 3 * ops_per_sequence[t - 1] for t in range(2, 33))

    def test_the_random_feature_mixers_cost_the_same_per_token_at_every_length_of_whole_chunks(self):
        config = tiny("performer", {})
        per_token = [model_flops(config, t).training for t in (64, 128, 256, 1024)]
        assert all(math.isclose(p, per_token[0], rel_tol=1e-12) for p in per_token)

    def test_bench_reports_the_same_counts(self):
        assert bench.forward_flops is forward_flops

    def test_bad_arguments_name_the_fix(self):
        with pytest.raises(ValueError, match=r"unknown mixer 'softmx' \(choose from: softmax, cubit"):
            forward_flops("softmx", 8, 4, 4, 4)
        with pytest.raises(ValueError, match="length must be a positive int"):
            model_flops(tiny("softmax", {}), 0)
        with pytest.raises(ValueError, match="config must be a ModelConfig"):
            model_flops({"mixer": "softmax"}, 8)



