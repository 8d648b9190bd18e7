"""``kernelmix --help``, ``kernelmix <command> --help`` and a mistyped option value answer without
importing torch, the ops or a study's measuring code (issue 26: a CLI that answers in a second).
A test of what is imported, not of time: results/startup has the measured seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the commands whose options come from torch-free modules (train, finetune, convert, diagnose,
# pretrained and report still import torch for theirs: their configs live in training/ and pretrained/)
LIGHT = ("compare", "recall", "bench", "demo", "generate-bench", "gpu-check", "model-info", "eval")
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
HEAVY = ("torch", "kernelmix.ops", "kernelmix.model", "kernelmix.training", "kernelmix.studies.compare.running")

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
    for row in _probe([["--help"], *([command, "--help"] for command in LIGHT)]):
        assert row["code"] == 0, row
        assert row["heavy"] == [], f"kernelmix {' '.join(row['argv'])} imported {row['heavy']}"


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
