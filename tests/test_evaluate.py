"""kernelmix.evaluate: loss/perplexity against an independent computation from logits, position
buckets, zero-shot tasks (deterministic construction, the scorer on a model with known
log-likelihoods), lm-eval backend agreement, loading runs and the CLI's errors.

Tiny preset on the 7 KB fixture corpus (tests/fixtures/train_corpus, byte tokens)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernelmix.cli import main as cli_main
from kernelmix.data import ByteTokenizer, TokenizedSplit, eval_windows
from kernelmix.evaluate import (
    DEFAULT_DOC_TOKENS,
    DEFAULT_MAX_DOCS,
    auto_batch_size,
    build_cloze_task,
    build_continuation_task,
    build_tasks,
    cap_split,
    default_buckets,
    evaluate_loss,
    evaluate_windows,
    loglikelihoods,
    loss_batches,
    parse_buckets,
    predicted_tokens,
    scope_split,
    score_tasks,
    split_from_texts,
    write_lm_eval_tasks,
)
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.training import TrainConfig, load_run, train

from tests.utils import isolated_data_cache

CORPUS = str(Path(__file__).parent / "fixtures" / "train_corpus")
TOK = ByteTokenizer()


# token caches in a temporary directory per module (also used by subprocesses)
data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny run trained for a few steps on the fixture corpus (30% of documents held out)."""
    out = tmp_path_factory.mktemp("evalrun") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(TrainConfig(preset="tiny", corpus=CORPUS, seq_len=64, batch_size=4, steps=6, lr=3e-3, warmup_steps=1,
                          eval_every=0, eval_batches=1, val_fraction=0.3, out_dir=str(out), device="cpu"),
              progress=False)
    finally:
        torch.set_num_threads(threads)
    return out


def small_model(seed=0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig.preset("tiny", **overrides)).eval()


def test_loss_matches_an_independent_computation():
    """Per window: cross-entropy of the logits of a plain forward over the window's tokens;
    windows from eval_windows; the mean over every predicted token, in float64."""
    model = small_model().double()
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs. " * 4, "ab"]
    split = split_from_texts(texts, TOK)
    T = 32
    total, count = 0.0, 0
    bucket_sum, bucket_count = [0.0, 0.0], [0, 0]
    with torch.no_grad():
        for start, length in eval_windows(split, T):
            ids = torch.as_tensor(split.tokens[start : start + length], dtype=torch.long)[None]
            logits = model(ids, use_cache=False).logits[0]
            nll = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
            total += float(nll.sum())
            count += len(nll)
            for t, value in enumerate(nll.tolist(), start=1):  # the t-th token of the window sees t tokens
                b = 0 if t < 8 else 1
                bucket_sum[b] += value
                bucket_count[b] += 1
    (report,) = evaluate_loss(model, split, T, batch_size=3, buckets=[0, 8])
    assert count == split.num_tokens - len(split) == report.tokens
    assert report.loss == pytest.approx(total / count, rel=1e-9)
    assert report.perplexity == pytest.approx(math.exp(total / count), rel=1e-9)
    assert [(b.start, b.end) for b in report.buckets] == [(0, 8), (8, 32)]
    assert [b.tokens for b in report.buckets] == bucket_count
    for b, s, c in zip(report.buckets, bucket_sum, bucket_count):
        assert b.loss == pytest.approx(s / c, rel=1e-9)
    assert report.bits_per_byte is None  # an in-memory split has no byte count



