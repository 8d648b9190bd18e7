"""kernelmix recall: MQAR generation (pairs, query placement, disjoint vocabularies, seeded), scoring on
the query positions only, a two-step recall run through the CLI that writes valid JSON, Markdown and
a PNG (reused when run again, kept when interrupted), and the errors that name the fix. The structure
checks read the sequences back with plain Python, independently of the generator's tensor code."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from kernelmix.cli import main as cli_main
from kernelmix.data import recall as data_recall
from kernelmix.data.recall import FILLER, check_mqar, key_range, mqar_batch, query_accuracy, value_range
from kernelmix.errors import Interrupted, KernelmixError
from kernelmix.studies import recall as study
from kernelmix.studies.recall import RecallConfig, evaluate_recall, run_recall, train_cell
from kernelmix.training.signals import StopSignals

PNG = b"\x89PNG\r\n\x1a\n"


def batch(seed=0, vocab=64, length=48, pairs=6, rows=16, **options):
    return mqar_batch(vocab, length, pairs, rows, torch.Generator().manual_seed(seed), **options)


def parse(row: list[int], labels: list[int], pairs: int) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
    """The prefix's key -> value map and every scored (position of the value, key, value) of one row."""
    prefix = {row[2 * i]: row[2 * i + 1] for i in range(pairs)}
    scored = [(t, row[t - 1], labels[t]) for t in range(len(row)) if labels[t] != -100]
    return prefix, scored


class TestGeneration:
    def test_pairs_come_first_with_distinct_keys_and_values_from_their_own_range(self):
        ids, labels = batch()
        keys, values = set(key_range(64)), set(value_range(64))
        assert not keys & values and FILLER not in keys | values  # three disjoint parts of the vocabulary
        assert ids.shape == labels.shape == (16, 48) and ids.dtype == labels.dtype == torch.int64
        for row in ids.tolist():
            prefix_keys = row[0:12:2]
            assert len(set(prefix_keys)) == 6 and set(prefix_keys) <= keys
            assert set(row[1:12:2]) <= values

    def test_queries_repeat_earlier_keys_followed_by_their_values_in_two_token_slots(self):
        ids, labels = batch(length=50)
        for row, lab in zip(ids.tolist(), labels.tolist()):
            prefix, scored = parse(row, lab, 6)
            assert len(scored) == 6  # one query per pair, every one scored
            for position, key, value in scored:
                assert position >= 13 and (position - 12) % 2 == 1  # key at an even offset after the pairs
                assert key in prefix and value == prefix[key] == row[position]
            asked = {p - 1 for p, _, _ in scored} | {p for p, _, _ in scored}
            rest = [row[t] for t in range(12, 50) if t not in asked]
            assert rest == [FILLER] * len(rest)  # the odd last position too

    def test_labels_are_minus_100_except_at_the_values_after_queries(self):
        ids, labels = batch()
        scored = labels != -100
        assert int(scored.sum()) == 16 * 6
        assert not scored[:, :12].any()  # the pairs' own values are not predictable, so not scored
        assert torch.equal(labels[scored], ids[scored])

    def test_placement_follows_the_power_law(self):
        def mean_slot(power_a):
            _, labels = batch(rows=400, length=200, pairs=4, power_a=power_a)
            slots = [(t - 8 - 1) / 2 for t in (labels != -100).nonzero()[:, 1].tolist()]
            return sum(slots) / len(slots)

        # 96 slots: uniform placement averages about slot 47; Zoology's power_a=0.01 puts most queries near the pairs
        assert mean_slot(0.01) < 30 < 40 < mean_slot(1.0)

    def test_the_same_seed_gives_the_same_batch_and_another_seed_another(self):
        first, second, other = batch(seed=3), batch(seed=3), batch(seed=4)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        assert not torch.equal(first[0], other[0])

    def test_a_full_sequence_and_more_queries_than_pairs(self):
        ids, labels = batch(length=24, pairs=6)  # 4 x pairs == T: every slot holds a query
        assert (ids[:, 12:] != FILLER).all()
        ids, labels = batch(length=40, pairs=4, num_queries=12)
        for row, lab in zip(ids.tolist(), labels.tolist()):
            prefix, scored = parse(row, lab, 4)
            assert len(scored) == 12 and all(prefix[k] == v for _, k, v in scored)


