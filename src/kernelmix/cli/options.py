"""Argument types shared by the subcommands: each parses one string and says what is wrong."""

from __future__ import annotations

import argparse
import math


class OptionError(argparse.ArgumentTypeError, ValueError):
    """A bad option value: argparse shows its message, and code that calls a parser directly can
    catch it as the ValueError it is."""


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise OptionError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise OptionError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise OptionError(f"must be an integer >= 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptionError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise OptionError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """Comma-separated positive finite numbers: learning rates."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise OptionError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise OptionError(f"learning rates must be positive numbers, got {text!r}")
    return values


def mixer_list(text: str) -> list[str]:
    from ..layers import MIXERS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MIXERS]
    if unknown or not names:
        raise OptionError(
            f"unknown mixer(s) {', '.join(repr(n) for n in unknown) or repr(text)} (choose from: {', '.join(MIXERS)})"
        )
    return names


__all__ = ["OptionError", "float_list", "int_list", "mixer_list", "non_negative_int", "positive_int"]
