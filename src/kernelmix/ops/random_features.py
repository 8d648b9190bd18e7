"""Positive random features: Performer (FAVOR+) and DARKFormer (SPEC §4–5).

    x̃ = d^{-1/4} x,   φ(x) = m^{-1/2} exp(W (M x̃) − ½‖M x̃‖²) ∈ R^m_{>0}
    o_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j)

M is DARKFormer's per-head transform (Σ = MᵀM, E[φ(q)·φ(k)] = exp(qᵀΣk/√d)); M = None is
Performer (Σ = I).

Numerical stability without bias and without reading the future: the query side is divided by
its own max over features (a per-query constant, cancels in the ratio). The key side is shifted
by a *running* max s_i = max_{j≤i} max_r logit(k_j)_r: for query i every key j ≤ i is multiplied by
the same exp(−s_i), so the ratio is unchanged, and s_i depends only on tokens ≤ i. Keys stored at
their own s_j are brought to s_i by the factor exp(s_j − s_i) ≤ 1, which never overflows. The state
(S, z) is kept at scale exp(−shift) and rescaled when the shift grows, in the chunked pass and in
decode alike. No additive epsilon enters the ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import check_4d, check_chunk_size, check_doc_start, check_qkv, compute_dtype, expand_heads, visible


@dataclass
class RandomFeatureState:
    """Recurrent state: ``S`` ``[B, H, m, d_v]`` and ``z`` ``[B, H, m]`` at scale exp(−shift),
    ``shift`` ``[B, H]`` the running max of key feature logits, ``length`` tokens seen."""

    S: Tensor
    z: Tensor
    shift: Tensor
    length: int


# ---------------------------------------------------------------------------------------------
# Projections and the feature map


def _check_feature_dims(num_features: int, head_dim: int, num_heads: int | None) -> None:
    if not isinstance(num_features, int) or num_features <= 0:
        raise ValueError(f"num_features (m) must be a positive int, got {num_features!r}")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if num_heads is not None and (not isinstance(num_heads, int) or num_heads <= 0):
        raise ValueError(f"num_heads must be a positive int or None, got {num_heads!r}")


def gaussian_random_features(
    num_features: int,
    head_dim: int,
    *,
    num_heads: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """iid N(0, I) rows ω_i: ``[m, d]``, or ``[H, m, d]`` (independent per head) if ``num_heads``."""
    _check_feature_dims(num_features, head_dim, num_heads)
    shape = (num_features, head_dim) if num_heads is None else (num_heads, num_features, head_dim)
    w = torch.randn(shape, generator=generator, dtype=torch.float64)
    return w.to(dtype=dtype, device=device)


def _orthogonal_block_rows(num_features: int, head_dim: int, generator: torch.Generator | None) -> Tensor:
    blocks = []
    for _ in range(math.ceil(num_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Sign fix: without it QR's convention biases the distribution away from Haar.
        q = q * torch.sign(torch.diagonal(r)).masked_fill(torch.diagonal(r) == 0, 1.0)
        blocks.append(q.T)  # rows are orthonormal
    rows = torch.cat(blocks, dim=0)[:num_features]
    # Row norms of iid Gaussian vectors (chi(d)) so each row is marginally N(0, I): keeps unbiasedness.
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return rows * norms[:, None]


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    num_heads: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Orthogonal random features: blocks of d mutually orthogonal rows (QR of a Gaussian matrix
    with the sign fix), rows rescaled to chi(d)-distributed norms. ``[m, d]`` or ``[H, m, d]``."""
    _check_feature_dims(num_features, head_dim, num_heads)
    if num_heads is None:
        w = _orthogonal_block_rows(num_features, head_dim, generator)
    else:
        w = torch.stack([_orthogonal_block_rows(num_features, head_dim, generator) for _ in range(num_heads)])
    return w.to(dtype=dtype, device=device)


def _feature_logits(x: Tensor, projection: Tensor, transform: Tensor | None) -> Tensor:
    """log(√m · φ(x)) = W (M x̃) − ½‖M x̃‖² for ``x`` ``[B, T, H, d]`` → ``[B, T, H, m]``."""
    x = x * x.shape[-1] ** -0.25
    if transform is not None:
        x = torch.einsum("hed,bthd->bthe", transform, x)
    if projection.dim() == 2:
        proj = torch.einsum("bthd,md->bthm", x, projection)
    else:
        proj = torch.einsum("bthd,hmd->bthm", x, projection)
    return proj - 0.5 * x.pow(2).sum(dim=-1, keepdim=True)


