"""The command line: a small demo run end to end, and clear argument errors."""

import json

import pytest
import torch

from kernelmix.cli import main


def test_demo_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = main(["demo", "--batch", "1", "--length", "17", "--heads", "2", "--head-dim", "8",
                 "--num-features", "16", "--repeats", "1", "--memory-length", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out.read_text())
    assert {row["mixer"] for row in rows} == {"softmax", "cubit", "cubit (no LRR)", "deltaformer", "performer",
                                              "darkformer", "cubit-rf"}
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
                 "--no-memory", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {(r["mixer"], r["length"]) for r in report["records"]} == {
        (m, t) for m in ("softmax", "cubit", "performer") for t in (32, 48)
    }
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in report["records"])
    assert all(r["without_autocast_ms"] is None for r in report["records"])  # no autocast: nothing to compare
    assert {d["mixer"] for d in report["decode"]} == {"softmax", "cubit", "performer"}
    assert report["matmul_peak_gflops"] > 0
    assert "crossover vs softmax" in capsys.readouterr().out


def test_op_bench_under_autocast_writes_valid_json(tmp_path, capsys):
    code = main(["bench", "--mixers", "softmax,cubit,deltaformer,darkformer", "--lengths", "33",
                 "--decode-positions", "16", "--heads", "2", "--head-dim", "8", "--num-features", "8",
                 "--chunk-size", "16", "--repeats", "1", "--autocast", "bfloat16", "--no-memory", "--out",
                 str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["autocast"] == "bfloat16" and report["dtype"] == "float32"
    assert {r["mixer"] for r in report["records"]} == {"softmax", "cubit", "deltaformer", "darkformer"}
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in report["records"])
    # each op also timed without autocast in the same run, and the ratio printed
    assert all(r["without_autocast_ms"] > 0 for r in report["records"])
    out = capsys.readouterr().out
    assert "under bfloat16 autocast" in out and "vs no autocast" in out


def test_op_bench_memory_is_measured_in_a_fresh_process(tmp_path, capsys):
    # the memory pass (after the timings): one probe process per op, its peak in the JSON and table
    code = main(["bench", "--mixers", "cubit", "--lengths", "512", "--decode-positions", "16", "--heads", "2",
                 "--head-dim", "16", "--chunk-size", "64", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    (record,) = json.loads((tmp_path / "bench.json").read_text())["records"]
    # fwd+bwd of Cubit at T=512 keeps U, the output and four gradients of 64 KiB each alive
    assert record["peak_memory_mb"] is not None and record["peak_memory_mb"] > 0.25
    assert "memory cubit T=512" in capsys.readouterr().out


def test_memory_probe_failure_is_reported_not_raised():
    from kernelmix.studies.bench import op_peak_memory_mb

    result = op_peak_memory_mb("peer", "no-such-peer", 16, batch=1, heads=1, head_dim=4, num_features=4,
                               chunk_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(result, str) and "memory probe failed" in result and "no-such-peer" in result


def test_op_bench_autocast_needs_fp32_inputs(capsys):
    with pytest.raises(SystemExit) as exit_info:  # refused with the options, before any measuring
        main(["bench", "--lengths", "16", "--dtype", "bfloat16", "--autocast", "bfloat16"])
    assert exit_info.value.code == 2
    assert "autocast runs fp32 inputs under torch.autocast: use --dtype float32 with --autocast bfloat16" in (
        capsys.readouterr().err)


def test_op_bench_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--lengths", "0,5"])
    assert "positive integers" in capsys.readouterr().err


def test_option_values_are_checked_by_the_config(capsys):
    # text that is no number is refused by the parser; a number out of bounds by the config dataclass
    with pytest.raises(SystemExit):
        main(["demo", "--length", "abc"])
    assert "argument --length: must be an integer, got 'abc'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--heads", "0"])
    assert "--heads must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--peers", "no-such-peer"])
    assert "unknown peer(s) 'no-such-peer' (choose from: performer-pytorch" in capsys.readouterr().err


def test_train_help_lists_the_settings(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--set KEY=VALUE" in out and "betas = [0.9,0.95]: AdamW's betas" in out
    assert "seq_len = 256: tokens per training window" in out
