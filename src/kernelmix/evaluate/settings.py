"""What an evaluation may be asked for, without torch: the task and backend names, the default
scope of ``kernelmix eval`` and the position buckets (so that the command line checks an option's
value before it imports the model code)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import KernelmixError

TASKS = ("continuation", "cloze")
BACKENDS = ("builtin", "lm-eval")


# The default scope of `kernelmix eval`: the first 8 documents, 4,096 tokens of each — for the
# `small` preset on 2 CPU cores about 10 s at one length and a minute for four lengths plus the
# zero-shot tasks (measured in docs/evaluation.md), where a whole split takes minutes (over half an
# hour was seen on a busy machine).
DEFAULT_MAX_DOCS = 8
DEFAULT_DOC_TOKENS = 4096


def default_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[0, 64), [64, 256), [256, 1024), ... (×4), the last one ending at ``seq_len``.

    Args:
        seq_len: the context length T; the buckets cover the predicted tokens' indices 0..T-1.

    Returns:
        ``(start, end)`` pairs, end exclusive (a single ``(0, seq_len)`` when ``seq_len`` ≤ 64)."""
    edges = [0, 64]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 4)
    edges = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def parse_buckets(edges: Sequence[int] | str, seq_len: int) -> list[tuple[int, int]]:
    """Buckets from edges ``[0, 64, 256]`` (or ``"0,64,256"``); a last bucket up to ``seq_len``
    is added, and edges at or beyond ``seq_len`` are dropped.

    Args:
        edges: increasing bucket starts, the first 0: a sequence of ints or comma-separated text
            (anything else is a KernelmixError).
        seq_len: the context length T the last bucket ends at.

    Returns:
        ``(start, end)`` pairs, end exclusive."""
    if isinstance(edges, str):
        try:
            edges = [int(e) for e in edges.split(",") if e.strip()]
        except ValueError:
            raise KernelmixError(
                f"bucket edges must be comma-separated integers, e.g. 0,64,256; got {edges!r}") from None
    edges = list(edges)
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise KernelmixError(f"bucket edges must start at 0 and increase, e.g. [0, 64, 256]; got {edges}")
    kept = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(kept[:-1], kept[1:]))


def check_backend(backend: str) -> None:
    """``backend`` is one of :data:`BACKENDS` and can run here (lm-eval is installed); otherwise a
    :class:`~kernelmix.errors.KernelmixError` naming the fix. Cheap: call it before any evaluation.

    Args:
        backend: ``"builtin"`` or ``"lm-eval"``.

    Returns:
        None."""
    if backend not in BACKENDS:
        raise KernelmixError(f"unknown backend {backend!r} (choose from: {', '.join(BACKENDS)})")
    if backend == "lm-eval":
        try:
            import lm_eval  # noqa: F401  (the scoring imports it anyway)
        except ImportError:
            raise KernelmixError('the lm-eval backend needs lm-evaluation-harness: pip install "kernelmix[eval]" '
                                 "(or use the builtin backend)") from None
