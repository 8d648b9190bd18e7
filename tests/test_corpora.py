"""The claims table over corpora (kernelmix.studies.corpora): gaps paired by seed, verdicts with the
rounding noise as margin, the pooled rounding sd, and the markdown, on hand-made compare results."""

import json
import math
from pathlib import Path

import pytest

from kernelmix.studies.corpora import (
    CLAIMS, corpora_markdown, paired_gap, readme_claims_table, rounding_noise, summarize_corpora, verdict,
)

ROOT = Path(__file__).resolve().parents[1]


def _write(folder, losses: dict, bigram=3.0, corpus=None, steps=300):
    """``losses``: {(mixer, length, seed): loss} → a compare results.json in ``folder``."""
    folder.mkdir(parents=True)
    runs = [{"mixer": m, "length": t, "seed": s, "val_loss": v} for (m, t, s), v in losses.items()]
    (folder / "results.json").write_text(json.dumps({
        "runs": runs, "reference": {"bigram": bigram, "unigram": bigram + 0.5},
        "settings": {"preset": "mini", "steps": steps, "tokens_per_step": 2048, "corpus": corpus or folder.name,
                     "lengths": [256]}}))
    return folder


def test_gaps_are_paired_by_seed_and_missing_seeds_are_left_out():
    mixers = {"cubit": {"256": {0: 2.0, 1: 2.5, 2: 2.2}}, "softmax": {"256": {0: 2.1, 1: 2.4}}}
    gap = paired_gap(mixers, CLAIMS[0], "256")
    assert gap["seeds"] == [0, 1]
    assert gap["gaps"] == pytest.approx([-0.1, 0.1])
    assert gap["mean"] == pytest.approx(0.0) and gap["sd"] == pytest.approx(math.sqrt(0.02))
    assert gap["below_zero"] == 1
    assert paired_gap(mixers, CLAIMS[0], "512") is None


def test_verdicts_use_the_noise_as_margin():
    below = {"gaps": [-0.05, -0.04], "mean": -0.045}
    assert verdict([below]) == "held"
    assert verdict([below], noise=0.045) == "mixed"  # one gap inside the noise; the mean is not above -noise
    assert verdict([{"gaps": [0.03, -0.01], "mean": 0.01}]) == "not held"
    assert verdict([below, {"gaps": [0.05, 0.06], "mean": 0.055}]) == "mixed"  # held at one length only
    assert verdict([]) == "no runs"


def test_summary_over_two_corpora_and_its_markdown(tmp_path):
    code = _write(tmp_path / "code", {("softmax", 256, 0): 2.4, ("softmax", 256, 1): 2.5,
                                      ("cubit", 256, 0): 2.5, ("cubit", 256, 1): 2.55})
    prose = _write(tmp_path / "prose", {("softmax", 256, 0): 1.6, ("softmax", 256, 1): 1.7,
                                        ("cubit", 256, 0): 1.5, ("cubit", 256, 1): 1.52}, bigram=2.2)
    summary = summarize_corpora({"code": code, "prose": prose}, {"cubit": 0.02, "softmax": 0.001})
    claim = CLAIMS[0].name
    assert summary["corpora"]["code"]["claims"][claim]["verdict"] == "not held"
    assert summary["corpora"]["prose"]["claims"][claim]["verdict"] == "held"
    assert summary["corpora"]["prose"]["claims"][claim]["noise"] == 0.02
    assert summary["overall"][claim] == {"code": "not held", "prose": "held"}
    assert summary["corpora"]["prose"]["mixers"]["cubit"]["256"] == [1.5, 1.52]
    assert summary["corpora"]["prose"]["bigram"] == 2.2
    assert set(summary["corpora"]["code"]["claims"]) == {claim}  # no runs of the other claims' mixers
    text = corpora_markdown(summary)
    assert ("| Cubit reaches a lower loss than softmax | prose | T=256: -0.140 ± 0.057 (2/2 below 0) | 0.020 | held |"
            in text)
    assert "held on prose; not held on code" in text


def test_rounding_noise_is_the_pooled_sd_over_nudges(tmp_path):
    values = [(2.50, 2.40), (2.52, 2.40), (2.55, 2.40)]  # three nudges; seed 0 moves, seed 1 does not
    folders = [_write(tmp_path / f"nudge{i}", {("cubit", 256, 0): a, ("cubit", 256, 1): b})
               for i, (a, b) in enumerate(values)]
    mean = sum(a for a, _ in values) / 3
    variance0 = sum((a - mean) ** 2 for a, _ in values) / 2
    assert rounding_noise(folders)["cubit"] == pytest.approx(math.sqrt((variance0 + 0.0) / 2))


def test_a_missing_compare_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="run that corpus's kernelmix compare first"):
        summarize_corpora({"x": tmp_path / "nothing"})


def test_one_corpus_from_two_compares_of_the_same_setting(tmp_path):
    """A mixer trained later in its own folder joins its corpus's runs; another setting is refused."""
    main = _write(tmp_path / "main", {("darkformer", 256, 0): 2.8, ("darkformer", 256, 1): 2.9}, corpus="code")
    extra = _write(tmp_path / "extra", {("cubit-rf", 256, 0): 2.7, ("cubit-rf", 256, 1): 2.95}, corpus="code")
    summary = summarize_corpora({"code": [main, extra]})
    gap = summary["corpora"]["code"]["claims"]["Cubit-RF reaches a lower loss than DARKFormer"]["gaps"]["256"]
    assert gap["gaps"] == pytest.approx([-0.1, 0.05]) and gap["below_zero"] == 1
    other = _write(tmp_path / "other", {("cubit-rf", 256, 0): 2.7}, corpus="code", steps=100)
    with pytest.raises(ValueError, match="another setting"):
        summarize_corpora({"code": [main, other]})


def test_readme_claims_table_has_one_verdict_per_corpus_and_an_overall_column(tmp_path):
    code = _write(tmp_path / "code", {("softmax", 256, 0): 2.4, ("softmax", 256, 1): 2.5, ("softmax", 256, 2): 2.45,
                                      ("cubit", 256, 0): 2.5, ("cubit", 256, 1): 2.55, ("cubit", 256, 2): 2.5})
    prose = _write(tmp_path / "prose", {("softmax", 256, 0): 1.6, ("softmax", 256, 1): 1.7, ("softmax", 256, 2): 1.65,
                                        ("cubit", 256, 0): 1.5, ("cubit", 256, 1): 1.52, ("cubit", 256, 2): 1.55})
    table = readme_claims_table(summarize_corpora({"code": code, "prose": prose}))
    assert table.splitlines()[0] == "| claim (mixer − baseline, T = 256) | code | prose | overall |"
    assert ("| Cubit reaches a lower loss than softmax | +0.067 ± 0.029: not held | -0.127 ± 0.046: held "
            "| held on prose; not held on code |") in table
    assert "(3 seeds paired per gap.)" in table
    assert len(table.splitlines()) == 5  # header, rule, the one claim with runs, blank, the seeds line


def test_the_readme_claims_table_is_the_one_results_corpora_holds():
    """The README's table is written from results/corpora/results.json: no number drifts from it."""
    summary = json.loads((ROOT / "results" / "corpora" / "results.json").read_text())
    assert all(len(g["seeds"]) >= 3 for c in summary["corpora"].values() for e in c["claims"].values()
               for g in e["gaps"].values()), "every verdict rests on ≥ 3 seeds"
    assert readme_claims_table(summary) in (ROOT / "README.md").read_text()
