"""The PNGs beside a compare's results.md (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...output import pyplot
from .report import loss_unit

def _loss_vs_length(plt, results: dict[str, Any]):
    """val_loss_vs_length.png's figure: each mixer's validation loss against its training length,
    with the unigram and bigram tables of the same tokens as reference lines."""
    summary, mixers, lengths = results["summary"], results["settings"]["mixers"], results["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in mixers:
        rows = sorted((r for r in summary if r["mixer"] == m), key=lambda r: r["length"])
        if rows:
            ax.errorbar([r["length"] for r in rows], [r["val_loss"] for r in rows],
                        yerr=[r["val_loss_sd"] for r in rows], marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(t) for t in lengths])
    reference = results.get("reference")
    if reference:
        for name, style in (("unigram", ":"), ("bigram", "--")):
            ax.axhline(reference[name], color="0.4", linestyle=style, linewidth=1, label=f"{name} table")
    ax.set_xlabel("training length (tokens)")
    ax.set_ylabel(f"validation loss ({loss_unit(results['settings']['tokenizer'])})")
    equal = results["budget"]["equal"]
    ax.set_title(f"{results['budget']['tokens_per_run']:,} training tokens per run" if equal == "tokens"
                 else f"equal training {'FLOPs' if equal == 'flops' else 'seconds'} per run")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """The PNGs (matplotlib, Agg backend); returns their file names."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    settings, summary, runs = results["settings"], results["summary"], results["runs"]
    mixers, lengths = settings["mixers"], settings["lengths"]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    save(_loss_vs_length(plt, results), "val_loss_vs_length.png")

    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.8), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], lengths):
        for m in mixers:
            group = [r for r in runs if r["mixer"] == m and r["length"] == t and r["curve"]]
            if not group:
                continue
            n = min(len(r["curve"]) for r in group)
            tokens = [group[0]["curve"][i][1] for i in range(n)]
            losses = [sum(r["curve"][i][2] for r in group) / len(group) for i in range(n)]
            ax.plot(tokens, losses, label=m)
        ax.set_title(f"T={t}")
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss" + (" (mean over seeds)" if len(settings["seeds"]) > 1 else ""))
    axes[0][-1].legend()
    save(fig, "loss_curves.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / len(lengths)
    for i, t in enumerate(lengths):
        values = [next((r["tokens_per_s"] for r in summary if r["mixer"] == m and r["length"] == t), 0) for m in mixers]
        ax.bar([x + (i - (len(lengths) - 1) / 2) * width for x in range(len(mixers))], values, width, label=f"T={t}")
    ax.set_xticks(range(len(mixers)), mixers, rotation=20)
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"throughput ({results['machine']['threads']} threads, {settings['device']})")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax.set_xlabel("measured on this machine while it ran: other jobs on its cores lower every bar,\n"
                  "the mixers made of many small ops most (see --threads)", fontsize=7, color="0.35")
    save(fig, "throughput.png")

    longest = lengths[-1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in mixers:
        r = next((r for r in summary if r["mixer"] == m and r["length"] == longest), None)
        if r:
            labels = [f"[{b['start']},{b['end']})" for b in r["buckets"]]
            ax.plot(range(len(labels)), [b["loss"] for b in r["buckets"]], marker="o", label=m)
            ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("position of the predicted token in the window")
    ax.set_ylabel(f"validation loss ({loss_unit(results['settings']['tokenizer'])})")
    ax.set_title(f"loss by position, T={longest}")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "loss_by_position.png")
    return written
