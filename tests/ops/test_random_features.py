"""Random-feature attention (Performer / DARKFormer): fast path vs reference, decode, causality,
and the estimator's statistics (unbiasedness, the variance formula of docs/math.md §6, convergence in m)."""

from __future__ import annotations

import math

import pytest
import torch

from kernelmix.ops.random_features import (
    RandomFeatureState,
    gaussian_random_features,
    orthogonal_random_features,
    positive_random_features,
    random_feature_attention,
    random_feature_attention_naive,
    random_feature_attention_step,
)
from tests.utils import rel_rmse

F64 = torch.float64


def _inputs(batch, length, heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, head_dim, generator=g, dtype=F64)
    k = torch.randn(batch, length, kv_heads, head_dim, generator=g, dtype=F64)
    v = torch.randn(batch, length, kv_heads, head_dim, generator=g, dtype=F64)
    transform = torch.eye(head_dim, dtype=F64) + 0.3 * torch.randn(heads, head_dim, head_dim, generator=g, dtype=F64)
    return q, k, v, transform


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("length,chunk", [(1, 4), (2, 3), (63, 16), (65, 16), (257, 48)])
@pytest.mark.parametrize("darkformer,per_head", [(False, False), (True, True)])
def test_fast_path_matches_reference_forward_and_gradients(dtype, tol, length, chunk, darkformer, per_head):
    heads, head_dim, m = 4, 8, 16
    q, k, v, transform = _inputs(2, length, heads, 2, head_dim)
    gen = torch.Generator().manual_seed(1)
    projection = orthogonal_random_features(m, head_dim, num_heads=heads if per_head else None, generator=gen,
                                            dtype=F64)
    base = [q, k, v] + ([transform] if darkformer else [])
    ref_in = [x.clone().requires_grad_() for x in base]
    ref = random_feature_attention_naive(*ref_in[:3], projection, transform=ref_in[3] if darkformer else None)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=F64)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    fast_in = [x.detach().to(dtype).requires_grad_() for x in base]
    out = random_feature_attention(
        *fast_in[:3], projection.to(dtype), transform=fast_in[3] if darkformer else None, chunk_size=chunk
    )
    assert out.dtype == dtype and out.shape == (2, length, heads, head_dim)
    fast_grads = torch.autograd.grad(out, fast_in, grad_out.to(dtype))
    assert rel_rmse(out, ref) <= tol
    for name, got, want in zip(["q", "k", "v", "transform"], fast_grads, ref_grads):
        assert rel_rmse(got, want) <= tol, name


def test_bfloat16_inputs_keep_fp32_logits_and_state():
    q, k, v, transform = _inputs(1, 40, 2, 2, 8)
    projection = gaussian_random_features(32, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    ref = random_feature_attention_naive(q, k, v, projection, transform=transform)
    out, state = random_feature_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), projection.bfloat16(), transform=transform.bfloat16(),
        chunk_size=16, return_state=True,
    )
    assert out.dtype == torch.bfloat16
    assert state.S.dtype == torch.float32 and state.z.dtype == torch.float32
    assert rel_rmse(out, ref) <= 3e-2  # bf16 rounding of the inputs and output only


def test_gradcheck_float64():
    q, k, v, transform = _inputs(1, 9, 2, 1, 4)
    projection = gaussian_random_features(6, 4, num_heads=2, generator=torch.Generator().manual_seed(3), dtype=F64)
    args = [x.clone().requires_grad_() for x in (q, k, v, transform)]

    def fn(q_, k_, v_, m_):
        return random_feature_attention(q_, k_, v_, projection, transform=m_, chunk_size=4)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("t", [0, 15, 16, 40])
def test_causal_even_when_a_future_key_is_huge(t):
    """A key stabiliser that reads the future (a global max) would underflow the past keys when a
    later key has an enormous logit; ours is a running max, so the past is untouched."""
    q, k, v, transform = _inputs(1, 50, 2, 2, 8)
    projection = orthogonal_random_features(32, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    out = random_feature_attention(q, k, v, projection, transform=transform, chunk_size=16)
    k2, q2, v2 = k.clone(), q.clone(), v.clone()
    k2[:, t + 1 :] = 60.0 * torch.randn_like(k2[:, t + 1 :])
    q2[:, t + 1 :] += 5.0
    v2[:, t + 1 :] -= 7.0
    out2 = random_feature_attention(q2, k2, v2, projection, transform=transform, chunk_size=16)
    assert (out2[:, : t + 1] - out[:, : t + 1]).abs().max().item() <= 1e-12
    assert torch.isfinite(out2).all()


@pytest.mark.parametrize("prefill", [0, 1, 11, 16])
def test_decode_equals_parallel(prefill):
    q, k, v, transform = _inputs(2, 37, 4, 2, 8)
    projection = orthogonal_random_features(24, 8, num_heads=4, generator=torch.Generator().manual_seed(0), dtype=F64)
    full = random_feature_attention(q, k, v, projection, transform=transform, chunk_size=16)
    outs, state = [], None
    if prefill:
        o, state = random_feature_attention(
            q[:, :prefill], k[:, :prefill], v[:, :prefill], projection, transform=transform, chunk_size=16,
            return_state=True,
        )
        outs.append(o)
        assert state.length == prefill
    for i in range(prefill, 37):
        o, state = random_feature_attention_step(
            q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], projection, state, transform=transform
        )
        outs.append(o)
    assert state.length == 37
    assert state.S.shape == (2, 4, 24, 8)  # O(m·d) state, independent of the position
    assert rel_rmse(torch.cat(outs, dim=1), full) <= 1e-10


