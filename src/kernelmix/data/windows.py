"""Token windows of real text for pretrained (Hugging Face) tokenizers: finetuning, calibration
and diagnostics of converted models. (Our own models read tokenized corpora through
:mod:`.sampling`.)"""

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


def token_windows(tokenizer, texts: Sequence[str], seq_len: int, max_windows: int | None = None) -> Tensor:
    """``[N, seq_len]`` windows cut from the texts joined with BOS (when the tokenizer has one)
    before each document; the tail that does not fill a window is dropped."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids: list[int] = []
    limit = None if max_windows is None else seq_len * max_windows
    for text in texts:
        if bos is not None:
            ids.append(bos)
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if limit is not None and len(ids) >= limit:
            break
    count = len(ids) // seq_len if limit is None else min(len(ids) // seq_len, max_windows)
    if count == 0:
        raise ValueError(f"not enough text: {len(ids)} tokens, fewer than one window of {seq_len}; give more text or lower seq_len")
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


def bos_windows(tokenizer, texts: Sequence[str], seq_len: int, count: int) -> Tensor:
    """``[count, seq_len]`` windows of the texts joined without separators, each starting with BOS
    (when the tokenizer has one) followed by the next ``seq_len - 1`` tokens: what a pretrained
    model expects at position 0. Raises ValueError when the text is too short."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if len(ids) >= seq_len * count:
            break
    if len(ids) < seq_len * count:
        raise ValueError(f"not enough text: {len(ids)} tokens for {count} windows of {seq_len}; give more text or lower seq_len")
    bos = getattr(tokenizer, "bos_token_id", None)
    windows = torch.tensor(ids[: seq_len * count]).view(count, seq_len)
    if bos is not None:
        windows = torch.cat([torch.full((count, 1), bos), windows[:, :-1]], dim=1)
    return windows


def load_text_windows(tokenizer, text: str, seq_len: int, *, val_fraction: float, eval_seqs: int, seed: int = 0):
    """``(train_windows, val_windows)`` from a corpus name / directory / glob / file, split by document."""
    train_texts, val_texts = split_texts(load_corpus(text).documents(), val_fraction, seed)
    return token_windows(tokenizer, train_texts, seq_len), token_windows(tokenizer, val_texts, seq_len, max_windows=eval_seqs)


__all__ = ["bos_windows", "load_text_windows", "split_texts", "token_windows"]
