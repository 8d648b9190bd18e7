"""Issue 13 (model and Hugging Face part): every wrong input to the model, to ``generate`` and to
the transformers adapter is either a KernelmixError that names the problem and the fix, or is
handled correctly. One class per failure case; each test failed on the code before the fix (a
nan loss, a traceback from deep inside, or a silent wrong result). What must keep working beside
them is tested with the module it belongs to: rows of only -100 in a batch and options of a
mixer one layer of a hybrid has (tests/test_model.py), left-padded generation against each
prompt alone and generation up to max_seq_len exactly (tests/test_hf.py), old checkpoints
(tests/test_legacy.py). References are float64."""

from __future__ import annotations

import importlib.util
import math
import re
import warnings

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.generate import generate
from kernelmix.model import CausalLM, ModelConfig

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs transformers and safetensors (the hf extra)",
)
F64 = torch.float64


def tiny(seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig.preset("tiny", **overrides)).to(F64).eval()


def ids(batch: int = 2, length: int = 8, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood over the labels that are not -100, in float64."""
    log_probs = logits[:, :-1].double().log_softmax(dim=-1)
    targets = labels[:, 1:]
    keep = targets != -100
    picked = log_probs.gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    return -(picked * keep).sum() / keep.sum()


def hf_model(seed: int = 0, **overrides):
    from kernelmix.hf import KernelMixConfig, KernelMixForCausalLM

    torch.manual_seed(seed)
    return KernelMixForCausalLM(KernelMixConfig.from_model_config(ModelConfig.preset("tiny", **overrides))).eval()


@pytest.fixture
def saved_hf(tmp_path):
    model = hf_model(mixer="cubit")
    model.save_pretrained(tmp_path)
    return tmp_path, model


# ---------------------------------------------------------------------------------------------
# 7. labels that leave nothing to predict


class TestLabelsWithNothingToPredict:
    """All labels -100 gave loss = nan (0 / 0) without a word; one nan step makes every parameter
    nan. Now: loss 0 in the graph (zero gradients) and a warning naming the cause and the fix."""

    def _check(self, loss: torch.Tensor, caught: list) -> None:
        assert loss.dim() == 0 and math.isfinite(loss.item()) and loss.item() == 0.0
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert any("no token to predict" in m and "-100" in m and "check how its labels are masked" in m
                   for m in messages), messages

    def test_all_minus_100_gives_zero_loss_zero_gradients_and_a_warning(self):
        model = tiny()
        x = ids()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(x, labels=torch.full_like(x, -100), use_cache=False).loss
        self._check(loss, caught)
        loss.backward()  # still part of the graph
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(bool((g == 0).all()) for g in grads)

    def test_only_the_first_label_real_is_nothing_to_predict(self):
        # labels are shifted inside: labels[:, 0] is never predicted; T = 1 likewise
        model = tiny()
        x = ids()
        labels = torch.full_like(x, -100)
        labels[:, 0] = x[:, 0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._check(model(x, labels=labels).loss, caught)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._check(model(x[:, :1], labels=x[:, :1]).loss, caught)

    @needs_hf
    def test_the_hugging_face_wrapper_does_the_same(self):
        model = hf_model()
        x = ids()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._check(model(x, labels=torch.full_like(x, -100)).loss, caught)


# ---------------------------------------------------------------------------------------------
# 8. right padding in generate


@needs_hf
class TestHuggingFaceGenerateRefusesRightPadding:
    """HF generate took a right-padded mask with only a warning (and none without pad_token_id)
    and generated after the padding; now it refuses, naming tokenizer.padding_side = "left"."""

    def test_right_padding_is_refused_with_the_fix(self):
        model = hf_model(mixer="cubit")
        x = ids(2, 6)
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
        for extra in ({}, {"pad_token_id": 0}):
            with pytest.raises(KernelmixError) as error:
                model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False, **extra)
            message = str(error.value)
            assert "LEFT padding" in message and "row 0" in message and "ends in padding" in message
            assert 'tokenizer.padding_side = "left"' in message

    def test_padding_between_real_tokens_is_refused(self):
        model = hf_model()
        mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        with pytest.raises(KernelmixError,
                           match=r'row 0 .*padding after a real token at index 1.*padding_side = "left"'):
            model.generate(ids(2, 6), attention_mask=mask, max_new_tokens=3, do_sample=False)

    def test_kernelmix_generate_names_the_same_fix(self):
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        with pytest.raises(KernelmixError, match='row 0 of attention_mask ends in padding.*padding_side = "left"'):
            generate(tiny(), ids(2, 4), 2, temperature=0, attention_mask=mask)


# ---------------------------------------------------------------------------------------------
# 9. mixer_options for a mixer no layer has


class TestMixerOptionsForAnAbsentMixer:
    """mixer_options.cubit.* with no Cubit layer was ignored silently."""

    def test_refused_naming_the_option_the_mixers_and_the_fix(self):
        with pytest.raises(KernelmixError) as error:
            ModelConfig.preset("tiny", mixer="softmax", mixer_options={"cubit": {"lrr": False}})
        message = str(error.value)
        assert "mixer_options.cubit.lrr" in message and "softmax, softmax" in message
        assert "mixer='cubit'" in message and "remove mixer_options['cubit']" in message

    def test_a_hybrid_without_that_mixer_is_refused_too(self):
        with pytest.raises(KernelmixError, match=r"mixer_options\.performer\.num_features .*softmax, cubit"):
            ModelConfig.preset("tiny", mixers=["softmax", "cubit"], mixer_options={"performer": {"num_features": 8}})

    @needs_hf
    def test_a_from_pretrained_override_is_checked(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, _ = saved_hf
        with pytest.raises(KernelmixError, match=r"mixer_options\.performer\.num_features .*cubit, cubit"):
            KernelMixForCausalLM.from_pretrained(path, mixer_options={"performer": {"num_features": 8}})


# ---------------------------------------------------------------------------------------------
# from_pretrained with other shapes


@needs_hf
class TestFromPretrainedWithAnotherVocabSize:
    """from_pretrained(path, vocab_size=n) ended in transformers' "look at the above report";
    resize_token_embeddings, the fix, raised NotImplementedError."""

    def test_names_both_sizes_and_the_fix(self, saved_hf):
        from transformers import AutoModelForCausalLM

        from kernelmix.hf import KernelMixConfig, KernelMixForCausalLM

        path, _ = saved_hf
        bigger = KernelMixConfig.from_model_config(ModelConfig.preset("tiny", mixer="cubit", vocab_size=300))
        for load in (lambda: KernelMixForCausalLM.from_pretrained(path, vocab_size=300),
                     lambda: AutoModelForCausalLM.from_pretrained(path, vocab_size=300),
                     lambda: KernelMixForCausalLM.from_pretrained(path, config=bigger)):
            with pytest.raises(KernelmixError) as error:
                load()
            message = str(error.value)
            assert "saved with vocab_size 256" in message and "asks for vocab_size 300" in message
            assert "model.resize_token_embeddings(300)" in message

    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_resize_token_embeddings_keeps_the_trained_rows(self, tmp_path, tied):
        from kernelmix.hf import KernelMixForCausalLM

        model = hf_model(mixer="cubit", tie_embeddings=tied)
        x = ids(1, 6)
        with torch.no_grad():
            before = model(x).logits.double()
        model.resize_token_embeddings(300)
        assert model.config.vocab_size == model.model.config.vocab_size == 300
        assert (model.model.lm_head.weight is model.model.embed.weight) is tied
        with torch.no_grad():
            after = model(x).logits.double()
            new_token = model(torch.tensor([[299, 3]])).logits
        assert after.shape[-1] == 300 and new_token.shape == (1, 2, 300)
        assert (after[..., :256] - before).abs().max().item() <= 1e-6 * before.abs().max().item()
        model.save_pretrained(tmp_path)
        loaded = KernelMixForCausalLM.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            assert torch.equal(loaded(x).logits.double(), after)


@needs_hf
class TestFromPretrainedWithOtherShapes:
    """Any other shape-changing override (hidden_size=...) ended in the same RuntimeError."""

    def test_names_the_tensors_the_override_and_the_fix(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, _ = saved_hf
        with pytest.raises(KernelmixError) as error:
            KernelMixForCausalLM.from_pretrained(path, hidden_size=128)
        message = str(error.value)
        assert "[64, 64] there, [64, 128] here" in message and "hidden_size=128" in message
        assert "load the checkpoint with the config it was saved with" in message


@needs_hf
class TestIgnoreMismatchedSizes:
    """ignore_mismatched_sizes=True loaded a model whose resized tensors were uninitialised memory
    (nan in the embedding), silently."""

    def test_refused_with_the_fix(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, _ = saved_hf
        with pytest.raises(KernelmixError,
                           match=r"ignore_mismatched_sizes=True .*uninitialised.*resize_token_embeddings"):
            KernelMixForCausalLM.from_pretrained(path, vocab_size=300, ignore_mismatched_sizes=True)


@needs_hf
class TestFromPretrainedWithAnUnknownArgument:
    """A typo (vocab_sise=300) was a TypeError from __init__; now it names the config fields."""

    def test_names_the_argument_and_the_fields(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, _ = saved_hf
        with pytest.raises(KernelmixError, match=r"unknown argument\(s\) \['vocab_sise'\].*fields are: .*vocab_size"):
            KernelMixForCausalLM.from_pretrained(path, vocab_sise=300)


@needs_hf
class TestHuggingFaceSaveWithFlippedBytes:
    """Issue 25: a saved model whose model.safetensors had 8 bytes flipped loaded without a word, with
    weights off by up to 9.2 (training checkpoints had checksums, HF saves none). save_pretrained now
    writes kernelmix.checksums.json beside the weights and from_pretrained verifies it first."""

    @staticmethod
    def _flip(path, back: int = 100) -> None:
        with open(path, "r+b") as handle:  # 8 bytes of the last tensor's data: the header still parses
            handle.seek(-back, 2)
            data = handle.read(8)
            handle.seek(-back, 2)
            handle.write(bytes(b ^ 0xFF for b in data))

    def test_refused_naming_the_file_and_the_fix(self, saved_hf):
        from transformers import AutoModelForCausalLM

        path, _ = saved_hf
        assert (path / "kernelmix.checksums.json").is_file()
        self._flip(path / "model.safetensors")
        with pytest.raises(KernelmixError, match=rf"{re.escape(str(path / 'model.safetensors'))} does not match the "
                                                 r"checksum written when the model was saved \(same size, other "
                                                 r"bytes\): .*corrupt.*save or copy the model again"):
            AutoModelForCausalLM.from_pretrained(path)

    def test_a_flipped_shard_is_named(self, tmp_path):
        from kernelmix.hf import KernelMixForCausalLM

        hf_model().save_pretrained(tmp_path, max_shard_size="100KB")
        shards = sorted(tmp_path.glob("model-*.safetensors"))
        assert len(shards) > 1
        self._flip(shards[1])
        with pytest.raises(KernelmixError, match=rf"{re.escape(shards[1].name)} does not match the checksum"):
            KernelMixForCausalLM.from_pretrained(tmp_path)

    def test_a_save_without_checksums_still_loads(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, model = saved_hf
        (path / "kernelmix.checksums.json").unlink()  # as an older kernelmix saved it
        loaded = KernelMixForCausalLM.from_pretrained(path)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))

    def test_an_unreadable_checksum_file_is_named(self, saved_hf):
        from kernelmix.hf import KernelMixForCausalLM

        path, _ = saved_hf
        (path / "kernelmix.checksums.json").write_text("{not json")
        with pytest.raises(KernelmixError, match=r"cannot read .*kernelmix.checksums.json .*save or copy the model "
                                                 r"again, or delete kernelmix.checksums.json"):
            KernelMixForCausalLM.from_pretrained(path)


# ---------------------------------------------------------------------------------------------
# generate: length, empty prompt, special tokens, id dtype


@needs_hf
class TestHuggingFaceGenerateBeyondMaxSeqLen:
    """Generating past max_seq_len failed at the step that got there, after the work before it,
    with a message that did not name max_new_tokens; now it is refused before the first forward."""

    def test_refused_before_any_forward_naming_the_largest_max_new_tokens(self):
        model = hf_model()
        calls = []
        hook = model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
        try:
            with pytest.raises(KernelmixError,
                               match=r"6 tokens plus 300 new tokens .*max_seq_len = 256.*max_new_tokens=250"):
                model.generate(ids(2, 6), max_new_tokens=300, do_sample=False)
            with pytest.raises(KernelmixError, match=r"max_new_tokens=250"):
                model.generate(ids(2, 6), max_length=300, do_sample=False)
        finally:
            hook.remove()
        assert calls == []

    def test_left_padding_does_not_count(self):
        # a row of 4 real tokens padded to 10: 4 + 252 new tokens fit into 256 positions
        model = hf_model()
        x = ids(1, 10)
        mask = torch.tensor([[0] * 6 + [1] * 4])
        with pytest.raises(KernelmixError, match="4 tokens plus 253 new tokens"):
            model.generate(x, attention_mask=mask, max_new_tokens=253, do_sample=False, pad_token_id=0)


@needs_hf
class TestHuggingFaceGeneratePromptAloneTooLong:
    """Issue 25: a prompt that alone fills max_seq_len was told to "ask for at most max_new_tokens=0",
    which transformers refuses. Now: no max_new_tokens fits, shorten the prompt to max_seq_len - 1
    tokens (how), or use a model with a larger max_seq_len; refused before any forward."""

    @pytest.mark.parametrize("length", [16, 20])
    def test_refused_naming_the_prompt_limit_and_how_to_cut(self, length):
        model = hf_model(max_seq_len=16)
        calls = []
        hook = model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
        try:
            with pytest.raises(KernelmixError, match=rf"a prompt of {length} tokens leaves no room to generate: the "
                                                     r"model's max_seq_len = 16 positions hold at most 15 prompt "
                                                     r"tokens plus one new token; shorten the prompt to at most 15 "
                                                     r"tokens \(e.g. its last ones: input_ids\[:, -15:\].*larger "
                                                     r"max_seq_len") as caught:
                model.generate(ids(1, length), max_new_tokens=3, do_sample=False)
        finally:
            hook.remove()
        assert "max_new_tokens=0" not in str(caught.value) and calls == []

    def test_the_cut_it_suggests_works(self):
        model = hf_model(max_seq_len=16)
        assert model.generate(ids(1, 20)[:, -15:], max_new_tokens=1, do_sample=False).shape == (1, 16)


@needs_hf
class TestHuggingFaceGenerateLengthNotAnInt:
    """Issue 25: ``max_new_tokens="3"`` was a TypeError deep inside transformers ('<=' not supported
    between 'str' and 'int'), a float was taken as it came and 0 was transformers' error without a
    fix. The length options are ints at least their minimum, else a KernelmixError naming the value."""

    @pytest.mark.parametrize("name,value,fix", [
        ("max_new_tokens", "3", "max_new_tokens=3"), ("max_new_tokens", 2.0, "max_new_tokens=2"),
        ("max_new_tokens", True, "max_new_tokens=20"), ("max_length", "12", "max_length=12"),
        ("min_new_tokens", "1", "min_new_tokens=1"),
    ])
    def test_not_an_int(self, name, value, fix):
        with pytest.raises(KernelmixError, match=rf"{name} must be an int \(a number of tokens\), got "
                                                 rf"{re.escape(repr(value))} \({type(value).__name__}\); pass an "
                                                 rf"int, e.g. {fix}"):
            hf_model().generate(ids(1, 4), do_sample=False, **{name: value})

    @pytest.mark.parametrize("value", [0, -1])
    def test_no_token_to_generate(self, value):
        with pytest.raises(KernelmixError, match=rf"max_new_tokens must be >= 1 \(at least one token to generate\), "
                                                 rf"got {value}; pass e.g. max_new_tokens=20"):
            hf_model().generate(ids(1, 4), max_new_tokens=value, do_sample=False)

    def test_in_a_generation_config_too(self):
        from transformers import GenerationConfig

        config = GenerationConfig(do_sample=False)
        config.max_new_tokens = "3"
        with pytest.raises(KernelmixError, match=r"max_new_tokens must be an int .*got '3' \(str\)"):
            hf_model().generate(ids(1, 4), generation_config=config)

    def test_ints_still_run(self):
        import numpy as np

        assert hf_model().generate(ids(1, 4), max_new_tokens=np.int64(2), min_new_tokens=0,
                                   do_sample=False).shape == (1, 6)


@needs_hf
class TestHuggingFaceGenerateEmptyPrompt:
    """A prompt of no tokens was an IndexError inside transformers."""

    def test_refused_with_the_fix(self):
        with pytest.raises(KernelmixError, match=r"no prompt token \(shape \[2, 0\]\).*BOS token"):
            hf_model().generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3, do_sample=False)


@needs_hf
class TestHuggingFaceGenerateSpecialTokensOutsideTheVocabulary:
    """pad_token_id=300 with 256 tokens was accepted; a finished row was padded with a token the
    model cannot read (returned, or fed back and refused mid-generation)."""

    @pytest.mark.parametrize("name,value", [("pad_token_id", 300), ("eos_token_id", [5, 256])])
    def test_refused_naming_the_id_and_the_fix(self, name, value):
        with pytest.raises(KernelmixError, match=rf"{name}=.* not a token of this model .*\[0, 256\).*tokenizer"):
            hf_model().generate(ids(2, 4), max_new_tokens=3, do_sample=False, **{name: value})


class TestGenerateIdsOfANarrowDtype:
    """New tokens come back in the prompt's dtype: uint8 ids with 300 tokens wrapped ids >= 256
    around silently."""

    def test_refused_naming_the_dtype_and_the_fix(self):
        model = tiny(vocab_size=300)
        with pytest.raises(KernelmixError, match=r"torch\.uint8, which cannot hold .*up to 299.*input_ids\.long\(\)"):
            generate(model, ids(1, 4).to(torch.uint8), 3, temperature=0)


# ---------------------------------------------------------------------------------------------
# CausalLM.forward: dtypes and kinds of input


class TestIdsAndLabelsOfAnyIntegerDtype:
    """int32 labels were a RuntimeError inside cross_entropy; uint8 / int16 ids one inside the
    embedding. Any integer dtype now gives what int64 gives."""

    def test_the_same_logits_and_loss_as_int64(self):
        model = tiny()
        x = ids()
        with torch.no_grad():
            expected = model(x, labels=x, use_cache=False)
            for id_dtype, label_dtype in ((torch.int32, torch.int32), (torch.uint8, torch.int16),
                                          (torch.int16, torch.uint8)):
                out = model(x.to(id_dtype), labels=x.to(label_dtype), use_cache=False)
                assert torch.equal(out.logits, expected.logits), id_dtype
                assert out.loss.item() == expected.loss.item(), label_dtype
        assert abs(expected.loss.item() - reference_loss(expected.logits, x).item()) <= 1e-12 * expected.loss.item()


class TestPositionIdsOfTheWrongKind:
    """A list was an AttributeError; negative positions an error about doc_start, which the caller
    never passed; a bool tensor was taken as positions 0/1."""

    @pytest.mark.parametrize("bad", [[[0] * 8] * 2, torch.ones(2, 8, dtype=torch.bool)], ids=["list", "bool"])
    def test_not_an_integer_tensor(self, bad):
        with pytest.raises(KernelmixError,
                           match=r"position_ids must be an integer tensor of shape \[B, T\] = \(2, 8\).*0, 1, 2"):
            tiny()(ids(), position_ids=bad)

    def test_negative_positions(self):
        positions = torch.arange(8).expand(2, 8) - 3
        with pytest.raises(KernelmixError,
                           match=r"position_ids must be >= 0, got a minimum of -3; positions count 0, 1, 2"):
            tiny()(ids(), position_ids=positions)


class TestAttentionMaskOfTheWrongKind:
    """A list was an AttributeError; values other than 0 and 1 (2, 0.5) were read as real tokens."""

    def test_not_a_tensor(self):
        with pytest.raises(KernelmixError, match=r"attention_mask must have shape \[B, T\] = \(2, 8\).*got list"):
            tiny()(ids(), attention_mask=[[1] * 8] * 2)

    @pytest.mark.parametrize("value", [2, 0.5])
    def test_values_other_than_0_and_1(self, value):
        mask = torch.ones(2, 8)
        mask[0, 0] = value
        with pytest.raises(KernelmixError, match=rf"only 0 \(padding\) and 1 \(real token\), got \[{float(value)}\]"):
            tiny()(ids(), attention_mask=mask)


class TestEmptyBatch:
    """input_ids of shape [0, T] was a RuntimeError from min() of an empty tensor."""

    def test_refused(self):
        with pytest.raises(KernelmixError, match=r"at least one row and one token, got shape \(0, 8\)"):
            tiny()(torch.zeros(0, 8, dtype=torch.long))


class TestUseCacheNotABool:
    """use_cache="no" was truthy: a cache was built."""

    def test_refused(self):
        with pytest.raises(KernelmixError, match="use_cache must be True or False, got 'no'"):
            tiny()(ids(), use_cache="no")
