"""Model contracts: cached decode == full forward (left padding, chunked prefill, hybrids), packed
documents == separate documents, preset sizes, the loss, and clear errors for bad input."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from kernelmix.cli import main
from kernelmix.model import CausalLM, ModelCache, ModelConfig

F64 = torch.float64
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (id, config overrides on the "tiny" preset): every mixer, three hybrids and a Cubit ablation.
CASES = [
    ("softmax", dict(mixer="softmax")),
    ("cubit", dict(mixer="cubit")),
    ("deltaformer", dict(mixer="deltaformer")),
    ("performer", dict(mixer="performer")),
    ("darkformer", dict(mixer="darkformer")),
    ("cubit-rf", dict(mixer="cubit-rf")),
    ("softmax+cubit", dict(mixers=["softmax", "cubit"])),
    ("darkformer+deltaformer", dict(mixers=["darkformer", "deltaformer"])),
    ("cubit-rf+softmax", dict(mixers=["cubit-rf", "softmax"])),
    ("cubit-nolrr-key", dict(mixer="cubit", mixer_options={"cubit": {"lrr": False, "reference": "key"}})),
]
CASE_IDS = [c[0] for c in CASES]
OVERRIDES = [c[1] for c in CASES]


@torch.no_grad()
def make_model(dtype=F64, seed: int = 0, **overrides) -> CausalLM:
    """A tiny model in eval mode with every parameter moved off its (often symmetric) init, so that
    per-token ρ and β, per-head ridge and reference scale and a non-identity DARKFormer M all matter."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.preset("tiny", **overrides)).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=F64).to(p)
        if name.endswith("log_ridge"):
            p.copy_(torch.empty(p.shape, dtype=F64).uniform_(-5.0, -1.0, generator=g).to(p))
        elif name.endswith("log_ref_scale"):
            p.add_(0.5 * noise)
        elif name.endswith("transform"):
            p.add_(0.2 * noise)
        elif "rho_proj" in name:
            p.add_(0.3 * noise)
        else:
            p.add_(0.08 * noise)
    return model


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a − e| / max |e|."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def left_padded(lengths: list[int], width: int, seed: int = 1, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded (with arbitrary ids) to ``width``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------
# a. prefill + decode == full forward


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("overrides", OVERRIDES, ids=CASE_IDS)
def test_prefill_then_decode_equals_full_forward_left_padded(overrides, dtype):
    model = make_model(dtype, **overrides)
    width, prefill = 21, 9  # crosses the tiny preset's chunk size (16)
    ids, mask = left_padded([21, 18, 13], width)  # 0, 3 and 8 pads
    real = mask.bool()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits

        # each row alone, unpadded, gives its padded row's logits
        for row in range(ids.shape[0]):
            alone = model(ids[row : row + 1, real[row]]).logits
            assert rel_err(full[row, real[row]], alone[0]) <= TOL[dtype]

        # prefill, then one token at a time (no mask needed after the prefill)
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill])
        logits, cache = [out.logits], out.cache
        assert isinstance(cache, ModelCache) and cache.length == prefill
        assert cache.next_position.tolist() == [9, 6, 1]
        for t in range(prefill, width):
            out = model(ids[:, t : t + 1], cache=cache)
            logits.append(out.logits)
            cache = out.cache
        stepped = torch.cat(logits, dim=1)
        assert cache.length == width and cache.next_position.tolist() == [21, 18, 13]
        assert rel_err(stepped[real], full[real]) <= TOL[dtype]


@pytest.mark.parametrize("overrides", OVERRIDES, ids=CASE_IDS)
def test_chunked_prefill_equals_full_forward(overrides):
    """Three multi-token chunks through the cache; the first chunk is all padding in row 2."""
    model = make_model(F64, **overrides)
    ids, mask = left_padded([21, 18, 13], 21)
    real = mask.bool()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        first = model(ids[:, :5], attention_mask=mask[:, :5])
        assert first.cache.next_position.tolist() == [5, 2, 0]
        second = model(ids[:, 5:14], attention_mask=mask[:, :14], cache=first.cache)  # [B, past + T] mask
        third = model(ids[:, 14:], cache=second.cache)
        chunked = torch.cat([first.logits, second.logits, third.logits], dim=1)
        assert rel_err(chunked[real], full[real]) <= TOL[F64]
        # the same chunks with the mask of the current chunk only ([B, T])
        second_b = model(ids[:, 5:14], attention_mask=mask[:, 5:14], cache=first.cache)
        assert rel_err(second_b.logits[real[:, 5:14]], full[:, 5:14][real[:, 5:14]]) <= TOL[F64]


