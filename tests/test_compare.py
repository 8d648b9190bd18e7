"""kernelmix.compare: 2 mixers × 2 lengths × a few steps on the fixture corpus write valid
results.json / results.md / PNGs, finished runs are reused, an interrupted run is redone, and
bad input gives clear errors."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kernelmix.cli import main as cli_main
from kernelmix.errors import KernelmixError
from kernelmix.studies.compare import MIXER_VARIANTS, CompareConfig, plan_budget, run_compare

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).parent / "fixtures" / "train_corpus")
PNG = b"\x89PNG\r\n\x1a\n"


# token caches in a temporary directory per module (also used by subprocesses)
data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


def small(out: Path, **overrides) -> CompareConfig:
    settings = dict(preset="tiny", mixers=["softmax", "cubit-nolrr"], lengths=[32, 64], steps=3, tokens_per_step=128,
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
        assert run["threads"] == torch.get_num_threads()
        assert run["flops"] == 384 * run["flops_per_token"] > 0 and run["train_s"] > 0  # every budget reports all three
        assert sum(b["tokens"] for b in run["buckets"]) == run["val_tokens"]
    # both lengths are evaluated on the same held-out tokens
    assert len({r["val_tokens"] for r in data["runs"]}) == 1
    assert {(r["mixer"], r["length"]) for r in data["summary"]} == {(m, t) for m in config.mixers for t in (32, 64)}
    md = (out / "results.md").read_text()
    assert "| softmax |" in md and "| cubit-nolrr |" in md and "T=64" in md and "384 training tokens" in md
    reference = data["reference"]  # unigram/bigram tables of the same validation tokens
    assert reference["tokens"] == data["evaluation"]["predicted_tokens"] and reference["unigram"] > 0
    assert f"unigram {reference['unigram']:.3f}, bigram {reference['bigram']:.3f}" in md
    for name in ("val_loss_vs_length.png", "loss_curves.png", "throughput.png", "loss_by_position.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert sorted(results["plots"]) == sorted(p.name for p in out.glob("*.png"))
    for name in results["plots"]:  # results.md links every plot written beside it
        assert f"[{name}]({name})" in md
    unit = "nats/byte" if config.tokenizer == "byte" else "nats/token"  # one unit name, the tokenizer's
    assert f"## Validation loss ({unit})" in md

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
                     "--warmup-steps", "1", "--tokens-per-step", "64", "--corpus", CORPUS, "--eval-docs", "2", "--out",
                     str(out), "--set", "hidden_size=32", "--threads", str(torch.get_num_threads())])
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

    args = ["--preset", "tiny", "--mixers", "softmax,performer", "--lengths", "32", "--steps", "3", "--tokens-per-step",
            "128", "--corpus", CORPUS, "--eval-docs", "2", "--warmup-steps", "1"]
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
    config = CompareConfig(mixers=["softmax", "performer"],
                           model={"mixer_options": {"performer": {"num_features": 64}}})
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


# ---------------------------------------------------------------------------------------------
# Budgets (issue 14 item 2): tokens, FLOPs or time


def training_flops(mixer: str, length: int) -> float:
    """Training FLOPs per token of the small() runs' model (preset tiny, bytes), counted here."""
    from kernelmix.model import ModelConfig
    from kernelmix.studies.flops import model_flops

    base, options = MIXER_VARIANTS[mixer]
    return model_flops(ModelConfig.preset("tiny", mixer=base, mixer_options=options), length).training