def _check_projection(projection: Tensor, transform: Tensor | None, heads: int, head_dim: int) -> None:
    if not isinstance(projection, Tensor) or projection.dim() not in (2, 3):
        got = tuple(projection.shape) if isinstance(projection, Tensor) else type(projection).__name__
        raise ValueError(f"projection must be a tensor [m, d] or [H, m, d], got {got}")
    if projection.shape[-2] <= 0:
        raise ValueError(f"projection has m = {projection.shape[-2]} features; m must be ≥ 1")
    if projection.shape[-1] != head_dim:
        raise ValueError(f"projection rows have dim {projection.shape[-1]} but the head dim is {head_dim}")
    if projection.dim() == 3 and projection.shape[0] != heads:
        raise ValueError(f"projection has {projection.shape[0]} heads but q has {heads}; use [m, d] or [H, m, d]")
    if transform is not None and (not isinstance(transform, Tensor) or tuple(transform.shape) != (heads, head_dim, head_dim)):
        got = tuple(transform.shape) if isinstance(transform, Tensor) else type(transform).__name__
        raise ValueError(f"transform (M) must have shape [H, d, d] = {(heads, head_dim, head_dim)}, got {got}")


def positive_random_features(x: Tensor, projection: Tensor, *, transform: Tensor | None = None) -> Tensor:
    """The positive feature map φ(x) (SPEC §4–5), ``[B, T, H, d]`` → ``[B, T, H, m]``, unstabilised.

    E[φ(q)·φ(k)] = exp(qᵀ Σ k / √d) with Σ = MᵀM (Σ = I when ``transform`` is None)."""
    check_4d("x", x)
    _check_projection(projection, transform, x.shape[2], x.shape[3])
    dtype = compute_dtype(x, projection)
    logits = _feature_logits(x.to(dtype), projection.to(dtype), None if transform is None else transform.to(dtype))
    return torch.exp(logits) / math.sqrt(projection.shape[-2])


# ---------------------------------------------------------------------------------------------
# Attention


def _prepare(q, k, v, projection, transform):
    check_qkv(q, k, v)
    heads, head_dim = q.shape[2], q.shape[3]
    _check_projection(projection, transform, heads, head_dim)
    dtype = compute_dtype(q, k, v, projection)
    proj = projection.to(dtype)
    m = None if transform is None else transform.to(dtype)
    q_logits = _feature_logits(q.to(dtype), proj, m)
    k_logits = _feature_logits(expand_heads(k, heads).to(dtype), proj, m)
    return q_logits, k_logits, expand_heads(v, heads).to(dtype), dtype


def _normalised_queries(q_logits: Tensor) -> Tensor:
    # A per-query constant cancels in the ratio; detached since the output does not depend on it.
    return torch.exp(q_logits - q_logits.detach().amax(dim=-1, keepdim=True))


def _exp_where(x: Tensor, keep: Tensor) -> Tensor:
    """exp(x) where ``keep``, exactly 0 elsewhere (masked before the exp so it cannot overflow)."""
    return torch.exp(x.masked_fill(~keep, float("-inf")))


def _running_shift(key_max: Tensor, doc_start: Tensor | None) -> Tensor:
    """s_i = max of the key logit maxima over j ∈ [doc_start_i, i]: causal and per document.

    Without documents this is a plain cummax. With them, a segmented cummax: documents are
    contiguous and doc_start is non-decreasing, so adding doc_start·span (span > range of the
    values) makes every earlier document's values smaller than any of the current one's; the offset
    is removed afterwards. Computed in float64; the shift is detached (the output is invariant to it)."""
    if doc_start is None:
        return torch.cummax(key_max, dim=-1).values
    values = key_max.double()
    span = (values.max() - values.min()).item() + 1.0
    offset = doc_start[:, None, :].double() * span
    return (torch.cummax(values + offset, dim=-1).values - offset).to(key_max.dtype)


