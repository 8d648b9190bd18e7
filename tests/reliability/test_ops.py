"""Reliability of the ops (issue 13, the ops' part): one class per failure case a user reported.

Non-finite inputs must neither reach rows that cannot see them nor come out as zeros; the
random-feature estimator's underflow must be reported; empty sequences, non-tensor arguments and
bad decode states must give an empty output or a clear KernelmixError; the dense feature map and
the masked softmax must run with autocast off. The references are the same op on a clean input
(the rows that cannot see a bad token must be bitwise what it gives) and float64 computations
written out here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kernelmix import ops
from kernelmix.errors import KernelmixError
from kernelmix.layers import build_mixer
from kernelmix.ops import random_features as rf_module

B, T, H, HKV, D, M = 2, 37, 4, 2, 8, 16
CHUNK = 8  # does not divide T = 37 (odd)
# (position, value): the first token, inside a chunk, a chunk boundary, the last token
BAD_TOKENS = ((0, float("nan")), (5, float("inf")), (16, float("nan")), (36, float("-inf")))
DOC_SPLIT = 21  # batch row 1 packs two documents, [0, 21) and [21, 37); row 0 is one document
NAN_ROW = 1  # the batch row that receives the bad entry (row 0 must not notice)


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(B, T, H, D, generator=g),
        "k": torch.randn(B, T, HKV, D, generator=g),
        "v": torch.randn(B, T, HKV, D, generator=g),
        "r": torch.randn(B, T, H, D, generator=g),
        "w": torch.randn(B, T, H, D, generator=g),
        "rho": 0.5 + 1.5 * torch.rand(B, T, H, generator=g),
        "beta": torch.rand(B, T, H, generator=g),
    }


PROJECTION = ops.orthogonal_random_features(M, D, num_heads=H, generator=torch.Generator().manual_seed(1))
TRANSFORM = torch.eye(D) + 0.2 * torch.randn(H, D, D, generator=torch.Generator().manual_seed(2))


def _doc_start() -> torch.Tensor:
    idx = torch.arange(T)
    return torch.stack([torch.zeros(T, dtype=torch.long), torch.where(idx < DOC_SPLIT, 0, DOC_SPLIT)])


def _mask(doc_start: torch.Tensor) -> torch.Tensor:
    """The causal document mask [B, T, T] of ``doc_start`` (True: visible), for the masked ops."""
    idx = torch.arange(doc_start.shape[1])
    return (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] >= doc_start[:, :, None])


# name → (fn(x, doc_start) → [B, T, H, D], the per-token inputs it reads besides q)
OPS = {
    "softmax": (lambda x, d: ops.softmax_attention(x["q"], x["k"], x["v"], doc_start=d), "kv"),
    "softmax_naive": (lambda x, d: ops.softmax_attention_naive(x["q"], x["k"], x["v"], doc_start=d), "kv"),
    "softmax_masked": (lambda x, d: ops.softmax_attention_masked(x["q"], x["k"], x["v"], _mask(d))[0], "kv"),
    "cubit_blocked": (lambda x, d: ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], chunk_size=CHUNK,
                                                       doc_start=d, solver="blocked"), ("k", "v", "r", "rho")),
    "cubit_rectangles": (lambda x, d: ops.cubit_attention(x["q"], x["k"], x["v"], x["r"], rho=x["rho"],
                                                          chunk_size=CHUNK, doc_start=d, solver="rectangles"),
                         ("k", "v", "r", "rho")),
    "cubit_naive": (lambda x, d: ops.cubit_attention_naive(x["q"], x["k"], x["v"], x["r"], rho=x["rho"], doc_start=d),
                    ("k", "v", "r", "rho")),
    "deltaformer_blocked": (lambda x, d: ops.deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], w=x["w"],
                                                                   chunk_size=CHUNK, doc_start=d, solver="blocked"),
                            ("k", "v", "beta", "w")),
    "deltaformer_rectangles": (lambda x, d: ops.deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"],
                                                                      chunk_size=CHUNK, doc_start=d,
                                                                      solver="rectangles"),
                               ("k", "v", "beta")),
    "deltaformer_naive": (lambda x, d: ops.deltaformer_attention_naive(x["q"], x["k"], x["v"], beta=x["beta"], w=x["w"],
                                                                       doc_start=d), ("k", "v", "beta", "w")),
    "performer": (lambda x, d: ops.random_feature_attention(x["q"], x["k"], x["v"], PROJECTION, chunk_size=CHUNK,
                                                            doc_start=d), "kv"),
    "darkformer": (lambda x, d: ops.random_feature_attention(x["q"], x["k"], x["v"], PROJECTION, transform=TRANSFORM,
                                                             chunk_size=CHUNK, doc_start=d), "kv"),
    "performer_naive": (lambda x, d: ops.random_feature_attention_naive(x["q"], x["k"], x["v"], PROJECTION,
                                                                        doc_start=d), "kv"),
    "darkformer_masked": (lambda x, d: ops.random_feature_attention_masked(x["q"], x["k"], x["v"], PROJECTION, _mask(d),
                                                                           transform=TRANSFORM)[0], "kv"),
}


def _spoil(x: dict, name: str, t: int, value: float) -> dict:
    """A copy of the inputs with ``value`` in one entry of token t (batch row NAN_ROW, head 0)."""
    y = {n: a.clone() for n, a in x.items()}
    if y[name].dim() == 4:
        y[name][NAN_ROW, t, 0, 1] = value
    else:
        y[name][NAN_ROW, t, 0] = value
    return y


def _reached(name: str, t: int) -> torch.Tensor:
    """[B, T, H]: the rows (tokens × query heads) that see the bad entry of :func:`_spoil`: the token
    itself and the later tokens of its document; for k and v every query head of key head 0's
    group, else head 0. A bad query reaches its own row only."""
    reached = torch.zeros(B, T, H, dtype=torch.bool)
    heads = slice(0, H // HKV) if name in ("k", "v") else slice(0, 1)
    end = t + 1 if name == "q" else (DOC_SPLIT if t < DOC_SPLIT else T)
    reached[NAN_ROW, t:end, heads] = True
    return reached


def _assert_only_reached_rows_spoilt(out: torch.Tensor, clean: torch.Tensor, reached: torch.Tensor, what: str):
    assert torch.equal(out[~reached], clean[~reached]), f"{what}: a row that cannot see the bad entry changed"
    assert not torch.isfinite(out[reached]).any(), f"{what}: a row that sees the bad entry came out finite"


class TestNonFiniteInputsStayCausal:
    """Issue 13.5: a NaN key at position 100 made rows 64–99 (before it) and 100–255 exactly zero.
    For every op, every input and bad positions at the start, inside a chunk, at a chunk boundary
    and at the end (chunks that do not divide an odd T, packed documents): the rows that cannot see
    the bad entry are bitwise those of the clean input, the rows that see it are non-finite."""

    @pytest.mark.parametrize("op", list(OPS))
    def test_rows_before_a_bad_token_are_exact_and_rows_after_it_non_finite(self, op):
        fn, names = OPS[op]
        x, doc_start = _inputs(), _doc_start()
        clean = fn(x, doc_start)
        assert torch.isfinite(clean).all()
        for name in ("q", *names):
            for t, value in BAD_TOKENS:
                out = fn(_spoil(x, name, t, value), doc_start)
                _assert_only_reached_rows_spoilt(out, clean, _reached(name, t), f"{op}: {name}[{t}] = {value}")

    @pytest.mark.parametrize("mixer", ["softmax", "cubit", "deltaformer", "performer", "darkformer"])
    def test_layers(self, mixer):
        """The layers add only per-token projections and RoPE: a bad hidden state at token t spoils
        rows ≥ t of its document (every head, through o_proj) and nothing else."""
        torch.manual_seed(0)
        options = {"num_features": M} if mixer in ("performer", "darkformer") else {}
        layer = build_mixer(mixer, hidden_size=32, num_heads=H, num_kv_heads=HKV, chunk_size=CHUNK, **options)
        hidden = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(3))
        doc_start = _doc_start()
        with torch.no_grad():
            clean, _ = layer(hidden, doc_start=doc_start)
            for t, value in BAD_TOKENS:
                spoilt = hidden.clone()
                spoilt[NAN_ROW, t, 0] = value
                out, _ = layer(spoilt, doc_start=doc_start)
                reached = torch.zeros(B, T, dtype=torch.bool)
                reached[NAN_ROW, t:DOC_SPLIT if t < DOC_SPLIT else T] = True
                _assert_only_reached_rows_spoilt(out, clean, reached, f"{mixer}: hidden[{t}] = {value}")

    def test_cubit_solve(self):
        x, doc_start = _inputs(), _doc_start()
        clean, _ = ops.cubit_solve(x["r"], x["v"], rho=x["rho"], chunk_size=CHUNK, doc_start=doc_start)
        for name in ("r", "v", "rho"):
            for t, value in BAD_TOKENS:
                y = _spoil(x, name, t, value)
                u, _ = ops.cubit_solve(y["r"], y["v"], rho=y["rho"], chunk_size=CHUNK, doc_start=doc_start)
                _assert_only_reached_rows_spoilt(u, clean, _reached(name, t), f"cubit_solve: {name}[{t}]")


class TestRandomFeatureAttentionNeverHidesNaN:
    """The report itself: T = 256, a NaN key at position 100, chunks of 64. Rows 64–99 were exactly
    zero (they come before the NaN) and so were rows 100–255 (SDPA gives NaN there)."""

    def _case(self):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 256, 2, 16, generator=g) for _ in range(3))
        projection = ops.orthogonal_random_features(32, 16, generator=g)
        return q, k, v, projection

    def test_nan_key_at_100(self):
        q, k, v, projection = self._case()
        k_nan = k.clone()
        k_nan[0, 100, 0, 0] = float("nan")
        forms = {
            "chunked": lambda key: ops.random_feature_attention(q, key, v, projection, chunk_size=64),
            "reference": lambda key: ops.random_feature_attention_naive(q, key, v, projection),
        }
        for form, fn in forms.items():
            clean, out = fn(k), fn(k_nan)
            assert torch.equal(out[:, :100], clean[:, :100]), f"{form}: rows 0-99 come before the NaN"
            assert torch.isnan(out[:, 100:, 0]).all(), f"{form}: rows from the NaN on must be NaN, not zero"
            assert torch.equal(out[:, :, 1], clean[:, :, 1]), f"{form}: the other head never sees the NaN"

    def test_nan_query_gives_a_nan_row_in_every_form(self):
        q, k, v, projection = self._case()
        q_nan = q.clone()
        q_nan[0, 100, 0, 0] = float("nan")
        fast = ops.random_feature_attention(q_nan, k, v, projection, chunk_size=64)
        naive = ops.random_feature_attention_naive(q_nan, k, v, projection)
        mask = torch.ones(1, 256, 256, dtype=torch.bool).tril()
        masked, _ = ops.random_feature_attention_masked(q_nan, k, v, projection, mask)
        _, state = ops.random_feature_attention(q[:, :100], k[:, :100], v[:, :100], projection, return_state=True)
        step, _ = ops.random_feature_attention_step(q_nan[:, 100:101], k[:, 100:101], v[:, 100:101], projection, state)
        for out in (fast[:, 100], naive[:, 100], masked[:, 100], step[:, 0]):
            assert torch.isnan(out[:, 0]).all() and torch.isfinite(out[:, 1]).all()

    def test_a_nan_state_does_not_reach_the_next_document(self):
        """Decoding into a new document restarts the state: a NaN state of the previous one must
        be dropped, not multiplied by 0 (0 · NaN = NaN)."""
        q, k, v, projection = self._case()
        v_nan = v.clone()
        v_nan[0, 3, :, 0] = float("nan")
        _, state = ops.random_feature_attention(q[:, :10], k[:, :10], v_nan[:, :10], projection, return_state=True)
        assert torch.isnan(state.S).any()
        new_doc = torch.tensor([[10]])
        step, _ = ops.random_feature_attention_step(q[:, 10:11], k[:, 10:11], v[:, 10:11], projection, state,
                                                    doc_start=new_doc)
        fresh, _ = ops.random_feature_attention_step(q[:, 10:11], k[:, 10:11], v[:, 10:11], projection, None)
        assert torch.equal(step, fresh)
        doc = torch.full((1, 6), 10)
        chunked = ops.random_feature_attention(q[:, 10:16], k[:, 10:16], v[:, 10:16], projection, initial_state=state,
                                               doc_start=doc)
        alone = ops.random_feature_attention(q[:, 10:16], k[:, 10:16], v[:, 10:16], projection)
        assert torch.allclose(chunked, alone, rtol=1e-6, atol=1e-7)


def _scaled_case(length: int = 1024):
    """q and k ×30 (the report): most of Performer's rows miss every key."""
    g = torch.Generator().manual_seed(0)
    q, k = (30 * torch.randn(1, length, 1, 16, generator=g) for _ in range(2))
    v = torch.randn(1, length, 1, 16, generator=g)
    return q, k, v, ops.orthogonal_random_features(16, 16, generator=g)


