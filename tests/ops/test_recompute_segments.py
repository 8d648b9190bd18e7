"""The random-feature ops' PyTorch path under autograd runs in checkpointed segments of tokens
(``_common.RECOMPUTE_SEGMENT_TOKENS``): values and gradients must be those of the float64 references
whatever the segments, and the peak memory of a forward+backward must fall."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kernelmix.ops._common as common
from kernelmix.ops import (
    cubit_rf_attention,
    cubit_rf_attention_naive,
    orthogonal_random_features,
    random_feature_attention,
    random_feature_attention_naive,
)
from kernelmix.ops._common import recompute_segments
from tests.utils import rel_rmse

F64 = torch.float64
B, H, H_KV, D, M = 2, 4, 2, 8, 16
TOL = 1e-4


def packed(T: int) -> torch.Tensor:
    """Documents of 5, 9, 1, ... and 12, 3, ... tokens: boundaries inside segments and on their edges."""
    rows = []
    for lengths in ((5, 9, 1, 17, 30, 40), (12, 3, 16, 25, 50)):
        starts, at = [], 0
        for n in lengths:
            starts += [at] * n
            at += n
        rows.append(starts[:T])
    return torch.tensor(rows)


def test_segments_are_whole_chunks_covering_the_sequence(monkeypatch):
    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 10)
    assert recompute_segments(37, 4) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 37)]
    assert recompute_segments(5, 16) == [(0, 5)]  # a chunk longer than a segment: one chunk each
    assert recompute_segments(0, 4) == [(0, 0)]


def _rf_inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=F64)
    k = torch.randn(B, T, H_KV, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H_KV, D, generator=g, dtype=F64)
    transform = torch.eye(D, dtype=F64) + 0.3 * torch.randn(H, D, D, generator=g, dtype=F64)
    projection = orthogonal_random_features(M, D, num_heads=H, generator=g, dtype=F64)
    return [q, k, v, transform], projection


@pytest.mark.parametrize("T,chunk,documents", [(37, 4, False), (41, 3, True), (9, 4, True)])
def test_segmented_random_features_match_the_reference(monkeypatch, T, chunk, documents):
    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 10)  # segments of 8 / 9 tokens
    base, projection = _rf_inputs(T, seed=T)
    doc_start = packed(T) if documents else None
    ref_in = [x.clone().requires_grad_() for x in base]
    ref = random_feature_attention_naive(*ref_in[:3], projection, transform=ref_in[3], doc_start=doc_start)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    fast_in = [x.detach().float().requires_grad_() for x in base]
    out = random_feature_attention(*fast_in[:3], projection.float(), transform=fast_in[3], chunk_size=chunk,
                                   doc_start=doc_start, backend="torch")
    assert rel_rmse(out, ref) <= TOL
    for name, got, want in zip(["q", "k", "v", "transform"], torch.autograd.grad(out, fast_in, grad_out.float()),
                               ref_grads):
        assert rel_rmse(got, want) <= TOL, name


def test_segmented_random_features_carry_gradients_into_the_initial_state(monkeypatch):
    """A prefill state handed to a later call gets the same gradients in segments as in one piece."""
    base, projection = _rf_inputs(30, seed=3)
    q, k, v, transform = (x.float() for x in base)

    def gradients(segment_tokens: int):
        monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", segment_tokens)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, transform)]
        lq, lk, lv, lt = leaves
        _, state = random_feature_attention(lq[:, :11], lk[:, :11], lv[:, :11], projection.float(), transform=lt,
                                            chunk_size=4, return_state=True, backend="torch")
        out = random_feature_attention(lq[:, 11:], lk[:, 11:], lv[:, 11:], projection.float(), transform=lt,
                                       chunk_size=4, initial_state=state, backend="torch")
        return torch.autograd.grad(out.square().sum(), leaves)

    for name, got, want in zip("qkvM", gradients(4), gradients(10**6)):
        assert rel_rmse(got, want) <= 1e-5, name
        assert got.abs().sum() > 0, name


@pytest.mark.parametrize("T,chunk,documents", [(29, 4, False), (41, 3, True)])
def test_segmented_cubit_rf_matches_the_reference(monkeypatch, T, chunk, documents):
    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 10)
    g = torch.Generator().manual_seed(T)
    x = {
        "q": torch.randn(B, T, H, D, generator=g, dtype=F64), "k": torch.randn(B, T, H_KV, D, generator=g, dtype=F64),
        "v": torch.randn(B, T, H_KV, D, generator=g, dtype=F64), "r": torch.randn(B, T, H, D, generator=g, dtype=F64),
        "rho": 0.5 + torch.rand(B, T, H, generator=g, dtype=F64),
        "ridge": torch.tensor([1e-6, 1e-2, 0.1, 0.5], dtype=F64),
        "ref_scale": torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=F64),
        "transform": torch.eye(D, dtype=F64) + 0.2 * torch.randn(H, D, D, generator=g, dtype=F64),
    }
    projection = orthogonal_random_features(M, D, num_heads=H, generator=g, dtype=F64)
    doc_start = packed(T) if documents else None
    names = list(x)
    ref_in = {n: t.clone().requires_grad_() for n, t in x.items()}
    ref = cubit_rf_attention_naive(ref_in["q"], ref_in["k"], ref_in["v"], ref_in["r"], projection, doc_start=doc_start,
                                   **{n: ref_in[n] for n in ("rho", "ridge", "ref_scale", "transform")})
    weights = torch.randn(ref.shape, generator=g, dtype=F64)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [ref_in[n] for n in names])
    fast_in = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    out = cubit_rf_attention(fast_in["q"], fast_in["k"], fast_in["v"], fast_in["r"], projection.float(),
                             chunk_size=chunk, doc_start=doc_start, backend="torch",
                             **{n: fast_in[n] for n in ("rho", "ridge", "ref_scale", "transform")})
    assert rel_rmse(out, ref) <= TOL
    fast_grads = torch.autograd.grad((out * weights.float()).sum(), [fast_in[n] for n in names])
    for name, got, want in zip(names, fast_grads, ref_grads):
        assert rel_rmse(got, want) <= TOL, name


def _whole_input_slices(out: torch.Tensor, length: int) -> int:
    """How many slices of a whole ``length``-token input (along dim 1) the graph behind ``out`` holds."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "SliceBackward0":
            count += node._saved_dim == 1 and node._saved_self_sym_sizes[1] == length
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize("op", ["random_features", "cubit_rf"])
def test_segments_are_cut_by_one_split_not_a_slice_each(monkeypatch, op):
    """A slice's backward writes its gradient into a zeroed tensor of the whole input: one slice per
    segment made the backward O(T²) (fwd+bwd 3.0× per doubling of T at 16k, issue 27's bench). The
    inputs are cut by one split whatever the number of segments."""
    base, projection = _rf_inputs(64, seed=2)
    q, k, v, _ = (x.float().requires_grad_() for x in base)
    r = torch.randn(q.shape).requires_grad_()

    def slices(segment_tokens: int) -> int:
        monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", segment_tokens)
        if op == "random_features":
            out = random_feature_attention(q, k, v, projection.float(), chunk_size=4, backend="torch")
        else:
            out = cubit_rf_attention(q, k, v, r, projection.float(), chunk_size=4, backend="torch")
        return _whole_input_slices(out, 64)

    assert slices(8) == slices(32) == 0  # 8 segments, then 2


