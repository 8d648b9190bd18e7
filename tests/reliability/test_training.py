"""Issue 13 (training part): training runs that lose nothing, mix nothing and stop cleanly.

One class per failure case; each test failed on the code before the fix (two runs writing one
directory, a NaN update taken and a NaN checkpoint written, a FloatingPointError or KeyboardInterrupt
traceback, a raw OSError/SafetensorError, a directory that needed deleting by hand). "Bitwise" is
checked against an uninterrupted run of the same settings with ``torch.equal`` on every tensor of
the final checkpoint (a CPU promise).

Processes: a second writer, a SIGTERM from outside and ``kill -9`` are real processes, forked from
this (already warm) interpreter so that each costs a fraction of a second instead of a fresh
Python + torch start; the child ends with ``os._exit`` and never returns into pytest."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from kernelmix.cli import main as cli_main
from kernelmix.errors import Interrupted, KernelmixError, RunDirectoryBusy
from kernelmix.locks import run_directory_lock
from kernelmix.training import TrainConfig, latest_checkpoint, list_checkpoints, load_checkpoint, train
from kernelmix.training import checkpoint as checkpoint_module
from kernelmix.training.loop import PretrainTrainer

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).resolve().parents[1] / "fixtures" / "train_corpus")

# As tests/test_train.py's resume reference: dropout (the RNG state must be restored), Performer
# projections redrawn every 3 steps, evaluation and a checkpoint every 4 steps.
REF = dict(
    preset="tiny", corpus=CORPUS, seq_len=32, batch_size=4, steps=8, lr=3e-3, warmup_steps=2,
    eval_every=4, eval_batches=2, log_every=3, checkpoint_every=4, redraw_every=3, seed=1,
    model={"mixer": "performer", "dropout": 0.1}, device="cpu",
)

data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


def config(out: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**REF, **overrides, "out_dir": str(out)})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every resumed one must equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config(tmp_path_factory.mktemp("reference") / "run"), progress=False)
    finally:
        torch.set_num_threads(threads)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(out)).weights


def assert_bitwise_equal(out: Path, reference) -> None:
    """The run in ``out`` ended where the reference did: every tensor equal, every logged loss equal,
    each step logged once."""
    ours, theirs = final_weights(out), final_weights(reference.out_dir)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    rows = [r for r in metric_rows(out) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, REF["steps"] + 1))
    assert {r["step"]: r["loss"] for r in rows} == reference.losses


def config_file(tmp_path: Path) -> Path:
    """REF as a `kernelmix train --config` file."""
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(REF))
    return path


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def every_checkpoint_is_finite(out: Path) -> bool:
    for _, path in list_checkpoints(out):
        saved = load_checkpoint(path)
        bad, _ = checkpoint_module.non_finite_tensors(saved.weights, saved.state)
        if bad:
            return False
    return True


def hook_after_step(monkeypatch, action) -> None:
    """Call ``action(trainer, step)`` after every update of ``kernelmix train`` (the test's fault injector)."""
    real = PretrainTrainer.after_step

    def after_step(self, step, outcome):
        stop = real(self, step, outcome)
        action(self, step)
        return stop

    monkeypatch.setattr(PretrainTrainer, "after_step", after_step)


def hook_before_step(monkeypatch, action) -> None:
    real = PretrainTrainer.before_step

    def before_step(self, step):
        real(self, step)
        action(self, step)

    monkeypatch.setattr(PretrainTrainer, "before_step", before_step)


# ---------------------------------------------------------------------------------------------
# Forked processes


def fork(body, output: Path | None = None) -> int:
    """Run ``body()`` in a forked child (its return value is the exit code; stdout and stderr go
    to ``output``); returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never return into pytest
        if output is not None:
            sink = open(output, "w", buffering=1)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            sys.stdout = sys.stderr = sink
        torch.set_num_threads(1)
        code = body() or 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 99
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid: int, timeout: float = 120.0) -> int:
    """The child's exit code as a shell reports it through ``os.waitstatus_to_exitcode`` (-N: killed by signal N)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish in {timeout} s")


def needs_transformers():
    pytest.importorskip("transformers")
    from tests.test_convert import tiny_gemma
    from tests.test_finetune import converted, windows

    return tiny_gemma, converted, windows


# ---------------------------------------------------------------------------------------------


class TestConcurrentWriters:
    """Two writers into one run directory: the second is refused at once, naming the first, and
    writes nothing (before: both ran, metrics.jsonl interleaved, checkpoints overwritten)."""

    @pytest.fixture
    def held(self, tmp_path):
        """Another process holding ``tmp_path / "run"`` as `kernelmix train` would; yields its pid."""
        out = tmp_path / "run"
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()

        def hold():
            with run_directory_lock(out, "kernelmix train"):
                os.write(ready_w, b"1")
                os.read(go_r, 1)  # until the test is done
            return 0

        pid = fork(hold)
        assert select.select([ready_r], [], [], 30)[0], "the lock holder did not start"
        os.read(ready_r, 1)
        yield out, pid
        os.write(go_w, b"1")
        assert wait(pid) == 0
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)

    def test_a_second_train_is_refused_naming_the_holder(self, held):
        out, pid = held
        with pytest.raises(RunDirectoryBusy, match=rf"is being written by `kernelmix train` \(pid {pid} on .*\)\. Wait "
                                                   r"for it to finish, stop it, "
                                                   r"or write to another directory \(--out\)"):
            train(config(out), progress=False)
        assert sorted(p.name for p in out.iterdir()) == [".kernelmix.lock", ".kernelmix.lock.json"]  # nothing of ours

    def test_compare_is_refused_too(self, held):
        from kernelmix.studies.compare import CompareConfig, run_compare

        out, pid = held
        with pytest.raises(RunDirectoryBusy, match=rf"pid {pid} .*write to another directory"):
            run_compare(CompareConfig(mixers=["softmax"], lengths=[32], steps=2, tokens_per_step=64, corpus=CORPUS,
                                      out_dir=str(out), warmup_steps=1), progress=False)
        assert sorted(p.name for p in out.iterdir()) == [".kernelmix.lock", ".kernelmix.lock.json"]

    def test_finetune_and_report_are_refused_too(self, held):
        out, pid = held
        tiny_gemma, converted, windows = needs_transformers()
        from kernelmix import pretrained as pt
        from kernelmix.studies import darkformer_report as rp
        from kernelmix.studies import finetune as ft

        x = windows()
        with pytest.raises(RunDirectoryBusy, match=rf"pid {pid}"):
            ft.compare_finetune(tiny_gemma(), x, x[:2], pt.FinetuneConfig(steps=2, seq_len=32), variants=("softmax",),
                                out_dir=out)
        with pytest.raises(RunDirectoryBusy, match=rf"pid {pid}"):
            pt.finetune(converted(), x, x[:2], pt.FinetuneConfig(steps=2, seq_len=32), out_dir=out)
        with pytest.raises(RunDirectoryBusy, match=rf"pid {pid}"):
            rp.darkformer_report(rp.DarkformerReportSettings.quick(), out, out.parent / "work", model=object(),
                                 tokenizer=None)
        assert sorted(p.name for p in out.iterdir()) == [".kernelmix.lock", ".kernelmix.lock.json"]

    def test_train_holds_the_lock_while_it_runs(self, tmp_path, monkeypatch):
        """In the middle of a run its directory is locked by the operating system (a fresh open of the
        lock file cannot take it) and the holder file names the run, so another process is refused."""
        import fcntl

        out, seen = tmp_path / "run", {}

        def probe(trainer, step):
            if step == 5:
                with open(out / ".kernelmix.lock", "a") as handle:
                    try:
                        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                        seen["free"] = True
                    except BlockingIOError:
                        seen["free"] = False
                seen["holder"] = json.loads((out / ".kernelmix.lock.json").read_text())

        hook_after_step(monkeypatch, probe)
        train(config(out), progress=False)
        assert seen["free"] is False
        assert (seen["holder"]["pid"], seen["holder"]["command"]) == (os.getpid(), "kernelmix train")
        assert not (out / ".kernelmix.lock.json").exists()  # released at the end


