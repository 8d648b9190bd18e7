"""kernelmix: kernel-regression token mixers (Cubit, DARKFormer) and their baselines."""

__version__ = "0.1.0"

# Hugging Face registration (kernelmix.hf) without importing transformers here, so that
# `import kernelmix` stays fast and works without transformers installed. The classes are
# registered with AutoConfig / AutoModelForCausalLM as soon as both packages are imported, in
# either order: now if transformers already is, else right after `import transformers` finishes
# (a one-shot import hook). Registering imports transformers' modeling code, so it costs what the
# first use of an Auto class would; `import kernelmix.hf` registers explicitly.

import sys as _sys


def _register_with_transformers() -> None:
    try:
        from . import hf  # noqa: F401  (registers on import)
    except Exception as error:  # e.g. transformers too old: never break the user's import
        import warnings

        warnings.warn(
            f"kernelmix could not register its models with transformers ({type(error).__name__}: {error}); "
            "`import kernelmix.hf` shows the full error",
            stacklevel=2,
        )


class _RegisterAfterTransformersImport:
    """Meta path finder that lets ``transformers`` import as usual, then registers kernelmix's
    classes with it. It removes itself at the first import of ``transformers``."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        if self in _sys.meta_path:
            _sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)  # the spec the other finders give
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_module_then_register(module):
            try:
                exec_module(module)
            finally:
                del loader.exec_module  # back to the loader's own method
            _register_with_transformers()

        loader.exec_module = exec_module_then_register
        return spec


if _sys.modules.get("transformers") is not None:
    _register_with_transformers()
else:
    _sys.meta_path.insert(0, _RegisterAfterTransformersImport())
