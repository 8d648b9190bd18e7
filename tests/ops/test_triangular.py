"""The triangular solve shared by Cubit and DeltaFormer, in both of its implementations (the blocked
solve and the fused-attention rectangles, see ``_triangular``; the ``solver`` argument picks one):
the paths the mixer tests do not reach on their own — heads processed in groups (long sequences),
rectangles cut into pieces, several batch elements with different document layouts, reference
rows shorter than the norm clamp, β near 0 — against the float64 references, forward and every
input gradient, at odd lengths and chunk sizes not dividing T. The mixer tests themselves run the
default ("auto") path."""

from __future__ import annotations

import pytest
import torch

from kernelmix import ops
from kernelmix.ops import _solve_blocked, _solve_rectangles, _triangular
from tests.ops.test_documents import _doc_start
from tests.utils import rel_rmse

F64 = torch.float64
B, H, HKV, D = 2, 4, 2, 8


def _layouts(T: int) -> torch.Tensor:
    """Batch element 0: one document; 1: documents of varied lengths (some shorter than a chunk)."""
    lengths, left = [], T
    for n in (1, 2, 17, 5, 30, 3):
        if left <= 0:
            break
        lengths.append(min(n, left))
        left -= lengths[-1]
    if left > 0:
        lengths.append(left)
    return torch.stack([torch.zeros(T, dtype=torch.long), _doc_start(lengths)])


def _inputs(T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, T, H, D, generator=g, dtype=F64),
        "k": torch.randn(B, T, HKV, D, generator=g, dtype=F64),
        "v": torch.randn(B, T, HKV, D, generator=g, dtype=F64),
        "r": torch.randn(B, T, H, D, generator=g, dtype=F64),
        "rho": 0.5 + 1.5 * torch.rand(B, T, H, generator=g, dtype=F64),
        "beta": torch.rand(B, T, H, generator=g, dtype=F64),
    }


def _cubit(impl, t, **kw):
    return impl(t["q"], t["k"], t["v"], t["r"], rho=t["rho"], ridge=torch.tensor([1e-6, 1e-2, 0.1, 0.5], dtype=F64),
                ref_scale=torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=F64), **kw)


def _deltaformer(impl, t, **kw):
    return impl(t["q"], t["k"], t["v"], beta=t["beta"], **kw)


MIXERS = {
    "cubit": (ops.cubit_attention, ops.cubit_attention_naive, _cubit, ["q", "k", "v", "r", "rho"]),
    "deltaformer": (ops.deltaformer_attention, ops.deltaformer_attention_naive, _deltaformer, ["q", "k", "v", "beta"]),
}


@pytest.fixture(params=["blocked", "rectangles"])
def solve_path(request, monkeypatch):
    """Each test below runs with both implementations; the rectangles are cut into small pieces
    (24 rows × 16 columns) so that T = 63, 65 exercise that too, and its leaves are chunk_size rows
    (no minimum), so that chunk sizes that do not divide T exercise the leaves' edges. The tests
    pass the returned name as ``solver``."""
    monkeypatch.setattr(_solve_rectangles, "RECT_ROWS", 24)
    monkeypatch.setattr(_solve_rectangles, "RECT_COLS", 16)
    monkeypatch.setattr(_solve_rectangles, "RECT_MIN_LEAF", 1)
    return request.param


def _forward_and_grads(call, t, names, grad_out):
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    out = call(leaves)
    return out, torch.autograd.grad(out, [leaves[n] for n in names], grad_out, allow_unused=True,
                                    materialize_grads=True)


@pytest.mark.parametrize("documents", [False, True], ids=["one-doc", "docs"])
@pytest.mark.parametrize("T, chunk", [(1, 16), (63, 16), (65, 16), (65, 7)])
@pytest.mark.parametrize("name", list(MIXERS))
def test_head_groups_match_reference(monkeypatch, name, T, chunk, documents):
    # the blocked solve, one head per group (a kernel block of ≤ 1 element forces the smallest groups)
    monkeypatch.setattr(_solve_blocked, "TILE_ELEMENTS", 1)
    _check_mixer_against_reference(name, T, chunk, documents, seed=T + chunk, grad_seed=3, grad_tol=1e-10,
                                   solver="blocked")


