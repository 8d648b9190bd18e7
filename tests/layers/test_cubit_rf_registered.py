"""Cubit-RF as a registered mixer (``model.mixer=cubit-rf``): its registry entry and where it is
listed, its op-level calls against the op, a few training steps through the library's training
entry, an HF round trip of the trained model, cached generation against uncached and a decode cache
that does not grow, and the commands' options accepting it (parsed only, nothing run).

The layer contract tests (tests/layers: decode, init, errors; tests/test_model.py, test_generate.py,
test_hf.py, test_flops.py) take it from the registry or name it in their cases; the layer itself is
tested in test_cubit_rf.py and the op in tests/ops/test_cubit_rf.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kernelmix import ops
from kernelmix.generate import generate
from kernelmix.layers import MIXERS, registry
from kernelmix.layers.cubit_rf import CubitRFMixer
from kernelmix.model import CausalLM, ModelCache, ModelConfig
from kernelmix.ops import calls
from tests.utils import isolated_data_cache

NAME = "cubit-rf"
ROOT = Path(__file__).resolve().parents[2]
CORPUS = str(ROOT / "tests" / "fixtures" / "train_corpus")

data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


# ---------------------------------------------------------------------------------------------
# The registry entry and where it is listed


def test_the_entry_names_the_layer_the_calls_and_the_metadata_the_layer_carries():
    info = registry.mixer_info(NAME)
    assert MIXERS[NAME] is CubitRFMixer and registry.layer_class(NAME) is CubitRFMixer
    assert registry.op_call(NAME) is calls.cubit_rf and registry.step_call(NAME) is calls.cubit_rf_step
    assert info.family == CubitRFMixer.family == "random-features" and info.family in registry.FAMILIES
    assert info.constant_cache is CubitRFMixer.constant_cache is True
    assert info.leaves == ("q", "k", "v", "r", "rho") and info.in_defaults is True
    # its variants are the dense ablation (ops/cubit_rf_parts), which the op-level call does not take and
    # the trained studies do not run by default (O(T²·m), no decode)
    assert {v.name for v in info.variants} == {"cubit-rf-exact-readout", "cubit-rf-exact-gram", "cubit-rf-exact"}
    assert not any(v.op_level or v.in_defaults for v in info.variants)


def test_a_choice_everywhere_and_in_the_trained_studies_defaults():
    """Issue 27: Cubit-RF is one of compare's (the README's main job) and recall's default mixers."""
    from kernelmix.studies import gpu_check
    from kernelmix.studies.bench import BenchConfig
    from kernelmix.studies.compare import DEFAULT_MIXERS, MIXER_VARIANTS, CompareConfig
    from kernelmix.studies.demo import mixer_cases
    from kernelmix.studies.generate_bench import GenerateBenchConfig
    from kernelmix.studies.recall import RecallConfig

    assert MIXER_VARIANTS[NAME] == (NAME, {}) and NAME in DEFAULT_MIXERS
    assert NAME in CompareConfig().mixers and NAME in RecallConfig().mixers
    assert not {"cubit-rf-exact-readout", "cubit-rf-exact-gram", "cubit-rf-exact"} & set(DEFAULT_MIXERS)
    assert CompareConfig(mixers=["softmax", NAME]).mixers == ["softmax", NAME]
    assert RecallConfig(mixers=[NAME]).model_config(NAME, 64, 64).mixer == NAME
    # the measuring commands list every mixer with an op call
    assert NAME in BenchConfig().mixers and NAME in GenerateBenchConfig(preset="tiny").mixers
    assert NAME in {mixer for _, mixer, _ in mixer_cases(1, 4, 1, 4, 4)[0]}
    assert NAME in gpu_check.MIXERS and NAME in gpu_check.family("random-features")
    assert NAME not in gpu_check.LONG_MIXERS  # the long length is for the T² families


