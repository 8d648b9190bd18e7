"""Hugging Face adapter (kernelmix.hf): config conversion, registration with the Auto classes,
bitwise save/load round trips through safetensors (random projections and DARKFormer's fold and
transform included), HF ``generate`` against kernelmix's own greedy decoding, left-padded batches,
and clear errors for broken checkpoints. Tiny models only."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from kernelmix.generate import generate as kernelmix_generate  # noqa: E402
from kernelmix.hf import KernelMixConfig, KernelMixForCausalLM  # noqa: E402
from kernelmix.layers import RandomFeatureMap  # noqa: E402
from kernelmix.model import CausalLM, ModelCache, ModelConfig  # noqa: E402

MIXERS = ["softmax", "cubit", "deltaformer", "performer", "darkformer", "cubit-rf"]
CONFIGS = {name: dict(mixer=name) for name in MIXERS}
CONFIGS["cubit-rf-data-aware"] = dict(mixer="cubit-rf", mixer_options={"cubit-rf": {"data_aware": True}})
CONFIGS["hybrid"] = dict(mixers=["softmax", "cubit"])
CONFIGS["untied"] = dict(mixers=["performer", "softmax"], tie_embeddings=False)


def tiny_model(seed: int = 0, **overrides) -> KernelMixForCausalLM:
    torch.manual_seed(seed)
    config = KernelMixConfig.from_model_config(ModelConfig.preset("tiny", **overrides))
    return KernelMixForCausalLM(config).eval()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Config


def test_config_holds_every_model_config_field_with_the_same_defaults():
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert model_fields <= {f.name for f in dataclasses.fields(KernelMixConfig)}
    assert KernelMixConfig().to_model_config() == ModelConfig()
    assert KernelMixConfig.model_type == "kernelmix"


def test_config_fields_come_from_model_config():
    # derived, not re-listed: same names, types and defaults, fresh mutable defaults per instance
    import typing

    ours = {f.name: f for f in dataclasses.fields(KernelMixConfig)}
    for f in dataclasses.fields(ModelConfig):
        assert ours[f.name].type == typing.get_type_hints(ModelConfig)[f.name], f.name
    a, b = KernelMixConfig(), KernelMixConfig()
    a.mixer_options["cubit"] = {"lrr": False}
    assert b.mixer_options == {} and ModelConfig().mixer_options == {}


def test_config_converts_both_ways_and_through_json(tmp_path):
    cfg = ModelConfig.preset("tiny", mixers=["softmax", "performer"], mixer_options={"performer": {"num_features": 24}})
    hf_config = KernelMixConfig.from_model_config(cfg, eos_token_id=3)
    assert hf_config.to_model_config() == cfg
    # transformers' standard names read our fields
    assert (hf_config.num_hidden_layers, hf_config.num_attention_heads, hf_config.num_key_value_heads) == (2, 4, 2)
    assert hf_config.max_position_embeddings == cfg.max_seq_len and hf_config.tie_word_embeddings is True
    hf_config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KernelMixConfig)
    assert loaded.to_model_config() == cfg and loaded.eos_token_id == 3
    # the copy is independent
    loaded.to_model_config().mixers.append("cubit")
    assert loaded.mixers == ["softmax", "performer"]


def test_config_validates_with_model_config_messages():
    with pytest.raises(ValueError, match="unknown mixer 'cubt'"):
        KernelMixConfig(mixer="cubt")
    with pytest.raises(ValueError, match="mixers lists 1 names but num_layers is 4"):
        KernelMixConfig(mixers=["softmax"])
    with pytest.raises(ValueError, match="must be a kernelmix ModelConfig"):
        KernelMixConfig.from_model_config({"mixer": "cubit"})
    with pytest.raises(ValueError, match="must be a KernelMixConfig"):
        KernelMixForCausalLM(ModelConfig())


# ---------------------------------------------------------------------------------------------
# Forward


def test_forward_is_the_causal_lm():
    model = tiny_model(mixer="cubit")
    ids = prompt(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    ref = model.model(ids, attention_mask=mask, labels=ids)
    assert isinstance(out, CausalLMOutputWithPast) and isinstance(out.cache, ModelCache)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    step = model(ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1), cache=out.cache)
    assert step.logits.shape == (2, 1, 256) and step.cache.length == 11
    loss, logits = model(ids, labels=ids, use_cache=False, return_dict=False)
    plain = model.model(ids, labels=ids, use_cache=False)
    assert torch.equal(logits, plain.logits) and torch.equal(loss, plain.loss)
    model.train()
    assert model(ids).cache is None  # training: no cache unless asked for


def test_from_model_wraps_an_existing_causal_lm(tmp_path):
    torch.manual_seed(0)
    lm = CausalLM(ModelConfig.preset("tiny", mixer="deltaformer"))
    state = torch.get_rng_state()
    wrapper = KernelMixForCausalLM.from_model(lm)
    assert wrapper.model is lm and torch.equal(torch.get_rng_state(), state)
    assert wrapper.device.type == "cpu" and wrapper.model.lm_head.weight is lm.embed.weight
    wrapper.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = prompt(1, 9)
    assert torch.equal(loaded(ids).logits, lm(ids).logits)


# ---------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained


def _perturb_buffers(model: KernelMixForCausalLM) -> None:
    """Redraw every random projection and whiten the data-aware maps (DARKFormer, Cubit-RF with
    data_aware), so that a reloaded model only matches if these tensors travelled with the weights
    (a fresh construction would draw others)."""
    x = torch.randn(2, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    for i, block in enumerate(model.model.blocks):
        mixer = block.mixer
        if isinstance(mixer, RandomFeatureMap):
            before = mixer.projection.clone()
            mixer.redraw_(torch.Generator().manual_seed(100 + i))
            assert not torch.equal(before, mixer.projection)
        if isinstance(mixer, RandomFeatureMap) and mixer.data_aware:
            q, k = mixer.qk_samples(x)
            mixer.whiten_(q, k)
            eye = torch.eye(mixer.head_dim).expand_as(mixer.query_fold)
            assert not torch.allclose(mixer.query_fold, eye) and not torch.allclose(mixer.transform, eye)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_bitwise(tmp_path, name):
    model = tiny_model(**CONFIGS[name])
    _perturb_buffers(model)
    ids = prompt(2, 20)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))

    torch.manual_seed(123)  # a different RNG state: nothing may be re-drawn on load
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is KernelMixForCausalLM and not loaded.training
    assert loaded.config.to_model_config() == model.config.to_model_config()
    saved, restored = model.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys()
    for key in saved:
        assert torch.equal(saved[key], restored[key]), key
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    lm = model.model
    has_features = any(isinstance(b.mixer, RandomFeatureMap) for b in lm.blocks)
    assert any(k.endswith(".projection") for k in keys) == has_features
    if any(isinstance(b.mixer, RandomFeatureMap) and b.mixer.data_aware for b in lm.blocks):
        assert any(k.endswith(".query_fold") for k in keys) and any(k.endswith(".transform") for k in keys)
    tied = model.config.tie_embeddings
    assert ("model.lm_head.weight" in keys) is not tied  # a tied head is stored once
    assert (loaded.model.lm_head.weight is loaded.model.embed.weight) is tied


# ---------------------------------------------------------------------------------------------
# generate


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_greedy_equals_kernelmix_greedy(name):
    model = tiny_model(**CONFIGS[name])
    _perturb_buffers(model)
    ids = prompt(2, 7)
    lengths = []
    hook = model.model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    try:
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    finally:
        hook.remove()
    assert out.shape == (2, 15) and torch.equal(out[:, :7], ids)
    assert lengths == [7] + [1] * 7  # prefill once, then only the new token against the cache
    assert torch.equal(out, kernelmix_generate(model.model, ids, 8, temperature=0.0))
    # without the cache HF reruns the whole sequence: same tokens
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False), out)


@pytest.mark.parametrize("name", MIXERS)
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = tiny_model(**CONFIGS[name])
    prompts = [prompt(1, n, seed=n)[0] for n in (3, 9, 6)]
    width, new = max(len(p) for p in prompts), 6
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert batch.shape == (3, width + new)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=new, do_sample=False)
        assert torch.equal(batch[row, width:], alone[0, len(p) :]), row
    assert torch.equal(batch, kernelmix_generate(model.model, ids, new, temperature=0.0, attention_mask=mask))


def test_generation_may_reach_max_seq_len_exactly_and_padding_does_not_count():
    model = tiny_model(mixer="performer", max_seq_len=32)
    ids = prompt(1, 6)
    assert model.generate(ids, max_new_tokens=26, do_sample=False).shape == (1, 32)
    with pytest.raises(ValueError, match="6 tokens plus 27 new tokens is 33 positions"):
        model.generate(ids, max_new_tokens=27, do_sample=False)
    # 6 pads + 4 real tokens: 4 + 28 positions fit although the tensor grows to 38
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids[:, :4]], dim=1)
    mask = torch.tensor([[0] * 6 + [1] * 4])
    out = model.generate(padded, attention_mask=mask, max_new_tokens=28, do_sample=False, pad_token_id=0)
    alone = model.generate(ids[:, :4], max_new_tokens=28, do_sample=False)
    assert out.shape == (1, 38) and torch.equal(out[:, 10:], alone[:, 4:])


def test_sampling_and_unsupported_modes():
    model = tiny_model(mixer="performer")
    ids = prompt(2, 5)
    torch.manual_seed(0)
    first = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(0)
    again = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.8)
    assert first.shape == (2, 11) and torch.equal(first, again) and int(first.max()) < 256
    with pytest.raises(ValueError, match="only supports"):
        model.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False)
    with pytest.raises(ValueError, match="does not take a cache"):
        model.generate(ids, max_new_tokens=2, cache=model(ids).cache)
    # the cache comes back with return_dict_in_generate (it has seen every token fed: all but the last)
    result = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(result.cache, ModelCache) and result.cache.length == 5 + 2


# ---------------------------------------------------------------------------------------------
# Registration


def test_registered_with_the_auto_classes(tmp_path):
    config = KernelMixConfig.from_model_config(ModelConfig.preset("tiny", mixer="softmax"))
    assert isinstance(AutoConfig.for_model("kernelmix"), KernelMixConfig)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is KernelMixForCausalLM


def test_import_kernelmix_registers_once_transformers_is_imported(tmp_path):
    tiny_model(mixer="cubit").save_pretrained(tmp_path)
    # a fresh interpreter: `import kernelmix` does not import transformers, and the Auto classes
    # know kernelmix once transformers is imported afterwards
    code = textwrap.dedent(
        f"""
        import sys
        import kernelmix
        assert "transformers" not in sys.modules
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained({str(tmp_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        print(type(config).__name__, type(model).__name__, model.config.mixer)
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["KernelMixConfig", "KernelMixForCausalLM", "cubit"]


# ---------------------------------------------------------------------------------------------
# Bad checkpoints


@pytest.fixture
def saved(tmp_path):
    tiny_model(mixers=["softmax", "cubit"]).save_pretrained(tmp_path)
    return tmp_path


def test_truncated_weights_are_a_clear_error(saved):
    path = saved / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_corrupt_weights_are_a_clear_error(saved):
    with open(saved / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 16)  # garbage header length
    with pytest.raises(ValueError, match="truncated or corrupt"):
        KernelMixForCausalLM.from_pretrained(saved)


def test_config_of_another_model_type_is_refused(saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama', not 'kernelmix'"):
        KernelMixForCausalLM.from_pretrained(saved)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        KernelMixConfig.from_pretrained(saved)


def test_weights_of_other_mixers_are_refused(saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "mixers": ["softmax", "softmax"]}))
    with pytest.raises(ValueError, match=r"does not match its config .*unexpected tensors \['model.blocks.1.mixer"):
        AutoModelForCausalLM.from_pretrained(saved)
    (saved / "config.json").write_text(json.dumps({**config, "mixers": ["cubit", "cubit"]}))
    with pytest.raises(ValueError, match=r"missing tensors \['model.blocks.0.mixer"):
        AutoModelForCausalLM.from_pretrained(saved)


@pytest.mark.parametrize("load", [KernelMixForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained],
                         ids=["class", "auto"])
def test_weights_of_another_shape_are_our_error_alone(saved, load):
    """A config.json edited to another hidden size: transformers logged its LOAD REPORT (a table of
    MISMATCH rows, "Reinit due to size mismatch") before our error; ours now comes alone and names
    the file and the fix (issue 26). A load that succeeds logs no report either."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        config = json.loads((saved / "config.json").read_text())
        (saved / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
        with pytest.raises(ValueError, match=r"other shapes than its config\.json builds .*model\.\S+ \[.*\] there, "
                                             r"\[.*\] here.*restore the config\.json saved with these weights"):
            load(saved)
        assert not [r for r in records if "LOAD REPORT" in r.getMessage()]
        (saved / "config.json").write_text(json.dumps(config))
        assert isinstance(load(saved), KernelMixForCausalLM)
        assert not [r for r in records if "LOAD REPORT" in r.getMessage()]
    finally:
        root.removeHandler(handler)
