"""Tokenized corpora, cached on disk as memory-mapped token arrays.

:func:`prepare_dataset` reads a corpus, splits it by document (:func:`~kernelmix.data.split_documents`),
builds or loads the tokenizer (a ``bpe:N`` tokenizer is trained on the training split only),
tokenizes both splits and writes them to a cache directory::

    <cache>/<source>-<tokenizer>-<key>/
        meta.json                what was tokenized how: corpus, tokenizer, split, counts, doc names
        tokenizer.json           the tokenizer (Hugging Face format)
        train.tokens, val.tokens all token ids of a split, documents back to back (uint16 / uint32)
        train.offsets.npy, ...   int64 [docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]

The key hashes the corpus fingerprint (file names, sizes, modification times), the tokenizer
(its fingerprint, or the ``bpe:N`` spec for one trained here) and the split settings, so the next
call with the same inputs opens the arrays with ``numpy.memmap`` instead of tokenizing again, and
any change to a file or setting gives a new directory. A directory is written under a temporary
name and renamed into place, so a crash or a concurrent run never leaves a half-written cache
(two ranks racing both tokenize; the second rename loses and its copy is dropped).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..output import progress_bar
from .corpus import Corpus, Document, load_corpus, split_documents
from .tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer, load_tokenizer, parse_tokenizer_spec,
                        train_bpe)

FORMAT_VERSION = 1
SPLITS = ("train", "val")
_PROGRESS_MIN_BYTES = 1 << 20  # below this a progress bar is just flicker


def default_cache_dir() -> Path:
    """``$KERNELMIX_CACHE/data`` if that variable is set, else ``$XDG_CACHE_HOME/kernelmix/data``
    (``~/.cache/kernelmix/data``)."""
    root = os.environ.get("KERNELMIX_CACHE")
    if root:
        return Path(root).expanduser() / "data"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kernelmix" / "data"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class TokenizedSplit:
    """The documents of one split as one token array plus document offsets.

    ``tokens`` is 1-D (a read-only memmap when loaded from the cache); document ``i`` is
    ``tokens[offsets[i]:offsets[i + 1]]`` and is named ``doc_names[i]``; ``num_bytes`` is the
    UTF-8 size of the split's text (for bits per byte)."""

    name: str
    tokens: np.ndarray
    offsets: np.ndarray
    doc_names: list[str] = field(default_factory=list)
    num_bytes: int = 0
    fingerprint: str = ""  # identifies the data (cache key + split), recorded in sampler state

    @classmethod
    def from_token_lists(cls, documents: Sequence[Sequence[int]], name: str = "train",
                         names: Sequence[str] | None = None):
        """An in-memory split from lists of token ids (tests, small experiments)."""
        lengths = [len(doc) for doc in documents]
        offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for doc in documents for t in doc), dtype=np.int64, count=int(offsets[-1]))
        names = list(names) if names is not None else [f"doc{i}" for i in range(len(documents))]
        digest = hashlib.sha256(tokens.tobytes() + offsets.tobytes()).hexdigest()[:16]
        return cls(name, tokens, offsets, names, num_bytes=0, fingerprint=f"memory-{digest}")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """The token ids of document ``index``."""
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def __repr__(self) -> str:
        return f"TokenizedSplit({self.name!r}, documents={len(self)}, tokens={self.num_tokens})"


@dataclass
class TokenizedDataset:
    """A tokenized corpus: the two splits, the tokenizer, where it is cached and how it was made.
    ``reused`` is True when it was opened from the cache rather than tokenized now."""

    path: Path
    train: TokenizedSplit
    val: TokenizedSplit
    tokenizer: Tokenizer
    meta: dict
    reused: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str) -> TokenizedSplit:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r} (choose from: {', '.join(SPLITS)})")
        return getattr(self, name)

    def summary(self) -> str:
        """One line per split: documents, tokens, bytes."""
        lines = [f"{self.meta['corpus']['source']} with tokenizer {self.meta['tokenizer']['spec']} "
                 f"(vocab {self.vocab_size}) at {self.path}"]
        for split in (self.train, self.val):
            lines.append(f"  {split.name}: {len(split)} documents, {split.num_tokens:,} tokens, "
                         f"{split.num_bytes:,} bytes")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Building and opening


