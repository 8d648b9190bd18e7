"""The library's main entry points say what each argument is and what they return (Args / Returns
sections naming every parameter), as the ops do (tests/ops/test_return_types.py)."""

from __future__ import annotations

import inspect

import pytest

from kernelmix.evaluate import evaluate_loss
from kernelmix.generate import generate
from kernelmix.pretrained import finetune, load_pretrained
from kernelmix.training import train

ENTRY_POINTS = {fn.__name__: fn for fn in (train, generate, evaluate_loss, load_pretrained, finetune)}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_parameter_is_named_in_args_and_there_is_a_returns(name):
    fn = ENTRY_POINTS[name]
    doc = inspect.getdoc(fn)
    assert "\nArgs:\n" in doc and "\nReturns:\n" in doc
    args = doc.split("\nArgs:\n", 1)[1].split("\nReturns:\n", 1)[0]
    named = {part.strip() for line in args.splitlines() if line.startswith("    ") and not line.startswith("        ")
             for part in line.strip().split(":", 1)[0].split(",")}
    assert set(inspect.signature(fn).parameters) <= named, set(inspect.signature(fn).parameters) - named