def stopped_at(run: dict) -> int:
    """The last training step a run's own metrics.jsonl logged."""
    lines = (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return max(json.loads(line)["step"] for line in lines if json.loads(line)["kind"] == "train")


class TestFlopBudget:
    def test_every_mixer_trains_the_steps_the_formula_says_and_stops_there(self, tmp_path):
        console_text = io.StringIO()
        config = small(tmp_path / "flops", mixers=["softmax", "performer"], steps=10, budget="flops")
        results = run_compare(config, progress=False, console=Console(file=console_text, width=400))
        assert results["budget"]["equal"] == "flops"
        differ = 0
        for run in results["runs"]:
            mixer, length = run["mixer"], run["length"]
            reference = 10 * 128 * training_flops("softmax", length)
            expected = max(1, round(reference / (training_flops(mixer, length) * 128)))
            differ += expected != 10
            assert run["steps"] == expected == stopped_at(run) and run["tokens"] == expected * 128
            assert run["flops"] == pytest.approx(run["tokens"] * training_flops(mixer, length), rel=1e-12)
            assert abs(run["flops"] - reference) <= training_flops(mixer, length) * 128 / 2  # the nearest step
            assert run["train_s"] > 0
            trained = json.loads((Path(run["run_dir"]) / "config.json").read_text())["train"]
            # warmup 1 of 10, scaled
            assert trained["steps"] == expected and trained["warmup_steps"] == round(expected / 10)
        assert differ  # Performer costs more per token than softmax at these lengths: fewer steps
        md = (tmp_path / "flops" / "results.md").read_text()
        assert md.splitlines()[2].startswith("Equal budget: **training FLOPs**")
        assert "| performer | 32 | " in md  # the cost table: steps, tokens, FLOPs, seconds per run
        assert len(results["plots"]) == 4 and all((tmp_path / "flops" / p).read_bytes()[:8] == PNG
                                                  for p in results["plots"])

        # the progress lines: run i of n, elapsed, and the time left once a run has finished
        text = console_text.getvalue()
        assert "[1/4] softmax T=32" in text and "time left known after the first run" in text
        assert "[4/4] performer T=64" in text and "elapsed, about" in text and " left" in text

        again = run_compare(config, progress=False, console=Console(file=io.StringIO()))
        assert again["reused_runs"] == 4

    def test_the_run_key_includes_the_budget(self):
        tokens, flops = CompareConfig(), CompareConfig(budget="flops")
        assert tokens.run_key("softmax", 256, 0) != flops.run_key("softmax", 256, 0)
        assert flops.run_key("performer", 256, 0, steps=30) != flops.run_key("performer", 256, 0, steps=31)


class TestTimeBudget:
    def test_a_tiny_budget_stops_where_the_calibration_says(self, tmp_path):
        config = small(tmp_path / "time", mixers=["softmax", "performer"], lengths=[32], budget="time", seconds=0.05,
                       calibration_steps=2)
        results = run_compare(config, progress=False, console=Console(file=io.StringIO()))
        budget = results["budget"]
        assert budget["equal"] == "time" and budget["reference"] == "--seconds"
        saved = json.loads((tmp_path / "time" / "calibration.json").read_text())["entries"]
        speeds = {(e["mixer"], e["length"]): e["seconds_per_step"] for e in saved.values()}
        assert set(speeds) == {("softmax", 32), ("performer", 32)}  # --seconds given: softmax only as a mixer
        for run in results["runs"]:
            expected = round(0.05 / speeds[run["mixer"], 32])  # at least 1: a budget below one step is refused
            assert budget["seconds_per_step"][run["mixer"]]["32"] == speeds[run["mixer"], 32]
            assert run["steps"] == expected == stopped_at(run) == budget["steps_per_run"][run["mixer"]]["32"]
            assert run["tokens"] == 128 * expected and run["flops"] > 0 and run["train_s"] > 0
        assert not (tmp_path / "time" / "calibration").exists()  # the calibrations' scratch runs are gone
        md = (tmp_path / "time" / "results.md").read_text()
        assert md.splitlines()[2].startswith("Equal budget: **training time**") and "noisy" in md.splitlines()[2]

        # the same command: the measured speeds are reused, so the same step counts and the finished runs
        again = run_compare(config, progress=False, console=Console(file=io.StringIO()))
        assert again["reused_runs"] == 2 and again["budget"] == budget

    def test_without_seconds_softmax_trains_steps_and_the_others_its_seconds(self):
        config = CompareConfig(mixers=["cubit", "softmax"], lengths=[256, 512], steps=40, budget="time")
        speeds = {("softmax", 256): 0.10, ("cubit", 256): 0.25, ("softmax", 512): 0.2, ("cubit", 512): 0.7}
        plan = plan_budget(config, 256, speeds)
        assert plan.reference == {256: 40 * 0.10, 512: 40 * 0.2}
        assert plan.steps == {("softmax", 256): 40, ("cubit", 256): 16, ("softmax", 512): 40, ("cubit", 512): 11}
        assert plan.to_dict(config)["reference"] == "softmax"


class TestTokenBudget:
    @pytest.mark.parametrize("folder", ["compare", "compare-tiny", "compare-long"])
    def test_committed_runs_keep_their_keys(self, folder):
        # the default budget computes what it did before budgets existed, so finished runs stay reusable
        committed = json.loads((Path(__file__).parents[1] / "results" / folder / "results.json").read_text())
        config = CompareConfig(**committed["settings"])
        assert config.budget == "tokens"
        for run in committed["runs"]:
            assert config.run_key(run["mixer"], run["length"], run["seed"]) == run["key"]

    def test_the_plan_is_steps_for_every_mixer(self):
        config = CompareConfig()
        plan = plan_budget(config, 256)
        assert set(plan.steps.values()) == {300} and plan.to_dict(config)["tokens_per_run"] == 300 * 2048


class TestBudgetErrors:
    def test_seconds_without_the_time_budget_names_the_fix(self, tmp_path, capsys):
        with pytest.raises(KernelmixError,
                           match=r"--seconds sets the time budget.*add --budget time, or drop --seconds"):
            small(tmp_path, seconds=30.0)
        with pytest.raises(SystemExit):
            cli_main(["compare", "--seconds", "30", "--out", str(tmp_path / "x")])
        assert "add --budget time" in capsys.readouterr().err

    def test_the_budget_options_are_in_the_help(self, capsys):
        with pytest.raises(SystemExit):
            cli_main(["compare", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--budget {tokens,flops,time}" in text and "--seconds SECONDS" in text and "--calibration-steps" in text
        assert "measured, so noisy" in text

    def test_an_unknown_budget_lists_the_budgets(self, tmp_path, capsys):
        with pytest.raises(ValueError, match=r"tokens, flops, time"):
            small(tmp_path, budget="wallclock")
        with pytest.raises(SystemExit):
            cli_main(["compare", "--budget", "wallclock"])
        assert "tokens" in capsys.readouterr().err


def test_recompute_options_reach_the_runs_and_keep_their_keys(tmp_path):
    plain = small(tmp_path / "cmp")
    recomputed = small(tmp_path / "cmp", activation_checkpointing="selective", activation_checkpointing_every=1)
    train = recomputed.train_config("cubit", 32, 0, "x")
    assert (train.activation_checkpointing, train.activation_checkpointing_every) == ("selective", 1)
    # recomputing changes no number (tests/test_parallelize.py), so finished runs stay reusable
    assert recomputed.run_key("cubit", 32, 0) == plain.run_key("cubit", 32, 0)
    assert small(tmp_path / "cmp", compile=True).run_key("cubit", 32, 0) != plain.run_key("cubit", 32, 0)


def test_results_md_says_when_reused_runs_trained_with_other_threads():
    from kernelmix.studies.compare import _threads_text

    runs = [{"threads": 1}, {"threads": 2}, {}]  # {}: a run saved before threads were recorded
    assert (_threads_text({"machine": {"threads": 2}, "runs": runs})
            == "2 torch threads now; the runs trained with 1 / 2")
    assert _threads_text({"machine": {"threads": 2}, "runs": runs[1:]}) == "2 torch threads"


def test_every_training_setting_that_changes_a_run_is_in_its_key(tmp_path, monkeypatch):
    """A finished run is reused when its key matches, so every TrainConfig field that can change
    its result must change the key: max_bad_steps too (it decides whether a run with skipped steps
    finishes or stops; issue 26). Only where the run is and what it recomputes are left out."""
    import dataclasses

    from kernelmix.training import TrainConfig

    config = small(tmp_path / "cmp")
    plain = config.run_key("cubit-nolrr", 32, 0)
    train = config.train_config("cubit-nolrr", 32, 0, "x")
    original = CompareConfig.train_config
    unkeyed = {"out_dir", "activation_checkpointing", "activation_checkpointing_every"}

    def other(value):
        if isinstance(value, bool):
            return not value
        if isinstance(value, (int, float)):
            return value + 1
        if isinstance(value, tuple):
            return tuple(v / 2 for v in value)
        if isinstance(value, dict):
            return {**value, "hidden_size": 96}
        return value + "-other"

    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        def changed(self, *args, name=name, **kwargs):
            run = original(self, *args, **kwargs)
            setattr(run, name, other(getattr(run, name)))
            return run

        monkeypatch.setattr(CompareConfig, "train_config", changed)
        assert (config.run_key("cubit-nolrr", 32, 0) == plain) == (name in unkeyed), name
    monkeypatch.undo()
    assert train.max_bad_steps == TrainConfig().max_bad_steps  # at the default: the committed keys are unchanged


def test_settings_import_without_torch_and_mirror_the_trainer():
    """compare's settings are what its parser reads: they import no torch, and their copy of the
    activation-checkpointing modes (training.parallelize imports torch) is the trainer's."""
    import subprocess
    import sys

    code = ("import sys; from kernelmix.studies.compare.settings import CompareConfig; "
            "print(sorted(m for m in ('torch', 'kernelmix.model', 'kernelmix.training') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
    from kernelmix.studies.compare.settings import ACTIVATION_CHECKPOINTING
    from kernelmix.training import ACTIVATION_CHECKPOINTING as trainer_modes

    assert ACTIVATION_CHECKPOINTING == trainer_modes


def test_time_left_uses_each_mixers_own_measured_cost():
    """Softmax's first run must not price Cubit's: once a (mixer, length) has trained, its later seeds
    are expected to take what it took; the others take their cost weight at the pooled rate so far."""
    from kernelmix.studies.compare.running import TimeLeft

    keys = [("softmax", 256), ("cubit", 256), ("cubit", 256), ("cubit", 256)]
    clock = TimeLeft(0.0, keys, weights=[1.0, 2.0, 2.0, 2.0], finished=[False] * 4)
    assert clock.seconds_left(0) is None  # nothing measured yet
    clock.record(0, reused=False, seconds=10.0)
    assert clock.seconds_left(1) == pytest.approx(3 * 2.0 * 10.0)  # cubit at softmax's rate, all it knows
    clock.record(1, reused=False, seconds=80.0)  # cubit costs 8× softmax, not the 2× its weight says
    assert clock.seconds_left(2) == pytest.approx(2 * 80.0)  # a pooled rate would say 90 / 3 × 4 = 120
    clock.record(2, reused=True, seconds=0.1)  # a reused run teaches nothing
    assert clock.seconds_left(3) == pytest.approx(80.0)
    done = TimeLeft(0.0, keys[:2], weights=[1.0, 2.0], finished=[True, True])
    assert done.seconds_left(0) == 0.0 and "the rest reused" in done.status(0)
