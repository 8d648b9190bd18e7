"""The demo job: every mixer's fast path on one random batch, timed and checked against its
float64 reference; optionally the peak memory of Cubit's blocked solve vs the dense reference.

Everything here is measured in this run; nothing is typed in by hand.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import ops
from ..layers import registry
from ..output import progress_bar
from .settings import DemoConfig, check_device


@dataclass
class DemoRow:
    mixer: str
    shape: tuple[int, ...]
    forward_ms: float
    backward_ms: float
    forward_error: float
    grad_error: float


def _rel_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    err = (actual.double() - expected.double()).pow(2).mean().sqrt()
    return (err / expected.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


PER_TOKEN = ("q", "k", "v", "r")  # the inputs in the demo's dtype whose gradients are checked


def mixer_cases(batch: int, length: int, heads: int, head_dim: int, num_features: int, seed: int = 0):
    """``(cases, inputs)``: ``(label, mixer, options)`` for every registered mixer with an op call and
    each of its variants (``cubit (no LRR)``), and one random float64 batch of the studies' inputs
    (:mod:`kernelmix.ops.calls`)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    x = {name: rnd(batch, length, heads, head_dim) for name in PER_TOKEN}
    x["rho"] = 0.5 + 1.5 * torch.sigmoid(rnd(batch, length, heads))
    x["beta"] = torch.sigmoid(rnd(batch, length, heads))
    x["projection"] = ops.orthogonal_random_features(num_features, head_dim, num_heads=heads, generator=g,
                                                     dtype=torch.float64)
    x["transform"] = torch.eye(head_dim, dtype=torch.float64) + rnd(heads, head_dim, head_dim, scale=0.1)
    cases = []
    for mixer in registry.op_mixers():
        cases.append((mixer, mixer, {}))
        cases += [(f"{mixer} ({v.note})", mixer, dict(v.options)) for v in registry.mixer_info(mixer).variants
                  if v.op_level]
    return cases, x


ERROR_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the dtypes the studies run in


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in ms after one warm-up call (CUDA work is waited for)."""
    fn()
    sync_device(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_demo(config: DemoConfig | None = None, *, progress: bool = False) -> list[DemoRow]:
    """Each mixer's fast path (in ``config.dtype`` on ``config.device``) against its float64 reference;
    ``progress`` shows a bar (mixers done, the one running, time left) on stderr."""
    c = DemoConfig() if config is None else config
    batch, length, heads, head_dim, num_features, repeats = (
        c.batch, c.length, c.heads, c.head_dim, c.num_features, c.repeats)
    dtype = DTYPES[c.dtype]
    device = torch.device(c.device)
    rows = []
    cases, inputs = mixer_cases(batch, length, heads, head_dim, num_features)
    bar = progress_bar(progress, "demo", len(cases), fields={"mixer": "{}"})
    for name, mixer, options in cases:
        bar.update(mixer=name)
        call = registry.op_call(mixer)
        ref_inputs = {key: val.to(device, copy=True).requires_grad_(key in PER_TOKEN) for key, val in inputs.items()}
        reference = call(ref_inputs, reference=True, **options)
        grad_out = torch.randn_like(reference)
        reference.backward(grad_out)
        # per-token inputs in the demo dtype; the rest (the projection: a buffer in the layers) in float32
        fast_inputs = {key: val.to(device, dtype if key in PER_TOKEN else torch.float32, copy=True)
                       .requires_grad_(key in PER_TOKEN) for key, val in inputs.items()}

        def fast():  # noqa: B023  (called within this iteration only)
            return call(fast_inputs, **options)

        out = fast()
        out.backward(grad_out.to(dtype))
        grad_errors = [_rel_rmse(fast_inputs[key].grad, ref_inputs[key].grad) for key in PER_TOKEN
                       if ref_inputs[key].grad is not None]

        def forward():
            with torch.no_grad():
                fast()

        def forward_backward():
            fast().backward(grad_out.to(dtype))

        rows.append(
            DemoRow(
                mixer=name,
                shape=tuple(out.shape),
                forward_ms=median_ms(forward, repeats, device),
                backward_ms=median_ms(forward_backward, repeats, device),
                forward_error=_rel_rmse(out, reference),
                grad_error=max(grad_errors),
            )
        )
        bar.advance()
    bar.close()
    return rows


# ---------------------------------------------------------------------------------------------
# Peak memory (CPU): the kernel's resident-set high-water mark, reset before each measurement.


def _read_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


# Blocks at least this large are mmapped (and unmapped when freed) while memory is measured.
MMAP_THRESHOLD_BYTES = 64 * 1024


def _return_freed_memory_to_the_os() -> None:
    """Make glibc serve every block ≥ MMAP_THRESHOLD_BYTES by mmap and give it back on free.

    By default glibc raises its mmap threshold after the first large free and then keeps freed
    tensors in its heap, so a later measurement would reuse them and see no growth at all."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD (fixed: disables the dynamic threshold)
    libc.mallopt(-1, MMAP_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def peak_memory_mb(fn: Callable[[], object]) -> float | None:
    """Peak resident memory added while ``fn`` runs, in MiB (Linux + glibc; None where unsupported).

    Resets the kernel's high-water mark through /proc/self/clear_refs so measurements in one
    process do not see each other's peaks. Run ``fn`` once before measuring to exclude one-time
    start-up allocations (thread pools, kernels)."""
    try:
        gc.collect()
        _return_freed_memory_to_the_os()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        baseline = _read_status_kb("VmRSS")
        fn()
        return (_read_status_kb("VmHWM") - baseline) / 1024
    except OSError:
        return None


def cuda_peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - baseline) / 2**20


