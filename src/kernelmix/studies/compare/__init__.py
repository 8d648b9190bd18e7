"""``kernelmix compare``: train every mixer the same way and compare them — the README's main job.

    from kernelmix.studies.compare import CompareConfig, run_compare
    summary = run_compare(CompareConfig(mixers=["softmax", "cubit"], lengths=[256, 512], steps=60))

For every (mixer, training length, seed) one run of :func:`kernelmix.training.train` with the
same preset, corpus, tokenizer, optimizer settings and **budget**. Every step sees
``tokens_per_step`` tokens at every length (``batch = tokens_per_step / length``); ``budget``
says what is equal between the mixers at one length:

* ``"tokens"`` (default): every run trains ``steps`` steps, the same tokens.
* ``"flops"``: every run gets the training FLOPs softmax spends on ``steps × tokens_per_step``
  tokens at that length (analytic counts, :mod:`kernelmix.studies.flops`, the ones ``kernelmix
  bench`` reports): ``round(those FLOPs / (its FLOPs per token × tokens_per_step))`` steps. A budget
  that rounds to no step for some mixer is refused (one step would exceed it, under either budget).
* ``"time"``: every run gets the same seconds of training on this machine: ``seconds``, or by
  default the seconds softmax takes for ``steps`` steps at that length. Each mixer's seconds per
  step are measured first (a calibration: ``calibration_steps`` timed steps after
  :data:`CALIBRATION_WARMUP` untimed ones, the median; kept in ``calibration.json`` so that the
  same command reuses them and its finished runs), and it trains ``round(seconds / its seconds
  per step)`` steps. Measured time is noisy (±10–30% on a shared machine), so the seconds the runs
  actually took are reported beside the target.

A run of other steps than ``steps`` scales its warmup to its own steps (the cosine decay always
ends at its last step). Whatever the budget, every run reports its tokens, training FLOPs and
training seconds. The seed sets the initial weights and the order of the training windows;
different mixers with the same seed see exactly the same training windows (a longer run sees
more of them).

Each finished run is evaluated on the same held-out tokens (the first ``max(lengths)`` tokens of
``eval_docs`` validation documents; :func:`kernelmix.evaluate.evaluate_loss`) at its training
length: loss, perplexity and loss by token position in the window.

Output (``out_dir``, default ``runs/compare/``)::

    results.json              settings, the budget, every run, the mean ± spread over seeds per (mixer, length)
    results.md                which budget was equal, the tables
    val_loss_vs_length.png    validation loss vs training length per mixer
    loss_curves.png           training loss vs tokens, one panel per length
    throughput.png            training tokens/s per mixer and length
    loss_by_position.png      validation loss by position bucket at the longest length
    calibration.json          --budget time: the measured seconds per step of each mixer and length
    runs/<mixer>-T<len>-s<seed>-<hash>/   each run's train() directory + result.json

Resumable: a run whose ``result.json`` exists for the same settings (the hash in its directory
name: the training settings, its steps, the evaluation and, unless it is tokens, the budget) is
reused; one that was interrupted after a checkpoint is resumed (bitwise on CPU); an interrupted
one without a checkpoint is started again. SIGINT (Ctrl-C) or SIGTERM during a run's training
finishes its step and checkpoints it; during its evaluation, the evaluation is finished and saved;
either way the compare stops with :class:`kernelmix.errors.Interrupted` and the same command
continues it. One writer at a time: ``out_dir`` is locked (:func:`kernelmix.locks.run_directory_lock`)
while a compare writes it.

Mixer names: every mixer of the registry (:mod:`kernelmix.layers.registry`) and its variants, e.g.
``cubit-nolrr`` (Cubit with ``mixer_options cubit.lrr=false``).

The study is a package, one module per part: :mod:`.settings` (:class:`CompareConfig` and the
constants; no torch, so the command line checks its options without it), :mod:`.budget`,
:mod:`.calibration` (the time budget's measured speeds), :mod:`.running` (the runs and the whole
comparison), :mod:`.report` (results.md) and :mod:`.plots`. Every name is importable from
``kernelmix.studies.compare`` as before; a submodule is imported when one of its names is first used.
"""

from __future__ import annotations

from ...lazy import lazy_names

MODULES = {
    "settings": ["BUDGETS", "CALIBRATION_WARMUP", "DEFAULT_MIXERS", "MIXER_VARIANTS", "REFERENCE_MIXER",
                 "CompareConfig"],
    "budget": ["BudgetPlan", "plan_budget"],
    "calibration": ["calibrate"],
    "running": ["run_compare", "run_one", "saved_result", "summarize", "with_costs"],
    "report": ["format_markdown", "_threads_text"],
    "plots": ["write_plots"],
}
__getattr__, __dir__ = lazy_names(__name__, MODULES)
__all__ = sorted(name for names in MODULES.values() for name in names if not name.startswith("_"))
