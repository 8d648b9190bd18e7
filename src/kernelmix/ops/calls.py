"""Each registered mixer's op, called the one way ``kernelmix bench``, ``demo`` and ``gpu-check`` call it.

    call = registry.op_call("cubit")                # kernelmix.layers.registry names these functions
    out = call(x, chunk_size=64, backend="auto")    # x: the studies' dict of inputs
    _, state = call(prefix, return_state=True)      # a prefill, then one decode token:
    out, state = registry.step_call("cubit")(last, state)

``x`` holds ``q``, ``k``, ``v`` ``[B, T, H, d]`` (keys and values may have fewer heads), ``r``
(the references of Cubit and Cubit-RF, whose ``r`` has the queries' shape), ``rho`` and ``beta``
``[B, T, H]``, ``projection`` (``[m, d]`` or ``[H, m, d]``) and ``transform`` ``[H, d, d]``; a call
reads the ones its op takes. ``chunk_size=None`` and ``backend="auto"`` are the op's defaults;
``reference=True`` calls the op's float64 ``*_naive`` form instead (what ``demo`` checks against).
Other keywords are the layer options a registered :class:`~kernelmix.layers.registry.Variant` sets
(``lrr=False``: Cubit without its learned rates).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .cubit import cubit_attention, cubit_attention_naive, cubit_attention_step
from .cubit_rf import cubit_rf_attention, cubit_rf_attention_naive, cubit_rf_attention_step
from .deltaformer import deltaformer_attention, deltaformer_attention_naive, deltaformer_attention_step
from .random_features import random_feature_attention, random_feature_attention_naive, random_feature_attention_step
from .softmax import softmax_attention, softmax_attention_naive, softmax_attention_step


def _fast(chunk_size: int | None, backend: str, return_state: bool) -> dict[str, Any]:
    """The fast path's keywords: the chunk size only where one is asked for (else the op's default)."""
    return {**({"chunk_size": chunk_size} if chunk_size is not None else {}), "backend": backend,
            "return_state": return_state}


def softmax(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
            return_state: bool = False):
    if reference:
        return softmax_attention_naive(x["q"], x["k"], x["v"])
    return softmax_attention(x["q"], x["k"], x["v"], return_state=return_state)


def softmax_step(x: dict, state) -> tuple[Tensor, Any]:
    return softmax_attention_step(x["q"], x["k"], x["v"], state)


def cubit(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
          return_state: bool = False, lrr: bool = True):
    rates = {"rho": x["rho"]} if lrr else {}  # without LRR: no learned per-token rate
    if reference:
        return cubit_attention_naive(x["q"], x["k"], x["v"], x["r"], **rates)
    return cubit_attention(x["q"], x["k"], x["v"], x["r"], **rates, **_fast(chunk_size, backend, return_state))


def cubit_step(x: dict, state, *, lrr: bool = True) -> tuple[Tensor, Any]:
    return cubit_attention_step(x["q"], x["k"], x["v"], x["r"], state, **({"rho": x["rho"]} if lrr else {}))


def cubit_rf(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
             return_state: bool = False):
    # the layer's defaults: ρ from its LRR gate, one W for the Gram and the read-out, no transform M
    # (data_aware=False), the ops' ridge and reference scale
    if reference:
        return cubit_rf_attention_naive(x["q"], x["k"], x["v"], x["r"], x["projection"], rho=x["rho"])
    return cubit_rf_attention(x["q"], x["k"], x["v"], x["r"], x["projection"], rho=x["rho"],
                              **_fast(chunk_size, backend, return_state))


def cubit_rf_step(x: dict, state) -> tuple[Tensor, Any]:
    return cubit_rf_attention_step(x["q"], x["k"], x["v"], x["r"], x["projection"], state, rho=x["rho"])


def deltaformer(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
                return_state: bool = False):
    if reference:
        return deltaformer_attention_naive(x["q"], x["k"], x["v"], beta=x["beta"])
    return deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], **_fast(chunk_size, backend, return_state))


def deltaformer_step(x: dict, state) -> tuple[Tensor, Any]:
    return deltaformer_attention_step(x["q"], x["k"], x["v"], state, beta=x["beta"])


def _random_features(x: dict, transform: Tensor | None, chunk_size: int | None, backend: str, reference: bool,
                     return_state: bool):
    if reference:
        return random_feature_attention_naive(x["q"], x["k"], x["v"], x["projection"], transform=transform)
    return random_feature_attention(x["q"], x["k"], x["v"], x["projection"], transform=transform,
                                    **_fast(chunk_size, backend, return_state))


def performer(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
              return_state: bool = False):
    return _random_features(x, None, chunk_size, backend, reference, return_state)


def performer_step(x: dict, state) -> tuple[Tensor, Any]:
    return random_feature_attention_step(x["q"], x["k"], x["v"], x["projection"], state)


def darkformer(x: dict, *, chunk_size: int | None = None, backend: str = "auto", reference: bool = False,
               return_state: bool = False):
    return _random_features(x, x["transform"], chunk_size, backend, reference, return_state)


def darkformer_step(x: dict, state) -> tuple[Tensor, Any]:
    return random_feature_attention_step(x["q"], x["k"], x["v"], x["projection"], state, transform=x["transform"])


__all__ = ["cubit", "cubit_rf", "cubit_rf_step", "cubit_step", "darkformer", "darkformer_step", "deltaformer",
           "deltaformer_step", "performer", "performer_step", "softmax", "softmax_step"]
