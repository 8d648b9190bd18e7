"""``kernelmix gpu-check``: check and measure the GPU kernels in one command (≤ 8 minutes on one H200).

Three parts, each written to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` as soon as it ends
(so a Ctrl-C or a crash keeps what finished); a failing part is recorded and the next one runs.

(a) **Op checks** on the device against float64 references: ``cubit_attention``, ``cubit_solve``,
    ``deltaformer_attention``, ``random_feature_attention`` (Performer: no transform; DARKFormer:
    a transform) and ``cubit_rf_attention`` (with a transform; its backend is its read-out's and its state recurrence's)
    with the fast backend (``"auto"``: Triton on CUDA) and ``"torch"``, float32 and bfloat16 inputs, an odd T with a
    chunk that does not divide it, grouped-query heads, and a case with packed documents (``doc_start``). The references
    are the ``*_naive`` ops (and a dense solve for ``cubit_solve``) in float64 on the same device, on the inputs rounded
    to the checked dtype; values and every input gradient are compared by relative RMSE against the tolerances of
    the test suite (1e-4 float32; 2e-2 bfloat16, 3e-2 for random features and Cubit-RF).
(b) **Bench** (B=1, H=16, d=128, m=128, bf16 inputs): forward and forward+backward medians (CUDA
    events, a warm-up first, the mixers interleaved round by round so that a slow spell slows them
    all) and peak memory (the caching allocator's peak after a reset) at T = 1024 … 32768 for SDPA
    (flash backend), Cubit, DeltaFormer, Performer, DARKFormer, Cubit-RF (every registered mixer
    with an op call) and flash-linear-attention's DeltaFormer when it imports; then decode latency against the position
    (each mixer's ``*_step`` after a prefill) and, last, T = 65536 for Cubit and DeltaFormer if time is left.
    An out-of-memory cell is recorded and ends that mixer's lengths; so does a cell that takes
    longer than its time budget. The issue's targets become a pass/fail table.
(c) **Compare**: a short :mod:`kernelmix.studies.compare` (``small`` preset, T=1024, compare's six
    default mixers, one seed, the same seconds of training each) into ``DIR/compare``. It needs pydantic (through
    :mod:`kernelmix.config`); where that does not import, the part says so and is skipped.

``quick=True`` runs the same code at tiny sizes (T ∈ {64, 128}, H=2, d=16; part (c) a few steps of
the ``tiny`` preset) for a dry run on CPU; there the fast backend is ``"triton"`` under Triton's
interpreter (the command line sets ``TRITON_INTERPRET=1`` before triton kernels are defined), or
``"torch"`` with a note where triton does not import. Quick timings mean nothing; they check that
the code runs.

One module per part: :mod:`.settings` (the parts, their sizes and :class:`GpuCheckConfig`: the
standard library only), :mod:`.measure` (what (a) and (b) share), :mod:`.checks` (a), :mod:`.bench`
(b), :mod:`.running` ((c) and the run), :mod:`.report` (JSON, markdown, console) and :mod:`.plots`.
``--plan`` (no GPU: every kernel compiled for sm_90 here, its grid, registers, spills and a roofline)
is :mod:`.plan` with :mod:`.plan_compile`, :mod:`.plan_costs` and :mod:`.plan_report`, imported by
the command itself.
They import only torch, the standard library, :mod:`kernelmix.ops`, :mod:`kernelmix.errors` and
:mod:`kernelmix.output` at import time (no pydantic): the GPU machine they are for may not have it.
Every name is importable from ``kernelmix.studies.gpu_check`` as before; a submodule is imported
when one of its names is first used.
"""

from __future__ import annotations

from ...lazy import lazy_names

MODULES = {
    "settings": ["DEVICES", "FLA_PEER", "FLA_PEER_OF", "FORMAT", "INTERPRETER_ENV", "LONG_MIXERS", "MIXERS", "PARTS",
                 "PART_TITLES", "TOLERANCES", "CheckCase", "GpuCheckConfig", "Sizes", "full_sizes", "quick_sizes",
                 "sizes_for", "smoke_sizes", "solve_variants"],
    "measure": ["Timer", "environment", "fast_backend", "relative_rmse", "short_error", "triton_import_error"],
    "checks": ["DTYPES", "OP_CHECKS", "OpCheck", "check_inputs", "run_op_checks"],
    "bench": ["bench_inputs", "evaluate_targets", "family", "mixer_forward", "mixer_leaves", "run_bench"],
    "running": ["exit_status", "new_report", "run_compare_part", "run_gpu_check"],
    "report": ["format_markdown", "print_tables", "report_tables", "write_report"],
    "plots": ["write_plots"],
}
__getattr__, __dir__ = lazy_names(__name__, MODULES)
__all__ = sorted(name for names in MODULES.values() for name in names)
