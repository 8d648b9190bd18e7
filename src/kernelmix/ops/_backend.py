"""Which implementation an op runs: the PyTorch paths or the Triton kernels.

``backend="auto"`` (every op's default) takes the Triton kernels for float32/bfloat16/float16
CUDA tensors when the ``triton`` package imports, and the PyTorch paths everywhere else (the CPU
fast paths, float64). ``"torch"`` always takes the PyTorch paths. ``"triton"`` insists on the
kernels: on CUDA, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before triton is imported: slow, for tests and dry runs); anywhere else it is a
:class:`~kernelmix.errors.KernelmixError` that says what to do instead.

The kernels compute in float32 (the policy of ``_common``: solves, feature logits and states stay
fp32 under bf16), so float64 inputs stay on the PyTorch paths under "auto" and are refused by
"triton".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends import BACKENDS  # plain data (what ModelConfig and the command line offer): exported here as before
from ..errors import KernelmixError

INTERPRETER_ENV = "TRITON_INTERPRET"


# The operands of the Triton solve's tensor-core products (Cubit, DeltaFormer): see :func:`solve_operands`
SOLVE_OPERAND_CHOICES = ("tf32", "bf16", "fp32")
_SOLVE_OPERANDS: ContextVar[str | None] = ContextVar("kernelmix_solve_operands", default=None)


@contextlib.contextmanager
def solve_operands(operands: str | None):
    """Within the ``with`` block, the Triton solve of Cubit and DeltaFormer (CUDA, or Triton's interpreter;
    sequences longer than one span of 1,024 rows) takes ``operands`` for its products across spans, its
    pushes' and its gradients': "tf32" (the default), "bf16" (bf16 copies of x, y, U and db, bf16 tensor-core
    products with fp32 sums: about twice as fast in the launch plan, for about eight times the error
    against float64; docs/gpu.md has both) or "fp32" (CUDA cores). Softmax normalisers, the in-span
    substitution and the sums stay fp32 with every choice. A forward run inside the block keeps its choice
    for its backward, wherever that runs; code that recomputes the forward in the backward
    (``torch.utils.checkpoint``) passes ``context_fn=keep_solve_operands`` to recompute it with the same
    choice (the model's ``recompute`` modes do). Blocks nest; the innermost choice holds. None changes
    nothing (the solve mixers' default option: the caller's choice, else TF32)."""
    if operands is None:
        yield
        return
    if operands not in SOLVE_OPERAND_CHOICES:
        raise KernelmixError(f"solve_operands({operands!r}): choose one of {', '.join(SOLVE_OPERAND_CHOICES)}")
    token = _SOLVE_OPERANDS.set(operands)
    try:
        yield
    finally:
        _SOLVE_OPERANDS.reset(token)


def chosen_solve_operands() -> str | None:
    """The operands :func:`solve_operands` chose here, or None outside every such block."""
    return _SOLVE_OPERANDS.get()


def keep_solve_operands():
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around code that runs the solve: the
    recomputation, which runs in the backward (outside the ``with solve_operands(...)`` block that ran the
    forward), takes the operands the forward took, so that it saves what the forward saved."""
    return contextlib.nullcontext(), solve_operands(chosen_solve_operands())


def check_backend(backend: object) -> str:
    """``backend`` itself if it is one of :data:`BACKENDS`, else a KernelmixError naming them."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise KernelmixError(f"unknown backend {backend!r} (choose from: {', '.join(BACKENDS)})")
    return backend


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when ``import triton`` works here, else why not (one attempt per process)."""
    try:
        importlib.import_module("triton")
    except Exception as error:  # an ImportError, or a broken install raising something else
        return f"{type(error).__name__}: {error}"
    return None


def interpreter_enabled() -> bool:
    """Whether Triton's interpreter is requested (``TRITON_INTERPRET=1``): kernels then run on CPU tensors."""
    return os.environ.get(INTERPRETER_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def defined_for_the_interpreter(kernel: object) -> bool:
    """Whether the ``@triton.jit`` ``kernel`` was defined under Triton's interpreter, i.e. runs on
    CPU tensors: ``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so the variable
    set after its module was imported does not count. The knob and the variable are the fallback
    should Triton rename its interpreter's class."""
    kind = type(kernel).__name__
    if kind in ("InterpretedFunction", "JITFunction"):
        return kind == "InterpretedFunction"
    knobs = getattr(importlib.import_module("triton"), "knobs", None)
    return bool(getattr(getattr(knobs, "runtime", None), "interpret", None)) or interpreter_enabled()


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """"torch" or "triton": what ``backend`` means for inputs on ``device`` computed in ``dtype``
    (the op's compute dtype: float32 for float32/bf16/fp16 inputs, float64 for float64)."""
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        usable = device.type == "cuda" and dtype == torch.float32 and triton_import_error() is None
        return "triton" if usable else "torch"
    missing = triton_import_error()
    if missing is not None:
        raise KernelmixError(
            f"backend='triton' needs the triton package, which does not import here ({missing}): "
            "`pip install triton` (PyTorch's CUDA wheels bring it), or use backend='auto' or 'torch'"
        )
    if dtype != torch.float32:
        raise KernelmixError(
            f"backend='triton': the Triton kernels compute in float32 (from float32, bfloat16 or float16 inputs); "
            f"these inputs compute in {dtype}. Use backend='auto' or 'torch' for {dtype} inputs"
        )
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreter_enabled():
        return "triton"
    if device.type == "cpu":
        raise KernelmixError(
            "backend='triton' on CPU tensors runs the kernels under Triton's interpreter, which needs "
            f"{INTERPRETER_ENV}=1 in the environment before triton is imported (slow: meant for tests and "
            "dry runs). For speed on CPU use backend='auto' or 'torch' (the CPU fast paths)"
        )
    raise KernelmixError(
        f"backend='triton' runs on CUDA tensors (or on CPU under {INTERPRETER_ENV}=1); these are on {device}. "
        "Use backend='auto' or 'torch'"
    )


@dataclass(frozen=True)
class KernelLaunch:
    """One Triton kernel launch as an op makes it at given sizes, for ``kernelmix gpu-check --plan``
    to compile ahead of time and report without a GPU: the ``@triton.jit`` function, its launch
    grid, its constexpr arguments and warps, the types of its run-time arguments (``signature``:
    ``"*fp32"``, ``"*i64"``, ``"i32"``, ``"fp32"``, as ``triton.compile`` takes them) and the tile
    sizes the cost model reads (``tiles``: rows, head, value and feature blocks, loop trip counts),
    and how many times one call of the op launches it (``calls``)."""

    name: str
    kernel: Any
    grid: tuple[int, ...]
    constexprs: dict
    num_warps: int
    signature: dict
    tiles: dict = field(default_factory=dict)
    calls: int = 1  # launches of this kernel per op call (the span kernels: one per span)

    @property
    def programs(self) -> int:
        total = 1
        for size in self.grid:
            total *= int(size)
        return total


def aot_signature(kernel: Any, constexprs: dict, pointers: dict, floats: set) -> dict:
    """``triton.compile``'s signature of ``kernel``: ``constexpr`` for ``constexprs``, the pointer
    type of ``pointers`` (else ``*fp32``) for arguments named ``*_ptr``, ``fp32`` for ``floats``
    and ``i32`` for every other scalar (sizes and strides)."""
    def kind(arg: str) -> str:
        if arg in constexprs:
            return "constexpr"
        if arg.endswith("_ptr"):
            return pointers.get(arg, "*fp32")
        return "fp32" if arg in floats else "i32"

    return {arg: kind(arg) for arg in kernel.arg_names}
