"""kernelmix: kernel-regression token mixers (Cubit, DARKFormer) and their baselines."""

__version__ = "0.1.0"

# Hugging Face registration (kernelmix.hf) without importing transformers here, so that
# `import kernelmix` stays fast and works without transformers installed. The classes are
# registered with AutoConfig / AutoModelForCausalLM as soon as both packages are imported, in
# either order: now if transformers already is, else right after `import transformers` finishes
# (a one-shot import hook: kernelmix.lazy.after_import). Registering imports transformers' modeling
# code, so it costs what the first use of an Auto class would; `import kernelmix.hf` registers explicitly.

from .lazy import after_import as _after_import


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


_after_import("transformers", _register_with_transformers)
