"""Cubit-RF (docs/math.md §12): the chunked fast path and the decode step against the dense float64
reference written from the definition — values and the gradients of every input — documents, grouped
heads, states, causality, bf16 and input errors."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.ops import (
    CubitRFState,
    cubit_rf_attention,
    cubit_rf_attention_naive,
    cubit_rf_attention_step,
    gaussian_random_features,
)
from tests.utils import rel_rmse

F64 = torch.float64
B, H, H_KV, D, D_V, M = 2, 4, 2, 16, 12, 32
PER_TOKEN = ("q", "k", "v", "r", "rho")
COEFFICIENTS = ("rho", "ridge", "ref_scale", "transform")
TOL = 1e-4  # float32 fast path against the float64 reference (relative RMSE), values and gradients


def make_inputs(T: int, *, seed: int = 0, h_kv: int = H_KV, with_rho: bool = True, with_transform: bool = True,
                shared_projection: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {
        "q": randn(B, T, H, D),
        "k": randn(B, T, h_kv, D),
        "v": randn(B, T, h_kv, D_V),
        "r": randn(B, T, H, D),
        "projection": randn(M, D) if shared_projection else randn(H, M, D),
        "rho": 0.5 + 1.5 * torch.sigmoid(randn(B, T, H)) if with_rho else None,
        # the init ridge (1e-6) beside better conditioned heads; distinct reference scales
        "ridge": torch.tensor([1e-6, 1e-2, 0.1, 0.5], dtype=F64),
        "ref_scale": torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=F64),
        "transform": torch.eye(D, dtype=F64) + 0.2 * randn(H, D, D) if with_transform else None,
    }


def convert(x: dict, dtype: torch.dtype, grad: bool = False) -> dict:
    out = {}
    for name, t in x.items():
        out[name] = None if t is None else t.detach().to(dtype).requires_grad_(grad)
    return out


def tokens(x: dict, start: int, stop: int) -> dict:
    return {n: t[:, start:stop] if n in PER_TOKEN and t is not None else t for n, t in x.items()}


def fast(x: dict, **kw):
    return cubit_rf_attention(x["q"], x["k"], x["v"], x["r"], x["projection"], **{n: x[n] for n in COEFFICIENTS}, **kw)


def naive(x: dict, **kw):
    return cubit_rf_attention_naive(x["q"], x["k"], x["v"], x["r"], x["projection"], **{n: x[n] for n in COEFFICIENTS},
                                    **kw)


def step(x: dict, state, **kw):
    return cubit_rf_attention_step(x["q"], x["k"], x["v"], x["r"], x["projection"], state,
                                   **{n: x[n] for n in COEFFICIENTS}, **kw)


def packed_doc_start(T: int) -> torch.Tensor:
    """Two packings: documents of 5, 8, ... and 2, 6, ... tokens (boundaries inside and at chunk edges)."""
    rows = []
    for lengths in ((5, 8, 3, 40, 41), (2, 6, 16, 1, 70)):
        starts, at = [], 0
        for n in lengths:
            starts += [at] * n
            at += n
        rows.append(starts[:T])
    return torch.tensor(rows)


# ---------------------------------------------------------------------------------------------
# the fast path against the reference


@pytest.mark.parametrize("T", [1, 7, 33, 97])
@pytest.mark.parametrize("chunk_size", [5, 16, 64])
def test_fast_float32_matches_float64_reference(T, chunk_size):
    x = make_inputs(T, seed=T)
    ref = naive(x)
    out = fast(convert(x, torch.float32), chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (B, T, H, D_V)
    assert rel_rmse(out, ref) <= TOL


@pytest.mark.parametrize("with_rho", [True, False])
@pytest.mark.parametrize("with_transform", [True, False])
@pytest.mark.parametrize("h_kv", [1, 4])
def test_options_match_reference(with_rho, with_transform, h_kv):
    x = make_inputs(21, seed=3, h_kv=h_kv, with_rho=with_rho, with_transform=with_transform,
                    shared_projection=h_kv == 1)
    assert rel_rmse(fast(x, chunk_size=8), naive(x)) <= 1e-12


def test_float_coefficients_equal_constant_tensors():
    x = make_inputs(19, seed=4)
    as_tensors = {**x, "ridge": torch.full((H,), 0.05, dtype=F64), "ref_scale": torch.full((H,), 1.5, dtype=F64)}
    as_floats = {**x, "ridge": 0.05, "ref_scale": 1.5}
    assert rel_rmse(fast(as_floats, chunk_size=6), naive(as_tensors)) <= 1e-12


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_packed_documents_match_reference_and_separate_sequences(chunk_size):
    T = 29
    x = make_inputs(T, seed=5)
    doc_start = packed_doc_start(T)
    out = fast(convert(x, torch.float32), chunk_size=chunk_size, doc_start=doc_start)
    assert rel_rmse(out, naive(x, doc_start=doc_start)) <= TOL
    for b in range(B):  # every document alone gives the same rows
        for start in doc_start[b].unique().tolist():
            stop = int((doc_start[b] == start).sum()) + start
            alone = {n: None if t is None else (t[b : b + 1, start:stop] if n in PER_TOKEN else t)
                     for n, t in x.items()}
            solo = fast(alone, chunk_size=chunk_size)
            assert ((fast(x, chunk_size=chunk_size, doc_start=doc_start)[b : b + 1, start:stop] - solo).abs().max()
                    <= 1e-10)


def test_empty_sequence_keeps_the_state():
    x = make_inputs(9, seed=6)
    _, state = fast(tokens(x, 0, 5), chunk_size=4, return_state=True)
    out, same = fast(tokens(x, 5, 5), chunk_size=4, initial_state=state, return_state=True)
    assert out.shape == (B, 0, H, D_V) and same.length == 5
    assert torch.equal(same.reference.S, state.reference.S) and torch.equal(same.readout.S, state.readout.S)


# ---------------------------------------------------------------------------------------------
# states and decode


@pytest.mark.parametrize("split", [1, 8, 13, 20])
@pytest.mark.parametrize("documents", [False, True])
def test_continuing_from_a_state_equals_the_whole_sequence(split, documents):
    T = 29
    x = make_inputs(T, seed=7)
    doc_start = packed_doc_start(T) if documents else None
    whole = fast(x, chunk_size=8, doc_start=doc_start)
    kw = lambda a, b: {} if doc_start is None else {"doc_start": doc_start[:, a:b]}  # noqa: E731
    first, state = fast(tokens(x, 0, split), chunk_size=8, return_state=True, **kw(0, split))
    rest = fast(tokens(x, split, T), chunk_size=5, initial_state=state, **kw(split, T))
    assert (torch.cat([first, rest], dim=1) - whole).abs().max() <= 1e-12


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("prefill", [0, 6])
def test_step_equals_parallel_token_by_token(dtype, prefill):
    T = 23
    x = convert(make_inputs(T, seed=8), dtype)
    doc_start = packed_doc_start(T)
    whole = fast(x, chunk_size=5, doc_start=doc_start)
    state, outs = None, []
    if prefill:
        first, state = fast(tokens(x, 0, prefill), chunk_size=5, doc_start=doc_start[:, :prefill], return_state=True)
        outs.append(first)
    for t in range(prefill, T):
        o_t, state = step(tokens(x, t, t + 1), state, doc_start=doc_start[:, t : t + 1])
        outs.append(o_t)
    assert state.length == T
    assert rel_rmse(torch.cat(outs, dim=1), whole) <= (1e-12 if dtype == F64 else 1e-5)


def test_state_size_does_not_grow_with_the_length():
    shapes = []
    for T in (3, 40, 130):
        _, state = fast(make_inputs(T, seed=9), chunk_size=16, return_state=True)
        _, state = step(tokens(make_inputs(T + 1, seed=9), T, T + 1), state)
        shapes.append([tuple(t.shape) for part in (state.reference, state.readout)
                       for t in (part.S, part.z, part.shift)])
    assert shapes[0] == shapes[1] == shapes[2]
    assert shapes[0][0] == (B, H, M, D_V) and shapes[0][3] == (B, H, M, D_V)


@pytest.mark.parametrize("t", [0, 9, 15, 30])
def test_causal_even_when_the_future_is_extreme(t):
    """Rows ≤ t do not change when tokens > t do, even with enormous future logits (a stabiliser that
    read the future, such as a global max, would underflow the past)."""
    x = make_inputs(40, seed=10)
    out = fast(x, chunk_size=16)
    y = {n: None if v is None else v.clone() for n, v in x.items()}
    for name in ("q", "k", "r"):
        y[name][:, t + 1 :] = 40.0 * torch.randn_like(y[name][:, t + 1 :])
    y["v"][:, t + 1 :] -= 7.0
    y["rho"][:, t + 1 :] = 1.9
    out2 = fast(y, chunk_size=16)
    assert (out2[:, : t + 1] - out[:, : t + 1]).abs().max() <= 1e-12


def test_bfloat16_inputs_keep_float32_solves_and_states():
    T = 40
    x = make_inputs(T, seed=11)
    ref = naive(x)
    out, state = fast(convert(x, torch.bfloat16), chunk_size=16, return_state=True)
    assert out.dtype == torch.bfloat16
    for part in (state.reference, state.readout):
        assert part.S.dtype == part.z.dtype == part.shift.dtype == torch.float32
    # bf16 rounding of the inputs only: the same inputs rounded, computed in float64, agree closely
    rounded = convert(convert(x, torch.bfloat16), F64)
    assert rel_rmse(out, naive(rounded)) <= 1e-2
    assert rel_rmse(out, ref) <= 0.5  # (the solve amplifies the inputs' rounding; a sanity bound)
    o_t, state = step(tokens(convert(x, torch.bfloat16), 0, 1), None)
    assert o_t.dtype == torch.bfloat16 and state.reference.S.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# gradients


GRAD_INPUTS = ("q", "k", "v", "r", "projection", "rho", "ridge", "ref_scale", "transform")


@pytest.mark.parametrize("T,chunk_size,documents", [(1, 4, False), (18, 5, False), (33, 8, True)])
def test_float32_gradients_match_float64_reference(T, chunk_size, documents):
    x = make_inputs(T, seed=12 + T)
    doc_start = packed_doc_start(T) if documents else None
    ref_in, fast_in = convert(x, F64, grad=True), convert(x, torch.float32, grad=True)
    ref = naive(ref_in, doc_start=doc_start)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [ref_in[n] for n in GRAD_INPUTS])
    out = fast(fast_in, chunk_size=chunk_size, doc_start=doc_start)
    fast_grads = torch.autograd.grad((out * weights.float()).sum(), [fast_in[n] for n in GRAD_INPUTS])
    for name, got, want in zip(GRAD_INPUTS, fast_grads, ref_grads):
        assert rel_rmse(got, want) <= TOL, name


def test_gradcheck_float64_fast_path():
    """Finite differences of the fast path itself (small: 2 heads of dim 4, 6 features, 3 chunks)."""
    g = torch.Generator().manual_seed(13)
    heads, d, T = 2, 4, 7
    x = {
        "q": torch.randn(1, T, heads, d, generator=g, dtype=F64), "k": torch.randn(1, T, 1, d, generator=g, dtype=F64),
        "v": torch.randn(1, T, 1, 3, generator=g, dtype=F64), "r": torch.randn(1, T, heads, d, generator=g, dtype=F64),
        "projection": gaussian_random_features(6, d, num_heads=heads, generator=g, dtype=F64),
        "rho": 0.5 + torch.rand(1, T, heads, generator=g, dtype=F64), "ridge": torch.tensor([1e-3, 0.1], dtype=F64),
        "ref_scale": torch.tensor([1.0, 2.0], dtype=F64),
        "transform": torch.eye(d, dtype=F64) + 0.2 * torch.randn(heads, d, d, generator=g, dtype=F64),
    }
    args = [x[n].clone().requires_grad_() for n in GRAD_INPUTS]

    def fn(*tensors):
        return fast(dict(zip(GRAD_INPUTS, tensors)), chunk_size=3)

    assert torch.autograd.gradcheck(fn, args)


def test_step_gradients_flow_to_every_input():
    x = convert(make_inputs(3, seed=14), F64, grad=True)
    _, state = fast(tokens(x, 0, 2), chunk_size=4, return_state=True)
    o_t, _ = step(tokens(x, 2, 3), state)
    grads = torch.autograd.grad(o_t.sum(), [x[n] for n in GRAD_INPUTS])
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------------------------------------
# errors


def _bad(case: str, x: dict) -> dict:
    y = dict(x)
    if case == "r":
        y["r"] = x["r"][..., :8]
    elif case == "projection_dim":
        y["projection"] = x["projection"][..., :8]
    elif case == "projection_heads":
        y["projection"] = x["projection"][:3]
    elif case == "transform":
        y["transform"] = x["transform"][:, :8, :8]
    elif case == "rho_shape":
        y["rho"] = x["rho"][..., :2]
    elif case == "rho_sign":
        y["rho"] = -x["rho"]
    elif case == "ridge":
        y["ridge"] = 0.0
    elif case == "ridge_tensor":
        y["ridge"] = torch.tensor([1e-3, -1.0, 1.0, 1.0], dtype=F64)
    elif case == "ref_scale":
        y["ref_scale"] = torch.ones(3, dtype=F64)
    elif case == "k":
        y["k"] = x["k"][:, :-1]
    return y


BAD = {
    "r": r"r must have the query's shape", "projection_dim": "projection must be a tensor",
    "projection_heads": "projection has 3 heads", "transform": r"transform \(M\) must have shape",
    "rho_shape": r"rho must have shape \[B, T, H\]", "rho_sign": "rho must lie in", "ridge": "ridge must be > 0",
    "ridge_tensor": "ridge must be > 0 for every head",
    "ref_scale": r"ref_scale must be a float or a tensor of shape \[H\]", "k": "sequence lengths differ",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_kernelmix_error(case):
    x = _bad(case, make_inputs(6, seed=15))
    calls = [lambda: fast(x), lambda: naive(x)]
    if case != "k":  # (one token of each has equal lengths)
        calls.append(lambda: step(tokens(x, 0, 1), None))
    for call in calls:
        with pytest.raises(KernelmixError, match=BAD[case]):
            call()


def test_bad_chunk_size_state_and_step_length():
    x = make_inputs(6, seed=16)
    for chunk_size in (0, -3, 2.5, True):
        with pytest.raises(KernelmixError, match="chunk_size must be a positive int"):
            fast(x, chunk_size=chunk_size)
    with pytest.raises(KernelmixError, match="a decode step takes one token"):
        step(tokens(x, 0, 2), None)
    with pytest.raises(KernelmixError, match="state must be a CubitRFState"):
        fast(x, initial_state=object())
    _, state = fast(x, return_state=True)
    fewer = {**x, "projection": x["projection"][:, :8]}
    with pytest.raises(KernelmixError, match="the state does not fit"):
        step(tokens(fewer, 0, 1), state)
    broken = CubitRFState(reference=state.reference, readout=type(state.readout)(
        S=state.readout.S, z=state.readout.z, shift=state.readout.shift, length=state.length + 1))
    with pytest.raises(KernelmixError, match="the state is inconsistent"):
        fast(x, initial_state=broken)
    with pytest.raises(KernelmixError, match="doc_start"):
        fast(x, doc_start=torch.zeros(B, 5, dtype=torch.long))
    with pytest.raises(KernelmixError, match="backend"):
        fast(x, backend="cuda")


# ---------------------------------------------------------------------------------------------
# non-finite inputs


@pytest.mark.parametrize("name", ["k", "v", "r", "rho"])
def test_a_non_finite_input_reaches_only_the_rows_that_see_it(name):
    T, t = 29, 9
    x = make_inputs(T, seed=17)
    doc_start = packed_doc_start(T)
    clean = fast(x, chunk_size=8, doc_start=doc_start)
    y = {n: None if v is None else v.clone() for n, v in x.items()}
    y[name][0, t, 0] = float("nan") if name != "rho" else float("inf")
    out, state = fast(y, chunk_size=8, doc_start=doc_start, return_state=True)
    ref = naive(y, doc_start=doc_start)
    reached = torch.isnan(out).any(-1)
    assert torch.equal(reached, torch.isnan(ref).any(-1))
    # token 9 of batch 0 lies in the document [5, 13): its rows 9..12 are NaN (in the heads that read
    # head 0), nothing before it, in later documents or in batch 1
    assert reached[0, t:13, 0].all() and not reached[1].any()
    assert not reached[0, :t].any() and not reached[0, 13:].any()
    assert (out[~reached] - clean[~reached]).abs().max() <= 1e-12
    assert torch.isfinite(state.reference.S).all()  # the document ended before the last token


def test_a_non_finite_state_is_emptied_for_a_new_document():
    T = 12
    x = make_inputs(T, seed=18)
    _, state = fast(tokens(x, 0, 6), chunk_size=4, return_state=True)
    state.reference.S[0, 1] = float("nan")
    doc_start = torch.tensor([[0] * 3 + [9] * 3, [0] * 6])  # batch 0: a new document at 9
    out = fast(tokens(x, 6, T), chunk_size=4, initial_state=state, doc_start=doc_start)
    assert torch.isnan(out[0, :3, 1]).all() and not torch.isnan(out[0, 3:]).any()
    assert not torch.isnan(out[:, :, [0, 2, 3]]).any() and not torch.isnan(out[1]).any()


def test_step_with_a_non_finite_input_equals_the_parallel_form():
    T, t = 14, 4
    x = make_inputs(T, seed=19)
    x["v"][1, t, 1] = float("nan")
    doc_start = torch.tensor([[0] * T, [0] * 8 + [8] * 6])
    whole = fast(x, chunk_size=4, doc_start=doc_start)
    state, outs = None, []
    for i in range(T):
        o_i, state = step(tokens(x, i, i + 1), state, doc_start=doc_start[:, i : i + 1])
        outs.append(o_i)
    stepped = torch.cat(outs, dim=1)
    assert torch.equal(torch.isnan(stepped), torch.isnan(whole))
    finite = ~torch.isnan(whole)
    assert (stepped[finite] - whole[finite]).abs().max() <= 1e-12


@pytest.mark.parametrize("operands, tol", [("fp32", TOL), ("tf32", 2e-3)])
def test_triton_backend_matches_the_reference(monkeypatch, operands, tol):
    """backend="triton": the solve's recurrence over the chunks by its Triton kernels and the read-out
    by the random-feature ones (under the interpreter on the CPU), the per-chunk systems by torch; odd
    T, chunks that do not divide it, packed documents, grouped heads, every coefficient. With full-fp32
    read-out products the float32 bound; with the read-out's default TF32 products its measured one."""
    pytest.importorskip("triton")
    monkeypatch.setattr("kernelmix.ops._triton_features.FEATURE_OPERANDS", operands)
    x = make_inputs(37, seed=20)
    doc_start = packed_doc_start(37)
    ref_in, fast_in = convert(x, F64, grad=True), convert(x, torch.float32, grad=True)
    ref = naive(ref_in, doc_start=doc_start)
    out = fast(fast_in, chunk_size=16, doc_start=doc_start, backend="triton")
    assert rel_rmse(out, ref) <= tol
    names = [n for n in x if x[n] is not None]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    want = torch.autograd.grad(ref, [ref_in[n] for n in names], cotangent)
    got = torch.autograd.grad(out, [fast_in[n] for n in names], cotangent.float())
    for name, g, w in zip(names, got, want):
        assert rel_rmse(g, w) <= tol, name


def test_triton_backend_continues_a_state(monkeypatch):
    """Two Triton calls on a split sequence (the split inside a chunk and a document) give the one
    call's output and the torch path's final state."""
    pytest.importorskip("triton")
    monkeypatch.setattr("kernelmix.ops._triton_features.FEATURE_OPERANDS", "fp32")
    x = convert(make_inputs(29, seed=21), torch.float32)
    doc_start = packed_doc_start(29)
    whole, state = fast(x, chunk_size=8, doc_start=doc_start, return_state=True, backend="torch")
    first, mid = fast(tokens(x, 0, 13), chunk_size=8, doc_start=doc_start[:, :13], return_state=True,
                      backend="triton")
    second, end = fast(tokens(x, 13, 29), chunk_size=8, doc_start=doc_start[:, 13:], initial_state=mid,
                       return_state=True, backend="triton")
    assert rel_rmse(torch.cat([first, second], dim=1), whole) <= TOL
    assert rel_rmse(end.reference.S, state.reference.S) <= TOL and rel_rmse(end.readout.S, state.readout.S) <= TOL