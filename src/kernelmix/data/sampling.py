"""Training windows and evaluation windows over a :class:`~kernelmix.data.TokenizedSplit`.

Label convention (that of :class:`kernelmix.model.CausalLM`, which shifts internally: the logits
at index t predict ``labels[t + 1]``): ``labels`` equal ``input_ids`` except -100 where a token
is not to be predicted — the first token of every document (nothing before it in the window
belongs to its document) and padding.

:class:`WindowSampler` draws training batches. It has no state: the batch of a step is a pure
function of (seed, step, rank, world_size), so a run resumed from step k sees exactly the batches
it would have seen. Each epoch is a seeded permutation of the epoch's windows; the global sample
index ``step · batch_size · world_size + rank · batch_size + i`` picks the window, so ranks draw
disjoint windows of the same permutation, and every window is used once per epoch.

:func:`eval_batches` walks a split in document order for validation loss; every token but the
first of each document is predicted exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .dataset import TokenizedSplit

IGNORE_INDEX = -100


@dataclass
class Batch:
    """Model inputs for one step: ``input_ids``/``labels`` LongTensors [B, T]; ``position_ids``
    [B, T] (restarting at 0 at each document start) when rows pack several documents, else None;
    ``attention_mask`` [B, T] (0 = padding, right-padded) when rows can be padded, else None."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.attention_mask))

    def model_inputs(self) -> dict[str, Tensor | None]:
        """Keyword arguments for :class:`kernelmix.model.CausalLM`: ``model(**batch.model_inputs())``."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }

    @property
    def num_predicted(self) -> int:
        """Tokens that count in the loss (labels after the model's shift that are not -100)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def _check_positive(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}, got {value!r}")


class WindowSampler:
    """Batches of ``batch_size`` windows of ``seq_len`` tokens for step ``step`` of one rank.

    ``cross_documents=True`` (default): windows are cut from the split's token stream (all
    documents back to back), so a window may hold the end of one document and the start of the
    next; ``position_ids`` restart at 0 at every document start (and at the window start), so the
    model never attends across a boundary, and the label of each document's first token is -100.
    Each epoch uses ``N // seq_len - 1`` windows at a random offset (drawn per epoch), so window
    boundaries move from epoch to epoch and at most about ``2·seq_len`` tokens are left out.

    ``cross_documents=False``: every window lies inside one document. A document of L ≥ seq_len
    tokens gives ``L // seq_len`` windows per epoch (at a random offset in ``[0, L mod seq_len]``);
    a shorter one (≥ 2 tokens) gives one window right-padded with ``attention_mask`` 0 and label
    -100 if ``pad_short`` (default), or is skipped if not. ``position_ids`` is None then, and
    ``attention_mask`` is given for every batch if any window can be padded.

    Exact resumption needs the same split, seq_len, batch_size, seed and world_size
    (:meth:`state_dict` records them)."""

    def __init__(
        self,
        split: TokenizedSplit,
        seq_len: int,
        batch_size: int,
        *,
        cross_documents: bool = True,
        pad_short: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        _check_positive("seq_len", seq_len, 2)
        _check_positive("batch_size", batch_size)
        _check_positive("world_size", world_size)
        _check_positive("seed", seed, 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size = {world_size}), got {rank!r}")
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.cross_documents, self.pad_short = bool(cross_documents), bool(pad_short)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._plans: dict[int, np.ndarray] = {}
        n_tokens = split.num_tokens
        if cross_documents:
            if n_tokens < seq_len:
                raise ValueError(
                    f"split {split.name!r} has {n_tokens} tokens, fewer than seq_len = {seq_len}; "
                    "use a shorter seq_len or a larger corpus"
                )
            self.windows_per_epoch = max(1, n_tokens // seq_len - 1)
            self._slack = n_tokens - self.windows_per_epoch * seq_len
            self.pads = False
        else:
            lengths = split.doc_lengths
            long = lengths >= seq_len
            usable = long | ((lengths >= 2) & pad_short)
            if not usable.any():
                longest = int(lengths.max()) if len(lengths) else 0
                raise ValueError(
                    f"no document of split {split.name!r} is long enough for seq_len = {seq_len} with "
                    f"cross_documents=False (the longest has {longest} tokens); use seq_len ≤ {longest}, "
                    "pad_short=True, or cross_documents=True"
                )
            self._docs = np.flatnonzero(usable)  # documents that give windows
            self._lengths = lengths[self._docs]
            counts = np.where(self._lengths >= seq_len, self._lengths // seq_len, 1)
            self._slack_per_doc = np.where(self._lengths >= seq_len, self._lengths - counts * seq_len, 0)
            # window w belongs to local document _win_doc[w] and is its _win_k[w]-th window
            self._win_doc = np.repeat(np.arange(len(self._docs)), counts)
            self._win_k = np.arange(len(self._win_doc)) - np.repeat(np.cumsum(counts) - counts, counts)
            self.windows_per_epoch = int(counts.sum())
            self.pads = bool((self._lengths < seq_len).any())

    # -- the plan of an epoch: a permutation of its windows' starts --------------------------------

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        """Start token (in the split's stream) of every window of ``epoch``, in the order used."""
        plan = self._plans.get(epoch)
        if plan is None:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.windows_per_epoch)
            if self.cross_documents:
                offset = int(rng.integers(0, self._slack + 1))
                plan = offset + order.astype(np.int64) * self.seq_len
            else:
                doc_offset = rng.integers(0, self._slack_per_doc + 1)
                starts = (
                    self.split.offsets[self._docs][self._win_doc]
                    + doc_offset[self._win_doc]
                    + self._win_k * self.seq_len
                )
                plan = starts[order]
            if len(self._plans) >= 4:
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = plan
        return plan

    def epoch(self, step: int) -> float:
        """How many epochs (of this split) the global batch has gone through before ``step``."""
        return step * self.batch_size * self.world_size / self.windows_per_epoch

    @property
    def tokens_per_step(self) -> int:
        """Input tokens per step over all ranks."""
        return self.batch_size * self.seq_len * self.world_size

    def starts(self, step: int) -> np.ndarray:
        """The start offsets (in the split's token stream) of this rank's windows at ``step``."""
        _check_positive("step", step, 0)
        first = step * self.batch_size * self.world_size + self.rank * self.batch_size
        index = first + np.arange(self.batch_size, dtype=np.int64)
        epochs, within = np.divmod(index, self.windows_per_epoch)
        starts = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            starts[mask] = self._epoch_starts(int(epoch))[within[mask]]
        return starts

    def batch(self, step: int) -> Batch:
        """The batch of this rank at ``step`` (a pure function of seed, step, rank, world_size)."""
        starts = self.starts(step)
        tokens, offsets, T = self.split.tokens, self.split.offsets, self.seq_len
        if self.cross_documents:
            ids = np.stack([tokens[s : s + T] for s in starts]).astype(np.int64)
            index = starts[:, None] + np.arange(T)
            doc_begin = offsets[np.searchsorted(offsets, index, side="right") - 1]
            positions = index - np.maximum(doc_begin, starts[:, None])
            input_ids = torch.from_numpy(ids)
            position_ids = torch.from_numpy(positions)
            labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
            return Batch(input_ids, labels, position_ids, None)
        doc_end = offsets[np.searchsorted(offsets, starts, side="right")]
        return _padded_batch(tokens, starts, np.minimum(doc_end - starts, T), T, always_mask=self.pads)

    def state_dict(self) -> dict:
        """The settings that define the batches (store beside the step in a checkpoint)."""
        return {
            "split": self.split.fingerprint,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "cross_documents": self.cross_documents,
            "pad_short": self.pad_short,
            "seed": self.seed,
            "world_size": self.world_size,
        }

    def __repr__(self) -> str:
        return (
            f"WindowSampler({self.split.name!r}, seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"cross_documents={self.cross_documents}, seed={self.seed}, rank={self.rank}/{self.world_size}, "
            f"windows_per_epoch={self.windows_per_epoch})"
        )


def _padded_batch(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, T: int, *, always_mask: bool) -> Batch:
    """Rows ``tokens[start : start + length]`` (each inside one document, starting a window at
    position 0), right-padded to T."""
    ids = np.zeros((len(starts), T), dtype=np.int64)
    mask = np.zeros((len(starts), T), dtype=np.int64)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        ids[row, :length] = tokens[start : start + length]
        mask[row, :length] = 1
    input_ids = torch.from_numpy(ids)
    attention_mask = torch.from_numpy(mask)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX  # a window's first token has no context in the window
    padded = always_mask or bool((lengths < T).any())
    return Batch(input_ids, labels, None, attention_mask if padded else None)


def eval_windows(split: TokenizedSplit, seq_len: int) -> Iterator[tuple[int, int]]:
    """(start, length) of the evaluation windows, in document order. Inside each document of L ≥ 2
    tokens, windows start every ``seq_len - 1`` tokens and overlap by one token, which is context
    only (label -100): each token but the document's first is predicted exactly once, with
    ``seq_len - 1`` tokens of context at most.

    This is the rule for our own tokenized corpora, which have no BOS: a window never crosses a
    document, and a document's first token plays the part BOS plays in
    :func:`kernelmix.data.windows.text_windows` (the windows of pretrained models: BOS first,
    documents joined with BOS). Both predict ``seq_len - 1`` tokens per full window, each from
    the tokens before it in the window."""
    _check_positive("seq_len", seq_len, 2)
    stride = seq_len - 1
    offsets = split.offsets
    for doc in range(len(split)):
        begin, end = int(offsets[doc]), int(offsets[doc + 1])
        for start in range(begin, end - 1, stride):
            yield start, min(seq_len, end - start)


def eval_batches(split: TokenizedSplit, seq_len: int, batch_size: int,
                 max_batches: int | None = None) -> Iterator[Batch]:
    """Deterministic batches covering ``split`` for validation loss (see :func:`eval_windows`):
    each window within one document, right-padded (``attention_mask`` always given,
    ``position_ids`` None); the last batch may have fewer rows. Summing ``loss ·
    num_predicted`` over the batches gives the split's total loss over
    ``split.num_tokens - len(split)`` predicted tokens (when ``max_batches`` does not cut it).

    When ``max_batches`` cuts, its ``max_batches · batch_size`` windows are spread evenly over the
    split's windows in document order (deterministic), not the first ones: the first ones all lie
    in the first document or two, whose loss can sit far from the split's (the periodic check of a
    compare read one file of code, 0.9 nats below the final evaluation)."""
    _check_positive("batch_size", batch_size)
    if max_batches is not None:
        _check_positive("max_batches", max_batches)
    if split.num_tokens - len(split) <= 0:
        raise ValueError(
            f"split {split.name!r} has nothing to evaluate ({len(split)} documents, {split.num_tokens} tokens); "
            "use a corpus with at least two documents and val_fraction > 0"
        )
    windows = iter(spread_windows(split, seq_len, max_batches * batch_size) if max_batches
                   else eval_windows(split, seq_len))
    produced = 0
    while max_batches is None or produced < max_batches:
        chunk = [w for _, w in zip(range(batch_size), windows)]
        if not chunk:
            return
        starts, lengths = (np.array(column, dtype=np.int64) for column in zip(*chunk))
        yield _padded_batch(split.tokens, starts, lengths, seq_len, always_mask=True)
        produced += 1


def spread_windows(split: TokenizedSplit, seq_len: int, count: int) -> list[tuple[int, int]]:
    """``count`` of :func:`eval_windows`' windows, evenly spaced from the first to the last (all of
    them when there are no more)."""
    windows = list(eval_windows(split, seq_len))
    if count >= len(windows):
        return windows
    if count == 1:
        return [windows[len(windows) // 2]]
    # spacing ≥ 1, so the rounded indices are distinct
    return [windows[i] for i in np.linspace(0, len(windows) - 1, count).round().astype(np.int64)]


def window_documents(split: TokenizedSplit, windows: list[tuple[int, int]]) -> int:
    """How many documents of ``split`` the windows ``(start, length)`` come from."""
    starts = np.array([start for start, _ in windows], dtype=np.int64)
    return len(np.unique(np.searchsorted(split.offsets, starts, side="right") - 1))


def loader_throughput(sampler: WindowSampler, n_batches: int = 50, *, first_step: int = 0) -> float:
    """Input tokens per second that ``sampler`` delivers (batches built on this process's CPU),
    to compare with the training throughput."""
    _check_positive("n_batches", n_batches)
    sampler.batch(first_step)  # warm: the epoch plan and the memmap pages
    started = time.perf_counter()
    for step in range(first_step, first_step + n_batches):
        sampler.batch(step)
    elapsed = time.perf_counter() - started
    return n_batches * sampler.batch_size * sampler.seq_len / max(elapsed, 1e-9)


__all__ = ["IGNORE_INDEX", "Batch", "WindowSampler", "eval_batches", "eval_windows", "loader_throughput",
           "spread_windows", "window_documents"]
