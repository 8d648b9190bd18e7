"""Packages whose public names live in submodules imported at their first use.

    # kernelmix/evaluate/__init__.py
    __getattr__, __dir__ = lazy_names(__name__, {"loss": ["evaluate_loss", ...], "settings": ["TASKS", ...]})

``from kernelmix.evaluate import evaluate_loss`` works as before; ``import kernelmix.evaluate.settings``
(what the command line's parsers read) no longer imports torch with the rest of the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable


def lazy_names(package: str, modules: dict[str, Iterable[str]]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: each name of ``modules[submodule]``
    is that submodule's, imported (and kept on the package) when the name is first read."""
    owner = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> object:
        if name not in owner:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{owner[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(owner))

    return __getattr__, __dir__


__all__ = ["lazy_names"]
