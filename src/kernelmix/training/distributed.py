"""Process-group setup for ``torchrun``: detection from environment variables, gloo on CPU
(so multi-process runs are testable anywhere), nccl on CUDA."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we initialised the process group, so we tear it down

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer (set by torchrun)") from None


def setup(device: str = "auto") -> DistEnv:
    """Join the process group that ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT), or run as a single process when those are absent."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") or 0
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available; use device=cpu (or auto)")
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if rank is None or world_size is None or world_size == 1:
        return DistEnv(device=dev)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, owns_group=owns)


#: how long :func:`teardown` waits for the other processes before it leaves the group all the same
TEARDOWN_TIMEOUT_S = 300.0


def teardown(env: DistEnv, *, wait_for_peers: bool | None = None) -> None:
    """Leave the process group we joined (``env.owns_group``; nothing otherwise), explicitly and
    in step: a barrier, then ``destroy_process_group``, which joins the backend's threads. A process
    that exits with its group alive leaves those threads to the interpreter's shutdown (a gloo
    worker still running then aborts the process: "terminate called without an active
    exception"), and one that leaves before its peers finished their last collective breaks
    theirs. ``wait_for_peers``: the barrier (gloo's monitored one: a peer that never comes is
    named after :data:`TEARDOWN_TIMEOUT_S`); None: only when no exception is propagating (a
    failed process may be the only one here, and must not wait for the others)."""
    if not (env.owns_group and dist.is_initialized()):
        return
    if wait_for_peers is None:
        wait_for_peers = sys.exc_info()[1] is None
    try:
        if wait_for_peers and env.enabled:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=TEARDOWN_TIMEOUT_S))
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


def all_reduce_sum(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over processes in place (gloo has no AVG, so averages are sums divided by counts)."""
    if env.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """The maximum over processes, in place."""
    if env.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def agree_on_signal(env: DistEnv, received: int | None) -> int | None:
    """The stop signal every process acts on now (None: none). A signal reaches the processes of a
    run at different moments, but they must all stop at the same step: any one's signal counts."""
    if not env.enabled:
        return received
    flag = torch.tensor(float(received or 0), device=env.device)
    return int(all_reduce_max(env, flag).item()) or None


def all_gather_object(env: DistEnv, obj):
    if not env.enabled:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


__all__ = ["DistEnv", "TEARDOWN_TIMEOUT_S", "agree_on_signal", "all_gather_object", "all_reduce_max", "all_reduce_sum",
           "barrier", "setup", "teardown"]
