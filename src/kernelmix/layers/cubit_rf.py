"""Cubit-RF layer: Cubit's ridge solve with random-feature kernels, decoding in constant memory (docs/math.md §12).

It is a :class:`~kernelmix.layers.cubit.CubitMixer` (the reference projection and its RoPE, the LRR
gate, the per-head ridge and reference scale) and a
:class:`~kernelmix.layers.feature_map.RandomFeatureMap` (W, optionally DARKFormer's M and F, redraw
and whitening) whose op is :func:`~kernelmix.ops.cubit_rf.cubit_rf_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..errors import KernelmixError
from ..ops.cubit_rf import CubitRFState, cubit_rf_attention, cubit_rf_attention_step
from ..ops.cubit_rf_parts import ESTIMATES, READOUTS, cubit_rf_parts_attention
from .base import check_choice
from .cubit import CubitMixer
from .feature_map import RandomFeatureMap
from .random_features import DarkFormerMixer


@dataclass(frozen=True)
class AblationState:
    """The cache state of an ablation layer (:attr:`CubitRFMixer.ablation`): it holds nothing, so that
    a cache built by one is refused rather than read as an empty state."""

    estimate: str
    readout: str = "keys"


class CubitRFMixer(CubitMixer, RandomFeatureMap):
    """Cubit-RF: U = (Ĝ + λ_h I)⁻¹ (ρ ⊙ V) with Ĝ the row-normalised random-feature estimate of
    Cubit's Gram kernel exp(r_iᵀ r̂_j), then the random-feature read-out of U (docs/math.md §12). The
    substitution is a recurrence on an m × d_v state, so the cache has a constant size.

    Keyword-only arguments: the shared ones (``hidden_size``, ``num_heads``, ``head_dim=None``,
    ``num_kv_heads=None``, ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64``,
    ``backend="auto"``, see :class:`MixerLayer`), the random-feature ones

    * ``num_features=64``: m, random features per head (> 0), shared by the Gram and the read-out.
    * ``projection="orthogonal"``: orthogonal random features, or ``"iid"`` Gaussian rows.
    * ``data_aware=False``: True adds DARKFormer's transform M ``[H, d, d]`` (a parameter, init
      identity; the kernels become exp(qᵀΣk/√d) and exp(r_iᵀΣ r̂_j), Σ = MᵀM) and query fold F (a
      buffer, applied to q). :meth:`~RandomFeatureMap.whiten_` (samples from :meth:`qk_samples`) then
      keeps the read-out's kernel exactly, but not the Gram's: M is shared and r is not folded.

    and Cubit's (:class:`CubitMixer`): ``reference="separate"|"key"``, ``reference_rope=True``,
    ``lrr=True``, ``lrr_range=(0.5, 2.0)``, ``ridge=1e-6``; and

    * ``estimate="both"``: which kernels are random-feature estimates. ``"gram"`` (the read-out exact),
      ``"readout"`` (the Gram exact) and ``"none"`` (exact Cubit) are the ablation of
      :mod:`~kernelmix.ops.cubit_rf_parts`: dense T × T, for training short sequences, with no decode cache.
    * ``readout="keys"``: Cubit's read-out over U. ``"reference"`` (the regression's prediction at the
      query) and ``"linear"`` (q kᵀ/√d over U) are read-outs of that same ablation (dense, no decode).

    Parameters: those of :class:`CubitMixer` (and ``transform`` M when ``data_aware``). Buffers:
    ``projection`` W ``[H, m, d]`` (persistent, drawn at construction; :meth:`~RandomFeatureMap.redraw_`
    draws another) and ``query_fold`` F (when ``data_aware``). Cache state:
    :class:`~kernelmix.ops.cubit_rf.CubitRFState`, O(m·d) per head whatever the number of tokens.
    ``backend`` picks the read-out's implementation (the random-feature op's); the solve runs in PyTorch.
    """

    mixer_name = "cubit-rf"
    #: what its registry entry (:class:`~kernelmix.layers.registry.MixerInfo`) says: linear cost as the
    #: random-feature mixers (the registry says why that family, not "solve"), a constant-size cache
    family = "random-features"
    constant_cache = True
    #: its own keyword arguments (``__init__``'s, in order; the shared ones: ``SHARED_OPTIONS``)
    OPTIONS = ("num_features", "projection", "data_aware", "reference", "reference_rope", "lrr", "lrr_range", "ridge",
               "estimate", "readout")

    def __init__(
        self,
        *,
        num_features: int = 64,
        projection: str = "orthogonal",
        data_aware: bool = False,
        reference: str = "separate",
        reference_rope: bool = True,
        lrr: bool = True,
        lrr_range: tuple[float, float] = (0.5, 2.0),
        ridge: float = 1e-6,
        estimate: str = "both",
        readout: str = "keys",
        **shared: Any,
    ) -> None:
        super().__init__(
            reference=reference, reference_rope=reference_rope, lrr=lrr, lrr_range=lrr_range, ridge=ridge, **shared
        )
        self.init_feature_map(num_features=num_features, projection=projection, data_aware=data_aware)
        self.estimate = check_choice("estimate", estimate, ESTIMATES)
        self.readout = check_choice("readout", readout, READOUTS)
        if readout == "linear" and estimate in ("both", "readout"):
            raise KernelmixError("readout='linear' has no kernel to estimate; "
                                 f"use estimate='gram' or 'none', got {estimate!r}")

    # whiten_'s calibration samples: the rotated queries (before the fold) and keys, as DARKFormer's
    qk_samples = DarkFormerMixer.qk_samples

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Cubit's parameters as :meth:`CubitMixer.reset_parameters`, then M = F = I; W is kept."""
        CubitMixer.reset_parameters(self, std, out_std)
        RandomFeatureMap.reset_parameters(self)

    def extra_repr(self) -> str:
        ablation = f", estimate={self.estimate!r}, readout={self.readout!r}" if self.ablation else ""
        return f"{super().extra_repr()}, {self.feature_repr()}{ablation}"

    def _op_options(self, extras: dict) -> dict:
        return {"rho": extras["rho"], "transform": self.transform, "doc_start": extras["doc_start"],
                **self._coefficients()}

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, Any]:
        if self.ablation:  # dense, and a marker state that a later call refuses (_check_cache runs first)
            out = cubit_rf_parts_attention(q, k, v, extras["r"], self.projection, estimate=self.estimate,
                                           readout=self.readout, **self._op_options(extras))
            return out, AblationState(self.estimate, self.readout)
        return cubit_rf_attention(
            q, k, v, extras["r"], self.projection, chunk_size=self.chunk_size, initial_state=state, return_state=True,
            backend=self.backend, **self._op_options(extras),
        )

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, CubitRFState]:
        """The fold F on q, then one decode step (a single token after a cache) or the chunked op,
        continuing ``state`` when there is one (several tokens at once)."""
        q = self.fold_queries(q)
        if state is not None and q.shape[1] == 1:
            return self._step(q, k, v, extras, state)
        return self._chunked(q, k, v, extras, state)

    def _parallel(self, q: Tensor, k: Tensor, v: Tensor, extras: dict) -> tuple[Tensor, CubitRFState]:
        """The whole sequence from an empty state (``q`` already folded)."""
        return self._chunked(q, k, v, extras, None)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, CubitRFState]:
        """One token (T = 1, ``q`` already folded) from ``state``."""
        return cubit_rf_attention_step(q, k, v, extras["r"], self.projection, state, **self._op_options(extras))

    @property
    def ablation(self) -> bool:
        """Whether this layer runs the dense ablation (:mod:`~kernelmix.ops.cubit_rf_parts`) rather than the op."""
        return self.estimate != "both" or self.readout != "keys"

    def _no_cache_message(self) -> str:
        return (f"this {self.mixer_name} layer has estimate={self.estimate!r}, readout={self.readout!r}, a dense "
                "training ablation with no decode cache; decode with estimate='both', readout='keys' (or run the "
                "whole sequence without a cache)")

    def _check_cache(self, cache: Any, batch_size: int) -> None:
        if self.ablation or isinstance(getattr(cache, "state", None), AblationState):
            raise KernelmixError(self._no_cache_message())
        # (its batch check reads a state's first tensor field; ours holds two states)
        super()._check_cache(cache, batch_size)
        state_batch = cache.state.readout.S.shape[0]
        if state_batch != batch_size:
            raise KernelmixError(f"cache was built for batch size {state_batch}, "
                                 f"hidden_states has batch size {batch_size}")

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, CubitRFState):
            raise KernelmixError(f"a {self.mixer_name} layer's cache state must be a CubitRFState, "
                                 f"got {type(state).__name__}")
        features = state.readout.S.shape[2] if state.readout.S.dim() == 4 else "?"
        if features != self.num_features:
            raise KernelmixError(f"cache holds {features} random features, "
                                 f"this layer has num_features={self.num_features}")


__all__ = ["AblationState", "CubitRFMixer"]
