"""Window + features attention (a converted layer's op): the chunked path, the decode step, the
continued state and the dense masked form against the float64 reference written from the
definition; documents, odd lengths, chunks that do not divide T, gradients, the state's size,
stability at large logits, non-finite inputs and bad arguments."""

from __future__ import annotations

import pytest
import torch

from kernelmix.errors import KernelmixError
from kernelmix.ops.window_features import (
    WindowFeatureState,
    window_feature_attention,
    window_feature_attention_masked,
    window_feature_attention_naive,
    window_feature_attention_step,
)
from tests.utils import rel_rmse

F64 = torch.float64


def _inputs(length, *, batch=2, heads=4, kv_heads=2, head_dim=6, m=5, dv=3, seed=0, dtype=F64, logit_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, head_dim, generator=g, dtype=F64)
    k = torch.randn(batch, length, kv_heads, head_dim, generator=g, dtype=F64)
    v = torch.randn(batch, length, kv_heads, dv, generator=g, dtype=F64)
    qf = logit_scale * torch.randn(batch, length, heads, m, generator=g, dtype=F64)
    kf = logit_scale * torch.randn(batch, length, heads, m, generator=g, dtype=F64)
    return [x.to(dtype) for x in (q, k, v, qf, kf)]


def _steps(inputs, window, relative=False, doc_start=None, sinks=0):
    state, outs = None, []
    for t in range(inputs[0].shape[1]):
        token = [x[:, t:t + 1] for x in inputs]
        ds = None if doc_start is None else doc_start[:, t:t + 1]
        out, state = window_feature_attention_step(*token, state, window=window, sinks=sinks,
                                                   relative_features=relative, doc_start=ds)
        outs.append(out)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("length,chunk", [(1, 4), (5, 3), (13, 4), (40, 7), (67, 16)])
@pytest.mark.parametrize("window", [0, 1, 3, 8, 64])
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_chunked_step_and_continued_equal_the_reference(length, chunk, window, relative, sinks):
    inputs = _inputs(length)
    options = dict(window=window, sinks=sinks, relative_features=relative)
    ref = window_feature_attention_naive(*inputs, **options)
    out = window_feature_attention(*inputs, chunk_size=chunk, **options)
    assert rel_rmse(out, ref) < 1e-12
    split = length // 3
    first, state = window_feature_attention(*[x[:, :split] for x in inputs], chunk_size=chunk, return_state=True,
                                            **options)
    second = window_feature_attention(*[x[:, split:] for x in inputs], chunk_size=chunk, initial_state=state, **options)
    assert rel_rmse(torch.cat([first, second], 1), ref) < 1e-12
    stepped, _ = _steps(inputs, window, relative, sinks=sinks)
    assert rel_rmse(stepped, ref) < 1e-12
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    positions = torch.arange(length).expand(2, -1)
    masked = window_feature_attention_masked(*inputs, causal, key_positions=positions, **options)
    assert rel_rmse(masked, ref) < 1e-12


@pytest.mark.parametrize("window", [0, 1, 4, 9])
@pytest.mark.parametrize("sinks", [0, 2])
def test_documents_are_kept_apart_in_every_form(window, sinks):
    inputs = _inputs(23)
    doc_start = torch.tensor([[0] * 5 + [5] * 10 + [15] * 8, [0] * 3 + [3] * 20])
    ref = window_feature_attention_naive(*inputs, window=window, sinks=sinks, doc_start=doc_start)
    out = window_feature_attention(*inputs, window=window, sinks=sinks, chunk_size=4, doc_start=doc_start)
    assert rel_rmse(out, ref) < 1e-12
    for split in (4, 7, 16):  # inside a document, at a boundary's first tokens (its sinks split), …
        first, state = window_feature_attention(*[x[:, :split] for x in inputs], window=window, sinks=sinks,
                                                chunk_size=3, doc_start=doc_start[:, :split], return_state=True)
        second = window_feature_attention(*[x[:, split:] for x in inputs], window=window, sinks=sinks, chunk_size=3,
                                          doc_start=doc_start[:, split:], initial_state=state)
        assert rel_rmse(torch.cat([first, second], 1), ref) < 1e-12
    stepped, _ = _steps(inputs, window, doc_start=doc_start, sinks=sinks)
    assert rel_rmse(stepped, ref) < 1e-12
    # each document alone gives the same rows (nothing crosses a boundary)
    alone = window_feature_attention(*[x[:1, 5:15] for x in inputs], window=window, sinks=sinks)
    assert rel_rmse(ref[:1, 5:15], alone) < 1e-12


@pytest.mark.parametrize("window", [0, 3, 8])
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
def test_gradients_of_every_input_equal_the_reference(window, relative, sinks):
    inputs = [x.requires_grad_(True) for x in _inputs(19, seed=1)]
    weights = torch.randn(2, 19, 4, 3, dtype=F64)
    grads = []
    for fn in (window_feature_attention_naive, lambda *a, **kw: window_feature_attention(*a, chunk_size=4, **kw)):
        out = fn(*inputs, window=window, sinks=sinks, relative_features=relative)
        got = torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)
        grads.append([torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs)])
    for name, fast, ref in zip(("q", "k", "v", "q_features", "k_features"), grads[1], grads[0]):
        assert rel_rmse(fast, ref) < 1e-10, name


