"""``kernelmix --help``, ``kernelmix <command> --help`` (every command) and a mistyped option value
answer without importing torch, the ops or a study's measuring code (issue 26: a CLI that answers in
a second).
A test of what is imported, not of time: results/startup has the measured seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every command's options come from torch-free modules (kernelmix.cli.commands lists them all)
LIGHT = ("compare", "recall", "bench", "demo", "generate-bench", "gpu-check", "model-info", "eval", "train",
         "pretrained", "convert", "diagnose", "finetune", "report")
SUBCOMMAND_HELP = [["pretrained", "prepare", "--help"], ["pretrained", "list", "--help"],
                   ["report", "darkformer", "--help"], ["report", "conversion", "--help"]]
MISTAKES = [
    ["compare", "--seeds", "abc"],
    ["compare", "--budget", "money"],
    ["recall", "--widths", "32,x"],
    ["bench", "--lengths", "1k"],
    ["demo", "--length", "x"],
    ["generate-bench", "--preset", "huge"],
    ["model-info", "huge"],
    ["eval", "runs/x", "--lengths", "x"],
    ["gpu-check", "--out", "unused", "--lengths", "1024,x"],
]
# a bad value of the commands whose configs moved out of torch modules, and what the message names
NAMED_MISTAKES = [
    (["train", "--set", "steps=-1"], "steps must be a positive integer"),
    (["train", "--set", "model.mixer=cubt"], "unknown mixer 'cubt'"),
    (["train", "--set", "model.num_heads=3"], "is not divisible by num_heads 3"),  # ModelConfig's head geometry
    (["pretrained", "prepare", "huge"], "invalid choice: 'huge'"),
    (["convert", "x", "--out", "y", "--window", "-1"], "--window must be an integer >= 0"),
    (["diagnose", "x", "--m", "0"], "--m must be positive integers"),
    (["finetune", "x", "--out", "y", "--steps", "0"], "--steps must be a positive integer"),
    (["report", "darkformer", "--steps", "0"], "--steps must be a positive integer"),
    (["report", "conversion", "--window", "-1"], "--window must be a positive integer"),
]
HEAVY = ("torch", "transformers", "kernelmix.ops", "kernelmix.model", "kernelmix.training.loop",
         "kernelmix.pretrained.convert", "kernelmix.pretrained.load", "kernelmix.studies.compare.running",
         "kernelmix.studies.diagnose", "kernelmix.studies.finetune", "kernelmix.studies.conversion_report",
         "kernelmix.studies.darkformer_report")

PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from kernelmix.cli import main

    seen = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code
        heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
        seen.append({"argv": argv, "code": code, "heavy": heavy, "err": err.getvalue()[-300:]})
    print(json.dumps(seen))
""")


def _probe(cases: list[list[str]]) -> list[dict]:
    """Run ``kernelmix ARGV`` for each case in one fresh interpreter; what each left imported."""
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases), json.dumps(HEAVY)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_help_imports_no_torch():
    from kernelmix.cli.commands import SUBCOMMANDS

    assert sorted(LIGHT) == sorted(SUBCOMMANDS)  # every command: kernelmix --help and the 14 commands' --help
    for row in _probe([["--help"], *([command, "--help"] for command in LIGHT), *SUBCOMMAND_HELP]):
        assert row["code"] == 0, row
        assert row["heavy"] == [], f"kernelmix {' '.join(row['argv'])} imported {row['heavy']}"


@pytest.mark.parametrize("argv, message", NAMED_MISTAKES, ids=[" ".join(a) for a, _ in NAMED_MISTAKES])
def test_a_bad_value_is_refused_naming_it_before_torch_is_imported(argv, message):
    (row,) = _probe([argv])
    assert row["code"] == 2 and message in row["err"], row
    assert row["heavy"] == [], f"kernelmix {' '.join(argv)} imported {row['heavy']} before refusing it"


def test_a_public_name_stays_itself_beside_its_submodule():
    """kernelmix.pretrained and kernelmix.training are lazy: convert, finetune and parallelize stay the
    functions after their submodules (of the same names) are imported, as when the packages were eager."""
    pytest.importorskip("transformers")
    import kernelmix.pretrained.convert  # noqa: F401  (the submodules)
    import kernelmix.pretrained.finetune  # noqa: F401
    import kernelmix.training.parallelize  # noqa: F401
    from kernelmix import pretrained, training

    assert callable(pretrained.convert) and callable(pretrained.finetune) and callable(training.parallelize)
    assert pretrained.ConversionConfig is sys.modules["kernelmix.pretrained.convert"].ConversionConfig


@pytest.mark.parametrize("argv", MISTAKES, ids=[" ".join(a) for a in MISTAKES])
def test_a_mistyped_value_is_refused_before_torch_is_imported(argv):
    (row,) = _probe([argv])
    assert row["code"] == 2 and "error:" in row["err"], row
    assert row["heavy"] == [], f"kernelmix {' '.join(argv)} imported {row['heavy']} before refusing it"


def test_every_command_is_in_the_help_without_its_module():
    from kernelmix.cli.commands import SUBCOMMANDS

    (row,) = _probe([["--help"]])
    code = ("import sys, contextlib, io; from kernelmix.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main(['--help'])\n"
            "    except SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('kernelmix.cli.') and m not in "
            "('kernelmix.cli.app', 'kernelmix.cli.commands', 'kernelmix.cli.options')))\n"
            "print(out.getvalue())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    modules, _, text = done.stdout.partition("\n")
    assert modules == "[]"
    assert all(name in text for name in SUBCOMMANDS)
