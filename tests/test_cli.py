"""The command line: a small demo run end to end, and clear argument errors."""

import json

import pytest

from kernelmix.cli import main


def test_demo_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = main(["demo", "--batch", "1", "--length", "17", "--heads", "2", "--head-dim", "8",
                 "--num-features", "16", "--repeats", "1", "--memory-length", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out.read_text())
    assert {row["mixer"] for row in rows} == {"softmax", "cubit", "cubit (no LRR)", "deltaformer", "performer", "darkformer"}
    assert all(row["forward_error"] < 1e-4 and row["grad_error"] < 1e-4 for row in rows)
    assert all(row["shape"] == [1, 17, 2, 8] for row in rows)
    assert "peak memory at T=64" in printed


def test_demo_rejects_non_positive_sizes(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--length", "0"])
    assert "must be a positive integer" in capsys.readouterr().err