def prepare_dataset(
    corpus: "str | Path | Corpus" = "pystdlib",
    tokenizer: "str | Path | Tokenizer" = "byte",
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    text_field: str | None = None,
    extensions: Sequence[str] | None = None,
    limit: int | None = None,
    progress: bool | None = None,
    rebuild: bool = False,
) -> TokenizedDataset:
    """Tokenize ``corpus`` (see :func:`~kernelmix.data.load_corpus`) with ``tokenizer`` ("byte",
    "bpe:N", a path or a tokenizer object), split by document, or open the cached result of an
    identical earlier call.

    ``val_fraction``/``seed`` set the split; ``cache_dir`` defaults to :func:`default_cache_dir`;
    ``progress``: show a progress bar while tokenizing (default: only on a terminal and for corpora
    over 1 MB); ``rebuild``: tokenize again even if cached."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    split_documents([], val_fraction)  # validates val_fraction before any work
    source = load_corpus(corpus, text_field=text_field, extensions=extensions, limit=limit)
    tokenizer_key, ready_tokenizer, bpe_vocab = _tokenizer_key(tokenizer)
    key_parts = {
        "format": FORMAT_VERSION,
        "corpus": source.fingerprint,
        "tokenizer": tokenizer_key,
        "val_fraction": float(val_fraction),
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{_slug(source.source)}-{_slug(tokenizer_key)}-{key}"

    if target.exists() and not rebuild:
        try:
            return open_dataset(target, reused=True)
        except ValueError:
            shutil.rmtree(target, ignore_errors=True)  # incomplete or corrupt: build it again
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        _build(source, work, ready_tokenizer, bpe_vocab, tokenizer_key, key, val_fraction, seed, progress)
        if rebuild and target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(work, target)
        except OSError:
            if not target.exists():
                raise
            # another process finished the same cache first: use theirs
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return open_dataset(target, reused=False)


def open_dataset(path: str | Path, *, reused: bool = True) -> TokenizedDataset:
    """Open a cache directory written by :func:`prepare_dataset` (memory-mapped, read-only)."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} is not a tokenized dataset (no readable meta.json): {error}") from error
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r} has dataset format {meta.get('format')!r}, "
                         f"expected {FORMAT_VERSION}; prepare it again")
    try:
        tokenizer = load_tokenizer(path)
        dtype = np.dtype(meta["dtype"])
        splits = {}
        for name in SPLITS:
            splits[name] = _open_split(path, name, meta, dtype)
    except (KeyError, OSError, TypeError) as error:
        raise ValueError(f"{str(path)!r} is an incomplete tokenized dataset "
                         f"({type(error).__name__}: {error}); prepare it again") from error
    return TokenizedDataset(path, splits["train"], splits["val"], tokenizer, meta, reused=reused)


def _open_split(path: Path, name: str, meta: dict, dtype: np.dtype) -> TokenizedSplit:
    info = meta["splits"][name]
    offsets = np.load(path / f"{name}.offsets.npy")
    token_file = path / f"{name}.tokens"
    expected = info["num_tokens"] * dtype.itemsize
    if (len(offsets) != info["num_documents"] + 1 or int(offsets[-1]) != info["num_tokens"]
            or token_file.stat().st_size != expected):
        raise ValueError(f"{str(path)!r}: {name} split does not match meta.json (truncated?); prepare it again")
    if info["num_tokens"]:
        tokens = np.memmap(token_file, dtype=dtype, mode="r", shape=(info["num_tokens"],))
    else:
        tokens = np.zeros(0, dtype=dtype)  # numpy cannot map an empty file
    return TokenizedSplit(name, tokens, offsets, info["doc_names"], info["num_bytes"],
                          fingerprint=f"{meta['key']}:{name}")


def _tokenizer_key(spec) -> tuple[str, Tokenizer | None, int | None]:
    """The tokenizer's part of the cache key, the tokenizer if it needs no training, and the BPE
    vocab size if it does."""
    if isinstance(spec, Tokenizer):
        return spec.fingerprint, spec, None
    kind, value = parse_tokenizer_spec(spec)
    if kind == "bpe":
        return f"bpe:{value}", None, value
    tokenizer = get_tokenizer(spec)
    return tokenizer.fingerprint, tokenizer, None


