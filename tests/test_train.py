"""kernelmix.training: config, training loop, exact resumption, crash-safe checkpoints,
multi-process (torchrun, gloo) runs and the errors a user can run into.

Tiny preset on a 7 KB fixture corpus (tests/fixtures/train_corpus, byte tokens); the token cache
lives in a per-module temporary directory."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernelmix.cli import main as cli_main
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.training import (
    CheckpointError,
    TrainConfig,
    build_config,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    lr_at,
    param_groups,
    redraw_random_features,
    run_config,
    train,
)
from kernelmix.training.config import RESOLVED_FORMAT

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).parent / "fixtures" / "train_corpus")
REPO = Path(__file__).resolve().parents[1]

# The reference run of the resume tests: dropout (the RNG state must be restored), Performer layers
# redrawn every 3 steps (the redraw must follow the step, not the process's history), a checkpoint
# every 4 steps (keep 2), evaluation every 4 steps.
REF = dict(
    preset="tiny", corpus=CORPUS, seq_len=32, batch_size=4, steps=8, lr=3e-3, warmup_steps=2,
    eval_every=4, eval_batches=2, log_every=3, checkpoint_every=4, redraw_every=3, seed=1,
    model={"mixer": "performer", "dropout": 0.1}, device="cpu",  # exactness is a CPU promise
)


# token caches in a temporary directory per module (also used by subprocesses)
data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted reference run (one thread, like every test here: see conftest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(TrainConfig(**REF, out_dir=str(tmp_path_factory.mktemp("ref") / "run")), progress=False)
    finally:
        torch.set_num_threads(threads)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file below ``directory`` with the hash of its bytes (not the writer lock's files: a
    refused writer may have held the lock for a moment)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.startswith(".kernelmix.lock")
    }


def metric_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# 1. End to end


def test_train_end_to_end_loss_decreases(tmp_path, capsys):
    out = tmp_path / "run"
    config = TrainConfig(
        preset="tiny", corpus=CORPUS, seq_len=64, batch_size=8, steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=3,
        eval_every=10, eval_batches=4, log_every=5, checkpoint_every=10, out_dir=str(out),
    )
    result = train(config, progress=True)  # the rich bar, rendered into captured output

    assert (result.start_step, result.final_step, result.total_steps) == (0, 30, 30)
    assert sorted(result.losses) == list(range(1, 31))
    assert sorted(result.val_losses) == [0, 10, 20, 30]
    first, last = [result.losses[s] for s in (1, 2, 3)], [result.losses[s] for s in (28, 29, 30)]
    assert sum(first) / 3 > sum(last) / 3 + 1.0, result.losses  # from ln 256 ≈ 5.5 to below ≈ 3.5
    assert result.val_losses[30] < result.val_losses[0] - 1.0, result.val_losses
    assert abs(result.val_losses[0] - math.log(256)) < 0.2  # a fresh model is near uniform
    assert result.tokens_seen == 30 * 8 * 64 and result.tokens_per_s > 0

    # metrics: one train line per step, one eval line per evaluation, with the promised fields
    lines = metric_lines(out)
    train_lines = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train_lines] == list(range(1, 31))
    assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "wall_s"} <= set(train_lines[0])
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 10, 20, 30]
    assert train_lines[-1]["tokens"] == 30 * 8 * 64 and train_lines[-1]["loss"] == result.losses[30]
    assert train_lines[1]["lr"] == pytest.approx(2e-3) and train_lines[-1]["lr"] == pytest.approx(lr_at(29, config, 30))

    # the resolved config: train settings, the full model config, run facts; it rebuilds the config
    record = json.loads((out / "config.json").read_text())
    assert record["format"] == RESOLVED_FORMAT
    assert record["model"] == json.loads(config.model_config(256).to_json())
    assert record["run"]["global_batch"] == 8 and record["run"]["tokens_per_step"] == 512
    assert TrainConfig.from_dict(record) == config

    # the checkpoints: the newest two, loadable into a model that reproduces the final val loss
    assert [s for s, _ in list_checkpoints(out)] == [20, 30] and result.checkpoint == latest_checkpoint(out)
    ckpt = load_checkpoint(result.checkpoint)
    assert ckpt.step == 30 and "lm_head.weight" not in ckpt.weights  # tied: stored once
    model = CausalLM(ModelConfig.from_dict(ckpt.config["model"]))
    model.load_state_dict({**ckpt.weights, "lm_head.weight": ckpt.weights["embed.weight"]})
    assert ckpt.state["tokens_seen"] == result.tokens_seen and ckpt.state["data"]["step"] == 30
    assert "30/30 loss" in capsys.readouterr().err  # the bar (on stderr)


def test_token_budget_and_bf16_autocast(tmp_path):
    config = TrainConfig(
        preset="tiny", corpus=CORPUS, seq_len=32, batch_size=4, tokens=300, bf16=True, warmup_steps=1,
        eval_batches=1, out_dir=str(tmp_path / "run"),
    )
    result = train(config, progress=False)
    assert result.total_steps == result.final_step == 3  # ceil(300 / (4 · 32))
    assert all(math.isfinite(v) for v in [*result.losses.values(), *result.val_losses.values()])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["run"]["total_steps"] == 3


# ---------------------------------------------------------------------------------------------
# 2. Resumption and crash safety


def test_resume_continues_exactly(reference, tmp_path):
    """Stop after step 5 (mid-way between checkpoints, after one redraw), resume to 8: every loss
    and validation loss is bitwise the uninterrupted run's."""
    out = tmp_path / "run"
    config = TrainConfig(**REF, out_dir=str(out))
    first = train(config, stop_at=5, progress=False)
    assert first.final_step == 5 and latest_checkpoint(out).name == "step_00000005"
    second = train(config, resume=True, progress=False)
    assert (second.start_step, second.final_step) == (5, 8)
    assert {**first.losses, **second.losses} == reference.losses
    assert {**first.val_losses, **second.val_losses} == reference.val_losses
    assert [r["step"] for r in metric_lines(out) if r["kind"] == "train"] == list(range(1, 9))
    # the final weights are bitwise those of the uninterrupted run
    ours, theirs = load_checkpoint(latest_checkpoint(out)), load_checkpoint(reference.checkpoint)
    assert ours.weights.keys() == theirs.weights.keys()
    assert all(torch.equal(ours.weights[k], theirs.weights[k]) for k in ours.weights)


KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    import kernelmix.training.checkpoint as checkpoint
    from kernelmix.training import TrainConfig, train

    torch.set_num_threads(1)
    real_write_state = checkpoint.write_state
    saves = []

    def write_state_then_die(state, path):
        saves.append(state["step"])
        real_write_state(state, path)
        if len(saves) == 2:  # the second checkpoint: half of state.pt is on disk when the kill comes
            data = path.read_bytes()
            with open(path, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.write_state = write_state_then_die
    train(TrainConfig(**json.loads(sys.argv[1])), progress=False)
    """
)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(reference, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "die.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps({**REF, "out_dir": str(out)})],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, proc.stderr  # killed by SIGKILL inside the second save (step 8)
    root = out / "checkpoints"
    assert [s for s, _ in list_checkpoints(out)] == [4]
    assert any(p.name.startswith(".tmp-step_00000008") for p in root.iterdir())  # the half-written one
    assert load_checkpoint(root / "step_00000004").step == 4

    resumed = train(TrainConfig(**REF, out_dir=str(out)), resume=True, progress=False)
    assert resumed.start_step == 4
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s > 4}
    assert [s for s, _ in list_checkpoints(out)] == [4, 8]
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # debris cleaned by the next save
    # metrics written after the step-4 checkpoint by the killed run were dropped, then rewritten once
    assert [r["step"] for r in metric_lines(out) if r["kind"] == "train"] == list(range(1, 9))


def test_failed_checkpoint_write_raises_and_keeps_the_previous_one(reference, tmp_path, monkeypatch):
    import kernelmix.training.checkpoint as checkpoint

    out = tmp_path / "run"
    real = checkpoint.write_weights
    calls = []

    def disk_full(weights, path):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        real(weights, path)

    monkeypatch.setattr(checkpoint, "write_weights", disk_full)
    with pytest.raises(CheckpointError, match=r"cannot write '.*step_00000008': No space left on device; free space or "
                                              r"choose another --out; "
                                              r"the previous checkpoint '.*step_00000004' is intact"):
        train(TrainConfig(**REF, out_dir=str(out)), progress=False)
    assert [s for s, _ in list_checkpoints(out)] == [4]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000004"]  # the temporary dir is gone
    monkeypatch.setattr(checkpoint, "write_weights", real)
    resumed = train(TrainConfig(**REF, out_dir=str(out)), resume=True, progress=False)
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s > 4}


# ---------------------------------------------------------------------------------------------
# 3. Many processes: torchrun, gloo


def _torchrun(tmp_path: Path, out: Path, sets: list[str], nproc: int = 2,
              raw: bool = False) -> subprocess.CompletedProcess:
    args = sets if raw else [arg for s in sets for arg in ("--set", s)]
    # --standalone: a local rendezvous on a free port; OMP_NUM_THREADS=1: two processes on two cores
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "-m", "kernelmix.cli", "train", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


DIST = dict(
    preset="tiny", corpus=CORPUS, seq_len=32, batch_size=4, steps=4, lr=3e-3, warmup_steps=1, eval_every=2,
    eval_batches=3, log_every=1, checkpoint_every=2, redraw_every=2, model={"mixer": "performer"}, device="cpu",
)


@pytest.mark.parametrize("mode",
                         ["ddp", "fsdp", "fsdp-checkpointed", pytest.param("ddp-compiled", marks=pytest.mark.slow)])
def test_two_processes_match_one_process_at_the_same_global_batch(tmp_path, mode):
    """2 processes × batch 4 (DDP or FSDP2 over gloo) vs 1 process × batch 4 × grad_accum 2.

    Both see the same 8 windows per step (the sampler shard of a micro-batch depends only on the
    global batch) and the same Performer redraws (seeded by step), so the math is the same and
    only the order of float32 sums differs (averaging gradients over processes vs accumulating
    them): ~1e-7 relative per step, which Adam's normalised updates carry over a few steps at that
    order. 1e-4 relative is far below what a real mismatch gives (different data, unsynchronised
    gradients or redraws move the loss by >1e-2 at the second step). The trainer's parallelize
    applies activation checkpointing before FSDP2 (fsdp-checkpointed) and compiles the blocks
    inside DDP (ddp-compiled).

    ddp-compiled is compared with one *compiled* process. Measured (this test's settings):
    2 compiled processes give one compiled process's weights bitwise, as 2 eager ones give one
    eager process's, so DDP synchronises compiled blocks' gradients exactly. Compiled against eager,
    inductor's fused kernels sum in another order (gradients ~1e-7 relative apart), and Adam's
    normalised update amplifies that where an element's gradients nearly cancel: after 4 steps one
    of 123,200 weights (blocks.0.mixer.o_proj[12, 34], gradient ~1e-5, 40x below the median) is
    6.6e-5 from eager's, the whole tensor 9e-5 relative — outside the weight check's 1e-3 / 1e-5
    elementwise, and no defect of the distributed code."""
    sets = [f"{k}={json.dumps(v)}" for k, v in DIST.items() if k != "model"] + ["model.mixer=performer"]
    if mode.startswith("fsdp"):
        sets.append("fsdp=true")
    if mode == "fsdp-checkpointed":
        sets.append("activation_checkpointing=full")
    if mode == "ddp-compiled":
        sets.append("compile=true")
    out = tmp_path / "two"
    proc = _torchrun(tmp_path, out, sets)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    compiled = {"compile": mode == "ddp-compiled"}  # the same kernels on both sides (see above)
    one = train(TrainConfig(**DIST, grad_accum=2, **compiled, out_dir=str(tmp_path / "one")), progress=False)

    lines = metric_lines(out)  # written by rank 0 only: one line per step, not one per process
    losses = {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}
    val_losses = {r["step"]: r["val_loss"] for r in lines if r["kind"] == "eval"}
    assert len([r for r in lines if r["kind"] == "train"]) == 4
    assert losses.keys() == one.losses.keys() and val_losses.keys() == one.val_losses.keys() == {0, 2, 4}
    for step in losses:
        assert losses[step] == pytest.approx(one.losses[step], rel=1e-4), (step, losses, one.losses)
    for step in val_losses:
        assert val_losses[step] == pytest.approx(one.val_losses[step], rel=1e-4), (step, val_losses, one.val_losses)
    record = json.loads((out / "config.json").read_text())
    assert record["run"]["world_size"] == 2 and record["run"]["global_batch"] == 8
    # the checkpoint of the 2-process run holds both processes' RNG states and full (unsharded) weights
    ckpt = load_checkpoint(latest_checkpoint(out))
    assert len(ckpt.state["rng"]) == 2
    ref = load_checkpoint(latest_checkpoint(tmp_path / "one"))
    for name, tensor in ref.weights.items():
        assert torch.allclose(ckpt.weights[name], tensor, rtol=1e-3, atol=1e-5), name

    # resume from the step-2 checkpoint: FSDP loads the full state into its shards (2 processes
    # again); the DDP checkpoint continues in one process with grad_accum=2 (same global batch)
    shutil.rmtree(latest_checkpoint(out))
    if mode.startswith("fsdp"):
        proc = _torchrun(tmp_path, out, ["--resume"], raw=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        resumed = {r["step"]: r["loss"] for r in metric_lines(out) if r["kind"] == "train"}
    else:
        resumed = train(TrainConfig(**DIST, grad_accum=2, **compiled, out_dir=str(out)), resume=True,
                        progress=False).losses
    for step in (3, 4):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-4), (step, resumed, losses)


# ---------------------------------------------------------------------------------------------
# 4. Bad input: clear errors, nothing overwritten


@pytest.fixture
def finished_run(reference, tmp_path) -> Path:
    """A copy of the reference run (checkpoints at steps 4 and 8) to damage."""
    out = tmp_path / "run"
    shutil.copytree(reference.out_dir, out)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": {"mixer": "cubit"}}, r"another model config \(.*mixer: 'performer' in the checkpoint, 'cubit' now"),
        ({"model": {"mixer": "performer", "dropout": 0.1, "hidden_size": 128}}, r"another model config .*hidden_size"),
        ({"seed": 2}, r"other settings \(seed: 1 in the checkpoint, 2 now\)"),
        ({"batch_size": 8}, r"global batch of 4 sequences .* this run has 8"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_config(finished_run, change, message):
    before = snapshot(finished_run)
    with pytest.raises(CheckpointError, match=message) as error:
        train(TrainConfig(**{**REF, **change, "steps": 12}, out_dir=str(finished_run)), resume=True, progress=False)
    assert ("--resume --out DIR` without --config/--set reuses them" in str(error.value)
            or "grad_accum" in str(error.value))
    assert snapshot(finished_run) == before


def test_a_truncated_newest_checkpoint_is_named_and_resume_falls_back(reference, finished_run):
    latest = finished_run / "checkpoints" / "step_00000008"
    weights = latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.warns(UserWarning, match=rf"'{weights}' is truncated or corrupt: 1000 bytes.*resuming from the newest "
                                         r"valid checkpoint '.*step_00000004' instead"):
        resumed = train(TrainConfig(**REF, out_dir=str(finished_run)), resume=True, progress=False)
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s > 4}
    assert load_checkpoint(latest).step == 8  # replaced by the resumed run's own step-8 checkpoint


def test_every_checkpoint_damaged_is_reported_and_nothing_changes(finished_run):
    for step in (4, 8):
        state = finished_run / "checkpoints" / f"step_{step:08d}" / "state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
        state.write_bytes(bytes(data))
    before = snapshot(finished_run)
    with pytest.raises(CheckpointError, match=r"every checkpoint of .* is damaged \(.*step_00000008/state.pt' is "
                                              r"corrupt \(SHA-256 mismatch\); "
                                              r".*step_00000004/state.pt' is corrupt.*another --out"):
        train(TrainConfig(**REF, out_dir=str(finished_run)), resume=True, progress=False)
    assert snapshot(finished_run) == before


def test_a_fresh_run_never_overwrites_and_resume_needs_a_checkpoint(finished_run, tmp_path):
    before = snapshot(finished_run)
    with pytest.raises(ValueError, match=r"already holds a training run \(checkpoints up to step 8\); pass --resume"):
        train(TrainConfig(**REF, out_dir=str(finished_run)), progress=False)
    assert snapshot(finished_run) == before
    with pytest.raises(CheckpointError,
                       match="nothing to resume: .* does not exist; check --out, or run without --resume"):
        train(TrainConfig(**REF, out_dir=str(tmp_path / "empty")), resume=True, progress=False)
    with pytest.raises(ValueError, match="stop_at must be a step >= 1"):
        train(TrainConfig(**REF, out_dir=str(tmp_path / "empty")), stop_at=0, progress=False)
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lrate=1e-3"], r"unknown training setting 'lrate' .*valid settings: preset, model, corpus"),
        (["model.mixr=cubit"], r"unknown config field\(s\) \['mixr'\]; fields are: .*mixer"),
        (["model.mixer=cubt"], r"unknown mixer 'cubt' \(choose from: softmax, cubit"),
        (["model.mixer_options.cubit.lrx=false"], r"unknown option\(s\) \['lrx'\]; accepted: .*lrr"),
        (["preset=huge"], r"unknown preset 'huge' \(choose from: tiny, mini, small"),
        (["lr=fast"], r"lr must be a number, got 'fast'"),
        (["betas=0.9"], r"betas must be two numbers, e.g. betas=\[0.9,0.95\]"),
        (["seq_len=512", "preset=tiny"], r"seq_len 512 exceeds the model's max_seq_len 256 .*model.max_seq_len=512"),
        (["steps"], r"not key=value"),
        (["lr.peak=1"], r"'lr' has no sub-settings"),
    ],
)
def test_bad_settings_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config(None, overrides)


def test_settings_are_strict_about_types_but_take_file_data(tmp_path):
    for overrides, message in [
        (['steps="3"'], "steps must be an integer, got '3'"),  # a quoted number is a string
        (["steps=2.5"], "steps must be an integer, got 2.5"),
        (["bf16=1"], "bf16 must be true or false, got 1"),
        (["steps=0"], "steps must be a positive integer, got 0"),
        (["val_fraction=1"], r"val_fraction must be a number in \[0, 1\), got 1"),
        (["betas=[0.9,1.5]"], r"betas must be two numbers in \[0, 1\), e.g. betas=\[0.9,0.95\], got \[0.9, 1.5\]"),
        (["lr=1e-4", "min_lr=1e-3"], "min_lr must be at most lr"),
        (["device=tpu"], r"unknown device 'tpu' \(choose from: auto, cpu, cuda\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_config(None, overrides)
    config = build_config(None, ["steps=2e3", "lr=1", "betas=[0, 0.5]"])  # whole floats, ints for floats, lists
    assert (config.steps, config.lr, config.betas) == (2000, 1.0, (0.0, 0.5))
    assert type(config.steps) is int and type(config.lr) is float


def test_config_files_and_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'preset = "tiny"\nsteps = 50\nbetas = [0.9, 0.99]\n[model]\nmixer = "cubit"\n'
        "mixer_options = { cubit = { lrr = false } }\n"
    )
    config = build_config(toml, ["lr=3e-4", "model.mixer_options.cubit.ridge=1e-5", "tokens=1e6", "bf16=true"])
    assert (config.preset, config.steps, config.lr, config.betas, config.tokens, config.bf16) == (
        "tiny", 50, 3e-4, (0.9, 0.99), 1_000_000, True)
    assert config.model == {"mixer": "cubit", "mixer_options": {"cubit": {"lrr": False, "ridge": 1e-5}}}
    assert config.model_config(256).mixer_options == {"cubit": {"lrr": False, "ridge": 1e-5}}

    yaml = tmp_path / "run.yaml"
    yaml.write_text("preset: tiny\nfoo: 1\n")
    pytest.importorskip("yaml")
    with pytest.raises(ValueError, match=r"unknown training setting\(s\) \['foo'\]; valid settings: preset"):
        build_config(yaml)
    ini = tmp_path / "run.ini"
    ini.write_text("[train]\n")
    with pytest.raises(ValueError, match="unknown format '.ini' \\(use .toml, .yaml, .yml or .json\\)"):
        build_config(ini)


def test_cli_train_resume_and_errors(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'preset = "tiny"\ncorpus = "{CORPUS}"\nseq_len = 32\nbatch_size = 4\nsteps = 3\nwarmup_steps = 1\n'
        "eval_batches = 1\nlog_every = 1\n"
    )
    out = tmp_path / "run"
    assert cli_main(["train", "--config", str(toml), "--set", "model.mixer=cubit", "--out", str(out)]) == 0
    assert "step 3/3" in capsys.readouterr().out
    # --resume alone reuses the run's settings (the cubit mixer included); --set with --reschedule extends the run
    assert run_config(None, ["steps=5"], out_dir=out, resume=True).model == {"mixer": "cubit"}
    assert cli_main(["train", "--resume", "--reschedule", "--out", str(out), "--set", "steps=5"]) == 0
    assert [r["step"] for r in metric_lines(out) if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert json.loads((out / "config.json").read_text())["model"]["mixer"] == "cubit"
    capsys.readouterr()

    assert cli_main(["train", "--config", str(toml), "--out", str(out)]) == 2  # a fresh run over an old one
    assert "already holds a training run (checkpoints up to step 5); pass --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--set", "lrate=1", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "unknown training setting 'lrate'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Pieces


def test_warmup_then_cosine_to_min_lr():
    config = TrainConfig(preset="tiny", lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=111)
    lrs = [lr_at(s, config, 111) for s in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # linear warmup to the peak
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # then non-increasing
    assert lrs[60] == pytest.approx(5.5e-4)  # half-way: the mean of lr and min_lr
    assert lrs[-1] == pytest.approx(1e-4)  # the last update uses min_lr


def test_weight_decay_only_on_linear_weights():
    model = CausalLM(ModelConfig.preset("tiny", mixer="darkformer"))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decayed) + len(kept) == len(names)  # every parameter once (the tied head is the embedding)
    assert "embed.weight" in kept and "norm.weight" in kept and "blocks.0.mixer.transform" in kept
    assert "blocks.0.mixer.q_proj.weight" in decayed and "blocks.1.mlp.down_proj.weight" in decayed
    assert all(".weight" in n and "norm" not in n for n in decayed)


def test_redraw_is_a_function_of_seed_and_step():
    torch.manual_seed(0)
    a = CausalLM(ModelConfig.preset("tiny", mixer="performer"))
    torch.manual_seed(1)
    b = CausalLM(ModelConfig.preset("tiny", mixer="performer"))
    assert redraw_random_features(a, 7, 100) == redraw_random_features(b, 7, 100) == 2
    wa = [blk.mixer.projection.clone() for blk in a.blocks]
    assert all(torch.equal(x, blk.mixer.projection) for x, blk in zip(wa, b.blocks))  # any process, any history
    assert not torch.equal(wa[0], wa[1])  # layers differ
    redraw_random_features(a, 7, 101)
    assert not torch.equal(wa[0], a.blocks[0].mixer.projection)  # steps differ


def test_schedule_of_evaluations_checkpoints_and_the_stop():
    from kernelmix.training.trainer import Schedule

    fresh = Schedule(total_steps=10, eval_every=4, checkpoint_every=3, stop_at=5)
    assert [s for s in range(11) if fresh.eval_due(s)] == [0, 4, 8, 10]
    assert [s for s in range(11) if fresh.save_due(s)] == [3, 5, 6, 9, 10]  # and where stop_at ends the run
    assert [s for s in range(11) if fresh.stopping(s)] == [5, 10]
    resumed = Schedule(total_steps=10, start_step=4, resumed=True, eval_every=4, stop_at=5, save_at_stop=False)
    assert [s for s in range(4, 11) if resumed.eval_due(s)] == [8, 10]  # step 4 was evaluated before its checkpoint
    assert [s for s in range(4, 11) if resumed.save_due(s)] == [10]
    assert not Schedule(total_steps=10, can_evaluate=False).eval_due(0)


def test_a_skipped_update_leaves_parameters_and_optimizer_as_they_were():
    from kernelmix.training.trainer import optimizer_step

    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    x = torch.ones(2, 3)
    for bad in (float("nan"), float("inf")):
        loss_of = lambda batch: (layer(batch) * bad).mean()  # noqa: E731
        outcome = optimizer_step(optimizer, [x], loss_of, params=list(layer.parameters()), grad_clip=1.0,
                                 skip_non_finite=True)
        assert not outcome.updated and not torch.isfinite(outcome.grad_norm)
    # a finite loss with a non-finite gradient: skipped too
    handle = layer.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    outcome = optimizer_step(optimizer, [x], lambda batch: layer(batch).mean(), params=list(layer.parameters()),
                             grad_clip=1.0, skip_non_finite=True)
    handle.remove()
    assert not outcome.updated and torch.isfinite(outcome.loss) and not torch.isfinite(outcome.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters())) and not optimizer.state
    assert all(p.grad is None for p in layer.parameters())
    outcome = optimizer_step(optimizer, [x, x], lambda batch: layer(batch).pow(2).mean(),
                             params=list(layer.parameters()), grad_clip=0.0)
    assert outcome.updated and not torch.equal(before[0], layer.weight)  # two micro-batches, one update


def test_a_run_shorter_than_its_warmup_is_warned_about(tmp_path):
    # kernelmix train --set steps=20 with the default 100 warmup steps never reached its lr, silently
    config = TrainConfig(preset="tiny", corpus=CORPUS, seq_len=32, batch_size=2, steps=3, warmup_steps=100,
                         eval_every=0, out_dir=str(tmp_path / "run"))
    with pytest.warns(UserWarning, match=r"warmup_steps=100 is not below the run's 3 steps.*warmup_steps=1"):
        train(config, progress=False)


def test_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch):
    """The first SIGINT finishes the step and saves (tests/reliability/test_training.py sends real
    ones); a second one means "now": KeyboardInterrupt at once, nothing saved, the usual handler back.
    The loop's handler is called directly, twice, as the interpreter would for two Ctrl-Cs: sent with
    os.kill from inside the step, the second signal was sometimes acted on only after the step's
    boundary had saved (2 of 4 fresh-clone suite runs, never alone; cause not found)."""
    import signal

    from kernelmix.training.loop import PretrainTrainer

    before, real = signal.getsignal(signal.SIGINT), PretrainTrainer.after_step

    def after_step(self, step, outcome):
        stop = real(self, step, outcome)
        if step == 2:
            handler = signal.getsignal(signal.SIGINT)  # the loop's own (catch_stop_signals)
            handler(signal.SIGINT, None)
            handler(signal.SIGINT, None)
        return stop

    monkeypatch.setattr(PretrainTrainer, "after_step", after_step)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # "the usual handler": Python's own
    try:
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(**REF, out_dir=str(tmp_path / "run")), progress=False)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not list_checkpoints(tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, before)


def test_activation_checkpointing_trains_bitwise_the_same_and_may_change_on_resume(reference, tmp_path):
    """The trainer goes through parallelize: the reference run (dropout, redraws) with every block
    recomputed has bitwise the same losses; resumed from a run without it (the setting may change on
    resume: it changes no number), it continues bitwise too."""
    run = tmp_path / "ac"
    result = train(TrainConfig(**REF, out_dir=str(run), activation_checkpointing="full"), progress=False)
    assert result.losses == reference.losses and result.val_losses == reference.val_losses
    shutil.rmtree(run)
    train(TrainConfig(**REF, out_dir=str(run)), stop_at=4, progress=False)
    resumed = train(TrainConfig(**REF, out_dir=str(run), activation_checkpointing="selective",
                                activation_checkpointing_every=1), resume=True, progress=False)
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s > 4}


@pytest.mark.parametrize("overrides, message", [
    (["activation_checkpointing=some"], "activation_checkpointing"),
    (["compile=maybe"], "compile"),
])
def test_scale_options_through_set(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config(None, overrides)
    assert build_config(None, ["activation_checkpointing=selective", "compile=true"]).compile is True


def test_resume_may_change_the_backend_but_not_the_model(tmp_path):
    """`backend` says which kernels compute the same numbers (a CPU run resumed on a GPU): a resume
    may change it; any other model field is still refused."""
    settings = {**REF, "steps": 4, "eval_every": 0, "checkpoint_every": 2, "out_dir": str(tmp_path / "run")}
    train(TrainConfig(**{**settings, "steps": 2}), progress=False)
    resumed = train(TrainConfig(**{**settings, "model": {**REF["model"], "backend": "torch"}}), resume=True,
                    progress=False, reschedule=True)
    assert resumed.start_step == 2
    with pytest.raises(CheckpointError, match="dropout: 0.1 in the checkpoint, 0.0 now"):
        train(TrainConfig(**{**settings, "steps": 6, "model": {"mixer": "performer"}}), resume=True, progress=False)


def test_the_periodic_check_changes_no_training_number(reference, tmp_path):
    """The validation check only reads the model (with dropout and redraws in the run): sampling another
    set of windows (the whole split instead of 2 spread batches) leaves every training loss bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        other = train(TrainConfig(**{**REF, "eval_batches": 0}, out_dir=str(tmp_path / "run")), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert other.losses == reference.losses
    assert other.val_losses.keys() == reference.val_losses.keys() and other.val_losses != reference.val_losses