class TestScoring:
    def predictions(self, ids, labels, right_on_queries: bool):
        """Predicted next tokens: the true next token everywhere, then replaced on the query positions
        (by the right value, or by a wrong one) or off them (by a wrong token)."""
        truth = torch.roll(ids, -1, dims=1)
        query = torch.zeros_like(labels, dtype=torch.bool)
        query[:, :-1] = labels[:, 1:] != -100
        wrong = (truth + 1) % 64
        return torch.where(query, truth, wrong) if right_on_queries else torch.where(query, wrong, truth)

    def test_right_exactly_on_the_query_positions_scores_one(self):
        ids, labels = batch()
        assert query_accuracy(self.predictions(ids, labels, True), labels) == (96, 96)

    def test_right_everywhere_but_the_query_positions_scores_zero(self):
        ids, labels = batch()
        assert query_accuracy(self.predictions(ids, labels, False), labels) == (0, 96)

    def test_logits_are_scored_by_their_argmax_through_evaluate_recall(self):
        ids, labels = batch()

        class Oracle(torch.nn.Module):  # one-hot logits of the predictions above
            def __init__(self, predicted):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(1))
                self.predicted = predicted

            def forward(self, input_ids):
                rows = [i for i in range(len(self.predicted)) if torch.equal(ids[i], input_ids[0])][0]
                logits = torch.nn.functional.one_hot(self.predicted[rows:rows + len(input_ids)], 64).float()
                return type("Out", (), {"logits": logits})()

        assert evaluate_recall(Oracle(self.predictions(ids, labels, True)), ids, labels, 5) == (96, 96)
        assert evaluate_recall(Oracle(self.predictions(ids, labels, False)), ids, labels, 5) == (0, 96)


def tiny(out, **overrides) -> RecallConfig:
    settings = dict(mixers=["softmax", "performer"], widths=[16], lengths=[16], pairs=[2, 4], steps=2, batch_size=4,
                    warmup_steps=1, eval_examples=8, vocab_size=32, out_dir=str(out))
    return RecallConfig(**{**settings, **overrides})


ARGS = ["recall", "--mixers", "softmax,performer", "--widths", "16", "--lengths", "16", "--pairs", "2,4,8", "--steps",
        "2", "--batch-size", "4", "--warmup-steps", "1", "--eval-examples", "8", "--vocab-size", "32"]


class TestRun:
    def test_two_steps_through_the_cli_write_json_markdown_and_png_and_are_reused(self, tmp_path, capsys):
        out = tmp_path / "recall"
        assert cli_main(ARGS + ["--out", str(out)]) == 0
        data = json.loads((out / "results.json").read_text())
        assert data["format"] == "kernelmix.recall/1" and len(data["cells"]) == 4 and data["reused_cells"] == 0
        assert data["skipped"] == [{"length": 16, "pairs": 8, "why": "4 x 8 pairs > T=16"}]
        for cell in data["cells"]:
            assert {"mixer", "width", "length", "pairs", "accuracy", "final_train_loss", "steps", "tokens", "seconds",
                    "seed", "eval_seed"} <= set(cell)
            assert 0 <= cell["accuracy"] <= 1 and cell["queries"] == 8 * cell["pairs"]
            assert cell["steps"] == 2 and cell["tokens"] == 2 * 4 * 16 and cell["seed"] == 0
        md = (out / "results.md").read_text()
        assert "| softmax |" in md and "| performer |" in md and "T=16, 4 pairs" in md and "## width 16" in md
        assert (out / "accuracy_vs_pairs.png").read_bytes()[:8] == PNG and data["plots"] == ["accuracy_vs_pairs.png"]
        assert "| softmax |" in capsys.readouterr().out

        assert cli_main(ARGS + ["--out", str(out)]) == 0  # the same command again: every cell reused
        again = json.loads((out / "results.json").read_text())
        assert (again["reused_cells"] == 4
                and [c["accuracy"] for c in again["cells"]] == [c["accuracy"] for c in data["cells"]])

    def test_a_changed_setting_trains_again(self, tmp_path):
        run_recall(tiny(tmp_path, mixers=["softmax"], pairs=[2]), progress=False, note=lambda _: None)
        results = run_recall(tiny(tmp_path, mixers=["softmax"], pairs=[2], lr=1e-3), progress=False,
                             note=lambda _: None)
        assert results["reused_cells"] == 0 and len(list((tmp_path / "cells").glob("*.json"))) == 2

    def test_training_and_held_out_data_come_from_different_seeds(self):
        config = tiny("unused")
        assert study.train_seed(config, 16, 2) != study.eval_seed(config, 16, 2)
        generator = torch.Generator().manual_seed(study.train_seed(config, 16, 2))
        first_training_batch = mqar_batch(32, 16, 2, 8, generator)[0]
        assert not torch.equal(first_training_batch, study.held_out(config, 16, 2)[0])

    def test_a_stop_signal_drops_the_cell_in_progress_and_keeps_the_finished_ones(self, tmp_path, monkeypatch):
        calls = {"n": 0}
        real = study.mqar_batch

        def batches_then_ctrl_c(*args, **kwargs):  # SIGINT during the second cell's first step
            calls["n"] += 1
            if calls["n"] == 4:  # cell 1: 2 training batches + the held-out set; then cell 2's first batch
                signal.raise_signal(signal.SIGINT)
            return real(*args, **kwargs)

        monkeypatch.setattr(study, "mqar_batch", batches_then_ctrl_c)
        with pytest.raises(Interrupted, match="the 1 finished cells are kept .* run the same command again") as stop:
            run_recall(tiny(tmp_path), progress=False, note=lambda _: None)
        assert stop.value.exit_code == 130
        assert len(list((tmp_path / "cells").glob("*.json"))) == 1 and not (tmp_path / "results.json").exists()
        monkeypatch.setattr(study, "mqar_batch", real)
        assert run_recall(tiny(tmp_path), progress=False, note=lambda _: None)["reused_cells"] == 1

    def test_train_cell_stops_at_the_next_step_when_a_signal_was_received(self):
        signals = StopSignals()
        signals.received = signal.SIGTERM
        with pytest.raises(Interrupted):
            train_cell(tiny("unused"), "softmax", 16, 16, 2, device=torch.device("cpu"), signals=signals)


