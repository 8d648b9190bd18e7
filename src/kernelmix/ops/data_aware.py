"""DARKFormer's data-aware transform (docs/math.md §7): from calibration samples of queries and keys, the
per-head transform M and query fold F that keep the pretrained kernel exactly,
(F q̃)ᵀ MᵀM k̃ = q̃ᵀ k̃, while the random features see better-conditioned inputs.

Samples are ``[N, H, d]`` (tokens × heads × head dim), in the feature space of the op: the queries
as :func:`~kernelmix.ops.random_features.random_feature_attention` receives them, before the fold.
The results are float64 ``[H, d, d]`` tensors for ``random_feature_attention(..., transform=M)``
with queries F q.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..errors import KernelmixError
from ._common import check_tensor


def _check_samples(name: str, x: Any) -> None:
    check_tensor(name, x, "[N, H, d]")
    if x.dim() != 3 or not x.is_floating_point():
        raise KernelmixError(f"{name} must be a floating tensor of shape [N, H, d], got {x.dtype} {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise KernelmixError(f"{name} has no samples (N = 0); calibrate on at least one token")
    finite = torch.isfinite(x).flatten(1).all(-1)  # [N] (one sync; calibration, not a hot path)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[:, 0]
        raise KernelmixError(
            f"{name} holds NaN or ±inf in {bad.numel()} of {x.shape[0]} samples (the first at sample "
            f"{int(bad[0])}); the moments would be NaN (or silently wrong). Calibrate on finite activations: "
            "drop those tokens, or run the calibration forward in float32 if the model overflows in float16/bfloat16"
        )


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
        raise KernelmixError(f"q_samples have head dim {head_dim} but k_samples have {k_samples.shape[2]}")
    if heads % k_samples.shape[1]:
        raise KernelmixError(
            f"q_samples have {heads} heads, k_samples {k_samples.shape[1]}; the query head count must be a "
            f"multiple of the key head count"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise KernelmixError(f"eps must be a positive number (real q/k have exactly-zero dimensions), got {eps!r}")
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
    """docs/math.md §7's function-preserving initialisation: returns ``(M, fold)``, both ``[H, d, d]`` float64.

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


__all__ = ["data_aware_transform", "regularised_second_moments"]