def test_one_evaluator_behind_windows_and_process_shares():
    """evaluate_windows (any model taking input_ids) and evaluate_loss are sum_token_losses: the
    same loss and accuracy as a float64 computation from the logits; process shares (each process
    its batches, FSDP's equal forwards) add up to the single-process totals."""
    from kernelmix.data import Batch, eval_batches
    from kernelmix.evaluate import sum_token_losses

    model = small_model()
    windows = torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(windows, use_cache=False).logits[:, :-1].double()
    target = windows[:, 1:]
    expected = F.cross_entropy(logits.reshape(-1, 256), target.reshape(-1), reduction="sum").item() / target.numel()
    result = evaluate_windows(model, windows, batch_size=2)
    assert result["tokens"] == 5 * 11 and result["loss"] == pytest.approx(expected, rel=1e-6)
    assert result["accuracy"] == (logits.argmax(-1) == target).double().mean().item()
    whole = sum_token_losses(model, [Batch(x, x) for x in windows.split(2)])
    assert (whole.mean, whole.windows) == (result["loss"], 5)

    split = split_from_texts(["the quick brown fox jumps over the lazy dog " * 3, "pack my box with jugs. " * 4], TOK)
    batches = list(eval_batches(split, 16, 2))[:7]
    assert len(batches) % 2 == 1  # an odd count: the second process has one batch fewer
    single = sum_token_losses(model, batches)
    single_all = sum_token_losses(model, eval_batches(split, 16, 2))  # the training loop's validation batches
    forwards = []
    handle = model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        for same in (False, True):
            forwards.clear()
            shares = [sum_token_losses(model, batches, rank=r, world_size=2, same_forwards=same) for r in (0, 1)]
            assert sum(s.tokens for s in shares) == single.tokens
            assert sum(s.loss for s in shares) == pytest.approx(single.loss, rel=1e-12)
            assert len(forwards) == len(batches) + same  # with same_forwards the last batch runs twice, counted once
    finally:
        handle.remove()
    (report,) = evaluate_loss(model, split, 16, batch_size=2, max_batches=7)
    cut = sum_token_losses(model, loss_batches(split, 16, 2)[:7])  # evaluate_loss's own batches, cut the same way
    assert (report.loss, report.tokens) == (cut.mean, cut.tokens)
    (whole_split,) = evaluate_loss(model, split, 16, batch_size=2)
    assert whole_split.tokens == single_all.tokens and whole_split.loss == pytest.approx(single_all.mean, rel=1e-6)

def test_every_length_predicts_the_same_tokens_and_refuses_beyond_max_seq_len():
    model = small_model()
    split = split_from_texts(["x = 1\n" * 60, "def f(a):\n    return a\n" * 10], TOK)
    reports = evaluate_loss(model, split, [16, 64, 256], train_seq_len=64)
    assert len({r.tokens for r in reports}) == 1
    assert [r.beyond_training_length for r in reports] == [False, False, True]
    assert [(b.start, b.end) for b in reports[2].buckets] == [(0, 64), (64, 256)]
    assert sum(b.tokens for b in reports[2].buckets) == reports[2].tokens
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 256"):
        evaluate_loss(model, split, 512)


@pytest.mark.parametrize("mixer", ["softmax", "cubit", "performer"])
def test_batched_windows_equal_one_window_at_a_time(mixer):
    """7 full windows and 3 short ones (different lengths): batches of 3 leave a last full-width
    batch of one and pad the short ones together; the sums equal one window per forward (fp32)."""
    model = small_model(mixer=mixer)
    texts = ["abcdefghijklmnopqrstuvwxyz" * 3 + "ab", "the quick brown fox jumps over", "0123456789" * 2]
    split = split_from_texts(texts, TOK)
    T = 16
    windows = list(eval_windows(split, T))
    assert (sum(length == T for _, length in windows), len(windows)) == (7, 10)
    batched = loss_batches(split, T, 3)
    assert [tuple(b.input_ids.shape) for b in batched] == [(3, 16), (3, 16), (1, 16), (3, 15)]
    (one,) = evaluate_loss(model, split, T, batch_size=1, buckets=[0, 4])
    (three,) = evaluate_loss(model, split, T, batch_size=3, buckets=[0, 4])
    (auto,) = evaluate_loss(model, split, T, buckets=[0, 4])
    for report in (three, auto):
        assert (report.tokens, report.windows, report.full_windows) == (one.tokens, 10, 7)
        assert report.loss == pytest.approx(one.loss, rel=1e-5)
        for a, b in zip(report.buckets, one.buckets):
            assert (a.tokens, a.loss) == (b.tokens, pytest.approx(b.loss, rel=1e-5))
    stacked = torch.randint(0, 256, (7, 12), generator=torch.Generator().manual_seed(2))
    single, grouped = evaluate_windows(model, stacked, batch_size=1), evaluate_windows(model, stacked, batch_size=3)
    assert grouped["tokens"] == single["tokens"] and grouped["loss"] == pytest.approx(single["loss"], rel=1e-5)


