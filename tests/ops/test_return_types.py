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
    # the overloads take exactly the implementation's parameters, with the same defaults but return_state's
    real = inspect.signature(fn).parameters
    for overload in (first, second):
        params = inspect.signature(overload).parameters
        assert list(params) == list(real)
        assert all(params[p].default == real[p].default for p in real if p != "return_state")
    assert inspect.signature(first).parameters["return_state"].default is False
    assert inspect.signature(second).parameters["return_state"].default is inspect.Parameter.empty


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
