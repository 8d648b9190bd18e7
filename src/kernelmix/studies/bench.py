"""Speed and memory of the mixers' ops: ``kernelmix bench``.

For each mixer and sequence length: forward and forward+backward time (median over repeats after
a warm-up), peak memory of forward+backward, the op's FLOPs (counts below) and the achieved rate
against a matrix-multiply peak measured in the same run; decode latency per token versus the
position; and the crossover length against softmax attention (SDPA). Everything is measured in
one run and written as JSON (+ PNG when matplotlib is installed); nothing is typed in by hand.

Timings run first, in this process, under the default allocator, round-robin: at each length
every op (mixers and peers) runs once per repetition, and each mixer's decode steps at every
position likewise, so that a slow spell of a shared machine slows all the ops it compares. Peak
memory comes after: on CPU each op's forward+backward runs once more in a fresh process whose
allocator returns freed blocks at once (:data:`MEMORY_PROBE_ENV`), so the resident-set growth
counts the op's live tensors and does not depend on what ran before; on CUDA it is the caching
allocator's peak.

FLOP counts: :func:`kernelmix.studies.flops.forward_flops` (its module docstring lists them; the
same counts ``kernelmix compare --budget flops`` uses): the causal pairs of each op, one
multiply-add = 2 FLOPs, per (batch, head). Backward is counted as 2× forward.

``autocast`` (e.g. ``"bfloat16"``): fp32 inputs, every mixer's forward run under
``torch.autocast(device, dtype)`` (backward outside it, as in training) — the mixed-precision
path of a model, as opposed to ``dtype="bfloat16"`` (bf16 inputs). The matmul peak stays the
inputs' (fp32) one. Each op's forward+backward is then also timed without autocast in the same
round-robin (``without_autocast_ms``; the table's "vs no autocast" column).

Peers (``--peers``, optional extra ``peers``): performer-pytorch's causal FAVOR+ (its CPU path),
flash-linear-attention's reference DeltaFormer (``fla.ops.deltaformer.naive``; it is the Q–K form,
i.e. our ``w="q"``), and our own dense ``solve_triangular`` Cubit — each skipped with a note when
not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import ops
from ..layers import registry
from ..output import pyplot, write_json_atomic
from .decode_timing import decode_step_after_prefill
from .demo import DTYPES, MMAP_THRESHOLD_BYTES, cuda_peak_memory_mb, median_ms, peak_memory_mb, sync_device
from .flops import forward_flops
from .settings import PEERS, BenchConfig

# the registry's mixers with an op-level call (kernelmix.layers.registry), a live view
MIXER_NAMES = registry.OP_MIXERS


@dataclass
class BenchRecord:
    mixer: str
    length: int
    forward_ms: float | None
    forward_backward_ms: float | None
    peak_memory_mb: float | None
    forward_gflop: float
    achieved_gflops: float | None  # forward+backward FLOPs / forward+backward time
    note: str = ""
    # autocast runs: fwd+bwd of the same op without autocast (inputs' dtype), timed in the same
    # round-robin as forward_backward_ms
    without_autocast_ms: float | None = None


@dataclass
class DecodeRecord:
    mixer: str
    position: int
    step_ms: float


@dataclass
class BenchReport:
    device: str
    dtype: str
    batch: int
    heads: int
    head_dim: int
    num_features: int
    chunk_size: int
    threads: int
    matmul_peak_gflops: float
    records: list[BenchRecord] = field(default_factory=list)
    decode: list[DecodeRecord] = field(default_factory=list)
    crossover: dict[str, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    autocast: str | None = None  # the autocast dtype the forward passes ran under (None: off)


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Achieved GFLOP/s of one large square matrix product: the machine's practical peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, repeats, device)
    return 2.0 * size**3 / (ms * 1e-3) / 1e9


def _mixer_call(mixer: str, inputs: dict, chunk_size: int):
    call = registry.op_call(mixer)  # kernelmix.ops.calls: the op as the studies call it
    return lambda: call(inputs, chunk_size=chunk_size)


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _autocast(device: torch.device, autocast: str | None):
    """A fresh context manager: ``torch.autocast`` in the given dtype, or nothing."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[autocast])


