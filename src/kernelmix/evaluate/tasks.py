"""Zero-shot tasks built from the held-out documents of a split, deterministically from a seed:
``continuation`` (multiple choice) and ``cloze`` (the last word of a line)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..data import TokenizedSplit
from .settings import TASKS


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
    (split, tokenizer, arguments).

    Args:
        split: the held-out documents.
        tokenizer: encodes and decodes; a span is used only if its text encodes back to the same ids.
        items: the number of items (fewer possible is a ValueError).
        context_tokens: tokens of context per item.
        span_tokens: tokens of each choice.
        num_choices: choices per item, ≥ 2.
        seed: the draw of documents, positions and the true choice's place.

    Returns:
        ``items`` dicts: ``id`` (0, 1, ...), ``doc`` (the document's name), ``context`` and ``choices``
        (texts) and ``label`` (the index of the true continuation in ``choices``)."""
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
            f"≥ {context_tokens + span_tokens} tokens and another of ≥ {span_tokens}; "
            "use shorter context_tokens/span_tokens"
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
        out.append({"id": len(out), "doc": _doc_name(split, doc), "context": context, "choices": choices,
                    "label": label})
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
    Deterministic in (split, tokenizer, arguments).

    Args:
        split: the held-out documents.
        tokenizer: decodes the documents and encodes the contexts.
        items: the number of items, drawn without replacement from the candidate lines (fewer is a ValueError).
        context_tokens: the most tokens of context (the last ones before the word).
        seed: the draw of the lines.
        min_context_chars: a word is a candidate only after at least this many characters of its document.

    Returns:
        ``items`` dicts: ``id``, ``doc`` (the document's name), ``context`` (text) and ``target`` (the word),
        in document order."""
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
        out.append({"id": len(out), "doc": _doc_name(split, doc), "context": tokenizer.decode(prefix_ids),
                    "target": word})
    return out


def _doc_name(split: TokenizedSplit, doc: int) -> str:
    return split.doc_names[doc] if doc < len(split.doc_names) else f"doc{doc}"


def build_tasks(
    split: TokenizedSplit, tokenizer, *, tasks: Sequence[str] = TASKS, items: int = 100, context_tokens: int = 256,
    span_tokens: int = 32, num_choices: int = 4, seed: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """The named zero-shot tasks (``continuation``, ``cloze``) built from ``split``.

    Args:
        split: the held-out documents.
        tokenizer: the model's tokenizer.
        tasks: task names from :data:`TASKS` (another, or none, is a ValueError).
        items, context_tokens, seed: for every task (:func:`build_continuation_task`, :func:`build_cloze_task`).
        span_tokens, num_choices: for ``continuation`` only.

    Returns:
        ``{task name: items}``."""
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
