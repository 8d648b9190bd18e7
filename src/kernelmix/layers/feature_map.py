"""The random-feature map of Performer (docs/math.md §6) and DARKFormer (docs/math.md §7), in one module.

:class:`RandomFeatureMap` owns what both need besides q, k and v:

* ``projection`` W ``[H, m, d]`` (persistent buffer: saved, so a reloaded model computes the same
  features). It is drawn once at construction — from ``generator``, or torch's default RNG — and
  changes only through an explicit :meth:`~RandomFeatureMap.redraw_`, never inside a forward, so
  every process that loads the same weights (or redraws with the same seeded generator) uses the
  same W.
* with ``data_aware=True`` (DARKFormer), the transform M ``[H, d, d]`` (parameter ``transform``;
  kernel exp(qᵀMᵀMk/√d)) and the query fold F ``[H, d, d]`` (buffer ``query_fold``; the op sees
  F q). Both start at the identity, where DARKFormer equals Performer. :meth:`whiten_` sets them
  from calibration samples by :func:`~kernelmix.ops.data_aware_transform` so that the kernel is
  exactly the original one, (F q̃)ᵀ MᵀM k̃ = q̃ᵀk̃, while the features see better-conditioned inputs.

The attribute names ``projection``, ``transform`` and ``query_fold`` are the keys of saved state
dicts (``blocks.0.mixer.projection``, ``...self_attn.kernelmix_rf.query_fold``): they must not change.

Two kinds of module are random-feature maps: the Performer/DARKFormer layers
(:mod:`kernelmix.layers.random_features`, which also are :class:`~kernelmix.layers.MixerLayer`\\ s)
and a converted Hugging Face model's per-layer kernel
(:class:`kernelmix.pretrained.RandomFeatureKernel`, which adds the host's scaling, masks and cache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from ..ops import check_backend
from ..ops.data_aware import data_aware_transform
from ..ops.random_features import (
    RandomFeatureState,
    gaussian_random_features,
    orthogonal_random_features,
    random_feature_attention,
    random_feature_attention_masked,
    random_feature_attention_step,
)
from .base import check_bool, check_choice, check_positive_int
from .settings import PROJECTIONS


class RandomFeatureMap(nn.Module):
    """W (and, data-aware, M and F) of ``num_heads`` query heads of dim ``head_dim``, and the
    calls into the random-feature ops.

    Keyword-only arguments: ``num_heads``, ``head_dim``, ``num_kv_heads=None`` (= ``num_heads``;
    grouped key/value heads are expanded by the ops), ``num_features=64`` (m per head),
    ``projection="orthogonal"`` (blocks of d orthogonal rows with chi(d) norms) or ``"iid"``
    (Gaussian rows), ``data_aware=False`` (True: DARKFormer's M and F), ``chunk_size=64`` (block
    size of the chunked op; it does not change the result), ``backend="auto"`` (the op's
    implementation, see :mod:`kernelmix.ops`) and ``generator`` (the draw of W;
    None: torch's default RNG).

    The ops take queries after the fold (:meth:`fold_queries`): :meth:`attend_causal` (the
    chunked op, or one decode step from a state) and :meth:`attend_masked` (any mask, densely).
    This class has no ``forward``: a layer that is also a map keeps its own.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        num_features: int = 64,
        projection: str = "orthogonal",
        data_aware: bool = False,
        chunk_size: int = 64,
        backend: str = "auto",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.num_kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.backend = check_backend(backend)
        self.init_feature_map(num_features=num_features, projection=projection, data_aware=data_aware,
                              generator=generator)

    def init_feature_map(
        self, *, num_features: int, projection: str, data_aware: bool, generator: torch.Generator | None = None
    ) -> None:
        """Register W (drawn now) and, when ``data_aware``, M = F = I. Needs ``num_heads``,
        ``head_dim``, ``num_kv_heads`` and ``chunk_size`` set: :meth:`__init__` sets them, a layer
        that is also a map (:class:`~kernelmix.layers.PerformerMixer`) has them from its own
        constructor and calls this after it."""
        self.num_features = check_positive_int("num_features", num_features)
        self.projection_kind = check_choice("projection", projection, PROJECTIONS)
        self.data_aware = check_bool("data_aware", data_aware)
        self.register_buffer("projection", self.draw_projection(generator), persistent=True)
        if self.data_aware:
            eye = torch.eye(self.head_dim).expand(self.num_heads, -1, -1).clone()
            self.transform = nn.Parameter(eye.clone())
            self.register_buffer("query_fold", eye, persistent=True)
        else:  # Performer: no M, no F (None entries are not part of the state dict)
            self.register_parameter("transform", None)
            self.register_buffer("query_fold", None, persistent=True)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"{self.feature_repr()}"
        )

    def feature_repr(self) -> str:
        return f"num_features={self.num_features}, projection={self.projection_kind!r}, data_aware={self.data_aware}"

    # ----------------------------------------------------------------------------------------
    # W, M, F

    def draw_projection(self, generator: torch.Generator | None = None, num_features: int | None = None) -> Tensor:
        """A new W ``[H, m, d]`` (m = ``num_features``, default this map's), not installed: drawn in
        float64 on the CPU from ``generator`` (None: torch's default RNG), so it does not depend on
        the map's dtype or device, then cast to those of the current W (default dtype, CPU, before
        there is one)."""
        m = self.num_features if num_features is None else check_positive_int("num_features", num_features)
        current = getattr(self, "projection", None)
        dtype = torch.get_default_dtype() if current is None else current.dtype
        device = None if current is None else current.device
        draw = orthogonal_random_features if self.projection_kind == "orthogonal" else gaussian_random_features
        return draw(m, self.head_dim, num_heads=self.num_heads, generator=generator, dtype=dtype, device=device)

    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None, num_features: int | None = None) -> Tensor:
        """Draw a new W in place (keeping its dtype and device; another ``num_features`` replaces the
        buffer) and return it. With a seeded CPU ``generator`` every process draws the same W.
        M and F are kept. Caches built with the old W must not be continued."""
        new = self.draw_projection(generator, num_features)
        if new.shape == self.projection.shape:
            self.projection.copy_(new)
        else:
            self.projection = new
            self.num_features = new.shape[1]
        return self.projection

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """M = F = I (data-aware maps; nothing for Performer). W is kept: :meth:`redraw_` changes it."""
        if self.data_aware:
            eye = torch.eye(self.head_dim, dtype=self.transform.dtype, device=self.transform.device)
            self.transform.copy_(eye.expand_as(self.transform))
            self.query_fold.copy_(eye.expand_as(self.query_fold))

    @torch.no_grad()
    def whiten_(self, q_samples: Tensor, k_samples: Tensor, eps: float = 1e-3) -> "RandomFeatureMap":
        """Data-aware initialisation (docs/math.md §7): M = S^{1/2} and F = S⁻¹ from query samples
        ``[N, H, d]`` as the op receives them before the fold, and key samples ``[N', H_kv, d]``, so
        the map computes the same kernel as with M = F = I while the random features see whitened
        inputs. ``eps`` regularises the second moments relative to their trace (real models have
        exactly-zero q/k dimensions). Returns ``self``; existing caches become stale."""
        if not self.data_aware:
            raise KernelmixError("whiten_ needs a data-aware map (DARKFormer); a Performer map has no transform M")
        for name, samples in (("q_samples", q_samples), ("k_samples", k_samples)):
            if not isinstance(samples, Tensor):
                raise KernelmixError(
                    f"{name} must be a torch.Tensor of shape [N, H, d], got {type(samples).__name__}; pass a "
                    f"torch.Tensor (e.g. from {type(self).__name__}.qk_samples)"
                )
        expected = (  # (samples, dim, allowed sizes, what the layer has)
            ("q_samples", q_samples, 1, (self.num_heads,), f"num_heads={self.num_heads}"),
            ("k_samples", k_samples, 1, (self.num_kv_heads, self.num_heads),
             f"num_kv_heads={self.num_kv_heads} (or num_heads={self.num_heads})"),
            ("q_samples", q_samples, 2, (self.head_dim,), f"head_dim={self.head_dim}"),
        )
        for name, samples, dim, allowed, layer_has in expected:
            if samples.dim() == 3 and samples.shape[dim] not in allowed:
                size = f"{samples.shape[dim]} heads" if dim == 1 else f"head dim {samples.shape[dim]}"
                raise KernelmixError(f"{name} have {size}, this layer has {layer_has}: take the samples from this "
                                     "layer's own q and k")
        m, fold = data_aware_transform(q_samples, k_samples, eps)
        self.transform.copy_(m.to(self.transform))
        self.query_fold.copy_(fold.to(self.query_fold))
        return self

    # ----------------------------------------------------------------------------------------
    # the ops

    def fold_queries(self, q: Tensor, fold: Tensor | None = None) -> Tensor:
        """F q per head for ``q`` ``[B, T, H, d]`` (``fold`` overrides F, e.g. while training it; no
        F: q unchanged), at least in the fold's precision and outside autocast (not bf16)."""
        fold = self.query_fold if fold is None else fold
        if fold is None:
            return q
        with torch.autocast(q.device.type, enabled=False):
            dtype = torch.promote_types(q.dtype, fold.dtype)
            return torch.einsum("hij,bthj->bthi", fold.to(dtype), q.to(dtype))

    def attend_causal(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        doc_start: Tensor | None = None,
        state: RandomFeatureState | None = None,
        return_state: bool = False,
        transform: Tensor | None = None,
    ) -> Any:
        """Causal random-feature attention with this map's W and M (``transform`` overrides M):
        ``q`` ``[B, T, H, d]`` (folded), ``k``, ``v`` ``[B, T, H_kv, d]``. One decode step
        (:func:`~kernelmix.ops.random_feature_attention_step`) for a single token after ``state``,
        else the chunked op (continuing ``state`` if given). Returns the output ``[B, T, H, d_v]``,
        or ``(output, state)`` with ``return_state``."""
        transform = self.transform if transform is None else transform
        if state is not None and q.shape[1] == 1:
            out, new_state = random_feature_attention_step(
                q, k, v, self.projection, state, transform=transform, doc_start=doc_start
            )
            return (out, new_state) if return_state else out
        return random_feature_attention(
            q, k, v, self.projection, transform=transform, chunk_size=self.chunk_size, doc_start=doc_start,
            initial_state=state, return_state=return_state, backend=self.backend,
        )

    def attend_masked(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, transform: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Random-feature attention under any bool ``mask`` ``[B, T, L]`` (True: query t reads key
        l), densely (:func:`~kernelmix.ops.random_feature_attention_masked`): ``q`` ``[B, T, H, d]``
        (folded), ``k``, ``v`` ``[B, L, H_kv, d]``. Returns ``(out [B, T, H, d_v], weights [B, H, T, L])``."""
        transform = self.transform if transform is None else transform
        return random_feature_attention_masked(q, k, v, self.projection, mask, transform=transform)


__all__ = ["PROJECTIONS", "RandomFeatureMap"]
