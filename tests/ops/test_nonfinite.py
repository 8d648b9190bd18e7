"""The non-finite guard of the ops (``ops/_common.py``, non-finite inputs): the causal reach
against its dense definition, the accelerator form (no sync, masks always built) against the CPU
form, decode steps, and the random-feature state. The reliability suite
(``tests/reliability/test_ops.py``) covers every op's causality under NaN."""

from __future__ import annotations

import pytest
import torch

from kernelmix import ops
from kernelmix.ops import _common
from kernelmix.ops import random_features as rf_module

B, T, H, HKV, D = 2, 23, 4, 2, 8
NAN = float("nan")


def _inputs(seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, T, H, D, generator=g, dtype=dtype),
        "k": torch.randn(B, T, HKV, D, generator=g, dtype=dtype),
        "v": torch.randn(B, T, HKV, D, generator=g, dtype=dtype),
        "r": torch.randn(B, T, H, D, generator=g, dtype=dtype),
        "rho": 0.5 + torch.rand(B, T, H, generator=g, dtype=dtype),
        "beta": torch.rand(B, T, H, generator=g, dtype=dtype),
    }


PROJECTION = ops.orthogonal_random_features(16, D, num_heads=H, generator=torch.Generator().manual_seed(1),
                                            dtype=torch.float64)
DOC_START = torch.tensor([[0] * T, [0] * 9 + [9] * 14])

OPS = {
    "softmax": lambda x: ops.softmax_attention(x["q"], x["k"], x["v"], doc_start=DOC_START),
    "cubit": lambda x: ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], chunk_size=5,
                                           doc_start=DOC_START),
    "cubit_blocked": lambda x: ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], chunk_size=5, solver="blocked"),
    "deltaformer": lambda x: ops.deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], chunk_size=5,
                                                       doc_start=DOC_START),
    "performer": lambda x: ops.random_feature_attention(x["q"], x["k"], x["v"], PROJECTION, chunk_size=5,
                                                        doc_start=DOC_START),
    "masked": lambda x: ops.random_feature_attention_masked(x["q"], x["k"], x["v"], PROJECTION,
                                                            torch.ones(B, T, T, dtype=torch.bool).tril())[0],
    "softmax_masked": lambda x: ops.softmax_attention_masked(x["q"], x["k"], x["v"],
                                                             torch.ones(1, T, T, dtype=torch.bool).triu())[0],
}


def test_reach_matches_its_dense_definition():
    g = torch.Generator().manual_seed(0)
    bad = torch.rand(B, T, H, generator=g) < 0.05
    for doc_start in (None, DOC_START):
        got = _common.reaches_causal(bad, doc_start)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        seen = (j <= i)[None] if doc_start is None else (j <= i) & (j >= doc_start[:, :, None])  # [B or 1, T, T]
        want = (seen[..., None] & bad[:, None, :, :]).any(2)
        assert torch.equal(got, want)
    # with an offset (a continued state): doc_start is absolute
    assert torch.equal(_common.reaches_causal(bad, DOC_START + 5, offset=5), _common.reaches_causal(bad, DOC_START))


