"""``kernelmix gpu-check --plan``: the launch report of every Triton kernel, made on a CPU.

For each mixer with Triton kernels (Cubit's and DeltaFormer's solve, Performer's and DARKFormer's
random features, Cubit-RF's state recurrence and read-out) at the plan's shapes (:data:`PLAN_SHAPES`:
the gpu-check head B=1, H=16, T=8192, d=128, m=128, which is also the 1.3b preset's, and the 125m
preset's H=12, d=64), it records:

- the launch grid the op uses at those sizes (the ops' own launch code on meta tensors), programs
  against the H200's 132 SMs (the target: ≥ 2 per SM, or a reason why fewer is right);
- what the sm_90 compiler reports, compiling ahead of time here (:mod:`.plan_compile`, its own
  process): registers per thread, spilled bytes, stack frame, shared memory, compile seconds;
- the FLOPs and bytes one launch executes and moves (:mod:`.plan_costs`), the arithmetic
  intensity and a roofline time on an H200; per mixer, forward + backward against SDPA's.

Compiles are kept in ``OUT/compiled.jsonl`` as they finish, keyed by the kernel's source hash,
its constexprs and warps, and Triton's version: an interrupted plan resumes where it stopped, and a
kernel whose source changed is compiled again. Writes ``OUT/plan.json``, ``OUT/plan.md`` and
``OUT/README.md``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ...errors import KernelmixError
from ..flops import forward_flops
from .plan_compile import FEATURE_MIXERS, PLAN_MIXERS, RECURRENCE_MIXERS, mixer_launches
from .plan_costs import (H200, PROGRAMS_PER_SM_TARGET, Cost, feature_cost, recurrence_cost, roofline_seconds,
                         sdpa_cost, sdpa_streamed_cost, solve_cost)
from .plan_glue import feature_glue_ops, glue_seconds
from .settings import SOLVE_VARIANT

PLAN_FORMAT = "kernelmix.gpu_plan/1"
TARGET_SHAPE = "target"
PLAN_SHAPES = {
    TARGET_SHAPE: dict(batch=1, heads=16, kv_heads=16, length=8192, head_dim=128, features=128, chunk_size=64),
    "125m": dict(batch=1, heads=12, kv_heads=12, length=8192, head_dim=64, features=64, chunk_size=64),
    "gemma3": dict(batch=1, heads=4, kv_heads=1, length=8192, head_dim=256, features=256, chunk_size=64),
}
SHAPE_NOTES = {TARGET_SHAPE: "gpu-check's bench head, and the 1.3b preset's (H=16, d=128)",
               "125m": "the 125m preset's head (H=12, d=64)",
               "gemma3": "Gemma 3's attention head (270M and 1B: H=4, one KV head, d=256) with the conversion's "
                         "m=256; outside the issue's targets, reported so that spills at 256-wide heads are seen"}
LIMITS = dict(min_programs=PROGRAMS_PER_SM_TARGET * H200["sms"], max_registers=255, max_spilled_bytes=0,
              max_compile_s=60.0)
# what bounds each kernel's grid: the reason its program count is what it is
GRID_BOUNDS = {
    "solve_past_span": "B·H·⌈(rows of a span) / BLOCK_R⌉·⌈d_v/BLOCK_V⌉·SPLITS: every row of the span against the "
                       "earlier spans, BLOCK_R rows (SPAN_ROW_BLOCKS row blocks; with bf16 operands PAST_ROW_BLOCKS) "
                       "a program, each half of the columns (SPLITS = PAST_SPLITS with bf16 operands, else 1) its own",
    "solve_merge_partials": "B·H·⌈(rows of a span) / BLOCK_T⌉·⌈d_v/BLOCK_V⌉: the across-span kernel's two column "
                            "halves' partials merged, BLOCK_T rows a program",
    "solve_subspan_logits": "B·H·⌈T/BLOCK_T⌉: one program per BLOCK_T rows (a row block; 32 rows at 256-wide keys) "
                            "forms its rows' logits against their "
                            "sub-span (once per direction)",
    "solve_forward": "B·H·⌈d_v/BLOCK_V⌉ per sub-span: one program walks the sub-span's rows in order "
                     "(the forward substitution)",
    "solve_span_push": "B·H·⌈(rows after the sub-span in its span) / BLOCK_R⌉·⌈d_v/BLOCK_V⌉ (the median push's): "
                       "a solved sub-span pushed into the span's later rows, BLOCK_R rows a program "
                       "(SPAN_ROW_BLOCKS row blocks)",
    "solve_span_push_transposed": "B·H·⌈(columns before the sub-span in its span) / BLOCK_C⌉·⌈d_v/BLOCK_V⌉ (the "
                                  "median push's): a solved sub-span's db pushed into the span's earlier columns, "
                                  "BLOCK_C columns a program (SPAN_COLUMN_BLOCKS column blocks; one with TF32 "
                                  "operands at 256-wide keys)",
    "solve_future_span": "B·H·⌈(columns of a span) / BLOCK_C⌉·⌈d_v/BLOCK_V⌉: every column of the span against the "
                         "later spans, BLOCK_C columns a program (SPAN_COLUMN_BLOCKS column blocks; one with "
                         "TF32 operands at 256-wide keys)",
    "solve_transposed": "B·H·⌈d_v/BLOCK_V⌉ per sub-span: one program walks the sub-span's rows from the last (the back "
                        "substitution)",
    "solve_grad_rows": "B·H·⌈T/BLOCK_R⌉: one program per BLOCK_R rows (dx; GRADIENT_GROUP_BLOCKS row blocks)",
    "solve_grad_columns": "B·H·⌈T/BLOCK_C⌉: one program per BLOCK_C columns (dy, and dx by atomics where the row "
                          "kernel does not run; GRADIENT_GROUP_BLOCKS column blocks beside the row kernel and "
                          "with bf16 operands at heads up to 128 wide, else one)",
    "features_chunk_states": "⌈T/(S·C)⌉·B·H·⌈d_v/BLOCK_V⌉: one program per span of S chunks and value block",
    "features_state_scan": "B·H·⌈m/16⌉·⌈d_v/16⌉: one program per 16 × 16 tile of the state walks the spans in order",
    "features_forward": "⌈T/(S·C)⌉·B·H·⌈d_v/BLOCK_V⌉: one program per span and value block walks its chunks",
    "features_query_grad": "⌈T/(S·C)⌉·B·H·⌈m/BLOCK_M⌉: one program per span and block of features walks its chunks",
    "features_reverse_states": "⌈T/(S·C)⌉·B·H·⌈d_v/BLOCK_V⌉: one program per span and value block",
    "features_reverse_scan": "B·H·⌈m/16⌉·⌈d_v/16⌉: one program per 16 × 16 tile of the state walks the spans back",
    "features_key_grad": "⌈T/(S·C)⌉·B·H·⌈m/BLOCK_M⌉: one program per span and block of features walks its chunks "
                         "back",
    "features_value_grad": "⌈T/(S·C)⌉·B·H·⌈d_v/BLOCK_V⌉: one program per span and value block walks its chunks back",
    "features_key_norms": "⌈T/BLOCK_T⌉·B·H: one program per block of rows and head",
    "features_logits": "⌈T/BLOCK_T⌉·B·H: one program per block of rows and head",
    "features_chain": "⌈T/R⌉·B·H: one program per span of R rows (256, doubled while the grid keeps 264 programs) "
                      "and head",
    "features_chain_rows": "⌈T/BLOCK_T⌉·B·H: one program per block of rows and head",
    "features_chain_weights": "⌈T/R⌉·B·H·⌈m/BLOCK_F⌉: one program per span of R rows (as the fused chain's), head "
                              "and block of columns",
    "features_chain_norm": "⌈T/R⌉·B·H·⌈d/BLOCK_F⌉: one program per span of R rows (as the fused chain's), head and "
                           "block of columns",
    "cubit_rf_recurrence": "B·H·⌈d_v/BLOCK_V⌉: one program carries its value columns of R through the chunks in order",
    "cubit_rf_recurrence_backward": "B·H·⌈d_v/BLOCK_V⌉: one program carries its columns of dR from the last chunk",
}
_IN_SPAN = ("a triangular substitution is sequential in its rows: inside a sub-span of {span} rows it is the "
            "only order-dependent work, {share:.0%} of the solve's products; the rest runs in the span kernels "
            "and the pushes")
_PUSH = ("a push reaches the rows (columns) of its span on the far side of its sub-span: from {most} row "
         "blocks after the first sub-span down to {least} after the last but one; the pushes are {share:.0%} of "
         "the solve's products, and a longer span would give them more rows but the substitution more too")
# a kernel whose small grid is right says why (filled in per row by :func:`_why_fewer`)
_RECURRENCE = ("R_c = a_c R_{{c−1}} + K_cᵀ(X_c − A_c R_{{c−1}}) reads all m rows of R_{{c−1}}, so only its value "
               "columns split across programs, and the chunks go in order; it is {share:.0%} of Cubit-RF's Triton "
               "products (the per-chunk solves are torch's); its blocks are already 16 columns, the narrowest "
               "operand tl.dot takes")
_ROW_BLOCKS = ("its programs hold {rows} rows ({group} row blocks) and {width} value columns, and every column tile "
               "they stream serves all of them: the kernel is bound by its bytes, which fall as a program holds "
               "more rows (programs of half the rows would stream every tile twice as often); at 8 warps of over 128 "
               "registers a thread an SM holds one program, so {programs} programs are {waves}; "
               "it is {share:.0%} of the forward solve's products")
_COLUMN_BLOCKS = ("its programs hold {columns} columns ({column_group} column blocks) and {width} value columns, "
                  "and every row tile they stream serves all of them: the kernel is bound by its bytes, which fall "
                  "as a program holds more columns; at 8 warps of over 128 registers a thread an SM holds one "
                  "program, so {programs} programs are {waves}; it is {share:.0%} of the transposed solve's "
                  "products")
WHY_FEWER = {"solve_future_span": _COLUMN_BLOCKS, "solve_past_span": _ROW_BLOCKS, "solve_forward": _IN_SPAN,
             "solve_transposed": _IN_SPAN, "solve_span_push": _PUSH, "solve_span_push_transposed": _PUSH,
             "cubit_rf_recurrence": _RECURRENCE, "cubit_rf_recurrence_backward": _RECURRENCE}
ROOFLINE_LENGTHS = (8192, 16384)


def launch_cost(mixer: str, launch, shape: dict) -> Cost:
    """The executed cost of one launch of ``mixer``'s op at ``shape``."""
    batch_heads = shape["batch"] * shape["heads"]
    if launch.name.startswith("cubit_rf_"):
        return Cost(launch.calls * (once := recurrence_cost(launch.name, launch.tiles, batch_heads,
                                                             launch.grid[1])).flops, launch.calls * once.bytes)
    if launch.name.startswith("features_"):
        once = feature_cost(launch.name, launch.tiles, batch_heads, launch.grid[2] if len(launch.grid) > 2 else 1)
        return Cost(launch.calls * once.flops, launch.calls * once.bytes, launch.calls * once.split_flops)
    return solve_cost(launch.name, launch.tiles, batch_heads, has_beta=bool(launch.constexprs.get("HAS_BETA", False)),
                      has_doc=launch.tiles["has_doc"])


