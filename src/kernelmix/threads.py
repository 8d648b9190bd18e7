"""How many CPU threads a kernelmix command computes with.

On a busy machine torch's default (one thread per core) collapses: a thread that waits for a core
another process holds stalls every parallel region, and the mixers made of many small ops pay that
stall thousands of times a step. Measured on 2 cores with one competing CPU-bound process (see the
README's "On a busy machine"): softmax decode 8.5 ms/token with 2 threads against 1.5 with 1, Cubit
forward+backward 24.6 ms against 15.5. So the default is *auto*: the cores the machine's load leaves
idle when the command starts (at least 1, at most torch's default). ``--threads N`` overrides it.

The load is *measured now* where the OS says how busy each CPU has been (Linux ``/proc/stat``,
sampled over a quarter of a second), not read from the 1-minute load average: that average lags,
so a command started right after another CPU-heavy one (an install, the previous run) saw a busy
machine that had already gone idle and took one thread on two idle cores. The load average stays
the fallback where there is no ``/proc/stat``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .errors import KernelmixError

#: how long auto watches the CPUs before choosing (short: every command pays it once)
SAMPLE_SECONDS = 0.25
PROC_STAT = Path("/proc/stat")


def usable_cpu_set() -> set[int]:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(usable_cpu_set())


def cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks since boot summed over ``cpus`` (from ``/proc/stat``; steal time
    counts as busy: another guest has the core), or None where the OS does not say."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    busy = total = seen = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen += 1
    return (busy, total) if seen else None


def busy_cores(cpus: set[int], seconds: float = SAMPLE_SECONDS) -> float | None:
    """How many of ``cpus`` other processes kept busy over the next ``seconds`` (this one sleeps
    meanwhile), or None where the OS does not say."""
    before = cpu_times(cpus)
    if before is None:
        return None
    time.sleep(seconds)
    after = cpu_times(cpus)
    if after is None or after[1] <= before[1]:
        return None
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def auto_threads(default: int) -> tuple[int, str]:
    """``(threads, why)``: the cores left idle by the load measured now (:func:`busy_cores`, else the
    1-minute load average), between 1 and ``default`` (torch's own choice); ``why`` says how it
    was chosen, for a note to the user."""
    cpu_set = usable_cpu_set()
    cpus = len(cpu_set)
    busy = busy_cores(cpu_set)
    if busy is not None:
        measured = f"{busy:.1f} of {cpus} cores busy"
    else:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):  # neither (Windows): keep torch's choice
            return default, "torch's default"
        measured = f"load {busy:.1f} on {cpus} cores"
    idle = max(1, cpus - int(busy + 0.5))
    threads = max(1, min(default, idle))
    return threads, f"{measured} leaves {idle} idle"


def set_threads(requested: int | None) -> str | None:
    """Set torch's CPU threads: ``requested``, or :func:`auto_threads` when None. Returns a one-line
    note when auto chose fewer threads than torch would have (else None).

    The count is always *set*, also when auto keeps torch's default: torch computes some results
    (e.g. an in-place ``exp_``) with other rounding after ``torch.set_num_threads(2)`` than under
    its own default of 2 threads, and the solve mixers' training turns that rounding into final
    losses ~0.05 apart — so ``--threads 2`` and auto choosing 2 must be the same computation."""
    import torch

    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise KernelmixError(f"threads must be a positive integer (a CPU thread count, e.g. 1), got {requested!r}")
        torch.set_num_threads(requested)
        return None
    default = torch.get_num_threads()
    threads, why = auto_threads(default)
    torch.set_num_threads(threads)
    if threads == default:
        return None
    return (f"note: computing with {threads} CPU thread{'s' if threads > 1 else ''}, not {default} ({why}; a busy "
            f"core stalls every parallel step); --threads {default} to use them all")


__all__ = ["auto_threads", "busy_cores", "cpu_times", "set_threads", "usable_cpu_set", "usable_cpus"]
