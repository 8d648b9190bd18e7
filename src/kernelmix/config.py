"""One mechanism for configs: a plain dataclass whose fields say their type, bounds and help in
their annotations, checked by pydantic in one place, and turned into command-line options by
:mod:`kernelmix.cli.options` (which no library module imports).

    @dataclass
    class DemoOptions:
        length: Annotated[PositiveInt, Field(description="sequence length")] = 512
        dtype: Annotated[str, Choice(("float32", "bfloat16"), "dtype")] = "float32"
        layers: Annotated[str, Choice(("all", "global"), "layer selection")] | list[int] = "all"

        def __post_init__(self) -> None:
            check(self)  # then the checks that relate fields to each other

:func:`check` validates every field with :class:`pydantic.TypeAdapter` in strict mode (a string
is not an integer, ``1`` is not ``true``), with two allowances for data read from TOML/YAML/JSON
files and ``--set`` values: a list where the field is a tuple (and the reverse), and a whole
float such as ``1e6`` for an integer. A bad value raises :class:`FieldError`, a ``ValueError`` that
names the field, the value and what it should be::

    steps must be a positive integer, got 0
    betas must be two numbers, e.g. betas=[0.9,0.95], got 0.9
    unknown preset 'huge' (choose from: tiny, mini, small, 125m, ...)

The annotations use pydantic's own vocabulary (``Field(gt=0, description=..., title=...,
examples=[...])``); ``title`` names the field in messages, ``examples[0]`` is the fix they show.
Three markers are ours: :class:`Choice` (the value, or every item of a list, is one of a set of
names), :class:`Distinct` (no item of a list is given twice) and :class:`Arg` (how the field appears
on the command line). This module imports neither
torch nor the command line, so every tier can use it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from types import UnionType
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic import BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

from .errors import KernelmixError

# The bounds most fields need, by name (pydantic's Field; ``allow_inf_nan=False``: finite).
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


@dataclass(frozen=True, init=False)
class Choice:
    """Annotation marker: the value (or, for a list, each item) is one of ``options``; ``what``
    names it in the error, ``unknown mixer 'cubt' (choose from: softmax, cubit, ...)``."""

    source: Iterable[str]  # a tuple, or a live view (the mixer registry's) read at each use
    what: str
    more: str = ""  # another kind of value the field takes, for the message: "or a list of indices"

    def __init__(self, options: Iterable[str], what: str, more: str = "") -> None:
        # a registry's view (a Mapping that is not a dict) stays live, so a mixer registered later is accepted
        live = isinstance(options, Mapping) and not isinstance(options, dict)
        object.__setattr__(self, "source", options if live else tuple(options))
        object.__setattr__(self, "what", what)
        object.__setattr__(self, "more", more)

    @property
    def options(self) -> tuple[str, ...]:
        return tuple(self.source)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: Any) -> Any:
        if value is None:  # a field ``X | None`` left unset
            return value
        names = [value] if isinstance(value, str) else list(value)
        unknown = [name for name in names if name not in self.options]
        if unknown:
            what = self.what if isinstance(value, str) else f"{self.what}(s)"
            more = self.more if self.more.startswith(";") else f", {self.more}" if self.more else ""
            raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))} "
                             f"(choose from: {', '.join(self.options)}{more})")
        return value


@dataclass(frozen=True)
class Distinct:
    """Annotation marker: no item of the list is given twice; ``what`` names one item in the error,
    ``[0, 0] repeats 0: list each seed once``. One rule for every list option: a
    repeated item is refused, never run twice nor dropped in silence (either would make a result
    claim what was not asked: one run reported as two seeds, a length evaluated twice)."""

    what: str

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: Any) -> Any:
        if value is None:  # a field ``list[X] | None`` left unset
            return value
        items = list(value)
        repeated = []  # each item given more than once, once, in the order of the list
        for i, item in enumerate(items):
            if item in items[:i] and item not in repeated:
                repeated.append(item)
        if repeated:
            raise ValueError(f"{items} repeats {', '.join(map(repr, repeated))}: list each {self.what} once")
        return value


@dataclass(frozen=True)
class Arg:
    """Annotation marker: how a field appears on the command line. ``flag``: the option's name
    (default ``--field-name``; a bool that defaults to true gets ``--no-field-name``);
    ``positional``: an argument without a flag; ``group``: fields of one group exclude each other;
    ``repeat``: the option may be given several times (a list of the values); ``cli=False``: not
    an option at all (set by the program, not the user); ``parse_bounds``: the field's bounds are
    checked when the option is parsed, for an option that no config is built from (``--threads``)
    and whose value is used before any config's check would see it."""

    flag: str | None = None
    positional: bool = False
    metavar: str | None = None
    group: str | None = None
    repeat: bool = False
    cli: bool = True
    parse_bounds: bool = False