# ---------------------------------------------------------------------------------------------
# b. packed documents == separate documents


@pytest.mark.parametrize("overrides", OVERRIDES, ids=CASE_IDS)
def test_packed_documents_equal_separate_documents(overrides):
    model = make_model(F64, **overrides)
    packings = [[5, 11, 1, 7], [13, 11]]  # 24 tokens per row, crossing the chunk size 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in packings])
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits
        # the packed row continued token by token through the cache, positions restarting likewise
        cache, stepped = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], position_ids=positions[:, t : t + 1], cache=cache)
            stepped.append(out.logits)
            cache = out.cache
        stepped = torch.cat(stepped, dim=1)
        for row, lengths in enumerate(packings):
            start = 0
            for n in lengths:
                alone = model(ids[row : row + 1, start : start + n]).logits[0]
                assert rel_err(packed[row, start : start + n], alone) <= TOL[F64]
                assert rel_err(stepped[row, start : start + n], alone) <= TOL[F64]
                start += n
        # and packing matters: without position_ids the second document reads the first
        unpacked = model(ids).logits
        assert rel_err(unpacked[0, 5:16], packed[0, 5:16]) > 1e-3


# ---------------------------------------------------------------------------------------------
# c. preset sizes


def analytic_parameter_count(config: ModelConfig) -> int:
    """Softmax model: embedding (tied LM head counted once) + per block 2 norms, q/k/v/o, SwiGLU
    (3 matrices) + final norm — computed from the config alone."""
    d, heads, kv, hd, inter = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                               config.intermediate_size)
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    block = 2 * d + attention + 3 * d * inter
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return config.vocab_size * d + head + config.num_layers * block + d


@pytest.mark.parametrize("preset,target", [("125m", 125e6), ("350m", 350e6), ("1.3b", 1.3e9)])
def test_preset_parameter_counts(preset, target):
    config = ModelConfig.preset(preset, mixer="softmax")
    with torch.device("meta"):  # shapes only: no memory, no time
        model = CausalLM(config)
    assert model.embed.weight.is_meta
    count = model.num_parameters()
    assert count == analytic_parameter_count(config)
    assert abs(count - target) / target < 0.05, (preset, count)
    # the tied embedding is counted once
    assert model.lm_head.weight is model.embed.weight
    untied = ModelConfig.preset(preset, mixer="softmax", tie_embeddings=False)
    with torch.device("meta"):
        assert CausalLM(untied).num_parameters() == count + config.vocab_size * config.hidden_size


def test_model_info_cli(capsys):
    assert main(["model-info", "125m"]) == 0
    printed = capsys.readouterr().out
    assert "parameters: 123,551,232 (123.6M)" in printed
    assert '"hidden_size": 768' in printed and "counted once" in printed

    assert main(["model-info", "tiny", "--mixers", "cubit,softmax"]) == 0
    printed = capsys.readouterr().out
    expected = CausalLM(ModelConfig.preset("tiny", mixers=["cubit", "softmax"])).num_parameters()
    assert f"parameters: {expected:,}" in printed and "(cubit, softmax)" in printed


@pytest.mark.parametrize(
    "argv,message",
    [
        (["model-info", "125M"], "invalid choice: '125M' (choose from 'tiny', 'mini', 'small', '125m'"),
        (["model-info", "tiny", "--mixer", "cubt"], "invalid choice: 'cubt' (choose from 'softmax', 'cubit'"),
        (["model-info", "tiny", "--mixers", "cubit,cubt"], "unknown mixer(s) 'cubt' (choose from: softmax, cubit"),
        (["model-info", "tiny", "--mixers", "cubit,softmax,cubit"], "mixers lists 3 names but num_layers is 2"),
    ],
)
def test_model_info_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# d. errors


def _forward(model, **kwargs):
    def call():
        with torch.no_grad():
            return model(**kwargs)

    return call