def _inputs(batch, length, heads, head_dim, num_features, device, dtype, requires_grad):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return {
        "q": rnd(batch, length, heads, head_dim),
        "k": rnd(batch, length, heads, head_dim),
        "v": rnd(batch, length, heads, head_dim),
        "r": rnd(batch, length, heads, head_dim),
        "rho": (0.5 + 1.5 * torch.rand(batch, length, heads, generator=g)).to(device),
        "beta": torch.rand(batch, length, heads, generator=g).to(device),
        "projection": ops.orthogonal_random_features(num_features, head_dim, num_heads=heads, generator=g).to(device),
        "transform": (torch.eye(head_dim) + 0.05 * torch.randn(heads, head_dim, head_dim, generator=g)).to(device),
    }


def _op(kind: str, name: str, length: int, *, batch: int, heads: int, head_dim: int, num_features: int,
        chunk_size: int, device: torch.device, dtype: torch.dtype):
    """``(call, grad_out, forward FLOPs)`` of one of our mixers (``kind="mixer"``) or a peer on fresh
    inputs that need gradients; ``call`` is a string saying why when a peer cannot run."""
    inputs = _inputs(batch, length, heads, head_dim, num_features, device, dtype, requires_grad=True)
    if kind == "mixer":
        call, base = _mixer_call(name, inputs, chunk_size), name
    else:
        call, base = _peer_call(name, inputs, num_features), PEER_BASES[name]
    grad_out = torch.randn(batch, length, heads, head_dim, device=device, dtype=dtype)
    return call, grad_out, forward_flops(base, length, head_dim, num_features, chunk_size) * batch * heads


def _forward_backward(call: Callable[[], torch.Tensor], grad_out: torch.Tensor, device: torch.device,
                      autocast: str | None) -> Callable[[], None]:
    def run():
        with _autocast(device, autocast):
            out = call()
        out.backward(grad_out.to(out.dtype))  # autocast may return its own dtype

    return run


def _no_grad_forward(call: Callable[[], torch.Tensor], device: torch.device,
                     autocast: str | None) -> Callable[[], None]:
    def run():
        with torch.no_grad(), _autocast(device, autocast):
            call()

    return run


def interleaved_medians_ms(fns: list[Callable[[], object]], repeats: int, device: torch.device) -> list[float]:
    """Median wall time of each of ``fns`` in ms, measured round-robin: after one warm-up call of
    each, every repetition runs every function once. On a shared machine whose speed drifts (this
    project's 2-core runner: ±10–20% within minutes), a slow spell then slows every op it compares
    alike instead of whichever op happened to be measured during it, so the ratios hold better than
    those of back-to-back medians."""
    for fn in fns:
        fn()
    sync_device(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync_device(device)
            spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(spent) for spent in times]


# glibc settings of the memory probe: every block ≥ 64 KiB is mmapped and unmapped when freed, so
# the resident high-water mark counts the op's live tensors, not what the allocator kept from
# earlier work (with its default, dynamic threshold the same op measured 125–140 MiB from run to
# run in one process). Set in the environment, they hold from the probe's first allocation.
MEMORY_PROBE_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
}


def op_peak_memory_mb(kind: str, name: str, length: int, *, batch: int, heads: int, head_dim: int,
                      num_features: int, chunk_size: int, device: torch.device, dtype: torch.dtype,
                      autocast: str | None = None, threads: int | None = None) -> float | str:
    """Peak memory of one forward+backward in MiB, or a string saying why it was not measured.

    CUDA: the allocator's peak, in this process. CPU: the resident-set growth, measured in a fresh
    Python process (:data:`MEMORY_PROBE_ENV`) — so that neither this process's heap nor the malloc
    settings the measurement needs touch the timings, which run under the default allocator."""
    shape = dict(batch=batch, heads=heads, head_dim=head_dim, num_features=num_features, chunk_size=chunk_size)
    if device.type == "cuda":
        call, grad_out, _ = _op(kind, name, length, device=device, dtype=dtype, **shape)
        if isinstance(call, str):
            return call
        return cuda_peak_memory_mb(_forward_backward(call, grad_out, device, autocast), device)
    spec = dict(kind=kind, name=name, length=length, device=str(device), dtype=str(dtype).removeprefix("torch."),
                autocast=autocast, threads=threads or torch.get_num_threads(), **shape)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kernelmix.studies.bench", "--memory-probe", json.dumps(spec)],
            env={**os.environ, **MEMORY_PROBE_ENV}, capture_output=True, text=True, timeout=3600,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"memory probe did not run ({type(error).__name__}: {error})"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last_error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"memory probe failed (exit {done.returncode}): {last_error}"
    peak = json.loads(lines[-1])["peak_mb"]
    return peak if peak is not None else "no resident-set counters here (Linux only)"


