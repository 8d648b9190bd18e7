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

One module per part of it: :mod:`.settings` (the task and backend names, the default scope and the
position buckets; no torch, so the command line checks its options without the model code),
:mod:`.splits`, :mod:`.loss`, :mod:`.tasks` and :mod:`.scoring`. Every name is importable from
``kernelmix.evaluate`` as before; a submodule is imported when one of its names is first used.
"""

from __future__ import annotations

from ..lazy import lazy_names

MODULES = {
    "settings": ["BACKENDS", "DEFAULT_DOC_TOKENS", "DEFAULT_MAX_DOCS", "TASKS", "check_backend", "default_buckets",
                 "parse_buckets"],
    "splits": ["EvalScope", "cap_split", "predicted_tokens", "scope_split", "split_from_texts", "text_split"],
    "loss": ["LOGITS_BUDGET_BYTES", "BucketLoss", "LossReport", "TokenLosses", "auto_batch_size", "check_lengths",
             "evaluate_loss", "evaluate_windows", "loss_batches", "ngram_losses", "sum_token_losses", "token_nll"],
    "tasks": ["build_cloze_task", "build_continuation_task", "build_tasks"],
    "scoring": ["lm_eval_model", "loglikelihoods", "score_tasks", "score_with_lm_eval", "task_requests",
                "write_lm_eval_tasks"],
}
__getattr__, __dir__ = lazy_names(__name__, MODULES)
__all__ = sorted(name for names in MODULES.values() for name in names)
