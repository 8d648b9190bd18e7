"""The Triton kernels of causal positive random-feature attention (ops/_triton_features), run on CPU
under Triton's interpreter, against the dense float64 reference (random_feature_attention_naive):
values and gradients w.r.t. q, k, v, projection and transform; odd T, chunks that do not divide T,
documents (crossing chunk edges, starting on one, spanning several chunks), grouped heads,
Performer and DARKFormer, bf16-rounded inputs, continuation from a state, logits that would
overflow an unstabilised kernel, underflowing rows and the errors. The products run in full fp32
here (``FEATURE_OPERANDS``, held to 1e-4), and on tensor cores (TF32, bf16 operands, rounded in the
kernels as the GPU does) to their measured bounds."""

from __future__ import annotations

import os
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton",
                    reason="triton is not installed (the test extra brings it on Linux; it has no wheels elsewhere)")

from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.ops._triton_features import triton_random_feature_attention  # noqa: E402
from kernelmix.ops.random_features import (  # noqa: E402
    orthogonal_random_features,
    random_feature_attention,
    random_feature_attention_naive,
    underflow_floor,
)
from tests.utils import compile_ahead_of_time, rel_rmse  # noqa: E402

KERNELS = triton_random_feature_attention.__module__  # (monkeypatched by name)
F64 = torch.float64
F32 = torch.float32
HEAD_DIM, FEATURES = 6, 12  # neither a power of two: the kernels pad and mask both


def _problem(batch, length, heads, kv_heads, *, value_dim=8, darkformer=True, per_head=True, scale=1.0, seed=0):
    """float64 inputs: [q, k, v, projection] + [transform] (near the identity) for DARKFormer."""
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(batch, length, heads, HEAD_DIM, generator=gen, dtype=F64)
    k = scale * torch.randn(batch, length, kv_heads, HEAD_DIM, generator=gen, dtype=F64)
    v = torch.randn(batch, length, kv_heads, value_dim, generator=gen, dtype=F64)
    projection = orthogonal_random_features(FEATURES, HEAD_DIM, num_heads=heads if per_head else None,
                                            generator=gen, dtype=F64)
    inputs = [q, k, v, projection]
    if darkformer:
        inputs.append(torch.eye(HEAD_DIM, dtype=F64) + 0.2 * torch.randn(heads, HEAD_DIM, HEAD_DIM, generator=gen,
                                                                         dtype=F64))
    return inputs


def _documents(length, starts_per_row):
    """doc_start [B, T] from each batch row's document start positions (the first is 0)."""
    index = torch.arange(length)
    rows = []
    for starts in starts_per_row:
        starts = torch.tensor(starts)
        rows.append(starts[(index[:, None] >= starts[None, :]).sum(1) - 1])
    return torch.stack(rows)


def _reference(inputs, doc_start, grad_out):
    """The dense float64 reference's output and gradients w.r.t. every input."""
    leaves = [x.detach().to(F64).requires_grad_() for x in inputs]
    out = random_feature_attention_naive(*leaves[:4], transform=leaves[4] if len(leaves) > 4 else None,
                                         doc_start=doc_start)
    return out, torch.autograd.grad(out, leaves, grad_out.to(F64))


def _kernel(inputs, doc_start, grad_out, chunk_size, initial_state=None):
    """The kernel's output, gradients w.r.t. every input, denominator and final state (float32)."""
    leaves = [x.detach().to(F32).requires_grad_() for x in inputs]
    out, denominator, state = triton_random_feature_attention(
        *leaves[:4], leaves[4] if len(leaves) > 4 else None, chunk_size=chunk_size, doc_start=doc_start,
        initial_state=initial_state)
    return out, torch.autograd.grad(out, leaves, grad_out.to(F32)), denominator, state


NAMES = ["q", "k", "v", "projection", "transform"]


