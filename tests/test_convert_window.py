"""Converted layers with a window (exact softmax over the last w tokens, features before them) and
their constant-memory decode cache, on tiny random Gemma 3 / Llama hosts: generation equals the
parallel forward, the cache does not grow, left padding, save/load, legacy records, local layers,
bad input (local layers: tests/test_convert.py)."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelmix import pretrained as cv  # noqa: E402
from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.pretrained.window_cache import decode_cache_bytes  # noqa: E402
from tests.test_convert import ids, logits, tiny_gemma, tiny_llama  # noqa: E402


def _cache(generated):
    return getattr(generated, "cache", None) or generated.past_key_values


@pytest.mark.parametrize("make", [tiny_gemma, tiny_llama])
@pytest.mark.parametrize("mixer,window", [("darkformer", 4), ("performer", 0), ("hedgehog", 3), ("darkformer", 64)])
def test_generation_from_the_window_cache_equals_the_parallel_forward(make, mixer, window):
    model = cv.convert(make(), cv.ConversionConfig(mixer=mixer, num_features=16, window=window, layers="all"))
    prompt = ids(1, 30)[:, :5]
    gen = model.generate(prompt, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, gen.sequences)
    torch.testing.assert_close(torch.stack(gen.logits, 1)[0], full[0, 4:-1], atol=1e-4, rtol=1e-4)
    kinds = {type(layer).__name__ for layer in _cache(gen).layers}
    assert "WindowFeatureCacheLayer" in kinds and "DynamicLayer" not in kinds


def test_the_cache_does_not_grow_with_the_generated_length():
    model = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=16, window=4,
                                                         layers="global"))
    host = tiny_gemma()
    prompt = ids(1, 8)
    sizes, host_sizes = [], []
    for n in (12, 40, 80):
        sizes.append(decode_cache_bytes(_cache(model.generate(prompt, max_new_tokens=n, do_sample=False,
                                                              return_dict_in_generate=True))))
        host_sizes.append(decode_cache_bytes(_cache(host.generate(prompt, max_new_tokens=n, do_sample=False,
                                                                  return_dict_in_generate=True))))
    assert sizes[0] == sizes[1] == sizes[2] > 0
    assert host_sizes[0] < host_sizes[1] < host_sizes[2]  # the host's global layer grows


def test_left_padded_batch_generates_as_each_prompt_alone():
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="darkformer", num_features=16, window=3))
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    batch = model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    alone = model.generate(x[1:, 5:], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(batch[1, 12:], alone[0, 7:])


def test_window_layers_save_and_load(tmp_path):
    model = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="hedgehog", num_features=8, window=5, layers="all"))
    with torch.no_grad():
        cv.kernels(model)[1].query_map.add_(0.1)
    cv.save_converted(model, tmp_path / "m")
    loaded = cv.load_converted(tmp_path / "m")
    assert cv.conversion_config(loaded).window == 5 and cv.kernels(loaded)[1].mixer == "hedgehog"
    x = ids()
    torch.testing.assert_close(logits(loaded, x), logits(model, x))


def test_a_record_without_a_window_loads_as_features_only(tmp_path):
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="performer", num_features=8, window=0))
    cv.save_converted(model, tmp_path / "m")
    config_file = tmp_path / "m" / "config.json"
    raw = json.loads(config_file.read_text())
    del raw[cv.CONFIG_KEY]["window"]
    raw[cv.CONFIG_KEY]["version"] = 1
    config_file.write_text(json.dumps(raw))
    loaded = cv.load_converted(tmp_path / "m")
    assert cv.conversion_config(loaded).window == 0
    torch.testing.assert_close(logits(loaded, ids()), logits(model, ids()))


def test_a_window_as_long_as_the_text_is_the_host_and_a_short_one_is_not():
    host = tiny_gemma()
    x = ids(2, 24)
    whole = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer="performer", num_features=8, window=24,
                                                                layers="global"))
    torch.testing.assert_close(logits(whole, x), logits(host, x), atol=1e-5, rtol=1e-5)
    short = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer="performer", num_features=8, window=4,
                                                                layers="global"))
    assert not torch.allclose(logits(short, x), logits(host, x), atol=1e-3)


def test_bad_windows_and_feature_counts_are_refused_before_work():
    with pytest.raises(KernelmixError, match="longer than the host's context"):
        cv.convert(tiny_llama(), cv.ConversionConfig(window=10_000))
    with pytest.raises(ValueError, match="num_features"):
        cv.ConversionConfig(num_features=0).validate()
    with pytest.raises(KernelmixError, match="even num_features"):
        cv.convert(tiny_llama(), cv.ConversionConfig(mixer="hedgehog", num_features=7))


def test_exact_attention_refuses_to_continue_the_window_cache():
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2))
    x = ids(1, 6)
    with cv.exact_attention():
        first = model(input_ids=x[:, :4], use_cache=True)  # a first call sees every key: exact
        with pytest.raises(ValueError, match="use_cache=False"):
            model(input_ids=x[:, 4:], cache=first.cache if hasattr(first, "cache") else first.past_key_values)
        exact = logits(model, x, use_cache=False)  # the exact model itself still runs
    torch.testing.assert_close(exact, logits(tiny_llama(), x))
    torch.testing.assert_close(first.logits, logits(tiny_llama(), x[:, :4]))
    with pytest.raises(ValueError, match="new cache"):  # that cache cannot be continued outside either
        model(input_ids=x[:, 4:], cache=first.cache if hasattr(first, "cache") else first.past_key_values)
    assert all(getattr(k, "active_cache", None) is None for k in cv.kernels(model).values())
