"""The variants ``kernelmix finetune`` compares (:data:`VARIANTS`, :data:`DEFAULT_VARIANTS`).

Plain data, without torch, for the command line's options; :mod:`kernelmix.studies.finetune` exports
them as before.
"""

from __future__ import annotations

VARIANTS = ("softmax", "performer", "darkformer", "cubit")  # cubit: the experimental conversion
DEFAULT_VARIANTS = ("softmax", "performer", "darkformer")

__all__ = ["DEFAULT_VARIANTS", "VARIANTS"]