class TestUnderflowIsReported:
    """Issue 13.6: with q, k ×30, 75–82 % of Performer/DARKFormer rows were exactly zero, silently."""

    @pytest.fixture(autouse=True)
    def fresh_check(self, monkeypatch):
        check = rf_module.UnderflowCheck(every=3)
        monkeypatch.setattr(rf_module, "UNDERFLOW_CHECK", check)
        return check

    def test_warns_once_with_the_fraction_and_what_helps(self, fresh_check):
        q, k, v, projection = _scaled_case()
        with pytest.warns(RuntimeWarning) as record:
            out = ops.random_feature_attention(q, k, v, projection)
        zero = (out == 0).all(-1).float().mean().item()
        assert zero > 0.3
        message = str(record[0].message)
        assert f"{zero:.1%}" in message and "underflow" in message
        for hint in ("num_features", "temperature", "DARKFormer", "float64"):
            assert hint in message, hint
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process: no second warning
            for _ in range(4):
                ops.random_feature_attention(q, k, v, projection)

    def test_checked_on_the_first_call_and_every_nth(self, fresh_check):
        q, k, v, projection = _scaled_case(256)
        plain = [x / 30 for x in (q, k)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.random_feature_attention(*plain, v, projection)  # checked: nothing empty
            ops.random_feature_attention(q, k, v, projection)  # not checked (calls 2 and 3)
            ops.random_feature_attention(q, k, v, projection)
        with pytest.warns(RuntimeWarning, match="came out exactly 0"):
            ops.random_feature_attention(q, k, v, projection)  # call 4: checked

    @pytest.mark.parametrize("form", ["masked", "step", "layer"])
    def test_every_form_reports(self, form):
        q, k, v, projection = _scaled_case(512)
        with pytest.warns(RuntimeWarning, match="exactly 0"):
            if form == "masked":
                ops.random_feature_attention_masked(q, k, v, projection,
                                                    torch.ones(1, 512, 512, dtype=torch.bool).tril())
            elif form == "step":
                _, state = ops.random_feature_attention(q[:, :-1], k[:, :-1], v[:, :-1], projection, return_state=True)
                ops.random_feature_attention_step(q[:, -1:], k[:, -1:], v[:, -1:], projection, state)
            else:
                layer = build_mixer("darkformer", hidden_size=16, num_heads=1, num_features=16)
                with torch.no_grad():
                    layer.q_proj.weight.mul_(60)
                    layer.k_proj.weight.mul_(60)
                    layer(torch.randn(1, 512, 16, generator=torch.Generator().manual_seed(0)))


class TestEmptySequences:
    """Issue 13.10: random_feature_attention with T = 0 raised 'stack expects a non-empty
    TensorList' where softmax and Cubit return an empty tensor."""

    def test_every_op_returns_an_empty_output(self):
        x = {n: a[:, :0] for n, a in _inputs().items()}
        doc_start = torch.zeros(B, 0, dtype=torch.long)
        for op, (fn, _) in OPS.items():
            for d in (doc_start,) if "masked" in op else (None, doc_start):
                out = fn(x, d)
                assert out.shape == (B, 0, H, D) and out.dtype == torch.float32, op

    def test_gradients_flow_through_an_empty_output(self):
        for op, (fn, _) in OPS.items():
            x = {n: a[:, :0].clone().requires_grad_() for n, a in _inputs().items()}
            fn(x, torch.zeros(B, 0, dtype=torch.long)).sum().backward()  # no error, no gradient
            assert x["v"].grad is None or x["v"].grad.shape == (B, 0, HKV, D), op

    def test_random_feature_attention_keeps_the_state(self):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 5, 2, D, generator=g) for _ in range(3))
        _, state = ops.random_feature_attention(q, k, v, PROJECTION[:2], return_state=True)
        out, same = ops.random_feature_attention(q[:, :0], k[:, :0], v[:, :0], PROJECTION[:2], initial_state=state,
                                                 return_state=True)
        assert out.shape == (1, 0, 2, D) and same.length == 5
        assert torch.equal(same.S, state.S) and torch.equal(same.z, state.z) and torch.equal(same.shift, state.shift)
        out, empty = ops.random_feature_attention(q[:, :0], k[:, :0], v[:, :0], PROJECTION[:2], return_state=True)
        step_a, _ = ops.random_feature_attention_step(q[:, :1], k[:, :1], v[:, :1], PROJECTION[:2], empty)
        step_b, _ = ops.random_feature_attention_step(q[:, :1], k[:, :1], v[:, :1], PROJECTION[:2], None)
        assert torch.equal(step_a, step_b)

    def test_masked_ops_with_no_keys(self):
        x = _inputs()
        no_keys = torch.zeros(B, T, 0, dtype=torch.bool)
        for out, weights in (ops.softmax_attention_masked(x["q"], x["k"][:, :0], x["v"][:, :0], no_keys),
                             ops.random_feature_attention_masked(x["q"], x["k"][:, :0], x["v"][:, :0], PROJECTION,
                                                                 no_keys)):
            assert out.shape == (B, T, H, D) and (out == 0).all() and weights.shape == (B, H, T, 0)


