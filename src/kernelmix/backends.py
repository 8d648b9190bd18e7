"""The names of the ops' implementations (``backend=``): plain data, so that :class:`kernelmix.model.ModelConfig`
and the command line offer them without importing torch; :mod:`kernelmix.ops` checks and runs them."""

from __future__ import annotations

BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS"]