class TestNonFiniteUpdates:
    """A NaN gradient (a finite loss) used to be stepped on: every weight NaN, then a checkpoint of
    NaNs and a FloatingPointError. Now the update is skipped and counted; N in a row stop the run
    with one line naming the fix; no checkpoint ever holds NaN or Inf."""

    def test_a_nan_gradient_skips_that_update_and_is_counted(self, tmp_path, monkeypatch):
        seen = {}

        def poison(trainer, step):  # before the update from step 2 to 3 only
            if step == 2:
                weight = trainer.raw_model.blocks[0].mixer.q_proj.weight
                seen["handle"] = weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
                seen["before"] = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
                seen["moments"] = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]

        def check(trainer, step):
            if step == 3:
                seen["handle"].remove()
                seen["unchanged"] = all(
                    torch.equal(seen["before"][n], p) for n, p in trainer.raw_model.named_parameters())
                seen["moments_unchanged"] = all(
                    torch.equal(a, s["exp_avg"]) for a, s in zip(seen["moments"], trainer.optimizer.state.values()))

        hook_before_step(monkeypatch, poison)
        hook_after_step(monkeypatch, check)
        result = train(config(tmp_path / "run"), progress=False)
        assert result.final_step == 8 and result.skipped_steps == [3]
        assert seen["unchanged"] and seen["moments_unchanged"]  # the skipped update changed nothing
        rows = {r["step"]: r for r in metric_rows(tmp_path / "run") if r["kind"] == "train"}
        assert rows[3]["skipped"] and rows[3]["grad_norm"] is None and math.isfinite(rows[3]["loss"])
        assert not any(rows[s]["skipped"] for s in rows if s != 3)
        assert all(math.isfinite(v) for v in result.losses.values())
        assert every_checkpoint_is_finite(tmp_path / "run")
        assert load_checkpoint(latest_checkpoint(tmp_path / "run")).state["skipped_steps"] == [3]

    def test_bad_updates_in_a_row_stop_the_run_with_one_line(self, tmp_path, monkeypatch, capsys):
        def poison_from_step_2(trainer, step):
            if step == 2:
                trainer.raw_model.embed.weight.register_hook(lambda grad: grad * float("nan"))

        hook_before_step(monkeypatch, poison_from_step_2)
        out = tmp_path / "run"
        with pytest.raises(KernelmixError) as stopped:
            train(config(out, max_bad_steps=3), progress=False)
        message = str(stopped.value)
        assert not isinstance(stopped.value, Interrupted) and "\n" not in message
        assert message.startswith("training stopped at step 5: the last 3 updates (steps 3-5) had a non-finite loss or "
                                  "gradient norm and were skipped")
        assert "lower lr (now 0.003)" in message and "max_bad_steps=N (now 3)" in message
        assert [r["skipped"] for r in metric_rows(out) if r["kind"] == "train"] == [False, False, True, True, True]
        assert every_checkpoint_is_finite(out) and [s for s, _ in list_checkpoints(out)] == [4]

        # the command line prints that one line and exits 2, no traceback
        capsys.readouterr()
        code = cli_main(["train", "--out", str(tmp_path / "cli"), "--config", str(config_file(tmp_path)),
                         "--set", "max_bad_steps=3"])
        err = capsys.readouterr().err
        assert code == 2 and "kernelmix train: error: training stopped at step 5" in err and "Traceback" not in err

    def test_a_nan_weight_never_reaches_a_checkpoint(self, tmp_path, monkeypatch):
        def corrupt(trainer, step):  # a NaN appears in a Performer weight after the step-2 checkpoint
            if step == 3:
                with torch.no_grad():
                    trainer.raw_model.blocks[1].mixer.v_proj.weight[0, 0] = float("nan")

        hook_before_step(monkeypatch, corrupt)
        out = tmp_path / "run"
        with pytest.raises(KernelmixError, match=r"refusing to write the checkpoint of step 4 in .*: \d+ of \d+ "
                                                 r"tensors hold NaN or Inf \(blocks\.1\.mixer\.v_proj\.weight.*nothing "
                                                 r"was written and the previous checkpoint '.*step_00000002' "
                                                 r"is intact\. Resume from it"):
            train(config(out, checkpoint_every=2), progress=False)
        assert [s for s, _ in list_checkpoints(out)] == [2] and every_checkpoint_is_finite(out)
        assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())

    def test_save_checkpoint_checks_the_optimizer_state_too(self, tmp_path):
        state = {"step": 1, "optimizer": {"state": {0: {"exp_avg": torch.tensor([1.0, float("inf")])}}}}
        with pytest.raises(KernelmixError,
                           match=r"1 of 2 tensors hold NaN or Inf \(state\.optimizer\.state\.0\.exp_avg\)"):
            checkpoint_module.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, state, {})
        assert not (tmp_path / "checkpoints").exists()