def _check_mixer_against_reference(name, T, chunk, documents, *, seed, grad_seed, grad_tol, solver):
    """The fast mixer (with ``solver``) against its float64 reference: output to 1e-10, every input
    gradient finite and within ``grad_tol``."""
    fast, naive, call, names = MIXERS[name]
    t = _inputs(T, seed=seed)
    doc = {"doc_start": _layouts(T)} if documents else {}
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(grad_seed), dtype=F64)
    ref, ref_grads = _forward_and_grads(lambda z: call(naive, z, **doc), t, names, grad_out)
    out, grads = _forward_and_grads(lambda z: call(fast, z, chunk_size=chunk, solver=solver, **doc), t, names, grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert torch.isfinite(got).all(), n
        assert rel_rmse(got, want) <= grad_tol, n


@pytest.mark.parametrize("name", list(MIXERS))
def test_group_size_does_not_change_the_result(monkeypatch, name):
    fast, _, call, _ = MIXERS[name]
    t = _inputs(65, seed=5)
    t32 = {n: x.float() for n, x in t.items()}
    whole = call(fast, t32, chunk_size=16, solver="blocked")
    monkeypatch.setattr(_solve_blocked, "TILE_ELEMENTS", 1)
    grouped = call(fast, t32, chunk_size=16, solver="blocked")
    assert torch.allclose(whole, grouped, rtol=1e-5, atol=1e-6)


def test_cubit_references_below_the_norm_clamp(solve_path):
    # r ≈ 0 rows: r̂ = s·r/1e-6 and the diagonal logit is no longer the row maximum (all logits are
    # then tiny, so the stabiliser stays safe); the result must still match the reference
    t = _inputs(33, seed=11)
    t["r"][:, 3] = 0.0
    t["r"][:, 10] *= 1e-9
    grad_out = torch.randn(B, 33, H, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    names = ["q", "k", "v", "r", "rho"]
    ref, ref_grads = _forward_and_grads(lambda z: _cubit(ops.cubit_attention_naive, z), t, names, grad_out)
    out, grads = _forward_and_grads(lambda z: _cubit(ops.cubit_attention, z, chunk_size=8, solver=solve_path), t, names,
                                    grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-8, n


def test_large_logits_do_not_overflow(solve_path):
    # big reference scale / keys: logits of several hundred; the stabilisers keep exp2 finite
    t = _inputs(40, seed=12)
    t["k"] = t["k"] * 30.0
    names = ["q", "k", "v", "beta"]
    grad_out = torch.randn(B, 40, H, D, generator=torch.Generator().manual_seed(5), dtype=F64)
    t32 = {n: x.float() for n, x in t.items()}
    ref, _ = _forward_and_grads(lambda z: _deltaformer(ops.deltaformer_attention_naive, z), t, names, grad_out)
    fast = lambda z: _deltaformer(ops.deltaformer_attention, z, chunk_size=16, solver=solve_path)  # noqa: E731
    out, grads = _forward_and_grads(fast, t32, names, grad_out.float())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_rmse(out, ref) <= 1e-3
    c = ops.cubit_attention(t32["q"], t32["k"], t32["v"], t32["r"], ref_scale=200.0, chunk_size=16, solver=solve_path)
    c_ref = ops.cubit_attention_naive(t["q"], t["k"], t["v"], t["r"], ref_scale=200.0)
    assert torch.isfinite(c).all() and rel_rmse(c, c_ref) <= 1e-3


def _dense_solve(x, y, b, beta, gamma, scale, strict, doc_start, y_scale=None, b_scale=None):
    """(diag(β) K + γ I)⁻¹ (b ⊙ b_scale) with K the dense masked softmax of scale · x yᵀ; ``[B, H, T, *]``."""
    if y is None:
        y = x if y_scale is None else x * y_scale[..., None]
    T = x.shape[2]
    idx = torch.arange(T)
    hidden = (idx[None, :] >= idx[:, None]) if strict else (idx[None, :] > idx[:, None])
    hidden = hidden[None, None]
    if doc_start is not None:
        hidden = hidden | (idx[None, None, None, :] < doc_start[:, None, :, None])
    kernel = ops._common.masked_softmax(scale * x @ y.transpose(-1, -2), hidden.expand(x.shape[0], x.shape[1], T, T))
    system = kernel if beta is None else beta[..., None] * kernel
    system = system + gamma[:, None, None] * torch.eye(T, dtype=x.dtype)
    rhs = b if b_scale is None else b * b_scale[..., None]
    return torch.linalg.solve_triangular(system, rhs, upper=False)


@pytest.mark.parametrize("tile", [None, 1], ids=["whole", "head-groups"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-doc", "docs"])
@pytest.mark.parametrize("T, chunk", [(1, 16), (63, 16), (65, 16), (65, 7)])
@pytest.mark.parametrize("form", ["y-scaled", "y-is-x", "separate-y"])
def test_solve_with_derived_y_and_row_scaled_rhs(monkeypatch, solve_path, form, T, chunk, documents, tile):
    # the solve's own options: y = x ⊙ y_scale (Cubit's r̂), y = x (DeltaFormer's K–K form), a
    # separate y; b ⊙ b_scale (Cubit's ρ) — forward and every input gradient against the dense
    # float64 solve, at odd lengths and chunk sizes not dividing T, with and without documents
    if tile is not None:
        monkeypatch.setattr(_solve_blocked, "TILE_ELEMENTS", tile)
    g = torch.Generator().manual_seed(T * 31 + chunk)
    strict = form == "y-is-x"  # DeltaFormer's mask with its own form, Cubit's with the others
    t = {
        "x": torch.randn(B, H, T, D, generator=g, dtype=F64),
        "y": torch.randn(B, H, T, D, generator=g, dtype=F64) if form == "separate-y" else None,
        "b": torch.randn(B, H, T, D, generator=g, dtype=F64),
        "beta": torch.rand(B, H, T, generator=g, dtype=F64) if strict else None,
        "gamma": torch.tensor([1e-2, 0.1, 0.5, 1.0], dtype=F64),
        "y_scale": (0.5 + torch.rand(B, H, T, generator=g, dtype=F64)) if form == "y-scaled" else None,
        "b_scale": (0.5 + 1.5 * torch.rand(B, H, T, generator=g, dtype=F64)) if form != "y-is-x" else None,
    }
    leaves = {n: v.clone().requires_grad_() for n, v in t.items() if v is not None}
    doc_start = _layouts(T) if documents else None
    grad_out = torch.randn(B, H, T, D, generator=g, dtype=F64)
    kw = dict(scale=0.7, strict=strict, doc_start=doc_start)

    def args(z):
        return {n: z.get(n) for n in ("x", "y", "b", "beta", "gamma", "y_scale", "b_scale")}

    ref = _dense_solve(**args(leaves), **kw)
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), grad_out)
    leaves2 = {n: v.clone().requires_grad_() for n, v in t.items() if v is not None}
    a = args(leaves2)
    out = _triangular.kernel_triangular_solve(
        a["x"], a["y"], a["b"], beta=a["beta"], gamma=a["gamma"], y_scale=a["y_scale"], b_scale=a["b_scale"],
        chunk_size=chunk, diagonal_is_row_max=False, solver=solve_path, **kw,
    )
    grads = torch.autograd.grad(out, list(leaves2.values()), grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(leaves, grads, ref_grads):
        assert torch.isfinite(got).all(), n
        assert rel_rmse(got, want) <= 1e-9, n


def test_y_scale_needs_derived_y(solve_path):
    x = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="y_scale"):
        _triangular.kernel_triangular_solve(
            x, x, x, beta=None, gamma=torch.ones(2), scale=1.0, strict=False, chunk_size=4, y_scale=torch.ones(1, 2, 5),
            solver=solve_path,
        )


@pytest.mark.parametrize("T, chunk", [(1, 16), (63, 16), (65, 7)])
def test_cubit_ridge_and_ref_scale_gradients(solve_path, T, chunk):
    # λ and s reach the solve as γ and the row scale of y: their gradients against the reference
    t = _inputs(T, seed=T + 100)
    t["ridge"] = torch.tensor([1e-3, 1e-2, 0.1, 0.5], dtype=F64)
    t["ref_scale"] = torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=F64)
    names = ["q", "k", "v", "r", "rho", "ridge", "ref_scale"]
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(6), dtype=F64)

    def call(impl, **kw):
        return lambda z: impl(z["q"], z["k"], z["v"], z["r"], rho=z["rho"], ridge=z["ridge"], ref_scale=z["ref_scale"],
                              doc_start=_layouts(T), **kw)

    ref, ref_grads = _forward_and_grads(call(ops.cubit_attention_naive), t, names, grad_out)
    out, grads = _forward_and_grads(call(ops.cubit_attention, chunk_size=chunk, solver=solve_path), t, names, grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-9, n


@pytest.mark.parametrize("documents", [False, True], ids=["one-doc", "docs"])
@pytest.mark.parametrize("T, chunk", [(1, 16), (65, 7), (130, 16)])
@pytest.mark.parametrize("name", list(MIXERS))
def test_mixers_match_reference_with_rectangle_pieces(solve_path, name, T, chunk, documents):
    # both mixers end to end, every input gradient, with the rectangles cut into small pieces
    _check_mixer_against_reference(name, T, chunk, documents, seed=T + 7 * chunk, grad_seed=8, grad_tol=1e-9,
                                   solver=solve_path)


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-9), (torch.float32, 1e-4)])
def test_beta_near_zero(solve_path, dtype, tol):
    # β = 0, tiny, and on both sides of BETA_EXACT (below it the rectangles keep the forward's
    # K U rows; above it they recover them as (b − γU)/β): forward and the gradients of every
    # input, β's included, against the dense float64 solve
    T = 70
    g = torch.Generator().manual_seed(21)
    x = torch.randn(B, H, T, D, generator=g, dtype=F64)
    b = torch.randn(B, H, T, D, generator=g, dtype=F64)
    beta = torch.rand(B, H, T, generator=g, dtype=F64)
    edge = _solve_rectangles.BETA_EXACT
    beta[:, :, 5] = 0.0
    beta[:, :, 9] = 1e-12
    beta[:, :, 20] = edge * (1 - 1e-6)
    beta[:, :, 21] = edge * (1 + 1e-6)
    beta[:, :, 40:50] = 1e-4
    gamma = torch.tensor([1.0, 0.5, 1.0, 2.0], dtype=F64)
    grad_out = torch.randn(B, H, T, D, generator=g, dtype=F64)
    leaves = [z.clone().requires_grad_() for z in (x, b, beta)]
    ref = _dense_solve(leaves[0], None, leaves[1], leaves[2], gamma, 0.35, True, None)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out)
    mine = [z.to(dtype).requires_grad_() for z in (x, b, beta)]
    out = _triangular.kernel_triangular_solve(mine[0], None, mine[1], beta=mine[2], gamma=gamma.to(dtype), scale=0.35,
                                              strict=True, chunk_size=16, solver=solve_path)
    grads = torch.autograd.grad(out, mine, grad_out.to(dtype))
    assert rel_rmse(out.double(), ref) <= tol
    for n, got, want in zip(("x", "b", "beta"), grads, ref_grads):
        assert torch.isfinite(got).all(), n
        assert rel_rmse(got.double(), want) <= tol, n
    # the rows with tiny β, on their own: their β-gradients are not small, and must stay accurate
    assert rel_rmse(grads[2][:, :, [5, 9, 20, 40]].double(), ref_grads[2][:, :, [5, 9, 20, 40]]) <= tol