class TestNonTensorArguments:
    """Issue 13.10: a list passed to deltaformer_attention / random_feature_attention must be a
    KernelmixError that names the argument and says to pass a torch.Tensor."""

    def test_every_public_op(self):
        x = _inputs()
        q, k, v, r = x["q"], x["k"], x["v"], x["r"]
        mask = torch.ones(B, T, T, dtype=torch.bool)
        listed = [[0.0] * D]
        calls = {
            "q": [lambda a: ops.softmax_attention(a, k, v), lambda a: ops.cubit_attention(a, k, v, r),
                  lambda a: ops.deltaformer_attention(a, k, v),
                  lambda a: ops.random_feature_attention(a, k, v, PROJECTION),
                  lambda a: ops.softmax_attention_masked(a, k, v, mask), lambda a: ops.softmax_attention_naive(a, k, v),
                  lambda a: ops.random_feature_attention_masked(a, k, v, PROJECTION, mask),
                  lambda a: ops.cubit_attention_naive(a, k, v, r), lambda a: ops.deltaformer_attention_naive(a, k, v),
                  lambda a: ops.random_feature_attention_naive(a, k, v, PROJECTION),
                  lambda a: ops.softmax_attention_step(a, k[:, :1], v[:, :1], None),
                  lambda a: ops.cubit_attention_step(a, k[:, :1], v[:, :1], r[:, :1], None),
                  lambda a: ops.deltaformer_attention_step(a, k[:, :1], v[:, :1], None),
                  lambda a: ops.random_feature_attention_step(a, k[:, :1], v[:, :1], PROJECTION, None)],
            "k": [lambda a: ops.random_feature_attention(q, a, v, PROJECTION),
                  lambda a: ops.deltaformer_attention(q, a, v)],
            "v": [lambda a: ops.softmax_attention(q, k, a), lambda a: ops.cubit_solve(r, a)],
            "r": [lambda a: ops.cubit_attention(q, k, v, a), lambda a: ops.cubit_solve(a, v)],
            "rho": [lambda a: ops.cubit_attention(q, k, v, r, rho=a)],
            "beta": [lambda a: ops.deltaformer_attention(q, k, v, beta=a)],
            "w": [lambda a: ops.deltaformer_attention(q, k, v, w=a)],
            "projection": [lambda a: ops.random_feature_attention(q, k, v, a),
                           lambda a: ops.positive_random_features(q, a)],
            "transform": [lambda a: ops.random_feature_attention(q, k, v, PROJECTION, transform=a)],
            "mask": [lambda a: ops.softmax_attention_masked(q, k, v, a)],
            "x": [lambda a: ops.positive_random_features(a, PROJECTION), lambda a: ops.expand_heads(a, 4)],
            "q_samples": [lambda a: ops.data_aware_transform(a, k.flatten(0, 1))],
        }
        for name, fns in calls.items():
            for fn in fns:
                with pytest.raises(KernelmixError,
                                   match=rf"{name} must be a torch\.Tensor.*got list; pass a torch\.Tensor"):
                    fn(listed)