class TestInterruption:
    """Ctrl-C or SIGTERM during training printed a KeyboardInterrupt traceback (or just died) and lost
    every step since the last checkpoint. Now the step is finished and saved, Interrupted says
    where and how to resume (exit 128 + signal), and the resumed run is bitwise the uninterrupted one."""

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
    def test_a_signal_saves_the_step_and_resume_is_bitwise(self, reference, tmp_path, monkeypatch, signum):
        out = tmp_path / "run"
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        hook_after_step(monkeypatch, lambda trainer, step: os.kill(os.getpid(), signum) if step == 5 else None)
        with pytest.raises(Interrupted) as stopped:
            train(config(out), progress=False)
        assert stopped.value.signal_number == signum and stopped.value.exit_code == 128 + signum
        assert str(stopped.value) == (
            f"interrupted by {signal.Signals(signum).name} at step 5/8: the run is saved in "
            f"'{out / 'checkpoints' / 'step_00000005'}'; continue with `kernelmix train --resume --out {out}`")
        assert {s: signal.getsignal(s) for s in before} == before  # our handlers are gone again
        assert latest_checkpoint(out).name == "step_00000005"
        monkeypatch.undo()
        resumed = train(config(out), resume=True, progress=False)
        assert resumed.start_step == 5
        assert_bitwise_equal(out, reference)

    def test_sigterm_from_outside_exits_143_through_the_cli(self, reference, tmp_path):
        """`python -m kernelmix.cli train` in another process, sent SIGTERM by us in the middle of a step."""
        import runpy

        out, log = tmp_path / "run", tmp_path / "child.log"
        settings = config_file(tmp_path)
        ready_r, ready_w = os.pipe()

        def body():
            real = PretrainTrainer.after_step

            def after_step(self, step, outcome):  # step 3 done: tell the parent, wait for its signal
                stop = real(self, step, outcome)
                if step == 3:
                    os.write(ready_w, b"1")
                    stop_signals = signal.getsignal(signal.SIGTERM).__self__  # kernelmix's StopSignals
                    while stop_signals.received is None:
                        time.sleep(0.005)
                return stop

            PretrainTrainer.after_step = after_step
            sys.argv = ["kernelmix", "train", "--config", str(settings), "--out", str(out)]
            runpy.run_module("kernelmix.cli", run_name="__main__")  # sys.exit(main()) as the console script does

        pid = fork(body, output=log)
        assert select.select([ready_r], [], [], 60)[0], log.read_text()
        os.kill(pid, signal.SIGTERM)
        code = wait(pid)
        os.close(ready_r)
        os.close(ready_w)
        text = log.read_text()
        assert code == 143, text
        assert text.strip().splitlines()[-1] == (
            f"kernelmix train: interrupted by SIGTERM at step 3/8: the run is saved in "
            f"'{out / 'checkpoints' / 'step_00000003'}'; continue with `kernelmix train --resume --out {out}`")
        assert "Traceback" not in text
        train(config(out), resume=True, progress=False)
        assert_bitwise_equal(out, reference)

    def test_no_handlers_outside_the_main_thread(self, tmp_path):
        """Python refuses signal handlers off the main thread: a run there trains with the usual ones."""
        from kernelmix.training.signals import catch_stop_signals

        before, seen = signal.getsignal(signal.SIGINT), {}

        def body():
            with catch_stop_signals() as stop:
                seen["inside"] = signal.getsignal(signal.SIGINT)
                seen["received"] = stop.received
            seen["result"] = train(config(tmp_path / "run", steps=2, warmup_steps=1, checkpoint_every=0),
                                   progress=False)

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        assert seen["inside"] is before and seen["received"] is None and seen["result"].final_step == 2

    def test_finetune_interrupted_then_resumed_is_bitwise(self, tmp_path, monkeypatch):
        _, converted, windows = needs_transformers()
        from kernelmix import pretrained as pt
        from kernelmix.pretrained.finetune import FinetuneTrainer

        x = windows()
        settings = pt.FinetuneConfig(steps=8, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=4, eval_seqs=2)
        full_model, full = pt.finetune(converted(), x, x[:2], settings)
        real = FinetuneTrainer.after_step

        def after_step(self, step, outcome):
            stop = real(self, step, outcome)
            if step == 5:
                os.kill(os.getpid(), signal.SIGINT)
            return stop

        monkeypatch.setattr(FinetuneTrainer, "after_step", after_step)
        with pytest.raises(Interrupted, match=r"finetune interrupted by SIGINT at step 5/8: saved '.*step_00000005'; "
                                              r"continue with resume=True") as stopped:
            pt.finetune(converted(), x, x[:2], settings, out_dir=tmp_path / "run")
        assert stopped.value.exit_code == 130
        monkeypatch.undo()
        model, resumed = pt.finetune(converted(), x, x[:2], settings, out_dir=tmp_path / "run", resume=True)
        assert resumed["losses"] == full["losses"] and resumed["evals"] == full["evals"]
        theirs = dict(full_model.named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())

    def test_compare_interrupted_then_run_again_continues(self, tmp_path, monkeypatch):
        from kernelmix.studies.compare import CompareConfig, run_compare

        def settings(out):
            return CompareConfig(mixers=["softmax", "performer"], lengths=[32], steps=3, tokens_per_step=64,
                                 corpus=CORPUS, out_dir=str(out), eval_docs=1, warmup_steps=1)

        whole = run_compare(settings(tmp_path / "whole"), progress=False)

        def stop_performer(trainer, step):
            if trainer.config.model["mixer"] == "performer" and step == 2:
                os.kill(os.getpid(), signal.SIGINT)

        hook_after_step(monkeypatch, stop_performer)
        with pytest.raises(Interrupted, match=r"kernelmix compare interrupted by SIGINT while training performer T=32 "
                                              r"seed 0: its progress is saved in '.*step_00000002'; run the same "
                                              r"command again to continue") as stopped:
            run_compare(settings(tmp_path / "cut"), progress=False)
        assert stopped.value.exit_code == 130
        monkeypatch.undo()
        again = run_compare(settings(tmp_path / "cut"), progress=False)
        assert again["reused_runs"] == 1
        assert [r["val_loss"] for r in again["runs"]] == [r["val_loss"] for r in whole["runs"]]
        for ours, theirs in zip(again["runs"], whole["runs"]):
            a, b = final_weights(Path(ours["run_dir"])), final_weights(Path(theirs["run_dir"]))
            assert all(torch.equal(a[k], b[k]) for k in a)


