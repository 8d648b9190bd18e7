"""What the configs above the layers read without torch (the layer modules import it): the names they
offer as choices (:data:`PROJECTIONS`, exported by :mod:`.feature_map` as before), the keyword
arguments every mixer takes (:data:`SHARED_OPTIONS`, exported by :mod:`.base` as before) and the
layers' argument checks, :func:`check_head_geometry` among them (:class:`kernelmix.model_config.ModelConfig`
checks every layer's head layout with it; :mod:`.base` exports them as before)."""

from __future__ import annotations

from typing import Any

from ..errors import KernelmixError, check_positive_int  # noqa: F401  (the layers import it from here)

PROJECTIONS = ("orthogonal", "iid")  # the random features' projection W: orthogonal blocks or iid Gaussian

#: The keyword arguments every mixer takes (:class:`~kernelmix.layers.base.MixerLayer`'s ``__init__``,
#: in its order; a test keeps the two equal). A mixer's own ones are its class's ``OPTIONS`` and its
#: registry entry's ``MixerInfo.options``.
SHARED_OPTIONS: tuple[str, ...] = (
    "hidden_size", "num_heads", "head_dim", "num_kv_heads", "rope_theta", "bias", "chunk_size", "backend",
)


# The argument checks of the layers (errors name the argument, the value and what is accepted).


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise KernelmixError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise KernelmixError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_head_geometry(
    hidden_size: Any, num_heads: Any, head_dim: Any = None, num_kv_heads: Any = None
) -> tuple[int, int]:
    """``(head_dim, num_kv_heads)`` of a layer of width ``hidden_size`` with ``num_heads`` query
    heads, the defaults filled in (``hidden_size // num_heads``; ``num_heads``); checked for what
    every mixer needs: an even head dim (RoPE) and query heads in whole groups per key/value head.
    Used by :class:`MixerLayer` and, for every layer at once, by :class:`kernelmix.model.ModelConfig`."""
    hidden_size = check_positive_int("hidden_size", hidden_size)
    num_heads = check_positive_int("num_heads", num_heads)
    if head_dim is None:
        if hidden_size % num_heads:
            raise KernelmixError(
                f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
                f"pass head_dim explicitly or choose num_heads dividing hidden_size"
            )
        head_dim = hidden_size // num_heads
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise KernelmixError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    num_kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise KernelmixError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) for grouped-query "
            f"attention; choose num_kv_heads among the divisors of {num_heads}"
        )
    return head_dim, num_kv_heads


__all__ = ["PROJECTIONS", "SHARED_OPTIONS", "check_bool", "check_choice", "check_head_geometry", "check_positive_int"]