def test_auto_path_falls_back_where_the_rectangles_do_not_apply():
    # the fused kernel needs dk == dv: other head sizes take the blocked solve (and are correct);
    # forcing the rectangles there says why it cannot
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 40, 8, generator=g, dtype=F64)
    b = torch.randn(1, 2, 40, 5, generator=g, dtype=F64)
    kw = dict(beta=None, gamma=torch.full((2,), 0.1, dtype=F64), scale=1.0, strict=False, chunk_size=16)
    out = _triangular.kernel_triangular_solve(x, None, b, **kw)
    assert rel_rmse(out, _dense_solve(x, None, b, None, kw["gamma"], 1.0, False, None)) <= 1e-10
    assert torch.equal(out, _triangular.kernel_triangular_solve(x, None, b, solver="blocked", **kw))
    assert not _solve_rectangles.rectangles_applicable(x, b) and _solve_rectangles.rectangles_applicable(x, x)
    # where they apply, "auto" is the rectangle solve
    auto = _triangular.kernel_triangular_solve(x, None, x, **kw)
    assert torch.equal(auto, _triangular.kernel_triangular_solve(x, None, x, solver="rectangles", **kw))
    with pytest.raises(RuntimeError, match=r"dk == dv.*solver='auto'"):
        _triangular.kernel_triangular_solve(x, None, b, solver="rectangles", **kw)


