"""kernelmix report conversion on a tiny random Gemma 3 host and a local corpus: every row, the
decode measurement (flat for the converted model, growing for the host), the files, reuse of
finished rows, and the command line."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelmix.studies.conversion_report import ConversionReportSettings, conversion_report  # noqa: E402

from .test_convert import tiny_gemma  # noqa: E402
from .test_finetune import TEXT, SavableByteTokenizer  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    directory = tmp_path / "text"
    directory.mkdir()
    for i in range(10):
        (directory / f"doc{i}.txt").write_text(f"document {i}: " + TEXT * 3)
    return directory


def _settings(corpus, **overrides):
    base = dict(text=str(corpus), num_features=8, window=4, sinks=1, calib_seqs=2, calib_len=48, eval_seqs=1,
                eval_len=64, error_len=32, transfer_steps=3, lora_steps=2, lora_seq_len=32, decode_contexts=(40, 160),
                decode_tokens=2, val_fraction=0.3, feature_sweep=())
    base.update(overrides)
    return ConversionReportSettings(**base)


def test_the_feature_sweep_and_the_logit_distillation_rows(tmp_path, corpus):
    """feature_sweep adds global DARKFormer-after-transfer rows at other m (first stage only, their
    own transfer), kl_steps distils every transferred row on the host's logits, and the README tabulates
    the gap against m."""
    host = tiny_gemma(layer_types=("full_attention", "sliding_attention", "full_attention"))
    settings = _settings(corpus, layers=["global"], variants=["darkformer"], lora_variants=[], feature_sweep=[16],
                         kl_steps=2, kl_lr=1e-2, layer_gaps=True, estimator_check=[24])
    result = conversion_report(settings, tmp_path / "out", tmp_path / "work", model=host,
                               tokenizer=SavableByteTokenizer(), log=lambda msg: None)
    rows = {(r["layers"], r["variant"], r["stage"]): r for r in result["rows"]}
    assert set(rows) == {("global", "darkformer", "transfer"), ("global", "darkformer m=16", "transfer")}
    assert rows[("global", "darkformer", "transfer")]["loss"] != rows[("global", "darkformer m=16", "transfer")]["loss"]
    for row in rows.values():
        assert row["kl"] is not None and row["kl"]["first"] >= 0
    assert len(list((tmp_path / "work").glob("transfer-global-darkformer-m=16-*"))) == 1
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "## The gap against the number of features" in readme and "| 16 |" in readme
    assert "2 steps of end-to-end logit distillation at lr 0.01" in readme  # the rows' numbers include it
    # layer_gaps: one converted global layer at a time, the other back on the host's attention
    gaps = result["layer_gaps"]
    both = rows[("global", "darkformer", "transfer")]["loss"]
    assert set(gaps) == {"0", "2"} and len({gaps["0"], gaps["2"], both, result["host_loss"]}) == 4
    assert "## Which layer carries the gap" in readme and "| all 2 | " in readme
    # estimator_check: the transferred M with three fresh draws at m = 8 (the row's) and 24, the whitened M
    check = result["estimator"]
    assert set(check["redrawn"]) == set(check["whitened"]) == {"8", "24"}
    assert all(len(runs) == 3 and all(set(r) == {"0", "2"} for r in runs) for runs in check["redrawn"].values())
    assert check["own"] == {k: pytest.approx(v) for k, v in
                            rows[("global", "darkformer", "transfer")]["per_layer_error"].items()}
    draws = [r["0"] for r in check["redrawn"]["8"]]
    assert len(set(draws)) == 3 and check["own"]["0"] not in draws  # fresh draws, none the trained one
    assert "## Is the feature part estimating a kernel?" in readme and "| 24 |" in readme


def test_each_stage_works_in_a_directory_named_by_its_budget(tmp_path, corpus):
    """A rerun with another transfer budget (objective, steps) trains afresh in its own directory, not
    resuming the other budget's transfer; a later stage's settings (LoRA's) leave the transfer's name."""
    from kernelmix.studies.conversion_report import _stage_dir

    base = _settings(corpus)
    names = {_stage_dir(tmp_path, "transfer", "global-darkformer", s) for s in
             (base, _settings(corpus, transfer_objective="residual"), _settings(corpus, transfer_steps=4))}
    assert len(names) == 3
    assert (_stage_dir(tmp_path, "transfer", "global-darkformer", _settings(corpus, lora_steps=5))
            == _stage_dir(tmp_path, "transfer", "global-darkformer", base))
    assert (_stage_dir(tmp_path, "lora", "global-darkformer", _settings(corpus, lora_steps=5))
            != _stage_dir(tmp_path, "lora", "global-darkformer", base))
    assert (_stage_dir(tmp_path, "lora", "global-darkformer", _settings(corpus, transfer_objective="residual"))
            != _stage_dir(tmp_path, "lora", "global-darkformer", base))  # LoRA continues the transferred model
    host = tiny_gemma(layer_types=("full_attention", "sliding_attention", "full_attention"))
    for objective in ("attention", "residual"):
        settings = _settings(corpus, layers=["global"], variants=["darkformer"], lora_variants=[],
                             transfer_objective=objective)
        result = conversion_report(settings, tmp_path / "out", tmp_path / "work", model=host,
                                   tokenizer=SavableByteTokenizer(), log=lambda msg: None)
        assert result["rows"][0]["stage"] == "transfer"
    assert len(list((tmp_path / "work").glob("transfer-global-darkformer-*"))) == 2
    assert "`--transfer-objective residual`" in (tmp_path / "out" / "README.md").read_text()  # the last run's


def test_the_report_measures_every_row_and_decoding(tmp_path, corpus):
    host = tiny_gemma(layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    logs = []
    result = conversion_report(_settings(corpus), tmp_path / "out", tmp_path / "work", model=host,
                               tokenizer=SavableByteTokenizer(), log=logs.append)
    rows = {(r["layers"], r["variant"], r["stage"]): r for r in result["rows"]}
    for layers in ("global", "all"):
        for variant, stage in (("window", "none"), ("performer", "none"), ("whiten", "none"),
                               ("darkformer", "transfer"), ("hedgehog", "transfer")):
            row = rows[(layers, variant, stage)]
            assert torch.isfinite(torch.tensor(row["loss"])) and row["attention_error"] >= 0
        for variant in ("window", "darkformer", "hedgehog"):
            assert rows[(layers, variant, "lora")]["attention_error"] is None
    assert set(rows[("all", "darkformer", "transfer")]["per_layer_error"]) == {"0", "1", "2"}
    decode = result["decode"]
    assert decode["converted"]["bytes"][0] == decode["converted"]["bytes"][1]  # flat
    assert decode["host"]["bytes"][0] < decode["host"]["bytes"][1]  # the host's global layer grows
    assert {"host", "decode", "global/darkformer/transfer", "all/hedgehog/lora"} <= set(result["row_seconds"])
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["host_loss"] == result["host_loss"] and len(saved["rows"]) == len(result["rows"])
    for name in ("README.md", "loss.png", "attention_error.png", "decode.png"):
        assert (tmp_path / "out" / name).is_file()
    assert "targets" in (tmp_path / "out" / "README.md").read_text()
    # a second run reuses every finished row (nothing is trained or measured again)
    logs.clear()
    again = conversion_report(_settings(corpus), tmp_path / "out", tmp_path / "work", model=host,
                              tokenizer=SavableByteTokenizer(), log=logs.append)
    assert again["rows"] == result["rows"] and all("loss" not in line for line in logs[:-1])


def test_cli_report_conversion_refuses_bad_settings(capsys):
    from kernelmix.cli import main

    with pytest.raises(SystemExit):
        main(["report", "conversion", "--variants", "window,window"])
    assert "repeats 'window'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "conversion", "--variants", "softmax"])
