"""Random-feature layers: Performer (docs/math.md §6) and DARKFormer (docs/math.md §7).

Each is a :class:`~kernelmix.layers.MixerLayer` (projections, RoPE, cache) and a
:class:`~kernelmix.layers.feature_map.RandomFeatureMap` (the projection W, DARKFormer's transform M
and query fold F, redraw and whitening, the calls into the ops): the layer computes q, k, v and
hands them to the map. DARKFormer is Performer with a data-aware map. The map is a base class,
not a submodule, so that its tensors keep the state-dict keys models were saved with
(``blocks.0.mixer.projection``, ``.transform``, ``.query_fold``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import KernelmixError
from ..ops.random_features import RandomFeatureState
from .base import MixerLayer
from .feature_map import RandomFeatureMap


class PerformerMixer(MixerLayer, RandomFeatureMap):
    """Performer (FAVOR+): causal attention with positive random features φ(x) = m^{-1/2}
    exp(W x̃ − ½‖x̃‖²), x̃ = d^{-1/4} x, an unbiased estimate of the softmax kernel (docs/math.md §6).

    Keyword-only arguments: the shared ones (``hidden_size``, ``num_heads``, ``head_dim=None``,
    ``num_kv_heads=None``, ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64``, see
    :class:`MixerLayer`) and

    * ``num_features=64``: m, random features per head (> 0).
    * ``projection="orthogonal"``: orthogonal random features (blocks of d orthogonal rows with
      chi(d) norms), or ``"iid"`` Gaussian rows.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``. Buffer: ``projection`` W
    ``[H, m, d]`` (persistent; one independent draw per query head, from torch's default RNG at
    construction; :meth:`~RandomFeatureMap.redraw_` draws another). Cache state:
    :class:`~kernelmix.ops.random_features.RandomFeatureState` (O(m·d) per head, independent of
    the number of tokens).
    """

    mixer_name = "performer"
    #: whether the feature map has DARKFormer's transform M and query fold F
    DATA_AWARE = False
    #: its own keyword arguments (``__init__``'s, in order; the shared ones: ``SHARED_OPTIONS``); DARKFormer's too
    OPTIONS = ("num_features", "projection")

    def __init__(self, *, num_features: int = 64, projection: str = "orthogonal", **shared: Any) -> None:
        super().__init__(**shared)  # MixerLayer: the shared arguments (a typo is a TypeError there)
        self.init_feature_map(num_features=num_features, projection=projection, data_aware=self.DATA_AWARE)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_features}, projection={self.projection_kind!r}"

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """The projections as :meth:`MixerLayer.reset_parameters`, M = F = I; W is kept."""
        MixerLayer.reset_parameters(self, std, out_std)
        RandomFeatureMap.reset_parameters(self)

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, RandomFeatureState]:
        q = self.fold_queries(q)
        return self.attend_causal(q, k, v, doc_start=extras["doc_start"], state=state, return_state=True)

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, RandomFeatureState):
            raise KernelmixError(
                f"a {self.mixer_name} layer's cache state must be a RandomFeatureState, got {type(state).__name__}"
            )
        if state.S.dim() != 4 or state.S.shape[2] != self.num_features:
            raise KernelmixError(
                f"cache holds {state.S.shape[2] if state.S.dim() == 4 else '?'} random features, this layer has "
                f"num_features={self.num_features}"
            )


class DarkFormerMixer(PerformerMixer):
    """DARKFormer: data-aware random features, φ_Σ(x) = m^{-1/2} exp(W M x̃ − ½‖M x̃‖²), an
    unbiased estimate of exp(qᵀΣk/√d) with Σ = MᵀM (docs/math.md §7).

    Keyword-only arguments: exactly those of :class:`PerformerMixer` (``num_features=64``,
    ``projection="orthogonal"|"iid"`` and the shared ones).

    Parameters: those of Performer and ``transform`` M ``[H, d, d]`` (per query head, init
    identity: a fresh layer equals Performer with the same weights and projection). Buffers:
    ``projection`` W ``[H, m, d]`` and ``query_fold`` F ``[H, d, d]`` (init identity; the rotated
    queries are replaced by F q before the features). :meth:`~RandomFeatureMap.whiten_` sets M and
    F from calibration samples (:meth:`qk_samples`); F is a buffer, not trained — fold it into
    the training of M or ``q_proj`` as you see fit.
    """

    mixer_name = "darkformer"
    DATA_AWARE = True

    @torch.no_grad()
    def qk_samples(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """Calibration samples for :meth:`~RandomFeatureMap.whiten_`: the rotated (RoPE, positions
        from 0) queries ``[B·T, H, d]`` — before the fold — and keys ``[B·T, H_kv, d]`` of
        ``hidden_states``."""
        self._check_hidden_states(hidden_states)
        batch, length, _ = hidden_states.shape
        positions = torch.arange(length, device=hidden_states.device)
        q = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        q, k = self.rope(q, positions), self.rope(k, positions)
        return q.reshape(batch * length, self.num_heads, self.head_dim), k.reshape(
            batch * length, self.num_kv_heads, self.head_dim
        )


__all__ = ["DarkFormerMixer", "PerformerMixer"]
