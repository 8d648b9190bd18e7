"""The Triton kernels of Cubit-RF's state recurrence (ops/_triton_cubit_rf), run on CPU under Triton's
interpreter, against a float64 loop written from the recurrence R_c = a_c R_{c−1} + K_cᵀ (X_c − A_c
R_{c−1}): the states before every chunk, the final one and the gradients of all five inputs; odd
chunk, feature and value sizes (padded and masked), two value blocks, a rescale of 0 (a document
starting in the chunk); the errors; the sm_90 compile."""

from __future__ import annotations

import os
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton",
                    reason="triton is not installed (the test extra brings it on Linux; it has no wheels elsewhere)")

from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.ops._triton_cubit_rf import triton_state_recurrence  # noqa: E402
from tests.utils import compile_ahead_of_time, rel_rmse  # noqa: E402

F64 = torch.float64


def _reference(x, a, keys, rescale, initial):
    """The recurrence in float64, one chunk after another."""
    state, before = initial, []
    for c in range(x.shape[2]):
        before.append(state)
        solved = x[:, :, c] - a[:, :, c] @ state
        state = rescale[..., c, None, None] * state + keys[:, :, c].transpose(-1, -2) @ solved
    return torch.stack(before, dim=2), state


def _inputs(batch, heads, chunks, chunk, m, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, chunks, chunk, dv, generator=g, dtype=F64)
    a = 0.3 * torch.randn(batch, heads, chunks, chunk, m, generator=g, dtype=F64)
    keys = 0.3 * torch.rand(batch, heads, chunks, chunk, m, generator=g, dtype=F64)  # features: positive, ≤ 1
    rescale = torch.rand(batch, heads, chunks, generator=g, dtype=F64)
    rescale[0, -1, chunks // 2] = 0.0  # a document begins in this chunk: the state before it is dropped
    initial = torch.randn(batch, heads, m, dv, generator=g, dtype=F64)
    return [x, a, keys, rescale, initial]


@pytest.mark.parametrize("sizes", [(2, 3, 5, 7, 12, 80), (1, 1, 1, 16, 16, 16), (1, 2, 9, 5, 33, 20)])
def test_states_and_gradients_match_the_float64_recurrence(sizes):
    batch, heads, chunks, chunk, m, dv = sizes
    inputs = _inputs(*sizes)
    g = torch.Generator().manual_seed(1)
    g_before = torch.randn(batch, heads, chunks, m, dv, generator=g, dtype=F64)
    g_final = torch.randn(batch, heads, m, dv, generator=g, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in inputs]
    before, final = _reference(*leaves)
    want = torch.autograd.grad((before * g_before).sum() + (final * g_final).sum(), leaves)
    leaves32 = [t.float().requires_grad_() for t in inputs]
    got_before, got_final = triton_state_recurrence(*leaves32)
    assert got_before.shape == before.shape and got_final.shape == final.shape
    assert rel_rmse(got_before, before) <= 1e-5 and rel_rmse(got_final, final) <= 1e-5
    got = torch.autograd.grad((got_before * g_before.float()).sum() + (got_final * g_final.float()).sum(), leaves32)
    for name, g_got, g_want in zip(("X", "A", "K", "rescale", "R0"), got, want):
        assert g_got.shape == g_want.shape and rel_rmse(g_got, g_want) <= 1e-5, name


def test_only_the_final_state_used():
    """A loss on the final state alone (the states before the chunks unused: their gradient is None)."""
    inputs = _inputs(1, 2, 4, 6, 10, 9, seed=2)
    leaves = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(_reference(*leaves)[1].sum(), leaves)
    leaves32 = [t.float().requires_grad_() for t in inputs]
    got = torch.autograd.grad(triton_state_recurrence(*leaves32)[1].sum(), leaves32)
    for g_got, g_want in zip(got, want):
        assert rel_rmse(g_got, g_want) <= 1e-5


def test_errors_name_the_fix():
    x, a, keys, rescale, initial = (t.float() for t in _inputs(1, 1, 2, 4, 8, 8))
    with pytest.raises(KernelmixError, match='float32 tensors, but X is torch.float64.*backend="torch"'):
        triton_state_recurrence(x.double(), a, keys, rescale, initial)
    wide = torch.zeros(1, 1, 2, 4, 300)
    with pytest.raises(KernelmixError, match="at most 256 features"):
        triton_state_recurrence(x, wide, wide, rescale, torch.zeros(1, 1, 300, 8))


AOT_SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from kernelmix.ops import _triton_cubit_rf as recurrence
    try:
        from triton.backends.compiler import GPUTarget
        source = triton.compiler.ASTSource
    except (ImportError, AttributeError) as error:
        sys.exit(f"SKIP: this Triton has no ahead-of-time compile API ({error})")
    constexprs = recurrence._Blocks(64, 64, 64).constexprs()
    for kernel in (recurrence._recurrence_forward_kernel, recurrence._recurrence_backward_kernel):
        signature = {arg: "constexpr" if arg in constexprs else "*fp32" if arg.endswith("_ptr") else "i32"
                     for arg in kernel.arg_names}
        compiled = triton.compile(source(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]
        print(kernel.fn.__name__, "compiled", compiled.metadata.shared, "bytes shared")
""")


def test_kernels_compile_for_a_gpu(tmp_path):
    """Both kernels compile for sm_90 down to a cubin (chunks of 64, m = d_v = 64: the 125m preset's
    head), in a process without TRITON_INTERPRET."""
    compile_ahead_of_time(AOT_SCRIPT, tmp_path, kernels=2)
