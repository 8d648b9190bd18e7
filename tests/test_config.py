"""The one mechanism for configs and options (kernelmix.config, kernelmix.cli.options): strict
types with the allowances for file data, errors that name the field, the value and the fix, and
command-line options built from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest

from kernelmix.cli import build_parser
from kernelmix.cli.options import add_options, from_args
from kernelmix.config import (
    Arg, Choice, Field, FieldError, NonNegativeInt, PositiveFloat, PositiveInt, check, expectation, specs,
)

Fraction = Annotated[float, Field(ge=0, lt=1)]


@dataclass
class Toy:
    name: Annotated[str, Arg(positional=True), Field(description="a name")]
    steps: Annotated[PositiveInt, Field(description="optimizer steps")] = 3
    seed: NonNegativeInt = 0
    lr: PositiveFloat = 1e-3
    betas: Annotated[tuple[Fraction, Fraction], Field(examples=["betas=[0.9,0.95]"])] = (0.9, 0.95)
    lengths: Annotated[list[PositiveInt], Field(min_length=1)] = field(default_factory=lambda: [4, 8])
    lrs: Annotated[list[PositiveFloat], Arg(flag="--rates"), Field(title="learning rates")] = (
        field(default_factory=lambda: [1.0]))
    layers: Annotated[str, Choice(("all", "global"), "layer selection", "or a list of indices")] | list[int] = "all"
    mixers: Annotated[list[str], Choice(("softmax", "cubit"), "mixer")] = field(default_factory=lambda: ["softmax"])
    preset: Annotated[str, Choice(("tiny", "small"), "preset")] = "tiny"
    model: Annotated[dict[str, Any], Arg(cli=False), Field(examples=["model.mixer=cubit"])] = (
        field(default_factory=dict))
    limit: Annotated[PositiveInt, Arg(group="size")] | None = None
    unlimited: Annotated[bool, Arg(group="size")] = False
    memory: Annotated[bool, Field(description="skip the memory probe")] = True
    tags: Annotated[list[str], Arg(flag="--tag", repeat=True)] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(self)


def error(**changes) -> str:
    with pytest.raises(FieldError) as info:
        Toy(name="x", **changes)
    return str(info.value)


@pytest.mark.parametrize("changes, message", [
    ({"steps": 0}, "steps must be a positive integer, got 0"),
    ({"steps": "3"}, "steps must be an integer, got '3'"),  # strict: a string is not an integer
    ({"steps": True}, "steps must be an integer, got True"),
    ({"steps": 2.5}, "steps must be an integer, got 2.5"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"lr": "fast"}, "lr must be a number, got 'fast'"),
    ({"lr": float("nan")}, "lr must be a positive number, got nan"),
    ({"betas": 0.9}, "betas must be two numbers, e.g. betas=[0.9,0.95], got 0.9"),
    ({"betas": [0.9, 1.5]}, "betas must be two numbers in [0, 1), e.g. betas=[0.9,0.95], got [0.9, 1.5]"),
    ({"lengths": [4, 0]}, "lengths must be positive integers, got [4, 0]"),
    ({"lengths": []}, "lengths must be a non-empty list of positive integers, got []"),
    ({"lengths": "4,8"}, "lengths must be a list of integers, got '4,8'"),  # the type is wrong: the type's words
    ({"lrs": [-1.0]}, "learning rates must be positive numbers, got [-1.0]"),
    ({"layers": "some"}, "unknown layer selection 'some' (choose from: all, global, or a list of indices)"),
    ({"layers": [1, "a"]}, "layers must be one of: all, global or a list of integers, got [1, 'a']"),
    ({"mixers": ["softmax", "cubt", "x"]}, "unknown mixer(s) 'cubt', 'x' (choose from: softmax, cubit)"),
    ({"preset": "huge"}, "unknown preset 'huge' (choose from: tiny, small)"),
    ({"model": 3}, "model must be a mapping of settings, e.g. model.mixer=cubit, got 3"),
    ({"limit": 0}, "limit must be a positive integer, got 0"),
    ({"memory": 1}, "memory must be true or false, got 1"),
])
def test_errors_name_the_field_the_value_and_the_fix(changes, message):
    assert error(**changes) == message


def test_file_data_is_accepted_and_normalised():
    toy = Toy(name="x", steps=1e6, lr=1, betas=[0.5, 0.25], lengths=(2, 3), layers=(0, 5), limit=None)
    assert (toy.steps, toy.lr, toy.betas, toy.lengths, toy.layers) == (1_000_000, 1.0, (0.5, 0.25), [2, 3], [0, 5])
    assert type(toy.steps) is int and type(toy.lr) is float


def test_words_for_annotations():
    by_name = {s.name: s for s in specs(Toy)}
    assert expectation(by_name["betas"].annotation) == "two numbers in [0, 1)"
    assert expectation(by_name["betas"].annotation, constraints=False) == "two numbers"
    assert expectation(by_name["lengths"].annotation) == "a non-empty list of positive integers"
    assert expectation(by_name["preset"].annotation) == "one of: tiny, small"
    assert by_name["lrs"].label == "learning rates" and by_name["model"].example == "model.mixer=cubit"


def test_the_mechanism_imports_neither_torch_nor_the_command_line():
    code = "import sys, kernelmix.config; print('torch' in sys.modules, 'kernelmix.cli' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False", "False"]


# ---------------------------------------------------------------------------------------------
# Command-line options from the fields


def toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy")
    add_options(parser, Toy)
    return parser


def test_options_come_from_the_fields():
    parser = toy_parser()
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {"--steps", "--seed", "--lr", "--rates", "--betas", "--lengths", "--layers", "--mixers", "--preset",
                     "--limit", "--unlimited", "--no-memory", "--tag"}  # model: Arg(cli=False)
    args = parser.parse_args(["a", "--lengths", "16,32", "--layers", "0,5", "--no-memory", "--tag", "p", "--tag", "q",
                              "--betas", "0.8,0.9", "--rates", "1e-3,3e-3"])
    toy = from_args(Toy, args)
    assert (toy.name, toy.lengths, toy.layers, toy.memory, toy.tags, toy.betas, toy.lrs) == (
        "a", [16, 32], [0, 5], False, ["p", "q"], (0.8, 0.9), [1e-3, 3e-3])
    assert toy.steps == 3 and toy.layers != "all"  # options not given keep the dataclass default
    assert from_args(Toy, parser.parse_args(["a", "--layers", "global"])).layers == "global"
    assert not hasattr(parser.parse_args(["a"]), "steps")  # the parser holds no defaults of its own
    assert "optimizer steps (default: 3)" in parser.format_help()


def test_option_errors(capsys):
    parser = toy_parser()
    with pytest.raises(ValueError, match=r"^--steps must be a positive integer, got 0$"):  # names the flag
        from_args(Toy, parser.parse_args(["a", "--steps", "0"]))
    with pytest.raises(ValueError, match=r"^learning rates must be positive numbers, got \[-1.0\]$"):  # its title
        from_args(Toy, parser.parse_args(["a", "--rates=-1"]))
    with pytest.raises(ValueError, match=r"unknown mixer\(s\) 'cubt'"):
        from_args(Toy, parser.parse_args(["a", "--mixers", "softmax,cubt"]))
    for argv, message in [
        (["a", "--steps", "x"], "argument --steps: must be an integer, got 'x'"),
        (["a", "--lengths", "4,b"], "argument --lengths: must be comma-separated integers, got '4,b'"),
        (["a", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["a", "--limit", "3", "--unlimited"], "not allowed with argument"),
        ([], "the following arguments are required: name"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert message in capsys.readouterr().err


def test_two_configs_cannot_define_one_option():
    @dataclass
    class Other:
        steps: int = 1

    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --steps"):
        add_options(argparse.ArgumentParser(), Toy, Other)


def test_every_command_is_built_from_dataclasses():
    """No option of any subcommand is written by hand: each one's dest is a field of a config
    dataclass (the help is the field's description or shows its default)."""
    from kernelmix import cli
    from kernelmix.cli import COMMANDS

    def parsers(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield sub
                    yield from parsers(sub)

    fields = {f.name for f in dataclasses.fields(cli.GlobalOptions)}  # --debug, before or after the subcommand
    fields |= {f.name for f in dataclasses.fields(cli.ThreadOptions)}  # --threads, added to every command
    for module in COMMANDS:
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                fields |= {f.name for f in dataclasses.fields(value)}
    options = [a for p in parsers(build_parser()) for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    assert options and {a.dest for a in options} <= fields
    assert all(a.default is argparse.SUPPRESS for a in options if a.option_strings)


# ---------------------------------------------------------------------------------------------
# Commands: a bad value is refused before any work, with a message that names the option


@pytest.mark.parametrize("argv, message", [
    (["convert", "x", "--layers", "1,a", "--out", "unused"], "--layers: unknown layer selection '1,a'"),
    (["bench", "--mixers", "foo"], "--mixers: unknown mixer(s) 'foo'"),
    (["diagnose", "x", "--variants", "cubit"],
     "--variants: unknown variant(s) 'cubit' (choose from: performer, whiten, distill; identity"),
    (["eval", "unused", "--tasks", "foo"], "--tasks: unknown task(s) 'foo'"),
    (["compare", "--buckets", "5,0", "--out", "unused"], "bucket edges must start at 0 and increase"),
    (["compare", "--min-lr", "1", "--out", "unused"], "min_lr must be at most lr"),
    (["bench", "--device", "nowhere"], "unknown device 'nowhere'"),
    (["demo", "--device", "nowhere"], "unknown device 'nowhere'"),
])
def test_bad_option_values_are_refused_naming_the_option(argv, message, tmp_path, monkeypatch, capsys):
    from kernelmix.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's error: usage and message on stderr
        code = stop.code
    assert code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_config_file_that_does_not_parse_is_named(tmp_path):
    from kernelmix.training import read_config_file

    for name, text in (("bad.toml", "steps = \n"), ("bad.json", "{steps: 1}")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"cannot parse config file '.*{name}'"):
            read_config_file(tmp_path / name)


def test_a_broken_config_file_is_named_with_the_parsers_line(tmp_path, capsys):
    """Issue 13: the parser's message alone did not say which file; now the command names the file,
    and the line where the parser gives one (TOML, YAML and JSON all do)."""
    from kernelmix.cli import main

    pytest.importorskip("yaml")
    for name, text, where in (("bad.toml", 'preset = "tiny"\nsteps = \n', "line 2"),
                              ("bad.yaml", "preset: tiny\n steps: [\n", "line 2"),
                              ("bad.json", '{"preset": "tiny",\n}', "line 2")):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit):
            main(["train", "--config", str(tmp_path / name), "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert f"cannot parse config file '{tmp_path / name}'" in err and where in err, err
    assert not (tmp_path / "run").exists()


def test_a_resolved_run_config_without_a_train_mapping_is_a_clear_error(tmp_path):
    """A run's resolved config.json whose 'train' section is missing or not a mapping was a KeyError
    (or reached the merge as a list); it is named as damaged."""
    import json

    from kernelmix.training import read_config_file
    from kernelmix.training.config import RESOLVED_FORMAT

    for name, record in (("missing.json", {"format": RESOLVED_FORMAT}),
                         ("list.json", {"format": RESOLVED_FORMAT, "train": [1, 2]})):
        (tmp_path / name).write_text(json.dumps(record))
        expected = rf"'.*{name}' \(a run's resolved config\): its 'train' section must be a mapping"
        with pytest.raises(ValueError, match=expected):
            read_config_file(tmp_path / name)