def cubit_memory(
    length: int = 4096, heads: int = 8, head_dim: int = 64, chunk_size: int = 64, device: str | torch.device = "cpu"
) -> dict[str, float | None]:
    """Peak memory of forward+backward: Cubit blocked vs Cubit dense reference vs SDPA (float32, B=1).

    On CPU the resident-set high-water mark; on CUDA the caching allocator's peak."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    q, k, v, r = (torch.randn(1, length, heads, head_dim, generator=g).to(device) for _ in range(4))
    rho = (0.5 + 1.5 * torch.rand(1, length, heads, generator=g)).to(device)
    results: dict[str, float | None] = {}
    for label, fn in (
        ("blocked", lambda *a, **kw: ops.cubit_attention(*a, chunk_size=chunk_size, **kw)),
        ("dense", ops.cubit_attention_naive),
        ("softmax (SDPA)", lambda q_, k_, v_, r_, rho: ops.softmax_attention(q_, k_, v_)),
    ):
        args = [x.clone().requires_grad_() for x in (q, k, v, r)]

        def step():
            out = fn(*args, rho=rho)
            out.sum().backward()

        small = [x[:, :256].detach().requires_grad_() for x in (q, k, v, r)]
        fn(*small, rho=rho[:, :256]).sum().backward()  # warm-up: one-time allocations
        results[label] = cuda_peak_memory_mb(step, device) if device.type == "cuda" else peak_memory_mb(step)
    return results


def format_table(rows: list[DemoRow]) -> str:
    header = f"{'mixer':<16} {'output shape':<20} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd err':>9} {'grad err':>9}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.mixer:<16} {str(list(row.shape)):<20} {row.forward_ms:>9.1f} {row.backward_ms:>11.1f} "
            f"{row.forward_error:>9.1e} {row.grad_error:>9.1e}"
        )
    return "\n".join(lines)


def describe(rows: list[DemoRow], dtype: torch.dtype = torch.float32, device: str = "cpu") -> str:
    worst = max(max(r.forward_error, r.grad_error) for r in rows)
    bound = ERROR_BOUNDS[dtype]
    where = f"{torch.get_num_threads()} CPU threads" if torch.device(device).type == "cpu" else str(device)
    return (
        f"{str(dtype).replace('torch.', '')} fast paths vs float64 references: worst relative RMSE {worst:.1e} "
        f"({'within' if worst < bound else 'ABOVE'} the {bound:g} bound); times are medians on {where}."
    )


__all__ = ["DTYPES", "DemoConfig", "check_device", "DemoRow", "run_demo", "cubit_memory", "peak_memory_mb",
           "format_table", "describe", "mixer_cases"]