def test_loss_batches_cover_every_window_once():
    split = split_from_texts(["x" * 50, "y" * 17, "z", "w" * 2, "v" * 31], TOK)
    T = 8
    rows = []
    for batch in loss_batches(split, T, 4):
        width = batch.input_ids.shape[1]
        mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
        assert width == T or batch.attention_mask is not None or len({int(m.sum()) for m in mask}) == 1
        for ids, labels, m in zip(batch.input_ids, batch.labels, mask):
            length = int(m.sum())
            assert m[:length].all() and not m[length:].any()  # right padding only
            assert labels[0] == -100 and (labels[length:] == -100).all() and (labels[1:length] == ids[1:length]).all()
            rows.append(ids[:length].tolist())
    expected = [split.tokens[start : start + length].tolist() for start, length in eval_windows(split, T)]
    assert sorted(rows) == sorted(expected)
    assert sum(len(r) - 1 for r in rows) == predicted_tokens(split) == 49 + 16 + 0 + 1 + 30


def test_auto_batch_size_bounds_windows_and_logits():
    assert auto_batch_size(256, 256) == 16
    assert auto_batch_size(2048, 256) == 8  # 16k tokens a forward
    assert auto_batch_size(512, 262144) == 1  # a 262k vocabulary: 512 MiB of logits for one window
    assert auto_batch_size(256, 50257) == 10
    assert auto_batch_size(64, None) == 1


def test_scope_split_defaults_and_all():
    docs = [[1] * 5000, [2], [3] * 100] + [[4 + i] * 3000 for i in range(9)]
    split = TokenizedSplit.from_token_lists(docs, name="val")
    split.num_bytes = 123
    capped, scope = scope_split(split, [256])
    assert (scope.documents, scope.split_documents, scope.doc_tokens) == (DEFAULT_MAX_DOCS, 12, DEFAULT_DOC_TOKENS)
    assert capped.doc_lengths.tolist() == [4096, 100] + [3000] * 6  # the 1-token document has nothing to predict
    assert scope.tokens == 4096 + 100 + 6 * 3000 and not scope.whole and capped.num_bytes == 0
    assert scope.describe() == (f"val: first 8 of 12 documents, at most 4,096 tokens each ({scope.tokens:,} of "
                                f"{split.num_tokens:,} tokens); --max-docs all for the whole split")
    capped, scope = scope_split(split, [256], max_docs=2, doc_tokens=None)
    assert capped.doc_lengths.tolist() == [4096, 100]
    capped, scope = scope_split(split, [8192], max_docs=1)  # the default cap grows to the longest length
    assert capped.doc_lengths.tolist() == [5000] and scope.doc_tokens is None
    capped, scope = scope_split(split, [256], max_docs="all")
    assert (scope.whole and capped.num_bytes == 123
            and scope.describe() == f"val: all 12 documents, {split.num_tokens:,} tokens")
    capped, scope = scope_split(split, [256], max_docs="all", doc_tokens=10)
    assert not scope.whole and capped.doc_lengths.max() == 10
    with pytest.raises(ValueError, match="max_docs must be a positive int or 'all'"):
        scope_split(split, [256], max_docs=0)
    with pytest.raises(ValueError, match="nothing to predict"):
        scope_split(TokenizedSplit.from_token_lists([[1], [2]]), [256])


def test_option_text_errors_name_the_option(trained_run, capsys):
    """`--lengths abc` and `--tasks foo` are refused by the parser, naming the option and the form."""
    for args, words in ((["--lengths", "abc"], ["--lengths", "comma-separated integers"]),
                        (["--tasks", "foo"], ["--tasks", "unknown task", "choose from"]),
                        (["--max-docs", "some"], ["--max-docs", "all", "positive integer"])):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["eval", str(trained_run), *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert all(word in err for word in words), err

def test_buckets():
    assert default_buckets(1024) == [(0, 64), (64, 256), (256, 1024)]
    assert default_buckets(2048) == [(0, 64), (64, 256), (256, 1024), (1024, 2048)]
    assert default_buckets(128) == [(0, 64), (64, 128)]
    assert default_buckets(32) == [(0, 32)]
    assert parse_buckets("0,100,1000", 256) == [(0, 100), (100, 256)]
    with pytest.raises(ValueError, match="start at 0"):
        parse_buckets([5, 10], 64)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_buckets("0,a", 64)


def test_cap_split_keeps_a_prefix_of_each_document():
    split = TokenizedSplit.from_token_lists([[1, 2, 3, 4, 5], [6], [7, 8, 9]])
    capped = cap_split(split, doc_tokens=2, max_docs=2)
    assert capped.tokens.tolist() == [1, 2, 7, 8]  # the 1-token document has nothing to predict
    assert len(capped) == 2


class KnownModel(torch.nn.Module):
    """A stand-in with known log-likelihoods: after any token it predicts ``favourite`` with
    probability ~1 (logit 20, all others 0)."""

    def __init__(self, favourite: int) -> None:
        super().__init__()
        self.config = ModelConfig.preset("tiny")
        self.favourite = favourite
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, use_cache=False, **_):
        logits = torch.zeros(*input_ids.shape, 256)
        logits[..., self.favourite] = 20.0
        return type("Out", (), {"logits": logits})()


