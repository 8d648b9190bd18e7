"""Generation: cached == uncached greedy decoding for every mixer, batched left-padded prompts ==
each prompt alone, eos handling, reproducible sampling, top-k/top-p, argument errors, the model's
mode left alone; throughput measurement and the generate-bench command."""

from __future__ import annotations

import json

import pytest
import torch

from kernelmix.cli import main
from kernelmix.generate import generate
from kernelmix.model import PRESETS, CausalLM, ModelConfig
from kernelmix.studies.generate_bench import (
    BenchRow, GenerateBenchConfig, benchmark_generation, format_bench_table, generation_throughput,
)

from .test_model import CASE_IDS, OVERRIDES, left_padded, make_model

F64 = torch.float64
NEW = 12
LENGTHS = [7, 4, 10]  # prompt lengths of a left-padded batch of width 10


@pytest.fixture(scope="module")
def softmax_model():
    return make_model(F64, mixer="softmax")


@pytest.mark.parametrize("overrides", OVERRIDES, ids=CASE_IDS)
def test_greedy_cached_equals_uncached_and_batched_equals_alone(overrides):
    model = make_model(F64, **overrides)
    ids, mask = left_padded(LENGTHS, 10)
    cached = generate(model, ids, NEW, temperature=0.0, attention_mask=mask)
    uncached = generate(model, ids, NEW, temperature=0.0, attention_mask=mask, use_cache=False)
    assert cached.shape == (3, 10 + NEW)
    assert torch.equal(cached[:, :10], ids)  # the prompt (padding included) comes back unchanged
    assert torch.equal(cached, uncached)
    for row, n in enumerate(LENGTHS):
        alone = generate(model, ids[row : row + 1, 10 - n :], NEW, temperature=0.0)
        assert torch.equal(alone[0, n:], cached[row, 10:])
    # not a degenerate model that repeats one token
    assert len(set(cached[:, 10:].flatten().tolist())) > 3


