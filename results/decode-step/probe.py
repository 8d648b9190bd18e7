"""One cached decode step. *Model*: each mixer in the ``mini`` preset (4 layers, width 128, 4
query heads sharing 2 kv heads), milliseconds per token (median of 40 steps after 8 untimed ones)
and aten operators per token (counted with a TorchDispatchMode), at cache positions 32 and 960.
*Op*: the step functions of the three mixers whose cache grows (softmax, Cubit, DeltaFormer) alone,
B=1, 8 query heads sharing 2 kv heads, d=64, from a cache of 1,024 / 4,096 / 16,384 random tokens
(median of 24 steps after 8 untimed ones): the part of a step that copies the cache.

    python3 probe.py THREADS      # prints one line per (mixer, position)

Run from a source tree by ``run.sh``, which puts that tree's ``src`` on PYTHONPATH.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernelmix.model import CausalLM, ModelConfig
from kernelmix.ops import cubit_attention_step, deltaformer_attention_step, softmax_attention_step
from kernelmix.ops.cubit import CubitState
from kernelmix.ops.deltaformer import DeltaFormerState
from kernelmix.ops.softmax import SoftmaxState

MIXERS = ("softmax", "cubit", "deltaformer", "performer", "darkformer")
POSITIONS = (32, 960)
WARMUP, TIMED = 8, 40


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _op_steps() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64

    def rows(t: int, h: int) -> torch.Tensor:
        return torch.randn(1, t, h, dim, generator=g)

    for position in (1024, 4096, 16384):
        q, k, v, r = rows(1, heads), rows(1, kv_heads), rows(1, kv_heads), rows(1, heads)
        states = {
            "softmax": (SoftmaxState(k=rows(position, kv_heads), v=rows(position, kv_heads)),
                        lambda state: softmax_attention_step(q, k, v, state)),
            "cubit": (CubitState(k=rows(position, kv_heads), u=rows(position, heads), r_hat=rows(position, heads) / 8),
                      lambda state: cubit_attention_step(q, k, v, r, state)),
            "deltaformer": (DeltaFormerState(k=rows(position, kv_heads), u=rows(position, heads)),
                            lambda state: deltaformer_attention_step(q, k, v, state)),
        }
        for mixer, (state, step) in states.items():
            times = []
            with torch.no_grad():
                for _ in range(WARMUP + 24):
                    started = time.perf_counter()
                    _, state = step(state)
                    times.append(time.perf_counter() - started)
            ms = statistics.median(times[WARMUP:]) * 1e3
            print(f"op {mixer} position {position}: {ms:.3f} ms/token", flush=True)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    _op_steps()
    for mixer in MIXERS:
        model = CausalLM(ModelConfig.preset("mini", mixer=mixer), seed=0).eval()
        for position in POSITIONS:
            ids = torch.randint(0, 256, (1, position), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                out = model(ids, use_cache=True)
                token, times = ids[:, -1:], []
                for step in range(WARMUP + TIMED):
                    started = time.perf_counter()
                    out = model(token, cache=out.cache, use_cache=True)
                    times.append(time.perf_counter() - started)
                with _CountOps() as ops:
                    model(token, cache=out.cache, use_cache=True)
            ms = statistics.median(times[WARMUP:]) * 1e3
            print(f"{mixer} position {position}: {ms:.3f} ms/token, {ops.count} aten ops/token", flush=True)


if __name__ == "__main__":
    main()