IO_STEPS = ("write_weights", "write_state", "write_json", "_fsync_file", "_fsync_dir", "_move_into_place")


def count_checkpoint_io(action) -> None:
    """Wrap every file-system step of a checkpoint save (the writes, fsyncs, the rename and the
    clean-up's rmtree) so that ``action(name, index, call, args)`` runs instead (``call()`` does the
    real thing; ``index`` counts the steps from 1). Used in forked children, and undone by
    :func:`restore_checkpoint_io` in this process."""
    calls = {"n": 0}

    def wrap(name, real):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return action(name, calls["n"], lambda: real(*args, **kwargs), args)
        return wrapper

    for name in IO_STEPS:
        if hasattr(checkpoint_module, name):  # (the code before the fix had no _move_into_place)
            setattr(checkpoint_module, name, wrap(name, getattr(checkpoint_module, name)))
    checkpoint_module.shutil.rmtree = wrap("rmtree", checkpoint_module.shutil.rmtree)


class TestKilledDuringACheckpointWrite:
    """``kill -9`` at random moments of checkpoint writes (before, in the middle of, or after each
    write, fsync, rename and clean-up), then resume: always bitwise the uninterrupted run."""

    SETTINGS = dict(checkpoint_every=2)  # four saves of eight steps: more moments to die in

    @pytest.fixture(scope="class")
    @classmethod
    def moments(cls, tmp_path_factory):
        """How many file-system steps the saves of one run take (counted in a child, which is then gone)."""
        out, counted = tmp_path_factory.mktemp("count") / "run", tmp_path_factory.mktemp("count") / "steps"

        def body():
            count_checkpoint_io(lambda name, index, call, args: (counted.write_text(str(index)), call())[1])
            train(config(out, **cls.SETTINGS), progress=False)

        assert wait(fork(body)) == 0
        return int(counted.read_text())

    def kill_and_resume(self, reference, out: Path, moment: int, how: str) -> None:
        def die(name, index, call, args):
            if index != moment:
                return call()
            if how == "after":
                call()
            elif how == "half" and name.startswith("write_"):  # half of the file is on disk
                call()
                path = Path(args[1])
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        def body():
            count_checkpoint_io(die)
            train(config(out, **self.SETTINGS), progress=False)
            return 0

        code = wait(fork(body))
        assert code in (-signal.SIGKILL, 0), code
        # whatever the moment: every complete checkpoint verifies, and resuming ends bitwise where the reference did
        for _, path in list_checkpoints(out):
            load_checkpoint(path)
        train(config(out, **self.SETTINGS), resume=True, progress=False)
        assert_bitwise_equal(out, reference)

    def cases(self, moments: int, count: int, seed: int) -> list[tuple[int, str]]:
        """``count`` (moment, how) pairs; the first inside the first save (nothing to resume from yet)."""
        rng = random.Random(seed)
        hows = ["before", "half", "after"]
        first = (rng.randint(1, moments // 4), rng.choice(hows))
        return [first] + [(rng.randint(1, moments), rng.choice(hows)) for _ in range(count - 1)]

    def test_a_few_random_kills(self, reference, moments, tmp_path):
        assert moments > 30  # the saves were seen (4 checkpoints × writes, fsyncs, renames, clean-ups)
        for index, (moment, how) in enumerate(self.cases(moments, 3, seed=13)):
            self.kill_and_resume(reference, tmp_path / f"run{index}", moment, how)

    @pytest.mark.slow
    def test_fifty_random_kills(self, reference, moments, tmp_path):
        for index, (moment, how) in enumerate(self.cases(moments, 50, seed=2024)):
            self.kill_and_resume(reference, tmp_path / f"run{index}", moment, how)


class TestDiskFull:
    """A full disk (or no permission) while writing a checkpoint or the metrics was a raw OSError or
    ``SafetensorError: No space left on device``; now a KernelmixError names the path and the fix,
    and the previous checkpoint is intact."""

    def test_enospc_while_saving_a_checkpoint(self, reference, tmp_path, monkeypatch):
        out, real, calls = tmp_path / "run", checkpoint_module.write_state, []

        def disk_full(state, path):
            calls.append(path)
            if len(calls) == 2:
                path.write_bytes(b"par")
                raise OSError(errno.ENOSPC, "No space left on device")
            real(state, path)

        monkeypatch.setattr(checkpoint_module, "write_state", disk_full)
        with pytest.raises(KernelmixError, match=r"cannot write "
                                                 rf"'{re.escape(str(out / 'checkpoints' / 'step_00000008'))}': "
                                                 r"No space left on device; free space or choose another --out; "
                                                 r"the previous checkpoint '.*step_00000004' is intact"):
            train(config(out), progress=False)
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000004"]
        assert load_checkpoint(out / "checkpoints" / "step_00000004").step == 4  # verifies against its manifest
        monkeypatch.undo()
        train(config(out), resume=True, progress=False)
        assert_bitwise_equal(out, reference)

    def test_safetensors_reports_a_full_disk_in_its_own_words(self, tmp_path, monkeypatch):
        import safetensors.torch
        from safetensors import SafetensorError

        def full(weights, path, metadata=None):  # safetensors' own words for a full disk
            raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path '
                                  f'"{Path(path).parent / ".tmpX1"}"')

        monkeypatch.setattr(safetensors.torch, "save_file", full)
        with pytest.raises(KernelmixError,
                           match=r"step_00000001': No space left on device; free space or choose another"):
            checkpoint_module.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"step": 1}, {})
        assert list((tmp_path / "checkpoints").iterdir()) == []

    @pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free space or choose another --out"),
                                           (errno.EACCES, "make the directory writable or choose another --out")])
    def test_enospc_or_eacces_while_writing_metrics(self, tmp_path, monkeypatch, code, fix):
        import kernelmix.training.reporter as reporter

        class Failing:
            def __init__(self, handle):
                self.handle, self.lines = handle, 0

            def write(self, text):
                self.lines += 1
                if self.lines == 3:
                    raise OSError(code, os.strerror(code))
                return self.handle.write(text)

            def __getattr__(self, name):
                return getattr(self.handle, name)

        monkeypatch.setattr(reporter, "open", lambda *args, **kwargs: Failing(open(*args, **kwargs)), raising=False)
        out = tmp_path / "run"
        with pytest.raises(KernelmixError, match=rf"cannot write '{re.escape(str(out / 'metrics.jsonl'))}': "
                                                 rf"{os.strerror(code)}; {fix}"):
            train(config(out), progress=False)


