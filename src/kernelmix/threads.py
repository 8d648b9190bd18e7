"""How many CPU threads a kernelmix command computes with.

On a busy machine torch's default (one thread per core) collapses: a thread that waits for a core
another process holds stalls every parallel region, and the mixers made of many small ops pay that
stall thousands of times a step. Measured on 2 cores with one competing CPU-bound process (see the
README's "On a busy machine"): softmax decode 8.5 ms/token with 2 threads against 1.5 with 1, Cubit
forward+backward 24.6 ms against 15.5. So the default is *auto*: the cores the machine's load leaves
idle when the command starts (at least 1, at most torch's default). ``--threads N`` overrides it.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_threads(default: int) -> tuple[int, str]:
    """``(threads, why)``: the cores left idle by the 1-minute load average, between 1 and
    ``default`` (torch's own choice); ``why`` says how it was chosen, for a note to the user."""
    cpus = usable_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average (Windows): keep torch's choice
        return default, "torch's default"
    idle = max(1, cpus - int(load + 0.5))
    threads = max(1, min(default, idle))
    return threads, f"load {load:.1f} on {cpus} cores leaves {idle} idle"


def set_threads(requested: int | None) -> str | None:
    """Set torch's CPU threads: ``requested``, or :func:`auto_threads` when None. Returns a one-line
    note when auto chose fewer threads than torch would have (else None)."""
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
        return None
    default = torch.get_num_threads()
    threads, why = auto_threads(default)
    if threads == default:
        return None
    torch.set_num_threads(threads)
    return (f"note: computing with {threads} CPU thread{'s' if threads > 1 else ''}, not {default} ({why}; a busy "
            f"core stalls every parallel step); --threads {default} to use them all")


__all__ = ["auto_threads", "set_threads", "usable_cpus"]