def kernel_sources(kernel) -> list[Path]:
    """The source files of a Triton kernel and of every device function it reaches (its module's, and the
    modules they come from, such as ``_triton_products``): what its binary depends on."""
    files, seen, pending = set(), set(), [kernel]
    while pending:
        fn = getattr(pending.pop(), "fn", None)  # a JITFunction's Python function
        if fn is None or id(fn) in seen or not getattr(fn, "__module__", "").startswith("kernelmix."):
            continue
        seen.add(id(fn))
        files.add(Path(inspect.getsourcefile(fn)))
        pending += [value for value in fn.__globals__.values() if hasattr(value, "fn")]
    return sorted(files)


def compile_key(mixer: str, label: str, launch) -> str:
    """What a compile's result depends on: the sources of the kernel and of the device functions it
    calls (:func:`kernel_sources`; the same under Triton's interpreter, which the tests run with), its
    constexprs and warps (the grid does not enter the binary)."""
    source = b"".join(path.read_bytes() for path in kernel_sources(launch.kernel))
    flags = ",".join(f"{k}={v}" for k, v in sorted(launch.constexprs.items()))
    digest = hashlib.sha256(source).hexdigest()[:16]
    return f"{label}/{mixer}/{launch.name}/{digest}/{flags}/warps={launch.num_warps}"