@pytest.mark.parametrize("name", list(MIXERS))
def test_unknown_solver_names_the_choices(name):
    fast, _, call, _ = MIXERS[name]
    t = _inputs(5, seed=1)
    with pytest.raises(ValueError, match=r"unknown solver 'rectangle' \(choose from: auto, blocked, rectangles\)"):
        call(fast, t, chunk_size=4, solver="rectangle")


def test_the_two_paths_agree_in_float32_at_length_1000(monkeypatch):
    # a long fp32 run (several levels of rectangles and pieces; the rectangles' leaves at their
    # default minimum, 128 rows, which does not divide T): both implementations against the float64
    # reference and each other
    T = 1000
    t = {n: z[:1] for n, z in _inputs(T, seed=9).items()}
    t32 = {n: z.float() for n, z in t.items()}
    ref = _cubit(ops.cubit_attention_naive, t)
    results = {}
    monkeypatch.setattr(_solve_rectangles, "RECT_ROWS", 256)
    monkeypatch.setattr(_solve_rectangles, "RECT_COLS", 128)
    for path in ("blocked", "rectangles"):
        results[path] = _cubit(ops.cubit_attention, t32, chunk_size=63, solver=path)
        assert rel_rmse(results[path].double(), ref) <= 1e-4, path
    assert rel_rmse(results["rectangles"], results["blocked"]) <= 1e-4
