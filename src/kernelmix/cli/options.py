"""Command-line options built from config dataclasses (see :mod:`kernelmix.config`): one option
per field, so no option is written twice.

    add_options(parser, DemoOptions)           # --length, --head-dim, ... from the fields
    config = from_args(DemoOptions, args)      # the dataclass, validated by kernelmix.config

The flag is the field's name (``head_dim`` → ``--head-dim``) unless ``Arg(flag=...)`` says
otherwise; the type and bounds come from the annotation, the help from ``Field(description=...)``
and the default shown in the help from the dataclass. A bool that defaults to false is a switch
(``--force``); one that defaults to true is switched off (``--no-memory``). Lists are written
comma-separated (``--lengths 256,512``). A scalar :class:`~kernelmix.config.Choice` becomes
argparse's ``choices``. The parser only turns text into values (``--length x`` is refused
there); the bounds, choices of list items and the checks between fields are the dataclass's, so
they hold for library callers too. Options that are not given are left out of the namespace, so
the dataclass's own default applies.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any

from ..config import (Arg, Field, FieldError, PositiveInt, Spec, accepts, choice_of, expectation, item_type, specs,
                      union_members, unwrap)
from ..errors import KernelmixError


# the --threads option of the commands that compute (one spelling, one help text)
Threads = Annotated[PositiveInt | None, Arg(metavar="N", parse_bounds=True), Field(description=(
    "torch CPU threads (default: auto, the cores the machine's load leaves idle at the start, at most torch's "
    "default; on a shared machine 1 is often fastest)"))]


class OptionError(argparse.ArgumentTypeError, ValueError):
    """A bad option value: argparse shows its message, and code that calls a parser directly can
    catch it as the ValueError it is."""


def add_options(parser: argparse.ArgumentParser, *configs: type, exclude: tuple[str, ...] = ()) -> None:
    """One option (or positional argument) per command-line field of each dataclass in ``configs``
    (``exclude``: fields the command sets itself). Two dataclasses with a field of the same name
    are an argparse error: an option is defined once."""
    groups: dict[str, Any] = {}
    for cls in configs:
        for s in specs(cls):
            if not s.arg.cli or s.name in exclude:
                continue
            target = parser
            if s.arg.group is not None:
                if s.arg.group not in groups:
                    groups[s.arg.group] = parser.add_mutually_exclusive_group()
                target = groups[s.arg.group]
            if s.arg.positional:
                target.add_argument(s.name, **_kwargs(s))
            else:
                target.add_argument(flag(s), dest=s.name, default=argparse.SUPPRESS, **_kwargs(s))


def from_args(cls: type, args: argparse.Namespace, factory: Any = None, **values: Any) -> Any:
    """The ``cls`` instance of the options given in ``args`` (and ``values``, set by the command),
    validated; ``factory``: what builds it from those keywords (default ``cls``, e.g. a
    ``quick`` classmethod). A bad value raises a KernelmixError (a ValueError) naming the option:
    ``--length must be a positive integer, got 0``."""
    given = {s.name: getattr(args, s.name) for s in specs(cls) if s.arg.cli and hasattr(args, s.name)}
    try:
        config = (factory or cls)(**given, **values)
        validate = getattr(config, "validate", None)  # configs that are checked on demand, not when built
        if callable(validate):
            validate()
    except FieldError as error:
        s = error.spec
        if s.owner is not cls or not s.arg.cli or s.title is not None:
            raise
        raise KernelmixError(error.message(flag(s))) from None
    return config


def flag(s: Spec) -> str:
    """The option of field ``s`` as the user writes it."""
    if s.arg.positional:
        return s.arg.metavar or s.name
    if s.arg.flag:
        return s.arg.flag
    name = s.name.replace("_", "-")
    return f"--no-{name}" if unwrap(s.annotation)[0] is bool and s.default is True else f"--{name}"


def _kwargs(s: Spec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": _help(s)}
    base = unwrap(s.annotation)[0]
    if s.arg.metavar or not s.arg.positional and base is not bool and choice_of(s.annotation) is None:
        kwargs["metavar"] = s.arg.metavar or flag(s).lstrip("-").upper().replace("-", "_")
    if base is bool:
        kwargs["action"] = "store_false" if s.default is True else "store_true"
        return kwargs
    if s.arg.repeat:
        kwargs.update(action="append", type=_parser(s, item_type(s.annotation)))
        return kwargs
    kwargs["type"] = _parser(s, s.annotation)
    found = choice_of(s.annotation)
    if found is not None and base is str:
        kwargs["choices"] = found.options
    if s.required and not s.arg.positional:
        kwargs["required"] = True
    return kwargs


def _help(s: Spec) -> str:
    text = s.description
    default = s.default
    shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    if not s.required and not isinstance(shown, bool) and shown not in (None, "") and "default" not in text:
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def _parser(s: Spec, annotation: Any):
    def parse(text: str) -> Any:
        try:
            value = parse_text(annotation, text)
        except ValueError:
            raise OptionError(f"must be {_words(annotation)}, got {text!r}") from None
        if s.arg.parse_bounds and not accepts(annotation, value):
            raise OptionError(f"must be {expectation(annotation)}, got {text!r}")
        return value

    parse.__name__ = s.name
    return parse


def parse_text(annotation: Any, text: str) -> Any:
    """The value of an option's text: ``256,512`` → ``[256, 512]`` for a list of ints. A union
    (``all`` or ``0,5,11``) takes the first member the text is valid for."""
    members = union_members(annotation)
    if members:
        parsed = []
        for member in members:
            try:
                value = parse_text(member, text)
            except ValueError:
                continue
            if accepts(member, value):
                return value
            parsed.append(value)
        if parsed:
            return parsed[0]  # the config's check says what is wrong with it
        raise ValueError(text)
    base = unwrap(annotation)[0]
    item = item_type(annotation)
    if item is not None:
        return [parse_text(item, part.strip()) for part in text.split(",") if part.strip()]
    if base is int:
        return int(text)
    if base is float:
        return float(text)
    return text


def _words(annotation: Any) -> str:
    members = union_members(annotation)
    if members:
        return " or ".join(_words(m) for m in members)
    item = item_type(annotation)
    if item is not None:
        return "comma-separated " + expectation(item, plural=True, constraints=False)
    return expectation(annotation, constraints=False)


__all__ = ["OptionError", "Threads", "add_options", "flag", "from_args", "parse_text"]