def plan_rows(shapes: dict | None = None, mixers=PLAN_MIXERS, kernels=None) -> list[dict]:
    """One row per (shape, mixer, kernel): the launch, its cost and its compile key (not compiled yet)."""
    rows = []
    for label, shape in (PLAN_SHAPES if shapes is None else shapes).items():
        for mixer in mixers:
            for launch in mixer_launches(mixer, shape):
                if kernels is not None and launch.name not in kernels:
                    continue
                cost = launch_cost(mixer, launch, shape)
                precision = launch.constexprs.get("OPERANDS", "fp32")
                if cost.flops and cost.split_flops == cost.flops:  # all of it fp32-accurate (the logits, the key norms)
                    precision = "tf32x3"
                rows.append(dict(
                    name=f"{mixer}/{launch.name}", mixer=mixer, kernel=launch.name, shape=dict(label=label, **shape),
                    grid=list(launch.grid), programs=launch.programs, calls=launch.calls, num_warps=launch.num_warps,
                    blocks={k: v for k, v in launch.constexprs.items() if k.startswith("BLOCK")}, precision=precision,
                    flops=cost.flops, bytes=cost.bytes, intensity=cost.intensity,
                    roofline_ms=1e3 * launch_seconds(cost, launch), products_ms=1e3 * products_seconds(cost, launch),
                    grid_bound=GRID_BOUNDS[launch.name], why_fewer=_why_fewer(mixer, launch, shape),
                    key=compile_key(mixer, label, launch)))
    return rows


