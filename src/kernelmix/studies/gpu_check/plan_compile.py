"""The compiling half of ``kernelmix gpu-check --plan``: the Triton kernels each mixer launches at
given sizes, compiled ahead of time for sm_90 (an H100/H200) on this CPU, and what the compiler says
about them (registers per thread, spilled bytes, stack frame, shared memory) with the seconds it took.

It runs as its own process (``python -m kernelmix.studies.gpu_check.plan_compile``, a JSON job list
on stdin, one JSON line per kernel on stdout), started without ``TRITON_INTERPRET``: kernels defined
under Triton's interpreter cannot be compiled, and the tests run with it set. Each compile gets an
empty Triton cache, so its seconds are a compile, not a cache hit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time

from ...errors import KernelmixError

TARGET = ("cuda", 90, 32)  # sm_90, 32 threads per warp: what triton.compile targets without a GPU
SOLVE_MIXERS = {"cubit": dict(strict=False, has_beta=False), "deltaformer": dict(strict=True, has_beta=True),
                # the same solves with bf16 operands (solve_operands("bf16"): bf16 copies of x, y, U and db)
                "cubit-bf16": dict(strict=False, has_beta=False, operands="bf16"),
                "deltaformer-bf16": dict(strict=True, has_beta=True, operands="bf16")}
# the rows' dtype the plan launches with: bf16 for the mixers a model calls on bf16 activations (gpu-check's
# bench), fp32 for Cubit-RF's read-out (it mixes the solve's fp32 U with the queries, and casts them)
FEATURE_MIXERS = {"performer": dict(has_transform=False, rows="bfloat16"),
                  "darkformer": dict(has_transform=True, rows="bfloat16")}
# Cubit-RF: the solve's state recurrence over the chunks, and its read-out on the random-feature kernels
# (M = I; its per-chunk systems are torch solves, outside the plan)
RECURRENCE_MIXERS = {"cubit-rf": dict(has_transform=False)}
PLAN_MIXERS = (*SOLVE_MIXERS, *FEATURE_MIXERS, *RECURRENCE_MIXERS)

_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def mixer_launches(mixer: str, shape: dict) -> list:
    """The kernel launches of one differentiated call of ``mixer``'s op at ``shape`` (batch, heads,
    kv_heads, length, head_dim, features, chunk_size), documents packed (the models' training case)."""
    if mixer in SOLVE_MIXERS:
        from ...ops._triton_solve_plan import solve_launches

        return solve_launches(shape["batch"], shape["heads"], shape["length"], shape["head_dim"], shape["head_dim"],
                              chunk_size=shape["chunk_size"], has_doc=True, **SOLVE_MIXERS[mixer])
    if mixer in FEATURE_MIXERS or mixer in RECURRENCE_MIXERS:
        import torch

        from ...ops._triton_features import feature_launches

        options = dict(FEATURE_MIXERS.get(mixer) or RECURRENCE_MIXERS[mixer])
        rows = getattr(torch, options.pop("rows", "float32"))
        launches = feature_launches(shape["batch"], shape["heads"], shape["kv_heads"], shape["length"],
                                    shape["head_dim"], shape["head_dim"], shape["features"],
                                    chunk_size=shape["chunk_size"], has_doc=True, row_dtype=rows, **options)
        if mixer in RECURRENCE_MIXERS:
            from ...ops._triton_cubit_rf import recurrence_launches

            launches = recurrence_launches(shape["batch"], shape["heads"], shape["length"], shape["features"],
                                           shape["head_dim"], chunk_size=shape["chunk_size"]) + launches
        return launches
    raise KernelmixError(f"no Triton kernels to plan for mixer {mixer!r} (planned: {', '.join(PLAN_MIXERS)})")


def parse_ptxas_log(log: str) -> dict:
    """Registers per thread, stack frame and spill stores/loads (bytes) from ``ptxas -v``'s log."""
    registers, frame = _REGISTERS.search(log), _FRAME.search(log)
    if registers is None or frame is None:
        raise KernelmixError("could not read ptxas's resource report (registers, stack frame, spills) from its log; "
                             "this Triton's ptxas may print another format: run with a Triton whose ptxas -v says "
                             "'Used N registers' (3.9 does), or extend parse_ptxas_log. "
                             f"The log:\n{log.strip()[:2000]}")
    stack, stores, loads = (int(x) for x in frame.groups())
    return dict(registers=int(registers.group(1)), stack_bytes=stack, spill_stores=stores, spill_loads=loads)


def compile_launch(launch) -> dict:
    """Compile one launch for sm_90 in a fresh cache; its resource report and compile seconds."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    source = triton.compiler.ASTSource(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs)
    knobs.nvidia.dump_ptxas_log = True  # Triton then prints ptxas -v's report: captured below
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="kernelmix-plan-") as cache:
        previous = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            start = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(source, target=GPUTarget(*TARGET), options={"num_warps": launch.num_warps})
            seconds = time.perf_counter() - start
        finally:
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous
    report = parse_ptxas_log(log.getvalue())
    return dict(report, shared_bytes=int(compiled.metadata.shared), compile_s=round(seconds, 2),
                triton=triton.__version__)


def main() -> int:
    """Read ``[{"key", "mixer", "shape", "kernel"}]`` on stdin; print one JSON line per compiled kernel."""
    if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels are defined for the interpreter and cannot be compiled; "
              "unset it (kernelmix gpu-check --plan starts this worker without it)", file=sys.stderr)
        return 2
    for job in json.load(sys.stdin):
        launch = next(x for x in mixer_launches(job["mixer"], job["shape"]) if x.name == job["kernel"])
        print(json.dumps(dict(key=job["key"], **compile_launch(launch))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