class TestDecodeStatesAreChecked:
    """Issue 13.10: cubit_attention_step (and DeltaFormer's, random features') with a state of the
    wrong heads, type or shape gave an AttributeError or a torch size error from inside."""

    def _steps(self):
        x = _inputs()
        one = {n: a[:, :1] for n, a in x.items()}
        four = {n: torch.cat([a, a], dim=2)[:, :3] for n, a in x.items() if n in ("q", "k", "v", "r")}  # 8 / 4 heads
        projection = ops.orthogonal_random_features(M, D, generator=torch.Generator().manual_seed(0))
        return {
            "softmax_attention_step": (lambda s: ops.softmax_attention_step(one["q"], one["k"], one["v"], s),
                                       ops.softmax_attention(four["q"], four["k"], four["v"], return_state=True)[1],
                                       "SoftmaxState"),
            "cubit_attention_step": (lambda s: ops.cubit_attention_step(one["q"], one["k"], one["v"], one["r"], s),
                                     ops.cubit_attention(four["q"], four["k"], four["v"], four["r"],
                                                         return_state=True)[1],
                                     "CubitState"),
            "deltaformer_attention_step": (lambda s: ops.deltaformer_attention_step(one["q"], one["k"], one["v"], s),
                                           ops.deltaformer_attention(four["q"], four["k"], four["v"],
                                                                     return_state=True)[1],
                                           "DeltaFormerState"),
            "random_feature_attention_step": (
                lambda s: ops.random_feature_attention_step(one["q"], one["k"], one["v"], projection, s),
                ops.random_feature_attention(four["q"], four["k"], four["v"], projection, return_state=True)[1],
                "RandomFeatureState"),
        }

    def test_wrong_type(self):
        for op, (step, _, cls) in self._steps().items():
            for bad in ("cache", (1, 2), {"k": 1}):
                with pytest.raises(KernelmixError,
                                   match=rf"{op}: state must be a {cls} .*or None.*got {type(bad).__name__}"):
                    step(bad)

    def test_wrong_heads(self):
        for op, (step, other_layer_state, _) in self._steps().items():
            with pytest.raises(KernelmixError,
                               match=rf"{op}: the state does not fit: state\.\w+ has shape .*expected \[B, "):
                step(other_layer_state)

    def test_wrong_shape_of_one_field(self):
        steps = self._steps()
        _, state = ops.cubit_attention(*(_inputs()[n][:, :3] for n in ("q", "k", "v", "r")), return_state=True)
        state.u = state.u[..., :3]
        with pytest.raises(KernelmixError,
                           match=r"state\.u has shape \(2, 3, 4, 3\), expected \[B, t, H, d_v\] = \(2, t, 4, 8\)"):
            steps["cubit_attention_step"][0](state)
        state.u = torch.zeros(2, 2, 4, 8)  # 2 cached u for 3 cached keys
        with pytest.raises(KernelmixError, match="cached lengths differ"):
            steps["cubit_attention_step"][0](state)


