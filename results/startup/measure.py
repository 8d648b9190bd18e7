"""How long ``kernelmix --help`` and ``kernelmix <command> --help`` take: the median of 5 runs of each,
a fresh process every run, and what each imported (torch or not). Writes ``results.json`` and
``README.md`` next to this file.

    python3 results/startup/measure.py [--runs 5]

It runs the ``kernelmix`` console script beside this interpreter (``python -m kernelmix`` where there
is none), with ``--help`` for the program and for every subcommand (``kernelmix.cli.commands``).
The machine's load (the 1-minute load average and the busiest other processes, from ``ps``) is
recorded before and after, since a busy machine slows every start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

from kernelmix.cli.commands import SUBCOMMANDS  # noqa: E402  (light: the table of subcommands)

TARGET_S = 1.0  # issue 26: every --help within a second on an idle core
# after a run, whether it imported torch (the same process: `python -X importtime` lists every import)
PROBE = "import runpy, sys; sys.argv = ['kernelmix', *sys.argv[1:]]\ntry:\n    runpy.run_module('kernelmix', run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)"


def program() -> list[str]:
    script = Path(sys.executable).with_name("kernelmix")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kernelmix"]


def seconds(argv: list[str]) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one run: the wall clock, and the user + system CPU time of the process
    (what it costs on an idle core; on a busy machine the wall time adds the waits for a core)."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    started, cpu_started = time.perf_counter(), cpu()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started, cpu() - cpu_started


def imports_torch(words: list[str]) -> bool:
    done = subprocess.run([sys.executable, "-c", PROBE, *words], capture_output=True, text=True, check=True)
    return done.stderr.strip().splitlines()[-1] == "True"


def load() -> dict:
    """The 1-minute load average and the processes using the most CPU now (other than this one)."""
    top = []
    if shutil.which("ps"):
        out = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
        top = [" ".join(line.split())[:80] for line in out.splitlines()[1:] if " ps -eo " not in line][:5]
    return {"loadavg_1min": round(os.getloadavg()[0], 2), "busiest": top}


def measure(runs: int) -> dict:
    base = program()
    before = load()
    rows = []
    for words in [["--help"], *([name, "--help"] for name in SUBCOMMANDS)]:
        walls, cpus = zip(*(seconds(base + words) for _ in range(runs)))
        rows.append({"command": " ".join(["kernelmix", *words]), "median_s": round(statistics.median(walls), 3),
                     "median_cpu_s": round(statistics.median(cpus), 3), "runs_s": [round(t, 3) for t in walls],
                     "imports_torch": imports_torch(words)})
    return {"format": "kernelmix.startup/1", "program": " ".join(base), "runs": runs, "target_s": TARGET_S,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "load_before": before, "load_after": load(), "rows": rows,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def torch_note(rows: list[dict]) -> str:
    """What the table says about torch: which commands import it for their options, if any."""
    heavy = [f"`{r['command']}`" for r in rows if r["imports_torch"]]
    if not heavy:
        return ("None imports torch: every command builds its options from torch-free settings modules "
                "(tests/test_startup.py checks it).")
    return (f"{', '.join(heavy)} import torch to build their options, and cannot be: importing torch alone takes "
            "longer here.")


def readme(result: dict) -> str:
    rows = result["rows"]
    fast = [r for r in rows if r["median_s"] <= result["target_s"]]
    fast_cpu = [r for r in rows if r["median_cpu_s"] <= result["target_s"]]
    lines = [
        "# results/startup — how long `kernelmix --help` takes",
        "",
        f"**Command**: `python3 results/startup/measure.py` (median of {result['runs']} runs of each, a fresh process "
        f"every run, `{result['program']}`), {result['measured']}, {result['machine']['cpus']} CPU cores, Python "
        f"{result['machine']['python']}.",
        "",
        f"Load (1-minute average) {result['load_before']['loadavg_1min']} before and "
        f"{result['load_after']['loadavg_1min']} after (on {result['machine']['cpus']} cores: above "
        f"{result['machine']['cpus']} means other jobs were waiting for a core); the busiest processes at the start "
        "(% CPU, command): " + "; ".join(f"`{p}`" for p in result["load_before"]["busiest"][:3]) + ".",
        "",
        f"{len(fast)} of {len(rows)} within {result['target_s']:g} s of wall time, {len(fast_cpu)} within it in CPU "
        "time (user + system: what a run costs on an idle core). " + torch_note(rows),
        "",
        "| command | median wall s | median CPU s | wall s of each run | imports torch |",
        "|---|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(f"| `{r['command']}` | {r['median_s']:.2f} | {r['median_cpu_s']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['runs_s'])} | "
                     f"{'yes' if r['imports_torch'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    result = measure(parser.parse_args().runs)
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (HERE / "README.md").write_text(readme(result), encoding="utf-8")
    print(readme(result))


if __name__ == "__main__":
    main()
