"""results.md of a compare: which budget was equal, the tables of validation loss, throughput,
loss by position and what every run cost."""

from __future__ import annotations

from typing import Any

from .settings import REFERENCE_MIXER

PLOT_CAPTIONS = {
    "val_loss_vs_length.png": "final validation loss against the training length",
    "loss_curves.png": "training loss against tokens, one panel per length",
    "throughput.png": "training tokens/s per mixer and length",
    "loss_by_position.png": "validation loss by position in the window, at the longest length",
}


def loss_unit(tokenizer: str) -> str:
    """The loss's unit name: with byte tokens a token is a byte, so nats/byte, as the README says."""
    return "nats/byte" if tokenizer == "byte" else "nats/token"


def _fmt(mean: float, sd: float, seeds: int, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if seeds > 1 else f"{mean:.{digits}f}"


def format_markdown(results: dict[str, Any]) -> str:
    """The tables of results.md: val loss per mixer and length, throughput and wall time, loss by
    position at the longest length."""
    settings, summary = results["settings"], results["summary"]
    lengths, mixers = settings["lengths"], settings["mixers"]
    seeds = settings["seeds"]
    cell = {(r["mixer"], r["length"]): r for r in summary}
    spread = " (mean ± sample std over seeds)" if len(seeds) > 1 else ""
    lines = [
        f"# kernelmix compare — preset `{settings['preset']}`, {settings['corpus']} / {settings['tokenizer']} tokens",
        "",
        _budget_markdown(results),
        "",
        f"Every step: {settings['tokens_per_step']:,} tokens (batch = {settings['tokens_per_step']:,} / length); "
        f"seeds {seeds}; lr {settings['lr']}. Validation: {results['evaluation']['predicted_tokens']:,} predicted "
        f"tokens (first {results['evaluation']['tokens_per_document']} tokens of {results['evaluation']['documents']} "
        f"held-out documents) at each run's training length. Wall time {results['wall_s'] / 60:.1f} min for this "
        f"invocation ({results['reused_runs']} of {len(results['runs'])} runs reused), "
        f"{results['runs_wall_s'] / 60:.1f} min of training + evaluation over all runs; {_threads_text(results)}.",
        "",
        f"## Validation loss ({loss_unit(settings['tokenizer'])}){spread}",
        "",
        "| mixer | " + " | ".join(f"T={t}" for t in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    best = {t: min((r["val_loss"] for r in summary if r["length"] == t), default=None) for t in lengths}
    for m in mixers:
        cells = []
        for t in lengths:
            r = cell.get((m, t))
            if r is None:
                cells.append("–")
                continue
            text = _fmt(r["val_loss"], r["val_loss_sd"], r["seeds"])
            cells.append(f"**{text}**" if r["val_loss"] == best[t] else text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    reference = results.get("reference")  # absent from results written before it existed
    if reference:
        lines += [
            "",
            f"Reference lines on the same validation tokens (counted on the training split, add-one smoothing): "
            f"unigram {reference['unigram']:.3f}, bigram {reference['bigram']:.3f}. A mixer above the bigram line has "
            "not yet learned what a table of which token follows which knows, let alone used its context.",
        ]
    lines += [
        "",
        "## Training throughput (tokens/s) and wall time per run (s)",
        "",
        "Measured on this machine while it ran: other jobs on the same cores lower every figure, the mixers made of "
        "many small ops (Cubit, DeltaFormer, the random-feature ones) most; `--threads 1` on a shared machine.",
        "",
        "| mixer | params | " + " | ".join(f"tok/s T={t}" for t in lengths) + " | "
        + " | ".join(f"s T={t}" for t in lengths) + " |",
        "|---|---:|" + "---:|" * (2 * len(lengths)),
    ]
    for m in mixers:
        rows = [cell.get((m, t)) for t in lengths]
        params = next((r["parameters"] for r in rows if r), 0)
        lines.append(
            f"| {m} | {params:,} | "
            + " | ".join(f"{r['tokens_per_s']:,.0f}" if r else "–" for r in rows) + " | "
            + " | ".join(f"{r['train_wall_s']:.0f}" if r else "–" for r in rows) + " |"
        )
    longest = lengths[-1]
    at_longest = [cell[(m, longest)] for m in mixers if (m, longest) in cell]
    if at_longest:
        ranges = [(b["start"], b["end"]) for b in at_longest[0]["buckets"]]
        lines += [
            "",
            f"## Validation loss by position in the window (T={longest})",
            "",
            "| mixer | " + " | ".join(f"[{a}, {b})" for a, b in ranges) + " |",
            "|---|" + "---:|" * len(ranges),
        ]
        for r in at_longest:
            lines.append(f"| {r['mixer']} | " + " | ".join(_fmt(b["loss"], b["loss_sd"], r["seeds"])
                                                           for b in r["buckets"]) + " |")
    return "\n".join(lines + _costs_markdown(results) + _plots_markdown(results.get("plots") or [])) + "\n"


def _plots_markdown(plots: list[str]) -> list[str]:
    """Links to the PNGs written beside results.md (none without matplotlib)."""
    if not plots:
        return []
    return ["", "## Plots", ""] + [f"- [{name}]({name}): {PLOT_CAPTIONS.get(name, name)}" for name in plots]


def _threads_text(results: dict[str, Any]) -> str:
    """The torch threads of this invocation, and those reused runs trained with where they differ
    (the solve mixers' losses move with the rounding a thread count brings: results/rounding)."""
    now = results["machine"]["threads"]
    counts = sorted({run["threads"] for run in results["runs"] if run.get("threads") is not None})
    if counts in ([], [now]):
        return f"{now} torch threads"
    return f"{now} torch threads now; the runs trained with {' / '.join(map(str, counts))}"


def _budget_markdown(results: dict[str, Any]) -> str:
    """The line at the top of results.md: which budget was equal, and how."""
    settings, budget = results["settings"], results["budget"]
    tokens = f"{settings['steps']} steps × {settings['tokens_per_step']:,} tokens"
    if budget["equal"] == "tokens":
        return (f"Equal budget: **{budget['tokens_per_run']:,} training tokens** per run ({tokens}); training FLOPs "
                "and seconds differ between the mixers (table at the end).")
    if budget["equal"] == "flops":
        return (f"Equal budget: **training FLOPs** — at each length every run gets the FLOPs {REFERENCE_MIXER} spends "
                f"on {tokens} (analytic counts, `kernelmix.studies.flops`), so its own number of steps; tokens and "
                "seconds differ (table at the end).")
    target = (f"{settings['seconds']:g} s" if settings.get("seconds") is not None
              else f"the seconds {REFERENCE_MIXER} takes for {tokens}")
    return (f"Equal budget: **training time** — at each length every run gets {target} of training on this machine, "
            f"its steps set by a calibration of its speed ({settings['calibration_steps']} timed steps). Measured time "
            "is noisy (±10–30% on a shared machine): the seconds each run took are in the table at the end.")


def _costs_markdown(results: dict[str, Any]) -> list[str]:
    """The table of what every run cost, whatever the budget (mean over seeds)."""
    settings, summary = results["settings"], results["summary"]
    lines = ["",
             "## Cost per run: steps, training tokens, training FLOPs, "
             f"training seconds (equal: {results['budget']['equal']})",
             "", "| mixer | T | steps | tokens | FLOPs | train s | tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    cell = {(r["mixer"], r["length"]): r for r in summary}
    for m in settings["mixers"]:
        for t in settings["lengths"]:
            r = cell.get((m, t))
            if r is None:
                continue
            seconds = "–" if r.get("train_s") is None else f"{r['train_s']:.1f}"
            lines.append(f"| {m} | {t} | {r['steps']:g} | {r['tokens']:,.0f} | {flop_text(r['flops'])} | {seconds} | "
                         f"{r['tokens_per_s']:,.0f} |")
    return lines


def flop_text(flops: float | None) -> str:
    """FLOPs with an SI prefix: 1.23 GFLOP."""
    if flops is None:
        return "? FLOP"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"