def test_greedy_is_the_argmax_of_the_full_forward(softmax_model):
    ids, mask = left_padded(LENGTHS, 10)
    out = generate(softmax_model, ids, 5, temperature=0.0, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(3, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = softmax_model(out, attention_mask=full_mask).logits
    assert torch.equal(logits[:, 9:-1].argmax(dim=-1), out[:, 10:])


def _expected_with_eos(unconstrained: torch.Tensor, prompt_width: int, eos: int, pad: int) -> torch.Tensor:
    """Each row cut after its first eos and padded with ``pad``; trimmed when every row stopped."""
    rows, ends = [], []
    for row in unconstrained:
        new = row[prompt_width:].clone()
        hits = (new == eos).nonzero()
        end = len(new) if len(hits) == 0 else int(hits[0]) + 1
        new[end:] = pad
        rows.append(torch.cat([row[:prompt_width], new]))
        ends.append(end)
    return torch.stack(rows)[:, : prompt_width + max(ends)]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_eos_then_pad_and_early_stop(softmax_model, use_cache):
    ids, mask = left_padded(LENGTHS, 10)
    free = generate(softmax_model, ids, NEW, temperature=0.0, attention_mask=mask)
    # eos := the token row 0 emits at step 3 (so row 0 stops there; the others stop where they emit it)
    eos = int(free[0, 10 + 3])
    pad = (eos + 1) % 256
    out = generate(softmax_model, ids, NEW, temperature=0.0, attention_mask=mask, eos_token_id=eos,
                   pad_token_id=pad, use_cache=use_cache)
    assert torch.equal(out, _expected_with_eos(free, 10, eos, pad))
    first = int((free[0, 10:] == eos).nonzero()[0])  # step 3 unless row 0 emitted that token before
    assert out[0, 10 + first] == eos and (out[0, 10 + first + 1 :] == pad).all() and first + 1 < NEW

    # a single row stops early: width = prompt + steps up to and including eos
    single = generate(softmax_model, ids[:1, 3:], NEW, temperature=0.0, eos_token_id=eos, use_cache=use_cache)
    assert single.shape == (1, 7 + first + 1)
    assert torch.equal(single[0, 7:], free[0, 10 : 10 + first + 1])

    # pad defaults to eos; the width is the longest row's (all of NEW unless every row stopped)
    all_stop = _expected_with_eos(free, 10, eos, eos)
    out = generate(softmax_model, ids, NEW, temperature=0.0, attention_mask=mask, eos_token_id=eos, use_cache=use_cache)
    assert torch.equal(out, all_stop)


def test_sampling_is_reproducible_and_cache_independent():
    model = make_model(F64, mixer="cubit")
    ids, mask = left_padded(LENGTHS, 10)

    def sample(seed, **kwargs):
        g = torch.Generator().manual_seed(seed)
        return generate(model, ids, NEW, attention_mask=mask, generator=g, temperature=1.5, **kwargs)

    a, b, c = sample(0), sample(0), sample(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(sample(0, use_cache=False), a)  # same logits, same random stream
    assert torch.equal(sample(0, top_k=50, top_p=0.9), sample(0, top_k=50, top_p=0.9))
    greedy = generate(model, ids, NEW, attention_mask=mask, temperature=0.0)
    assert not torch.equal(a, greedy)


def test_top_k_one_and_tiny_top_p_are_greedy(softmax_model):
    ids, mask = left_padded(LENGTHS, 10)
    greedy = generate(softmax_model, ids, NEW, temperature=0.0, attention_mask=mask)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(generate(softmax_model, ids, NEW, top_k=1, temperature=2.0, attention_mask=mask, generator=g),
                       greedy)
    assert torch.equal(generate(softmax_model, ids, NEW, top_p=1e-6, temperature=2.0, attention_mask=mask, generator=g),
                       greedy)


def test_temperature_scales_the_logits(softmax_model):
    ids, mask = left_padded(LENGTHS, 10)
    greedy = generate(softmax_model, ids, NEW, temperature=0.0, attention_mask=mask)
    g = torch.Generator().manual_seed(0)
    cold = generate(softmax_model, ids, NEW, temperature=1e-4, attention_mask=mask, generator=g)
    hot = generate(softmax_model, ids, NEW, temperature=1.0, attention_mask=mask, generator=g)
    assert torch.equal(cold, greedy)  # logit gaps / 1e-4: sampling is (almost surely) the argmax
    assert not torch.equal(hot, greedy)


@pytest.mark.parametrize("top_k,top_p", [(3, None), (None, 0.05)])
def test_sampled_tokens_stay_inside_top_k_and_nucleus(softmax_model, top_k, top_p):
    ids, mask = left_padded(LENGTHS, 10)
    g = torch.Generator().manual_seed(0)
    out = generate(softmax_model, ids, 20, top_k=top_k, top_p=top_p, temperature=5.0, attention_mask=mask, generator=g)
    full_mask = torch.cat([mask, torch.ones(3, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = softmax_model(out, attention_mask=full_mask).logits[:, 9:-1] / 5.0
    chosen = out[:, 10:]
    order = logits.argsort(dim=-1, descending=True)
    rank = (order == chosen[..., None]).nonzero()[:, -1].view(chosen.shape)
    if top_k is not None:
        assert rank.max() < top_k and rank.max() > 0  # inside the top 3, and not simply greedy
    else:
        probs = logits.softmax(dim=-1).sort(dim=-1, descending=True).values
        mass_before = probs.cumsum(-1) - probs
        chosen_mass_before = mass_before.gather(-1, rank[..., None])[..., 0]
        assert (chosen_mass_before < 0.05).all()
        assert (rank > 0).any()  # at temperature 5 the nucleus holds several tokens: this is not greedy


def test_constant_state_for_random_features_growing_cache_for_softmax():
    """Performer/DARKFormer decode from an m×d state whose size does not grow; softmax's grows."""
    for mixer, grows in (("performer", False), ("darkformer", False), ("softmax", True), ("cubit", True)):
        model = make_model(F64, mixer=mixer)
        with torch.no_grad():
            out = model(torch.zeros(1, 5, dtype=torch.long))
            before = sum(t.numel() for t in vars(out.cache.layers[0].state).values() if isinstance(t, torch.Tensor))
            for _ in range(10):
                out = model(torch.zeros(1, 1, dtype=torch.long), cache=out.cache)
            after = sum(t.numel() for t in vars(out.cache.layers[0].state).values() if isinstance(t, torch.Tensor))
        assert (after > before) == grows, mixer


def test_model_mode_restored_and_no_grad():
    model = make_model(F64, mixer="softmax", dropout=0.5)
    ids = torch.randint(0, 256, (2, 6))
    model.eval()
    reference = generate(model, ids, 6, temperature=0.0)
    model.train()
    model.blocks[1].eval()  # a mixed mode is restored exactly as it was
    modes = [m.training for m in model.modules()]
    out = generate(model, ids, 6, temperature=0.0)
    assert torch.equal(out, reference)  # dropout was off while generating
    assert [m.training for m in model.modules()] == modes
    assert not out.requires_grad and all(p.grad is None for p in model.parameters())
    model.eval()
    generate(model, ids, 2, temperature=0.0)
    assert not any(m.training for m in model.modules())


def test_zero_new_tokens_returns_the_prompt(softmax_model):
    ids = torch.randint(0, 256, (2, 6))
    out = generate(softmax_model, ids, 0)
    assert torch.equal(out, ids) and out is not ids


def _bad_calls():
    model = make_model(F64, mixer="softmax")
    ids, mask = left_padded(LENGTHS, 10)
    right = mask.flip(1)
    return [
        ("negative max_new_tokens", lambda: generate(model, ids, -1), "max_new_tokens must be an int >= 0"),
        ("negative temperature", lambda: generate(model, ids, 2, temperature=-0.1), "temperature must be"),
        ("top_p 0", lambda: generate(model, ids, 2, top_p=0.0), "top_p must be in (0, 1]"),
        ("top_p > 1", lambda: generate(model, ids, 2, top_p=1.5), "top_p must be in (0, 1]"),
        ("top_k 0", lambda: generate(model, ids, 2, top_k=0), "top_k must be an int >= 1"),
        ("mask shape", lambda: generate(model, ids, 2, attention_mask=mask[:, 1:]),
         "attention_mask must have the shape"),
        ("right padding", lambda: generate(model, ids, 2, attention_mask=right), "LEFT padding"),
        ("mask values", lambda: generate(model, ids, 2, attention_mask=mask * 2), "only 0 (padding) and 1"),
        ("too long", lambda: generate(model, ids, 247), "max_seq_len = 256"),
        ("too long padded", lambda: generate(model, torch.zeros(1, 300, dtype=torch.long), 7,
                                             attention_mask=torch.tensor([[0] * 50 + [1] * 250])), "max_seq_len = 256"),
        ("1-D prompt", lambda: generate(model, ids[0], 2), "ids.unsqueeze(0)"),
        ("id >= vocab", lambda: generate(model, ids + 256, 2), "token ids must lie in [0, 256)"),
        ("eos >= vocab", lambda: generate(model, ids, 2, eos_token_id=256), "eos_token_id must be a token id"),
        ("generator type", lambda: generate(model, ids, 2, generator=0), "generator must be a torch.Generator"),
        ("not a model", lambda: generate(torch.nn.Linear(2, 2), ids, 2), "model must be a kernelmix CausalLM"),
        ("throughput sizes", lambda: generation_throughput(model, 0, 4), "prompt_length must be a positive int"),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("call,message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_clear_value_error(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert message in str(exc.value)


def test_longest_prompt_plus_new_tokens_may_reach_max_seq_len_exactly():
    model = make_model(F64, mixer="performer")
    ids = torch.zeros(1, 250, dtype=torch.long)
    assert generate(model, ids, 6, temperature=0.0).shape == (1, 256)
    # left padding does not count: 50 pads + 200 real tokens + 56 new = 256 positions
    mask = torch.tensor([[0] * 50 + [1] * 200])
    assert generate(model, ids, 56, temperature=0.0, attention_mask=mask).shape == (1, 306)


def test_generation_throughput_is_positive(softmax_model):
    rate = generation_throughput(softmax_model, 4, 3, batch=2, repeats=2)
    assert isinstance(rate, float) and rate > 0
    assert generation_throughput(softmax_model, 4, 3, use_cache=False) > 0


def test_format_bench_table():
    rows = [BenchRow("softmax", 100, 1024, 200.0, 128, 50.0), BenchRow("cubit", 120, 1024, 100.0, 0, None)]
    table = format_bench_table(rows)
    assert "4.0x" in table and table.splitlines()[-1].split()[-1] == "-"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_generate_bench_defaults_fit_every_preset(preset):
    config = GenerateBenchConfig(preset=preset)
    room = ModelConfig.preset(preset).max_seq_len - config.prompt_length
    assert config.new_tokens == min(1024, room) and config.uncached_new_tokens == config.new_tokens
    shorter = GenerateBenchConfig(preset=preset, prompt_length=200, uncached_new_tokens=8)
    assert shorter.new_tokens == min(1024, room + 32 - 200) and shorter.uncached_new_tokens == 8


def test_benchmark_generation_takes_its_config():
    config = GenerateBenchConfig(preset="tiny", mixers=["softmax", "performer"], prompt_length=4, new_tokens=3,
                                 uncached_new_tokens=0)
    rows = benchmark_generation(config)
    assert [(r.mixer, r.cached_tokens, r.uncached_tokens) for r in rows] == [("softmax", 3, 0), ("performer", 3, 0)]
    assert all(r.cached_tokens_per_s > 0 and r.uncached_tokens_per_s is None and r.speedup is None for r in rows)
    with pytest.raises(ValueError,
                       match=r"new tokens 300 is beyond the preset's max_seq_len = 256; ask for at most 224"):
        GenerateBenchConfig(preset="tiny", new_tokens=300)
    with pytest.raises(ValueError, match="uncached_new_tokens must be an integer >= 0, got -1"):
        GenerateBenchConfig(uncached_new_tokens=-1)


def test_generate_bench_cli(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["generate-bench", "--preset", "tiny", "--mixers", "softmax,performer", "--prompt-length", "4",
                 "--new-tokens", "6", "--uncached-new-tokens", "3", "--json", str(path)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "cached: 6 new tokens, uncached: 3 new tokens" in printed
    assert "measured on 3 new tokens only" in printed
    rows = json.loads(path.read_text())
    assert [r["mixer"] for r in rows] == ["softmax", "performer"]
    assert all(r["cached_tokens_per_s"] > 0 and r["uncached_tokens_per_s"] > 0 for r in rows)
    assert all(abs(r["speedup"] - r["cached_tokens_per_s"] / r["uncached_tokens_per_s"]) < 1e-9 for r in rows)
    lines = [line for line in printed.splitlines() if line.startswith(("softmax", "performer"))]
    assert len(lines) == 2 and lines[0].split()[-1].endswith("x")

    assert main(["generate-bench", "--preset", "tiny", "--mixers", "cubit", "--prompt-length", "2",
                 "--new-tokens", "2", "--uncached-new-tokens", "0"]) == 0
    assert "uncached: not measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--mixers", "softmax,cubt"], "unknown mixer(s) 'cubt' (choose from: softmax, cubit"),
        (["--preset", "huge"], "invalid choice: 'huge' (choose from 'tiny', 'mini', 'small'"),
        (["--new-tokens", "0"], "must be a positive integer"),
        (["--preset", "tiny", "--prompt-length", "200", "--new-tokens", "100"], "max_seq_len = 256"),
        (["--preset", "tiny", "--prompt-length", "256"],
         "leaves no room for new tokens within the preset's max_seq_len"),
        (["--uncached-new-tokens", "-1"], "--uncached-new-tokens must be an integer >= 0, got -1"),
        (["--device", "cuda:x"], "unknown device 'cuda:x'"),
    ],
)
def test_generate_bench_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate-bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_on_untrained_model_default_init():
    """The default (unperturbed) initialisation also decodes consistently."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny", mixers=["darkformer", "cubit"])).double()
    ids, mask = left_padded([5, 9], 9)
    assert torch.equal(
        generate(model, ids, 8, temperature=0.0, attention_mask=mask),
        generate(model, ids, 8, temperature=0.0, attention_mask=mask, use_cache=False),
    )
