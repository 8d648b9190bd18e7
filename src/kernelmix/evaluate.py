"""Evaluation of a trained model: ``kernelmix eval``.

    from kernelmix.evaluate import evaluate_loss, build_tasks, score_tasks
    from kernelmix.training import load_run

    run = load_run("runs/train")                        # a run directory or one checkpoint directory
    split = run.split("val")                            # the run's validation split (or split_from_texts / text_split)
    split, scope = scope_split(split, [128, 256, 512])  # kernelmix eval's default part of it (max_docs="all": all)
    reports = evaluate_loss(run.model, split, [128, 256, 512], progress=lambda T, tokens: ...)
    reports[0].loss, reports[0].perplexity, reports[0].buckets   # loss by position within the window
    tasks = build_tasks(split, run.tokenizer, items=100, seed=0)  # zero-shot tasks from held-out documents
    scores = score_tasks(run.model, run.tokenizer, tasks)          # or backend="lm-eval"

**Loss at several context lengths.** For each context length T the split is cut into windows of
T tokens inside each document (:func:`kernelmix.data.eval_windows`: windows overlap by one token,
so every token but a document's first is predicted exactly once, with at most T - 1 tokens of
context). The set of predicted tokens is therefore the same for every T, and the losses at
different T are directly comparable: a model that uses long context has a lower loss at larger T.
T may exceed the length the model was trained at (reported as ``beyond_training_length``) but not
its ``max_seq_len``: positions beyond it are refused by the model, never extrapolated.

**Loss by position.** The token at index t of a window is predicted from the t tokens before it;
``buckets`` (default [0, 64), [64, 256), [256, 1024), ... up to T) group the predicted tokens by t,
so a model that ignores distant context shows the same loss in every bucket and one that uses it
a falling loss. Bucket losses at a given T are means over different tokens (early vs late in a
window), so compare them across models, not across buckets of one model in isolation.

**One loss evaluator.** :func:`sum_token_losses` sums the next-token loss (float64), the correct
top-1 predictions and the tokens of any batches, by position bucket, over processes when asked;
:func:`evaluate_loss`, :func:`evaluate_windows` (any model that takes ``input_ids``, Hugging Face
ones included, on ``[N, T]`` windows) and the training loop's validation loss are thin wrappers.
:func:`evaluate_loss` runs several windows per forward (:func:`loss_batches`: full windows
without padding or mask, the short last windows of documents padded only to their batch's
longest; :func:`auto_batch_size` bounds a forward's windows and logits), which gives the sums of
one window at a time up to float32 rounding.

**Scope.** A whole split can take minutes; :func:`scope_split` cuts the part ``kernelmix eval``
evaluates by default (the first :data:`DEFAULT_MAX_DOCS` documents, :data:`DEFAULT_DOC_TOKENS`
tokens of each) and describes it (:class:`EvalScope`), so the output says what was evaluated.

**Zero-shot tasks** are built from the held-out documents of a split, deterministically from a
seed (:func:`build_tasks`):

* ``continuation`` (multiple choice): a context of ``context_tokens`` tokens from a document, and
  ``num_choices`` spans of ``span_tokens`` tokens: the true continuation and spans from other
  documents. Accuracy: the choice with the highest log-likelihood is the true one (chance
  1/num_choices); ``acc_norm`` divides by the choice's length in characters.
* ``cloze`` (last word): a context ending just before the last word of a line (an identifier in
  code, a word in prose) and that word as target. Accuracy: the target is the model's greedy
  continuation, token by token (lm-eval's ``acc`` for loglikelihood tasks); ``perplexity`` is
  lm-eval's (exp of minus the mean log-likelihood of a whole target word), ``token_perplexity``
  per target token.

Scoring is our own log-likelihood code by default (:func:`loglikelihoods`: our tokenizer, no
network). ``backend="lm-eval"`` runs the same tasks through lm-evaluation-harness
(``pip install "kernelmix[eval]"``) from local task files (``dataset_path: json``, see
:func:`write_lm_eval_tasks`) with a small ``lm_eval.api.model.LM`` subclass that calls the same
scorer, offline (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): it never contacts a hub.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .data import Batch, TokenizedSplit, eval_windows, load_corpus
from .errors import KernelmixError
from .model import CausalLM

TASKS = ("continuation", "cloze")
BACKENDS = ("builtin", "lm-eval")


# ---------------------------------------------------------------------------------------------
# Splits to evaluate


def split_from_texts(texts: Sequence[str], tokenizer, names: Sequence[str] | None = None, name: str = "text") -> TokenizedSplit:
    """An in-memory split: each text one document, tokenized with ``tokenizer``."""
    return TokenizedSplit.from_token_lists([tokenizer.encode(t) for t in texts], name=name, names=names)


def text_split(spec: str | Path, tokenizer) -> TokenizedSplit:
    """Every document of a corpus spec (a text file is one document; see
    :func:`kernelmix.data.load_corpus`), tokenized with ``tokenizer``."""
    docs = list(load_corpus(spec).documents())
    if not docs:
        raise ValueError(f"{str(spec)!r} holds no text to evaluate")
    split = split_from_texts([d.text for d in docs], tokenizer, [d.name for d in docs], name=str(spec))
    split.num_bytes = sum(len(d.text.encode("utf-8")) for d in docs)  # for bits per byte over the whole text
    return split


def cap_split(split: TokenizedSplit, *, doc_tokens: int | None = None, max_docs: int | None = None) -> TokenizedSplit:
    """The first ``doc_tokens`` tokens of each of the first ``max_docs`` documents with at least
    2 tokens: a smaller evaluation set that is the same for every context length ≤ doc_tokens.
    Its ``num_bytes`` (for bits per byte) is kept only when nothing was cut."""
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
    """The tokens a loss evaluation of ``split`` predicts: every token but each document's first."""
    return int(np.maximum(split.doc_lengths - 1, 0).sum())