class TestOutIsAFile:
    """``--out`` naming a file failed with FileExistsError after the data were loaded; now it is
    refused before anything is read, naming the fix."""

    MESSAGE = "is a file, not a run directory: pass an --out that is a directory (or does not exist yet)"

    @pytest.fixture
    def a_file(self, tmp_path, monkeypatch):
        import kernelmix.data

        def never(*args, **kwargs):
            raise AssertionError("data were loaded before --out was checked")

        monkeypatch.setattr(kernelmix.data, "prepare_dataset", never)
        path = tmp_path / "notes.txt"
        path.write_text("mine\n")
        return path

    def test_train(self, a_file, capsys):
        assert cli_main(["train", "--out", str(a_file), "--set", f"corpus={CORPUS}", "--set", "preset=tiny"]) == 2
        assert f"kernelmix train: error: {a_file} {self.MESSAGE}" in capsys.readouterr().err
        assert a_file.read_text() == "mine\n"

    def test_compare(self, a_file, capsys):
        assert cli_main(["compare", "--mixers", "softmax", "--lengths", "32", "--corpus", CORPUS, "--out",
                         str(a_file)]) == 2
        assert self.MESSAGE in capsys.readouterr().err

    def test_finetune(self, a_file, capsys, monkeypatch):
        def never(*args, **kwargs):
            raise AssertionError("the model was loaded before --out was checked")

        monkeypatch.setattr("kernelmix.pretrained.load_pretrained", never)  # what kernelmix finetune loads with
        assert cli_main(["finetune", "some-model", "--out", str(a_file)]) == 2
        assert self.MESSAGE in capsys.readouterr().err


