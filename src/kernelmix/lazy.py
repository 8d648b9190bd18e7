"""Importing later: packages whose public names live in submodules imported at their first use, and
work to do once a module is imported, whoever imports it.

    # kernelmix/evaluate/__init__.py
    __getattr__, __dir__ = lazy_names(__name__, {"loss": ["evaluate_loss", ...], "settings": ["TASKS", ...]})

    after_import("torch", lambda: set_threads(4))  # now if torch is imported, else right after it is

``from kernelmix.evaluate import evaluate_loss`` works as before; ``import kernelmix.evaluate.settings``
(what the command line's parsers read) no longer imports torch with the rest of the package.

A public name that is also a submodule's (``kernelmix.pretrained.convert``, the function, and
``kernelmix/pretrained/convert.py``) stays the function: ``lazy_names(..., keep=["convert"])``. Python
binds a submodule on its package when it is first imported, which would otherwise hide the name
once anything imported the submodule (as the eager ``from .convert import convert`` rebound it).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterable


def lazy_names(package: str, modules: dict[str, Iterable[str]], keep: Iterable[str] = ()
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: each name of ``modules[submodule]``
    is that submodule's, imported (and kept on the package) when the name is first read. ``keep``: names
    of ``modules`` that are also submodules of ``package``; the attribute stays the name's value, never
    the submodule (which stays in ``sys.modules``)."""
    owner = {name: module for module, names in modules.items() for name in names}
    kept = frozenset(keep)
    if kept:
        sys.modules[package].__class__ = _names_over_submodules(package, kept)

    def __getattr__(name: str) -> object:
        if name not in owner:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{owner[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(owner))

    return __getattr__, __dir__


def _names_over_submodules(package: str, kept: frozenset[str]) -> type:
    """A module class for ``package`` that does not let the import system bind the submodules named in
    ``kept`` on it (their public names are read through ``__getattr__`` instead)."""

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: object) -> None:
            if name in kept and isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}":
                return
            super().__setattr__(name, value)

    return Package


def after_import(name: str, callback: Callable[[], object]) -> None:
    """Call ``callback()`` once the module ``name`` is imported: now if it already is, else right after
    its first import finishes (one finder per module name at the front of ``sys.meta_path``, removed at
    that import; nothing is called if the import fails)."""
    if sys.modules.get(name) is not None:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    finder.callbacks.append(callback)


class _AfterImport:
    """The finder of :func:`after_import`: it lets the other finders find ``name``, then runs the
    callbacks after the module's code has run."""

    def __init__(self, name: str) -> None:
        self.name, self.callbacks = name, []

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)  # the spec the other finders give
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, callbacks = loader.exec_module, self.callbacks

        def exec_module_then_call(module):
            try:
                exec_module(module)
            finally:
                del loader.exec_module  # back to the loader's own method
            for callback in callbacks:
                callback()

        loader.exec_module = exec_module_then_call
        return spec


__all__ = ["after_import", "lazy_names"]
