"""Softmax attention layer (docs/math.md §2), the baseline."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..errors import KernelmixError
from ..ops.softmax import SoftmaxState, softmax_attention, softmax_attention_step
from .base import MixerLayer


class SoftmaxMixer(MixerLayer):
    """Causal softmax attention with RoPE on q and k; the decode cache is a KV cache.

    Keyword-only arguments (all shared with the other mixers, see :class:`MixerLayer`):
    ``hidden_size``, ``num_heads``, ``head_dim=None``, ``num_kv_heads=None`` (grouped-query
    attention), ``rope_theta=10000.0``, ``bias=False``, ``chunk_size=64`` (unused by this mixer).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``. Cache state: :class:`SoftmaxState`.
    """

    mixer_name = "softmax"
    OPTIONS = ()  # no options of its own

    def _parallel(self, q: Tensor, k: Tensor, v: Tensor, extras: dict) -> tuple[Tensor, SoftmaxState]:
        return softmax_attention(q, k, v, doc_start=extras["doc_start"], return_state=True)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, SoftmaxState]:
        return softmax_attention_step(q, k, v, state, doc_start=extras["doc_start"])

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, SoftmaxState):
            raise KernelmixError(f"a softmax layer's cache state must be a SoftmaxState, got {type(state).__name__}")


__all__ = ["SoftmaxMixer"]