@dataclass(frozen=True)
class Spec:
    """One field of a config dataclass, as the mechanism sees it."""

    owner: type
    name: str
    annotation: Any
    default: Any  # dataclasses.MISSING when the field is required
    description: str
    title: str | None
    example: str | None
    arg: Arg
    adapter: TypeAdapter

    @property
    def label(self) -> str:
        return self.title or self.name

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


class FieldError(KernelmixError):
    """A field's value is wrong: ``<label> must be <expect>, got <value>`` (or, for a value that
    failed a :class:`Choice` or another validator, that validator's own message). A
    :class:`~kernelmix.errors.KernelmixError`: the command line prints it without a traceback."""

    def __init__(self, spec: Spec, value: Any, expect: str | None, message: str | None = None) -> None:
        self.spec, self.value, self.expect, self.custom = spec, value, expect, message
        super().__init__(self.message(spec.label))

    def message(self, label: str) -> str:
        if self.custom is not None:  # a validator's own message: say which option it is about
            return self.custom if label == self.spec.label else f"{label}: {self.custom}"
        example = f", e.g. {self.spec.example}" if self.spec.example else ""
        return f"{label} must be {self.expect}{example}, got {self.value!r}"


# ---------------------------------------------------------------------------------------------
# Reading a dataclass's fields


