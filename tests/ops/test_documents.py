"""Document boundaries (packed sequences, left padding) in every op: ``doc_start``.

A row holding several documents must give each document exactly the output it gets alone; the
fast path must match the reference with boundaries too, forward and backward; decode must match.
"""

from __future__ import annotations

import pytest
import torch

from kernelmix import ops
from tests.utils import rel_rmse

F64 = torch.float64
H, HKV, D = 4, 2, 8


def _doc_start(lengths: list[int]) -> torch.Tensor:
    starts, pos = [], 0
    for n in lengths:
        starts += [pos] * n
        pos += n
    return torch.tensor(starts)


def _tensors(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {
        "q": torch.randn(batch, length, H, D, generator=g, dtype=F64),
        "k": torch.randn(batch, length, HKV, D, generator=g, dtype=F64),
        "v": torch.randn(batch, length, HKV, D, generator=g, dtype=F64),
        "r": torch.randn(batch, length, H, D, generator=g, dtype=F64),
        "rho": 0.5 + 1.5 * torch.rand(batch, length, H, generator=g, dtype=F64),
        "beta": torch.rand(batch, length, H, generator=g, dtype=F64),
        "transform": torch.eye(D, dtype=F64) + 0.2 * torch.randn(H, D, D, generator=g, dtype=F64),
    }
    return t


PROJECTION = ops.orthogonal_random_features(16, D, num_heads=H, generator=torch.Generator().manual_seed(9), dtype=F64)

# name -> (fast, naive, step, per-token tensor names, static kwargs builder)
MIXERS = {
    "softmax": (ops.softmax_attention, ops.softmax_attention_naive, ops.softmax_attention_step, ["q", "k", "v"], {}),
    "cubit": (ops.cubit_attention, ops.cubit_attention_naive, ops.cubit_attention_step, ["q", "k", "v", "r", "rho"],
              {"ridge": 0.05}),
    "deltaformer": (ops.deltaformer_attention, ops.deltaformer_attention_naive, ops.deltaformer_attention_step,
                    ["q", "k", "v", "beta"], {}),
    "darkformer": (ops.random_feature_attention, ops.random_feature_attention_naive,
                   ops.random_feature_attention_step, ["q", "k", "v", "transform"], {}),
}
POSITIONAL = {"q", "k", "v", "r"}


def _call(fn, name, t, *, sl=slice(None), state=None, step=False, **kw):
    """Call an op of mixer ``name`` on tokens ``sl`` of the tensors ``t``."""
    _, _, _, names, static = MIXERS[name]
    args = [t[n][:, sl] for n in names if n in POSITIONAL]
    kwargs = dict(static)
    for n in names:
        if n not in POSITIONAL:
            kwargs[n] = t[n] if n == "transform" else t[n][:, sl]
    if name == "darkformer":
        args.append(PROJECTION)
    if step:
        args.append(state)
    return fn(*args, **kwargs, **kw)


@pytest.mark.parametrize("name", list(MIXERS))
def test_packed_documents_equal_separate_runs(name):
    lengths = [5, 1, 17, 9]
    t = _tensors(1, sum(lengths))
    fast = MIXERS[name][0]
    chunk = {} if name == "softmax" else {"chunk_size": 7}
    packed = _call(fast, name, t, doc_start=_doc_start(lengths)[None], **chunk)
    start = 0
    for n in lengths:
        alone = _call(fast, name, t, sl=slice(start, start + n), **chunk)
        assert rel_rmse(packed[:, start : start + n], alone) <= 1e-10, (name, start)
        start += n


@pytest.mark.parametrize("name", list(MIXERS))
def test_fast_path_matches_reference_with_documents_forward_and_backward(name):
    fast, naive, _, names, _ = MIXERS[name]
    t = _tensors(2, 29, seed=1)
    doc_start = torch.stack([_doc_start([3, 12, 14]), _doc_start([1, 1, 20, 7])])  # two different layouts
    ref_in = {n: x.clone().requires_grad_() for n, x in t.items()}
    ref = _call(naive, name, ref_in, doc_start=doc_start)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    used = [n for n in names]
    ref_grads = torch.autograd.grad(ref, [ref_in[n] for n in used], grad_out)
    fast_in = {n: x.clone().requires_grad_() for n, x in t.items()}
    chunk = {} if name == "softmax" else {"chunk_size": 5}
    out = _call(fast, name, fast_in, doc_start=doc_start, **chunk)
    fast_grads = torch.autograd.grad(out, [fast_in[n] for n in used], grad_out)
    assert rel_rmse(out, ref) <= 1e-10
    for n, got, want in zip(used, fast_grads, ref_grads):
        assert torch.isfinite(got).all(), n
        assert rel_rmse(got, want) <= 1e-10, n


@pytest.mark.parametrize("name", list(MIXERS))
def test_left_padding_leaves_real_tokens_unchanged(name):
    """Each row is left-padded by a different amount; padding tokens are their own one-token
    documents, so the real tokens see exactly the unpadded sequence."""
    fast = MIXERS[name][0]
    real = 11
    pads = [0, 3, 6]
    t = _tensors(len(pads), real + max(pads), seed=3)
    total = real + max(pads)
    # a row with p pads: tokens [0, p) are one-token documents, tokens [p, total) the real one
    doc_start = torch.stack([torch.cat([torch.arange(p), torch.full((total - p,), p)]) for p in pads])
    chunk = {} if name == "softmax" else {"chunk_size": 4}
    padded = _call(fast, name, t, doc_start=doc_start, **chunk)
    assert torch.isfinite(padded).all()
    for row, p in enumerate(pads):
        row_t = {n: (x[row : row + 1] if n != "transform" else x) for n, x in t.items()}
        alone = _call(fast, name, row_t, sl=slice(p, None), **chunk)
        assert rel_rmse(padded[row : row + 1, p:], alone) <= 1e-10, (name, row)


@pytest.mark.parametrize("name", list(MIXERS))
@pytest.mark.parametrize("prefill", [0, 6])
def test_decode_with_documents_equals_parallel(name, prefill):
    fast, _, step, _, _ = MIXERS[name]
    lengths = [4, 1, 9, 6]
    total = sum(lengths)
    t = _tensors(2, total, seed=4)
    doc_start = torch.stack([_doc_start(lengths), _doc_start([2, 18])])
    chunk = {} if name == "softmax" else {"chunk_size": 4}
    full = _call(fast, name, t, doc_start=doc_start, **chunk)
    outs, state = [], None
    if prefill:
        o, state = _call(fast, name, t, sl=slice(0, prefill), doc_start=doc_start[:, :prefill], return_state=True,
                         **chunk)
        outs.append(o)
    for i in range(prefill, total):
        o, state = _call(step, name, t, sl=slice(i, i + 1), state=state, step=True, doc_start=doc_start[:, i : i + 1])
        outs.append(o)
    assert rel_rmse(torch.cat(outs, dim=1), full) <= 1e-10


def test_random_features_continue_across_calls_with_documents():
    t = _tensors(1, 40, seed=5)
    doc_start = _doc_start([13, 2, 25])[None]
    full = ops.random_feature_attention(t["q"], t["k"], t["v"], PROJECTION, chunk_size=6, doc_start=doc_start)
    for split in (13, 14, 15, 22):
        first, state = ops.random_feature_attention(
            t["q"][:, :split], t["k"][:, :split], t["v"][:, :split], PROJECTION, chunk_size=6,
            doc_start=doc_start[:, :split], return_state=True,
        )
        second = ops.random_feature_attention(
            t["q"][:, split:], t["k"][:, split:], t["v"][:, split:], PROJECTION, chunk_size=5,
            doc_start=doc_start[:, split:], initial_state=state,
        )
        assert rel_rmse(torch.cat([first, second], dim=1), full) <= 1e-10, split


def test_random_feature_shift_restarts_per_document():
    """An enormous key logit in an earlier document must not underflow the next document's keys
    (the running-max shift is per document)."""
    t = _tensors(1, 30, seed=6)
    t["k"][:, 3] = 40.0
    doc_start = _doc_start([10, 20])[None]
    packed = ops.random_feature_attention(t["q"].float(), t["k"].float(), t["v"].float(), PROJECTION.float(),
                                          chunk_size=16, doc_start=doc_start)
    alone = ops.random_feature_attention(t["q"][:, 10:], t["k"][:, 10:], t["v"][:, 10:], PROJECTION, chunk_size=16)
    assert torch.isfinite(packed).all()
    assert rel_rmse(packed[:, 10:], alone) <= 1e-5


def test_gradcheck_blocked_solve_with_documents():
    g = torch.Generator().manual_seed(7)
    q, k, v, r = (torch.randn(1, 8, 2, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(4))
    rho = (0.5 + torch.rand(1, 8, 2, generator=g, dtype=F64)).requires_grad_()
    beta = torch.rand(1, 8, 2, generator=g, dtype=F64).requires_grad_()
    doc_start = _doc_start([3, 1, 4])[None]
    assert torch.autograd.gradcheck(
        lambda *a: ops.cubit_attention(*a[:4], rho=a[4], ridge=0.3, chunk_size=3, doc_start=doc_start),
        (q, k, v, r, rho),
    )
    assert torch.autograd.gradcheck(
        lambda *a: ops.deltaformer_attention(*a[:3], beta=a[3], chunk_size=3, doc_start=doc_start), (q, k, v, beta)
    )


@pytest.mark.parametrize("bad", ["shape", "float", "future", "negative", "sliding-window",
                                 "back-to-an-earlier-document"])
def test_bad_doc_start_is_rejected(bad):
    # a doc_start that is not contiguous documents (a sliding window max(0, i - 2), or a token that
    # returns to an earlier document) was accepted before, and the paths disagreed on it
    t = _tensors(1, 6)
    doc_start = {
        "shape": torch.zeros(6, dtype=torch.long),
        "float": torch.zeros(1, 6),
        "future": torch.tensor([[0, 0, 5, 0, 0, 0]]),
        "negative": torch.tensor([[0, -1, 0, 0, 0, 0]]),
        "sliding-window": torch.tensor([[0, 0, 0, 1, 2, 3]]),
        "back-to-an-earlier-document": torch.tensor([[0, 0, 2, 2, 0, 0]]),
    }[bad]
    for name, (fast, *_rest) in MIXERS.items():
        with pytest.raises(ValueError, match="doc_start"):
            _call(fast, name, t, doc_start=doc_start)


def test_a_checked_doc_start_changed_in_place_is_checked_again():
    """The check remembers the doc_start it passed (every layer of a model gets the same one), but
    only while that tensor is unchanged and used for the same shape and offset."""
    from kernelmix.ops._common import check_doc_start

    doc_start = torch.tensor([[0, 0, 2, 2, 2, 5]])
    check_doc_start(doc_start, 1, 6)
    check_doc_start(doc_start, 1, 6)  # remembered
    with pytest.raises(ValueError, match="must lie in"):
        check_doc_start(doc_start, 1, 6, offset=-3)  # another offset: checked again
    check_doc_start(doc_start, 1, 6)
    doc_start[0, 4] = 0  # back to an earlier document, in place
    with pytest.raises(ValueError, match="contiguous documents"):
        check_doc_start(doc_start, 1, 6)