def test_loglikelihoods_and_the_scorer_on_known_models():
    model = KnownModel(ord("z"))
    (zz, greedy), (ab, not_greedy) = loglikelihoods(model, TOK, [("context", "zz"), ("context", "ab")])
    p = torch.log_softmax(torch.tensor([20.0] + [0.0] * 255), 0)
    assert zz == pytest.approx(2 * float(p[0]), abs=1e-5) and greedy
    assert ab == pytest.approx(2 * float(p[1]), abs=1e-4) and not not_greedy
    items = {"continuation": [{"context": "abc", "choices": ["xy", "zz", "qq"], "label": 1},
                              {"context": "abc", "choices": ["zzz", "aaa"], "label": 0}],
             "cloze": [{"context": "abc", "target": "zzz"}, {"context": "abc", "target": "zaz"}]}
    scores = score_tasks(model, TOK, items)
    assert scores["continuation"]["acc"] == 1.0
    assert scores["cloze"]["acc"] == 0.5
    with pytest.raises(ValueError, match="empty context"):
        loglikelihoods(model, TOK, [("", "x")])


def test_tasks_build_deterministically(trained_run):
    run = load_run(trained_run)
    split = run.split("val")
    a = build_tasks(split, run.tokenizer, items=6, context_tokens=48, span_tokens=12, seed=3)
    b = build_tasks(split, run.tokenizer, items=6, context_tokens=48, span_tokens=12, seed=3)
    c = build_tasks(split, run.tokenizer, items=6, context_tokens=48, span_tokens=12, seed=4)
    assert a == b and a != c
    for item in a["continuation"]:
        assert len(item["choices"]) == 4 and 0 <= item["label"] < 4
        assert len(TOK.encode(item["context"])) == 48
        assert all(len(TOK.encode(choice)) == 12 for choice in item["choices"])
        # the true continuation follows the context in its document
        doc = split.doc_names.index(item["doc"])
        text = TOK.decode(split.document(doc).tolist())
        assert item["context"] + item["choices"][item["label"]] in text
    for item in a["cloze"]:
        assert item["target"].isidentifier() and len(item["target"]) >= 3
        doc = split.doc_names.index(item["doc"])
        assert item["context"] + item["target"] in TOK.decode(split.document(doc).tolist())
    with pytest.raises(ValueError, match="unknown task"):
        build_tasks(split, run.tokenizer, tasks=["hellaswag"])


