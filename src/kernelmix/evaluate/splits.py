"""The splits an evaluation reads: texts and corpora as tokenized splits, a split cut to a smaller
one that is the same for every context length, and the default part of it that ``kernelmix eval``
evaluates (:func:`scope_split`, :class:`EvalScope`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data import TokenizedSplit, load_corpus
from ..errors import KernelmixError
from .settings import DEFAULT_DOC_TOKENS, DEFAULT_MAX_DOCS


def split_from_texts(texts: Sequence[str], tokenizer, names: Sequence[str] | None = None,
                     name: str = "text") -> TokenizedSplit:
    """An in-memory split: each text one document, tokenized with ``tokenizer``.

    Args:
        texts: the documents' texts.
        tokenizer: anything with ``encode(text) -> list[int]``.
        names: the documents' names (None: ``doc0``, ``doc1``, ...).
        name: the split's name.

    Returns:
        The :class:`~kernelmix.data.TokenizedSplit`, its ``num_bytes`` 0 (unknown: no bits per byte)."""
    return TokenizedSplit.from_token_lists([tokenizer.encode(t) for t in texts], name=name, names=names)


def text_split(spec: str | Path, tokenizer) -> TokenizedSplit:
    """Every document of a corpus spec (a text file is one document; see
    :func:`kernelmix.data.load_corpus`), tokenized with ``tokenizer``.

    Args:
        spec: a corpus spec: a built-in corpus name, a file, a directory or a glob.
        tokenizer: anything with ``encode(text) -> list[int]``.

    Returns:
        The split, named ``str(spec)``, its ``num_bytes`` the UTF-8 size of the text (for bits per byte).
        A spec without any text is a ValueError."""
    docs = list(load_corpus(spec).documents())
    if not docs:
        raise ValueError(f"{str(spec)!r} holds no text to evaluate")
    split = split_from_texts([d.text for d in docs], tokenizer, [d.name for d in docs], name=str(spec))
    split.num_bytes = sum(len(d.text.encode("utf-8")) for d in docs)  # for bits per byte over the whole text
    return split


def cap_split(split: TokenizedSplit, *, doc_tokens: int | None = None, max_docs: int | None = None) -> TokenizedSplit:
    """The first ``doc_tokens`` tokens of each of the first ``max_docs`` documents with at least
    2 tokens: a smaller evaluation set that is the same for every context length ≤ doc_tokens.
    Its ``num_bytes`` (for bits per byte) is kept only when nothing was cut.

    Args:
        split: the split to cut.
        doc_tokens: tokens kept of each document, a positive int (None: whole documents).
        max_docs: documents kept, a positive int (None: every one with at least 2 tokens).

    Returns:
        The smaller split, with the same name and the kept documents' names."""
    for label, value in (("doc_tokens", doc_tokens), ("max_docs", max_docs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KernelmixError(f"{label} must be a positive int or None, got {value!r}")
    docs, names = [], []
    for i in range(len(split)):
        tokens = split.document(i)
        if len(tokens) < 2:
            continue
        docs.append(np.asarray(tokens[:doc_tokens] if doc_tokens else tokens, dtype=np.int64))
        names.append(split.doc_names[i] if i < len(split.doc_names) else f"doc{i}")
        if max_docs is not None and len(docs) >= max_docs:
            break
    capped = TokenizedSplit.from_token_lists(docs, name=split.name, names=names)
    capped.num_bytes = split.num_bytes if predicted_tokens(capped) == predicted_tokens(split) else 0
    return capped


def predicted_tokens(split: TokenizedSplit) -> int:
    """The tokens a loss evaluation of ``split`` predicts: every token but each document's first.

    Args:
        split: a tokenized split.

    Returns:
        The count: the sum of max(L - 1, 0) over the documents' lengths L."""
    return int(np.maximum(split.doc_lengths - 1, 0).sum())


@dataclass
class EvalScope:
    """Which part of a split an evaluation covers (:func:`scope_split`): ``documents`` of its
    ``split_documents``, at most ``doc_tokens`` tokens of each (None: whole documents), ``tokens``
    of its ``split_tokens`` tokens; ``whole``: every token the split has to predict."""

    split: str
    documents: int
    split_documents: int
    doc_tokens: int | None
    tokens: int
    split_tokens: int
    whole: bool

    def describe(self) -> str:
        """``val: first 8 of 39 documents, at most 4,096 tokens each (28,801 of 622,368 tokens); ...``"""
        if self.whole:
            documents = "its one document" if self.split_documents == 1 else f"all {self.split_documents} documents"
            return f"{self.split}: {documents}, {self.split_tokens:,} tokens"
        cap = f", at most {self.doc_tokens:,} tokens each" if self.doc_tokens else ""
        return (f"{self.split}: first {self.documents} of {self.split_documents} documents{cap} "
                f"({self.tokens:,} of {self.split_tokens:,} tokens); --max-docs all for the whole split")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scope_split(
    split: TokenizedSplit, seq_lens: Sequence[int], *, max_docs: int | str = DEFAULT_MAX_DOCS,
    doc_tokens: int | str | None = None,
) -> tuple[TokenizedSplit, EvalScope]:
    """The part of ``split`` to evaluate at the context lengths ``seq_lens``, and its
    :class:`EvalScope`: the first ``max_docs`` documents of ≥ 2 tokens ("all": every one) and the
    first ``doc_tokens`` tokens of each ("all": whole documents; None: whole documents when
    ``max_docs`` is "all", else :data:`DEFAULT_DOC_TOKENS` or the longest length if that is more,
    so the longest windows still fit). Refuses a scope with no token to predict.

    Args:
        split: the split to evaluate.
        seq_lens: the context lengths it will be evaluated at.
        max_docs: a positive int or ``"all"``.
        doc_tokens: a positive int, ``"all"`` or None (see above).

    Returns:
        ``(capped split, scope)``: the split :func:`cap_split` cut and the :class:`EvalScope` describing it."""
    for label, value in (("max_docs", max_docs), ("doc_tokens", doc_tokens)):
        if value != "all" and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                     or value < 1):
            raise KernelmixError(f"{label} must be a positive int or 'all', got {value!r}")
    if max_docs is None:
        raise KernelmixError("max_docs must be a positive int or 'all', got None")
    if doc_tokens is None:
        doc_tokens = "all" if max_docs == "all" else max([DEFAULT_DOC_TOKENS, *seq_lens])
    cap = None if doc_tokens == "all" else doc_tokens
    capped = cap_split(split, doc_tokens=cap, max_docs=None if max_docs == "all" else max_docs)
    tokens, total = predicted_tokens(capped), predicted_tokens(split)
    if tokens == 0:
        raise KernelmixError(
            f"split {split.name!r} has nothing to predict: none of its {len(split)} documents has 2 tokens or more "
            "(a document's first token is context only); evaluate other text with --data FILE"
        )
    longest = int(capped.doc_lengths.max())
    scope = EvalScope(split=split.name, documents=len(capped), split_documents=len(split),
                      doc_tokens=cap if cap is not None and cap <= longest else None,
                      tokens=capped.num_tokens, split_tokens=split.num_tokens, whole=tokens == total)
    return capped, scope
