"""The CPU-thread policy: auto takes the cores the load leaves idle; --threads on every command."""

from __future__ import annotations

import os

import pytest
import torch

from kernelmix import threads
from kernelmix.cli import build_parser


@pytest.fixture
def machine(monkeypatch):
    def set_machine(cpus: int, load: float | None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        if load is None:
            def no_load():
                raise OSError("no load average here")
            monkeypatch.setattr(os, "getloadavg", no_load)
        else:
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    return set_machine


@pytest.mark.parametrize("cpus, load, default, expected", [
    (2, 0.1, 2, 2),  # idle machine: torch's default
    (2, 1.0, 2, 1),  # one competing process on 2 cores: one thread
    (2, 3.7, 2, 1),  # overloaded: never below one
    (16, 4.4, 16, 12),
    (16, 0.0, 4, 4),  # never above torch's default (OMP_NUM_THREADS, torchrun)
])
def test_auto_takes_the_idle_cores(machine, cpus, load, default, expected):
    machine(cpus, load)
    assert threads.auto_threads(default)[0] == expected


def test_no_load_average_keeps_the_default(machine):
    machine(8, None)
    assert threads.auto_threads(8) == (8, "torch's default")


def test_set_threads_explains_a_lower_choice_and_obeys_an_explicit_one(machine):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        machine(2, 1.2)
        note = threads.set_threads(None)
        assert torch.get_num_threads() == 1
        assert "computing with 1 CPU thread, not 2 (load 1.2 on 2 cores leaves 1 idle" in note and "--threads 2" in note
        torch.set_num_threads(2)
        machine(2, 0.0)
        assert threads.set_threads(None) is None and torch.get_num_threads() == 2
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