def _memory_probe(spec: dict) -> None:
    """The child side of :func:`op_peak_memory_mb`: one warm-up, then one measured fwd+bwd."""
    torch.set_num_threads(spec.pop("threads"))
    kind, name, length, autocast = spec.pop("kind"), spec.pop("name"), spec.pop("length"), spec.pop("autocast")
    device, dtype = torch.device(spec.pop("device")), getattr(torch, spec.pop("dtype"))
    call, grad_out, _ = _op(kind, name, length, device=device, dtype=dtype, **spec)
    if isinstance(call, str):
        raise SystemExit(call)
    run = _forward_backward(call, grad_out, device, autocast)
    run()  # one-time allocations (thread pools, kernels, lazy imports) are not the op's
    print(json.dumps({"peak_mb": peak_memory_mb(run)}))


# A step is ~1 ms: two repeats let one scheduler hiccup decide the median (a 2.3× "growth" of
# Performer's O(1) step from position 256 to 8192 in one run; 200 repeats: 0.92 vs 0.78 ms).
DECODE_MIN_REPEATS = 50


def _decode_step(
    mixer: str, position: int, *, batch: int, heads: int, head_dim: int, num_features: int, chunk_size: int,
    device: torch.device, dtype: torch.dtype, autocast: str | None = None,
) -> Callable[[], object]:
    """One decode step (a no-argument call) after a prefill of ``position`` tokens
    (:func:`decode_step_after_prefill` on this bench's inputs, under its autocast setting)."""
    inputs = _inputs(batch, position + 1, heads, head_dim, num_features, device, dtype, requires_grad=False)
    return decode_step_after_prefill(mixer, inputs, position, chunk_size=chunk_size,
                                     context=lambda: _autocast(device, autocast))


# ---------------------------------------------------------------------------------------------
# Peers: public implementations measured side by side when installed (optional extra `peers`).

def _peer_call(peer: str, inputs: dict, num_features: int):
    """A zero-argument callable running ``peer`` on ``inputs``, or a string saying why it cannot run."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if peer == "cubit-dense":  # our own dense solve_triangular reference, as the naive baseline
        return lambda: ops.cubit_attention_naive(q, k, v, inputs["r"], rho=inputs["rho"])
    if peer == "performer-pytorch":
        try:
            from performer_pytorch import FastAttention
        except ImportError:
            return "performer-pytorch not installed (pip install 'kernelmix[peers]')"
        attention = FastAttention(dim_heads=q.shape[-1], nb_features=num_features, causal=True).to(q.device)
        return lambda: attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    if peer == "fla-deltaformer-naive":
        try:
            from fla.ops.deltaformer.naive import naive_deltaformer_attn
        except Exception as error:  # fla's import can fail on machines without its kernels
            return f"flash-linear-attention's naive DeltaFormer not importable ({type(error).__name__})"
        return lambda: naive_deltaformer_attn(q, k, v, inputs["beta"])
    raise ValueError(f"unknown peer {peer!r} (choose from: {', '.join(PEERS)})")


PEER_BASES = {"performer-pytorch": "performer", "fla-deltaformer-naive": "deltaformer", "cubit-dense": "cubit"}


def crossover_length(records: list[BenchRecord], mixer: str) -> int | None:
    """Smallest measured T from which ``mixer``'s forward+backward is faster than softmax's at every
    larger measured T (None if never)."""
    mine = {r.length: r.forward_backward_ms for r in records if r.mixer == mixer and r.forward_backward_ms}
    base = {r.length: r.forward_backward_ms for r in records if r.mixer == "softmax" and r.forward_backward_ms}
    lengths = sorted(set(mine) & set(base))
    result = None
    for t in reversed(lengths):
        if mine[t] < base[t]:
            result = t
        else:
            break
    return result


def run_bench(config: BenchConfig | None = None, *, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every op of ``config`` (default :class:`BenchConfig`): timings, decode, then memory."""
    config = BenchConfig() if config is None else config
    say = progress or (lambda text: None)
    torch_device, torch_dtype = torch.device(config.device), DTYPES[config.dtype]
    report = BenchReport(
        device=str(torch_device), dtype=config.dtype, batch=config.batch, heads=config.heads, head_dim=config.head_dim,
        num_features=config.num_features, chunk_size=config.chunk_size, threads=torch.get_num_threads(),
        matmul_peak_gflops=matmul_peak_gflops(torch_device, torch_dtype), autocast=config.autocast,
    )
    shape = dict(batch=config.batch, heads=config.heads, head_dim=config.head_dim, num_features=config.num_features,
                 chunk_size=config.chunk_size, device=torch_device, dtype=torch_dtype)
    peer_records, missing_peers = [], set()
    for length in config.lengths:
        mixer_records, peers_at_length = _time_length(config, length, shape, report.notes, missing_peers, say)
        report.records += mixer_records
        peer_records += peers_at_length
    report.records += peer_records
    # Decode: one mixer's steps at every position round-robin, so that its growth with the position
    # is measured under the same conditions. (Not across mixers: a step that follows another
    # mixer's long-context step finds its state evicted from the caches, and Performer's O(1) step
    # then seemed to grow 1.5× from position 256 to 8192 after DeltaFormer's 8192-token cache.)
    for mixer in config.mixers if config.decode_positions else ():
        say(f"decode {mixer} at positions {', '.join(map(str, config.decode_positions))}")
        steps = [_decode_step(mixer, position, autocast=config.autocast, **shape)
                 for position in config.decode_positions]
        decode_ms = interleaved_medians_ms(steps, max(config.repeats, DECODE_MIN_REPEATS), torch_device)
        report.decode += [DecodeRecord(mixer, position, ms) for position, ms in zip(config.decode_positions, decode_ms)]
        del steps
    if config.memory:  # after every timing (see op_peak_memory_mb)
        _measure_memory(report, config.autocast, shape, say)
    report.crossover = {m: crossover_length(report.records, m) for m in config.mixers if m != "softmax"}
    return report


