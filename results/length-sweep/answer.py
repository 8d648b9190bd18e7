"""The length sweep's answer, from the two compare runs that ``run.sh`` makes: Cubit's validation
loss minus softmax's at every training length, paired by seed (same data order, same
initialisation seed), at equal tokens (``tokens/results.json``) and at equal training FLOPs
(``flops/results.json``). Writes ``answer.md`` (the table) and ``gap.png`` (the gap against length)
next to this file.

    python3 results/length-sweep/answer.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGETS = {"tokens": "equal tokens", "flops": "equal training FLOPs"}


def _runs(budget: str) -> dict[tuple[str, int, int], dict]:
    data = json.loads((HERE / budget / "results.json").read_text())
    return {(r["mixer"], r["length"], r["seed"]): r for r in data["runs"]}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def gaps(budget: str) -> dict[int, dict]:
    """Per length: softmax's and Cubit's losses per seed, Cubit's steps and the paired gaps."""
    runs = _runs(budget)
    out = {}
    for length in sorted({t for _, t, _ in runs}):
        seeds = sorted(s for m, t, s in runs if m == "softmax" and t == length and ("cubit", t, s) in runs)
        soft = [runs["softmax", length, s]["val_loss"] for s in seeds]
        cubit = [runs["cubit", length, s]["val_loss"] for s in seeds]
        out[length] = {"seeds": seeds, "softmax": soft, "cubit": cubit, "gap": [c - s for c, s in zip(cubit, soft)],
                       "cubit_steps": runs["cubit", length, seeds[0]]["steps"],
                       "softmax_steps": runs["softmax", length, seeds[0]]["steps"]}
    return out


def _cell(values: list[float]) -> str:
    mean, sd = _mean_sd(values)
    return f"{mean:+.3f} ± {sd:.3f}" if len(values) > 1 else f"{mean:+.3f}"


def _loss(values: list[float]) -> str:
    mean, sd = _mean_sd(values)
    return f"{mean:.3f} ± {sd:.3f}"


def _longer_budget_lines() -> list[str]:
    """T=4096 again with twice the steps (``tokens-4096-300/``, when it has been run): does the gap
    change once the models are past the bigram line?"""
    path = HERE / "tokens-4096-300" / "results.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    runs = {(r["mixer"], r["seed"]): r["val_loss"] for r in data["runs"]}
    seeds = sorted(s for m, s in runs if m == "softmax" and ("cubit", s) in runs)
    soft, cubit = [runs["softmax", s] for s in seeds], [runs["cubit", s] for s in seeds]
    steps, bigram = data["settings"]["steps"], data["reference"]["bigram"]
    return ["", f"T=4096 with {steps} steps ({data['budget']['tokens_per_run']:,} tokens per run, equal tokens; "
            f"`tokens-4096-300/results.json`; the bigram line of these validation tokens: {bigram:.3f}):", "",
            "| T | softmax | Cubit | gap | seeds |", "|---:|---:|---:|---:|---|",
            f"| 4096 | {_loss(soft)} | {_loss(cubit)} | {_cell([c - s for c, s in zip(cubit, soft)])} "
            f"| {','.join(map(str, seeds))} |", "",
            "Per seed: " + ", ".join(f"seed {s}: {c - f:+.3f}" for s, c, f in zip(seeds, cubit, soft))]


def main() -> None:
    results = {budget: gaps(budget) for budget in BUDGETS}
    lines = ["# Does the Cubit − softmax gap grow with training length?", "",
             "`python3 results/length-sweep/answer.py`, from `tokens/results.json` and `flops/results.json`. "
             "Gap = Cubit's validation loss − softmax's (nats/byte; **negative: Cubit better**), paired by seed, "
             "mean ± sample std over the seeds.", "",
             "| T | softmax | Cubit, equal tokens | gap, equal tokens | Cubit steps at equal FLOPs | Cubit, equal FLOPs "
             "| gap, equal FLOPs | seeds |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for length, tok in results["tokens"].items():
        flo = results["flops"][length]
        lines.append(f"| {length} | {_loss(tok['softmax'])} | {_loss(tok['cubit'])} | {_cell(tok['gap'])} "
                     f"| {flo['cubit_steps']} of {flo['softmax_steps']} | {_loss(flo['cubit'])} | {_cell(flo['gap'])} "
                     f"| {','.join(map(str, tok['seeds']))} |")
    lines += ["", "Per seed (gap at equal tokens / equal FLOPs):", ""]
    for length, tok in results["tokens"].items():
        per_seed = ", ".join(f"seed {s}: {g:+.3f} / {f:+.3f}" for s, g, f in
                             zip(tok["seeds"], tok["gap"], results["flops"][length]["gap"]))
        lines.append(f"- T={length}: {per_seed}")
    lines += _longer_budget_lines()
    (HERE / "answer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for offset, (budget, label) in zip((-0.03, 0.03), BUDGETS.items()):
        lengths = list(results[budget])
        means = [_mean_sd(results[budget][t]["gap"])[0] for t in lengths]
        line, = ax.plot(lengths, means, marker="o", label=f"{label} (mean)")
        for t in lengths:  # every seed's own gap, shifted a little so the budgets do not overlap
            ax.scatter([t * (1 + offset)] * len(results[budget][t]["gap"]), results[budget][t]["gap"],
                       color=line.get_color(), alpha=0.45, s=18)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(results["tokens"]), [str(t) for t in results["tokens"]])
    ax.set_xlabel("training length T (tokens)")
    ax.set_ylabel("Cubit − softmax validation loss (nats/byte)")
    settings = json.loads((HERE / "tokens" / "results.json").read_text())
    tokens, preset = settings["budget"]["tokens_per_run"], settings["settings"]["preset"]
    ax.set_title(f"Cubit − softmax by training length, {preset} preset, {tokens:,} tokens per run\n"
                 "(equal FLOPs: Cubit gets fewer steps). Below 0: Cubit better; dots: single seeds", fontsize=9)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(HERE / "gap.png", dpi=120)


if __name__ == "__main__":
    main()