def launch_seconds(cost: Cost, launch) -> float:
    """The roofline time of a kernel's launches in one call: fp32 products on CUDA cores, TF32 operands
    on tensor cores at the TF32 peak, bf16 operands (bf16 instructions) at the bf16 peak."""
    operands = launch.constexprs.get("OPERANDS", "fp32")
    peak = H200["fp32_flops"] if operands == "fp32" else H200["bf16_flops"] if operands == "bf16" else \
        H200["tf32_flops"]
    return roofline_seconds(cost, launch.programs, peak)


def products_seconds(cost: Cost, launch) -> float:
    """:func:`launch_seconds` with every byte free: the launch's products alone at its peak, over the SMs
    its grid occupies. What no work on its bytes (more rows a program, L2) takes it under."""
    return launch_seconds(Cost(cost.flops, 0.0, cost.split_flops), launch)


def _why_fewer(mixer: str, launch, shape: dict) -> str | None:
    """Why a grid under 2 programs per SM is right, for the kernels where it is (else None)."""
    text = WHY_FEWER.get(launch.name)
    if text is None or launch.programs >= LIMITS["min_programs"]:
        return None
    costs = {x.name: launch_cost(mixer, x, shape).flops for x in mixer_launches(mixer, shape)}
    if launch.name.startswith("cubit_rf_"):
        return text.format(share=costs[launch.name] / sum(costs.values()))
    forward = launch.name in ("solve_past_span", "solve_forward", "solve_span_push")
    direction = ("solve_past_span", "solve_forward", "solve_span_push") if forward else (
        "solve_future_span", "solve_transposed", "solve_span_push_transposed")
    share = costs[launch.name] / sum(costs.get(name, 0.0) for name in direction)
    tiles = launch.tiles
    rows = tiles["past_block_r"] if launch.name == "solve_past_span" else tiles["span_block_r"]
    most = min(tiles["span_blocks"], tiles["blocks"]) - tiles["subspan_blocks"]
    return text.format(span=tiles["subspan_blocks"] * tiles["block_t"], share=share, most=most,
                       least=min(most, tiles["subspan_blocks"]), direction="forward" if forward else "transposed",
                       width=tiles["span_block_v" if forward else "future_block_v"], rows=rows,
                       group=rows // tiles["block_t"], programs=launch.programs,
                       columns=tiles["future_block_c"], column_group=tiles["future_block_c"] // tiles["block_t"],
                       waves=_waves(launch.programs))