@functools.cache
def specs(cls: type) -> tuple[Spec, ...]:
    """The fields of the dataclass ``cls`` with their types, help and command-line settings."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        meta = _metadata(annotation)
        infos = [m for m in meta if isinstance(m, FieldInfo)]
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append(Spec(
            owner=cls, name=f.name, annotation=annotation, default=default,
            description=next((i.description for i in reversed(infos) if i.description), ""),
            title=next((i.title for i in reversed(infos) if i.title), None),
            example=next((i.examples[0] for i in reversed(infos) if i.examples), None),
            arg=next((m for m in meta if isinstance(m, Arg)), Arg()),
            adapter=TypeAdapter(_lenient(annotation), config=ConfigDict(strict=True)),
        ))
    return tuple(out)


def check(obj: Any) -> None:
    """Validate every field of the dataclass instance ``obj`` and store the normalised values
    (a list given for a tuple field becomes a tuple, ``1`` for a float field ``1.0``)."""
    for s in specs(type(obj)):
        object.__setattr__(obj, s.name, check_value(s, getattr(obj, s.name)))


def check_value(s: Spec, value: Any) -> Any:
    """``value`` validated as field ``s``, or a :class:`FieldError`."""
    try:
        return s.adapter.validate_python(value)
    except ValidationError as error:
        raise _field_error(s, value, error) from None


def _field_error(s: Spec, value: Any, error: ValidationError) -> FieldError:
    errors = error.errors()
    for e in errors:  # a Choice or another validator wrote its own message, with the fix
        if e["type"] == "value_error":
            return FieldError(s, value, None, str(e["ctx"]["error"]))
    first = errors[0]
    base, _ = unwrap(s.annotation)
    if _members(base):  # no member took the value: say what each takes
        return FieldError(s, value, expectation(s.annotation))
    if first["type"] not in _CONSTRAINT_ERRORS:  # the wrong type: the type's words, "an integer"
        return FieldError(s, value, _wrong_kind(s.annotation, value))
    item = _item_annotation(base)
    if item is not None and first["loc"] and isinstance(first["loc"][0], int):  # one item of a list is wrong
        return FieldError(s, value, expectation(item, plural=True))
    return FieldError(s, value, expectation(s.annotation))


def _wrong_kind(annotation: Any, value: Any) -> str:
    """What a field must be, for a value of the wrong type: the type's words (``an integer``), or for a
    field of names the names themselves (a list for ``mixer`` says ``one of: softmax, cubit, ...``, the
    forms it accepts, not just ``a string``), and that one value is wanted when a list or a mapping came."""
    item = item_type(annotation)
    names = choice_of(annotation) is not None or item is not None and choice_of(item) is not None
    scalar = unwrap(annotation)[0] is str
    words = expectation(annotation, constraints=names)
    if item is None and scalar or unwrap(annotation)[0] in (int, float, bool):
        if isinstance(value, (list, tuple)):
            return f"{words} (one value, not a list)"
        if isinstance(value, dict):
            return f"{words} (one value, not a mapping)"
    return words


_CONSTRAINT_ERRORS = {
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number", "too_short", "too_long",
    "multiple_of",
}


# ---------------------------------------------------------------------------------------------
# Annotations: their parts, their words, the allowances for file and command-line data


def _metadata(annotation: Any) -> list[Any]:
    """The Annotated metadata of a field, also inside ``X | None``."""
    base, meta = _split(annotation)
    for member in get_args(base) if get_origin(base) in (Union, UnionType) else ():
        if member is not type(None):
            meta = meta + _split(member)[1]
    return meta


def _split(annotation: Any) -> tuple[Any, list[Any]]:
    if get_origin(annotation) is Annotated:
        base, *meta = get_args(annotation)
        return base, list(meta)
    return annotation, []


def _without_none(annotation: Any) -> Any:
    base, meta = _split(annotation)
    if get_origin(base) in (Union, UnionType):
        members = [m for m in get_args(base) if m is not type(None)]
        if len(members) == 1:
            return Annotated[(members[0], *meta)] if meta else members[0]
    return annotation


def unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``(type, Annotated metadata)`` of a field, with ``| None`` dropped: ``(list[int], [FieldInfo])``."""
    return _split(_without_none(annotation))


def union_members(annotation: Any) -> list[Any]:
    """The members of a union of two or more types (not counting None); [] for anything else."""
    return _members(unwrap(annotation)[0])


def item_type(annotation: Any) -> Any | None:
    """The item type of ``list[X]`` / ``tuple[X, ...]`` / ``tuple[X, X]``; None for anything else."""
    base = unwrap(annotation)[0]
    args = get_args(base)
    return _item_annotation(base) or (args[0] if get_origin(base) is tuple and args else None)


def accepts(annotation: Any, value: Any) -> bool:
    """Whether ``value`` is valid for ``annotation`` (under the same rules as :func:`check`)."""
    try:
        TypeAdapter(_lenient(annotation), config=ConfigDict(strict=True)).validate_python(value)
    except ValidationError:
        return False
    return True


def _members(base: Any) -> list[Any]:
    """The members of a union of two or more types (not counting None)."""
    if get_origin(base) in (Union, UnionType):
        members = [m for m in get_args(base) if m is not type(None)]
        return members if len(members) > 1 else []
    return []


def _item_annotation(base: Any) -> Any | None:
    """The item type of ``list[X]`` / ``tuple[X, ...]``; None for anything else."""
    origin, args = get_origin(base), get_args(base)
    if origin is list:
        return args[0] if args else Any
    if origin is tuple and (not args or args[-1] is Ellipsis):
        return args[0] if args else Any
    return None