class TestAutocastIsOff:
    """positive_random_features and softmax_attention_masked ran their products in bf16 under
    bf16 autocast, unlike every other op (the precision policy of ops/_common.py)."""

    def test_positive_random_features(self):
        x = torch.randn(2, 9, 2, 16, generator=torch.Generator().manual_seed(0))
        projection = ops.gaussian_random_features(8, 16, generator=torch.Generator().manual_seed(1))
        plain = ops.positive_random_features(x, projection)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = ops.positive_random_features(x, projection)
        assert mixed.dtype == torch.float32 and torch.equal(mixed, plain)
        reference = torch.exp(
            (x.double() / 2) @ projection.double().T - (x.double() / 2).pow(2).sum(-1, keepdim=True) / 2)
        assert torch.allclose(plain.double(), reference / 8**0.5, rtol=1e-5, atol=0)  # x̃ = x / 16^{1/4}

    def test_softmax_attention_masked(self):
        x = _inputs()
        mask = _mask(_doc_start())
        plain_out, plain_weights = ops.softmax_attention_masked(x["q"], x["k"], x["v"], mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, weights = ops.softmax_attention_masked(x["q"], x["k"], x["v"], mask)
        assert out.dtype == weights.dtype == torch.float32
        assert torch.equal(out, plain_out) and torch.equal(weights, plain_weights)


class TestCalibrationRefusesNonFinite:
    """DARKFormer's data-aware transform from samples holding a NaN gave a NaN (or failing) eigh
    instead of saying which samples are bad and what to do."""

    def test_data_aware_transform_and_whiten(self):
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(50, H, D, generator=g), torch.randn(50, HKV, D, generator=g)
        q[7, 1, 2] = float("nan")
        q[9, 0, 0] = float("inf")
        with pytest.raises(KernelmixError,
                           match=r"q_samples holds NaN or ±inf in 2 of 50 samples \(the first at sample 7\).*float32"):
            ops.data_aware_transform(q, k)
        layer = build_mixer("darkformer", hidden_size=32, num_heads=H, num_kv_heads=HKV, num_features=M)
        with pytest.raises(KernelmixError, match="q_samples holds NaN"):
            layer.whiten_(q, k)


class TestMixedDtypesNamed:
    """Issue 25: a float16 q with float32 k/v reached SDPA's own error ("Expected query, key, and
    value to have the same dtype ... c10::Half"). The ops that need one dtype now say so in our words."""

    @pytest.mark.parametrize("op", ["softmax", "cubit", "deltaformer"])
    def test_refused_naming_the_dtypes_and_the_fix(self, op):
        q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
        k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
        call = {"softmax": lambda: ops.softmax_attention(q, k, v),
                "cubit": lambda: ops.cubit_attention(q, k, v, torch.randn(1, 4, 2, 8)),
                "deltaformer": lambda: ops.deltaformer_attention(q, k, v)}[op]
        with pytest.raises(KernelmixError, match=r"dtypes differ: q float16, k float32, v float32; give q, k, v one "
                                                 r"dtype, e.g. k.to\(q.dtype\) and v.to\(q.dtype\)"):
            call()

    def test_the_masked_form_too(self):
        q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
        k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
        mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
        with pytest.raises(KernelmixError, match="dtypes differ: q bfloat16"):
            ops.softmax_attention_masked(q, k, v, mask)


def _factor_calls(rho=None, beta=None) -> dict:
    """Every op that takes ρ (Cubit) or β (DeltaFormer): the fast path, the solve alone, the
    reference and the decode step, each a zero-argument call."""
    g = torch.Generator().manual_seed(4)
    q, k, v, r = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(4))
    last = slice(4, 5)
    if rho is not None:
        return {
            "cubit_attention": lambda: ops.cubit_attention(q, k, v, r, rho=rho, chunk_size=2),
            "cubit_solve": lambda: ops.cubit_solve(r, v, rho=rho, chunk_size=2),
            "cubit_attention_naive": lambda: ops.cubit_attention_naive(q, k, v, r, rho=rho),
            "cubit_attention_step": lambda: ops.cubit_attention_step(q[:, last], k[:, last], v[:, last], r[:, last],
                                                                     None, rho=rho[:, last]),
        }
    return {
        "deltaformer_attention": lambda: ops.deltaformer_attention(q, k, v, beta=beta, chunk_size=2),
        "deltaformer_attention_naive": lambda: ops.deltaformer_attention_naive(q, k, v, beta=beta),
        "deltaformer_attention_step": lambda: ops.deltaformer_attention_step(q[:, last], k[:, last], v[:, last], None,
                                                                             beta=beta[:, last]),
    }


