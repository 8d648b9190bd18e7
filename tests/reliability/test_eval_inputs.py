"""Issues 15 (item 1) and 13 (item 11): ``kernelmix eval`` never looks hung, has a bounded default
scope, refuses bad options before the work, and says so when there is nothing to score.

One class per failure case; each test failed on the code before the fix (the whole split by
default with one line of output for half an hour, no progress, one window per forward in
``evaluate_windows``, ``--json`` into a missing directory or an lm-eval that is not installed
found out after the whole evaluation, ``loss nan`` for an empty position bucket and NaN in the
JSON, a "val_fraction > 0" fix for a text that has nothing to predict). Expected token counts are
worked out from the texts (byte tokens: one per byte), not by the code under test.

A tiny run (1 step) on the fixture corpus; the scope tests evaluate generated texts (``--data``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from kernelmix.cli import main as cli_main
from kernelmix.evaluate import evaluate_loss, evaluate_windows, split_from_texts
from kernelmix.data import ByteTokenizer
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.training import TrainConfig, train

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).parents[1] / "fixtures" / "train_corpus")

data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny run (T=64, max_seq_len 256), one step: the weights do not matter here."""
    out = tmp_path_factory.mktemp("evalrun") / "run"
    train(TrainConfig(preset="tiny", corpus=CORPUS, seq_len=64, batch_size=2, steps=1, warmup_steps=0, eval_every=0,
                      eval_batches=1, val_fraction=0.3, out_dir=str(out), device="cpu"), progress=False)
    return out


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory):
    """10 documents of 4,200 bytes (= tokens), each different: more than the default scope."""
    folder = tmp_path_factory.mktemp("docs")
    lengths = []
    for i in range(10):
        line = f"def f{i}(x):\n    return x * {i} + {i * i}\n"
        text = (line * (4200 // len(line) + 1))[:4200]
        (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        lengths.append(len(text.encode("utf-8")))
    return folder, lengths


def _forbid_forwards(monkeypatch):
    """Any forward of the model fails the test: the input had to be refused before the work."""
    def never(self, *args, **kwargs):
        raise AssertionError("a forward ran although the command's input was refused")
    monkeypatch.setattr(CausalLM, "forward", never)


def _strict_json(path: Path):
    def no_constant(name):
        raise AssertionError(f"{name} is not JSON (RFC 8259)")
    return json.loads(path.read_text(), parse_constant=no_constant)


class TestDefaultScopeIsBoundedAndStated:
    """The README's `kernelmix eval runs/cubit` ran the whole split (622k tokens) for 28+ minutes."""

    def test_default_is_the_first_8_documents_4096_tokens_each_and_says_so(self, run_dir, long_docs, tmp_path, capsys):
        folder, lengths = long_docs
        out = tmp_path / "eval.json"
        assert cli_main(["eval", str(run_dir), "--data", str(folder), "--json", str(out)]) == 0
        text = capsys.readouterr().out
        expected_tokens = sum(min(n, 4096) for n in lengths[:8])
        assert (f"first 8 of 10 documents, at most 4,096 tokens each ({expected_tokens:,} of {sum(lengths):,} tokens)"
                in text)
        assert "--max-docs all for the whole split" in text
        data = _strict_json(out)
        assert data["losses"][0]["tokens"] == sum(min(n, 4096) - 1 for n in lengths[:8])
        assert data["scope"]["whole"] is False and data["scope"]["documents"] == 8

    def test_max_docs_all_evaluates_every_token(self, run_dir, long_docs, tmp_path, capsys):
        folder, lengths = long_docs
        out = tmp_path / "eval.json"
        assert cli_main(["eval", str(run_dir), "--data", str(folder), "--max-docs", "all", "--json", str(out)]) == 0
        assert f"all 10 documents, {sum(lengths):,} tokens" in capsys.readouterr().out
        data = _strict_json(out)
        assert data["losses"][0]["tokens"] == sum(n - 1 for n in lengths)  # every token but each document's first
        assert data["scope"]["whole"] is True
        assert data["losses"][0]["bits_per_byte"] is not None  # the whole text: its bytes are known


class TestProgressIsShown:
    """One line, then silence for the whole evaluation: nothing said whether it was working."""

    def test_a_bar_counts_every_predicted_token_of_every_length(self, run_dir, long_docs, monkeypatch, capsys):
        folder, lengths = long_docs
        bars = []

        class Recorder:
            def __init__(self, enabled, label, total, **options):
                self.enabled, self.label, self.total, self.completed, self.closed = enabled, label, total, 0, False
                bars.append(self)

            def update(self, completed=None, **fields):
                if completed is not None:
                    assert completed >= self.completed  # never goes back
                    self.completed = completed

            def advance(self, n=1):
                self.completed += n

            def print(self, text):
                pass

            def close(self):
                self.closed = True

        import kernelmix.cli.eval as eval_command

        monkeypatch.setattr(eval_command, "progress_bar", Recorder)
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        args = ["eval", str(run_dir), "--data", str(folder), "--max-docs", "3", "--lengths", "32,64"]
        assert cli_main(args) == 0
        (bar,) = bars
        per_length = sum(min(n, 4096) - 1 for n in lengths[:3])
        assert bar.enabled and bar.total == 2 * per_length
        assert bar.completed == bar.total and bar.closed

    def test_evaluate_loss_reports_tokens_done(self):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig.preset("tiny")).eval()
        texts = ["abcdefghij" * 9, "0123456789" * 5, "xy"]
        split = split_from_texts(texts, ByteTokenizer())
        calls = []
        evaluate_loss(model, split, [16], batch_size=2, progress=lambda T, done: calls.append((T, done)))
        assert calls[-1] == (16, sum(len(t) - 1 for t in texts))
        assert all(b[1] > a[1] for a, b in zip(calls, calls[1:]))


class TestWindowsAreBatched:
    """evaluate_windows ran one window per forward unless told otherwise."""

    def test_evaluate_windows_runs_several_windows_per_forward(self):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig.preset("tiny")).eval()
        windows = torch.randint(0, 256, (7, 32), generator=torch.Generator().manual_seed(1))
        forwards = []
        handle = model.register_forward_hook(
            lambda module, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True)
        try:
            result = evaluate_windows(model, windows)
        finally:
            handle.remove()
        assert len(forwards) < 7 and sum(forwards) == 7
        with torch.no_grad():
            logits = model.double()(windows, use_cache=False).logits[:, :-1]
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1)).item()
        assert result["loss"] == pytest.approx(expected, rel=1e-5)

    def test_full_windows_go_without_padding_or_mask(self):
        """A mask on a batch with no padding sent every mixer down its document-aware path."""
        torch.manual_seed(0)
        model = CausalLM(ModelConfig.preset("tiny")).eval()
        split = split_from_texts(["abcdefghij" * 9, "0123456789" * 5], ByteTokenizer())
        seen = []
        handle = model.register_forward_hook(
            lambda module, args, kwargs, out: seen.append((tuple(kwargs["input_ids"].shape),
                                                           kwargs.get("attention_mask"))),
            with_kwargs=True)
        try:
            evaluate_loss(model, split, [16], batch_size=4)
        finally:
            handle.remove()
        full = [mask for shape, mask in seen if shape[1] == 16]
        assert len(full) == 2 and all(mask is None for mask in full)  # 8 full windows, 4 a batch
        assert [mask is not None for shape, mask in seen if shape[1] < 16] == [True]  # the short ones: 15 and 5 tokens
        assert sum(shape[0] for shape, _ in seen) == math.ceil(89 / 15) + math.ceil(49 / 15)