def _error_cases():
    model = make_model(F64, mixer="softmax")
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        cache = model(ids).cache
        long_prefill = model(torch.zeros(2, 251, dtype=torch.long)).cache  # 251 + 6 > 256
    three_layers = CausalLM(ModelConfig.preset("tiny", mixer="softmax", num_layers=3)).double()
    cubit = CausalLM(ModelConfig.preset("tiny", mixer="cubit")).double()
    gap = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return [
        ("id >= vocab", _forward(model, input_ids=ids.clone().fill_(256)), "token ids must lie in [0, 256)"),
        ("negative id", _forward(model, input_ids=ids - 300), "token ids must lie in [0, 256)"),
        ("too long", _forward(model, input_ids=torch.zeros(1, 257, dtype=torch.long)), "max_seq_len = 256"),
        ("too long via cache", _forward(model, input_ids=ids, cache=long_prefill), "max_seq_len = 256"),
        ("cache of 2 layers", _forward(three_layers, input_ids=ids, cache=cache), "2 layers"),
        ("cache of other mixers", _forward(cubit, input_ids=ids, cache=cache), "['softmax', 'softmax']"),
        ("cache of other batch", _forward(model, input_ids=ids[:1], cache=cache), "cache holds 2 rows"),
        ("labels shape", _forward(model, input_ids=ids, labels=ids[:, :5]), "labels must have the shape"),
        ("labels >= vocab", _forward(model, input_ids=ids, labels=ids + 256), "labels must lie in [0, 256)"),
        ("labels float", _forward(model, input_ids=ids, labels=ids.double()), "labels must be integer"),
        ("mask gap", _forward(model, input_ids=ids, attention_mask=gap), "padding between real tokens"),
        ("mask shape", _forward(model, input_ids=ids, attention_mask=gap[:, :4]), "attention_mask must have shape"),
        ("1-D ids", _forward(model, input_ids=ids[0]), "input_ids must be a [B, T] tensor"),
        ("unknown preset", lambda: ModelConfig.preset("tinyy"),
         "unknown preset 'tinyy' (choose from: tiny, mini, small"),
        ("unknown mixer", lambda: ModelConfig.preset("tiny", mixer="cubt"), "unknown mixer 'cubt' (choose from:"),
        ("unknown mixer in list", lambda: ModelConfig.preset("tiny", mixers=["softmax", "perf"]),
         "unknown mixer 'perf'"),
        ("unknown option", lambda: ModelConfig.preset("tiny", mixer_options={"cubit": {"lrrr": False}}), "'lrrr'"),
        ("option of unknown mixer", lambda: ModelConfig.preset("tiny", mixer_options={"cubt": {}}),
         "unknown mixer 'cubt'"),
        ("options not a dict", lambda: ModelConfig.preset("tiny", mixer_options={"cubit": 3}),
         "mixer_options must map"),
        ("mixers length", lambda: ModelConfig.preset("tiny", mixers=["softmax"] * 3), "mixers lists 3 names"),
        ("mixers a string", lambda: ModelConfig.preset("tiny", mixers="softmax"), "must be a list of mixer names"),
        ("unknown field", lambda: ModelConfig.preset("tiny", hidden=3), "unknown config field(s) ['hidden']"),
    ]


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("call,message", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_input_raises_clear_value_error(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(num_layers=True), "num_layers must be an integer, got True"),
        (dict(max_seq_len="256"), "max_seq_len must be an integer, got '256'"),
        (dict(dropout=1.0), "dropout must be a number in [0, 1), got 1.0"),
        (dict(rope_theta=0.0), "rope_theta must be a positive number, got 0.0"),
        (dict(tie_embeddings=1), "tie_embeddings must be true or false, got 1"),
        (dict(num_kv_heads=3), "num_heads (4) must be divisible by num_kv_heads (3)"),  # at config time, not build
        (dict(head_dim=7), "head_dim must be even for rotary embeddings, got 7"),
    ],
)
def test_config_fields_are_checked_when_the_config_is_built(overrides, message):
    with pytest.raises(ValueError) as exc:
        ModelConfig.preset("tiny", **overrides)
    assert message in str(exc.value)


def test_config_takes_data_read_from_files():
    # JSON/TOML give lists for tuples and may write an integer as a whole float: both normalised
    config = ModelConfig.preset("tiny", mixers=("softmax", "cubit"), vocab_size=512.0, rope_theta=500)
    assert config.mixers == ["softmax", "cubit"] and type(config.vocab_size) is int and type(config.rope_theta) is float
    assert ModelConfig.from_dict(json.loads(config.to_json())) == config