class TestRhoOutsideItsRangeRefused:
    """Issue 25: ρ outside (0, ∞) was taken as it came — ``rho=0`` gave an all-zero output, a negative
    ρ flipped the values' sign. Every op that takes ρ refuses it on the CPU, naming the value, where it
    is, the range and the fix; in range (and non-finite: the NaN guard's business) it runs as before."""

    @pytest.mark.parametrize("value", [0.0, -0.5])
    @pytest.mark.parametrize("op", list(_factor_calls(rho=torch.ones(1, 5, 2))))
    def test_refused_naming_value_range_and_fix(self, op, value):
        rho = torch.ones(1, 5, 2)
        rho[0, 4, 1] = value
        with pytest.raises(KernelmixError, match=rf"rho must lie in \(0, ∞\) for every token and head, got "
                                                 rf"{value:g} at \[b, t, h\] = \[0, (4|0), 1\].*rho = lo \+ \(hi - "
                                                 r"lo\) \* torch.sigmoid\(x\).*rho=None"):
            _factor_calls(rho=rho)[op]()

    def test_in_range_and_non_finite_still_run(self):
        rho = torch.full((1, 5, 2), 1e-3)
        rho[0, 2, 0] = 50.0
        for call in _factor_calls(rho=rho).values():
            call()
        rho[0, 1, 0] = float("-inf")  # non-finite: the rows that see it come out NaN, as for any input
        out = _factor_calls(rho=rho)["cubit_attention"]()
        assert torch.isfinite(out[:, 0]).all() and not torch.isfinite(out[:, 1:, 0]).any()

    def test_skipped_where_a_check_would_sync(self, monkeypatch):
        """Off the CPU (or under torch.compile) the check would wait for the device on every layer of every
        step: it is skipped exactly where the non-finite scan skips its sync (scan_syncs)."""
        from kernelmix.ops import _common
        monkeypatch.setattr(_common, "scan_syncs", lambda device: False)
        out = _factor_calls(rho=torch.zeros(1, 5, 2))["cubit_attention"]()
        assert torch.equal(out, torch.zeros_like(out))  # what ρ = 0 gives when nobody checks


