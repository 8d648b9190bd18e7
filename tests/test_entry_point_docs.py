"""The library's main entry points, and every public function of ``kernelmix.pretrained``,
``kernelmix.evaluate`` and ``kernelmix.training``, say what each argument is and what they return
(Args / Returns sections naming every parameter), as the ops do (tests/ops/test_return_types.py)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from kernelmix.evaluate import evaluate_loss
from kernelmix.generate import generate
from kernelmix.pretrained import finetune, load_pretrained
from kernelmix.training import train

ENTRY_POINTS = {fn.__name__: fn for fn in (train, generate, evaluate_loss, load_pretrained, finetune)}

PACKAGES = ("kernelmix.pretrained", "kernelmix.evaluate", "kernelmix.training")


def public_functions() -> dict[str, object]:
    """``package.name`` → each plain function in the package's ``__all__`` that takes a parameter."""
    found = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) and inspect.signature(obj).parameters:
                found[f"{package}.{name}"] = obj
    return found


PUBLIC_FUNCTIONS = public_functions()


def check_args_and_returns(fn) -> None:
    doc = inspect.getdoc(fn)
    assert doc and "\nArgs:\n" in doc and "\nReturns:\n" in doc
    args = doc.split("\nArgs:\n", 1)[1].split("\nReturns:\n", 1)[0]
    named = {part.strip() for line in args.splitlines() if line.startswith("    ") and not line.startswith("        ")
             for part in line.strip().split(":", 1)[0].split(",")}
    assert set(inspect.signature(fn).parameters) <= named, set(inspect.signature(fn).parameters) - named


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_parameter_is_named_in_args_and_there_is_a_returns(name):
    check_args_and_returns(ENTRY_POINTS[name])


def test_the_packages_have_public_functions_to_check():
    for package in PACKAGES:
        assert any(name.startswith(package + ".") for name in PUBLIC_FUNCTIONS), package


@pytest.mark.parametrize("name", sorted(PUBLIC_FUNCTIONS))
def test_every_public_function_names_its_parameters_in_args_and_has_a_returns(name):
    check_args_and_returns(PUBLIC_FUNCTIONS[name])