def _assert_matches_reference(inputs, doc_start, grad_out, chunk_size):
    """The kernel's output and every input's gradient within 1e-4 of the float64 reference."""
    ref, ref_grads = _reference(inputs, doc_start, grad_out)
    out, grads, _, _ = _kernel(inputs, doc_start, grad_out, chunk_size)
    assert rel_rmse(out, ref) <= 1e-4
    for name, got, want in zip(NAMES, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-4, name


@pytest.fixture(autouse=True)
def fp32_products(monkeypatch):
    """Full-fp32 products, so that the 1e-4 bounds check the algorithm (the tensor-core operands
    have a test of their own, below)."""
    monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", "fp32")

CASES = {
    # name: (batch, T, H, H_kv, chunk, darkformer, per-head projection, document starts per batch row)
    "T1-performer-shared": (1, 1, 2, 2, 16, False, False, None),
    "T37-darkformer-gqa-3docs": (1, 37, 4, 2, 16, True, True, [[0, 10, 30]]),
    "T37-performer-2batch-docs": (2, 37, 2, 1, 16, False, True, [[0, 20], [0]]),
    "T130-darkformer-chunk24-2docs": (1, 130, 2, 1, 24, True, False, [[0, 61]]),
    # 7 chunks of 16: documents starting on a chunk's first row (32, 80), one of a single row (32),
    # one spanning three chunks (33-79): the scans' restarts and carries across several chunks
    "T97-darkformer-chunk16-docs-on-edges": (1, 97, 2, 2, 16, True, True, [[0, 32, 33, 80]]),
}


def _spans_of(monkeypatch, span_blocks: int) -> None:
    """Spans of ``span_blocks`` chunks whatever the grid (the tests' grids are far below MIN_PROGRAMS,
    which would otherwise make every span one chunk)."""
    monkeypatch.setattr(f"{KERNELS}.SPAN_BLOCKS", span_blocks)
    monkeypatch.setattr(f"{KERNELS}.MIN_PROGRAMS", 1)


@pytest.mark.parametrize("span_blocks", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_the_float64_reference(monkeypatch, case, span_blocks):
    """Spans of 1, 2 and 3 chunks: the forward-direction walks (a span of 3 chunks does not divide
    the 7 or 6 chunks of T = 97 or 130, and their documents start inside spans and on their edges)."""
    _spans_of(monkeypatch, span_blocks)
    batch, length, heads, kv_heads, chunk, darkformer, per_head, starts = CASES[case]
    inputs = _problem(batch, length, heads, kv_heads, darkformer=darkformer, per_head=per_head)
    doc_start = None if starts is None else _documents(length, starts)
    grad_out = torch.randn(batch, length, heads, 8, generator=torch.Generator().manual_seed(5), dtype=F64)
    ref, ref_grads = _reference(inputs, doc_start, grad_out)
    out, grads, denominator, state = _kernel(inputs, doc_start, grad_out, chunk)
    assert out.dtype == F32 and out.shape == ref.shape and denominator.shape == (batch, heads, length)
    assert state[3] == length and (denominator > 0).all()
    assert rel_rmse(out, ref) <= 1e-4
    for name, got, want in zip(NAMES, grads, ref_grads):
        assert got.shape == want.shape and rel_rmse(got, want) <= 1e-4, name


@pytest.mark.parametrize("case", ["T37-darkformer-gqa-3docs", "T37-performer-2batch-docs"])
def test_the_chain_apart_matches_the_float64_reference(monkeypatch, case):
    """Where a side's fused chain pass does not fit (m · d over FUSED_CHAIN_TILE: here every side), its row
    and weight kernels run apart, in chain spans of 16 rows that do not divide T = 37."""
    monkeypatch.setattr(f"{KERNELS}.FUSED_CHAIN_TILE", 0)
    monkeypatch.setattr(f"{KERNELS}.CHAIN_SPAN_ROWS", 16)
    batch, length, heads, kv_heads, chunk, darkformer, per_head, starts = CASES[case]
    inputs = _problem(batch, length, heads, kv_heads, darkformer=darkformer, per_head=per_head)
    grad_out = torch.randn(batch, length, heads, 8, generator=torch.Generator().manual_seed(5), dtype=F64)
    _assert_matches_reference(inputs, _documents(length, starts), grad_out, chunk)


# The products of features, states and values on tensor cores, and the chain kernels' products of the backward's
# chain at the same operands. Measured against float64 on the cases above (largest relative error over
# the output and the five gradients): TF32 3.3e-4 in the output, 1.13e-3 in the gradients; bf16 3.0e-3
# and 9.2e-3.
@pytest.mark.parametrize("operands, bound", [("tf32", 2e-3), ("bf16", 2e-2)])
@pytest.mark.parametrize("case", ["T37-darkformer-gqa-3docs", "T97-darkformer-chunk16-docs-on-edges"])
def test_tensor_core_products_within_their_measured_error(monkeypatch, operands, bound, case):
    monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", operands)
    batch, length, heads, kv_heads, chunk, darkformer, per_head, starts = CASES[case]
    inputs = _problem(batch, length, heads, kv_heads, darkformer=darkformer, per_head=per_head)
    doc_start = _documents(length, starts)
    grad_out = torch.randn(batch, length, heads, 8, generator=torch.Generator().manual_seed(5), dtype=F64)
    ref, ref_grads = _reference(inputs, doc_start, grad_out)
    out, grads, _, _ = _kernel(inputs, doc_start, grad_out, chunk)
    errors = [rel_rmse(out, ref)] + [rel_rmse(got, want) for got, want in zip(grads, ref_grads)]
    assert max(errors) <= bound, errors
    assert max(errors) >= 1e-6, "no rounding seen: the operands did not reach the products"


def test_several_value_blocks(monkeypatch):
    """d_v = 24 in blocks of 16 (the value-blocked kernels, the span states and the value gradient): two
    programs per head, each with its part of the state; the denominator's gradient (c_i) is counted once."""
    monkeypatch.setattr(f"{KERNELS}.VALUE_BLOCK", 16)
    monkeypatch.setattr(f"{KERNELS}.WIDE_VALUE_BLOCK", 16)
    inputs = _problem(1, 37, 1, 1, value_dim=24)
    doc_start = _documents(37, [[0, 17]])
    grad_out = torch.randn(1, 37, 1, 24, generator=torch.Generator().manual_seed(6), dtype=F64)
    _assert_matches_reference(inputs, doc_start, grad_out, 16)


@pytest.mark.parametrize("span_blocks", [1, 2])
def test_several_feature_blocks(monkeypatch, span_blocks):
    """The logit gradients in blocks of 16 features with every value column (m = 40: blocks of 16, 16
    and 8 real features, each its own program, each storing its columns of dL/dℓ), grouped heads and
    documents: values and gradients against float64."""
    _spans_of(monkeypatch, span_blocks)
    monkeypatch.setattr(f"{KERNELS}.FEATURE_TILE", 16 * 16)
    gen = torch.Generator().manual_seed(12)
    length, heads, m = 53, 2, 40
    q = 0.7 * torch.randn(1, length, heads, HEAD_DIM, generator=gen, dtype=F64)
    k = 0.7 * torch.randn(1, length, 1, HEAD_DIM, generator=gen, dtype=F64)
    v = torch.randn(1, length, 1, 8, generator=gen, dtype=F64)
    projection = orthogonal_random_features(m, HEAD_DIM, num_heads=heads, generator=gen, dtype=F64)
    transform = torch.eye(HEAD_DIM, dtype=F64) + 0.2 * torch.randn(heads, HEAD_DIM, HEAD_DIM, generator=gen, dtype=F64)
    inputs = [q, k, v, projection, transform]
    doc_start = _documents(length, [[0, 16, 29]])
    grad_out = torch.randn(1, length, heads, 8, generator=gen, dtype=F64)
    _assert_matches_reference(inputs, doc_start, grad_out, 16)


def test_bfloat16_inputs():
    """bf16 inputs cast to float32 (as random_feature_attention does) against the reference on the
    same bf16-rounded values: the kernel computes in float32, so the float32 bound holds (the CPU
    fast paths' bf16 bound, 3e-2, would hide a kernel that lost precision on such inputs)."""
    inputs = [x.to(torch.bfloat16) for x in _problem(1, 37, 2, 1)]
    doc_start = _documents(37, [[0, 12]])
    grad_out = torch.randn(1, 37, 2, 8, generator=torch.Generator().manual_seed(7), dtype=F64)
    _assert_matches_reference(inputs, doc_start, grad_out, 16)


@pytest.mark.parametrize("darkformer", [False, True])
def test_bfloat16_rows_are_read_and_written_as_bfloat16(darkformer):
    """bf16 q, k, v go into the kernels as they are (no cast passes): they compute in fp32 and write
    the output (and dv) in bf16, rounded to nearest, so the output is the fp32 computation's rounded
    (what casting did), and the gradients, whose c = −g·o/den takes the output at fp32, are as accurate
    as through a cast: against float64 on the same bf16 values, within bf16's own rounding."""
    inputs = _problem(1, 37, 2, 1, darkformer=darkformer)
    inputs = [x.to(torch.bfloat16 if i < 3 else F32) for i, x in enumerate(inputs)]
    doc_start = _documents(37, [[0, 12]])
    grad_out = torch.randn(1, 37, 2, 8, generator=torch.Generator().manual_seed(8), dtype=F64).to(torch.bfloat16)
    ref, ref_grads = _reference(inputs, doc_start, grad_out)
    leaves = [x.detach().requires_grad_() for x in inputs]  # bf16 rows, fp32 parameters
    out, _, _ = triton_random_feature_attention(*leaves[:4], leaves[4] if darkformer else None, chunk_size=16,
                                                doc_start=doc_start)
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert out.dtype == torch.bfloat16 and [g.dtype for g in grads[:3]] == [torch.bfloat16] * 3
    through_fp32, _, _ = triton_random_feature_attention(*(x.float() for x in inputs[:4]),
                                                         inputs[4].float() if darkformer else None, chunk_size=16,
                                                         doc_start=doc_start)
    assert (out != through_fp32.to(torch.bfloat16)).float().mean() <= 1e-3  # ties aside, the same rounding
    assert rel_rmse(out, ref) <= 4e-3
    for name, got, want in zip(NAMES, grads, ref_grads):
        assert rel_rmse(got, want) <= 4e-3, name


def _log_domain_reference(q, k, v, projection, transform, doc_start):
    """Dense float64 attention with the weights formed in the log domain (logsumexp over features):
    exact where the feature logits leave even float64's exp range, which random_feature_attention_naive
    (exp of each feature) does not survive at these scales."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)

    def logits(x):
        x = torch.einsum("hed,bthd->bthe", transform, x * x.shape[-1] ** -0.25)
        return torch.einsum("hmd,bthd->bthm", projection, x) - 0.5 * x.pow(2).sum(-1, keepdim=True)

    index = torch.arange(q.shape[1])
    seen = (index[None, :] <= index[:, None])[None] & (index[None, None, :] >= doc_start[:, :, None])  # [B, i, j]
    log_weights = torch.logsumexp(logits(q)[:, :, None] + logits(k)[:, None], dim=-1)  # [B, i, j, H]
    log_weights = log_weights.masked_fill(~seen[..., None], float("-inf"))
    return torch.einsum("bijh,bjhd->bihd", torch.softmax(log_weights, dim=2), v)


def test_large_logits_stay_finite_and_exact():
    """q × 16, k × 3: query logits past float32's exp range (≈ 88.7) and key logits below it, so
    an unstabilised kernel overflows and underflows; the stabilisers keep every exponential ≤ 1."""
    inputs = _problem(1, 37, 2, 2)
    inputs[0], inputs[1] = 16 * inputs[0], 3 * inputs[1]
    q, k, _, projection, transform = inputs
    x_prime = torch.einsum("hed,bthd->bthe", transform, q * HEAD_DIM ** -0.25)
    assert torch.isinf(torch.exp(torch.einsum("hmd,bthd->bthm", projection, x_prime).float())).any()
    doc_start = _documents(37, [[0, 19]])
    grad_out = torch.randn(1, 37, 2, 8, generator=torch.Generator().manual_seed(8), dtype=F64)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref = _log_domain_reference(*leaves, doc_start)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out)
    out, grads, _, _ = _kernel(inputs, doc_start, grad_out, 16)
    assert torch.isfinite(out).all() and rel_rmse(out, ref) <= 1e-4
    for name, got, want in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(got).all() and rel_rmse(got, want) <= 1e-4, name


@pytest.mark.parametrize("span_blocks", [1, 2])
def test_continuation_from_a_state_equals_one_call(monkeypatch, span_blocks):
    """Two calls on a split sequence (the split inside a chunk and inside a document) give the one
    call's output; the final state is the CPU path's; the second call's gradients w.r.t. its own
    q, k, v are those of the whole sequence."""
    _spans_of(monkeypatch, span_blocks)
    length, split = 37, 21
    inputs = _problem(2, length, 2, 1)
    doc_start = _documents(length, [[0, 9, 30], [0]])
    grad_out = torch.randn(2, length, 2, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    grad_out[:, :split] = 0  # the loss reads the second part only
    ref, ref_grads = _reference(inputs, doc_start, grad_out)
    first = [x[:, :split] for x in inputs[:3]] + inputs[3:]
    second = [x[:, split:] for x in inputs[:3]] + inputs[3:]
    out1, _, _, state1 = _kernel(first, doc_start[:, :split], grad_out[:, :split], 16)
    out2, grads2, _, state2 = _kernel(second, doc_start[:, split:], grad_out[:, split:], 16, initial_state=state1)
    assert state1[3] == split and state2[3] == length
    assert rel_rmse(torch.cat([out1, out2], dim=1), ref) <= 1e-4
    for name, got, want in zip(NAMES[:3], grads2[:3], ref_grads[:3]):
        assert rel_rmse(got, want[:, split:]) <= 1e-4, name
    _, cpu_state = random_feature_attention(*[x.to(F32) for x in inputs[:4]], transform=inputs[4].to(F32),
                                            doc_start=doc_start, chunk_size=16, return_state=True, backend="torch")
    assert rel_rmse(state2[0], cpu_state.S) <= 1e-4 and rel_rmse(state2[1], cpu_state.z) <= 1e-4
    torch.testing.assert_close(state2[2], cpu_state.shift, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::kernelmix.ops.random_features.UnderflowWarning")
def test_underflowing_denominators_give_zero_rows_and_zero_gradients():
    """Huge, opposed q and k (the construction of test_random_features): the denominators underflow;
    those rows are 0 with zero gradients, as the CPU path's, and the ordinary rows are exact."""
    gen = torch.Generator().manual_seed(0)
    length = 37
    doc_start = _documents(length, [[0, 5]])  # the degenerate tokens in a document of their own
    projection = orthogonal_random_features(FEATURES, HEAD_DIM, generator=gen)
    direction = torch.randn(HEAD_DIM, generator=gen)
    direction = direction / direction.norm()
    k = (-400.0 * direction).expand(1, length, 1, HEAD_DIM).clone()
    q = (400.0 * direction).expand(1, length, 1, HEAD_DIM).clone()
    q[:, :5] = 0.3 * torch.randn(1, 5, 1, HEAD_DIM, generator=gen)
    k[:, :5] = 0.3 * torch.randn(1, 5, 1, HEAD_DIM, generator=gen)
    v = torch.randn(1, length, 1, 8, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, denominator, _ = triton_random_feature_attention(*leaves, projection, None, chunk_size=7, doc_start=doc_start)
    empty = denominator[0, 0] <= underflow_floor(F32)
    cpu = random_feature_attention(q, k, v, projection, chunk_size=7, doc_start=doc_start, backend="torch")
    assert empty[5:].any() and not empty[:5].any()
    assert torch.equal(out[0, :, 0].abs().sum(-1) == 0, empty) and torch.equal(out == 0, cpu == 0)
    assert rel_rmse(out[:, :5], cpu[:, :5]) <= 1e-5
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0, empty] == 0).all()


def test_empty_sequence_keeps_the_state():
    q, k, v, projection = (x.to(F32) for x in _problem(1, 0, 2, 1, darkformer=False))
    state = (torch.ones(1, 2, FEATURES, 8), torch.ones(1, 2, FEATURES), torch.zeros(1, 2), 5)
    out, denominator, final = triton_random_feature_attention(q, k, v, projection, None, chunk_size=16,
                                                              doc_start=None, initial_state=state)
    assert out.shape == (1, 0, 2, 8) and denominator.shape == (1, 2, 0)
    assert final[3] == 5 and all(torch.equal(a, b) for a, b in zip(final[:3], state[:3]))


def test_errors_name_the_fix(monkeypatch):
    q, k, v, projection = (x.to(F32) for x in _problem(1, 5, 2, 1, darkformer=False))
    with pytest.raises(KernelmixError, match="q, k, v of one dtype among float32, bfloat16 and float16"):
        triton_random_feature_attention(q, k, v.double(), projection, None, chunk_size=16, doc_start=None)
    with pytest.raises(KernelmixError, match="float32 projection, but it is torch.bfloat16"):
        triton_random_feature_attention(q, k, v, projection.bfloat16(), None, chunk_size=16, doc_start=None)
    state = (torch.zeros(1, 2, FEATURES, 8, requires_grad=True), torch.zeros(1, 2, FEATURES), torch.zeros(1, 2), 3)
    with pytest.raises(KernelmixError, match='initial_state.*backend="torch"'):
        triton_random_feature_attention(q, k, v, projection, None, chunk_size=16, doc_start=None, initial_state=state)
    with pytest.raises(KernelmixError, match='at most 256 features.*backend="torch"'):
        triton_random_feature_attention(q, k, v, torch.randn(300, HEAD_DIM), None, chunk_size=16, doc_start=None)
    wide = torch.zeros(1, 5, 1, 300)  # the logit gradients hold every value column: d_v ≤ 256
    with pytest.raises(KernelmixError, match='value dims of 256.*d_v=300.*backend="torch"'):
        triton_random_feature_attention(q, k, wide, projection, None, chunk_size=16, doc_start=None)
    monkeypatch.setattr(f"{KERNELS}._interpreted", lambda: False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(KernelmixError, match="TRITON_INTERPRET=1"):
        triton_random_feature_attention(q, k, v, projection, None, chunk_size=16, doc_start=None)


AOT_SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from kernelmix.ops import _triton_features as features
    try:
        from triton.backends.compiler import GPUTarget
        source = triton.compiler.ASTSource
    except (ImportError, AttributeError) as error:
        sys.exit(f"SKIP: this Triton has no ahead-of-time compile API ({error})")
    launches = []
    # the tests' head (d = 6, m = 12: blocks of 16); the launch plan compiles gpu-check's sizes. DARKFormer's
    # launches, then Performer's that differ (their logits form the keys' norms; their fused chain has the x term)
    seen = set()
    for has_transform in (True, False):
        for launch in features.feature_launches(1, 2, 1, 37, 6, 8, 12, chunk_size=16, has_transform=has_transform,
                                                has_doc=True):
            key = (launch.kernel.fn.__name__, tuple(sorted(launch.constexprs.items())))
            if key not in seen:
                seen.add(key)
                launches.append(launch)
    # and Performer's keys' chain rows apart (where its fused pass does not fit: m · d over 128 × 128)
    features.FUSED_CHAIN_TILE = 0
    launches += [launch for launch in features.feature_launches(1, 2, 1, 37, 6, 8, 12, chunk_size=16,
                                                                has_transform=False, has_doc=True)
                 if launch.name == "features_chain_rows"]
    for launch in launches:
        compiled = triton.compile(source(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=launch.num_warps))
        assert compiled.asm["cubin"], launch.name
        print(launch.name, "compiled", compiled.metadata.shared, "bytes shared")
""")


def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter accepts code the GPU compiler rejects: compile the nineteen launches (DARKFormer's
    fourteen: its key norms, the logits, the span kernels and the chain, fused for the queries and apart
    for the keys, with C = Σ s x xᵀ; Performer's four that differ, and its keys' chain rows apart) for
    sm_90 down to a cubin (Triton ships ptxas) in a process without TRITON_INTERPRET, so that a GPU's
    first run does not fail on it."""
    compile_ahead_of_time(AOT_SCRIPT, tmp_path, kernels=19)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_at_gpu_check_sizes(tmp_path):
    """At d = m = d_v = 128 (gpu-check's head and the 1.3b preset's), with the blocks the launches
    take there (``kernelmix gpu-check --plan`` reports their registers and spills)."""
    script = AOT_SCRIPT.replace("feature_launches(1, 2, 1, 37, 6, 8, 12,",
                                "feature_launches(1, 2, 1, 8192, 128, 128, 128,")
    assert script != AOT_SCRIPT
    compile_ahead_of_time(script, tmp_path, kernels=19, timeout=1200)


def test_large_heads_take_smaller_blocks():
    """The block sizes of gpu-check's head (d = m = d_v = 128): chunks of 16 rows, the forward's value
    blocks of 64 with the logits formed over the head in steps of 8, the span states' and the value
    gradient's one block of 128, the logit gradients' 64 features with every value column (what ptxas
    compiled without spills with the walks' running states); at d = 64, chunks of 16, one block of
    everything and steps of 32 (16 spilled with bf16 rows); below 64, chunks of 64 and steps of 16."""
    import importlib

    kernels = importlib.import_module("kernelmix.ops._triton_features")
    q = torch.zeros(1, 5, 1, 128)
    geometry = getattr(kernels, "_Geometry")(q, q, q, torch.zeros(128, 128), 64, 0, True)
    assert kernels.LARGE_TILE == 128
    assert (geometry.block_t, geometry.block_v, geometry.value_blocks) == (16, 64, 2)
    assert geometry.blocks(rows=True)["D_STEP"] == 8 and "D_STEP" not in geometry.blocks()
    assert (geometry.wide_block_v, geometry.wide_value_blocks) == (128, 1)
    features = geometry.blocks("features")
    assert (features["BLOCK_M"], features["BLOCK_V"], geometry.feature_blocks) == (64, 128, 2)
    small = torch.zeros(1, 5, 1, 64)
    geometry = getattr(kernels, "_Geometry")(small, small, small, torch.zeros(64, 64), 64, 0, True)
    assert (geometry.block_t, geometry.block_v, geometry.wide_block_v) == (16, 64, 64)
    assert (geometry.blocks(rows=True)["D_STEP"], geometry.block_f, geometry.feature_blocks) == (32, 64, 1)
    narrow = torch.zeros(1, 5, 1, 32)
    geometry = getattr(kernels, "_Geometry")(narrow, narrow, narrow, torch.zeros(32, 32), 64, 0, True)
    assert (geometry.block_t, geometry.blocks()["num_warps"], geometry.logit_step) == (64, 4, 16)


def test_256_wide_heads_take_the_blocks_that_compile_without_spills():
    """At d = m = d_v = 256 (Gemma 3's head with the conversion's 256 features): the span states 64 value
    columns a program, the value gradient 16, the logit gradients 16 features, the chain's weight kernel 64
    columns of G, the keys' half norms 8 warps (what ptxas, sm_90, compiled without spills: results/gpu-plan's
    `gemma3` shape; at 128 nothing changes). Their values and gradients: the next test (slow)."""
    import importlib

    kernels = importlib.import_module("kernelmix.ops._triton_features")
    wide = torch.empty(1, 8192, 4, 256, device="meta")
    geometry = getattr(kernels, "_Geometry")(wide, wide, wide, torch.empty(4, 256, 256, device="meta"), 64, 0, True)
    assert (geometry.wide_block_v, geometry.value_grad_block_v, geometry.block_f, geometry.block_v) == (64, 16, 16, 64)
    assert geometry.value_grad_grid[2] == 16 and getattr(kernels, "_key_norm_blocks")(geometry)["num_warps"] == 8
    assert getattr(kernels, "_chain_columns")(256, 256) == 64 and getattr(kernels, "_chain_columns")(256, 128) == 128
    target = torch.empty(1, 8192, 16, 128, device="meta")
    geometry = getattr(kernels, "_Geometry")(target, target, target, torch.empty(16, 128, 128, device="meta"), 64, 0,
                                             True)
    assert (geometry.wide_block_v, geometry.value_grad_block_v, geometry.block_f) == (128, 128, 64)


@pytest.mark.slow  # 20 s under the interpreter; the same block paths run at small sizes by default
def test_256_wide_heads_match_the_float64_reference(monkeypatch):
    """Values and every gradient against float64 at the blocks of d = m = d_v = 256 (above): two chunks in
    spans of one, two documents (the interpreter's cost grows with these tiles: a short case)."""
    _spans_of(monkeypatch, 1)
    gen = torch.Generator().manual_seed(13)
    length, heads, d = 24, 1, 256
    q = 0.5 * torch.randn(1, length, heads, d, generator=gen, dtype=F64)
    k = 0.5 * torch.randn(1, length, 1, d, generator=gen, dtype=F64)
    v = torch.randn(1, length, 1, d, generator=gen, dtype=F64)
    projection = orthogonal_random_features(256, d, num_heads=heads, generator=gen, dtype=F64)
    transform = torch.eye(d, dtype=F64) + 0.02 * torch.randn(heads, d, d, generator=gen, dtype=F64)
    doc_start = _documents(length, [[0, 11]])
    grad_out = torch.randn(1, length, heads, d, generator=gen, dtype=F64)
    _assert_matches_reference([q, k, v, projection, transform], doc_start, grad_out, 16)


def test_spans_shrink_until_the_grid_fills_the_machine():
    """A span holds SPAN_BLOCKS chunks unless the grid would then have fewer than MIN_PROGRAMS
    programs: at the 125m head (H = 12, d = m = 64, T = 8,192) 16 chunks of 16 rows, 384 programs;
    at a quarter of that length, 4 chunks (and 384 programs again)."""
    import importlib

    kernels = importlib.import_module("kernelmix.ops._triton_features")
    q = torch.empty(1, 8192, 12, 64, device="meta")
    geometry = getattr(kernels, "_Geometry")(q, q, q, torch.empty(12, 64, 64, device="meta"), 64, 0, False)
    assert (geometry.span_blocks, geometry.n_spans) == (16, 32)
    assert geometry.n_spans * 12 * geometry.value_blocks >= kernels.MIN_PROGRAMS
    short = torch.empty(1, 2048, 12, 64, device="meta")
    geometry = getattr(kernels, "_Geometry")(short, short, short, torch.empty(12, 64, 64, device="meta"), 64, 0, False)
    assert (geometry.span_blocks, geometry.n_spans) == (4, 32)
    target = torch.empty(1, 8192, 16, 128, device="meta")
    geometry = getattr(kernels, "_Geometry")(target, target, target, torch.empty(16, 128, 128, device="meta"), 64, 0,
                                             False)
    assert (geometry.block_t, geometry.span_blocks, geometry.n_spans) == (16, 16, 32)  # 256-row spans


@pytest.mark.parametrize("span_blocks", [1, 3])
def test_large_tiles_walk_16_row_chunks(monkeypatch, span_blocks):
    """At m = 128 (a large tile) the chunks are 16 rows and the logits go 8 head columns at a time:
    values and gradients against float64, documents starting inside and on the edges of chunks and spans."""
    _spans_of(monkeypatch, span_blocks)
    gen = torch.Generator().manual_seed(11)
    length, heads, m = 75, 2, 128
    q, k = (0.7 * torch.randn(1, length, heads, HEAD_DIM, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, length, heads, 8, generator=gen, dtype=F64)
    projection = orthogonal_random_features(m, HEAD_DIM, num_heads=heads, generator=gen, dtype=F64)
    inputs = [q, k, v, projection]
    doc_start = _documents(length, [[0, 16, 40, 41]])
    grad_out = torch.randn(1, length, heads, 8, generator=gen, dtype=F64)
    _assert_matches_reference(inputs, doc_start, grad_out, 32)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero), as float64: the tests' own."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32).double()


def test_the_backward_chain_takes_the_kernels_operands(monkeypatch):
    """The chain kernels (dx = dℓ W with the keys' term, through Σ for DARKFormer; the span parts of dW =
    Σ dℓᵀ x and of C = Σ s x xᵀ; both halves fused in one pass) round their operands to TF32 as the span
    kernels' products do (their input dℓ already carries that error), so under the interpreter they equal
    the float64 product of TF32-rounded operands and differ from the exact one; with fp32 operands they
    are the exact product.
    Grouped heads read x per kv head."""
    import importlib

    kernels = importlib.import_module("kernelmix.ops._triton_features")
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(1, 45, 4, 40, generator=gen)  # 45 rows: blocks of 32 that do not divide it
    w = torch.randn(4, 40, 24, generator=gen)
    x = torch.randn(1, 45, 2, 24, generator=gen)  # 2 kv heads for 4 query heads
    sigma = torch.randn(4, 24, 24, generator=gen)
    sigma = sigma @ sigma.transpose(1, 2)  # symmetric, as MᵀM
    x_q = x.double().repeat_interleave(2, dim=2)
    chain_rows, chain_weights = getattr(kernels, "_chain_rows"), getattr(kernels, "_chain_weights")
    for operands, round_ in (("tf32", _tf32), ("fp32", torch.Tensor.double)):
        monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", operands)
        rows = chain_rows(g, x, w, torch.float32, 0.5, 0.25)
        mixed = 0.5 * torch.einsum("bthm,hmd->bthd", round_(g), round_(w))
        assert rel_rmse(rows, mixed - 0.25 * g.double().sum(-1, True) * x_q) <= 1e-6, operands
        sums = torch.full((1, 45, 4), float("nan"))
        rows = chain_rows(g, x, w, torch.float32, 0.5, 0.25, sigma=sigma, sums=sums)
        through = torch.einsum("bthe,hed->bthd", round_(x.repeat_interleave(2, dim=2)), round_(sigma))
        assert rel_rmse(rows, mixed - 0.25 * g.double().sum(-1, True) * through) <= 1e-6, operands
        assert rel_rmse(sums, g.double().sum(-1)) <= 1e-7
        weights = chain_weights(g, x)
        assert rel_rmse(weights, torch.einsum("bthm,bthd->hmd", round_(g), round_(x_q))) <= 1e-6, operands
        scaled = chain_weights(sums, x, scaled_rows=True)
        want = torch.einsum("bthe,bthd->hed", round_(sums[..., None] * x.repeat_interleave(2, dim=2)), round_(x_q))
        assert rel_rmse(scaled, want) <= 1e-6, operands
    exact = torch.einsum("bthm,hmd->bthd", g.double(), w.double())
    assert rel_rmse(chain_rows(g, None, w, torch.float32, 1.0, 0.0), exact) <= 1e-6
    # the fused pass (both halves on one read of the rows), in spans of 16 rows that do not divide 45
    monkeypatch.setattr(f"{KERNELS}.CHAIN_SPAN_ROWS", 16)
    monkeypatch.setattr(f"{KERNELS}.MIN_PROGRAMS", 10 ** 6)
    chain_side = getattr(kernels, "_chain_side")
    for operands, round_ in (("tf32", _tf32), ("fp32", torch.Tensor.double)):
        monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", operands)
        mixed = 0.5 * torch.einsum("bthm,hmd->bthd", round_(g), round_(w))
        weights = torch.einsum("bthm,bthd->hmd", round_(g), round_(x_q))
        rows, summed = chain_side(g, x, w, torch.float32, 0.5, 0.25)
        assert rel_rmse(rows, mixed - 0.25 * g.double().sum(-1, True) * x_q) <= 1e-6, operands
        assert rel_rmse(summed, weights) <= 1e-6, operands
        rows, summed = chain_side(g, x, w, torch.bfloat16, 0.5, None)  # no x term; written in bf16
        assert rows.dtype == torch.bfloat16 and rel_rmse(rows, mixed) <= 4e-3, operands
        assert rel_rmse(summed, weights) <= 1e-6, operands
    fuses = getattr(kernels, "_fuses_chain")
    assert fuses(40, 24) and fuses(128, 128) and not fuses(256, 128)
    assert not fuses(256, 64)  # at most 128 features (256 spilled 52-180 B per thread at d = 32-64; sm_90)
    monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", "tf32")
    assert rel_rmse(chain_rows(g, None, w, torch.float32, 1.0, 0.0), exact) >= 1e-5


def test_darkformer_folded_projection_and_key_norms_stay_fp32_accurate(monkeypatch):
    """DARKFormer's M is folded into the projection (W' = W M, formed in float64 whatever torch's TF32
    setting), and its keys' ½‖M x̃‖² (``key_norm_kernel``, keys read per kv head, a half norm per query
    head) takes the logits' own product, three TF32 products (a_hi·b_hi + a_hi·b_lo + a_lo·b_hi), not
    one: both enter exponentiated logits, and against float64 their error is fp32's, where one TF32
    product's is about a hundred times larger."""
    import importlib

    kernels = importlib.import_module("kernelmix.ops._triton_features")
    monkeypatch.setattr(f"{KERNELS}.FEATURE_OPERANDS", "tf32")
    gen = torch.Generator().manual_seed(6)
    x, m = torch.randn(2, 33, 2, 64, generator=gen), torch.randn(4, 64, 64, generator=gen)  # 2 kv heads, 4 heads
    w = torch.randn(16, 64, generator=gen)  # a shared projection: W' is per head
    q = torch.empty(2, 33, 4, 64)
    geometry = getattr(kernels, "_Geometry")(q, x, x, w, 16, 0, True)
    assert geometry.w_head_stride == 16 * 64
    folded = getattr(kernels, "_folded")(w, m)
    assert folded.shape == (4, 16, 64) and rel_rmse(folded, w.double() @ m.double()) <= 1e-7
    x_tilde = x.double().repeat_interleave(2, dim=2) * 64 ** -0.25
    exact = 0.5 * torch.einsum("bthe,hfe->bthf", x_tilde, m.double()).square().sum(-1).transpose(1, 2)
    norms = getattr(kernels, "_key_norms")(x, m, geometry)
    assert norms.shape == (2, 4, 33)
    x_tf32 = _tf32(x.repeat_interleave(2, dim=2) * 64 ** -0.25)
    single = 0.5 * torch.einsum("bthe,hfe->bthf", x_tf32, _tf32(m)).square().sum(-1).transpose(1, 2)
    assert rel_rmse(norms, exact) <= 2e-6 < 2e-5 <= rel_rmse(single, exact)  # (one TF32 product: 1.2e-4 here)
    assert getattr(kernels, "_key_norms")(x, None, geometry) is None
