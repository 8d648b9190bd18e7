"""Token windows of real text for pretrained (Hugging Face) tokenizers: finetuning, calibration
and diagnostics of converted models, all through :func:`text_windows` (one rule: every window
starts with BOS, documents are separated by BOS). Our own models read tokenized corpora, which
have no BOS, through :mod:`.sampling`."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .corpus import load_corpus, split_documents



def split_texts(documents, val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Train / validation texts from :class:`kernelmix.data.Document` s, split by document."""
    documents = list(documents)
    if len(documents) < 2:
        raise ValueError(f"finetuning needs at least 2 documents (one for validation), got {len(documents)}; "
                         "give a directory or corpus with more documents")
    train, val = split_documents([d.name for d in documents], val_fraction, seed)
    return [documents[i].text for i in train], [documents[i].text for i in val]


# Names the rule below; results computed on windows (cached diagnostics, finetuning runs) record it,
# so a change of rule is never mistaken for the same data.
WINDOW_RULE = "bos-first/1"


def text_windows(
    tokenizer, texts: Sequence[str], seq_len: int, max_windows: int | None = None, *, min_windows: int = 1,
) -> Tensor:
    """``[N, seq_len]`` token windows of ``texts`` for a pretrained model: the one windowing rule
    of finetuning, calibration and diagnostics.

    The rule: the documents are joined into one stream with BOS between them, the stream is cut
    into consecutive pieces of ``seq_len - 1`` tokens, and each window is BOS followed by one
    piece. So every window starts with BOS — what a pretrained model saw at position 0 in
    training — and a document boundary inside a window is marked by BOS, as in a model's packed
    pretraining data (a piece that starts just after a document leaves two BOS in a row). With a
    tokenizer that has no BOS the documents are joined without separators and windows of
    ``seq_len`` tokens are cut from the stream.

    ``max_windows``: at most that many (the first ones; the text after them is not tokenized);
    the tail that does not fill a window is dropped. Raises ValueError ("not enough text") when
    fewer than ``min_windows`` windows fit. (Our own tokenized corpora, which have no BOS, are
    windowed by :mod:`kernelmix.data.sampling`.)"""
    bos = getattr(tokenizer, "bos_token_id", None)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int ≥ 2, got {seq_len!r}")
    piece = seq_len if bos is None else seq_len - 1
    limit = None if max_windows is None else piece * max_windows
    ids: list[int] = []
    for text in texts:
        if ids and bos is not None:
            ids.append(bos)
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if limit is not None and len(ids) >= limit:
            break
    count = len(ids) // piece if max_windows is None else min(len(ids) // piece, max_windows)
    if count < max(min_windows, 1):
        raise ValueError(
            f"not enough text: {len(ids)} tokens make {count} window(s) of {seq_len}, {max(min_windows, 1)} needed; "
            "give more text or lower seq_len"
        )
    windows = torch.tensor(ids[: count * piece], dtype=torch.long).view(count, piece)
    if bos is not None:
        windows = torch.cat([torch.full((count, 1), bos, dtype=torch.long), windows], dim=1)
    return windows


def load_text_windows(tokenizer, text: str, seq_len: int, *, val_fraction: float, eval_seqs: int, seed: int = 0):
    """``(train_windows, val_windows)`` from a corpus name / directory / glob / file, split by document."""
    train_texts, val_texts = split_texts(load_corpus(text).documents(), val_fraction, seed)
    return text_windows(tokenizer, train_texts, seq_len), text_windows(tokenizer, val_texts, seq_len, eval_seqs)


__all__ = ["WINDOW_RULE", "load_text_windows", "split_texts", "text_windows"]