def random_feature_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    transform: Tensor | None = None,
    chunk_size: int = 64,
    doc_start: Tensor | None = None,
    initial_state: RandomFeatureState | None = None,
    return_state: bool = False,
):
    """Causal random-feature attention in chunks (never a T×T matrix): O(T·m·d) time.

    ``q`` ``[B, T, H, d]``; ``k``, ``v`` ``[B, T, H_kv, d]``; ``projection`` ``[m, d]`` or ``[H, m, d]``;
    ``transform`` DARKFormer's M ``[H, d, d]`` or None (Performer). ``initial_state`` continues
    from a previous call (chunked prefill / decode of several tokens). ``doc_start`` ``[B, T]``
    (absolute indices, counting the tokens of ``initial_state``) keeps packed documents / left
    padding apart: the state restarts at every document boundary."""
    check_chunk_size(chunk_size)
    with torch.autocast(q.device.type, enabled=False):  # feature logits and states stay ≥ fp32
        q_logits, k_logits, values, dtype = _prepare(q, k, v, projection, transform)
        # [B, H, T, *] layout for batched matmuls per head.
        q_feat = _normalised_queries(q_logits).transpose(1, 2)
        k_logits = k_logits.transpose(1, 2)
        values = values.transpose(1, 2)
        batch, heads, length, m = k_logits.shape
        if initial_state is None:
            state_s = values.new_zeros(batch, heads, m, values.shape[-1])
            state_z = values.new_zeros(batch, heads, m)
            shift = values.new_full((batch, heads), float("-inf"))
            start = 0
        else:
            _check_state(initial_state, batch, heads, m, values.shape[-1])
            state_s, state_z = initial_state.S.to(dtype), initial_state.z.to(dtype)
            shift, start = initial_state.shift.to(dtype), initial_state.length
        check_doc_start(doc_start, batch, length, offset=start)
        positions = start + torch.arange(length, device=q.device)
        # Tokens whose document began before this call continue the carried state.
        continues = (
            torch.ones(batch, length, dtype=torch.bool, device=q.device) if doc_start is None else doc_start < start
        )
        # Running max of key logits (causal, per document); detached: the output is invariant to it.
        running = _running_shift(k_logits.detach().amax(dim=-1), doc_start)
        running = torch.where(continues[:, None, :], torch.maximum(running, shift[..., None]), running)
        k_feat = torch.exp(k_logits - running[..., None])  # ≤ 1
        outputs = []
        # split once instead of slicing per chunk: the backward of a slice writes into a zero tensor
        # of the full size, which made the backward O(T²/C) memory traffic; split's backward is one cat
        chunks = zip(*(x.split(chunk_size, dim=2) for x in (q_feat, k_feat, values, running)))
        for i0, (qc, kc, vc, sc) in zip(range(0, length, chunk_size), chunks):
            i1 = i0 + qc.shape[2]
            rows_doc = None if doc_start is None else doc_start[:, i0:i1]
            # exp(s_j − s_i) for visible j (≤ 1); future / other-document entries are exactly 0.
            decay = _exp_where(sc[..., None, :] - sc[..., :, None], visible(positions[i0:i1], positions[i0:i1], rows_doc))
            scores = (qc @ kc.transpose(-1, -2)) * decay  # [B, H, C, C]
            # The state (keys of the document of token i0 − 1) at scale exp(−s_i), for rows in that document.
            reads_state = (rows_doc < start + i0)[:, None, :] if rows_doc is not None else torch.ones_like(sc, dtype=torch.bool)
            carry = _exp_where(shift[..., None] - sc, reads_state)[..., None]
            numerator = scores @ vc + carry * (qc @ state_s)
            denominator = scores.sum(-1, keepdim=True) + carry * (qc @ state_z[..., None])
            outputs.append(numerator / denominator.clamp_min(torch.finfo(dtype).tiny))
            # New state: keys of the last token's document, at scale exp(−s_last).
            new_shift = sc[..., -1]
            if rows_doc is None:
                in_last_doc = torch.ones_like(sc, dtype=torch.bool)
                keeps_state = torch.ones_like(new_shift, dtype=torch.bool)
            else:
                in_last_doc = (positions[i0:i1][None, :] >= rows_doc[:, -1:])[:, None, :].expand_as(sc)
                keeps_state = (rows_doc[:, -1] < start + i0)[:, None].expand_as(new_shift)
            weights = _exp_where(sc - new_shift[..., None], in_last_doc)[..., None] * kc
            rescale = _exp_where(shift - new_shift, keeps_state)
            state_s = rescale[..., None, None] * state_s + weights.transpose(-1, -2) @ vc
            state_z = rescale[..., None] * state_z + weights.sum(dim=-2)
            shift = new_shift
        out = torch.cat(outputs, dim=2).transpose(1, 2).to(v.dtype)
    if return_state:
        return out, RandomFeatureState(S=state_s, z=state_z, shift=shift, length=start + length)
    return out