def _whole_float_to_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _lenient(annotation: Any) -> Any:
    """``annotation`` with the allowances for data from files and the command line: containers
    accept a list or a tuple (items stay strict), an integer accepts a whole float (``1e6``)."""
    base, meta = _split(annotation)
    origin = get_origin(base)
    if meta:
        return Annotated[(_lenient(base), *meta)]
    if base is int:
        return Annotated[int, BeforeValidator(_whole_float_to_int)]
    if origin in (Union, UnionType):
        return Union[tuple(_lenient(m) for m in get_args(base))]
    if origin in (list, tuple):
        args = tuple(a if a is Ellipsis else _lenient(a) for a in get_args(base))
        return Annotated[origin[args] if args else origin, Strict(False)]
    return annotation


def choice_of(annotation: Any) -> Choice | None:
    return next((m for m in _metadata(annotation) if isinstance(m, Choice)), None)


_NOUNS = {int: "integer", float: "number", str: "string"}
_COUNTS = {1: "one", 2: "two", 3: "three", 4: "four"}


def expectation(annotation: Any, *, plural: bool = False, constraints: bool = True) -> str:
    """What a value of ``annotation`` must be, in words: ``a positive integer``, ``two numbers``,
    ``integers >= 0``; ``constraints=False``: the type only (``an integer``)."""
    base, meta = _split(_without_none(annotation))
    if _members(base):
        return " or ".join(expectation(m, plural=plural, constraints=constraints) for m in _members(base))
    found = choice_of(annotation) if constraints else None
    origin = get_origin(base)
    item = _item_annotation(base)
    if item is not None:
        lead = ("lists" if plural else "a list") if not (constraints and _min_length(meta)) else (
            "non-empty lists" if plural else "a non-empty list")
        found = found or (choice_of(item) if constraints else None)
        if found is not None:
            return f"{lead} of names from: {', '.join(found.options)}"
        return f"{lead} of {expectation(item, plural=True, constraints=constraints)}"
    if origin is tuple:
        args = get_args(base)
        return f"{_COUNTS.get(len(args), len(args))} {expectation(args[0], plural=True, constraints=constraints)}"
    if found is not None:
        return f"{'names' if plural else 'one'} of: {', '.join(found.options)}"
    if base is dict or origin is dict:
        return "mappings of settings" if plural else "a mapping of settings"
    if base is bool:
        return "true or false"
    if base is Any:
        return "values" if plural else "a value"
    noun = _NOUNS.get(base, getattr(base, "__name__", str(base))) + ("s" if plural else "")
    words = _bounds(meta, noun) if constraints else noun
    return words if plural else ("an " if words[0] in "aeiou" else "a ") + words


def _min_length(meta: list[Any]) -> int:
    rules = [r for m in meta for r in (m.metadata if isinstance(m, FieldInfo) else [m])]
    return max((r.min_length for r in rules if isinstance(r, annotated_types.MinLen)), default=0)


def _bounds(meta: list[Any], noun: str) -> str:
    """``positive integer``, ``number >= 0``, ``number in [0, 1)`` from Field(gt=..., ...)."""
    rules: list[Any] = []
    for m in meta:
        rules.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    low = high = None
    for r in rules:
        if isinstance(r, (annotated_types.Ge, annotated_types.Gt)):
            low = ("[", r.ge) if isinstance(r, annotated_types.Ge) else ("(", r.gt)
        elif isinstance(r, (annotated_types.Le, annotated_types.Lt)):
            high = ("]", r.le) if isinstance(r, annotated_types.Le) else (")", r.lt)
    finite = any(getattr(r, "allow_inf_nan", True) is False for r in rules)
    if low == ("(", 0) and high is None:
        return f"positive {noun}"
    noun = f"finite {noun}" if finite else noun
    if low and high:
        return f"{noun} in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{noun} {'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{noun} {'<=' if high[0] == ']' else '<'} {high[1]}"
    return noun


__all__ = [
    "Arg", "Choice", "Distinct", "Field", "FieldError", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat",
    "PositiveInt", "Spec", "accepts", "check", "check_value", "choice_of", "expectation", "item_type", "specs",
    "union_members", "unwrap",
]
