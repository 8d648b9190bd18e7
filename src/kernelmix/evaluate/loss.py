"""Loss, perplexity and loss by position at several context lengths, and the one loss evaluator
(:func:`sum_token_losses`) that :func:`evaluate_loss`, :func:`evaluate_windows` and the training
loop's validation loss share; the unigram and bigram reference lines (:func:`ngram_losses`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data import Batch, TokenizedSplit, eval_windows
from ..errors import KernelmixError
from ..model import CausalLM
from .settings import default_buckets, parse_buckets
from .splits import predicted_tokens


def ngram_losses(train: TokenizedSplit, val: TokenizedSplit, vocab_size: int) -> dict[str, float | int]:
    """Reference lines for a loss table: the mean negative log-likelihood (nats/token) of ``val``'s
    predicted tokens (every token but each document's first) under a unigram and a bigram model
    counted on ``train`` with add-one smoothing over ``vocab_size`` tokens. A model below the
    bigram line has learned more than which token follows which; one above the unigram line, not
    even the token frequencies. Bigram counts stay inside documents and are kept sparse (pairs as
    ``prev * V + next``), so a large vocabulary costs memory for the pairs seen, not V².

    Args:
        train: the split the counts come from.
        val: the split scored.
        vocab_size: V, the number of token ids (every id of both splits must be below it).

    Returns:
        ``{"unigram": nats/token, "bigram": nats/token, "tokens": val's predicted tokens}``."""
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


def check_lengths(model, seq_lens: int | Iterable[int]) -> list[int]:
    """``seq_lens`` as a list, each an int ≥ 2 within ``model.config.max_seq_len``; otherwise a
    :class:`~kernelmix.errors.KernelmixError` that names the length and the limit.

    Args:
        model: a model with ``config.max_seq_len`` (a :class:`~kernelmix.model.CausalLM`).
        seq_lens: one context length or several.

    Returns:
        The lengths as a list, in the order given."""
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
    """Windows per forward when none is given (see :data:`LOGITS_BUDGET_BYTES`).

    Args:
        seq_len: tokens per window.
        vocab_size: the logits' width; None (unknown): one window per forward.

    Returns:
        ``max(1, min(16, 16384 // seq_len, LOGITS_BUDGET_BYTES // (4 · seq_len · vocab_size)))``; 1 when
        ``vocab_size`` is None."""
    by_logits = LOGITS_BUDGET_BYTES // (4 * seq_len * vocab_size) if vocab_size else 1
    return max(1, min(16, 16384 // seq_len, by_logits))


def loss_batches(split: TokenizedSplit, seq_len: int, batch_size: int) -> list[Batch]:
    """The evaluation windows of ``split`` (:func:`kernelmix.data.eval_windows`, the one rule),
    ``batch_size`` per batch: windows of the full ``seq_len`` in document order, unpadded and
    without an attention mask (the model's plain path), then each document's shorter last window,
    longest first, right-padded only to the longest in its batch. Padding is never read, so the
    sums are those of one window at a time.

    Args:
        split: the tokenized documents.
        seq_len: the context length T, ≥ 2.
        batch_size: windows per batch, a positive int.

    Returns:
        The :class:`~kernelmix.data.Batch` list: ``input_ids`` and ``labels`` ``[b, width]`` (label -100
        on each window's first token and on the padding), an ``attention_mask`` only where a batch has
        padding, no ``position_ids``."""
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
    """Loss, perplexity and loss by position bucket of ``model`` on ``split`` at each context length.

    See the module docstring for how the windows are cut. Every argument is checked before the first
    forward.

    Args:
        model: a :class:`~kernelmix.model.CausalLM`.
        split: the tokenized documents to score.
        seq_lens: one context length or several.
        batch_size: windows per forward (default :func:`auto_batch_size`).
        buckets: bucket edges (default :func:`default_buckets`).
        train_seq_len: marks lengths beyond it in the reports.
        max_batches: cut each length's evaluation short (then the token sets of different lengths
            differ; prefer :func:`cap_split`).
        progress: ``progress(seq_len, tokens_done)`` after each batch, with the tokens predicted so far
            at that length (of :func:`predicted_tokens` in all).

    Returns:
        One :class:`LossReport` per context length."""
    seq_lens = check_lengths(model, seq_lens)
    ranges = {T: parse_buckets(buckets, T) if buckets is not None else default_buckets(T) for T in seq_lens}
    if predicted_tokens(split) == 0:
        raise KernelmixError(f"split {split.name!r} has no token to predict: no document has 2 tokens or more")
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
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
    token after a window's first predicted (:func:`sum_token_losses`).

    Args:
        model: the model to score.
        windows: token ids ``[N, T]`` with N ≥ 1 and T ≥ 2; each batch is moved to the model's device.
        batch_size: windows per forward (default :func:`auto_batch_size` for the model's
            ``config.vocab_size``).

    Returns:
        ``{"loss": mean nats per predicted token, "accuracy": the share of them that is the model's most
        likely token, "tokens": N·(T - 1)}``."""
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise KernelmixError("windows must be [N, T] with N ≥ 1 and T ≥ 2 (a token to predict), "
                             f"got {tuple(windows.shape)}")
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

    Args:
        model: anything that takes ``input_ids`` and returns ``logits``; each batch is moved to the
            device of its first parameter.
        batches: the batches to score (any iterable; read into a list when there are several processes).
        edges: position buckets ``[edges[i], edges[i+1])`` of the predicted token's index in its
            window (= the tokens of context it sees); None: one bucket of every position.
        autocast: a context for the forwards (e.g. bf16); None: none.
        rank, world_size: many processes: process ``rank`` of ``world_size`` evaluates batches ``rank,
            rank + world_size, ...``.
        all_reduce: a sum over processes, in place, that gives every process the totals; None: this
            process's sums only.
        same_forwards: every process runs the same number of forwards (FSDP gathers weights
            collectively), one past the end repeating the last batch without counting it.
        progress: ``progress(batches_done)`` is called after each batch.

    Returns:
        :class:`TokenLosses`: the summed loss (nats), predicted tokens, correct top-1 predictions and
        rows, and the loss and tokens of each bucket."""
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
                bucket = (torch.zeros_like(positions) if bounds is None
                          else torch.bucketize(positions, bounds, right=True) - 1)
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
    logits = model(input_ids=batch.input_ids, **{k: v for k, v in inputs.items() if v is not None},
                   use_cache=False).logits
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    labels = batch.labels[:, 1:]
    mask = labels != -100
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return nll * mask, mask, (logits.argmax(-1) == labels) & mask


def token_nll(model: CausalLM, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token negative log-likelihood ``[B, T-1]`` of ``batch.labels[:, 1:]`` (in at least
    float32) and the mask of tokens that count (label ≠ -100).

    Args:
        model: anything that takes ``input_ids`` and returns ``logits`` (e.g. a :class:`~kernelmix.model.CausalLM`).
        batch: a :class:`kernelmix.data.Batch` on the model's device (its attention mask and position ids
            are passed when set).

    Returns:
        ``(nll, mask)``, both ``[B, T-1]``: nll 0 where not predicted, mask bool."""
    nll, mask, _ = _token_scores(model, batch)
    return nll, mask