def _time_length(config: BenchConfig, length: int, shape: dict, notes: list[str], missing_peers: set[str], say):
    """Forward and forward+backward medians of every mixer and peer at one length, timed
    round-robin (:func:`interleaved_medians_ms`) so that the ratios within a length are measured
    under the same machine conditions. Returns ``(mixer records, peer records)``."""
    device, autocast = shape["device"], config.autocast
    entries = []  # (record name, call, grad_out, forward FLOPs)
    for mixer in config.mixers:
        call, grad_out, flops = _op("mixer", mixer, length, **shape)
        entries.append((mixer, call, grad_out, flops))
    for peer in config.peers:
        if peer in missing_peers:
            continue
        if length > config.peer_max_length:
            notes.append(f"peer {peer} skipped at T={length} (> peer_max_length={config.peer_max_length})")
            continue
        call, grad_out, flops = _op("peer", peer, length, **shape)
        if isinstance(call, str):
            notes.append(f"peer {peer} skipped: {call}")
            missing_peers.add(peer)
            continue
        entries.append((f"peer:{peer}", call, grad_out, flops))
    say(f"T={length}: {', '.join(name for name, *_ in entries)}")
    forwards = [_no_grad_forward(call, device, autocast) for _, call, _, _ in entries]
    steps = [_forward_backward(call, grad_out, device, autocast) for _, call, grad_out, _ in entries]
    if autocast:  # the same ops without autocast, in the same round-robin: bf16 vs fp32 in one run
        steps += [_forward_backward(call, grad_out, device, None) for _, call, grad_out, _ in entries]
    forward_ms = interleaved_medians_ms(forwards, config.repeats, device)
    fb_ms = interleaved_medians_ms(steps, config.repeats, device)
    plain_ms = fb_ms[len(entries):] or [None] * len(entries)
    mixers, peers = [], []
    for (name, _, _, flops), fwd, fb, plain in zip(entries, forward_ms, fb_ms, plain_ms):
        record = BenchRecord(name, length, fwd, fb, None, flops / 1e9, 3 * flops / (fb * 1e-3) / 1e9,
                             without_autocast_ms=plain)
        (peers if name.startswith("peer:") else mixers).append(record)
    return mixers, peers


def _measure_memory(report: BenchReport, autocast: str | None, shape: dict, say) -> None:
    """Peak memory of every record's forward+backward (a fresh process per op on CPU)."""
    for record in report.records:
        say(f"memory {record.mixer} T={record.length}")
        is_peer = record.mixer.startswith("peer:")
        kind, name = ("peer", record.mixer.removeprefix("peer:")) if is_peer else ("mixer", record.mixer)
        peak = op_peak_memory_mb(kind, name, record.length, autocast=autocast, **shape)
        if isinstance(peak, str):
            report.notes.append(f"{record.mixer} T={record.length}: {peak}")
        else:
            record.peak_memory_mb = peak


def _autocast_label(report: BenchReport) -> str:
    return f" under {report.autocast} autocast" if report.autocast else ""