# The default scope of `kernelmix eval`: the first 8 documents, 4,096 tokens of each — for the
# `small` preset on 2 CPU cores about 10 s at one length and a minute for four lengths plus the
# zero-shot tasks (measured in docs/evaluation.md), where a whole split takes minutes (over half an
# hour was seen on a busy machine).
DEFAULT_MAX_DOCS = 8
DEFAULT_DOC_TOKENS = 4096


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
    so the longest windows still fit). Refuses a scope with no token to predict."""
    for label, value in (("max_docs", max_docs), ("doc_tokens", doc_tokens)):
        if value != "all" and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
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


# ---------------------------------------------------------------------------------------------
# Loss, perplexity, loss by position


def ngram_losses(train: TokenizedSplit, val: TokenizedSplit, vocab_size: int) -> dict[str, float | int]:
    """Reference lines for a loss table: the mean negative log-likelihood (nats/token) of ``val``'s
    predicted tokens (every token but each document's first) under a unigram and a bigram model
    counted on ``train`` with add-one smoothing over ``vocab_size`` tokens. A model below the
    bigram line has learned more than which token follows which; one above the unigram line, not
    even the token frequencies. Bigram counts stay inside documents and are kept sparse (pairs as
    ``prev * V + next``), so a large vocabulary costs memory for the pairs seen, not V²."""
    if vocab_size < 1:
        raise KernelmixError(f"vocab_size must be positive, got {vocab_size}")
    train_tokens = np.asarray(train.tokens, dtype=np.int64)
    in_doc = np.ones(max(len(train_tokens) - 1, 0), dtype=bool)
    starts = np.asarray(train.offsets[1:-1], dtype=np.int64)  # a pair never crosses into the next document
    in_doc[starts[(starts > 0) & (starts < len(train_tokens))] - 1] = False
    train_prev, train_next = train_tokens[:-1][in_doc], train_tokens[1:][in_doc]
    unigram = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
    predecessor = np.bincount(train_prev, minlength=vocab_size).astype(np.float64)
    pairs, pair_counts = np.unique(train_prev * vocab_size + train_next, return_counts=True)

    prev_list, next_list = [], []
    for i in range(len(val)):
        doc = np.asarray(val.document(i), dtype=np.int64)
        prev_list.append(doc[:-1])
        next_list.append(doc[1:])
    val_prev = np.concatenate(prev_list) if prev_list else np.zeros(0, dtype=np.int64)
    val_next = np.concatenate(next_list) if next_list else np.zeros(0, dtype=np.int64)
    if len(val_next) == 0:
        raise KernelmixError("the validation split predicts no token (every document has fewer than 2 tokens); "
                             "give documents of at least 2 tokens")
    if max(int(val_next.max()), int(train_tokens.max(initial=0))) >= vocab_size:
        raise KernelmixError(f"token ids reach {max(int(val_next.max()), int(train_tokens.max(initial=0)))} but "
                             f"vocab_size is {vocab_size}; pass the tokenizer's vocabulary size")
    unigram_p = (unigram[val_next] + 1.0) / (unigram.sum() + vocab_size)
    codes = val_prev * vocab_size + val_next
    pairs = np.append(pairs, np.iinfo(np.int64).max)  # a sentinel above every code: searchsorted stays in range
    pair_counts = np.append(pair_counts, 0)
    where = np.searchsorted(pairs, codes)
    counts = np.where(pairs[where] == codes, pair_counts[where], 0)
    bigram_p = (counts + 1.0) / (predecessor[val_prev] + vocab_size)
    return {"unigram": float(-np.log(unigram_p).mean()), "bigram": float(-np.log(bigram_p).mean()),
            "tokens": int(len(val_next))}


def default_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[0, 64), [64, 256), [256, 1024), ... (×4), the last one ending at ``seq_len``."""
    edges = [0, 64]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 4)
    edges = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def parse_buckets(edges: Sequence[int] | str, seq_len: int) -> list[tuple[int, int]]:
    """Buckets from edges ``[0, 64, 256]`` (or ``"0,64,256"``); a last bucket up to ``seq_len``
    is added, and edges at or beyond ``seq_len`` are dropped."""
    if isinstance(edges, str):
        try:
            edges = [int(e) for e in edges.split(",") if e.strip()]
        except ValueError:
            raise KernelmixError(f"bucket edges must be comma-separated integers, e.g. 0,64,256; got {edges!r}") from None
    edges = list(edges)
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise KernelmixError(f"bucket edges must start at 0 and increase, e.g. [0, 64, 256]; got {edges}")
    kept = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(kept[:-1], kept[1:]))


