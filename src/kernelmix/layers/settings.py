"""Names of the layers' options that the configs above them offer as choices, without torch
(the layer modules import torch): :data:`PROJECTIONS`. :mod:`.feature_map` exports it as before."""

from __future__ import annotations

PROJECTIONS = ("orthogonal", "iid")  # the random features' projection W: orthogonal blocks or iid Gaussian

__all__ = ["PROJECTIONS"]