class TestBetaOutsideItsRangeRefused:
    """Issue 25: β outside [0, 1] was taken as it came (β = 2 over-subtracts, β < 0 turns the delta rule
    around). Every op that takes β refuses it on the CPU, naming the value, the range and the fix. β = 0
    is accepted: the layer's sigmoid gate gives it exactly (logits below ~-88 in float32, a -inf hidden
    state), and it is well-defined (the delta rule off for that token, u = v)."""

    @pytest.mark.parametrize("value", [-0.1, -1e-30, 1.5])
    @pytest.mark.parametrize("op", list(_factor_calls(beta=torch.ones(1, 5, 2))))
    def test_refused_naming_value_range_and_fix(self, op, value):
        beta = torch.full((1, 5, 2), 0.5)
        beta[0, 4, 1] = value
        with pytest.raises(KernelmixError, match=rf"beta must lie in \[0, 1\] for every token and head, got "
                                                 rf"{value:g} at \[b, t, h\] = \[0, (4|0), 1\].*beta = "
                                                 r"torch.sigmoid\(x\).*beta=None"):
            _factor_calls(beta=beta)[op]()

    def test_zero_one_and_non_finite_still_run(self):
        beta = torch.ones(1, 5, 2)  # β = 1 (the default's value) and β = 0 (u = v) are in range
        beta[0, 3] = 0.0
        for call in _factor_calls(beta=beta).values():
            call()
        beta[0, 1, 0] = float("inf")
        out = _factor_calls(beta=beta)["deltaformer_attention"]()
        assert torch.isfinite(out[:, 0]).all() and not torch.isfinite(out[:, 1:, 0]).any()

    def test_skipped_where_a_check_would_sync(self, monkeypatch):
        from kernelmix.ops import _common
        monkeypatch.setattr(_common, "scan_syncs", lambda device: False)
        _factor_calls(beta=torch.full((1, 5, 2), 2.0))["deltaformer_attention"]()
