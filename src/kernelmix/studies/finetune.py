"""The finetuning study: exact softmax, Performer and DARKFormer (and the experimental Cubit
conversion) finetuned with the same data, steps, m and seed, at one or several learning rates.

The softmax variant (the host, unconverted) is finetuned with the same mode, layers and budget:
finetuning on the text also adapts any model to its domain, so the honest ceiling for a converted
model is the host finetuned the same way, not the host as it was. Both are reported. Several
learning rates make the learning-rate sweep of the stability claim (spikes per run).

Interruption: :func:`compare_finetune` keeps each finished run's result in ``out_dir`` and skips it
on the next call; an interrupted run (SIGINT/SIGTERM save its step) continues from its last
checkpoint, exactly. ``out_dir`` has one writer at a time (:func:`kernelmix.locks.run_directory_lock`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import Tensor

from ..errors import Interrupted
from ..locks import run_directory_lock
from ..output import pyplot, write_json_atomic
from ..pretrained.convert import INITS, ConversionConfig, convert
from ..pretrained.finetune import FinetuneConfig, finetune
from ..training.checkpoint import writing
from ..training.signals import catch_stop_signals, signal_name
from ..training.spikes import find_spikes
from .finetune_settings import DEFAULT_VARIANTS, VARIANTS  # torch-free: exported here as before
from .report_files import plot_if_installed, write_json_and_markdown


def build_variant(host, variant: str, *, num_features: int, layers: Any, init: str, calibration: Tensor | None,
                  seed: int = 0, distill_steps: int = 100, log: Callable | None = None):
    """A fresh copy of ``host`` as ``variant``: ``softmax`` (unchanged), ``performer`` or
    ``darkformer`` (converted with ``init``; the same W draw for both at equal m and seed), or the
    experimental ``cubit`` conversion (global layers only)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (choose from: {', '.join(VARIANTS)})")
    model = copy.deepcopy(host)
    if variant == "softmax":
        return model
    # features alone, as the study reports
    config = ConversionConfig(mixer=variant, layers=layers, num_features=num_features, seed=seed, window=0, sinks=0)
    use_init = init if variant == "darkformer" else "identity"
    return convert(model, config, calibration=calibration if use_init != "identity" else None, init=use_init,
                      steps=distill_steps, log=log)


def compare_finetune(
    host,
    train_windows: Tensor,
    val_windows: Tensor,
    config: FinetuneConfig,
    *,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    lrs: Sequence[float] | None = None,
    num_features: int = 64,
    layers: Any = "all",
    init: str = "whiten",
    calib_windows: int = 2,
    distill_steps: int = 100,
    out_dir: str | Path | None = None,
    progress: bool | None = False,
    log: Callable | None = None,
) -> dict:
    """Finetune every variant at every learning rate with the same data, steps, m and seed.
    Returns (and writes to ``out_dir``: ``finetune.json``, ``finetune.md``, PNG plots) the results.
    Finished runs found in ``out_dir`` are reused; ``out_dir`` is locked against a second writer
    meanwhile. SIGINT/SIGTERM: the run in progress saves its step (or, between runs, the finished
    run its result) and :class:`kernelmix.errors.Interrupted` says to run the same command again."""
    say = log or (lambda msg: None)
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r} (choose from: {', '.join(VARIANTS)})")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r} (choose from: {', '.join(INITS)})")
    lrs = list(lrs) if lrs else [config.lr]
    out = Path(out_dir) if out_dir is not None else None
    plan = [(variant, lr) for variant in variants for lr in lrs]
    runs = []
    t_all = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if out is not None:
            with writing(out, "create the output directory"):
                stack.enter_context(run_directory_lock(out, "kernelmix finetune"))
        signals = stack.enter_context(catch_stop_signals())
        for index, (variant, lr) in enumerate(plan, start=1):
            run_dir = out / "runs" / f"{variant}-lr{lr:g}" if out is not None else None
            saved = _finished_run(run_dir, config)
            if saved is not None:
                runs.append(saved)
                say(f"{variant}-lr{lr:g}: reusing the finished run in {run_dir}")
                continue
            runs.append(_run_variant(host, train_windows, val_windows, dataclasses.replace(config, lr=lr), variant,
                                     run_dir, num_features=num_features, layers=layers, init=init,
                                     calib_windows=calib_windows, distill_steps=distill_steps, progress=progress,
                                     log=log, say=say))
            if signals.received is not None and index < len(plan):
                raise Interrupted(f"finetuning interrupted by {signal_name(signals.received)} after {index} of "
                                  f"{len(plan)} runs (each one saved); run the same command again to continue",
                                  signals.received)
        report = {
            "format": "kernelmix-finetune-1",
            "settings": {"finetune": asdict(config), "variants": list(variants), "lrs": lrs,
                         "num_features": num_features, "layers": layers, "init": init, "calib_windows": calib_windows,
                         "train_windows": int(train_windows.shape[0]), "val_windows": int(val_windows.shape[0]),
                         "val_tokens": int(val_windows.shape[0] * (val_windows.shape[1] - 1))},
            "runs": runs,
            "wall_s": time.perf_counter() - t_all,
        }
        if out is not None:
            write_report(report, out)
    return report


