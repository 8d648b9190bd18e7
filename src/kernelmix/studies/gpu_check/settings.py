"""What ``kernelmix gpu-check`` runs: the parts, their sizes (full, quick, smoke) and
:class:`GpuCheckConfig`.

The standard library only (no torch, no pydantic): the command line reads these names, and the
GPU machine the command is for may not have pydantic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ...errors import KernelmixError
from ...layers import registry

FORMAT = "kernelmix.gpu_check/1"
PARTS = ("a", "b", "c")
PART_TITLES = {"a": "op checks against float64 references", "b": "bench", "c": "compare"}
DEVICES = ("cuda", "cpu")
INTERPRETER_ENV = "TRITON_INTERPRET"
# part (b)'s mixers: the registry's with an op-level call (kernelmix.layers.registry), a live view
MIXERS = registry.OP_MIXERS
FLA_PEER = "fla-deltaformer"  # flash-linear-attention's DeltaFormer, measured beside ours:
FLA_PEER_OF = "deltaformer"  # the registered mixer it is the peer of
FLA_PEER_LEAVES = ("q", "k", "v", "beta")
PYDANTIC_FIX = "fix: pip install pydantic (or carry a wheel to this machine)"
# the tolerances of the test suite (tests/ops): relative RMSE against the float64 reference
TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2}
RANDOM_FEATURE_TF32_TOLERANCE = 2e-3  # float32 inputs through the random-feature kernels' TF32 products
RANDOM_FEATURE_BF16_TOLERANCE = 3e-2


@dataclass(frozen=True)
class CheckCase:
    """One shape of part (a): T, the chunk size (not dividing T) and whether documents are packed."""

    length: int
    chunk_size: int
    documents: bool

    @property
    def label(self) -> str:
        return f"T={self.length} chunk={self.chunk_size} GQA" + (" docs" if self.documents else "")


@dataclass(frozen=True)
class Sizes:
    """Everything the run's size and duration depend on (:func:`sizes_for`)."""

    check_cases: tuple[CheckCase, ...]
    check_shape: dict[str, int]  # batch, heads, kv_heads, head_dim, value_dim, ref_dim, features
    lengths: tuple[int, ...]
    long_length: int | None  # tried last, for LONG_MIXERS, if part (b)'s time allows
    batch: int
    heads: int
    head_dim: int
    num_features: int
    repeats: int
    warmup_calls: int  # untimed forward+backward calls per cell before its rounds (Triton compiles in them)
    decode_positions: tuple[int, ...]
    decode_repeats: int
    cell_budget_s: float  # a bench cell (warm-up + repeats) longer than this ends the mixer's lengths
    part_budget_s: dict[str, float]
    target_lengths: dict[str, int]  # where the targets are read: solve (8192), features (16384)
    compare: dict[str, Any]  # CompareConfig settings of part (c)


# part (b) also times the solve mixers with bf16 operands in their Triton solve (kernelmix.ops.solve_operands):
# "<mixer>-bf16", beside the default (TF32); the plan's rows of the same names
SOLVE_VARIANT = "-bf16"  # a solve mixer's name with this suffix: the same op under solve_operands("bf16")


def solve_variants() -> dict[str, str]:
    """Part (b)'s bench-only names: "<solve mixer>-bf16" → the registered solve mixer it runs."""
    return {name + SOLVE_VARIANT: name for name, info in registry.OP_MIXERS.items() if info.family == "solve"}


# the long length is for the solve mixers (the issue: it must run for them); softmax too: the ratio in the same run
LONG_MIXERS = registry.View(lambda: {name: info for name, info in registry.OP_MIXERS.items()
                                     if info.family in ("softmax", "solve")})


def full_sizes() -> Sizes:
    """One H200, ≤ 8 minutes: (a) ≤ 2 (Triton compiles most of it), (b) ≤ 3.5, (c) ≈ 2.5 minutes
    (10 s of training per mixer after a calibration). Only (a) and (b) watch their budget."""
    return Sizes(
        check_cases=(CheckCase(37, 16, False), CheckCase(257, 48, True)),
        check_shape=dict(batch=2, heads=4, kv_heads=2, head_dim=32, value_dim=24, ref_dim=16, features=32),
        lengths=(1024, 4096, 8192, 16384, 32768), long_length=65536,
        batch=1, heads=16, head_dim=128, num_features=128, repeats=10, warmup_calls=1,
        decode_positions=(1024, 4096, 8192, 16384, 32768), decode_repeats=50,
        cell_budget_s=20.0, part_budget_s={"a": 120.0, "b": 200.0, "c": 150.0},
        target_lengths={"solve": 8192, "features": 16384},
        compare=dict(preset="small", lengths=[1024], seeds=[0], tokens_per_step=16384, steps=300, budget="time",
                     seconds=10.0, calibration_steps=3, warmup_steps=30, eval_docs=8),
    )


