"""Rotary position embedding (RoPE), rotate-half form.

For a head vector x ∈ R^d (d even) at integer position p, split x = [x₁, x₂] into halves and
rotate each pair (x₁[i], x₂[i]) by the angle p·θ^{-2i/d}:

    rope(x, p) = x ⊙ cos(p·f) + rotate_half(x) ⊙ sin(p·f),   rotate_half([x₁, x₂]) = [−x₂, x₁]

with f = [f₀ … f_{d/2−1}, f₀ … f_{d/2−1}], f_i = θ^{-2i/d}. The rotation preserves norms and
makes q·k depend only on the relative position of the two tokens.

Positions are absolute token indices: a layer that already holds ``n`` tokens in its cache
rotates the next tokens with positions ``n, n+1, …`` so decode reproduces the full forward.
Angles are computed in float64 for float64 inputs and in float32 otherwise (also for bfloat16
inputs), then cast to the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import KernelmixError

DEFAULT_THETA = 10000.0


def rope_positions(offset: int, length: int, *, device: torch.device | str | None = None) -> Tensor:
    """Integer positions ``offset, …, offset + length − 1`` as a ``[length]`` int64 tensor."""
    return torch.arange(offset, offset + length, dtype=torch.int64, device=device)


def rope_cos_sin(
    positions: Tensor, head_dim: int, *, theta: float = DEFAULT_THETA, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[..., T, head_dim]`` for integer ``positions`` ``[..., T]`` (computed in float64
    when ``dtype`` is float64, else float32, and returned in ``dtype``)."""
    if head_dim % 2:
        raise KernelmixError(f"RoPE needs an even head_dim, got {head_dim}")
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    exponents = torch.arange(0, head_dim, 2, dtype=angle_dtype, device=positions.device) / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)  # [d/2]
    angles = positions.to(angle_dtype)[..., None] * inv_freq  # [..., T, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x₁, x₂] → [−x₂, x₁] over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass(frozen=True)
class RopeTables:
    """The rotation of one set of positions, ready to apply to every tensor rotated at them (a
    layer's q, k and Cubit's r share one): ``cos`` and ``signed_sin`` ``[..., T, 1, d]`` broadcast
    over heads, ``signed_sin = [−sin₁, sin₂]`` so that rotate_half(x) ⊙ sin = roll(x, d/2) ⊙ signed_sin
    — one kernel fewer per rotation than rotate_half's negate-and-concatenate, the same bits."""

    cos: Tensor
    signed_sin: Tensor

    @classmethod
    def at(cls, positions: Tensor, head_dim: int, *, theta: float = DEFAULT_THETA,
           dtype: torch.dtype = torch.float32) -> "RopeTables":
        """The tables for integer ``positions`` ``[T]`` or ``[B, T]`` (see :func:`rope_cos_sin`)."""
        cos, sin = rope_cos_sin(positions, head_dim, theta=theta, dtype=dtype)
        half = head_dim // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cls(cos[..., None, :], signed_sin[..., None, :])

    def apply(self, x: Tensor) -> Tensor:
        """Rotate ``x`` ``[B, T, H, d]``."""
        return x * self.cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * self.signed_sin


def _check_rope_input(x: Tensor, positions: Tensor) -> None:
    if x.dim() != 4:
        raise KernelmixError(f"apply_rope expects [B, T, H, d], got shape {tuple(x.shape)}")
    if tuple(positions.shape) not in ((x.shape[1],), (x.shape[0], x.shape[1])):
        raise KernelmixError(
            f"positions must have shape [T] = ({x.shape[1]},) or [B, T] = {tuple(x.shape[:2])}, "
            f"got {tuple(positions.shape)}"
        )


def apply_rope(x: Tensor, positions: Tensor, *, theta: float = DEFAULT_THETA) -> Tensor:
    """Rotate ``x`` ``[B, T, H, d]`` by its token positions: ``[T]`` (shared by the batch) or
    ``[B, T]`` (per row: left padding, packed documents whose positions restart). To rotate several
    tensors at the same positions, build :class:`RopeTables` once and ``apply`` them to each."""
    _check_rope_input(x, positions)
    return RopeTables.at(positions, x.shape[-1], theta=theta, dtype=x.dtype).apply(x)


__all__ = ["DEFAULT_THETA", "RopeTables", "apply_rope", "rope_cos_sin", "rope_positions", "rotate_half"]
