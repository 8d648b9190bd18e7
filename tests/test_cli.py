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


def test_op_bench_runs_and_writes_valid_json(tmp_path, capsys):
    code = main(["bench", "--mixers", "softmax,cubit,performer", "--lengths", "32,48", "--decode-positions", "16",
                 "--heads", "2", "--head-dim", "8", "--num-features", "8", "--chunk-size", "16", "--repeats", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {(r["mixer"], r["length"]) for r in report["records"]} == {
        (m, t) for m in ("softmax", "cubit", "performer") for t in (32, 48)
    }
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in report["records"])
    assert {d["mixer"] for d in report["decode"]} == {"softmax", "cubit", "performer"}
    assert report["matmul_peak_gflops"] > 0
    assert "crossover vs softmax" in capsys.readouterr().out


def test_op_bench_under_autocast_writes_valid_json(tmp_path, capsys):
    code = main(["bench", "--mixers", "softmax,cubit,deltaformer,darkformer", "--lengths", "33",
                 "--decode-positions", "16", "--heads", "2", "--head-dim", "8", "--num-features", "8",
                 "--chunk-size", "16", "--repeats", "1", "--autocast", "bfloat16", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["autocast"] == "bfloat16" and report["dtype"] == "float32"
    assert {r["mixer"] for r in report["records"]} == {"softmax", "cubit", "deltaformer", "darkformer"}
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in report["records"])
    assert "under bfloat16 autocast" in capsys.readouterr().out


def test_op_bench_autocast_needs_fp32_inputs(capsys):
    with pytest.raises(ValueError, match="autocast"):
        main(["bench", "--lengths", "16", "--dtype", "bfloat16", "--autocast", "bfloat16"])


def test_op_bench_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--lengths", "0,5"])
    assert "positive integers" in capsys.readouterr().err