class TestRunKilledBeforeItsFirstCheckpoint:
    """A run killed before its first checkpoint left config.json and metrics: `--resume` said "run
    without --resume" and a fresh run said "pass --resume". Now either starts it over, saying so."""

    @pytest.fixture
    def killed_early(self, tmp_path):
        out = tmp_path / "run"

        def body():
            real = PretrainTrainer.after_step

            def after_step(self, step, outcome):
                stop = real(self, step, outcome)
                if step == 3:
                    self.log_pending(step)  # its metrics are on disk, as a real run's would be by now
                    os.kill(os.getpid(), signal.SIGKILL)
                return stop

            PretrainTrainer.after_step = after_step
            train(config(out), progress=False)

        assert wait(fork(body)) == -signal.SIGKILL
        assert (out / "config.json").is_file() and metric_rows(out) and not list_checkpoints(out)
        return out

    @pytest.mark.parametrize("resume", [False, True])
    def test_the_run_is_started_over_with_a_note(self, reference, killed_early, capsys, resume):
        capsys.readouterr()
        result = train(config(killed_early), resume=resume, progress=False)
        assert result.start_step == 0
        assert (f"note: {killed_early} holds a run that stopped before its first checkpoint, so there is nothing to "
                "resume; starting it over from step 0") in capsys.readouterr().err
        assert_bitwise_equal(killed_early, reference)

    def test_a_directory_of_something_else_is_not_taken_over(self, tmp_path):
        out = tmp_path / "project"
        out.mkdir()
        (out / "config.json").write_text('{"name": "not a training run"}\n')
        with pytest.raises(KernelmixError,
                           match="holds a config.json that is not a kernelmix training run; choose another"):
            train(config(out), progress=False)
        assert (out / "config.json").read_text() == '{"name": "not a training run"}\n'