# ---------------------------------------------------------------------------------------------
# e. loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_loss_equals_independent_cross_entropy(dtype):
    model = make_model(dtype, mixers=["softmax", "cubit"])
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (3, 11), generator=g)
    labels = torch.randint(0, 256, (3, 11), generator=g)
    labels[0, 3] = labels[1, 7:] = labels[2, 1] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
    # predict token t+1 from position t; -100 ignored; mean over the rest, in float64
    logits = out.logits[:, :-1].double()
    targets = labels[:, 1:]
    keep = targets != -100
    log_probs = logits.log_softmax(dim=-1)
    picked = log_probs.gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    expected = -(picked * keep).sum() / keep.sum()
    assert out.loss.dim() == 0
    assert abs(out.loss.item() - expected.item()) <= (1e-12 if dtype == F64 else 1e-6) * expected.item()
    # and it is not the unshifted loss
    unshifted = F.cross_entropy(out.logits.double().flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(unshifted.item() - expected.item()) > 1e-3
    assert math.isfinite(out.loss.item())


def test_rows_of_only_minus_100_add_no_tokens_to_the_mean():
    # a batch where some rows are all -100 is fine (no warning): the mean is over the real labels
    model = make_model(F64, mixer="softmax")
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[1] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = model(ids, labels=labels, use_cache=False)
    log_probs = out.logits[:, :-1].double().log_softmax(dim=-1)
    rows = [0, 2]  # float64 reference from the two real rows alone
    picked = log_probs[rows].gather(-1, ids[rows, 1:, None])[..., 0]
    expected = -picked.mean()
    assert abs(out.loss.item() - expected.item()) <= 1e-12 * expected.item()


def test_options_of_a_mixer_one_layer_of_a_hybrid_has_apply():
    # mixer_options for a mixer no layer has are refused (tests/reliability); one layer is enough
    config = ModelConfig.preset("tiny", mixers=["softmax", "performer"],
                                mixer_options={"performer": {"num_features": 24}})
    model = CausalLM(config)
    assert model.blocks[1].mixer.num_features == 24
    assert ModelConfig.from_dict(json.loads(config.to_json())) == config
    # an empty dict for an absent mixer ignores nothing, so it is accepted
    assert ModelConfig.preset("tiny", mixer_options={"cubit": {}}).mixer_options == {"cubit": {}}


# ---------------------------------------------------------------------------------------------
# f. initialisation


@pytest.mark.parametrize("overrides", OVERRIDES, ids=CASE_IDS)
def test_reset_parameters_is_the_init_and_each_layer_owns_its_part(overrides):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny", **overrides))
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.manual_seed(7)
    model.reset_parameters()
    again = model.state_dict()
    drawn = ("_proj.weight", "embed.", "lm_head.")  # N(0, std²) draws: other values from another seed
    for key, value in fresh.items():
        if "rho_proj" in key or not any(part in key for part in drawn):
            # norms, ρ gate, ridge, reference scale, M, F at their initial values; W kept
            assert torch.equal(again[key], value), key
    std = model.config.initializer_range
    assert abs(float(model.embed.weight.detach().std()) - std) < 0.1 * std
    assert model.lm_head.weight is model.embed.weight
    out_std = std / math.sqrt(2 * model.config.num_layers)
    assert abs(float(model.blocks[0].mixer.o_proj.weight.detach().std()) - out_std) < 0.2 * out_std
    for block in model.blocks:
        if block.mixer.mixer_name == "cubit" and block.mixer.lrr:
            assert not block.mixer.rho_proj.weight.any()  # ρ = 1 at init: Cubit starts as Cubit-NoLRR


def test_position_ids_that_do_not_count_up_inside_a_document_are_refused():
    # [0, 1, 1, 2] made token 2 start a document at index 1 while token 1 belonged to the one at 0:
    # overlapping documents, which the fast paths computed differently
    model = CausalLM(ModelConfig.preset("tiny", mixers=["cubit", "performer"])).eval()
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="contiguous documents.*position_ids"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 1, 2]]))
    model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]]))  # two packed documents are fine
