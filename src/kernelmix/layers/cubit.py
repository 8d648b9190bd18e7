"""Cubit layer: attention as kernel ridge regression (docs/math.md §3)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from ..ops import expand_heads
from ..ops.cubit import CubitState, cubit_attention, cubit_attention_step
from .base import MixerLayer, check_bool, check_choice, check_solve_operands, init_linear
from ..ops import solve_operands
from .rope import RopeTables

REFERENCES = ("separate", "key")


class CubitMixer(MixerLayer):
    """Cubit: U = (G + λ_h I)⁻¹ (ρ ⊙ V) with G the causal softmax Gram of the references, then
    O = causal softmax(q kᵀ/√d) U (docs/math.md §3).

    Keyword-only arguments: the shared ones (``hidden_size``, ``num_heads``, ``head_dim=None``,
    ``num_kv_heads=None``, ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64``, see
    :class:`MixerLayer`) and

    * ``reference="separate"``: r = W_R x from its own projection ``r_proj`` (D → H·d, with
      ``bias`` like q/k/v). ``"key"`` is the ablation r = k (expanded to the query heads under
      grouped-query attention); there is no ``r_proj`` then.
    * ``reference_rope=True``: apply RoPE to r (and so r̂). With ``reference="key"`` and
      ``reference_rope=False`` the un-rotated key is the reference.
    * ``lrr=True``: Limited-Range Rescale ρ = lo + (hi − lo)·sigmoid(W_ρ x + b) per token and query
      head, from ``rho_proj`` (D → H, with bias). ``lrr=False`` (Cubit-NoLRR) means ρ ≡ 1 and
      there is no ``rho_proj``. ``rho_proj`` starts with zero weights and the bias that gives
      ρ = 1 (when 1 lies in the range), so a fresh layer starts as Cubit-NoLRR.
    * ``lrr_range=(0.5, 2.0)``: (lo, hi) with 0 < lo < hi.
    * ``ridge=1e-6``: initial ridge λ_h > 0 (learned per head as ``log_ridge``).
    * ``solve_operands=None``: the Triton solve's tensor-core operands ("tf32", "bf16" or "fp32"; None:
      the default, TF32, or the caller's :func:`kernelmix.ops.solve_operands` block; docs/gpu.md).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``r_proj`` (if separate),
    ``rho_proj`` (if lrr), ``log_ref_scale`` [H] (s_h = exp, init 1), ``log_ridge`` [H]
    (λ_h = exp, init log ``ridge``). Cache state: :class:`~kernelmix.ops.cubit.CubitState`.
    """

    mixer_name = "cubit"
    #: its own keyword arguments (``__init__``'s, in order; the shared ones: ``SHARED_OPTIONS``)
    OPTIONS = ("reference", "reference_rope", "lrr", "lrr_range", "ridge", "solve_operands")

    def __init__(
        self,
        *,
        reference: str = "separate",
        reference_rope: bool = True,
        lrr: bool = True,
        lrr_range: tuple[float, float] = (0.5, 2.0),
        ridge: float = 1e-6,
        solve_operands: str | None = None,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        self.solve_operands = check_solve_operands(solve_operands)
        self.reference = check_choice("reference", reference, REFERENCES)
        self.reference_rope = check_bool("reference_rope", reference_rope)
        self.lrr = check_bool("lrr", lrr)
        try:
            lo, hi = (float(x) for x in lrr_range)
        except (TypeError, ValueError):
            raise KernelmixError(f"lrr_range must be a pair (lo, hi) of numbers, got {lrr_range!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
            raise KernelmixError(f"lrr_range (lo, hi) needs 0 < lo < hi (finite), got {lrr_range!r}")
        self.lrr_range = (lo, hi)
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not (math.isfinite(ridge) and ridge > 0):
            raise KernelmixError(f"ridge must be a positive finite number, got {ridge!r}")

        self.initial_ridge = float(ridge)  # reset_parameters returns λ to it

        if self.reference == "separate":
            self.r_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=self.bias)
        else:
            self.register_module("r_proj", None)
        if self.lrr:
            self.rho_proj = nn.Linear(self.hidden_size, self.num_heads, bias=True)
        else:
            self.register_module("rho_proj", None)
        self.log_ref_scale = nn.Parameter(torch.empty(self.num_heads))
        self.log_ridge = nn.Parameter(torch.empty(self.num_heads))
        self._reset_own_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """The projections as :meth:`MixerLayer.reset_parameters`, ``r_proj`` like q/k/v, then the ρ
        gate and the per-head scales at their initial values (ρ = 1, s = 1, λ = ``ridge``)."""
        super().reset_parameters(std, out_std)
        init_linear(self.r_proj, std)
        self._reset_own_parameters()

    @torch.no_grad()
    def _reset_own_parameters(self) -> None:
        if self.rho_proj is not None:
            # ρ = 1 at init: zero weights and sigmoid(b) = (1 − lo) / (hi − lo)
            lo, hi = self.lrr_range
            frac = (1.0 - lo) / (hi - lo)
            nn.init.zeros_(self.rho_proj.weight)
            nn.init.constant_(self.rho_proj.bias, math.log(frac / (1 - frac)) if 0 < frac < 1 else 0.0)
        self.log_ref_scale.zero_()
        self.log_ridge.fill_(math.log(self.initial_ridge))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, reference={self.reference!r}, reference_rope={self.reference_rope}, "
            f"lrr={self.lrr}, lrr_range={self.lrr_range}"
            + ("" if self.solve_operands is None else f", solve_operands={self.solve_operands!r}")
        )

    def _extras(self, hidden_states: Tensor, *, q: Tensor, k: Tensor, k_raw: Tensor, rotary: RopeTables) -> dict:
        batch, length, _ = hidden_states.shape
        if self.reference == "separate":
            r = self.r_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
            if self.reference_rope:
                r = rotary.apply(r)
        else:
            r = expand_heads(k if self.reference_rope else k_raw, self.num_heads)
        rho = None
        if self.lrr:
            lo, hi = self.lrr_range
            rho = lo + (hi - lo) * torch.sigmoid(self.rho_proj(hidden_states))
        return {"r": r, "rho": rho}

    def _coefficients(self) -> dict:
        return {"ridge": self.log_ridge.exp(), "ref_scale": self.log_ref_scale.exp()}

    def _parallel(self, q: Tensor, k: Tensor, v: Tensor, extras: dict) -> tuple[Tensor, CubitState]:
        with solve_operands(self.solve_operands):  # (inside the layer: a recomputed forward enters it again)
            return cubit_attention(
                q, k, v, extras["r"], rho=extras["rho"], chunk_size=self.chunk_size, doc_start=extras["doc_start"],
                backend=self.backend, return_state=True, **self._coefficients(),
            )

    def _step(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, CubitState]:
        return cubit_attention_step(
            q, k, v, extras["r"], state, rho=extras["rho"], doc_start=extras["doc_start"], **self._coefficients()
        )

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, CubitState):
            raise KernelmixError(f"a cubit layer's cache state must be a CubitState, got {type(state).__name__}")


__all__ = ["CubitMixer"]