class TestDamagedNewestCheckpoint:
    """The newest checkpoint damaged while an older one is good: the message said which to delete;
    now resume falls back to the newest valid one by itself, warning with the damaged one's name."""

    @pytest.mark.parametrize("damage", ["truncate", "no manifest"])
    def test_resume_falls_back_and_is_bitwise(self, reference, tmp_path, damage):
        import shutil

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        newest = out / "checkpoints" / "step_00000008"
        if damage == "truncate":
            (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:1000])
            expected = rf"'{re.escape(str(newest / 'model.safetensors'))}' is truncated or corrupt: 1000 bytes"
        else:
            (newest / "manifest.json").unlink()
            expected = rf"'{re.escape(str(newest))}' is incomplete \(no manifest.json\)"
        with pytest.warns(UserWarning, match=rf"{expected}.*: resuming from the newest valid checkpoint "
                                             rf"'{re.escape(str(out / 'checkpoints' / 'step_00000004'))}' instead"):
            resumed = train(config(out), resume=True, progress=False)
        assert resumed.start_step == 4
        assert_bitwise_equal(out, reference)


class TestLoadingARunWithADamagedNewestCheckpoint:
    """`kernelmix eval` / load_run failed on a damaged newest checkpoint instead of falling back."""

    def test_load_run_falls_back_with_a_warning(self, reference, tmp_path):
        import shutil

        from kernelmix.training import load_run

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        newest = out / "checkpoints" / "step_00000008"
        (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:1000])
        with pytest.warns(UserWarning, match=rf"the newest checkpoint '{re.escape(str(newest))}' is damaged; loading "
                                             r"the newest valid one .*step_00000004' \(step 4\) instead"):
            run = load_run(out)
        assert run.step == 4
        with pytest.raises(ValueError, match=r"truncated or corrupt"):  # a checkpoint asked for by name is not replaced
            load_run(newest)


class TestResumingAFinishedRun:
    """Resuming a run that had finished printed `checkpoint None` though its checkpoint exists."""

    def test_the_result_and_the_cli_name_the_checkpoint(self, reference, tmp_path, capsys):
        import shutil

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        result = train(config(out), resume=True, progress=False)
        assert result.final_step == 8 and result.checkpoint == out / "checkpoints" / "step_00000008"
        capsys.readouterr()
        assert cli_main(["train", "--resume", "--out", str(out)]) == 0
        assert f"checkpoint {out / 'checkpoints' / 'step_00000008'}" in capsys.readouterr().out


class TestResumeOnAnotherSchedule:
    """Issue 25: ``train --resume --set steps=10`` on a finished 6-step run rewrote the schedule in
    silence (the learning rate went from min_lr back up at the resumed step). Another total is now
    refused, naming both totals, both rates and the fixes; ``--reschedule`` accepts it on purpose."""

    def test_refused_naming_the_steps_the_rates_and_the_fixes(self, reference, tmp_path, capsys):
        import shutil

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(KernelmixError) as error:
            train(config(out, steps=12), resume=True, progress=False)
        message = str(error.value)
        assert "from a run of 8 steps, this one asks for 12" in message
        # the 8-step run ended at min_lr 1e-4; laid over 12 steps, update 9 would be at 8.25e-4
        assert "update 9 would use lr 0.000825 where the run's own schedule is at 0.0001" in message
        assert "another --out" in message and "--reschedule" in message
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
        capsys.readouterr()
        assert cli_main(["train", "--resume", "--out", str(out), "--set", "steps=12"]) == 2
        assert "this one asks for 12" in capsys.readouterr().err

    def test_reschedule_accepts_it(self, reference, tmp_path, capsys):
        import shutil

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        assert cli_main(["train", "--resume", "--reschedule", "--out", str(out), "--set", "steps=10"]) == 0
        assert "step 10/10" in capsys.readouterr().out

    def test_reschedule_without_resume_is_refused(self, tmp_path, capsys):
        assert cli_main(["train", "--reschedule", "--out", str(tmp_path / "run")]) == 1
        assert "add --resume, or drop --reschedule" in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


class TestOneDocumentCorpus:
    """Issue 25: a one-document corpus put everything in the train split (the split is by document)
    and the run went without validation in silence, though eval_every asked for it. Now a warning
    says so and names the fixes (a warning, not an error: the training itself is sound)."""

    def test_a_warning_names_the_corpus_and_the_fixes(self, tmp_path):
        corpus = tmp_path / "one.txt"
        corpus.write_text("def f(x):\n    return x + 1\n" * 200)
        settings = {**REF, "corpus": str(corpus), "steps": 2, "warmup_steps": 1, "eval_every": 1, "checkpoint_every": 0}
        with pytest.warns(UserWarning, match=r"no validation: the corpus .*one\.txt' has 1 document .* none was "
                                             r"held out .*eval_every=1 included.*--set val_fraction=0") as caught:
            result = train(config(tmp_path / "run", **settings), progress=False)
        assert result.val_losses == {} and len([w for w in caught if "no validation" in str(w.message)]) == 1

    def test_none_when_validation_is_switched_off(self, tmp_path, recwarn):
        corpus = tmp_path / "one.txt"
        corpus.write_text("def f(x):\n    return x + 1\n" * 200)
        train(config(tmp_path / "run", corpus=str(corpus), steps=2, warmup_steps=1, val_fraction=0.0,
                     checkpoint_every=0), progress=False)
        assert not [w for w in recwarn if "no validation" in str(w.message)]


