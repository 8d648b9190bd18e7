"""Shared layer-test helpers: tiny configurations and randomised float64 layers."""

from __future__ import annotations

import torch

from kernelmix.layers import build_mixer

F64 = torch.float64
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, CHUNK = 32, 4, 2, 8, 5  # chunk 5 does not divide T = 13
LENGTH, PREFILL = 13, 6

BASE = dict(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, chunk_size=CHUNK)

# (id, mixer name, options, setup): every mixer with its default options plus the ablations.
CASES = [
    ("softmax", "softmax", {}, None),
    ("cubit", "cubit", {}, None),
    ("cubit-key", "cubit", {"reference": "key"}, None),
    ("cubit-nolrr", "cubit", {"lrr": False}, None),
    ("cubit-norefrope", "cubit", {"reference_rope": False}, None),
    ("cubit-key-norope", "cubit", {"reference": "key", "reference_rope": False}, None),
    ("deltaformer", "deltaformer", {}, None),
    ("deltaformer-wq", "deltaformer", {"w": "q"}, None),
    ("performer", "performer", {"num_features": 16}, None),
    ("performer-iid", "performer", {"num_features": 16, "projection": "iid"}, None),
    ("darkformer", "darkformer", {"num_features": 16}, None),
    ("darkformer-whitened", "darkformer", {"num_features": 16}, "whiten"),
    ("cubit-rf", "cubit-rf", {"num_features": 16}, None),
    ("cubit-rf-key-nolrr", "cubit-rf", {"num_features": 16, "reference": "key", "lrr": False}, None),
    ("cubit-rf-whitened", "cubit-rf", {"num_features": 16, "data_aware": True}, "whiten"),
]
CASE_IDS = [c[0] for c in CASES]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a − e| / max |e| (max norms)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


@torch.no_grad()
def randomize_(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter away from its (often symmetric) init so all code paths matter:
    per-token ρ and β, ridge and reference scale per head, a non-identity DARKFormer M."""
    g = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=F64).to(p)
        if name == "log_ridge":
            p.copy_(torch.empty(p.shape, dtype=F64).uniform_(-5.0, -1.0, generator=g).to(p))
        elif name == "log_ref_scale":
            p.add_(0.5 * noise)
        elif name == "transform":
            p.add_(0.2 * noise)
        elif name.startswith("rho_proj"):
            p.add_(0.3 * noise)
        else:
            p.add_(0.05 * noise)
    return layer


def make_layer(name: str, options: dict, setup: str | None = None, *, seed: int = 0, dtype=F64, **overrides):
    torch.manual_seed(seed)
    layer = build_mixer(name, **{**BASE, **overrides, **options}).to(dtype)
    randomize_(layer, seed)
    if setup == "whiten":
        g = torch.Generator().manual_seed(seed + 1)
        mix = torch.randn(layer.head_dim, layer.head_dim, generator=g, dtype=F64)
        q = torch.randn(200, layer.num_heads, layer.head_dim, generator=g, dtype=F64) @ mix
        k = 0.5 * torch.randn(200, layer.num_kv_heads, layer.head_dim, generator=g, dtype=F64)
        layer.whiten_(q, k, eps=1e-2)
        with torch.no_grad():  # and move M off the whitened value, as training would
            layer.transform.add_(0.05 * torch.randn(layer.transform.shape, generator=g, dtype=F64))
    return layer


def inputs(batch: int = 2, length: int = LENGTH, seed: int = 1, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, HIDDEN, generator=g, dtype=F64).to(dtype)
