"""torch's work around the random-feature kernels in one differentiated call, counted from the aten
ops the op runs — the part of a call's time the kernels' cost model (:mod:`.plan_costs`) does not see.

The op (``triton_random_feature_attention``, forward and backward) runs on **meta** tensors at the
plan's shape: no memory, no GPU, no time. Its Triton launches are stubbed out (they are costed as
kernels). A dispatch mode records every aten op it runs: a view or an allocation costs
nothing; any other op reads each tensor it takes and writes each it returns once (bytes: the
tensor's elements, at most its storage), and a matrix product (``mm``, ``bmm``, ``addmm``,
``baddbmm``) executes 2·m·n·k FLOPs at the TF32 peak. Each op's roofline is max(FLOPs / peak,
bytes / bandwidth) over the whole machine; their sum is a lower bound on torch's share of the call,
taken from the very code the op runs, so a change to the torch side moves it. Counted for the Triton op
(what the kernels' cost model pairs with), and for the public op a model calls
(``random_feature_attention``: its guard against non-finite inputs on top, which on a GPU builds its
masks, without a sync, on every call), both on q, k, v of the plan's dtype.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .plan_costs import H200, Cost

# ops that only allocate (write nothing) and ops that write their output without reading their inputs
_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_FILLS = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
          "scalar_tensor"}
_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm"}
_ALIASES = {"detach", "alias", "lift_fresh", "_unsafe_view"}  # return the same memory, though not marked views


def _bytes(tensor: torch.Tensor) -> int:
    """What one read or write of ``tensor`` moves: its elements (a broadcast is read once), at most its storage."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


def _product_flops(name: str, args) -> float:
    """2·m·n·k of a matrix product from its operands' shapes."""
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class _AtenCounter(TorchDispatchMode):
    """Records (op, FLOPs, bytes) of every aten op run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Cost]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _ALLOCATIONS or name in _ALIASES:
            return out
        reads = [] if name in _FILLS else [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        writes = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        flops = _product_flops(name, args) if name in _PRODUCTS else 0.0
        self.ops.append((name, Cost(flops, float(sum(map(_bytes, reads)) + sum(map(_bytes, writes))))))
        return out


class _NoLaunch:
    """A stand-in for a Triton kernel: ``kernel[grid](...)`` does nothing (the kernels are costed apart)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _stubbed(module, names):
    saved = {name: getattr(module, name) for name in names}
    try:
        for name in names:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def _public_op_on_meta(ops_module):
    """``random_feature_attention`` on meta tensors as on a GPU: the Triton backend, no autocast
    context (meta has none; the op only turns autocast off) and no underflow check (a device sync,
    one call in a hundred)."""
    saved = dict(resolve_backend=ops_module.resolve_backend, autocast_off=ops_module.autocast_off)
    warned = ops_module.UNDERFLOW_CHECK.warned
    try:
        ops_module.resolve_backend = lambda *args, **kwargs: "triton"
        ops_module.autocast_off = lambda x: contextlib.nullcontext()
        ops_module.UNDERFLOW_CHECK.warned = True
        yield
    finally:
        for name, value in saved.items():
            setattr(ops_module, name, value)
        ops_module.UNDERFLOW_CHECK.warned = warned


def feature_glue_ops(shape: dict, *, has_transform: bool, public: bool = False,
                     dtype: torch.dtype = torch.float32) -> list[tuple[str, Cost]]:
    """The aten ops of torch's side of one forward + backward at ``shape`` (batch, heads, kv_heads, length,
    head_dim, features; d_v = head_dim; per-head projections), with their costs: of the Triton op
    (``triton_random_feature_attention``, float32 in and out), or with ``public`` of what a model calls,
    ``random_feature_attention`` on ``dtype`` inputs (its casts and its guard against non-finite inputs too)."""
    module = importlib.import_module("kernelmix.ops._triton_features")
    ops_module = importlib.import_module("kernelmix.ops.random_features")
    kernel_names = [name for name in vars(module) if name.endswith("_kernel")]
    batch, heads, kv_heads = shape["batch"], shape["heads"], shape["kv_heads"]
    length, d, m = shape["length"], shape["head_dim"], shape["features"]
    meta = dict(device="meta", requires_grad=True)
    q = torch.empty(batch, length, heads, d, dtype=dtype, **meta)
    k, v = (torch.empty(batch, length, kv_heads, d, dtype=dtype, **meta) for _ in range(2))
    projection = torch.empty(heads, m, d, **meta)
    transform = torch.empty(heads, d, d, **meta) if has_transform else None
    inputs = [x for x in (q, k, v, projection, transform) if x is not None]
    with _stubbed(module, kernel_names), _public_op_on_meta(ops_module), _AtenCounter() as counter:
        if public:
            out = ops_module.random_feature_attention(q, k, v, projection, transform=transform,
                                                      chunk_size=shape["chunk_size"], backend="triton")
        else:
            out, _, _ = module.triton_random_feature_attention(q, k, v, projection, transform,
                                                                chunk_size=shape["chunk_size"], doc_start=None)
        torch.autograd.grad(out, inputs, torch.empty_like(out))
    return counter.ops


def glue_seconds(ops: list[tuple[str, Cost]], machine: dict = H200) -> float:
    """The sum of the ops' rooflines: products at the TF32 peak, bytes at the HBM bandwidth."""
    return sum(max(cost.flops / machine["tf32_flops"], cost.bytes / machine["hbm_bytes_per_s"]) for _, cost in ops)


__all__ = ["feature_glue_ops", "glue_seconds"]