def _finished_run(run_dir: Path | None, config: FinetuneConfig) -> dict | None:
    """The saved result of a finished run in ``run_dir`` (None: not finished), its spikes recounted."""
    done_file = run_dir / "result.json" if run_dir is not None else None
    if done_file is None or not done_file.is_file():
        return None
    saved = json.loads(done_file.read_text())
    # spikes are a function of the logged losses: recount with the current rule
    by_loss = find_spikes(saved["losses"], window=config.spike_window, nats=config.spike_nats)
    by_gradient = [sp for sp in saved["spikes"] if sp.get("gradient")]
    steps = {sp["step"] for sp in by_loss}
    saved["spikes"] = sorted(by_loss + [sp for sp in by_gradient if sp["step"] not in steps], key=lambda sp: sp["step"])
    saved["num_spikes"] = len(saved["spikes"])
    return saved


def _run_variant(host, train_windows: Tensor, val_windows: Tensor, run_config: FinetuneConfig, variant: str,
                 run_dir: Path | None, *, num_features: int, layers: Any, init: str, calib_windows: int,
                 distill_steps: int, progress, log, say) -> dict:
    """Convert, finetune and record one (variant, lr) run; an interruption says how to continue."""
    name = f"{variant}-lr{run_config.lr:g}"
    t = time.perf_counter()
    model = build_variant(host, variant, num_features=num_features, layers=layers, init=init,
                          calibration=train_windows[:calib_windows], seed=run_config.seed, distill_steps=distill_steps,
                          log=log)
    setup_s = time.perf_counter() - t
    resume = run_dir is not None and (run_dir / "checkpoints").is_dir()
    try:
        model, result = finetune(model, train_windows, val_windows, run_config, layers=layers, out_dir=run_dir,
                                 resume=resume, progress=progress, label=name)
    except Interrupted as stop:  # the step is saved (when there is a run directory)
        where = "its step is saved" if run_dir is not None else "nothing is saved (no output directory)"
        raise Interrupted(f"finetuning interrupted by {signal_name(stop.signal_number)} during {name}: {where}; run "
                          "the same command again to continue (finished runs are reused, this one resumes)",
                          stop.signal_number) from None
    result.update({"variant": variant, "lr": run_config.lr,
                   "num_features": num_features if variant in ("performer", "darkformer") else None,
                   "init": None if variant == "softmax" else (init if variant == "darkformer" else "identity"),
                   "setup_s": setup_s})
    say(f"{name}: val loss {result['initial']['loss']:.3f} → {result['final']['loss']:.3f}, "
        f"acc {result['final']['accuracy']:.3f}, {result['num_spikes']} spikes, {result['train_s']:.0f} s")
    if run_dir is not None:
        with writing(run_dir / "result.json"):
            write_json_atomic(run_dir / "result.json", result, indent=1)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the run is done; its result is kept
    return result


# ---------------------------------------------------------------------------------------------
# Output


def markdown(report: dict) -> str:
    s = report["settings"]
    f = s["finetune"]
    lines = [
        f"Finetuning ({f['mode']}, {f['steps']} steps × {f['batch_size']} × {f['seq_len']} tokens, warmup "
        f"{f['warmup_steps']}, cosine to {f['min_lr_ratio']}·lr, seed {f['seed']}); m = {s['num_features']}, layers "
        f"{s['layers']}, DARKFormer init {s['init']}; validation {s['val_windows']} held-out windows "
        f"({s['val_tokens']} predicted tokens). Spike: loss > median of the previous {f['spike_window']} + "
        f"max({f['spike_nats']} nats, 4σ), σ = 1.4826·MAD of those losses (batch noise), or not finite.",
        "",
        "| variant | lr | val loss before | val loss after | val acc after | spikes | diverged | "
        "trainable params | train s | tok/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['variant']} | {r['lr']:g} | {r['initial']['loss']:.3f} | {r['final']['loss']:.3f} | "
            f"{r['final']['accuracy']:.3f} | {r['num_spikes']} | {'yes' if r['diverged'] else 'no'} | "
            f"{r['trainable_parameters']:,} | {r['train_s']:.0f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path, *, plots: bool = True) -> Path:
    out = Path(out_dir)
    with writing(out):
        write_json_and_markdown(out, "finetune", report, markdown(report))
    if plots:
        plot_if_installed(_plots, report, out)
    return out


def _smooth(values: Sequence[float], width: int = 10) -> list[float]:
    finite = [v if math.isfinite(v) else float("nan") for v in values]
    out = []
    for i in range(len(finite)):
        window = [v for v in finite[max(0, i - width + 1): i + 1] if v == v]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def _plots(report: dict, out: Path) -> None:
    plt = pyplot()

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for r in report["runs"]:
        label = f"{r['variant']} lr {r['lr']:g}"
        ax_train.plot(range(1, len(r["losses"]) + 1), _smooth(r["losses"]), label=label)
        ax_val.plot([e["step"] for e in r["evals"]], [e["loss"] for e in r["evals"]], marker="o", label=label)
    ax_train.set(xlabel="step", ylabel="train loss (10-step mean)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss (nats/token)", title="held-out loss")
    ax_val.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "finetune_curves.png", dpi=120)
    plt.close(fig)


__all__ = ["DEFAULT_VARIANTS", "VARIANTS", "build_variant", "compare_finetune", "markdown", "write_report"]
