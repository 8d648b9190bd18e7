"""Random-feature layers: Performer (SPEC §4) and DARKFormer (SPEC §5).

Both hold a random projection W ``[H, m, d]`` in a persistent buffer ``projection`` (saved in the
state dict, so a reloaded model computes the same features). It is drawn once at construction with
torch's default RNG and changes only through an explicit :meth:`PerformerMixer.redraw` — never
inside ``forward`` — so every process that loads the same weights (or redraws with the same seeded
generator) uses the same W.

DARKFormer adds a learned per-head transform M ``[H, d, d]`` (kernel exp(qᵀMᵀMk/√d)) and a buffer
``query_fold`` F ``[H, d, d]`` applied to the rotated queries (q ← F q). Both start at the
identity, where DARKFormer equals Performer. :meth:`DarkFormerMixer.whiten_` sets them from
calibration statistics by :func:`data_aware_transform` so that the kernel is exactly the
pretrained one, (F q̃)ᵀ MᵀM k̃ = q̃ᵀk̃, while the features see better-conditioned inputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..ops.random_features import (
    RandomFeatureState,
    gaussian_random_features,
    orthogonal_random_features,
    random_feature_attention,
    random_feature_attention_step,
)
from .base import MixerLayer, check_choice, check_positive_int
from .rope import DEFAULT_THETA

PROJECTIONS = ("orthogonal", "iid")


class PerformerMixer(MixerLayer):
    """Performer (FAVOR+): causal attention with positive random features φ(x) = m^{-1/2}
    exp(W x̃ − ½‖x̃‖²), x̃ = d^{-1/4} x, an unbiased estimate of the softmax kernel (SPEC §4).

    Keyword-only arguments: the shared ones (``hidden_size``, ``num_heads``, ``head_dim=None``,
    ``num_kv_heads=None``, ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64``, see
    :class:`MixerLayer`) and

    * ``num_features=64``: m, random features per head (> 0).
    * ``projection="orthogonal"``: orthogonal random features (blocks of d orthogonal rows with
      chi(d) norms), or ``"iid"`` Gaussian rows.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``. Buffer: ``projection`` W
    ``[H, m, d]`` (persistent; one independent draw per query head). Cache state:
    :class:`~kernelmix.ops.random_features.RandomFeatureState` (O(m·d) per head, independent of
    the number of tokens).
    """

    mixer_name = "performer"

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        rope_theta: float = DEFAULT_THETA,
        bias: bool = False,
        chunk_size: int = 64,
        num_features: int = 64,
        projection: str = "orthogonal",
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            num_kv_heads=num_kv_heads,
            rope_theta=rope_theta,
            bias=bias,
            chunk_size=chunk_size,
        )
        self.num_features = check_positive_int("num_features", num_features)
        self.projection_kind = check_choice("projection", projection, PROJECTIONS)
        self.register_buffer("projection", self._draw(None, torch.get_default_dtype(), None), persistent=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_features}, projection={self.projection_kind!r}"

    def _draw(self, generator: torch.Generator | None, dtype: torch.dtype, device: Any) -> Tensor:
        draw = orthogonal_random_features if self.projection_kind == "orthogonal" else gaussian_random_features
        return draw(
            self.num_features, self.head_dim, num_heads=self.num_heads, generator=generator, dtype=dtype, device=device
        )

    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None) -> Tensor:
        """Draw a new projection in place (keeps the buffer's dtype and device) and return it.

        With a seeded CPU ``generator`` every process draws the same W; with None torch's default
        RNG is used. The draw happens in float64 on the CPU, so it does not depend on the layer's
        dtype or device. Existing caches were built with the old W and must not be continued.
        """
        self.projection.copy_(self._draw(generator, self.projection.dtype, self.projection.device))
        return self.projection

    def _transform(self) -> Tensor | None:
        return None

    def _queries(self, q: Tensor) -> Tensor:
        return q

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, RandomFeatureState]:
        q = self._queries(q)
        if state is not None and q.shape[1] == 1:
            return random_feature_attention_step(
                q, k, v, self.projection, state, transform=self._transform(), doc_start=extras["doc_start"]
            )
        return random_feature_attention(
            q,
            k,
            v,
            self.projection,
            transform=self._transform(),
            chunk_size=self.chunk_size,
            doc_start=extras["doc_start"],
            initial_state=state,
            return_state=True,
        )

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, RandomFeatureState):
            raise ValueError(
                f"a {self.mixer_name} layer's cache state must be a RandomFeatureState, got {type(state).__name__}"
            )
        if state.S.dim() != 4 or state.S.shape[2] != self.num_features:
            raise ValueError(
                f"cache holds {state.S.shape[2] if state.S.dim() == 4 else '?'} random features, this layer has "
                f"num_features={self.num_features}"
            )


# ---------------------------------------------------------------------------------------------
# DARKFormer


def _check_samples(name: str, x: Any) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating tensor of shape [N, H, d], got {got}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no samples (N = 0)")


def _symmetric_function(mat: Tensor, fn) -> Tensor:
    """f(mat) for symmetric ``mat`` ``[..., d, d]`` via its eigendecomposition."""
    evals, evecs = torch.linalg.eigh(mat)
    out = (evecs * fn(evals)[..., None, :]) @ evecs.transpose(-1, -2)
    return 0.5 * (out + out.transpose(-1, -2))


def regularised_second_moments(q_samples: Tensor, k_samples: Tensor, eps: float = 1e-3) -> tuple[Tensor, Tensor]:
    """A = E[q̃q̃ᵀ] and B = E[k̃k̃ᵀ] per head (uncentred, x̃ = d^{-1/4} x), each regularised as
    X + eps·(tr X / d)·I (eps·I for an all-zero head). float64, ``[H, d, d]``.

    ``q_samples`` ``[N, H, d]``; ``k_samples`` ``[N', H_kv, d]`` with ``H % H_kv == 0`` (grouped key
    heads are repeated for their query heads)."""
    _check_samples("q_samples", q_samples)
    _check_samples("k_samples", k_samples)
    heads, head_dim = q_samples.shape[1], q_samples.shape[2]
    if k_samples.shape[2] != head_dim:
        raise ValueError(f"q_samples have head dim {head_dim} but k_samples have {k_samples.shape[2]}")
    if heads % k_samples.shape[1]:
        raise ValueError(
            f"q_samples have {heads} heads, k_samples {k_samples.shape[1]}; the query head count must be a "
            f"multiple of the key head count"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive number (real q/k have exactly-zero dimensions), got {eps!r}")
    k_samples = k_samples.repeat_interleave(heads // k_samples.shape[1], dim=1)
    scale = head_dim**-0.25
    eye = torch.eye(head_dim, dtype=torch.float64, device=q_samples.device)

    def moment(x: Tensor) -> Tensor:
        x = x.detach().to(torch.float64) * scale
        second = torch.einsum("nhi,nhj->hij", x, x) / x.shape[0]
        level = torch.diagonal(second, dim1=-2, dim2=-1).sum(-1) / head_dim  # tr / d
        level = torch.where(level > 0, level, torch.ones_like(level))
        return second + eps * level[:, None, None] * eye

    return moment(q_samples), moment(k_samples.to(q_samples.device))


def data_aware_transform(q_samples: Tensor, k_samples: Tensor, eps: float = 1e-3) -> tuple[Tensor, Tensor]:
    """SPEC §5's function-preserving initialisation: returns ``(M, fold)``, both ``[H, d, d]`` float64.

    With A, B the regularised second moments of the scaled queries and keys
    (:func:`regularised_second_moments`), S = B⁻¹ # A = B^{-1/2}(B^{1/2} A B^{1/2})^{1/2} B^{-1/2}
    is the symmetric positive definite solution of S B S = A; M = S^{1/2} and fold = S⁻¹. Feeding
    the op F q and M gives the kernel (F q̃)ᵀ MᵀM k̃ = q̃ᵀ k̃ (the pretrained one), while the features
    see M⁻ᵀq̃ = S^{-1/2} q̃ and M k̃ = S^{1/2} k̃, which have equal second moments
    (S^{-1/2} A S^{-1/2} = S^{1/2} B S^{1/2}) and so minimise E‖x + y‖² over such splits.
    Square roots are symmetric PSD roots from ``eigh`` in float64.
    """
    a, b = regularised_second_moments(q_samples, k_samples, eps)
    b_half = _symmetric_function(b, torch.sqrt)
    b_inv_half = _symmetric_function(b, torch.rsqrt)
    middle = _symmetric_function(b_half @ a @ b_half, lambda e: e.clamp_min(0).sqrt())
    s = b_inv_half @ middle @ b_inv_half
    s = 0.5 * (s + s.transpose(-1, -2))
    return _symmetric_function(s, torch.sqrt), _symmetric_function(s, torch.reciprocal)


class DarkFormerMixer(PerformerMixer):
    """DARKFormer: data-aware random features, φ_Σ(x) = m^{-1/2} exp(W M x̃ − ½‖M x̃‖²), an
    unbiased estimate of exp(qᵀΣk/√d) with Σ = MᵀM (SPEC §5).

    Keyword-only arguments: exactly those of :class:`PerformerMixer` (``num_features=64``,
    ``projection="orthogonal"|"iid"`` and the shared ones).

    Parameters: those of Performer and ``transform`` M ``[H, d, d]`` (per query head, init
    identity: a fresh layer equals Performer with the same weights and projection). Buffers:
    ``projection`` W ``[H, m, d]`` and ``query_fold`` F ``[H, d, d]`` (init identity; the rotated
    queries are replaced by F q before the features). :meth:`whiten_` sets M and F from
    calibration samples (:func:`data_aware_transform`); F is a buffer, not trained — fold it into
    the training of M or ``q_proj`` as you see fit.
    """

    mixer_name = "darkformer"

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        rope_theta: float = DEFAULT_THETA,
        bias: bool = False,
        chunk_size: int = 64,
        num_features: int = 64,
        projection: str = "orthogonal",
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            num_kv_heads=num_kv_heads,
            rope_theta=rope_theta,
            bias=bias,
            chunk_size=chunk_size,
            num_features=num_features,
            projection=projection,
        )
        eye = torch.eye(self.head_dim).expand(self.num_heads, -1, -1).clone()
        self.transform = nn.Parameter(eye.clone())
        self.register_buffer("query_fold", eye, persistent=True)

    def _transform(self) -> Tensor:
        return self.transform

    def _queries(self, q: Tensor) -> Tensor:
        # q ← F q per head, at least in the fold's precision (not bf16 under autocast)
        with torch.autocast(q.device.type, enabled=False):
            dtype = torch.promote_types(q.dtype, self.query_fold.dtype)
            return torch.einsum("hij,bthj->bthi", self.query_fold.to(dtype), q.to(dtype))

    @torch.no_grad()
    def qk_samples(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """Calibration samples for :meth:`whiten_`: the rotated (RoPE, positions from 0) queries
        ``[B·T, H, d]`` — before the fold — and keys ``[B·T, H_kv, d]`` of ``hidden_states``."""
        self._check_hidden_states(hidden_states)
        batch, length, _ = hidden_states.shape
        positions = torch.arange(length, device=hidden_states.device)
        q = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        q, k = self.rope(q, positions), self.rope(k, positions)
        return q.reshape(batch * length, self.num_heads, self.head_dim), k.reshape(
            batch * length, self.num_kv_heads, self.head_dim
        )

    @torch.no_grad()
    def whiten_(self, q_samples: Tensor, k_samples: Tensor, eps: float = 1e-3) -> "DarkFormerMixer":
        """Data-aware initialisation (SPEC §5): set M = S^{1/2} and F = S⁻¹ from post-RoPE query
        samples ``[N, H, d]`` and key samples ``[N', H_kv, d]`` (see :meth:`qk_samples`), so the
        layer computes the same kernel as with M = F = I while the random features see whitened
        inputs. ``eps`` regularises the second moments relative to their trace (real models have
        exactly-zero q/k dimensions). Returns ``self``; existing caches become stale."""
        if q_samples.dim() == 3 and q_samples.shape[1] != self.num_heads:
            raise ValueError(f"q_samples have {q_samples.shape[1]} heads, this layer has num_heads={self.num_heads}")
        if k_samples.dim() == 3 and k_samples.shape[1] not in (self.num_kv_heads, self.num_heads):
            raise ValueError(
                f"k_samples have {k_samples.shape[1]} heads, expected num_kv_heads={self.num_kv_heads} "
                f"(or num_heads={self.num_heads})"
            )
        if q_samples.dim() == 3 and q_samples.shape[2] != self.head_dim:
            raise ValueError(f"q_samples have head dim {q_samples.shape[2]}, this layer has head_dim={self.head_dim}")
        m, fold = data_aware_transform(q_samples, k_samples, eps)
        self.transform.copy_(m.to(self.transform))
        self.query_fold.copy_(fold.to(self.query_fold))
        return self


__all__ = ["DarkFormerMixer", "PerformerMixer", "data_aware_transform", "regularised_second_moments"]