class _Foreign:
    """A pickled object that would run a command when unpickled (it never is)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class TestForeignPickleCheckpoint:
    """Issue 25: a state.pt that is a foreign pickle (matching its manifest) was called "damaged",
    with torch's advice to retry with weights_only=False passed on. Now it is refused for safety,
    naming the global it asks for and the fix, and unpickling is never suggested."""

    def test_refused_for_safety_never_suggesting_unpickling(self, reference, tmp_path):
        import hashlib
        import pickle
        import shutil

        out = tmp_path / "run"
        shutil.copytree(reference.out_dir, out)
        newest = latest_checkpoint(out)
        state = newest / "state.pt"
        marker = tmp_path / "ran"
        state.write_bytes(pickle.dumps({"step": 8, "payload": _Foreign(marker)}, protocol=2))
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["files"]["state.pt"] = {"bytes": state.stat().st_size,
                                         "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
        (newest / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(KernelmixError) as error:
            train(config(out), resume=True, progress=False)
        message = str(error.value)
        assert "is refused for safety" in message and "never unpickles" in message
        assert "'posix.system'" in message or "'os.system'" in message
        assert f"delete {str(newest)!r} and --resume continues from" in message
        assert "weights_only" not in message and "damaged" not in message and "Weights only" not in message
        assert not marker.exists()


class TestCompareBudgetBelowOneStep:
    """Issue 25: ``compare --budget time --seconds 0.001`` gave every run one step, 8-14x over the
    budget and unequal between mixers, while results.md said each run got 0.001 s. A budget that
    buys some mixer less than one step is now refused after the calibration, naming the mixers,
    their step cost and the budget to give."""

    def test_seconds_below_one_step(self):
        from kernelmix.studies.compare import CompareConfig, plan_budget

        config = CompareConfig(mixers=["softmax", "cubit"], lengths=[256], budget="time", seconds=0.001)
        speeds = {("softmax", 256): 0.008, ("cubit", 256): 0.014}
        with pytest.raises(KernelmixError, match=r"the time budget at length 256, --seconds 0.001, is less than one "
                                                 r"training step of softmax, cubit \(one step: softmax 0.008s, cubit "
                                                 r"0.014s\).*over the budget.*give --seconds 0.028 or more"):
            plan_budget(config, 256, speeds)

    def test_flops_below_one_step(self):
        from kernelmix.studies.compare import CompareConfig, plan_budget

        config = CompareConfig(mixers=["softmax", "performer"], lengths=[256], budget="flops", steps=1,
                               model={"mixer_options": {"performer": {"num_features": 4096}}})
        with pytest.raises(KernelmixError, match=r"the flops budget at length 256, --steps 1 of softmax .* is less "
                                                 r"than one training step of performer .*give --steps [0-9]+ or more"):
            plan_budget(config, 256)

    def test_a_budget_of_one_step_or_more_is_kept(self):
        from kernelmix.studies.compare import CompareConfig, plan_budget

        config = CompareConfig(mixers=["softmax", "cubit"], lengths=[256], budget="time", seconds=0.02)
        plan = plan_budget(config, 256, {("softmax", 256): 0.008, ("cubit", 256): 0.014})
        assert plan.steps == {("softmax", 256): 2, ("cubit", 256): 1}


class TestFailedTrainLeavesNoDirectory:
    """Issue 25: a ``kernelmix train`` that failed on its corpus left its --out behind, holding only the
    lock file. A directory the command created (with the parents it created) and never wrote anything
    else to is removed; a directory that existed before is never removed."""

    @pytest.fixture
    def empty_corpus(self, tmp_path):
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        return ["--set", f"corpus={corpus}", "--set", "preset=tiny", "--set", "steps=2"]

    def test_a_directory_it_created_is_removed(self, tmp_path, empty_corpus, capsys):
        out = tmp_path / "runs" / "new"
        assert cli_main(["train", "--out", str(out), *empty_corpus]) == 2
        assert "no documents found" in capsys.readouterr().err
        assert not (tmp_path / "runs").exists()  # the parent it created goes too

    def test_a_directory_that_existed_is_kept(self, tmp_path, empty_corpus):
        out = tmp_path / "mine"
        out.mkdir()
        assert cli_main(["train", "--out", str(out / "new"), *empty_corpus]) == 2
        assert out.is_dir() and list(out.iterdir()) == []  # its own --out went, the existing parent stays
        assert cli_main(["train", "--out", str(out), *empty_corpus]) == 2
        assert out.is_dir()

    def test_a_directory_written_to_is_kept(self, tmp_path):
        out = tmp_path / "run"
        with pytest.raises(KernelmixError, match="boom"):
            with run_directory_lock(out, "kernelmix train"):
                (out / "config.json").write_text("{}")
                raise KernelmixError("boom")
        assert sorted(p.name for p in out.iterdir()) == [".kernelmix.lock", "config.json"]