def _waves(programs: int) -> str:
    """How ``programs`` programs of one per SM fill the H200's SMs, in words."""
    sms = H200["sms"]
    full, rest = divmod(programs, sms)
    if full == 0:
        return f"one wave on {rest} of the {sms} SMs"
    waves = "one full wave" if full == 1 else f"{full} full waves"
    return f"{waves} of the {sms} SMs" + (f" and one on {rest} of them" if rest else "")


def _load_compiled(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            found[entry["key"]] = entry
    return found


def _compile_missing(rows: list[dict], cache: Path, progress: bool) -> None:
    """Compile the rows not in ``cache`` in one worker process, appending each result as it comes."""
    done = _load_compiled(cache)
    jobs = [dict(key=r["key"], mixer=r["mixer"], kernel=r["kernel"], shape=r["shape"]) for r in rows
            if r["key"] not in done]
    if not jobs:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "kernelmix.studies.gpu_check.plan_compile"]
    worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    worker.stdin.write(json.dumps(jobs))
    worker.stdin.close()
    started = time.perf_counter()
    with cache.open("a") as sink:
        for count, line in enumerate(worker.stdout, 1):
            sink.write(line)
            sink.flush()
            if progress:
                entry = json.loads(line)
                print(f"  compiled {count}/{len(jobs)} {entry['key'].split('/', 3)[:3]} in {entry['compile_s']:.1f} s "
                      f"({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)
    error = worker.stderr.read()
    if worker.wait() != 0:
        raise KernelmixError(f"compiling the kernels for sm_90 failed (exit {worker.returncode}); the compiles "
                             f"that finished are kept in {cache}, so the same command resumes after the cause is "
                             "fixed (a kernel ptxas rejects: see its message). "
                             f"The worker said:\n{error.strip()[-3000:]}")


def compile_rows(rows: list[dict], cache: Path, progress: bool = False) -> list[dict]:
    """The rows with the compiler's report merged in (compiling what ``cache`` does not hold)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    _compile_missing(rows, cache, progress)
    done = _load_compiled(cache)
    # drop what a kernel's changed source (or blocks) superseded: one entry per (shape, mixer, kernel) planned
    def launch_of(key: str) -> tuple[str, ...]:  # (shape, mixer, kernel)
        return tuple(key.split("/", 3)[:3])

    current = {r["key"] for r in rows}
    planned = {launch_of(r["key"]) for r in rows}
    kept = {k: v for k, v in done.items() if k in current or launch_of(k) not in planned}
    if len(kept) < len(done):
        cache.write_text("".join(json.dumps(v) + "\n" for v in kept.values()))
    merged = []
    for row in rows:
        report = {k: v for k, v in done[row["key"]].items() if k != "key"}
        spilled = report["spill_stores"] + report["spill_loads"]
        merged.append(dict(row, **report, spilled_bytes=spilled, checks=_checks(row, report, spilled)))
    return merged


def _checks(row: dict, report: dict, spilled: int) -> dict:
    return dict(programs=row["programs"] >= LIMITS["min_programs"] or row["why_fewer"] is not None,
                registers=report["registers"] <= LIMITS["max_registers"],
                spills=spilled <= LIMITS["max_spilled_bytes"], compile_s=report["compile_s"] <= LIMITS["max_compile_s"])


def mixer_roofline(mixer: str, length: int, shape: dict) -> dict:
    """Forward + backward roofline milliseconds of ``mixer``'s op at ``length`` (the shape's head):
    the present kernels (at their grids, products and bytes), their products alone (every byte free),
    and the design the issue asks for (the useful products on tensor cores, TF32 or bf16 operands, over
    a full machine), each against SDPA in bf16."""
    at = dict(shape, length=length)
    launches = mixer_launches(mixer, at)
    costs = [(x, launch_cost(mixer, x, at)) for x in launches]
    kernels = sum(launch_seconds(cost, x) for x, cost in costs)
    products = sum(products_seconds(cost, x) for x, cost in costs)  # every byte free
    sdpa = sum(roofline_seconds(c, 10 ** 9, H200["bf16_flops"]) for c in sdpa_cost(at["batch"], at["heads"], length,
                                                                                   at["head_dim"]))
    readout = 0.0 if mixer in FEATURE_MIXERS else sdpa  # Cubit and DeltaFormer read U out by softmax attention
    # SDPA (and the read-out) with its bytes counted as our kernels' are: every streamed tile again
    streamed = sum(roofline_seconds(c, 10 ** 9, H200["bf16_flops"]) for c in sdpa_streamed_cost(
        at["batch"], at["heads"], length, at["head_dim"]))
    torch_side = public_side = 0.0
    if mixer in FEATURE_MIXERS:  # torch's work around the kernels, from the aten ops the op runs
        has_transform = FEATURE_MIXERS[mixer]["has_transform"]
        rows = getattr(torch, FEATURE_MIXERS[mixer]["rows"])
        torch_side = glue_seconds(feature_glue_ops(at, has_transform=has_transform, dtype=rows))
        public_side = glue_seconds(feature_glue_ops(at, has_transform=has_transform, public=True, dtype=rows))
    public = kernels + public_side
    kernels += torch_side
    products += torch_side + readout
    op = "performer" if mixer in FEATURE_MIXERS else mixer.removesuffix(SOLVE_VARIANT)
    useful = 3 * at["batch"] * at["heads"] * forward_flops(op, length, at["head_dim"], at["features"], at["chunk_size"])
    if mixer not in FEATURE_MIXERS:  # the read-out's share is SDPA's, counted above
        useful -= 3 * at["batch"] * at["heads"] * forward_flops("softmax", length, at["head_dim"], 0, at["chunk_size"])
    tf32 = useful / H200["tf32_flops"] + readout
    bf16 = useful / H200["bf16_flops"] + readout  # bf16 operands, fp32 accumulation
    extra = dict(torch_ms=1e3 * torch_side, public_ms=1e3 * public,
                 public_ratio=public / sdpa) if mixer in FEATURE_MIXERS else {}
    # the Triton launches of one forward + backward (the read-out's SDPA not counted): their host-side cost
    # is not in the roofline, and a GPU run should weigh it
    return dict(mixer=mixer, length=length, launches=sum(x.calls for x in launches),
                present_ms=1e3 * (kernels + readout), **extra, products_ms=1e3 * products,
                products_ratio=products / sdpa,
                design_tf32_ms=1e3 * tf32,
                design_bf16_ms=1e3 * bf16, sdpa_ms=1e3 * sdpa, present_ratio=(kernels + readout) / sdpa,
                design_tf32_ratio=tf32 / sdpa, design_bf16_ratio=bf16 / sdpa, sdpa_streamed_ms=1e3 * streamed,
                streamed_ratio=(kernels + (0.0 if mixer in FEATURE_MIXERS else streamed)) / streamed)


def run_plan(out: str | Path, *, shapes: dict | None = None, mixers=PLAN_MIXERS, kernels=None,
             progress: bool = True) -> dict:
    """Compile, cost and report every planned kernel; write plan.json, plan.md and README.md in ``out``."""
    out = Path(out)
    started = time.perf_counter()
    rows = compile_rows(plan_rows(shapes, mixers, kernels), out / "compiled.jsonl", progress)
    target = (PLAN_SHAPES if shapes is None else shapes).get(TARGET_SHAPE)
    # Cubit-RF has no roofline row: its per-chunk solves run as torch products the plan does not model
    roofline = [] if target is None else [mixer_roofline(m, t, target) for m in mixers if m not in RECURRENCE_MIXERS
                                          for t in ROOFLINE_LENGTHS]
    plan = dict(format=PLAN_FORMAT, target=dict(arch="sm_90", machine="H200", **H200), limits=LIMITS,
                shapes={k: dict(v, note=SHAPE_NOTES.get(k, "")) for k, v in (PLAN_SHAPES if shapes is None
                                                                             else shapes).items()},
                kernels=rows, roofline=roofline, seconds=round(time.perf_counter() - started, 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    from .plan_report import plan_markdown, plan_readme  # the text, apart from the measuring

    (out / "plan.md").write_text(plan_markdown(plan))
    (out / "README.md").write_text(plan_readme(plan))
    return plan


__all__ = ["LIMITS", "PLAN_FORMAT", "PLAN_SHAPES", "TARGET_SHAPE", "compile_rows", "launch_cost", "mixer_roofline",
           "plan_rows", "products_seconds", "run_plan"]