class TestOptionsCheckedBeforeTheWork:
    """`--tasks`, `--json` and the backend were found bad only after the whole loss evaluation."""

    def test_json_into_a_missing_directory(self, run_dir, tmp_path, monkeypatch, capsys):
        _forbid_forwards(monkeypatch)
        target = tmp_path / "no" / "such" / "eval.json"
        assert cli_main(["eval", str(run_dir), "--json", str(target)]) == 2
        err = capsys.readouterr().err
        assert "--json" in err and "does not exist" in err and "create it" in err

    def test_too_many_cloze_items(self, run_dir, monkeypatch, capsys):
        _forbid_forwards(monkeypatch)
        assert cli_main(["eval", str(run_dir), "--tasks", "cloze", "--items", "100000"]) == 2
        err = capsys.readouterr().err
        assert "cloze items" in err and "ask for ≤" in err

    def test_lm_eval_not_installed(self, run_dir, monkeypatch, capsys):
        _forbid_forwards(monkeypatch)
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval → ImportError
        assert cli_main(["eval", str(run_dir), "--tasks", "cloze", "--backend", "lm-eval"]) == 2
        err = capsys.readouterr().err
        assert "lm-evaluation-harness" in err and 'pip install "kernelmix[eval]"' in err

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    def test_cuda_without_cuda(self, run_dir, monkeypatch, capsys):
        _forbid_forwards(monkeypatch)
        assert cli_main(["eval", str(run_dir), "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "no CUDA device" in err and "--device cpu" in err


class TestNothingToScoreIsSaid:
    """An empty position bucket printed `loss nan` and wrote NaN into the JSON; a text with nothing
    to predict got the training-data advice "val_fraction > 0"."""

    def test_an_empty_bucket_says_why_and_the_json_is_valid(self, run_dir, tmp_path, capsys):
        doc = tmp_path / "short.txt"
        doc.write_text("x = 1\n" * 20, encoding="utf-8")  # 120 tokens: no window reaches position 128
        out = tmp_path / "eval.json"
        assert cli_main(["eval", str(run_dir), "--data", str(doc), "--lengths", "256", "--buckets", "0,64,128",
                         "--json", str(out)]) == 0
        text = capsys.readouterr().out
        assert not re.search(r"\bnan\b", text)
        assert "positions [128, 256): no token" in text and "no window has 256 tokens" in text
        data = _strict_json(out)
        empty = data["losses"][0]["buckets"][-1]
        assert (empty["tokens"], empty["loss"], empty["perplexity"]) == (0, None, None)
        assert data["losses"][0]["tokens"] == 119 and data["losses"][0]["full_windows"] == 0

    def test_a_text_with_nothing_to_predict(self, run_dir, tmp_path, monkeypatch, capsys):
        _forbid_forwards(monkeypatch)
        doc = tmp_path / "one.txt"
        doc.write_text("x", encoding="utf-8")
        assert cli_main(["eval", str(run_dir), "--data", str(doc)]) == 2
        err = capsys.readouterr().err
        assert "nothing to predict" in err and "2 tokens" in err and "--data" in err

    def test_evaluate_windows_without_a_token_to_predict(self):
        model = CausalLM(ModelConfig.preset("tiny")).eval()
        with pytest.raises(ValueError, match="T ≥ 2"):
            evaluate_windows(model, torch.zeros(3, 1, dtype=torch.long))

