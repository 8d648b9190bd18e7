"""``kernelmix report darkformer``: one command that reproduces the DARKFormer study on a real
pretrained model — kernel diagnostics of every layer (:mod:`kernelmix.studies.diagnose`) and a small
finetuning comparison of exact softmax, Performer and DARKFormer at equal m and budget with a
learning-rate sweep (:mod:`kernelmix.studies.finetune`) — and writes tables and plots under ``runs/darkformer-report/``
(features only, no window: the study of converted models with a window, sinks and attention transfer is
:mod:`.conversion_report`).

Sizes: the defaults fit about an hour on 2 CPU cores for Gemma 3 270M (18 layers, head dim 256);
``quick=True`` shrinks everything to a smoke run. Text: the document-level split of the corpus
(default ``shakespeare``): diagnostics and finetuning validation read only held-out documents;
finetuning and calibration read only training documents.

Work that is finished survives an interruption: the diagnostics JSON and each finished finetuning
run are kept in the work directory and reused when the command runs again with the same settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..data import load_corpus, split_texts, text_windows
from ..data.windows import WINDOW_RULE
from ..locks import run_directory_lock
from ..output import write_json_atomic, write_text_atomic
from ..pretrained import KNOWN_MODELS, FinetuneConfig, load_pretrained, prepare
from ..training.checkpoint import writing
from . import diagnose as dg
from . import finetune as ft
from .darkformer_settings import DarkformerReportSettings  # torch-free: exported here as before


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}


def darkformer_report(settings: DarkformerReportSettings, out_dir: str | Path = "runs/darkformer-report",
                      work_dir: str | Path | None = None, *, model=None, tokenizer=None, progress: bool | None = None,
                      log=print) -> dict:
    """Run the study and write ``out_dir``: ``README.md`` (the summary), ``diagnostics/`` and
    ``finetune/`` (JSON, markdown, PNG). ``model``/``tokenizer`` override loading ``settings.model``
    (tests pass tiny ones). Checkpoints and per-run state live in ``work_dir`` (default
    ``runs/report-darkformer``), never in ``out_dir``. Both are locked against a second writer
    while the report runs; SIGINT/SIGTERM during finetuning save the run in progress and raise
    :class:`kernelmix.errors.Interrupted` (the same command continues)."""
    out = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else Path("runs") / "report-darkformer"
    with contextlib.ExitStack() as stack:
        for directory in (out, work):  # one writer each (the same directory twice is fine: the lock is re-entrant)
            with writing(directory, "create the directory"):
                stack.enter_context(run_directory_lock(directory, "kernelmix report darkformer"))
        return _report(settings, out, work, model=model, tokenizer=tokenizer, progress=progress, log=log)


def _report(settings: DarkformerReportSettings, out: Path, work: Path, *, model, tokenizer, progress, log) -> dict:
    """:func:`darkformer_report` once both directories are locked."""
    say = log or (lambda msg: None)
    t_all = time.perf_counter()
    timings: dict[str, float] = {}
    if model is None:
        t = time.perf_counter()
        model, tokenizer = _load_model(settings.model, say)
        timings["load_s"] = time.perf_counter() - t
    train_texts, val_texts = split_texts(load_corpus(settings.text).documents(), settings.val_fraction, settings.seed)
    say(f"text {settings.text}: {len(train_texts)} training and {len(val_texts)} held-out documents")

    diagnostics = _diagnostics(settings, model, tokenizer, val_texts, work, progress, say)  # held-out documents only
    dg.write_report(diagnostics, out / "diagnostics")
    timings["diagnostics_s"] = diagnostics["timings"]["total_s"]

    t = time.perf_counter()
    finetuning = _finetuning(settings, model, tokenizer, train_texts, val_texts, work, progress, say)
    ft.write_report(finetuning, out / "finetune")
    timings["finetune_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_all

    summary = {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
               "machine": _machine(), "timings": timings,
               "diagnostics": {"summary": diagnostics["summary"], "end_to_end": diagnostics["end_to_end"]},
               "finetune": [{k: r[k] for k in ("variant", "lr", "initial", "final", "num_spikes", "diverged",
                                               "train_s")}
                            for r in finetuning["runs"]]}
    write_json_atomic(out / "summary.json", summary, indent=1)
    write_text_atomic(out / "README.md", _readme(summary, diagnostics, finetuning))
    say(f"wrote {out}/README.md, summary.json, diagnostics/ and finetune/ ({timings['total_s'] / 60:.1f} min)")
    return summary


def _load_model(name: str, say):
    """A known name (prepared on first use) or a local directory → ``(model, tokenizer)``."""
    path = prepare(name, progress=lambda msg: say(f"  prepare: {msg}")) if name in KNOWN_MODELS else name
    model, tokenizer = load_pretrained(path)
    if tokenizer is None:
        raise ValueError(f"{name} has no tokenizer files; the report needs one")
    return model, tokenizer


def _diagnostics(settings, model, tokenizer, val_texts, work: Path, progress, say) -> dict:
    """The diagnostics of the held-out documents, reused from ``work`` when its settings match."""
    diag_key = {k: v for k, v in asdict(settings).items()
                if k.startswith("diag_") or k in ("model", "text", "val_fraction", "seed")}
    diag_key["windows"] = WINDOW_RULE
    diag_file = work / "diagnostics.json"
    if diag_file.is_file():
        saved = json.loads(diag_file.read_text())
        if saved.get("report_key") == json.loads(json.dumps(diag_key)):
            say(f"diagnostics: reusing {diag_file}")
            return saved
    say(f"diagnostics of layers {settings.diag_layers} at m = {list(settings.diag_m)}")
    config = dg.DiagnoseConfig(layers=settings.diag_layers, m_values=list(settings.diag_m),
                               seq_len=settings.diag_seq_len, calib_seqs=2, eval_seqs=1, seeds=settings.diag_seeds,
                               distill_steps=settings.diag_distill_steps, distill_m=max(settings.diag_m[:3]),
                               e2e_m=list(settings.diag_e2e_m), seed=settings.seed)
    diagnostics = dg.diagnose(model, tokenizer, val_texts, None, config, progress=progress, log=lambda m: say(f"  {m}"))
    diagnostics["report_key"] = diag_key
    write_json_atomic(diag_file, diagnostics, indent=1)
    return diagnostics


def _finetuning(settings, model, tokenizer, train_texts, val_texts, work: Path, progress, say) -> dict:
    """The finetuning comparison and learning-rate sweep (finished runs in ``work`` are reused)."""
    config = FinetuneConfig(mode=settings.ft_mode, steps=settings.ft_steps, seq_len=settings.ft_seq_len,
                            lr=settings.ft_lrs[0], warmup_steps=max(1, settings.ft_steps // 10),
                            eval_every=settings.ft_eval_every, eval_seqs=settings.ft_eval_seqs, seed=settings.seed)
    train_w = text_windows(tokenizer, train_texts, config.seq_len)
    val_w = text_windows(tokenizer, val_texts, config.seq_len, config.eval_seqs)
    say(f"finetuning {list(settings.ft_variants)} × lr {list(settings.ft_lrs)}: {config.steps} steps of "
        f"{config.batch_size}×{config.seq_len} tokens each, m={settings.num_features}")
    return ft.compare_finetune(model, train_w, val_w, config, variants=settings.ft_variants, lrs=settings.ft_lrs,
                               num_features=settings.num_features, layers=settings.ft_layers, init=settings.init,
                               out_dir=work / ("finetune-" + _slug(config, settings)), progress=progress,
                               log=lambda m: say(f"  {m}"))


def _slug(config, settings) -> str:
    import hashlib

    key = json.dumps([asdict(config), settings.num_features, settings.ft_layers, settings.init, settings.model,
                      settings.text, settings.val_fraction, WINDOW_RULE], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def _readme(summary: dict, diagnostics: dict, finetuning: dict) -> str:
    s = summary["settings"]
    t = summary["timings"]
    m = summary["machine"]
    lines = [
        f"# DARKFormer report — {s['model']} on {s['text']}",
        "",
        f"Produced by `kernelmix report darkformer` in {t['total_s'] / 60:.1f} min on {m['cpu_count']} CPU cores "
        f"({m['threads']} torch threads, torch {m['torch']}). Diagnostics {t['diagnostics_s'] / 60:.1f} min "
        f"(as first measured; reused runs keep their time), finetuning {t['finetune_s'] / 60:.1f} min.",
        "",
        "## Kernel diagnostics",
        "",
        "Relative error of random-feature attention against exact softmax on held-out text (mean over the "
        "listed layers and their heads), as a function of m; `performer` = DARKFormer with M = I, `whiten` = the "
        "data-aware M from calibration statistics, `distill` = whitened then distilled per layer.",
        "",
    ]
    lines += [line.replace("## ", "### ", 1) if line.startswith("## ") else line
              for line in dg.markdown(diagnostics).split("\n", 2)[2].splitlines()]
    lines += ["", "![error vs m](diagnostics/error_vs_m.png)", "", "## Finetuning at equal m and budget", ""]
    lines += ft.markdown(finetuning).splitlines()
    lines += ["", "![finetuning curves](finetune/finetune_curves.png)", "",
              "## Findings (computed from the tables above)", ""]
    lines += [f"- {line}" for line in findings(diagnostics, finetuning)]
    return "\n".join(lines) + "\n"


def findings(diagnostics: dict, finetuning: dict) -> list[str]:
    """Plain statements read off the numbers (no judgement beyond the comparison itself)."""
    out = []
    summary = diagnostics["summary"]
    if "performer" in summary:
        for v in ("whiten", "distill"):
            if v not in summary:
                continue
            for m, e in summary[v].items():
                p = summary["performer"][m]["output"]
                out.append(f"m={m}: {v} output error {e['output']:.3g} vs Performer {p:.3g} "
                           f"({'lower' if e['output'] < p else 'not lower'}, ratio {e['output'] / p:.2f})")
    e2e = diagnostics["end_to_end"]
    zero = ", ".join(f"{v} m={m} {r['loss']:.2f}" for v in e2e if v != "host" for m, r in e2e[v].items())
    out.append(f"zero-shot held-out loss: host {e2e['host']['loss']:.2f}; converted (all diagnosed layers) {zero}")
    runs = finetuning["runs"]
    for lr in sorted({r["lr"] for r in runs}):
        at = {r["variant"]: r for r in runs if r["lr"] == lr}
        text = "; ".join(f"{v} {r['initial']['loss']:.2f} → {r['final']['loss']:.2f} ({r['num_spikes']} spikes"
                         f"{', diverged' if r['diverged'] else ''})" for v, r in at.items())
        out.append(f"finetuning at lr {lr:g}, validation loss before → after: {text}")
        if "performer" in at and "darkformer" in at:
            d, p = at["darkformer"]["final"]["loss"], at["performer"]["final"]["loss"]
            out.append(f"lr {lr:g}: DARKFormer ends {'below' if d < p else 'at or above'} Performer "
                       f"({d:.3f} vs {p:.3f}; one seed)")
    spikes = {v: sum(r["num_spikes"] for r in runs if r["variant"] == v) for v in {r["variant"] for r in runs}}
    out.append("loss spikes summed over the sweep: " + ", ".join(f"{v} {n}" for v, n in sorted(spikes.items())))
    return out


__all__ = ["DarkformerReportSettings", "darkformer_report", "findings"]
