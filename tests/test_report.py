"""`kernelmix report darkformer` end to end on a tiny random Gemma 3 (quick sizes): every output is
written, held-out documents are never trained on, and a second run reuses the finished work."""

import json

import pytest

pytest.importorskip("transformers")

from kernelmix.studies import darkformer_report as rp  # noqa: E402

from .test_convert import tiny_gemma  # noqa: E402
from .test_diagnose import ByteTokenizer  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog; " * 20


def corpus(tmp_path):
    d = tmp_path / "text"
    d.mkdir()
    for i in range(8):
        (d / f"doc{i}.txt").write_text(f"document {i}. " + TEXT)
    return d


def test_darkformer_report_quick(tmp_path):
    settings = rp.DarkformerReportSettings.quick(text=str(corpus(tmp_path)), val_fraction=0.25)
    logs = []
    out, work = tmp_path / "reports", tmp_path / "work"
    summary = rp.darkformer_report(settings, out, work, model=tiny_gemma(), tokenizer=ByteTokenizer(), progress=False,
                                   log=logs.append)
    for name in ("README.md", "summary.json", "diagnostics/diagnostics.json", "diagnostics/error_vs_m.png",
                 "finetune/finetune.json", "finetune/finetune.md", "finetune/finetune_curves.png"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("checkpoints"))  # state stays in the work directory
    runs = summary["finetune"]
    assert [(r["variant"], r["lr"]) for r in runs] == [(v, lr) for v in settings.ft_variants for lr in settings.ft_lrs]
    readme = (out / "README.md").read_text()
    assert "| performer | 16 |" in readme and "| darkformer | 0.01 |" in readme
    assert json.loads((out / "summary.json").read_text())["timings"]["total_s"] > 0
    # a second run reuses the diagnostics and every finished finetuning run
    logs.clear()
    rp.darkformer_report(settings, out, work, model=tiny_gemma(), tokenizer=ByteTokenizer(), progress=False,
                         log=logs.append)
    assert any("diagnostics: reusing" in line for line in logs)
    assert sum("reusing the finished run" in line for line in logs) == len(runs)


def test_report_cli_errors(tmp_path, capsys):
    from kernelmix.cli import main

    assert main(["report", "darkformer", "--model", str(tmp_path / "nowhere"), "--text", str(corpus(tmp_path)),
                 "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]) == 2
    assert "not a local directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "nosuchreport"])