def test_float32_and_bfloat16_compute_in_float32_against_float64():
    inputs = _inputs(50, seed=2)
    ref = window_feature_attention_naive(*inputs, window=6)
    out32 = window_feature_attention(*[x.float() for x in inputs], window=6, chunk_size=16)
    assert out32.dtype == torch.float32 and rel_rmse(out32, ref) < 1e-5
    out16 = window_feature_attention(*[x.bfloat16() for x in inputs], window=6, chunk_size=16)
    ref16 = window_feature_attention_naive(*[x.bfloat16().double() for x in inputs], window=6)
    assert out16.dtype == torch.bfloat16 and rel_rmse(out16, ref16) < 1e-2  # only the output is rounded to bf16


def test_large_logits_stay_finite_and_exact_in_float32():
    """Logits in the hundreds (exp overflows float32 at 88): both parts are stabilised, causally.
    (The feature logits' spread stays moderate: a spread of hundreds underflows the estimator itself
    in float32, its limit, not the combination's.)"""
    q, k, v, qf, kf = _inputs(37, seed=3, logit_scale=3.0)
    q, kf = 30 * q, kf + 120.0 * torch.linspace(0.5, 1.5, 37, dtype=F64)[None, :, None, None]
    ref = window_feature_attention_naive(q, k, v, qf, kf, window=5)
    assert torch.isfinite(ref).all()
    out = window_feature_attention(*[x.float() for x in (q, k, v, qf, kf)], window=5, chunk_size=8)
    stepped, _ = _steps([x.float() for x in (q, k, v, qf, kf)], 5)
    assert torch.isfinite(out).all() and rel_rmse(out, ref) < 1e-4 and rel_rmse(stepped, ref) < 1e-4


def test_the_state_does_not_grow_with_the_length():
    inputs = _inputs(90)

    def nbytes(state: WindowFeatureState) -> int:
        tensors = [state.keys, state.values, state.key_features, state.features.S, state.features.z,
                   state.features.shift, state.doc_start, state.sink_keys, state.sink_values]
        return sum(t.numel() * t.element_size() for t in tensors)

    sizes = {}
    for length in (10, 40, 90):
        _, state = window_feature_attention(*[x[:, :length] for x in inputs], window=8, sinks=2, return_state=True)
        sizes[length] = nbytes(state)
        assert state.keys.shape[1] == 7 and state.features.length == length - 7 and state.length == length
    assert sizes[10] == sizes[40] == sizes[90]


def test_a_window_longer_than_the_sequence_is_exact_softmax():
    q, k, v, qf, kf = _inputs(20)
    out = window_feature_attention(q, k, v, qf, kf, window=64)
    keys, values = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                                            values.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert rel_rmse(out, sdpa) < 1e-12


def test_causal_changing_later_tokens_leaves_earlier_rows():
    inputs = _inputs(30)
    out = window_feature_attention(*inputs, window=4, chunk_size=8)
    changed = [x.clone() for x in inputs]
    for x in changed:
        x[:, 17:] = torch.randn_like(x[:, 17:])
    again = window_feature_attention(*changed, window=4, chunk_size=8)
    assert torch.equal(out[:, :17], again[:, :17]) and not torch.equal(out[:, 17:], again[:, 17:])


def test_nonfinite_key_reaches_only_the_rows_that_see_it():
    q, k, v, qf, kf = _inputs(24)
    doc_start = torch.tensor([[0] * 12 + [12] * 12] * 2)
    v[0, 5, 0, 1] = float("nan")
    out = window_feature_attention(q, k, v, qf, kf, window=3, chunk_size=8, doc_start=doc_start)
    clean = v.clone()
    clean[0, 5, 0] = 0.0
    ref = window_feature_attention_naive(q, k, clean, qf, kf, window=3, doc_start=doc_start)
    assert torch.isnan(out[0, 5:12, :2]).all()  # the token and the rest of its document, on kv head 0's query heads
    assert rel_rmse(out[0, 5:12, 2:], ref[0, 5:12, 2:]) < 1e-12
    assert rel_rmse(out[0, :5], ref[0, :5]) < 1e-12 and rel_rmse(out[0, 12:], ref[0, 12:]) < 1e-12
    assert rel_rmse(out[1], ref[1]) < 1e-12


def test_bad_arguments_are_named():
    q, k, v, qf, kf = _inputs(6)
    with pytest.raises(KernelmixError, match="window must be an int"):
        window_feature_attention(q, k, v, qf, kf, window=-1)
    with pytest.raises(KernelmixError, match="k_features must be"):
        window_feature_attention(q, k, v, qf, kf[..., :3], window=2)
    with pytest.raises(KernelmixError, match="one token"):
        window_feature_attention_step(q, k, v, qf, kf, None, window=2)
    _, state = window_feature_attention(q, k, v, qf, kf, window=4, return_state=True)
    with pytest.raises(KernelmixError, match="window"):
        window_feature_attention(q, k, v, qf, kf, window=2, initial_state=state)
