"""The claims table over corpora (kernelmix.studies.corpora): gaps paired by seed, verdicts with the
rounding noise as margin, the pooled rounding sd, and the markdown, on hand-made compare results."""

import json
import math

import pytest

from kernelmix.studies.corpora import CLAIMS, corpora_markdown, paired_gap, rounding_noise, summarize_corpora, verdict


def _write(folder, losses: dict, bigram=3.0):
    """``losses``: {(mixer, length, seed): loss} → a compare results.json in ``folder``."""
    folder.mkdir(parents=True)
    runs = [{"mixer": m, "length": t, "seed": s, "val_loss": v} for (m, t, s), v in losses.items()]
    (folder / "results.json").write_text(json.dumps({
        "runs": runs, "reference": {"bigram": bigram, "unigram": bigram + 0.5},
        "settings": {"preset": "mini", "steps": 300, "tokens_per_step": 2048, "corpus": folder.name, "lengths": [256]}}))
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
    assert "| Cubit reaches a lower loss than softmax | prose | T=256: -0.140 ± 0.057 (2/2 below 0) | 0.020 | held |" in text
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
