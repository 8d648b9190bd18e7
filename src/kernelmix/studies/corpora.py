"""The claims table over kinds of text: one ``kernelmix compare`` per corpus, summarised across them.

Each corpus's compare writes its own folder (``results.json`` in the format of
:mod:`kernelmix.studies.compare`); :func:`summarize_corpora` reads those folders and returns, per
corpus, the bigram line of its tokens (computed on that corpus's training split by compare itself),
every mixer's final validation loss per length and seed, and the gaps of each claim paired by seed.
:func:`corpora_markdown` writes the table with one verdict per corpus and an overall line.

Plain data and the standard library only: it reads JSON, trains nothing (``results/corpora/run.py``
runs the compares, one after another, resumably).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Claim:
    """A seed paper's claim as a paired gap: ``mixer`` − ``baseline`` final loss, held when below 0."""

    name: str
    mixer: str
    baseline: str


CLAIMS = (
    Claim("Cubit reaches a lower loss than softmax", "cubit", "softmax"),
    Claim("LRR helps Cubit", "cubit", "cubit-nolrr"),
    Claim("DARKFormer trains to a lower loss than Performer", "darkformer", "performer"),
    Claim("DeltaFormer reaches a lower loss than softmax", "deltaformer", "softmax"),
    Claim("Cubit-RF reaches a lower loss than DARKFormer", "cubit-rf", "darkformer"),
)


SAME_SETTING = ("preset", "steps", "tokens_per_step", "corpus", "tokenizer")


def read_compare(folder: str | Path | list[str | Path]) -> dict:
    """One corpus's compare: ``{"bigram", "unigram", "mixers": {mixer: {length: {seed: loss}}}, "settings"}``.
    A list of folders is one corpus's compares in the same setting (a mixer run later beside the
    others), merged; the reference lines are the first folder's."""
    folders = [Path(f) for f in (folder if isinstance(folder, list) else [folder])]
    saved = []
    for path in (f / "results.json" for f in folders):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run that corpus's kernelmix compare first "
                                    "(results/corpora/run.py)")
        saved.append(json.loads(path.read_text()))
    setting = {k: saved[0]["settings"].get(k) for k in SAME_SETTING}
    for path, other in zip(folders[1:], saved[1:]):
        theirs = {k: other["settings"].get(k) for k in SAME_SETTING}
        if theirs != setting:
            raise ValueError(f"{path} was trained in another setting ({theirs}) than {folders[0]} ({setting}): "
                             "only compares of the same setting are one corpus's runs")
    mixers: dict[str, dict[str, dict[int, float]]] = {}
    for run in (run for one in saved for run in one["runs"]):
        mixers.setdefault(run["mixer"], {}).setdefault(str(run["length"]), {})[int(run["seed"])] = float(
            run["val_loss"])
    first = saved[0]
    return {"bigram": first["reference"]["bigram"], "unigram": first["reference"]["unigram"], "mixers": mixers,
            "settings": {k: first["settings"].get(k) for k in ("preset", "steps", "tokens_per_step", "corpus",
                                                               "lengths")}}


