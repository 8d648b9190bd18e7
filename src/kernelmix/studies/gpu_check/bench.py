"""Part (b): forward and forward+backward time and peak memory of every mixer against SDPA, the
decode latency against the position, and the issue's targets read from them."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ... import ops
from ..decode_timing import decode_step_after_prefill
from .measure import Timer, fast_backend, free_memory, is_out_of_memory, short_error, wall_seconds
from .report import ratio
from ...layers import registry
from .settings import FLA_PEER, FLA_PEER_LEAVES, FLA_PEER_OF, LONG_MIXERS, MIXERS, Sizes, solve_variants

def mixer_leaves(mixer: str) -> tuple[str, ...]:
    """The inputs a mixer's forward+backward differentiates (the per-token activations and, for
    DARKFormer, its learned transform; the random projection is a fixed buffer): the registry's."""
    if mixer == FLA_PEER:
        return FLA_PEER_LEAVES
    return registry.mixer_info(solve_variants().get(mixer, mixer)).leaves


def bench_inputs(sizes: Sizes, length: int, device: torch.device,
                 requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """bf16 activations ``[B, T, H, d]`` (ρ and β in float32, as a model's gates), drawn on the device."""
    g = torch.Generator(device=device).manual_seed(length)
    cpu = torch.Generator().manual_seed(0)
    b, h, d = sizes.batch, sizes.heads, sizes.head_dim

    def rand(*size, normal=True, dtype=torch.bfloat16):
        draw = torch.randn if normal else torch.rand
        return draw(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    x = {name: rand(b, length, h, d) for name in ("q", "k", "v", "r")}
    x["rho"] = 0.5 + 1.5 * rand(b, length, h, normal=False, dtype=torch.float32)
    x["beta"] = rand(b, length, h, normal=False, dtype=torch.float32)
    x["transform"] = (torch.eye(d) + 0.05 * torch.randn(h, d, d, generator=cpu)).to(device)
    for tensor in x.values():
        tensor.requires_grad_(requires_grad)
    x["projection"] = ops.orthogonal_random_features(sizes.num_features, d, generator=cpu).to(device)
    return x


def mixer_forward(mixer: str, x: dict, backend: str, softmax_context: Callable, fla_op: Callable | None) -> Callable:
    """The no-argument forward of ``mixer`` on ``x`` (softmax: SDPA itself, the baseline)."""
    q, k, v = x["q"], x["k"], x["v"]
    if mixer == "softmax":
        def sdpa():
            with softmax_context():
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return sdpa
    if mixer == FLA_PEER:
        return lambda: fla_op(q, k, v, x["beta"].to(q.dtype))
    variant = solve_variants().get(mixer)
    call = registry.op_call(variant or mixer)  # kernelmix.ops.calls: the op as the studies call it
    if variant is None:
        return lambda: call(x, backend=backend)

    def with_operands():  # the solve's operands, chosen for the forward (its backward keeps them)
        with ops.solve_operands("bf16"):
            return call(x, backend=backend)
    return with_operands


def forward_only(call: Callable) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            call()
    return run


def forward_backward(call: Callable, leaves: list[torch.Tensor]) -> Callable[[], None]:
    """Forward, then the gradients of ``leaves`` (torch.autograd.grad: nothing accumulates between calls)."""
    grad_out: list[torch.Tensor] = []

    def run():
        out = call()
        if not grad_out:  # one fixed output gradient per cell, drawn at the first call
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, leaves, grad_out[0])
    return run


@dataclass
class Cell:
    """One (mixer, T) of the bench while it is measured."""

    record: dict
    forward: Callable[[], None]
    step: Callable[[], None]
    warmup_s: float
    repeats: int = 1
    forward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    @property
    def round_s(self) -> float:
        """One round (forward, then forward+backward), from the first round's times."""
        return (self.forward_ms[0] + self.step_ms[0]) / 1e3 if self.step_ms else 0.0

    @property
    def measured_s(self) -> float:
        """The timed rounds and the memory call: what the cell budget limits (not the warm-up, where
        the first length of a run compiles its Triton kernels)."""
        return self.round_s * (self.repeats + (self.record.get("peak_memory_mib") is not None))


def prepare_cell(mixer: str, length: int, x: dict, context: dict, sizes: Sizes) -> Cell:
    """The cell's calls, warmed up (Triton compiles in the first call)."""
    call = mixer_forward(mixer, x, context["backend"], context["softmax_context"], context["fla_op"])
    device = context["device"]
    forward, step = forward_only(call), forward_backward(call, [x[n] for n in mixer_leaves(mixer)])
    warmup_s = sum(wall_seconds(step, device) + wall_seconds(forward, device) for _ in range(sizes.warmup_calls))
    return Cell({"mixer": mixer, "length": length}, forward, step, warmup_s)


def bench_length(length: int, mixers: list[str], context: dict, sizes: Sizes, say) -> list[dict]:
    """Every mixer at one T: warm-up, interleaved timing rounds, then peak memory. A mixer whose cell
    fails (out of memory, an error) or runs past the cell budget is added to ``context["stopped"]``."""
    device, stopped = context["device"], context["stopped"]
    try:
        x = bench_inputs(sizes, length, device)
    except Exception as error:  # the inputs alone do not fit: no mixer runs at this length
        return [_failed_cell(mixer, length, error, stopped, device) for mixer in mixers]
    cells, records = [], []
    for mixer in mixers:
        say(f"(b) T={length} {mixer}: warm-up")
        try:
            cells.append(prepare_cell(mixer, length, x, context, sizes))
        except Exception as error:
            records.append(_failed_cell(mixer, length, error, stopped, device))
    _timing_rounds(cells, device, sizes)
    for cell in cells:
        _measure_cell(cell, device)
        if cell.measured_s > sizes.cell_budget_s:
            stopped[cell.record["mixer"]] = (f"stopped after T={length}: its cell took {cell.measured_s:.1f} s "
                                             f"> the cell budget of {sizes.cell_budget_s:.0f} s")
        cell.record.update(warmup_s=round(cell.warmup_s, 2), measured_s=round(cell.measured_s, 2))
        records.append(cell.record)
        say(f"(b) T={length} {cell.record['mixer']}: {_describe_cell(cell.record)}")
    del cells, x
    free_memory(device)
    return records


def _failed_cell(mixer: str, length: int, error: BaseException, stopped: dict, device: torch.device) -> dict:
    reason = "out of memory" if is_out_of_memory(error) else short_error(error)
    stopped[mixer] = f"stopped at T={length}: {reason}"
    free_memory(device)
    return {"mixer": mixer, "length": length, "note": reason}


def _timing_rounds(cells: list[Cell], device: torch.device, sizes: Sizes) -> None:
    """Round-robin: each round times every cell's forward and forward+backward once. The first
    round sets each cell's repeats (as many as its time budget holds, at most ``sizes.repeats``, at least 1);
    cells with fewer repeats drop out of the later rounds."""
    timer = Timer(device)
    _timed_round(cells, 0, timer)
    for cell in cells:  # the rounds and one more forward+backward for the peak memory fit the budget
        cell.repeats = max(1, min(sizes.repeats, int(sizes.cell_budget_s / max(cell.round_s, 1e-6)) - 1))
    for round_index in range(1, max((c.repeats for c in cells), default=0)):
        _timed_round(cells, round_index, timer)


def _timed_round(cells: list[Cell], round_index: int, timer: Timer) -> None:
    for cell in cells:
        if round_index < cell.repeats and "note" not in cell.record:
            try:
                timer.time(cell.forward, cell.forward_ms)
                timer.time(cell.step, cell.step_ms)
            except Exception as error:
                cell.record["note"] = "out of memory" if is_out_of_memory(error) else short_error(error)
    timer.collect()


def _measure_cell(cell: Cell, device: torch.device) -> None:
    """Medians of the timed rounds and, on CUDA, the peak memory of one more forward+backward."""
    record = cell.record
    record["repeats"] = len(cell.step_ms)
    record["forward_ms"] = statistics.median(cell.forward_ms) if cell.forward_ms else None
    record["forward_backward_ms"] = statistics.median(cell.step_ms) if cell.step_ms else None
    record["peak_memory_mib"] = None
    if device.type != "cuda" or "note" in record:
        return
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        cell.step()
        torch.cuda.synchronize(device)
        record["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    except Exception as error:
        record["note"] = f"peak memory: {short_error(error)}"


def _describe_cell(record: dict) -> str:
    if record.get("forward_backward_ms") is None:
        return record.get("note", "not measured")
    peak = record.get("peak_memory_mib")
    return (f"fwd {record['forward_ms']:.3f} ms, fwd+bwd {record['forward_backward_ms']:.3f} ms"
            + (f", peak {peak:.0f} MiB" if peak is not None else "") + f" ({record['repeats']} repeats)")


def softmax_backend(device: torch.device) -> tuple[Callable, str]:
    """``(context factory, note)``: SDPA pinned to its flash kernel where that runs here (a tiny
    probe), else SDPA's own choice, and why."""
    if device.type != "cuda":
        return contextlib.nullcontext, "SDPA's default backend (the flash kernel is CUDA-only)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

        probe = torch.randn(1, 2, 128, 128, device=device, dtype=torch.bfloat16)
        with flash():
            torch.nn.functional.scaled_dot_product_attention(probe, probe, probe, is_causal=True)
        return flash, "SDPA pinned to the flash backend (torch.nn.attention.sdpa_kernel)"
    except Exception as error:
        return contextlib.nullcontext, f"SDPA's default backend: the flash backend did not run ({short_error(error)})"


def fla_deltaformer(device: torch.device) -> tuple[Callable | None, str]:
    """flash-linear-attention's DeltaFormer (``fla.ops.deltaformer.deltaformer_attn``) or None, and a note."""
    try:
        from fla.ops.deltaformer import deltaformer_attn
    except Exception as error:  # fla's import can fail for reasons of its own (flash-attn, triton versions)
        return None, f"{FLA_PEER}: not importable: {short_error(error)}"
    if device.type != "cuda":
        return None, f"{FLA_PEER}: importable, but its kernels are CUDA-only: not run on {device}"
    return deltaformer_attn, f"{FLA_PEER}: fla.ops.deltaformer.deltaformer_attn"


def bench_decode(mixer: str, context: dict, sizes: Sizes, say) -> list[dict]:
    """Decode latency of one mixer at every position, the positions interleaved round by round (a
    step after another mixer's long cache finds the caches cold: not across mixers)."""
    device, positions = context["device"], sizes.decode_positions
    say(f"(b) decode {mixer} at positions {', '.join(map(str, positions))}")
    try:
        x = bench_inputs(sizes, max(positions) + 1, device, requires_grad=False)
        steps = [decode_step_after_prefill(mixer, x, position, backend=context["backend"]) for position in positions]
        for step in steps:  # warm-up
            step()
        times: list[list[float]] = [[] for _ in steps]
        timer = Timer(device)
        for _ in range(sizes.decode_repeats):
            for step, spent in zip(steps, times):
                timer.time(step, spent)
            timer.collect()
    except Exception as error:
        reason = "out of memory" if is_out_of_memory(error) else short_error(error)
        free_memory(device)
        return [{"mixer": mixer, "position": None, "step_ms": None, "note": reason}]
    rows = [{"mixer": mixer, "position": p, "step_ms": statistics.median(t)} for p, t in zip(positions, times)]
    say(f"(b) decode {mixer}: " + ", ".join(f"{r['position']}: {r['step_ms']:.3f} ms" for r in rows))
    del steps, x
    free_memory(device)
    return rows


def run_bench(part: dict, sizes: Sizes, device: torch.device, say: Callable[[str], None],
              save: Callable[[], None] = lambda: None) -> None:
    """Part (b) into ``part``: the lengths, the decode positions, then the long length if time is
    left; ``save`` after each (the JSON keeps what finished if the run is killed)."""
    backend, backend_note = fast_backend(device)
    softmax_context, softmax_note = softmax_backend(device)
    fla_op, fla_note = fla_deltaformer(device)
    context = {"device": device, "backend": backend or "torch", "softmax_context": softmax_context,
               "fla_op": fla_op, "stopped": {}}
    notes = [n for n in (backend_note, softmax_note, fla_note) if n]
    if device.type != "cuda":
        notes += ["peak memory is measured on CUDA only (the caching allocator's peak)",
                  "on CPU the timings (the Triton kernels under the interpreter) and the targets read from them "
                  "only show that the code runs"]
    part.update(backend=context["backend"], shape={"batch": sizes.batch, "heads": sizes.heads,
                                                   "head_dim": sizes.head_dim, "num_features": sizes.num_features,
                                                   "dtype": "bfloat16"},
                records=[], decode=[], notes=notes, stopped=context["stopped"])
    mixers = list(MIXERS) + list(solve_variants()) + ([FLA_PEER] if fla_op is not None else [])
    budget, started = sizes.part_budget_s["b"], time.perf_counter()
    for length in sizes.lengths:
        if time.perf_counter() - started > 0.75 * budget:  # the rest is the decode's and the long length's
            notes.append(f"not run: T={length} and longer (three quarters of part (b)'s {budget:.0f} s were spent)")
            break
        active = [m for m in mixers if m not in context["stopped"]]
        part["records"] += bench_length(length, active, context, sizes, say)
        save()
    for mixer in MIXERS:
        part["decode"] += bench_decode(mixer, context, sizes, say)
    save()
    _bench_long_length(part, context, sizes, started, say)
    part["targets"] = evaluate_targets(part["records"], part["decode"], sizes, fla_op is not None)


def _bench_long_length(part: dict, context: dict, sizes: Sizes, started: float, say) -> None:
    """T = 65536 (the issue: it must run for Cubit and DeltaFormer), last, when time is left."""
    if sizes.long_length is None:
        return
    budget = sizes.part_budget_s["b"]
    if time.perf_counter() - started > budget:
        part["notes"].append(f"not run: T={sizes.long_length} (part (b)'s {budget:.0f} s were spent)")
        return
    # an earlier stop (out of memory, the cell budget) says the long length will not go better
    for mixer in LONG_MIXERS:
        if mixer in context["stopped"]:
            part["notes"].append(f"T={sizes.long_length} not tried for {mixer}: {context['stopped'][mixer]}")
    active = [m for m in LONG_MIXERS if m not in context["stopped"]]
    if active:
        part["records"] += bench_length(sizes.long_length, active, context, sizes, say)


def _target(name: str, value: float | None, limit: float, *, at_most: bool, missing: str = "") -> dict:
    """A ratio target: passed when ``value`` ≤ ``limit`` (``at_most``) or ≥ it; None when not measured."""
    if value is None:
        return {"target": name, "measured": None, "unit": "×", "passed": None, "note": missing or "not measured"}
    passed = value <= limit if at_most else value >= limit
    return {"target": name, "measured": float(f"{value:.4g}"), "unit": "×", "passed": passed, "note": ""}


def family(name: str) -> list[str]:
    """The part's mixers of one registry family (the targets are the issue's per family)."""
    return [mixer for mixer, info in MIXERS.items() if info.family == name]


def evaluate_targets(records: list[dict], decode: list[dict], sizes: Sizes, fla_ran: bool) -> list[dict]:
    """The Targets of issue 16 as rows ``{target, measured, passed (None: not measured), note}``;
    ratios are within this run. (Quick runs read them at their tiny lengths: the code path only.)"""
    time_of = {(r["mixer"], r["length"]): r.get("forward_backward_ms") for r in records}
    peak_of = {(r["mixer"], r["length"]): r.get("peak_memory_mib") for r in records}
    step_of = {(d["mixer"], d["position"]): d["step_ms"] for d in decode}
    solve, features = sizes.target_lengths["solve"], sizes.target_lengths["features"]
    low, high = sizes.decode_positions[0], sizes.decode_positions[-1]
    rows = []
    solvers, features_mixers = family("solve"), family("random-features")
    for mixer in solvers + list(solve_variants()):  # and with bf16 operands
        rows.append(_target(f"{mixer} fwd+bwd ≤ 2.5× SDPA's at T={solve}",
                            ratio(time_of.get((mixer, solve)), time_of.get(("softmax", solve))), 2.5, at_most=True))
        rows.append(_target(f"{mixer} peak memory ≤ 2× SDPA's at T={solve}",
                            ratio(peak_of.get((mixer, solve)), peak_of.get(("softmax", solve))), 2.0, at_most=True,
                            missing="not measured (peak memory is CUDA-only)" if not any(peak_of.values()) else ""))
    for mixer in solvers:
        if sizes.long_length is None:
            rows.append({"target": f"{mixer} runs at the long length", "measured": None, "unit": "ms fwd+bwd",
                         "passed": None, "note": "no long length in this run"})
            continue
        ran = time_of.get((mixer, sizes.long_length))
        rows.append({"target": f"{mixer} runs at T={sizes.long_length}", "measured": ran, "unit": "ms fwd+bwd",
                     "passed": ran is not None, "note": "" if ran is not None else "did not run (see the notes)"})
    for mixer in features_mixers:
        rows.append(_target(f"{mixer} fwd+bwd ≥ 3× faster than SDPA at T={features}",
                            ratio(time_of.get(("softmax", features)), time_of.get((mixer, features))), 3.0,
                            at_most=False))
    for mixer in features_mixers:
        rows.append(_target(f"{mixer} decode at position {high} ≤ 1.2× position {low}",
                            ratio(step_of.get((mixer, high)), step_of.get((mixer, low))), 1.2, at_most=True))
    rows.append(_target(f"{FLA_PEER_OF} fwd+bwd ≤ {FLA_PEER}'s at T={solve}",
                        ratio(time_of.get((FLA_PEER_OF, solve)), time_of.get((FLA_PEER, solve))), 1.0, at_most=True,
                        missing="not measured: flash-linear-attention did not run here" if not fla_ran else ""))
    return rows