def test_an_excluded_mixer_leaves_the_defaults_and_its_variants_with_it():
    registry.register(registry.MixerInfo(
        "throwaway-x", "kernelmix.layers.softmax:SoftmaxMixer", "softmax", constant_cache=False,
        variants=(registry.Variant("throwaway-x-biased", {"bias": True}, "with bias"),), in_defaults=False))
    try:
        assert {"throwaway-x", "throwaway-x-biased"} <= set(registry.variants())
        assert not {"throwaway-x", "throwaway-x-biased"} & set(registry.default_variants())
    finally:
        registry.unregister("throwaway-x")


@pytest.mark.parametrize("folder", ["compare", "recall"])
def test_the_committed_results_are_of_the_default_mixers(folder):
    """What guards results/compare and results/recall (and the README's main job) against a mixer
    joining the defaults silently: their committed settings list exactly the default mixers."""
    from kernelmix.studies.compare import CompareConfig
    from kernelmix.studies.recall import RecallConfig

    committed = json.loads((ROOT / "results" / folder / "results.json").read_text())["settings"]["mixers"]
    defaults = (CompareConfig() if folder == "compare" else RecallConfig()).mixers
    assert committed == defaults and NAME in committed


# ---------------------------------------------------------------------------------------------
# The op-level calls (kernelmix.ops.calls) are the op