def _check_state(state: RandomFeatureState, batch: int, heads: int, m: int, dv: int) -> None:
    expected = (batch, heads, m, dv)
    if not isinstance(state, RandomFeatureState) or tuple(state.S.shape) != expected:
        got = tuple(state.S.shape) if isinstance(state, RandomFeatureState) else type(state).__name__
        raise ValueError(
            f"random-feature state does not fit: expected S of shape [B, H, m, d_v] = {expected}, got {got}; "
            "was it built with another projection, batch or layer?"
        )


def random_feature_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> Tensor:
    """Dense reference: explicit φ(Q) φ(K)ᵀ (T×T), causal (+ document) mask, row-normalised."""
    check_qkv(q, k, v)
    check_doc_start(doc_start, q.shape[0], q.shape[1])
    heads = q.shape[2]
    phi_q = positive_random_features(q, projection, transform=transform)
    phi_k = positive_random_features(expand_heads(k, heads), projection, transform=transform)
    length = q.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:
        mask = mask & (torch.arange(length, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]
    kernel = torch.einsum("bihm,bjhm->bhij", phi_q, phi_k) * mask
    values = expand_heads(v, heads).to(kernel.dtype)
    out = torch.einsum("bhij,bjhd->bihd", kernel, values) / kernel.sum(-1).transpose(1, 2)[..., None]
    return out.to(v.dtype)


def random_feature_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    state: RandomFeatureState | None,
    *,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> tuple[Tensor, RandomFeatureState]:
    """Decode one token (T=1) with O(m·d) work and state, independent of the position.
    ``doc_start`` ``[B, 1]``: where ``doc_start == state.length`` the token starts a new document
    and the state restarts."""
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(
            f"a decode step takes one token (T=1), got T={q.shape[1]}; use random_feature_attention for prefill"
        )
    with torch.autocast(q.device.type, enabled=False):
        q_logits, k_logits, values, dtype = _prepare(q, k, v, projection, transform)
        q_feat = _normalised_queries(q_logits[:, 0])  # [B, H, m]
        k_logits, values = k_logits[:, 0], values[:, 0]  # [B, H, m], [B, H, d_v]
        batch, heads, m = k_logits.shape
        if state is None:
            state_s = values.new_zeros(batch, heads, m, values.shape[-1])
            state_z = values.new_zeros(batch, heads, m)
            shift = values.new_full((batch, heads), float("-inf"))
            length = 0
        else:
            _check_state(state, batch, heads, m, values.shape[-1])
            state_s, state_z, shift, length = state.S.to(dtype), state.z.to(dtype), state.shift.to(dtype), state.length
        check_doc_start(doc_start, batch, 1, offset=length)
        key_max = k_logits.detach().amax(dim=-1)
        if doc_start is None:
            keeps_state = torch.ones_like(key_max, dtype=torch.bool)
        else:
            keeps_state = (doc_start[:, 0] < length)[:, None].expand_as(key_max)
        new_shift = torch.where(keeps_state, torch.maximum(shift, key_max), key_max)
        rescale = _exp_where(shift - new_shift, keeps_state)
        k_feat = torch.exp(k_logits - new_shift[..., None])
        state_s = rescale[..., None, None] * state_s + k_feat[..., :, None] * values[..., None, :]
        state_z = rescale[..., None] * state_z + k_feat
        numerator = torch.einsum("bhm,bhmd->bhd", q_feat, state_s)
        denominator = (q_feat * state_z).sum(-1, keepdim=True)
        out = (numerator / denominator.clamp_min(torch.finfo(dtype).tiny))[:, None].to(v.dtype)
    return out, RandomFeatureState(S=state_s, z=state_z, shift=new_shift, length=length + 1)
