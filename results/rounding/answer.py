"""The rounding study's answer, from the three compare runs that ``run.sh`` makes (one per learning
rate: 3e-3 and 3e-3 × (1 + 1e-6) and × (1 + 2e-6)). For every mixer and seed: the three final
validation losses, their range (what a rounding-sized nudge does) and, across seeds, the gap
between the seeds' means (what the usual seed spread is made of). Writes ``answer.md`` (the
table) and ``losses.png`` (every run's loss, per mixer and seed) next to this file.

    python3 results/rounding/answer.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATES = ("0.003", "0.003000003", "0.003000006")


def losses() -> dict[str, dict[int, list[float]]]:
    """mixer → seed → the final validation loss at each learning rate, in RATES order."""
    table: dict[str, dict[int, list[float]]] = {}
    for rate in RATES:
        for run in json.loads((HERE / f"lr-{rate}" / "results.json").read_text())["runs"]:
            table.setdefault(run["mixer"], {}).setdefault(run["seed"], []).append(run["val_loss"])
    return table


def divergence(steps=(10, 20, 30, 50, 100, 300)) -> dict[str, list[float]]:
    """mixer → |training loss at lr 3e-3 − at lr 3e-3·(1+1e-6)| at each of ``steps``, the mean over
    seeds: when the two trajectories part."""
    curves: dict[tuple[str, int, str], dict[int, float]] = {}
    for rate in RATES[:2]:
        for run in json.loads((HERE / f"lr-{rate}" / "results.json").read_text())["runs"]:
            curves[run["mixer"], run["seed"], rate] = {step: loss for step, _, loss in run["curve"]}
    out: dict[str, list[float]] = {}
    for mixer, seed, _ in [k for k in curves if k[2] == RATES[0]]:
        apart = [abs(curves[mixer, seed, RATES[0]][s] - curves[mixer, seed, RATES[1]][s]) for s in steps]
        out.setdefault(mixer, []).append(apart)
    return {mixer: [statistics.fmean(col) for col in zip(*rows)] for mixer, rows in out.items()}


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def main() -> None:
    table = losses()
    seeds = sorted({seed for per_seed in table.values() for seed in per_seed})
    lines = ["# How far does a rounding-sized nudge move each mixer's final loss?", "",
             "`python3 results/rounding/answer.py`, from `lr-*/results.json`. Final validation loss "
             "(nats/byte) of each run at lr 3e-3, 3e-3·(1+1e-6), 3e-3·(1+2e-6); **nudge range** = largest − "
             "smallest of a seed's three; **sd, nudges** = the sample std of a seed's three, pooled over the "
             "seeds; **seed gap** = |mean of seed 1 − mean of seed 0|.", "",
             "| mixer | " + " | ".join(f"seed {s}: three lrs" for s in seeds)
             + " | nudge range (per seed) | sd, nudges | seed gap |",
             "|---|" + "---|" * len(seeds) + "---:|---:|---:|"]
    for mixer, per_seed in table.items():
        cells = [" / ".join(f"{v:.4f}" for v in per_seed[s]) for s in seeds]
        ranges = " / ".join(f"{_spread(per_seed[s]):.3f}" for s in seeds)
        pooled = statistics.fmean(statistics.variance(per_seed[s]) for s in seeds) ** 0.5
        means = [statistics.fmean(per_seed[s]) for s in seeds]
        lines.append(f"| {mixer} | " + " | ".join(cells) + f" | {ranges} | {pooled:.3f} | {abs(means[-1] - means[0]):.3f} |")
    steps = (10, 20, 30, 50, 100, 300)
    lines += ["", "When the trajectories part: |training loss at lr 3e-3 − at 3e-3·(1+1e-6)| at a step (the batch's "
              "loss as logged, mean over the seeds; warmup ends at step 20):", "",
              "| mixer | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---:|" * len(steps)]
    for mixer, apart in divergence(steps).items():
        lines.append(f"| {mixer} | " + " | ".join(f"{a:.1e}" for a in apart) + " |")
    (HERE / "answer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = ["o", "s", "^", "D"]
    for x, (mixer, per_seed) in enumerate(table.items()):
        for offset, seed in zip((-0.12, 0.12), seeds):
            values = per_seed[seed]
            ax.plot([x + offset] * len(values), values, markers[seed % len(markers)], color=f"C{seed}", alpha=0.8,
                    label=f"seed {seed}" if x == 0 else None)
    ax.set_xticks(range(len(table)), list(table))
    ax.set_ylabel("final validation loss (nats/byte)")
    ax.set_title("Each seed three times, lr nudged by 0, 1e-6, 2e-6 (relative)\n"
                 "mini preset, T=256, 614,400 tokens per run", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "losses.png", dpi=120)


if __name__ == "__main__":
    main()
