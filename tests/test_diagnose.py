"""Kernel diagnostics on a tiny random Gemma 3 (local + global layers), and their pieces."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from kernelmix.studies import diagnose as dg  # noqa: E402

from .test_convert import tiny_gemma  # noqa: E402


class ByteTokenizer:
    """Enough of a tokenizer for diagnose: bytes mod 128, bos 1."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [b % 126 + 2 for b in text.encode()]

        return Out()


def test_anisotropy_statistics():
    torch.manual_seed(0)
    iso = torch.randn(4000, 1, 16)
    stats = dg.anisotropy(iso)[0]
    assert 14 < stats["effective_rank"] <= 16 and stats["zero_dims"] == 0
    skewed = iso.clone()
    skewed[..., :4] = 0  # singular: 4 zero dims
    skewed[..., 4] *= 10
    s = dg.anisotropy(skewed)[0]
    assert s["zero_dims"] == 4 and s["effective_rank"] < 4 and s["top5_share"] > 0.8 and math.isfinite(s["condition"])


def test_estimator_variance_matches_closed_form():
    g = torch.Generator().manual_seed(0)
    x = 0.5 * torch.randn(6, 8, generator=g)
    y = 0.5 * torch.randn(6, 8, generator=g)
    res = dg.estimator_variance(x, y, None, num_features=16, draws=4000, generator=g)
    torch.testing.assert_close(res["mean"], res["kernel"], rtol=0.05, atol=0)  # unbiased
    ratio = res["empirical"] / res["closed"]
    assert bool(((ratio > 0.8) & (ratio < 1.25)).all()), ratio


def test_diagnose_tiny_gemma(tmp_path):
    model = tiny_gemma()
    text = ["the quick brown fox jumps over the lazy dog. " * 40]
    config = dg.DiagnoseConfig(m_values=[16, 256], seq_len=48, calib_seqs=2, eval_seqs=1, seeds=1, weight_rows=8,
                               variance_pairs=4, variance_draws=32, distill_steps=10, distill_m=16, e2e_m=[32])
    result = dg.diagnose(model, ByteTokenizer(), text, tmp_path, config, progress=False)
    assert not any(hasattr(l.self_attn, "kernelmix_rf") for l in model.model.layers)  # host untouched
    assert [L["layer"] for L in result["per_layer"]] == [0, 1]
    assert result["per_layer"][0]["local"] and not result["per_layer"][1]["local"]
    for v in dg.VARIANTS:
        s = result["summary"][v]
        assert s["256"]["output"] < s["16"]["output"]
        assert len(result["per_layer"][0]["errors"][v]["16"]["output"]) == 4  # per head
    assert set(result["end_to_end"]) == {"host", *dg.VARIANTS}
    for name in ("diagnostics.json", "diagnostics.md", "error_vs_m.png", "anisotropy.png"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "diagnostics.json").read_text())["layers"] == [0, 1]
    assert "| performer | 16 |" in (tmp_path / "diagnostics.md").read_text()


def test_diagnose_bad_input():
    with pytest.raises(ValueError, match="unknown variant"):
        dg.diagnose(tiny_gemma(), ByteTokenizer(), ["x"], config=dg.DiagnoseConfig(variants=["cubit"]))
    with pytest.raises(ValueError, match="not enough text"):
        dg.diagnose(tiny_gemma(), ByteTokenizer(), ["short"], config=dg.DiagnoseConfig(seq_len=64), progress=False)
