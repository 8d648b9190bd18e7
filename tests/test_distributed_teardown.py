"""kernelmix.training.distributed.teardown: a process leaves the group it joined explicitly and in
step with the others (a barrier, then destroy_process_group), never by exiting with the group
alive, and a failed process does not wait for peers that will never come."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from kernelmix.training import distributed as distrib

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def calls(monkeypatch):
    """A one-process gloo group (in-memory store), with its barrier and destroy recorded in order."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: list[str] = []
    barrier, destroy = dist.monitored_barrier, dist.destroy_process_group
    monkeypatch.setattr(dist, "monitored_barrier", lambda **kwargs: (seen.append("barrier"), barrier(**kwargs)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (seen.append("destroy"), destroy()))
    yield seen
    if dist.is_initialized():
        destroy()


def joined() -> distrib.DistEnv:
    # world_size=2: what a process of a two-process run holds
    # (the group here has one rank, so the barrier returns at once)
    return distrib.DistEnv(rank=0, world_size=2, owns_group=True)


def test_teardown_waits_for_the_peers_then_destroys_the_group(calls):
    distrib.teardown(joined())
    assert calls == ["barrier", "destroy"] and not dist.is_initialized()


def test_a_failed_process_leaves_without_waiting(calls):
    with pytest.raises(ValueError):
        try:
            raise ValueError("a step failed")
        finally:
            distrib.teardown(joined())  # no wait_for_peers given: an exception is propagating
    assert calls == ["destroy"] and not dist.is_initialized()


def test_explicit_choice_and_a_group_we_did_not_make(calls):
    distrib.teardown(distrib.DistEnv(rank=0, world_size=2, owns_group=False))  # the caller's group: left alone
    assert calls == [] and dist.is_initialized()
    distrib.teardown(joined(), wait_for_peers=False)
    assert calls == ["destroy"] and not dist.is_initialized()


TEARDOWN_SCRIPT = r'''
import sys, time, torch
from kernelmix.training import distributed as distrib
env = distrib.setup("cpu")
total = distrib.all_reduce_sum(env, torch.ones(1)).item()
if env.rank == 1:
    time.sleep(float(sys.argv[1]))  # the last process to finish its work
start = time.perf_counter()
distrib.teardown(env)
import torch.distributed as dist
print(f"RESULT rank={env.rank} total={total:g} waited={time.perf_counter() - start:.2f} alive={dist.is_initialized()}", flush=True)
'''  # noqa: E501  (a script's text: splitting its lines would change the string)


def test_two_processes_leave_the_group_together(tmp_path):
    """Under torchrun (gloo): rank 0 waits in teardown for the rank that finishes 2 s later, both
    destroy their group, and both exit cleanly (no abort at the interpreter's exit)."""
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "terminate called" not in output, output[-3000:]
    # the two processes share torchrun's stdout: their lines can run into each other ("...alive=FalseRESULT rank=1
    # ..."), so the results are found anywhere in the output, not one per line
    found = re.findall(r"RESULT rank=(\d+) total=(\S+?) waited=([\d.]+) alive=(True|False)", output)
    lines = {f"rank={rank}": dict(total=total, waited=waited, alive=alive) for rank, total, waited, alive in found}
    assert lines.keys() == {"rank=0", "rank=1"}, output[-3000:]
    assert all(fields["total"] == "2" and fields["alive"] == "False" for fields in lines.values()), lines
    assert float(lines["rank=0"]["waited"]) >= 1.5 > float(lines["rank=1"]["waited"]), lines
