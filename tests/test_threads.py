"""The CPU-thread policy: auto takes the cores the load measured now leaves idle (else the load
average's); --threads on every command."""

from __future__ import annotations

import os

import pytest
import torch

from kernelmix import threads
from kernelmix.cli import build_parser


@pytest.fixture
def machine(monkeypatch):
    """A machine of ``cpus`` cores on which ``busy`` cores are measured busy now (None: the OS does
    not say) and the 1-minute load average is ``load`` (None: there is none)."""
    def set_machine(cpus: int, load: float | None, busy: float | None = None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(threads, "busy_cores", lambda cpu_set: busy)
        if load is None:
            def no_load():
                raise OSError("no load average here")
            monkeypatch.setattr(os, "getloadavg", no_load)
        else:
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    return set_machine


@pytest.mark.parametrize("cpus, busy, default, expected", [
    (2, 0.1, 2, 2),  # idle machine: torch's default
    (2, 1.0, 2, 1),  # one competing process on 2 cores: one thread
    (2, 3.7, 2, 1),  # overloaded: never below one
    (16, 4.4, 16, 12),
    (16, 0.0, 4, 4),  # never above torch's default (OMP_NUM_THREADS, torchrun)
])
def test_auto_takes_the_idle_cores(machine, cpus, busy, default, expected):
    machine(cpus, load=None, busy=busy)
    assert threads.auto_threads(default)[0] == expected


def test_the_load_measured_now_wins_over_a_lagging_load_average(machine):
    machine(2, load=1.4, busy=0.05)  # the previous job just ended: the 1-minute average still says busy
    assert threads.auto_threads(2) == (2, "0.1 of 2 cores busy leaves 2 idle")


@pytest.mark.parametrize("load, expected", [(0.1, 2), (1.0, 1), (3.7, 1)])
def test_without_a_measurement_the_load_average_decides(machine, load, expected):
    machine(2, load=load, busy=None)
    assert threads.auto_threads(2) == (expected,
                                       f"load {load:.1f} on 2 cores leaves {max(1, 2 - int(load + 0.5))} idle")


def test_neither_keeps_the_default(machine):
    machine(8, None, None)
    assert threads.auto_threads(8) == (8, "torch's default")


def _stat(*cpus: tuple[int, int, int]) -> str:
    """A /proc/stat with one line per CPU: (user, idle, steal) ticks, the other fields small."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {user} 0 3 {idle} 1 0 0 {steal} 0 0" for i, (user, idle, steal) in enumerate(cpus)]
    return "\n".join([*lines, "intr 1 2 3", "ctxt 99", "procs_running 2"]) + "\n"


def test_busy_cores_reads_the_ticks_of_the_usable_cpus(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    samples = iter([_stat((100, 500, 0), (100, 500, 0), (7, 7, 7)),
                    # cpu0 fully busy (user and steal), cpu1 idle, cpu2 busy but not ours
                    _stat((180, 500, 20), (100, 600, 0), (107, 7, 7))])
    stat.write_text(next(samples))
    monkeypatch.setattr(threads, "PROC_STAT", stat)
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: stat.write_text(next(samples)))
    assert threads.cpu_times({0, 1}) == (100 + 3 + 0 + 100 + 3 + 0, 2 * (100 + 3 + 500 + 1))
    assert threads.busy_cores({0, 1}) == pytest.approx(2 * 100 / 200)
    assert threads.cpu_times({5}) is None  # a CPU the file does not list
    monkeypatch.setattr(threads, "PROC_STAT", tmp_path / "missing")
    assert threads.cpu_times({0}) is None and threads.busy_cores({0}) is None


def test_set_threads_explains_a_lower_choice_and_obeys_an_explicit_one(machine, monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        machine(2, load=0.0, busy=1.2)
        note = threads.set_threads(None)
        assert torch.get_num_threads() == 1
        assert "computing with 1 CPU thread, not 2 (1.2 of 2 cores busy leaves 1 idle" in note and "--threads 2" in note
        torch.set_num_threads(2)
        machine(2, load=0.0, busy=0.0)
        calls = []  # auto sets the count it keeps too: set and unset defaults round differently
        monkeypatch.setattr(torch, "set_num_threads", lambda n, real=torch.set_num_threads: (calls.append(n), real(n)))
        assert threads.set_threads(None) is None and torch.get_num_threads() == 2 and calls == [2]
        assert threads.set_threads(1) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _leaf_parsers(parser, path=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, child in action.choices.items():
                yield from _leaf_parsers(child, path + (name,))
            return
    yield path, parser


def test_every_command_takes_threads():
    leaves = list(_leaf_parsers(build_parser()))
    assert len(leaves) >= 12
    missing = [" ".join(path) for path, p in leaves if not any("--threads" in a.option_strings for a in p._actions)]
    assert not missing, f"commands without --threads: {missing}"
