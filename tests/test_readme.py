"""The README and the docs say what is true: their Python examples run as written (they are the
first thing users copy), every ``kernelmix`` command line they show parses, the README stays
short, every results folder says what made it, and no link leaves the repository."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULT_DIRS = sorted(p for p in (ROOT / "results").iterdir() if p.is_dir())
RESULT_PAGES = sorted((ROOT / "results").rglob("README.md"))
PAGES = [README, *DOCS, *RESULT_PAGES]
MAX_README_LINES = 250  # counted by str.splitlines, as the house check counts them

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def _prose(page: Path) -> str:
    """The page without fenced blocks and inline code, where links and headings live."""
    text = FENCE.sub("", page.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


EXAMPLES = [(page, i, code) for page in [README, *DOCS] for i, code in enumerate(_blocks(page, "python"))]


def _command_lines() -> list[tuple[Path, list[str]]]:
    """Every ``kernelmix ...`` (or ``torchrun ... -m kernelmix.cli ...``) in a bash block, as argv."""
    found = []
    for page in PAGES:
        for block in _blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                segments: list[list[str]] = [[]]
                for word in words:
                    if word == "&&":
                        segments.append([])
                    else:
                        segments[-1].append(word)
                for seg in segments:
                    if seg[:1] == ["kernelmix"]:
                        found.append((page, seg[1:]))
                    elif seg[:1] == ["torchrun"] and "kernelmix.cli" in seg:
                        found.append((page, seg[seg.index("kernelmix.cli") + 1:]))
    return found


COMMANDS = _command_lines()


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page), flags=re.M)}


def test_readme_has_python_examples():
    assert _blocks(README, "python")


@pytest.mark.parametrize("page,index,code", EXAMPLES, ids=[f"{_name(p)}#{i}" for p, i, _ in EXAMPLES])
def test_example_runs(page, index, code):
    exec(compile(code, f"{_name(page)} python block {index}", "exec"), {})


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move details to docs/"


def test_commands_are_found():
    assert any(page == README for page, _ in COMMANDS)


@pytest.mark.parametrize("page,argv", COMMANDS, ids=[f"{_name(p)}: {' '.join(a)}" for p, a in COMMANDS])
def test_command_parses(page, argv):
    from kernelmix.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"{_name(page)} shows `kernelmix {' '.join(argv)}`, which does not parse (exit {exit_.code})")


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_links_stay_in_the_repository(page):
    bad = []
    for target in LINK.findall(_prose(page)):
        if SCHEME.match(target):
            bad.append(f"{target} (leaves the repository)")
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_relative_to(ROOT):
            bad.append(f"{target} (outside the repository)")
        elif not linked.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            bad.append(f"{target} (no heading #{anchor} in {_name(linked)})")
    assert not bad, f"{_name(page)}: " + "; ".join(bad)


@pytest.mark.parametrize("folder", RESULT_DIRS, ids=[p.name for p in RESULT_DIRS])
def test_results_folder_names_its_command(folder):
    readme = folder / "README.md"
    assert readme.exists(), f"{_name(folder)} has no README.md naming the command that produced it"
    assert "kernelmix " in readme.read_text(), f"{_name(readme)} does not name its kernelmix command"
