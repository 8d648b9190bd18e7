"""The options a mixer takes are declared once per layer class (``OPTIONS``) and once in its registry
entry (``MixerInfo.options``, plain strings): both equal what its ``__init__`` accepts, and the model
config checks ``mixer_options`` against the registry without importing torch."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernelmix.layers import MIXERS, SHARED_OPTIONS, MixerLayer, build_mixer, mixer_options, registry

ROOT = Path(__file__).resolve().parents[2]


def _keyword_names(init) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(init).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY)


def test_the_shared_options_are_mixer_layer_s_arguments():
    assert SHARED_OPTIONS == _keyword_names(MixerLayer.__init__)


@pytest.mark.parametrize("name", list(MIXERS))
def test_declared_options_are_what_init_accepts(name):
    cls = MIXERS[name]
    own = () if cls.__init__ is MixerLayer.__init__ else _keyword_names(cls.__init__)
    assert cls.OPTIONS == own  # the class's declaration, in __init__'s order
    assert registry.mixer_info(name).options == own  # the registry's copy, read without torch
    assert mixer_options(name) == SHARED_OPTIONS + own
    assert not set(own) & set(SHARED_OPTIONS)


def test_a_registry_entry_that_disagrees_with_its_class_is_refused():
    registry.register(registry.MixerInfo("throwaway-opts", "kernelmix.layers.cubit:CubitMixer", "solve",
                                         constant_cache=False, options=("lrr",)))
    try:
        with pytest.raises(ValueError, match=r"MixerInfo.options equal CubitMixer.OPTIONS"):
            build_mixer("throwaway-opts", hidden_size=16, num_heads=2)
    finally:
        registry.unregister("throwaway-opts")


PROBE = textwrap.dedent("""
    import sys
    from kernelmix.model_config import ModelConfig
    try:
        ModelConfig(mixer="cubit", mixer_options={"cubit": {"lrrr": False}})
    except ValueError as err:
        print(err)
    from kernelmix.cli import main
    try:
        main(["train", "--set", "model.mixer=performer", "--set", "model.mixer_options.performer.num_feature=8"])
    except SystemExit as stop:
        print("exit", stop.code)
    print("torch imported:", "torch" in sys.modules)
""")


def test_an_unknown_mixer_option_is_refused_without_torch():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mixer_options['cubit'] has unknown option(s) ['lrrr']; accepted: bias, lrr, lrr_range" in done.stdout
    assert "exit 2" in done.stdout and "mixer_options['performer'] has unknown option(s) ['num_feature']" in done.stderr
    assert "accepted: bias, num_features, projection" in done.stderr
    assert "torch imported: False" in done.stdout