def _slug(text: str) -> str:
    name = Path(text.rstrip("/\\")).name or text
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")[:40] or "corpus"


def _build(source: Corpus, work: Path, tokenizer, bpe_vocab, tokenizer_key, key, val_fraction, seed, progress) -> None:
    started = time.perf_counter()
    documents = list(source.documents())
    if not documents:
        raise ValueError(
            f"corpus {source.source!r} has no documents with text ({len(source.files)} file(s), all empty); "
            "point it at files that contain text"
        )
    train_idx, val_idx = split_documents([d.name for d in documents], val_fraction, seed)
    split_docs = {"train": [documents[i] for i in train_idx], "val": [documents[i] for i in val_idx]}
    if tokenizer is None:  # bpe:N — learn it from the training split only
        if not split_docs["train"]:
            raise ValueError("cannot train a BPE tokenizer: the training split is empty; lower val_fraction")
        tokenizer = train_bpe((d.text for d in split_docs["train"]), bpe_vocab, show_progress=bool(progress))
    tokenizer.save(work)
    dtype = token_dtype(tokenizer.vocab_size)
    doc_bytes = {name: [len(d.text.encode("utf-8")) for d in docs] for name, docs in split_docs.items()}
    total_bytes = {name: sum(sizes) for name, sizes in doc_bytes.items()}
    meta_splits = {}
    with _progress_bar(progress, sum(total_bytes.values())) as advance:
        for name, docs in split_docs.items():
            offsets = _write_tokens(docs, doc_bytes[name], tokenizer, dtype, work / f"{name}.tokens", advance)
            np.save(work / f"{name}.offsets.npy", offsets)
            meta_splits[name] = {
                "num_documents": len(docs),
                "num_tokens": int(offsets[-1]),
                "num_bytes": total_bytes[name],
                "doc_names": [d.name for d in docs],
            }
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "corpus": {"source": source.source, "fingerprint": source.fingerprint, "version": source.version,
                   "files": len(source.files), "limit": source.limit},
        "tokenizer": {"spec": getattr(tokenizer, "spec", tokenizer_key), "key": tokenizer_key,
                      "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size},
        "split": {"val_fraction": float(val_fraction), "seed": seed, "by": "blake2b(seed, document name)"},
        "dtype": dtype.name,
        "splits": meta_splits,
        "tokenize_seconds": round(time.perf_counter() - started, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))


def _write_tokens(docs: list[Document], doc_bytes: list[int], tokenizer, dtype, path: Path, advance) -> np.ndarray:
    """Tokenize ``docs`` into ``path`` (streamed, one document after another); the offsets."""
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    batch = 64  # documents per call to a batched (parallel) encoder
    with open(path, "wb") as out:
        for first in range(0, len(docs), batch):
            chunk = docs[first : first + batch]
            if isinstance(tokenizer, ByteTokenizer):
                arrays = [tokenizer.encode_array(d.text) for d in chunk]
            elif isinstance(tokenizer, HFTokenizer):
                arrays = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch([d.text for d in chunk])]
            else:
                arrays = [np.asarray(tokenizer.encode(d.text), dtype=np.int64) for d in chunk]
            for i, (doc, ids) in enumerate(zip(chunk, arrays)):
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
                    raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size}) for {doc.name!r}")
                ids.astype(dtype, copy=False).tofile(out)
                offsets[first + i + 1] = offsets[first + i] + len(ids)
                advance(doc_bytes[first + i])
    return offsets


class _progress_bar:
    """A progress bar over bytes, shown when asked or when on a terminal for large corpora;
    used as ``with _progress_bar(show, total) as advance: advance(n)``."""

    def __init__(self, show: bool | None, total: int) -> None:
        if show is None:
            show = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
        self.bar = progress_bar(show, "tokenizing", total, unit="bytes")

    def __enter__(self):
        return self.bar.advance

    def __exit__(self, *exc) -> None:
        self.bar.close()


__all__ = [
    "FORMAT_VERSION",
    "TokenizedDataset",
    "TokenizedSplit",
    "default_cache_dir",
    "open_dataset",
    "prepare_dataset",
    "token_dtype",
]
