"""Multi-query associative recall (MQAR): synthetic sequences that test whether a mixer can look
a value up by its key, generated on the fly (Arora et al. 2023, "Zoology: Measuring and improving
recall in efficient language models"; our own code).

    g = torch.Generator().manual_seed(0)
    input_ids, labels = mqar_batch(vocab_size=256, seq_len=128, num_pairs=8, batch=32, generator=g)
    loss = model(input_ids, labels=labels).loss        # labels: -100 except the queried values
    correct, total = query_accuracy(model(input_ids).logits, labels)

One sequence of length T with N pairs::

    k1 v1 k2 v2 … kN vN | _ _ k3 v3 _ _ _ _ k1 v1 … _
    └── the N pairs ───┘ └── the query region: keys asked again, each followed by its value ──┘

- The vocabulary is split in three: token 0 is the filler ``_`` of the query region, keys are
  drawn from ``[1, 1 + (V - 1) // 2)`` and values from the rest, so a key and a value are never
  the same token (the model cannot answer by copying the query).
- The N keys of a sequence are distinct (a key has one value); values are drawn independently and
  may repeat.
- The query region is cut into two-token slots. ``num_queries`` of them (default N) are chosen
  without replacement with probability ∝ (slot + 1)^(power_a − 1), a power law that puts most
  queries near the pairs and some far away (Zoology's placement; ``power_a=1`` is uniform). Each
  query asks a pair drawn uniformly, with replacement: were every key asked exactly once, the last
  queries could be answered by elimination (the one value not asked yet) without recalling anything.
- ``labels`` are -100 everywhere except at the value after each query key, which holds that value:
  the model (which predicts token t + 1 from position t, as :class:`~kernelmix.model.CausalLM`'s
  loss does) is scored on recalling it and on nothing else. The values in the pairs themselves are
  not scored: nothing before them says what they are.

Everything comes from ``generator``: the same generator state gives the same batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import KernelmixError, check_positive_int
from .sampling import IGNORE_INDEX

FILLER = 0  # the token of the query region's empty slots
POWER_A = 0.01  # Zoology's default exponent for the query placement


def key_range(vocab_size: int) -> range:
    """The token ids keys are drawn from."""
    return range(1, 1 + (vocab_size - 1) // 2)


def value_range(vocab_size: int) -> range:
    """The token ids values are drawn from (after the keys: the two never overlap)."""
    return range(1 + (vocab_size - 1) // 2, vocab_size)


def check_mqar(vocab_size: Any, seq_len: Any, num_pairs: Any, batch: Any = 1, power_a: Any = POWER_A,
               num_queries: Any = None) -> None:
    """A KernelmixError naming the problem and the fix when these sizes cannot make an MQAR batch."""
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("num_pairs", num_pairs), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KernelmixError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not 0 < power_a <= 1:
        raise KernelmixError(f"power_a (the query placement's exponent) must be a number in (0, 1], got {power_a!r}; "
                             f"use {POWER_A} (Zoology's) or 1 (uniform)")
    if vocab_size < 3:
        raise KernelmixError(f"vocab_size {vocab_size} leaves no room for a filler, keys and values; use at least 3")
    keys = len(key_range(vocab_size))
    if num_pairs > keys:
        raise KernelmixError(
            f"{num_pairs} pairs need {num_pairs} distinct keys but vocab_size {vocab_size} has {keys} key tokens "
            f"(ids 1..{keys}); use at most {keys} pairs or a vocab_size of at least {2 * num_pairs + 1}")
    if seq_len < 4 * num_pairs:
        raise KernelmixError(
            f"seq_len {seq_len} is too short for {num_pairs} pairs: the pairs take {2 * num_pairs} tokens and their "
            f"{num_pairs} queries (key + value) as many again; use seq_len >= {4 * num_pairs} or at most "
            f"{seq_len // 4} pairs")
    slots = (seq_len - 2 * num_pairs) // 2
    if num_queries is not None:
        check_positive_int("num_queries (or None: one per pair)", num_queries)
        if num_queries > slots:
            raise KernelmixError(
                f"num_queries {num_queries} is more queries than the {slots} slots that seq_len {seq_len} leaves after "
                f"{num_pairs} pairs (two tokens each); ask at most {slots} or use seq_len >= "
                f"{2 * num_pairs + 2 * num_queries}")


def mqar_batch(vocab_size: int, seq_len: int, num_pairs: int, batch: int, generator: torch.Generator, *,
               power_a: float = POWER_A, num_queries: int | None = None) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)``, both ``[batch, seq_len]`` int64 on the CPU: ``batch`` MQAR sequences
    of ``num_pairs`` key–value pairs, then ``num_queries`` (default ``num_pairs``) of their keys asked
    again, each followed by its value (see the module docstring).
    ``labels`` are -100 except at the value after each query. Sizes that do not fit (too many pairs
    for the length or the key vocabulary) raise a KernelmixError naming the fix."""
    check_mqar(vocab_size, seq_len, num_pairs, batch, power_a, num_queries)
    if not isinstance(generator, torch.Generator):
        raise KernelmixError(f"generator must be a torch.Generator, got {type(generator).__name__}; "
                             "pass torch.Generator().manual_seed(seed)")
    keys_from, values_from = key_range(vocab_size), value_range(vocab_size)
    # N distinct keys per row: the first N of a random permutation of the key tokens
    order = torch.rand(batch, len(keys_from), generator=generator).argsort(dim=1)
    keys = order[:, :num_pairs] + keys_from.start
    values = torch.randint(values_from.start, values_from.stop, (batch, num_pairs), generator=generator)

    slots = (seq_len - 2 * num_pairs) // 2
    weights = torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    queries = num_pairs if num_queries is None else num_queries
    chosen = torch.multinomial(weights.expand(batch, slots), queries, replacement=False, generator=generator)
    # each query asks a pair drawn with replacement: were every key asked once, the last queries could
    # be answered by elimination (the one value not asked yet) without any recall
    asked = torch.randint(0, num_pairs, (batch, queries), generator=generator)

    input_ids = torch.full((batch, seq_len), FILLER, dtype=torch.long)
    pair_index = torch.arange(num_pairs)
    input_ids[:, 2 * pair_index] = keys
    input_ids[:, 2 * pair_index + 1] = values
    key_at = 2 * num_pairs + 2 * chosen  # where each query's key goes
    input_ids.scatter_(1, key_at, keys.gather(1, asked))
    input_ids.scatter_(1, key_at + 1, values.gather(1, asked))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels.scatter_(1, key_at + 1, values.gather(1, asked))
    return input_ids, labels


def query_accuracy(predictions: Tensor, labels: Tensor) -> tuple[int, int]:
    """``(correct, total)`` over the scored positions of ``labels`` (those not -100) only.
    ``predictions``: logits ``[B, T, V]`` (their argmax is taken) or predicted ids ``[B, T]``; the
    prediction at position t is for the token at t + 1, as in the model's loss."""
    if not isinstance(predictions, Tensor) or not isinstance(labels, Tensor) or labels.dim() != 2:
        raise KernelmixError("query_accuracy takes tensors: "
                             "logits [B, T, V] or predicted ids [B, T], and labels [B, T]")
    if predictions.dim() == 3:
        predictions = predictions.argmax(dim=-1)
    if predictions.shape != labels.shape:
        raise KernelmixError(f"predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} differ in "
                             "shape; pass the model's logits for the same input_ids the labels belong to")
    target = labels[:, 1:]
    scored = target != IGNORE_INDEX
    correct = (predictions[:, :-1] == target) & scored
    return int(correct.sum()), int(scored.sum())


__all__ = ["FILLER", "POWER_A", "check_mqar", "key_range", "mqar_batch", "query_accuracy", "value_range"]