def check_lengths(model, seq_lens: int | Iterable[int]) -> list[int]:
    """``seq_lens`` as a list, each an int ≥ 2 within ``model.config.max_seq_len``; otherwise a
    :class:`~kernelmix.errors.KernelmixError` that names the length and the limit."""
    seq_lens = [seq_lens] if isinstance(seq_lens, int) else list(seq_lens)
    if not seq_lens:
        raise KernelmixError("give at least one context length, e.g. [256]")
    limit = model.config.max_seq_len
    for T in seq_lens:
        if isinstance(T, bool) or not isinstance(T, int) or T < 2:
            raise KernelmixError(f"context lengths must be ints ≥ 2, got {T!r}")
        if T > limit:
            raise KernelmixError(
                f"context length {T} exceeds the model's max_seq_len {limit}: positions beyond it are refused, not "
                f"extrapolated; evaluate at ≤ {limit} (beyond the training length is allowed up to max_seq_len)"
            )
    return seq_lens


@dataclass
class BucketLoss:
    start: int  # the predicted token's index in its window (= tokens of context it sees), inclusive
    end: int  # exclusive
    loss: float  # mean nats per predicted token (nan if the bucket is empty)
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.tokens else float("nan")


@dataclass
class LossReport:
    """Loss of one model on one split at one context length ``seq_len``. ``loss``: mean
    next-token cross-entropy in nats over ``tokens`` predicted tokens in ``windows`` windows, of
    which ``full_windows`` have all ``seq_len`` tokens (0: every document, or every document's
    evaluated part, is shorter than ``seq_len``); ``bits_per_byte`` when the split's UTF-8 size is
    known (a whole split)."""

    seq_len: int
    loss: float
    tokens: int
    windows: int
    buckets: list[BucketLoss] = field(default_factory=list)
    bits_per_byte: float | None = None
    beyond_training_length: bool = False
    full_windows: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def to_dict(self) -> dict[str, Any]:
        """As JSON: an empty bucket's loss and perplexity are null (JSON has no NaN)."""
        data = asdict(self)
        data["perplexity"] = self.perplexity
        for bucket, entry in zip(self.buckets, data["buckets"]):
            entry["perplexity"] = bucket.perplexity if bucket.tokens else None
            entry["loss"] = bucket.loss if bucket.tokens else None
        return data


# A forward's logits are float32 [windows, T, vocab]; the automatic batch keeps them under this
# (a 262k-token vocabulary at T=512 gets one window) and at most 16 windows / 16k tokens.
LOGITS_BUDGET_BYTES = 512 * 2**20