@pytest.mark.parametrize("op", ["random_features", "cubit_rf"])
def test_segmented_forward_without_gradients_matches_the_reference(monkeypatch, op):
    """Without autograd the PyTorch path also runs in segments (a long prefill's tiles stay in the
    caches): the numbers are the float64 reference's, with packed documents across the segments' edges."""
    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 10)
    base, projection = _rf_inputs(41, seed=4)
    q, k, v, transform = base
    r = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    doc_start = packed(41)
    with torch.no_grad():
        if op == "random_features":
            ref = random_feature_attention_naive(q, k, v, projection, transform=transform, doc_start=doc_start)
            out = random_feature_attention(q.float(), k.float(), v.float(), projection.float(),
                                           transform=transform.float(), chunk_size=3, doc_start=doc_start,
                                           backend="torch")
        else:
            ref = cubit_rf_attention_naive(q, k, v, r, projection, transform=transform, doc_start=doc_start)
            out = cubit_rf_attention(q.float(), k.float(), v.float(), r.float(), projection.float(),
                                     transform=transform.float(), chunk_size=3, doc_start=doc_start, backend="torch")
    assert rel_rmse(out, ref) <= TOL


# The peak is measured as the bench measures it (the resident-set high-water mark in a fresh process
# whose allocator unmaps freed blocks); one process per setting, so neither sees the other's heap.
PROBE = """
import json, sys, torch
import kernelmix.ops._common as common
from kernelmix.ops import random_feature_attention
from kernelmix.studies.demo import peak_memory_mb
torch.set_num_threads(1)
common.RECOMPUTE_SEGMENT_TOKENS = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4096, 4, 32, generator=g).requires_grad_() for _ in range(3))
projection = torch.randn(4, 32, 32, generator=g)
transform = (torch.eye(32) + 0.05 * torch.randn(4, 32, 32, generator=g)).requires_grad_()
grad_out = torch.randn(1, 4096, 4, 32, generator=g)
def run():
    random_feature_attention(q, k, v, projection, transform=transform, backend="torch").backward(grad_out)
run()
print(json.dumps(peak_memory_mb(run)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident-set counters are Linux's")
def test_segments_cut_the_peak_memory_of_forward_and_backward():
    from kernelmix.studies.bench import MEMORY_PROBE_ENV

    def peak(segment_tokens: int) -> float:
        done = subprocess.run([sys.executable, "-c", PROBE, str(segment_tokens)],
                              env={**os.environ, **MEMORY_PROBE_ENV},
                              capture_output=True, text=True, check=True, timeout=300)
        return json.loads(done.stdout.strip().splitlines()[-1])

    whole, segmented = peak(10**6), peak(512)
    assert segmented < 0.6 * whole, (segmented, whole)


# ---------------------------------------------------------------------------------------------
# inside the model: under the blocks' activation checkpointing, and under torch.compile


def _model_loss_and_grads(model, length: int = 45):
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(20), torch.arange(length - 20)]).expand(2, -1)  # two documents per row
    loss = model(ids, labels=ids, position_ids=positions, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mixer", ["darkformer", "cubit-rf"])
def test_segments_inside_activation_checkpointed_blocks_change_no_number(monkeypatch, mixer):
    """The op's segment checkpoints nest inside the blocks' checkpoints: bitwise the numbers of the
    model without block checkpoints, the segments on in both (16-token segments of 8-token chunks at T = 45)."""
    from kernelmix.model import CausalLM, ModelConfig
    from kernelmix.training import parallelize

    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 16)
    config = ModelConfig.preset("tiny", mixer=mixer, num_layers=2, chunk_size=8)
    eager_loss, eager_grads = _model_loss_and_grads(CausalLM(config, seed=3).train())
    model = parallelize(CausalLM(config, seed=3).train(), activation_checkpointing="full")
    loss, grads = _model_loss_and_grads(model)
    assert torch.equal(loss, eager_loss)
    assert not [name for name in grads if not torch.equal(grads[name], eager_grads[name])]


def test_compiled_model_with_segments_gives_the_eager_numbers(monkeypatch):
    """Under torch.compile the op runs in one piece (the partitioner recomputes what it chooses):
    the compiled loss and gradients are the eager, segmented ones within fp32 tolerance."""
    import torch._dynamo

    from kernelmix.model import CausalLM, ModelConfig
    from kernelmix.training import parallelize

    monkeypatch.setattr(common, "RECOMPUTE_SEGMENT_TOKENS", 16)
    torch._dynamo.reset()
    config = ModelConfig.preset("tiny", mixer="performer", num_layers=2, chunk_size=8)
    eager_loss, eager_grads = _model_loss_and_grads(CausalLM(config, seed=5).train())
    model = parallelize(CausalLM(config, seed=5).train(), compile=True, compile_options={"backend": "aot_eager"})
    loss, grads = _model_loss_and_grads(model)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