class TestErrors:
    @pytest.mark.parametrize("sizes, words", [
        ((64, 20, 6), ["seq_len 20 is too short for 6 pairs", "use seq_len >= 24 or at most 5 pairs"]),
        ((16, 64, 8), ["8 pairs need 8 distinct keys", "vocab_size 16 has 7 key tokens", "at least 17"]),
        ((2, 64, 1), ["vocab_size 2 leaves no room", "use at least 3"]),
        ((64, 64, 0), ["num_pairs must be a positive integer, got 0"]),
    ])
    def test_sizes_that_cannot_make_a_batch_name_the_fix(self, sizes, words):
        with pytest.raises(KernelmixError) as error:
            mqar_batch(*sizes, 2, torch.Generator())
        for text in words:
            assert text in str(error.value)

    def test_other_bad_arguments(self):
        with pytest.raises(KernelmixError, match="generator must be a torch.Generator.*manual_seed"):
            mqar_batch(64, 64, 4, 2, 0)
        with pytest.raises(KernelmixError, match=r"power_a .* in \(0, 1\]"):
            check_mqar(64, 64, 4, 2, power_a=0)
        with pytest.raises(KernelmixError, match="more queries than the 2 slots"):
            mqar_batch(64, 8, 2, 2, torch.Generator(), num_queries=3)
        with pytest.raises(KernelmixError, match="differ in shape"):
            query_accuracy(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long))

    @pytest.mark.parametrize("overrides, words", [
        (dict(seed=3, eval_seed=3), "pass e.g. --eval-seed 4"),
        (dict(pairs=[40]), "use --vocab-size 81 or more"),
        (dict(lengths=[8], pairs=[4]), "use longer lengths or fewer pairs"),
        (dict(widths=[30], heads=4), "width 30 is not a multiple of heads 4"),
        (dict(pairs=[2, 2]), r"\[2, 2\] repeats 2: list each pair count once"),
        (dict(min_lr=1.0), "lower min_lr"),
    ])
    def test_configs_that_cannot_run_name_the_fix(self, overrides, words):
        with pytest.raises(KernelmixError, match=words):
            tiny("unused", **{"vocab_size": 64, **overrides})

    def test_cli_refuses_a_bad_option_and_a_file_as_out(self, tmp_path, capsys):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["recall", "--pairs", "0"])
        assert exit_.value.code == 2 and "--pairs must be positive integers, got [0]" in capsys.readouterr().err
        (tmp_path / "file").write_text("x")
        with pytest.raises(SystemExit):
            cli_main(ARGS + ["--out", str(tmp_path / "file")])
        assert "is a file" in capsys.readouterr().err


def test_the_module_exports_what_the_study_uses():
    assert set(data_recall.__all__) >= {"mqar_batch", "query_accuracy", "key_range", "value_range"}


def test_the_settings_copy_of_the_query_placement_is_the_datas():
    """RecallConfig lives in a module without torch (what the command line reads), with its own copy
    of kernelmix.data.recall's POWER_A (that module imports torch)."""
    from kernelmix.data.recall import POWER_A
    from kernelmix.studies import settings

    assert settings.POWER_A == POWER_A == RecallConfig().power_a