def test_a_model_overfit_to_one_document_picks_the_true_continuation():
    """Train a tiny model to memorise one document; continuation items from it (distractors from
    other documents) must then be answered right, and its cloze words predicted greedily."""
    torch.manual_seed(0)
    text = "def add(left, right):\n    total = left + right\n    return total\n"
    others = ["The rivers run to the sea, and the sea is never full of them. " * 3,
              "Lighthouses stand on rocks and turn their lamps all night long. " * 3]
    model = CausalLM(ModelConfig.preset("tiny", hidden_size=64, num_layers=2))
    ids = torch.tensor([TOK.encode(text)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(200):
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.1
    model.eval()
    split = split_from_texts([text] + others, TOK)
    items = build_continuation_task(split, TOK, items=8, context_tokens=24, span_tokens=12, seed=0)
    items = [i for i in items if i["doc"] == "doc0"]
    assert items
    assert score_tasks(model, TOK, {"continuation": items})["continuation"]["acc"] == 1.0
    cloze = [i for i in build_cloze_task(split, TOK, items=2, context_tokens=64, seed=0, min_context_chars=20)
             if i["doc"] == "doc0"]
    assert cloze and score_tasks(model, TOK, {"cloze": cloze})["cloze"]["acc"] == 1.0


def test_lm_eval_backend_agrees_with_ours(tmp_path):
    pytest.importorskip("lm_eval")
    model = small_model()
    split = split_from_texts(["alpha beta gamma delta\n    return value\n" * 8, "one two three four five six\n" * 8,
                              "import os\nprint(os.getcwd())\n" * 8], TOK)
    tasks = build_tasks(split, TOK, items=4, context_tokens=32, span_tokens=8, seed=1)
    paths = write_lm_eval_tasks(tasks, tmp_path / "tasks")
    assert "dataset_path: json" in paths["continuation"].read_text()
    ours = score_tasks(model, TOK, tasks)
    theirs = score_tasks(model, TOK, tasks, backend="lm-eval", task_dir=tmp_path / "tasks")
    assert theirs["continuation"]["acc"] == ours["continuation"]["acc"]
    assert theirs["continuation"]["acc_norm"] == ours["continuation"]["acc_norm"]
    assert theirs["cloze"]["acc"] == ours["cloze"]["acc"]
    assert theirs["cloze"]["perplexity"] == pytest.approx(ours["cloze"]["perplexity"], rel=1e-4)


def test_load_run_and_cli(trained_run, tmp_path, capsys):
    run = load_run(trained_run)
    assert run.step == 6 and run.train_seq_len == 64 and not run.model.training
    (report,) = evaluate_loss(run.model, run.split("val"), 64)
    assert report.bits_per_byte is not None  # the whole split: its bytes are known
    out = tmp_path / "eval.json"
    code = cli_main(["eval", str(trained_run), "--lengths", "32,128", "--tasks", "continuation", "--items", "3",
                     "--context-tokens", "32", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["seq_len"] for r in data["losses"]] == [32, 128]
    assert data["losses"][1]["beyond_training_length"] is True
    assert data["tasks"]["continuation"]["items"] == 3
    assert "(beyond the training length)" in capsys.readouterr().out


def test_bad_input_gives_clear_errors(trained_run, tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert cli_main(["eval", str(empty)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert cli_main(["eval", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["eval", str(trained_run), "--lengths", "512"]) == 2
    assert "max_seq_len 256" in capsys.readouterr().err
    assert cli_main(["eval", str(trained_run), "--data", "no/such/file.txt"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_ngram_losses_match_a_counting_reference():
    import math
    from collections import Counter

    from kernelmix.evaluate import ngram_losses

    import numpy as np

    rng = np.random.default_rng(0)
    train_docs = [list(rng.integers(0, 7, n)) for n in (5, 1, 12, 9)]
    val_docs = [list(rng.integers(0, 7, n)) for n in (4, 6, 1)] + [[8, 8]]  # a pair never seen in training
    vocab = 9
    got = ngram_losses(TokenizedSplit.from_token_lists(train_docs),
                       TokenizedSplit.from_token_lists(val_docs, name="val"), vocab)
    unigram = Counter(t for d in train_docs for t in d)
    total = sum(unigram.values())
    pairs = Counter((a, b) for d in train_docs for a, b in zip(d, d[1:]))  # inside documents only
    before = Counter(a for d in train_docs for a in d[:-1])
    uni = [-math.log((unigram[b] + 1) / (total + vocab)) for d in val_docs for b in d[1:]]
    bi = [-math.log((pairs[(a, b)] + 1) / (before[a] + vocab)) for d in val_docs for a, b in zip(d, d[1:])]
    assert got["tokens"] == len(uni) == 9
    assert got["unigram"] == pytest.approx(sum(uni) / len(uni), rel=1e-12)
    assert got["bigram"] == pytest.approx(sum(bi) / len(bi), rel=1e-12)
    with pytest.raises(ValueError, match="vocab_size is 5; pass the tokenizer's vocabulary size"):
        ngram_losses(TokenizedSplit.from_token_lists(train_docs), TokenizedSplit.from_token_lists(val_docs), 5)


def test_write_lm_eval_tasks_refuses_an_unknown_task_before_writing_anything(tmp_path):
    items = [{"context": "a", "target": "b"}]
    with pytest.raises(ValueError, match="unknown task 'clozee'"):
        write_lm_eval_tasks({"cloze": items, "clozee": items}, tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists() or not any((tmp_path / "tasks").iterdir())