def paired_gap(mixers: dict, claim: Claim, length: str) -> dict | None:
    """The claim's gap at ``length``, paired by seed: per-seed values, mean, sample sd (None with one
    seed), and how many seeds are below 0; None when either mixer or every common seed is missing."""
    a, b = mixers.get(claim.mixer, {}).get(length, {}), mixers.get(claim.baseline, {}).get(length, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    gaps = [a[s] - b[s] for s in seeds]
    return {"seeds": seeds, "gaps": gaps, "mean": statistics.fmean(gaps),
            "sd": statistics.stdev(gaps) if len(gaps) > 1 else None, "below_zero": sum(g < 0 for g in gaps)}


def verdict(gaps: list[dict], noise: float = 0.0) -> str:
    """*held* when every paired gap (all lengths, all seeds) is below −``noise``; *not held* when at
    every length the mean gap is above −``noise`` (no advantage beyond the rounding noise on average);
    *mixed* otherwise (the sign depends on the seed or the length)."""
    if not gaps:
        return "no runs"
    if all(g < -noise for entry in gaps for g in entry["gaps"]):
        return "held"
    if all(entry["mean"] > -noise for entry in gaps):
        return "not held"
    return "mixed"


def summarize_corpora(folders: dict[str, str | Path | list[str | Path]],
                      rounding: dict[str, float] | None = None) -> dict:
    """``{"corpora": {name: {"bigram", "unigram", "mixers": {mixer: {length: [loss per seed]}},
    "seeds": {mixer: {length: [seed, ...]}}, "claims": {claim: {"gaps": {length: paired_gap}, "verdict"}}}},
    "overall": {claim: {corpus: verdict}}, "rounding": {...}}``. ``rounding`` (mixer → the sd of its final
    loss under a rounding-sized nudge) sets the margin a gap must clear: the larger of the two mixers'."""
    rounding = rounding or {}
    out: dict = {"corpora": {}, "overall": {}, "rounding": rounding}
    for name, folder in folders.items():
        corpus = read_compare(folder)
        mixers = corpus["mixers"]
        claims = {}
        lengths = sorted({length for by_length in mixers.values() for length in by_length}, key=int)
        for claim in CLAIMS:
            gaps = {length: paired_gap(mixers, claim, length) for length in lengths}
            gaps = {length: g for length, g in gaps.items() if g is not None}
            if not gaps:
                continue
            noise = max(rounding.get(claim.mixer, 0.0), rounding.get(claim.baseline, 0.0))
            claims[claim.name] = {"gaps": gaps, "verdict": verdict(list(gaps.values()), noise), "noise": noise}
            out["overall"].setdefault(claim.name, {})[name] = claims[claim.name]["verdict"]
        out["corpora"][name] = {
            "bigram": corpus["bigram"], "unigram": corpus["unigram"], "settings": corpus["settings"],
            "mixers": {m: {length: [v[s] for s in sorted(v)] for length, v in by_length.items()}
                       for m, by_length in mixers.items()},
            "seeds": {m: {length: sorted(v) for length, v in by_length.items()} for m, by_length in mixers.items()},
            "claims": claims,
        }
    return out


def rounding_noise(folders: list[str | Path]) -> dict[str, float]:
    """Per mixer, the pooled sd of the final loss over compares that differ by a rounding-sized nudge
    only (results/rounding: the same runs at lr × (1, 1 + 1e-6, 1 + 2e-6)): the variance over the
    nudges at each (length, seed), averaged, square-rooted."""
    values: dict[str, dict[tuple, list[float]]] = {}
    for folder in folders:
        for mixer, by_length in read_compare(folder)["mixers"].items():
            for length, by_seed in by_length.items():
                for seed, loss in by_seed.items():
                    values.setdefault(mixer, {}).setdefault((length, seed), []).append(loss)
    noise = {}
    for mixer, groups in values.items():
        variances = [statistics.variance(v) for v in groups.values() if len(v) > 1]
        if variances:
            noise[mixer] = math.sqrt(statistics.fmean(variances))
    return noise


def _spread(entry: dict) -> str:
    sd = "" if entry["sd"] is None else f" ± {entry['sd']:.3f}"
    return f"{entry['mean']:+.3f}{sd} ({entry['below_zero']}/{len(entry['gaps'])} below 0)"


def corpora_markdown(summary: dict) -> str:
    """The per-corpus loss table and the claims with one verdict per corpus and an overall line."""
    lines = ["## Final validation loss per corpus (mean ± sd over seeds, nats/token)", ""]
    for name, corpus in summary["corpora"].items():
        lengths = sorted({l for m in corpus["mixers"].values() for l in m}, key=int)
        lines += [f"**{name}** (bigram line {corpus['bigram']:.3f}, unigram {corpus['unigram']:.3f}):", "",
                  "| mixer | " + " | ".join(f"T={l}" for l in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for mixer, by_length in corpus["mixers"].items():
            cells = []
            for length in lengths:
                v = by_length.get(length, [])
                sd = f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""
                cells.append(f"{statistics.fmean(v):.3f}{sd} (n={len(v)})" if v else "–")
            lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## The claims, per corpus", "",
              "Gap = claimed mixer − baseline, paired by seed (mean ± sd, how many seeds below 0); *held* when every "
              "paired gap at every length is below −noise, *not held* when the mean gap at every length is above "
              "−noise, *mixed* otherwise; noise = the larger rounding sd of the two mixers (results/rounding).", "",
              "| claim | corpus | gap per length | noise | verdict |", "|---|---|---|---:|---|"]
    for claim in CLAIMS:
        for name, corpus in summary["corpora"].items():
            entry = corpus["claims"].get(claim.name)
            if entry is None:
                continue
            gaps = "; ".join(f"T={length}: {_spread(g)}" for length, g in entry["gaps"].items())
            lines.append(f"| {claim.name} | {name} | {gaps} | {entry['noise']:.3f} | {entry['verdict']} |")
        verdicts = summary["overall"].get(claim.name)
        if verdicts:
            lines.append(f"| {claim.name} | **overall** | {_overall(verdicts)} | | |")
    return "\n".join(lines) + "\n"


def readme_claims_table(summary: dict) -> str:
    """The README's claims table: one row per claim, per corpus the paired gap at each length (mean ±
    sd over seeds) and its verdict, and the overall line; written from ``summary`` alone, so a test
    can hold the README to results/corpora/results.json."""
    names = list(summary["corpora"])
    seeds = {len(s) for c in summary["corpora"].values() for e in c["claims"].values() for s in
             (g["seeds"] for g in e["gaps"].values())}
    lines = [f"| claim (mixer − baseline, T = {' / '.join(_lengths(summary))}) | " + " | ".join(names) + " | overall |",
             "|---|" + "---|" * (len(names) + 1)]
    for claim in CLAIMS:
        verdicts = summary["overall"].get(claim.name)
        if not verdicts:
            continue
        cells = []
        for name in names:
            entry = summary["corpora"][name]["claims"].get(claim.name)
            cells.append("–" if entry is None else " / ".join(
                f"{g['mean']:+.3f} ± {g['sd']:.3f}" if g["sd"] is not None else f"{g['mean']:+.3f}"
                for g in entry["gaps"].values()) + f": {entry['verdict']}")
        lines.append(f"| {claim.name} | " + " | ".join(cells) + f" | {_overall(verdicts)} |")
    seeds_text = "–".join(str(n) for n in sorted(seeds)) if seeds else "0"
    return "\n".join(lines) + f"\n\n({seeds_text} seeds paired per gap.)\n"


def _lengths(summary: dict) -> list[str]:
    return sorted({length for c in summary["corpora"].values() for e in c["claims"].values() for length in e["gaps"]},
                  key=int)


def _overall(verdicts: dict[str, str]) -> str:
    by = {}
    for corpus, v in verdicts.items():
        by.setdefault(v, []).append(corpus)
    return "; ".join(f"{v} on {', '.join(c)}" for v, c in sorted(by.items()))


__all__ = ["CLAIMS", "Claim", "corpora_markdown", "paired_gap", "read_compare", "readme_claims_table", "rounding_noise",
           "summarize_corpora", "verdict"]