@pytest.mark.parametrize("name", list(OPS))
def test_accelerator_form_equals_the_cpu_form(name, monkeypatch):
    """Off the CPU the guard never syncs: the masks are always built and applied. For finite inputs
    that must change nothing, forward or backward; for a NaN it must spoil the same rows."""
    fn = OPS[name]

    def run(x):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        out = fn(leaves)
        grads = torch.autograd.grad(out.nan_to_num().sum(), list(leaves.values()), allow_unused=True)
        return out, grads

    x = _inputs()
    spoilt = {n: t.clone() for n, t in x.items()}
    spoilt["v"][1, 11, 1, 0] = NAN
    cpu = [run(x), fn(spoilt)]
    monkeypatch.setattr(_common, "scan_syncs", lambda device: False)
    monkeypatch.setattr(rf_module, "scan_syncs", lambda device: False)
    accelerator = [run(x), fn(spoilt)]
    assert torch.equal(cpu[0][0], accelerator[0][0])
    for a, b in zip(cpu[0][1], accelerator[0][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(cpu[1].isnan(), accelerator[1].isnan()) and cpu[1].isnan().any()
    assert torch.equal(cpu[1].nan_to_num(), accelerator[1].nan_to_num())


STEPS = {
    "softmax": lambda x, s, t: ops.softmax_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1],
                                                          s),
    "cubit": lambda x, s, t: ops.cubit_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1],
                                                      x["r"][:, t:t + 1], s, rho=x["rho"][:, t:t + 1]),
    "deltaformer": lambda x, s, t: ops.deltaformer_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1],
                                                                  x["v"][:, t:t + 1], s, beta=x["beta"][:, t:t + 1]),
    "performer": lambda x, s, t: ops.random_feature_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1],
                                                                   x["v"][:, t:t + 1], PROJECTION, s),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_decode_steps_are_causal_under_nan(name):
    """Token by token the row of token i is computed before token t > i exists; what matters is that
    rows ≥ t come out non-finite (a random-feature row was 0) and rows < t are untouched."""
    x = _inputs()
    state, clean = None, []
    for t in range(T):
        out, state = STEPS[name](x, state, t)
        clean.append(out)
    for which in ("q", "k", "v"):
        spoilt = {n: a.clone() for n, a in x.items()}
        spoilt[which][0, 7, 0, 0] = NAN
        state, rows = None, []
        for t in range(T):
            out, state = STEPS[name](spoilt, state, t)
            rows.append(out)
        for t in range(T):
            if t < 7:
                assert torch.equal(rows[t], clean[t])
            elif which == "q" and t > 7:
                assert torch.isfinite(rows[t][0]).all()
            else:  # a bad query spoils its own head; a bad key or value every head of its group
                heads = slice(0, 1) if which == "q" else slice(0, H // HKV)
                assert not torch.isfinite(rows[t][0, 0, heads]).all(-1).any(), (which, t)  # no spoilt row finite
            assert torch.equal(rows[t][1], clean[t][1])


def test_random_feature_state_carries_nan_only_within_its_document():
    x = _inputs()
    q, k, v = x["q"], x["k"], x["v"]
    v_nan = v.clone()
    v_nan[1, 3, 0, 0] = NAN  # batch row 1, document [0, 9)
    _, state = ops.random_feature_attention(q, k, v_nan, PROJECTION, doc_start=DOC_START, chunk_size=5,
                                            return_state=True)
    assert torch.isfinite(state.S).all()  # the last document [9, 23) never saw it
    _, state = ops.random_feature_attention(q[:, :8], k[:, :8], v_nan[:, :8], PROJECTION, return_state=True)
    assert (torch.isnan(state.S[1, :2]).all() and torch.isfinite(state.S[0]).all()
            and torch.isfinite(state.S[1, 2:]).all())
    # continuing that state: the rows of its document are NaN, a new document's rows are clean
    doc = DOC_START[:, 8:]
    out = ops.random_feature_attention(q[:, 8:], k[:, 8:], v[:, 8:], PROJECTION, initial_state=state, doc_start=doc,
                                       chunk_size=5)
    whole = ops.random_feature_attention(q, k, v_nan, PROJECTION, doc_start=DOC_START, chunk_size=5)[:, 8:]
    assert torch.equal(out.isnan(), whole.isnan())
    assert torch.isnan(out[1, 0, :2]).all() and torch.isfinite(out[1, 1:]).all()
    assert torch.allclose(out.nan_to_num(), whole.nan_to_num(), rtol=1e-12, atol=1e-13)


def test_a_documents_shift_depends_on_that_document_only():
    """The segmented running max is exact: changing another document's keys changes no bit."""
    g = torch.Generator().manual_seed(0)
    key_max = torch.randn(B, H, T, generator=g)
    other = key_max.clone()
    other[:, :, :9] *= 1e6
    got, changed = rf_module._running_shift(key_max, DOC_START), rf_module._running_shift(other, DOC_START)
    assert torch.equal(got[1, :, 9:], changed[1, :, 9:])
    for b in range(B):
        for i in range(T):
            assert got[b, :, i].equal(key_max[b, :, int(DOC_START[b, i]) : i + 1].amax(-1))


PARALLEL = {  # the parallel op with doc_start: (call on tokens sl, the inputs it reads that are per token)
    "softmax": (lambda x, sl, **kw: ops.softmax_attention(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], **kw),
                ("k", "v")),
    "cubit": (lambda x, sl, **kw: ops.cubit_attention(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["r"][:, sl],
                                                      rho=x["rho"][:, sl], chunk_size=5, **kw), ("k", "v", "r", "rho")),
    "deltaformer": (lambda x, sl, **kw: ops.deltaformer_attention(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl],
                                                                  beta=x["beta"][:, sl], chunk_size=5, **kw),
                    ("k", "v", "beta")),
}
DOC_STEP = {  # one decode token t with its doc_start
    "softmax": lambda x, s, t: ops.softmax_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1], s,
                                                          doc_start=DOC_START[:, t:t + 1]),
    "cubit": lambda x, s, t: ops.cubit_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1],
                                                      x["r"][:, t:t + 1], s, rho=x["rho"][:, t:t + 1],
                                                      doc_start=DOC_START[:, t:t + 1]),
    "deltaformer": lambda x, s, t: ops.deltaformer_attention_step(x["q"][:, t:t + 1], x["k"][:, t:t + 1],
                                                                  x["v"][:, t:t + 1], s, beta=x["beta"][:, t:t + 1],
                                                                  doc_start=DOC_START[:, t:t + 1]),
}


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "no-sync"])
@pytest.mark.parametrize("name", list(DOC_STEP))
def test_decode_keeps_a_cached_nan_in_its_document(name, accelerator, monkeypatch):
    """A NaN or inf cached in an earlier document is hidden from a later document's rows: decode
    must give what the parallel op with doc_start gives — the rows that see it NaN, every other row
    exact — decoded from scratch and continued from a prefill state (issue 26). A hidden row used to
    get weight 0 and 0 · NaN = NaN."""
    if accelerator:  # the accelerator form: no sync, the masks always built
        monkeypatch.setattr(_common, "scan_syncs", lambda device: False)
    parallel, names = PARALLEL[name]
    for which in names:
        for value in (NAN, float("inf")):
            x = _inputs()
            x[which][1, 3, 0] = value  # batch row 1, token 3: document [0, 9); the next starts at 9
            want = parallel(x, slice(None), doc_start=DOC_START)
            assert torch.isnan(want[1, 3:9]).any() and torch.isfinite(want[1, 9:]).all()
            for prefill in (0, 6, 12):
                state, rows = None, []
                if prefill:
                    out, state = parallel(x, slice(0, prefill), doc_start=DOC_START[:, :prefill], return_state=True)
                    rows.append(out)
                for t in range(prefill, T):
                    out, state = DOC_STEP[name](x, state, t)
                    rows.append(out)
                got = torch.cat(rows, dim=1)
                assert torch.equal(got.isnan(), want.isnan()), (which, value, prefill)
                assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-10, atol=1e-12), (
                    which, value, prefill)
