"""One return type per value of ``return_state``: every public op that has the argument declares two
``typing.overload`` s, ``Literal[False]`` → ``Tensor`` and ``Literal[True]`` → ``(Tensor, its State)``,
the same way for all (docs/library.md says what an op returns)."""

from __future__ import annotations

import importlib
import inspect
import typing

import pytest
import torch

from kernelmix import ops

MODULES = ("softmax", "cubit", "deltaformer", "random_features", "cubit_rf", "window_features")


def _ops_with_return_state() -> dict[str, object]:
    found = {}
    for name in MODULES:
        module = importlib.import_module(f"kernelmix.ops.{name}")
        for attr, fn in vars(module).items():
            if (inspect.isfunction(fn) and fn.__module__ == module.__name__ and not attr.startswith("_")
                    and "return_state" in inspect.signature(fn).parameters):
                found[f"{name}.{attr}"] = fn
    return found


OPS = _ops_with_return_state()


def test_the_ops_with_return_state():
    assert sorted(OPS) == ["cubit.cubit_attention", "cubit_rf.cubit_rf_attention", "deltaformer.deltaformer_attention",
                           "random_features.random_feature_attention", "softmax.softmax_attention",
                           "window_features.window_feature_attention"]


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_has_the_two_overloads(name):
    fn = OPS[name]
    first, second = typing.get_overloads(fn)
    state = second.__annotations__["return"].removeprefix("tuple[Tensor, ").removesuffix("]")
    assert state.endswith("State") and hasattr(importlib.import_module(fn.__module__), state)
    assert first.__annotations__["return_state"] == "Literal[False]" and first.__annotations__["return"] == "Tensor"
    assert second.__annotations__["return_state"] == "Literal[True]"
    assert fn.__annotations__["return"] == f"Tensor | tuple[Tensor, {state}]"
    # the overloads take the implementation's positional parameters, return_state, and **options: a
    # TypedDict whose keys are exactly the implementation's other keywords, with the same annotations
    real = inspect.signature(fn).parameters
    keywords = [p for p, param in real.items() if param.kind is param.KEYWORD_ONLY and p != "return_state"]
    positional = [p for p, param in real.items() if param.kind is param.POSITIONAL_OR_KEYWORD]
    for overload in (first, second):
        params = inspect.signature(overload).parameters
        assert list(params) == [*positional, "return_state", "options"]
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
        options_type = getattr(importlib.import_module(fn.__module__), _unpacked(overload.__annotations__["options"]))
        annotations = {key: _text(value) for key, value in options_type.__annotations__.items()}
        assert list(annotations) == keywords
        assert all(annotations[key].removeprefix("Required[").removesuffix("]") == fn.__annotations__[key]
                   for key in keywords)
        assert options_type.__total__ is False and all(p in options_type.__optional_keys__ or real[p].default is
                                                       inspect.Parameter.empty for p in keywords)
    assert inspect.signature(first).parameters["return_state"].default is False
    assert inspect.signature(second).parameters["return_state"].default is inspect.Parameter.empty


def _unpacked(annotation: str) -> str:
    assert annotation.startswith("Unpack[") and annotation.endswith("]"), annotation
    return annotation.removeprefix("Unpack[").removesuffix("]")


def _text(annotation) -> str:
    return annotation.__forward_arg__ if isinstance(annotation, typing.ForwardRef) else str(annotation)


def test_what_the_annotation_says_is_what_runs():
    torch.manual_seed(0)
    q, k, v, r = (torch.randn(1, 5, 2, 4) for _ in range(4))
    out = ops.cubit_attention(q, k, v, r)
    assert isinstance(out, torch.Tensor)
    out2, state = ops.cubit_attention(q, k, v, r, return_state=True)
    assert isinstance(state, ops.cubit.CubitState) and torch.equal(out, out2)
    out = ops.softmax_attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert isinstance(ops.softmax_attention(q, k, v, return_state=True)[1], ops.softmax.SoftmaxState)


def _steps() -> dict[str, object]:
    """Each op's ``*_step`` (the one-token decode beside it)."""
    steps = {}
    for key, fn in OPS.items():
        module = importlib.import_module(f"kernelmix.ops.{key.split('.')[0]}")
        steps[f"{key}_step"] = getattr(module, f"{fn.__name__}_step")
    return steps


def _references() -> dict[str, object]:
    """Each op's dense ``*_naive`` reference."""
    out = {}
    for key, fn in OPS.items():
        module = importlib.import_module(f"kernelmix.ops.{key.split('.')[0]}")
        if hasattr(module, f"{fn.__name__}_naive"):
            out[f"{key}_naive"] = getattr(module, f"{fn.__name__}_naive")
    return out


DOCUMENTED = {**OPS, **_steps(), **_references()}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_fast_path_step_and_reference_documents_every_argument_and_what_it_returns(name):
    """Args/Returns sections: every parameter named at the start of an Args entry."""
    fn = DOCUMENTED[name]
    doc = inspect.getdoc(fn)
    assert "\nArgs:\n" in doc and "\nReturns:\n" in doc, name
    args = doc.split("\nArgs:\n", 1)[1].split("\nReturns:\n", 1)[0]
    entries = [line.strip().split(":", 1)[0] for line in args.splitlines() if line.startswith("    ") and
               not line.startswith("        ") and ":" in line]
    named = {part.strip() for entry in entries for part in entry.split(",")}
    assert set(inspect.signature(fn).parameters) <= named, (name, set(inspect.signature(fn).parameters) - named)