def auto_batch_size(seq_len: int, vocab_size: int | None) -> int:
    """Windows per forward when none is given (see :data:`LOGITS_BUDGET_BYTES`)."""
    by_logits = LOGITS_BUDGET_BYTES // (4 * seq_len * vocab_size) if vocab_size else 1
    return max(1, min(16, 16384 // seq_len, by_logits))


def loss_batches(split: TokenizedSplit, seq_len: int, batch_size: int) -> list[Batch]:
    """The evaluation windows of ``split`` (:func:`kernelmix.data.eval_windows`, the one rule),
    ``batch_size`` per batch: windows of the full ``seq_len`` in document order, unpadded and
    without an attention mask (the model's plain path), then each document's shorter last window,
    longest first, right-padded only to the longest in its batch. Padding is never read, so the
    sums are those of one window at a time."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise KernelmixError(f"batch_size must be a positive int, got {batch_size!r}")
    windows = list(eval_windows(split, seq_len))
    full = [w for w in windows if w[1] == seq_len]
    short = sorted((w for w in windows if w[1] < seq_len), key=lambda w: -w[1])
    return [_window_batch(split.tokens, group[i : i + batch_size])
            for group in (full, short) for i in range(0, len(group), batch_size)]


def _window_batch(tokens: np.ndarray, windows: Sequence[tuple[int, int]]) -> Batch:
    """Rows ``tokens[start : start + length]`` right-padded to the longest; a window's first
    token and the padding are not predicted (label -100); a mask only where there is padding."""
    width = max(length for _, length in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    mask = torch.zeros(len(windows), width, dtype=torch.long)
    for row, (start, length) in enumerate(windows):
        ids[row, :length] = torch.from_numpy(np.asarray(tokens[start : start + length], dtype=np.int64))
        mask[row, :length] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    padded = any(length < width for _, length in windows)
    return Batch(ids, labels, None, mask if padded else None)


@torch.no_grad()
def evaluate_loss(
    model: CausalLM,
    split: TokenizedSplit,
    seq_lens: int | Iterable[int],
    *,
    batch_size: int | None = None,
    buckets: Sequence[int] | str | None = None,
    train_seq_len: int | None = None,
    max_batches: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[LossReport]:
    """Loss, perplexity and loss by position bucket of ``model`` on ``split`` at each context
    length (see the module docstring). ``batch_size``: windows per forward (default
    :func:`auto_batch_size`); ``buckets``: bucket edges (default :func:`default_buckets`);
    ``train_seq_len``: marks lengths beyond it in the reports; ``max_batches``: cut each length's
    evaluation short (then the token sets of different lengths differ; prefer :func:`cap_split`);
    ``progress(seq_len, tokens_done)`` is called after each batch with the tokens predicted so
    far at that length (of :func:`predicted_tokens` in all). Every argument is checked before
    the first forward."""
    seq_lens = check_lengths(model, seq_lens)
    ranges = {T: parse_buckets(buckets, T) if buckets is not None else default_buckets(T) for T in seq_lens}
    if predicted_tokens(split) == 0:
        raise KernelmixError(f"split {split.name!r} has no token to predict: no document has 2 tokens or more")
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1):
        raise KernelmixError(f"max_batches must be a positive int or None, got {max_batches!r}")
    vocab = getattr(model.config, "vocab_size", None)
    reports = []
    for T in seq_lens:
        batches = loss_batches(split, T, batch_size or auto_batch_size(T, vocab))[:max_batches]
        done = np.cumsum([b.num_predicted for b in batches]).tolist()
        sums = sum_token_losses(
            model, batches, edges=[start for start, _ in ranges[T]] + [T],
            progress=None if progress is None else (lambda n, T=T: progress(T, done[n - 1])),
        )
        bpb = sums.loss / math.log(2) / split.num_bytes if split.num_bytes and max_batches is None else None
        reports.append(LossReport(
            seq_len=T, loss=sums.mean, tokens=sums.tokens, windows=sums.windows,
            buckets=[BucketLoss(a, b, float(s / c) if c else float("nan"), int(c))
                     for (a, b), s, c in zip(ranges[T], sums.bucket_loss, sums.bucket_tokens)],
            bits_per_byte=bpb,
            beyond_training_length=bool(train_seq_len and T > train_seq_len),
            full_windows=sum(int(b.input_ids.shape[0]) for b in batches if b.attention_mask is None
                             and b.input_ids.shape[1] == T),
        ))
    return reports


def evaluate_windows(model, windows: torch.Tensor, batch_size: int | None = None) -> dict:
    """Next-token loss (nats/token) and accuracy of ``model`` (anything that takes ``input_ids``
    and returns ``logits``: our CausalLM or a Hugging Face one) over ``windows`` ``[N, T]``, every
    token after a window's first predicted (:func:`sum_token_losses`), ``batch_size`` windows
    per forward (default :func:`auto_batch_size` for the model's ``config.vocab_size``)."""
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise KernelmixError(f"windows must be [N, T] with N ≥ 1 and T ≥ 2 (a token to predict), got {tuple(windows.shape)}")
    size = batch_size or auto_batch_size(windows.shape[1], getattr(getattr(model, "config", None), "vocab_size", None))
    sums = sum_token_losses(model, (Batch(x, x) for x in windows.split(size)))
    return {"loss": sums.mean, "accuracy": sums.correct / sums.tokens, "tokens": sums.tokens}


# ---------------------------------------------------------------------------------------------
# The one loss evaluator


@dataclass
class TokenLosses:
    """Sums over the predicted tokens of some batches (:func:`sum_token_losses`): ``loss`` nats
    over ``tokens`` tokens, ``correct`` of them the model's most likely token, in ``windows``
    rows; ``bucket_loss``/``bucket_tokens`` the same sums per position bucket (one bucket, all
    positions, unless ``edges`` were given)."""

    loss: float
    tokens: int
    correct: int
    windows: int
    bucket_loss: list[float]
    bucket_tokens: list[int]

    @property
    def mean(self) -> float:
        """Mean loss per predicted token (nan when there is none)."""
        return self.loss / self.tokens if self.tokens else float("nan")


@torch.no_grad()
def sum_token_losses(
    model,
    batches: Iterable[Batch],
    *,
    edges: Sequence[int] | None = None,
    autocast: Any = None,
    rank: int = 0,
    world_size: int = 1,
    all_reduce: Callable[[torch.Tensor], Any] | None = None,
    same_forwards: bool = False,
    progress: Callable[[int], None] | None = None,
) -> TokenLosses:
    """The one loss evaluator (behind :func:`evaluate_loss`, :func:`evaluate_windows` and the
    training loop's validation loss): summed next-token cross-entropy, in float64, of ``model``
    over ``batches`` (:class:`kernelmix.data.Batch`; a label -100 is not predicted; attention mask
    and position ids are passed when a batch has them), in eval mode without gradients (the
    model's mode is restored after).

    ``edges``: position buckets ``[edges[i], edges[i+1])`` of the predicted token's index in its
    window (= the tokens of context it sees). ``autocast``: a context for the forwards (e.g. bf16).
    Many processes: process ``rank`` of ``world_size`` evaluates batches ``rank, rank +
    world_size, ...`` and ``all_reduce`` (a sum over processes, in place) gives every process the
    totals; ``same_forwards``: every process runs the same number of forwards (FSDP gathers
    weights collectively), one past the end repeating the last batch without counting it.
    ``progress(batches_done)`` is called after each batch."""
    device = next(model.parameters()).device
    bounds = None if edges is None else torch.as_tensor(list(edges), device=device)
    buckets = 1 if bounds is None else len(bounds) - 1
    sums = torch.zeros(2 * buckets + 2, dtype=torch.float64, device=device)  # losses, counts, correct, windows
    was_training = model.training
    model.eval()
    try:
        for done, (batch, counted) in enumerate(_my_batches(batches, rank, world_size, same_forwards), start=1):
            batch = batch.to(device)
            with autocast if autocast is not None else contextlib.nullcontext():
                nll, mask, hits = _token_scores(model, batch)
            if counted:
                positions = torch.arange(1, batch.input_ids.shape[1], device=device)  # of each predicted token
                bucket = torch.zeros_like(positions) if bounds is None else torch.bucketize(positions, bounds, right=True) - 1
                sums[:buckets].index_add_(0, bucket, (nll.double() * mask).sum(0))
                sums[buckets:-2].index_add_(0, bucket, mask.sum(0).double())
                sums[-2] += hits.sum()  # on the device: no sync per batch
                sums[-1] += batch.input_ids.shape[0]
            if progress is not None:
                progress(done)
    finally:
        model.train(was_training)
    if all_reduce is not None:
        all_reduce(sums)
    return TokenLosses(loss=float(sums[:buckets].sum()), tokens=int(sums[buckets:-2].sum()), correct=int(sums[-2]),
                       windows=int(sums[-1]), bucket_loss=sums[:buckets].tolist(),
                       bucket_tokens=[int(c) for c in sums[buckets:-2].tolist()])


def _my_batches(batches: Iterable[Batch], rank: int, world_size: int, same_forwards: bool):
    """``(batch, counted)``: the share of process ``rank`` (see :func:`sum_token_losses`)."""
    if world_size == 1:
        yield from ((batch, True) for batch in batches)
        return
    batches = list(batches)
    for r in range(math.ceil(len(batches) / world_size)):
        index = r * world_size + rank
        if index >= len(batches) and not same_forwards:
            return
        yield batches[min(index, len(batches) - 1)], index < len(batches)


def _token_scores(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token negative log-likelihood ``[B, T-1]`` of ``batch.labels[:, 1:]`` (in at least
    float32, 0 where not predicted), the mask of tokens that count (label ≠ -100) and of those the
    model's most likely token hits."""
    inputs = {"attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    logits = model(input_ids=batch.input_ids, **{k: v for k, v in inputs.items() if v is not None}, use_cache=False).logits
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    labels = batch.labels[:, 1:]
    mask = labels != -100
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return nll * mask, mask, (logits.argmax(-1) == labels) & mask


def token_nll(model: CausalLM, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token negative log-likelihood ``[B, T-1]`` of ``batch.labels[:, 1:]`` (in at least
    float32) and the mask of tokens that count (label ≠ -100)."""
    nll, mask, _ = _token_scores(model, batch)
    return nll, mask


# ---------------------------------------------------------------------------------------------
# Zero-shot tasks from held-out documents


def _roundtrips(tokenizer, ids: np.ndarray) -> str | None:
    """The text of ``ids`` if encoding it gives ``ids`` back (no character cut in half), else None."""
    text = tokenizer.decode([int(i) for i in ids])
    return text if tokenizer.encode(text) == [int(i) for i in ids] else None


def build_continuation_task(
    split: TokenizedSplit, tokenizer, *, items: int = 100, context_tokens: int = 256, span_tokens: int = 32,
    num_choices: int = 4, seed: int = 0,
) -> list[dict[str, Any]]:
    """Multiple-choice items ``{"id", "doc", "context", "choices", "label"}``: ``context_tokens``
    tokens of a document, then the true next ``span_tokens`` tokens among ``num_choices - 1``
    spans of the same length from other documents (at random positions). Deterministic in
    (split, tokenizer, arguments)."""
    for label, value, low in (("items", items, 1), ("context_tokens", context_tokens, 1),
                              ("span_tokens", span_tokens, 1), ("num_choices", num_choices, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an int ≥ {low}, got {value!r}")
    lengths = split.doc_lengths
    hosts = np.flatnonzero(lengths >= context_tokens + span_tokens)
    donors = np.flatnonzero(lengths >= span_tokens)
    if len(hosts) == 0 or len(donors) < 2:
        raise ValueError(
            f"split {split.name!r} ({len(split)} documents) cannot give continuation items: it needs a document of "
            f"≥ {context_tokens + span_tokens} tokens and another of ≥ {span_tokens}; use shorter context_tokens/span_tokens"
        )
    rng = np.random.default_rng([seed, 0xC0])
    out: list[dict[str, Any]] = []
    attempts = 0
    while len(out) < items and attempts < items * 50:
        attempts += 1
        doc = int(rng.choice(hosts))
        tokens = split.document(doc)
        p = int(rng.integers(context_tokens, len(tokens) - span_tokens + 1))
        context = _roundtrips(tokenizer, tokens[p - context_tokens : p])
        true = _roundtrips(tokenizer, tokens[p : p + span_tokens])
        if context is None or true is None or not true.strip():
            continue
        others = donors[donors != doc]
        distractors: list[str] = []
        for _ in range(20 * num_choices):
            if len(distractors) == num_choices - 1:
                break
            other = split.document(int(rng.choice(others)))
            q = int(rng.integers(0, len(other) - span_tokens + 1))
            text = _roundtrips(tokenizer, other[q : q + span_tokens])
            if text is not None and text.strip() and text != true and text not in distractors:
                distractors.append(text)
        if len(distractors) < num_choices - 1:
            continue
        label = int(rng.integers(0, num_choices))
        choices = distractors[:label] + [true] + distractors[label:]
        out.append({"id": len(out), "doc": _doc_name(split, doc), "context": context, "choices": choices, "label": label})
    if len(out) < items:
        raise ValueError(f"could only build {len(out)} of {items} continuation items from split {split.name!r}")
    return out


_CLOZE_WORD = re.compile(r"(?<=[ \t(\[.,=:!])([A-Za-z_][A-Za-z0-9_]{2,})[ \t]*$", re.MULTILINE)


def build_cloze_task(
    split: TokenizedSplit, tokenizer, *, items: int = 100, context_tokens: int = 256, seed: int = 0,
    min_context_chars: int = 64,
) -> list[dict[str, Any]]:
    """Last-word cloze items ``{"id", "doc", "context", "target"}``: the text before the last
    word of a line (a word of ≥ 3 letters/digits/underscores after a space or punctuation, e.g.
    the ``result`` of ``return result``; at most ``context_tokens`` tokens of it) and that word.
    Deterministic in (split, tokenizer, arguments)."""
    for label, value in (("items", items), ("context_tokens", context_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    candidates: list[tuple[int, int, str]] = []  # (doc, char offset of the word, word)
    texts: dict[int, str] = {}
    for doc in range(len(split)):
        text = tokenizer.decode([int(t) for t in split.document(doc)])
        texts[doc] = text
        for match in _CLOZE_WORD.finditer(text):
            if match.start(1) >= min_context_chars:
                candidates.append((doc, match.start(1), match.group(1)))
    if len(candidates) < items:
        raise ValueError(
            f"split {split.name!r} has only {len(candidates)} lines ending in a word (after ≥ {min_context_chars} "
            f"characters of context); ask for ≤ {len(candidates)} cloze items"
        )
    rng = np.random.default_rng([seed, 0xC1])
    out = []
    for index in sorted(rng.choice(len(candidates), size=items, replace=False).tolist()):
        doc, start, word = candidates[index]
        prefix_ids = tokenizer.encode(texts[doc][:start])[-context_tokens:]
        out.append({"id": len(out), "doc": _doc_name(split, doc), "context": tokenizer.decode(prefix_ids), "target": word})
    return out


def _doc_name(split: TokenizedSplit, doc: int) -> str:
    return split.doc_names[doc] if doc < len(split.doc_names) else f"doc{doc}"


def build_tasks(
    split: TokenizedSplit, tokenizer, *, tasks: Sequence[str] = TASKS, items: int = 100, context_tokens: int = 256,
    span_tokens: int = 32, num_choices: int = 4, seed: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """The named zero-shot tasks (``continuation``, ``cloze``) built from ``split``."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown or list(tasks)} (choose from: {', '.join(TASKS)})")
    built = {}
    for name in tasks:
        if name == "continuation":
            built[name] = build_continuation_task(split, tokenizer, items=items, context_tokens=context_tokens,
                                                  span_tokens=span_tokens, num_choices=num_choices, seed=seed)
        else:
            built[name] = build_cloze_task(split, tokenizer, items=items, context_tokens=context_tokens, seed=seed)
    return built


# ---------------------------------------------------------------------------------------------
# Log-likelihood scoring (our own; also what the lm-eval backend calls)


@torch.no_grad()
def loglikelihoods(
    model: CausalLM, tokenizer, requests: Sequence[tuple[str, str]], *, batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """For each ``(context, continuation)``: the summed log-probability of the continuation's
    tokens given the context, and whether every one of them is the model's greedy choice (the
    pair lm-eval's ``loglikelihood`` returns). Context and continuation are tokenized separately
    and concatenated; a context too long for ``max_seq_len`` loses its oldest tokens.
    ``progress(n)`` is called after each batch with the ``n`` requests it scored."""
    device = next(model.parameters()).device
    limit = model.config.max_seq_len
    encoded = []
    for context, continuation in requests:
        ctx, cont = tokenizer.encode(context), tokenizer.encode(continuation)
        if not cont:
            raise ValueError(f"empty continuation after {context[-40:]!r}: nothing to score")
        if not ctx:
            raise ValueError(f"empty context before {continuation[:40]!r}: the model has no start token to condition on")
        if len(cont) >= limit:
            raise ValueError(f"continuation of {len(cont)} tokens does not fit max_seq_len {limit} with any context")
        ctx = ctx[-(limit - len(cont)):]
        encoded.append((ctx, cont))
    results: list[tuple[float, bool] | None] = [None] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: -(len(encoded[i][0]) + len(encoded[i][1])))
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            rows = [encoded[i][0] + encoded[i][1] for i in chunk]
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for r, i in enumerate(chunk):
                ctx, cont = encoded[i]
                target = torch.tensor(cont)
                span = logprobs[r, len(ctx) - 1 : len(ctx) - 1 + len(cont)]  # the logits before each continuation token
                total = float(span.gather(1, target[:, None]).sum())
                greedy = bool((span.argmax(-1) == target).all())
                results[i] = (total, greedy)
            if progress is not None:
                progress(len(chunk))
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def task_requests(tasks: dict[str, list[dict[str, Any]]]) -> int:
    """The log-likelihood requests scoring ``tasks`` takes (one per choice, one per cloze item):
    the total of :func:`score_tasks`'s progress."""
    return sum(len(item.get("choices", [None])) for items in tasks.values() for item in items)


def check_backend(backend: str) -> None:
    """``backend`` is one of :data:`BACKENDS` and can run here (lm-eval is installed); otherwise a
    :class:`~kernelmix.errors.KernelmixError` naming the fix. Cheap: call it before any evaluation."""
    if backend not in BACKENDS:
        raise KernelmixError(f"unknown backend {backend!r} (choose from: {', '.join(BACKENDS)})")
    if backend == "lm-eval":
        try:
            import lm_eval  # noqa: F401  (the scoring imports it anyway)
        except ImportError:
            raise KernelmixError('the lm-eval backend needs lm-evaluation-harness: pip install "kernelmix[eval]" '
                                 "(or use the builtin backend)") from None


def score_tasks(
    model: CausalLM, tokenizer, tasks: dict[str, list[dict[str, Any]]], *, batch_size: int = 8,
    backend: str = "builtin", task_dir: str | Path | None = None, progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Accuracy (and more) per task: ``continuation`` → ``acc``, ``acc_norm``, ``items``;
    ``cloze`` → ``acc`` (target = greedy continuation), ``perplexity`` (per target token)...
    ``backend="lm-eval"`` scores through lm-evaluation-harness with task files written to
    ``task_dir`` (a temporary directory if None). ``progress(n)``: after each batch, with the
    ``n`` requests it scored (:func:`task_requests` in all). Task names and the backend are
    checked before anything is scored."""
    unknown = [name for name in tasks if name not in TASKS]
    if unknown:
        raise KernelmixError(f"unknown task(s) {', '.join(map(repr, unknown))} (choose from: {', '.join(TASKS)})")
    if backend not in BACKENDS:
        raise KernelmixError(f"unknown backend {backend!r} (choose from: {', '.join(BACKENDS)})")
    if backend == "lm-eval":
        return score_with_lm_eval(model, tokenizer, tasks, batch_size=batch_size, task_dir=task_dir, progress=progress)
    scores = {}
    for name, items in tasks.items():
        if name == "continuation":
            requests = [(item["context"], choice) for item in items for choice in item["choices"]]
            values = loglikelihoods(model, tokenizer, requests, batch_size=batch_size, progress=progress)
            correct = correct_norm = 0
            at = 0
            for item in items:
                n = len(item["choices"])
                lls = [v[0] for v in values[at : at + n]]
                at += n
                norm = [ll / max(1, len(c)) for ll, c in zip(lls, item["choices"])]  # per character, as lm-eval
                correct += int(np.argmax(lls)) == item["label"]
                correct_norm += int(np.argmax(norm)) == item["label"]
            scores[name] = {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "items": len(items),
                            "chance": float(np.mean([1 / len(i["choices"]) for i in items]))}
        else:  # cloze
            values = loglikelihoods(model, tokenizer, [(i["context"], i["target"]) for i in items],
                                    batch_size=batch_size, progress=progress)
            n_tokens = sum(len(tokenizer.encode(i["target"])) for i in items)
            scores[name] = {"acc": float(np.mean([g for _, g in values])), "items": len(items),
                            # lm-eval's perplexity: exp(−mean log-likelihood of a whole target)
                            "perplexity": math.exp(-float(np.mean([ll for ll, _ in values]))),
                            "token_perplexity": math.exp(-sum(ll for ll, _ in values) / n_tokens)}
    return scores


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness backend (optional: pip install "kernelmix[eval]")


def write_lm_eval_tasks(tasks: dict[str, list[dict[str, Any]]], task_dir: str | Path) -> dict[str, Path]:
    """Write each task as ``<task_dir>/kernelmix_<name>.jsonl`` plus a task YAML that lm-eval
    reads with ``--include_path task_dir`` (``dataset_path: json``: a local file, no hub).
    Returns the YAML paths by task name."""
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, items in tasks.items():
        data = (task_dir / f"kernelmix_{name}.jsonl").resolve()
        data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
        lines = [
            f"task: kernelmix_{name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data))}",
            "test_split: test",
            'doc_to_text: "{{context}}"',
            'target_delimiter: ""',
        ]
        if name == "continuation":
            lines += ["output_type: multiple_choice", 'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{label}}"',
                      "metric_list:", *_metric("acc", "mean", True), *_metric("acc_norm", "mean", True)]
        elif name == "cloze":
            lines += ["output_type: loglikelihood", 'doc_to_target: "{{target}}"',
                      "metric_list:", *_metric("perplexity", "perplexity", False), *_metric("acc", "mean", True)]
        else:
            raise ValueError(f"unknown task {name!r} (choose from: {', '.join(TASKS)})")
        lines += ["metadata:", "  version: 1.0"]
        path = task_dir / f"kernelmix_{name}.yaml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written[name] = path
    return written


def _metric(name: str, aggregation: str, higher_is_better: bool) -> list[str]:
    return [f"  - metric: {name}", f"    aggregation: {aggregation}", f"    higher_is_better: {str(higher_is_better).lower()}"]


def lm_eval_model(model: CausalLM, tokenizer, *, batch_size: int = 8, progress: Callable[[int], None] | None = None):
    """An ``lm_eval.api.model.LM`` for ``model``: loglikelihood through :func:`loglikelihoods`
    (our tokenizer; ``progress`` as there); rolling loglikelihood and generation are not provided."""
    try:
        from lm_eval.api.model import LM
    except ImportError as error:
        raise ImportError('the lm-eval backend needs lm-evaluation-harness: pip install "kernelmix[eval]"') from error

    class KernelMixLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return loglikelihoods(self.model, self.tokenizer, [r.args for r in requests], batch_size=self.batch_size,
                                  progress=progress)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("kernelmix's lm-eval model scores loglikelihood tasks only")

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("kernelmix's lm-eval model scores loglikelihood tasks only")

    return KernelMixLM()


def score_with_lm_eval(
    model: CausalLM, tokenizer, tasks: dict[str, list[dict[str, Any]]], *, batch_size: int = 8,
    task_dir: str | Path | None = None, progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Score ``tasks`` with lm-evaluation-harness (offline: local task files, no hub);
    ``progress`` as in :func:`loglikelihoods`."""
    import tempfile

    os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets is imported: never contact a hub
    os.environ["HF_HUB_OFFLINE"] = "1"
    lm = lm_eval_model(model, tokenizer, batch_size=batch_size, progress=progress)
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="kernelmix-lm-eval-") as tmp:
        directory = Path(task_dir) if task_dir is not None else Path(tmp)
        write_lm_eval_tasks(tasks, directory)
        manager = TaskManager(include_path=str(directory), include_defaults=False)
        names = [f"kernelmix_{name}" for name in tasks]
        output = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=manager, bootstrap_iters=0, log_samples=False, verbosity="ERROR",
        )
    scores = {}
    for name in tasks:
        raw = output["results"][f"kernelmix_{name}"]
        entry = {key.split(",")[0]: float(value) for key, value in raw.items()
                 if "," in key and "stderr" not in key and isinstance(value, (int, float))}
        entry["items"] = len(tasks[name])
        scores[name] = entry
    return scores


__all__ = [
    "ngram_losses",
    "BACKENDS",
    "TASKS",
    "BucketLoss",
    "DEFAULT_DOC_TOKENS",
    "DEFAULT_MAX_DOCS",
    "EvalScope",
    "LOGITS_BUDGET_BYTES",
    "LossReport",
    "auto_batch_size",
    "build_cloze_task",
    "build_continuation_task",
    "build_tasks",
    "cap_split",
    "check_backend",
    "check_lengths",
    "default_buckets",
    "evaluate_loss",
    "evaluate_windows",
    "lm_eval_model",
    "loglikelihoods",
    "loss_batches",
    "parse_buckets",
    "predicted_tokens",
    "score_tasks",
    "score_with_lm_eval",
    "scope_split",
    "split_from_texts",
    "sum_token_losses",
    "task_requests",
    "text_split",
    "TokenLosses",
    "token_nll",
    "write_lm_eval_tasks",
]