def _inputs(length: int, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(3)
    b, h, d, m = 2, 3, 8, 12

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {"q": rnd(b, length, h, d), "k": rnd(b, length, h, d), "v": rnd(b, length, h, d), "r": rnd(b, length, h, d),
            "rho": 0.5 + 1.5 * torch.rand(b, length, h, generator=g).to(dtype),
            "beta": torch.rand(b, length, h, generator=g).to(dtype),
            "projection": ops.orthogonal_random_features(m, d, num_heads=h, generator=g),
            "transform": torch.eye(d) + 0.05 * torch.randn(h, d, d, generator=g)}


def test_the_op_call_is_cubit_rf_attention():
    x = _inputs(11)
    args = (x["q"], x["k"], x["v"], x["r"], x["projection"])
    assert torch.equal(calls.cubit_rf(x), ops.cubit_rf_attention(*args, rho=x["rho"]))
    assert torch.equal(calls.cubit_rf(x, chunk_size=4, backend="torch"),
                       ops.cubit_rf_attention(*args, rho=x["rho"], chunk_size=4, backend="torch"))
    x64 = {key: value.double() for key, value in x.items()}
    args64 = (x64["q"], x64["k"], x64["v"], x64["r"], x64["projection"])
    assert torch.equal(calls.cubit_rf(x64, reference=True), ops.cubit_rf_attention_naive(*args64, rho=x64["rho"]))
    # the fast path is within the float64 reference
    assert (calls.cubit_rf(x64) - calls.cubit_rf(x64, reference=True)).abs().max() < 1e-10


def test_the_step_call_continues_the_op_calls_state():
    x = _inputs(9)
    prefix = {key: (value[:, :8] if value.dim() == 4 or key in ("rho", "beta") else value) for key, value in x.items()}
    last = {key: (value[:, 8:9] if value.dim() == 4 or key in ("rho", "beta") else value) for key, value in x.items()}
    _, state = calls.cubit_rf(prefix, chunk_size=3, return_state=True)
    assert isinstance(state, ops.CubitRFState) and state.length == 8
    out, after = calls.cubit_rf_step(last, state)
    direct, _ = ops.cubit_rf_attention_step(last["q"], last["k"], last["v"], last["r"], last["projection"], state,
                                            rho=last["rho"])
    assert torch.equal(out, direct) and after.length == 9
    full = calls.cubit_rf(x)
    torch.testing.assert_close(out, full[:, 8:9], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Training, HF save/load and generation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three steps of ``kernelmix train --set model.mixer=cubit-rf`` on the tiny corpus (the library's
    entry: the config the overrides build, then :func:`kernelmix.training.train`)."""
    from kernelmix.training import train
    from kernelmix.training.config import build_config

    out = tmp_path_factory.mktemp("cubit-rf-train")
    config = build_config(None, [
        "model.mixer=cubit-rf", "model.mixer_options.cubit-rf.num_features=16", "preset=tiny", f"corpus={CORPUS}",
        "seq_len=32", "batch_size=2", "steps=3", "warmup_steps=1", "eval_every=0", "checkpoint_every=3",
        "device=cpu", f"out_dir={out}",
    ])
    assert config.model_config().mixer == NAME
    result = train(config, progress=False)
    return config, result


def _load_trained(config, result) -> CausalLM:
    from kernelmix.training.runs import load_run

    return load_run(result.out_dir).model.eval()


def test_a_few_training_steps_run_finite(trained):
    _, result = trained
    assert result.final_step == 3 and not result.skipped_steps
    assert len(result.losses) >= 1 and all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert result.checkpoint is not None


def test_the_hf_round_trip_of_the_trained_model_gives_the_same_logits(trained, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from kernelmix.hf import KernelMixForCausalLM

    model = _load_trained(*trained)
    assert isinstance(model.blocks[0].mixer, CubitRFMixer)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    KernelMixForCausalLM.from_model(model).save_pretrained(tmp_path)
    torch.manual_seed(99)  # nothing (the projections W) may be redrawn on load
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
    assert torch.equal(loaded.model.blocks[0].mixer.projection, model.blocks[0].mixer.projection)


def _cache_bytes(cache: ModelCache) -> int:
    """Bytes of every tensor the cache's layer states hold (nested dataclasses included)."""
    def walk(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if dataclasses.is_dataclass(value):
            return sum(walk(getattr(value, f.name)) for f in dataclasses.fields(value))
        return 0

    return sum(walk(layer.state) for layer in cache.layers)


def test_cached_generation_equals_uncached_greedy(trained):
    model = _load_trained(*trained).double()
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, 16, temperature=0.0)
    uncached = generate(model, prompt, 16, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 23) and torch.equal(cached, uncached)


def test_the_decode_cache_is_a_cubit_rf_state_that_does_not_grow(trained):
    model = _load_trained(*trained)
    with torch.no_grad():
        out = model(torch.zeros(1, 5, dtype=torch.long))
        assert all(isinstance(layer.state, ops.CubitRFState) for layer in out.cache.layers)
        sizes = [_cache_bytes(out.cache)]
        for _ in range(40):
            out = model(torch.zeros(1, 1, dtype=torch.long), cache=out.cache)
            sizes.append(_cache_bytes(out.cache))
    assert out.cache.length == 45 and len(set(sizes)) == 1 and sizes[0] > 0


# ---------------------------------------------------------------------------------------------
# The commands' options (parsed and checked, nothing run)


def _parsed(command: str, argv: list[str]) -> argparse.Namespace:
    from kernelmix.cli.app import build_parser

    return build_parser([command]).parse_args([command, *argv])


@pytest.mark.parametrize("command, config", [
    ("bench", "kernelmix.studies.settings:BenchConfig"),
    ("recall", "kernelmix.studies.settings:RecallConfig"),
    ("compare", "kernelmix.studies.compare.settings:CompareConfig"),
    ("generate-bench", "kernelmix.studies.settings:GenerateBenchConfig"),
])
def test_the_commands_take_cubit_rf(command, config):
    from kernelmix.cli.options import from_args

    args = _parsed(command, ["--mixers", f"softmax,{NAME}"])
    assert from_args(registry.load(config), args).mixers == ["softmax", NAME]


def test_model_info_and_train_take_cubit_rf():
    from kernelmix.training.config import build_config

    assert _parsed("model-info", ["tiny", "--mixer", NAME]).mixer == NAME
    config = build_config(None, [f"model.mixer={NAME}", f"model.mixer_options.{NAME}.data_aware=true"])
    assert config.model_config().mixer == NAME and config.model_config().mixer_options == {NAME: {"data_aware": True}}
    assert ModelConfig.preset("tiny", mixers=[NAME, "softmax"]).layer_mixers() == [NAME, "softmax"]


def test_a_mistyped_name_lists_cubit_rf(capsys):
    from kernelmix.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["bench", "--mixers", "cubit-rff"])
    assert "cubit-rf" in capsys.readouterr().err