def test_initial_state_continues_a_chunked_prefill():
    q, k, v, transform = _inputs(1, 50, 2, 2, 8)
    projection = orthogonal_random_features(16, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    full = random_feature_attention(q, k, v, projection, transform=transform, chunk_size=7)
    first, state = random_feature_attention(
        q[:, :23], k[:, :23], v[:, :23], projection, transform=transform, chunk_size=7, return_state=True
    )
    second = random_feature_attention(
        q[:, 23:], k[:, 23:], v[:, 23:], projection, transform=transform, chunk_size=5, initial_state=state
    )
    assert rel_rmse(torch.cat([first, second], dim=1), full) <= 1e-10


def test_darkformer_with_identity_equals_performer():
    q, k, v, _ = _inputs(2, 30, 4, 4, 8)
    projection = orthogonal_random_features(16, 8, num_heads=4, generator=torch.Generator().manual_seed(0), dtype=F64)
    eye = torch.eye(8, dtype=F64).expand(4, 8, 8)
    dark = random_feature_attention(q, k, v, projection, transform=eye, chunk_size=8)
    performer = random_feature_attention(q, k, v, projection, chunk_size=8)
    assert rel_rmse(dark, performer) <= 1e-12


# ------------------------------------------------------------------------------------------
# Estimator statistics. x, y are single vectors; N independent projections are drawn at once by
# using the "head" axis of a [N, m, d] projection.


def _pair(head_dim, seed, norm=0.8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(head_dim, generator=g, dtype=F64)
    y = torch.randn(head_dim, generator=g, dtype=F64)
    m = torch.eye(head_dim, dtype=F64) + 0.4 * torch.randn(head_dim, head_dim, generator=g, dtype=F64)
    return norm * x / x.norm(), norm * y / y.norm(), m


def _estimates(x, y, projection, transform):
    """φ(x)·φ(y) for each of the N projections in ``projection`` [N, m, d]."""
    n = projection.shape[0]
    xs = x.expand(1, 1, n, -1)
    ys = y.expand(1, 1, n, -1)
    tf = None if transform is None else transform.expand(n, -1, -1)
    return (positive_random_features(xs, projection, transform=tf)
            * positive_random_features(ys, projection, transform=tf)).sum(-1)[0, 0]


def _exact(x, y, transform):
    d = x.shape[0]
    sigma = torch.eye(d, dtype=F64) if transform is None else transform.T @ transform
    return torch.exp(x @ sigma @ y / math.sqrt(d))


def _single_feature_moments(x, y, transform):
    """Raw moments of one feature product Z = exp(ωᵀa − c), ω ~ N(0, I):
    E[Z^p] = K^p exp(p(p−1)|a|²/2) with a = M(x̃ + ỹ) and K = E[Z] = exp(x̃ᵀΣỹ)."""
    d = x.shape[0]
    mt = torch.eye(d, dtype=F64) if transform is None else transform
    a2 = (mt @ (x + y) * d ** -0.25).pow(2).sum()
    kernel = _exact(x, y, transform)
    return [kernel**p * torch.exp(p * (p - 1) * a2 / 2) for p in range(5)], a2


@pytest.mark.parametrize("darkformer", [False, True])
def test_iid_features_are_unbiased_within_a_derived_monte_carlo_bound(darkformer):
    """Mean of N independent m-feature estimates; each feature term has variance K²(e^{|a|²} − 1)
    (docs/math.md §6 with m = 1), so the mean of N·m iid terms has standard error K·sqrt((e^{|a|²}−1)/(N m)).
    We allow 5 standard errors."""
    head_dim, m, n = 8, 4, 50_000
    x, y, mt = _pair(head_dim, seed=0)
    transform = mt if darkformer else None
    projection = gaussian_random_features(m, head_dim, num_heads=n, generator=torch.Generator().manual_seed(1),
                                          dtype=F64)
    estimates = _estimates(x, y, projection, transform)
    exact = _exact(x, y, transform)
    (_, _, second, _, _), a2 = _single_feature_moments(x, y, transform)
    standard_error = exact * torch.sqrt((torch.exp(a2) - 1) / (n * m))
    assert abs(estimates.mean() - exact) <= 5 * standard_error


def test_orthogonal_features_are_unbiased():
    """Each orthogonal row is marginally N(0, I) (Haar direction × chi(d) norm), so the estimator
    stays unbiased; the bound uses the empirical standard error of the N independent draws."""
    head_dim, n = 8, 20_000
    x, y, mt = _pair(head_dim, seed=2)
    projection = orthogonal_random_features(head_dim, head_dim, num_heads=n, generator=torch.Generator().manual_seed(3),
                                            dtype=F64)
    for transform in (None, mt):
        estimates = _estimates(x, y, projection, transform)
        standard_error = estimates.std() / math.sqrt(n)
        assert abs(estimates.mean() - _exact(x, y, transform)) <= 5 * standard_error


@pytest.mark.parametrize("m", [1, 8])
def test_darkformer_variance_formula_holds_empirically(m):
    """Var[φ_Σ(x)·φ_Σ(y)] = (1/m) K² (exp((x̃+ỹ)ᵀΣ(x̃+ỹ)) − 1) for iid features (docs/math.md §6).
    Tolerance: 5 standard errors of the sample variance, from the estimator's 4th central moment
    (for a mean of m iid terms: μ4/m³ + 3(m−1)σ⁴/m³)."""
    head_dim, n = 8, 100_000
    x, y, mt = _pair(head_dim, seed=4, norm=0.6)
    projection = gaussian_random_features(m, head_dim, num_heads=n, generator=torch.Generator().manual_seed(5),
                                          dtype=F64)
    estimates = _estimates(x, y, projection, mt)
    kernel = _exact(x, y, mt)
    formula = kernel**2 * (torch.exp(((mt @ (x + y)) * head_dim**-0.25).pow(2).sum()) - 1) / m
    raw, _ = _single_feature_moments(x, y, mt)
    mu = raw[1]
    sigma2 = raw[2] - mu**2
    mu4 = raw[4] - 4 * mu * raw[3] + 6 * mu**2 * raw[2] - 3 * mu**4
    assert torch.allclose(sigma2 / m, formula)  # the closed form is the moment identity
    mu4_mean = mu4 / m**3 + 3 * (m - 1) * sigma2**2 / m**3
    se_of_variance = torch.sqrt((mu4_mean - (sigma2 / m) ** 2) / n)
    assert abs(estimates.var() - formula) <= 5 * se_of_variance


def test_attention_approaches_exact_kernel_attention_as_m_grows():
    q, k, v, transform = _inputs(1, 24, 2, 2, 8, seed=7)
    q, k = 0.3 * q, 0.3 * k  # moderate logits: the estimator is in its 1/sqrt(m) regime
    sigma = transform.transpose(-1, -2) @ transform
    logits = torch.einsum("bihd,hde,bjhe->bhij", q, sigma, k) / math.sqrt(8)
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    exact = torch.einsum("bhij,bjhd->bihd", logits.masked_fill(~mask, float("-inf")).softmax(-1), v)
    errors = []
    for m in (8, 64, 512, 4096):
        per_seed = []
        for seed in range(4):
            proj = orthogonal_random_features(m, 8, num_heads=2, generator=torch.Generator().manual_seed(seed),
                                              dtype=F64)
            per_seed.append(rel_rmse(random_feature_attention(q, k, v, proj, transform=transform, chunk_size=10),
                                     exact))
        errors.append(sum(per_seed) / len(per_seed))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] / 8, errors  # ~1/sqrt(m): 8 → 4096 predicts a factor ≈ 22
    assert errors[-1] < 0.05, errors


def test_orthogonal_projection_structure_and_determinism():
    d = 8
    w = orthogonal_random_features(20, d, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert w.shape == (20, d)
    directions = w / w.norm(dim=1, keepdim=True)
    block = directions[:d] @ directions[:d].T
    assert torch.allclose(block, torch.eye(d, dtype=F64), atol=1e-12)  # rows of a block are orthogonal
    again = orthogonal_random_features(20, d, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert torch.equal(w, again)
    many = orthogonal_random_features(4096, d, generator=torch.Generator().manual_seed(1), dtype=F64).norm(dim=1)
    chi_mean = math.sqrt(2) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))
    chi_var = d - chi_mean**2
    assert abs(many.mean().item() - chi_mean) <= 5 * math.sqrt(chi_var / 4096)
    per_head = orthogonal_random_features(8, d, num_heads=3, generator=torch.Generator().manual_seed(0))
    assert per_head.shape == (3, 8, d) and not torch.equal(per_head[0], per_head[1])


def test_bad_input_raises_value_errors():
    q, k, v, transform = _inputs(1, 5, 4, 2, 8)
    projection = orthogonal_random_features(16, 8, dtype=F64)
    with pytest.raises(ValueError, match="num_features"):
        orthogonal_random_features(0, 8)
    with pytest.raises(ValueError, match="num_features"):
        gaussian_random_features(-3, 8)
    with pytest.raises(ValueError, match="m must be"):
        random_feature_attention(q, k, v, projection[:0])
    with pytest.raises(ValueError, match="head dim"):
        random_feature_attention(q, k, v, orthogonal_random_features(16, 4, dtype=F64))
    with pytest.raises(ValueError, match="heads"):
        random_feature_attention(q, k, v, orthogonal_random_features(16, 8, num_heads=3, dtype=F64))
    three_heads = torch.randn(1, 5, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"transform \(M\)"):
        random_feature_attention(q, k, v, projection, transform=transform[:2])
    with pytest.raises(ValueError, match="4 dims"):
        random_feature_attention(q[0], k, v, projection)
    with pytest.raises(ValueError, match="multiple"):
        random_feature_attention(q, three_heads, three_heads, projection)
    with pytest.raises(ValueError, match="chunk_size"):
        random_feature_attention(q, k, v, projection, chunk_size=0)
    with pytest.raises(ValueError, match="T=1"):
        random_feature_attention_step(q[:, :2], k[:, :2], v[:, :2], projection, None)
    bad_state = RandomFeatureState(S=torch.zeros(1, 4, 7, 8, dtype=F64), z=torch.zeros(1, 4, 7, dtype=F64),
                                   shift=torch.zeros(1, 4, dtype=F64), length=3)
    with pytest.raises(ValueError, match="state does not fit"):
        random_feature_attention_step(q[:, :1], k[:, :1], v[:, :1], projection, bad_state)


@pytest.mark.filterwarnings("ignore::kernelmix.ops.random_features.UnderflowWarning")  # (tests/reliability checks it)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_underflowing_denominator_gives_zero_rows_and_finite_gradients(dtype):
    """Queries whose dominant features miss every key's (huge, opposed q and k, as a finetuned
    DARKFormer on Gemma produced): the ratio is 0/0 numerically. Output and every gradient must be
    finite, fast path, decode step and float64 reference alike; ordinary rows are unchanged."""
    from kernelmix.ops.random_features import (
        random_feature_attention_naive,
        random_feature_attention_step,
        safe_ratio,
    )

    gen = torch.Generator().manual_seed(0)
    d, m, length = 8, 16, 37
    projection = orthogonal_random_features(m, d, generator=gen).to(dtype)
    direction = torch.randn(d, generator=gen, dtype=dtype)
    direction = direction / direction.norm()
    k = (-400.0 * direction).expand(1, length, 1, d).clone()
    q = (400.0 * direction).expand(1, length, 1, d).clone()
    q[:, :5] = torch.randn(1, 5, 1, d, generator=gen, dtype=dtype) * 0.3  # ordinary rows first
    k[:, :5] = torch.randn(1, 5, 1, d, generator=gen, dtype=dtype) * 0.3
    v = torch.randn(1, length, 1, 4, generator=gen, dtype=dtype)
    for fn in (lambda *a: random_feature_attention(*a, chunk_size=7), random_feature_attention_naive):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qq, kk, vv, projection)
        assert torch.isfinite(out).all()
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))
    # the first rows see only ordinary keys: they match the reference as usual
    ref = random_feature_attention_naive(q.double(), k.double(), v.double(), projection.double())
    fast = random_feature_attention(q, k, v, projection, chunk_size=7)
    assert rel_rmse(fast[:, :5], ref[:, :5]) < 1e-5
    # decode step from an empty state on a degenerate token: finite too
    _, state = random_feature_attention(q[:, :-1], k[:, :-1], v[:, :-1], projection, return_state=True)
    step, _ = random_feature_attention_step(q[:, -1:], k[:, -1:], v[:, -1:], projection, state)
    assert torch.isfinite(step).all()
    # the helper itself: exact division above the floor, 0 (and zero gradient) below it
    num = torch.tensor([1.0, 1.0], dtype=dtype, requires_grad=True)
    den = torch.tensor([2.0, 0.0], dtype=dtype, requires_grad=True)
    r = safe_ratio(num, den)
    r.sum().backward()
    assert r.tolist() == [0.5, 0.0] and torch.isfinite(den.grad).all() and den.grad[1] == 0
