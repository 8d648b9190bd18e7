"""Scoring zero-shot tasks: our own log-likelihoods (:func:`loglikelihoods`, no network) or the
same tasks through lm-evaluation-harness, offline (``backend="lm-eval"``, ``pip install "kernelmix[eval]"``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import KernelmixError
from ..model import CausalLM
from .settings import BACKENDS, TASKS


@torch.no_grad()
def loglikelihoods(
    model: CausalLM, tokenizer, requests: Sequence[tuple[str, str]], *, batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """For each ``(context, continuation)``: the summed log-probability of the continuation's
    tokens given the context, and whether every one of them is the model's greedy choice (the
    pair lm-eval's ``loglikelihood`` returns). Context and continuation are tokenized separately
    and concatenated; a context too long for ``max_seq_len`` loses its oldest tokens.

    Args:
        model: a model with ``config.max_seq_len`` that takes ``input_ids`` and ``attention_mask`` and
            returns ``logits`` (a :class:`~kernelmix.model.CausalLM`); run in eval mode, its mode restored after.
        tokenizer: anything with ``encode(text) -> list[int]``.
        requests: ``(context, continuation)`` text pairs; either one encoding to no token is a ValueError.
        batch_size: requests per forward (longest first, right-padded).
        progress: ``progress(n)`` is called after each batch with the ``n`` requests it scored.

    Returns:
        ``(log-likelihood, greedy)`` per request, in the order of ``requests``."""
    device = next(model.parameters()).device
    limit = model.config.max_seq_len
    encoded = []
    for context, continuation in requests:
        ctx, cont = tokenizer.encode(context), tokenizer.encode(continuation)
        if not cont:
            raise ValueError(f"empty continuation after {context[-40:]!r}: nothing to score")
        if not ctx:
            raise ValueError(f"empty context before {continuation[:40]!r}: "
                             "the model has no start token to condition on")
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
    the total of :func:`score_tasks`'s progress.

    Args:
        tasks: built tasks by name (:func:`build_tasks`).

    Returns:
        The number of requests."""
    return sum(len(item.get("choices", [None])) for items in tasks.values() for item in items)


def score_tasks(
    model: CausalLM, tokenizer, tasks: dict[str, list[dict[str, Any]]], *, batch_size: int = 8,
    backend: str = "builtin", task_dir: str | Path | None = None, progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Accuracy (and more) per task: ``continuation`` → ``acc``, ``acc_norm``, ``items``;
    ``cloze`` → ``acc`` (target = greedy continuation), ``perplexity`` (lm-eval's, per target word),
    ``token_perplexity`` (per target token)... Task names and the backend are checked before anything
    is scored.

    Args:
        model: the model (:func:`loglikelihoods`).
        tokenizer: its tokenizer.
        tasks: built tasks by name (:func:`build_tasks`).
        batch_size: requests per forward.
        backend: ``"builtin"`` (:func:`loglikelihoods`) or ``"lm-eval"``: scores through
            lm-evaluation-harness with task files written to ``task_dir``.
        task_dir: the lm-eval backend's task files (a temporary directory if None); unused by builtin.
        progress: ``progress(n)``: after each batch, with the ``n`` requests it scored
            (:func:`task_requests` in all).

    Returns:
        ``{task: {metric: value}}``. Builtin: continuation ``acc``, ``acc_norm``, ``items``, ``chance``;
        cloze ``acc``, ``items``, ``perplexity``, ``token_perplexity``. lm-eval: what
        :func:`score_with_lm_eval` returns."""
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

    Args:
        tasks: built tasks by name, ``continuation`` or ``cloze`` (another name is a ValueError).
        task_dir: the directory to write in (created if needed).

    Returns:
        The YAML paths by task name."""
    unknown = [name for name in tasks if name not in TASKS]
    if unknown:  # before anything is written: a refused call leaves no stray files
        raise ValueError(f"unknown task {unknown[0]!r} (choose from: {', '.join(TASKS)})")
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
        else:  # cloze
            lines += ["output_type: loglikelihood", 'doc_to_target: "{{target}}"',
                      "metric_list:", *_metric("perplexity", "perplexity", False), *_metric("acc", "mean", True)]
        lines += ["metadata:", "  version: 1.0"]
        path = task_dir / f"kernelmix_{name}.yaml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written[name] = path
    return written


def _metric(name: str, aggregation: str, higher_is_better: bool) -> list[str]:
    return [f"  - metric: {name}", f"    aggregation: {aggregation}",
            f"    higher_is_better: {str(higher_is_better).lower()}"]


def lm_eval_model(model: CausalLM, tokenizer, *, batch_size: int = 8, progress: Callable[[int], None] | None = None):
    """An ``lm_eval.api.model.LM`` for ``model``: loglikelihood through :func:`loglikelihoods`
    (our tokenizer; ``progress`` as there); rolling loglikelihood and generation are not provided.

    Args:
        model: the model to score.
        tokenizer: its tokenizer.
        batch_size: requests per forward.
        progress: as in :func:`loglikelihoods`.

    Returns:
        The ``LM`` instance. ImportError when lm-evaluation-harness is not installed."""
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
    ``progress`` as in :func:`loglikelihoods`. Sets ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE``
    to 1 in this process's environment.

    Args:
        model: the model to score.
        tokenizer: its tokenizer.
        tasks: built tasks by name (:func:`build_tasks`).
        batch_size: requests per forward.
        task_dir: where the task files are written and kept (None: a temporary directory, removed after).
        progress: as in :func:`loglikelihoods`.

    Returns:
        ``{task: {metric: value}}``: the metrics lm-eval reports (continuation ``acc``, ``acc_norm``;
        cloze ``perplexity``, ``acc``; no stderr) and ``items``."""
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
