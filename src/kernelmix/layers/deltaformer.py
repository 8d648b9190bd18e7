"""DeltaFormer layer (docs/math.md §4), a baseline."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from ..ops.deltaformer import DeltaFormerState, deltaformer_attention, deltaformer_attention_step
from .base import MixerLayer, check_choice, check_solve_operands, init_linear
from ..ops import solve_operands
from .rope import RopeTables

W_CHOICES = ("k", "q")


class DeltaFormerMixer(MixerLayer):
    """DeltaFormer: u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(w_i·k_j/√d) u_j, then
    O = causal softmax(q kᵀ/√d) U (docs/math.md §4).

    Keyword-only arguments: the shared ones (``hidden_size``, ``num_heads``, ``head_dim=None``,
    ``num_kv_heads=None``, ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64``, see
    :class:`MixerLayer`) and

    * ``w="k"``: the solve's query side. ``"k"`` is the K–K form of the paper; ``"q"`` uses the
      (RoPE-rotated) query, the Q–K variant some libraries use.
    * ``solve_operands=None``: the Triton solve's tensor-core operands ("tf32", "bf16" or "fp32"; None:
      the default, TF32, or the caller's :func:`kernelmix.ops.solve_operands` block; docs/gpu.md).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``beta_proj`` (W_β: D → H, no
    bias; β = sigmoid(W_β x) per token and query head). Cache state:
    :class:`~kernelmix.ops.deltaformer.DeltaFormerState`.
    """

    mixer_name = "deltaformer"
    OPTIONS = ("w", "solve_operands")  # its own keyword arguments (the shared ones: ``SHARED_OPTIONS``)

    def __init__(self, *, w: str = "k", solve_operands: str | None = None, **shared: Any) -> None:
        super().__init__(**shared)
        self.w = check_choice("w", w, W_CHOICES)
        self.solve_operands = check_solve_operands(solve_operands)
        self.beta_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)

    def extra_repr(self) -> str:
        operands = "" if self.solve_operands is None else f", solve_operands={self.solve_operands!r}"
        return f"{super().extra_repr()}, w={self.w!r}{operands}"

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """The projections as :meth:`MixerLayer.reset_parameters`, then ``beta_proj`` like q/k/v."""
        super().reset_parameters(std, out_std)
        init_linear(self.beta_proj, std)

    def _extras(self, hidden_states: Tensor, *, q: Tensor, k: Tensor, k_raw: Tensor, rotary: RopeTables) -> dict:
        return {"beta": torch.sigmoid(self.beta_proj(hidden_states)), "w": q if self.w == "q" else None}

    def _parallel(self, q: Tensor, k: Tensor, v: Tensor, extras: dict) -> tuple[Tensor, DeltaFormerState]:
        with solve_operands(self.solve_operands):  # (inside the layer: a recomputed forward enters it again)
            return deltaformer_attention(
                q, k, v, beta=extras["beta"], w=extras["w"], chunk_size=self.chunk_size,
                doc_start=extras["doc_start"], backend=self.backend, return_state=True,
            )

    def _step(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, DeltaFormerState]:
        return deltaformer_attention_step(q, k, v, state, beta=extras["beta"], w=extras["w"],
                                          doc_start=extras["doc_start"])

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, DeltaFormerState):
            raise KernelmixError(
                f"a deltaformer layer's cache state must be a DeltaFormerState, got {type(state).__name__}"
            )


__all__ = ["DeltaFormerMixer"]