def quick_sizes() -> Sizes:
    """The dry run: the same code at tiny sizes (a few minutes on CPU under the interpreter)."""
    return _dry_run_sizes()


def _dry_run_sizes() -> Sizes:  # apart from quick_sizes, which a test replaces with smoke_sizes
    return Sizes(
        check_cases=(CheckCase(37, 16, False), CheckCase(45, 16, True)),
        check_shape=dict(batch=1, heads=2, kv_heads=1, head_dim=16, value_dim=12, ref_dim=8, features=16),
        lengths=(64, 128), long_length=192,
        batch=1, heads=2, head_dim=16, num_features=16, repeats=2, warmup_calls=1,
        decode_positions=(64, 128), decode_repeats=3,
        cell_budget_s=60.0, part_budget_s={"a": 300.0, "b": 300.0, "c": 300.0},
        target_lengths={"solve": 128, "features": 128},
        compare=dict(preset="tiny", lengths=[64], seeds=[0], tokens_per_step=128, steps=2, warmup_steps=1,
                     eval_docs=2, eval_batch_size=2),
    )


def smoke_sizes() -> Sizes:
    """The smallest sizes that still run every part's code (the test suite's run, tens of seconds on
    CPU under the interpreter): one check case (odd T, a chunk that does not divide it, documents,
    grouped heads), one bench length, no warm-up, one repeat; the dry run's shapes and budgets otherwise."""
    return replace(
        _dry_run_sizes(),
        check_cases=(CheckCase(20, 16, True),),
        lengths=(16,), long_length=None, heads=1, repeats=1, warmup_calls=0,
        decode_positions=(8, 16), decode_repeats=1,
        target_lengths={"solve": 16, "features": 16},
        compare=dict(preset="tiny", lengths=[32], seeds=[0], tokens_per_step=64, steps=1, warmup_steps=0,
                     eval_docs=1, eval_batch_size=1),
    )


@dataclass
class GpuCheckConfig:
    """What :func:`run_gpu_check` runs. ``lengths`` replaces part (b)'s lengths; ``skip`` lists parts
    not to run ("a", "b", "c"); ``compare`` overrides part (c)'s CompareConfig settings."""

    device: str = "cuda"
    quick: bool = False
    lengths: tuple[int, ...] | None = None
    skip: tuple[str, ...] = ()
    compare: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise KernelmixError(f"unknown device {self.device!r} for gpu-check (choose from: {', '.join(DEVICES)})")
        if self.device == "cuda" and not _cuda_available():
            raise KernelmixError("gpu-check --device cuda: torch sees no CUDA device here; run it on the GPU machine, "
                                 "or dry-run it with --device cpu --quick")
        unknown = sorted(set(self.skip) - set(PARTS))
        if unknown:
            raise KernelmixError(f"unknown part(s) to skip {unknown} (the parts are: {', '.join(PARTS)})")
        if self.lengths is not None and (not self.lengths or any(t < 1 for t in self.lengths)):
            raise KernelmixError(f"lengths must be positive integers, got {list(self.lengths)}")


def _cuda_available() -> bool:
    import torch  # here, not at import: the command line reads this module without torch

    return torch.cuda.is_available()


def sizes_for(config: GpuCheckConfig) -> Sizes:
    """The full or quick sizes; ``config.lengths`` are then part (b)'s lengths, all of them (the
    long length is not added: put it in the list to have it)."""
    sizes = quick_sizes() if config.quick else full_sizes()
    if config.lengths is None:
        return sizes
    fields = asdict(sizes)
    fields.update(lengths=tuple(sorted(set(config.lengths))), long_length=None, check_cases=sizes.check_cases)
    return Sizes(**fields)