def format_report(report: BenchReport) -> str:
    lines = [
        f"device {report.device}, {report.dtype}{_autocast_label(report)}, B={report.batch} H={report.heads} "
        f"d={report.head_dim} m={report.num_features} chunk={report.chunk_size}, {report.threads} threads; "
        f"matmul peak {report.matmul_peak_gflops:.1f} GFLOP/s",
        "",
        f"{'mixer':<28} {'T':>6} {'fwd ms':>9} {'fwd+bwd ms':>11} {'vs SDPA':>8} {'peak MiB':>9} "
        f"{'GFLOP/s':>8} {'% peak':>7}"
        + (f" {'vs no autocast':>15}" if report.autocast else ""),
    ]
    base = {r.length: r.forward_backward_ms for r in report.records if r.mixer == "softmax"}
    for r in report.records:
        ratio = (f"{r.forward_backward_ms / base[r.length]:.2f}x" if r.forward_backward_ms and base.get(r.length)
                 else "-")
        peak = f"{r.peak_memory_mb:.0f}" if r.peak_memory_mb is not None else "-"
        rate = f"{r.achieved_gflops:.1f}" if r.achieved_gflops else "-"
        share = f"{100 * r.achieved_gflops / report.matmul_peak_gflops:.0f}%" if r.achieved_gflops else "-"
        fb = f"{r.forward_backward_ms:.1f}" if r.forward_backward_ms else "-"
        line = f"{r.mixer:<28} {r.length:>6} {r.forward_ms:>9.1f} {fb:>11} {ratio:>8} {peak:>9} {rate:>8} {share:>7}"
        if report.autocast:  # fwd+bwd under autocast / without it, same run
            vs_plain = (f"{r.forward_backward_ms / r.without_autocast_ms:.2f}x"
                        if r.forward_backward_ms and r.without_autocast_ms else "-")
            line += f" {vs_plain:>15}"
        lines.append(line)
    if report.decode:
        lines += ["", f"{'decode':<12} {'position':>8} {'ms/token':>9}"]
        lines += [f"{d.mixer:<12} {d.position:>8} {d.step_ms:>9.3f}" for d in report.decode]
    if report.crossover:
        lines += ["", "crossover vs softmax (fwd+bwd faster from this T on, among measured T): "
                  + ", ".join(f"{m} {t if t is not None else 'none'}" for m, t in report.crossover.items())]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def write_report(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """Write ``bench.json`` (and ``bench.png`` when matplotlib is available) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    try:
        plt = pyplot()
    except ImportError:
        report.notes.append("matplotlib not installed: no plot written (pip install 'kernelmix[plot]')")
        write_json_atomic(json_path, asdict(report))
        return [json_path]
    write_json_atomic(json_path, asdict(report))
    written = [json_path]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    def draw(ax, points, label):  # unmeasured values (None: --no-memory, forward only) are left out
        points = [(x, y) for x, y in points if y is not None and y > 0]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)

    for mixer in dict.fromkeys(r.mixer for r in report.records):
        rows = [r for r in report.records if r.mixer == mixer]  # peers are drawn too ("peer:…")
        draw(axes[0], [(r.length, r.forward_backward_ms) for r in rows], mixer)
        draw(axes[1], [(r.length, r.peak_memory_mb) for r in rows], mixer)
        draw(axes[2], [(d.position, d.step_ms) for d in report.decode if d.mixer == mixer], mixer)
    for ax, title, ylabel in zip(
        axes, ("forward+backward time", "peak memory (fwd+bwd)", "decode latency"), ("ms", "MiB", "ms / token")
    ):
        if ax.lines:  # a log axis needs positive data
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("T" if title != "decode latency" else "position")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    if axes[0].lines:
        axes[0].legend()
    fig.suptitle(f"kernelmix bench — {report.device}, {report.dtype}{_autocast_label(report)}, "
                 f"B={report.batch} H={report.heads} d={report.head_dim}")
    fig.tight_layout()
    png = out / "bench.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    written.append(png)
    return written


__all__ = [
    "BenchConfig", "BenchRecord", "BenchReport", "DecodeRecord", "MIXER_NAMES", "PEERS",
    "crossover_length", "interleaved_medians_ms", "op_peak_memory_mb",
    "format_report", "forward_flops", "matmul_peak_gflops", "run_bench", "write_report",
]


if __name__ == "__main__":  # the memory probe's child process (op_peak_memory_mb)
    if len(sys.argv) != 3 or sys.argv[1] != "--memory-probe":
        raise SystemExit("usage: python -m kernelmix.studies.bench --memory-probe SPEC_JSON "
                         "(internal; use `kernelmix bench`)")
    _memory_probe(json.loads(sys.argv[2]))
