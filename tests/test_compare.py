"""kernelmix.compare: 2 mixers × 2 lengths × a few steps on the fixture corpus write valid
results.json / results.md / PNGs, finished runs are reused, an interrupted run is redone, and
bad input gives clear errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kernelmix.cli import main as cli_main
from kernelmix.studies.compare import CompareConfig, run_compare

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).parent / "fixtures" / "train_corpus")
PNG = b"\x89PNG\r\n\x1a\n"


# token caches in a temporary directory per module (also used by subprocesses)
data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


def small(out: Path, **overrides) -> CompareConfig:
    settings = dict(mixers=["softmax", "cubit-nolrr"], lengths=[32, 64], steps=3, tokens_per_step=128,
                    corpus=CORPUS, out_dir=str(out), eval_docs=2, warmup_steps=1)
    return CompareConfig(**{**settings, **overrides})


def test_compare_writes_results_and_reuses_finished_runs(tmp_path):
    config = small(tmp_path / "cmp")
    results = run_compare(config, progress=False)
    out = tmp_path / "cmp"
    data = json.loads((out / "results.json").read_text())
    assert data["budget"]["equal"] == "tokens" and data["budget"]["tokens_per_run"] == 3 * 128
    assert len(data["runs"]) == 4 and data["reused_runs"] == 0
    for run in data["runs"]:
        assert run["tokens"] == 384 and run["batch_size"] == 128 // run["length"]
        assert run["val_loss"] > 0 and run["tokens_per_s"] > 0 and len(run["curve"]) == 3
        assert sum(b["tokens"] for b in run["buckets"]) == run["val_tokens"]
    # both lengths are evaluated on the same held-out tokens
    assert len({r["val_tokens"] for r in data["runs"]}) == 1
    assert {(r["mixer"], r["length"]) for r in data["summary"]} == {(m, t) for m in config.mixers for t in (32, 64)}
    md = (out / "results.md").read_text()
    assert "| softmax |" in md and "| cubit-nolrr |" in md and "T=64" in md and "384 training tokens" in md
    for name in ("val_loss_vs_length.png", "loss_curves.png", "throughput.png", "loss_by_position.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert sorted(results["plots"]) == sorted(p.name for p in out.glob("*.png"))

    # run again: every run reused, same numbers
    again = run_compare(config, progress=False)
    assert again["reused_runs"] == 4
    assert [r["val_loss"] for r in again["runs"]] == [r["val_loss"] for r in data["runs"]]

    # an interrupted run (no result.json, no checkpoint) is started over; others are reused
    victim = Path(data["runs"][0]["run_dir"])
    shutil.rmtree(victim / "checkpoints")
    (victim / "result.json").unlink()
    third = run_compare(config, progress=False)
    assert third["reused_runs"] == 3
    assert third["runs"][0]["val_loss"] == pytest.approx(data["runs"][0]["val_loss"], rel=1e-5)

    # other settings: new runs, in their own directories
    more = run_compare(small(tmp_path / "cmp", steps=4, mixers=["softmax"], lengths=[32]), progress=False)
    assert more["reused_runs"] == 0 and more["runs"][0]["tokens"] == 4 * 128


def test_seeds_give_mean_and_spread_and_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli_main(["compare", "--mixers", "softmax", "--lengths", "32", "--seeds", "0,1", "--steps", "2",
                     "--tokens-per-step", "64", "--corpus", CORPUS, "--eval-docs", "2", "--out", str(out),
                     "--set", "hidden_size=32", "--threads", str(torch.get_num_threads())])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    (row,) = data["summary"]
    assert row["seeds"] == 2 and row["val_loss_sd"] > 0
    assert data["runs"][0]["parameters"] < 115_008  # the --set model override reached the runs
    assert "±" in (out / "results.md").read_text()
    assert "Validation loss" in capsys.readouterr().out


def test_bad_input_gives_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown mixer\(s\) 'cubt' \(choose from: softmax, cubit, cubit-nolrr"):
        small(tmp_path, mixers=["cubt"])
    with pytest.raises(ValueError, match="not a multiple of length 48"):
        small(tmp_path, lengths=[48])
    with pytest.raises(ValueError, match="unknown preset"):
        small(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="model.* settings|unknown config field"):
        small(tmp_path, model={"hiden_size": 3})
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        run_compare(small(tmp_path, corpus="nope"), progress=False)
    with pytest.raises(SystemExit):
        cli_main(["compare", "--mixers", "softmax,cubt"])
    assert "unknown mixer(s) 'cubt'" in capsys.readouterr().err
    assert cli_main(["compare", "--mixers", "softmax", "--corpus", "no/such/dir", "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_torchrun_two_processes_match_one(tmp_path):
    """`torchrun --nproc_per_node=2 -m kernelmix.cli compare`: each process trains half of every
    step's windows (DDP over gloo), rank 0 writes the outputs; the validation losses equal the
    one-process run's up to the order of float32 sums (see test_train's DDP test for the bound)."""
    import subprocess
    import sys

    args = ["--mixers", "softmax,performer", "--lengths", "32", "--steps", "3", "--tokens-per-step", "128",
            "--corpus", CORPUS, "--eval-docs", "2", "--warmup-steps", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "kernelmix.cli",
         "compare", *args, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("| mixer | [0, 32) |") == 1  # one report, from rank 0
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["machine"]["processes"] == 2 and all(r["batch_size"] == 2 for r in two["runs"])  # 4 windows / 2 ranks
    one = run_compare(small(tmp_path / "one", mixers=["softmax", "performer"], lengths=[32]), progress=False)
    for a, b in zip(one["runs"], two["runs"]):
        assert (a["mixer"], a["tokens"]) == (b["mixer"], b["tokens"])
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4)


def test_mixer_options_reach_only_their_mixer():
    config = CompareConfig(mixers=["softmax", "performer"], model={"mixer_options": {"performer": {"num_features": 64}}})
    assert "mixer_options" not in config.model_overrides("softmax")
    assert config.model_overrides("performer")["mixer_options"] == {"performer": {"num_features": 64}}
    with pytest.raises(ValueError, match=r"mixer_options for performer, which no compared run uses.*add the mixer"):
        CompareConfig(mixers=["softmax", "cubit"], model={"mixer_options": {"performer": {"num_features": 64}}})


@pytest.mark.parametrize("model, message", [
    ({"mixer": "cubit"}, r"sets each run's mixer from --mixers.*pass --mixers"),
    ({"model": {"hidden_size": 128}}, r"without a 'model\.' prefix: write --set hidden_size=128"),
])
def test_model_overrides_compare_would_lose_are_refused(model, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig(model=model)
