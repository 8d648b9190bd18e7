"""The layer registry is the one list of mixers: a mixer registered with its metadata appears in
every command's choices and defaults (compare, recall, bench, demo, generate-bench, gpu-check,
model-info) with no other edit; and the registry reads without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kernelmix.layers import MIXERS, build_mixer, registry

NAME = "throwaway"


@pytest.fixture
def throwaway():
    """A mixer registered for one test (softmax's layer and op under another name, with a variant)."""
    registry.register(registry.MixerInfo(
        NAME, "kernelmix.layers.softmax:SoftmaxMixer", "softmax", constant_cache=False,
        op="kernelmix.ops.calls:softmax", step="kernelmix.ops.calls:softmax_step",
        variants=(registry.Variant(f"{NAME}-biased", {"bias": True}, "with bias"),),
    ))
    try:
        yield NAME
    finally:
        registry.unregister(NAME)


def _choices(command: str, option: str) -> list[str] | None:
    from kernelmix.cli.app import build_parser

    sub = next(a for a in build_parser([command])._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.choices for a in sub.choices[command]._actions if option in a.option_strings)


def test_a_registered_mixer_appears_in_every_command(throwaway):
    from kernelmix.studies import gpu_check
    from kernelmix.studies.bench import BenchConfig
    from kernelmix.studies.compare import MIXER_VARIANTS, CompareConfig
    from kernelmix.studies.demo import mixer_cases
    from kernelmix.studies.generate_bench import GenerateBenchConfig
    from kernelmix.studies.recall import RecallConfig

    assert throwaway in MIXERS and build_mixer(throwaway, hidden_size=8, num_heads=2).hidden_size == 8
    assert MIXER_VARIANTS[f"{throwaway}-biased"] == (throwaway, {throwaway: {"bias": True}})
    for config in (CompareConfig(), RecallConfig()):
        assert {throwaway, f"{throwaway}-biased"} <= set(config.mixers)
    assert CompareConfig(mixers=[f"{throwaway}-biased"]).train_config(f"{throwaway}-biased", 256, 0, "x").model == {
        "mixer": throwaway, "mixer_options": {throwaway: {"bias": True}}, "max_seq_len": 1024}
    assert throwaway in BenchConfig().mixers and throwaway in GenerateBenchConfig(preset="tiny").mixers
    assert {throwaway, f"{throwaway} (with bias)"} <= {label for label, _, _ in mixer_cases(1, 4, 1, 4, 4)[0]}
    assert throwaway in gpu_check.MIXERS and throwaway in gpu_check.LONG_MIXERS
    assert throwaway in _choices("model-info", "--mixer")


def test_an_unregistered_mixer_is_gone_everywhere(throwaway):
    from kernelmix.studies.bench import BenchConfig
    from kernelmix.studies.compare import CompareConfig

    registry.unregister(throwaway)
    assert throwaway not in MIXERS and throwaway not in BenchConfig().mixers
    with pytest.raises(ValueError, match=f"unknown mixer\\(s\\) '{throwaway}'"):
        CompareConfig(mixers=[throwaway])


def test_a_taken_name_or_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.MixerInfo("cubit-nolrr", "x:Y", "solve", constant_cache=False))
    with pytest.raises(ValueError, match="unknown family 'linear'"):
        registry.MixerInfo("new", "x:Y", "linear", constant_cache=True)


def test_the_metadata_says_which_caches_stay_constant():
    constant = {name for name, info in registry.REGISTRY.items() if info.constant_cache}
    assert {"performer", "darkformer", "cubit-rf"} <= constant and not {"softmax", "cubit", "deltaformer"} & constant


def test_the_registry_imports_without_torch_or_pydantic():
    code = ("import sys; import kernelmix.layers.registry as r; assert r.mixer_names(); "
            "print(sorted(m for m in ('torch', 'pydantic') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
