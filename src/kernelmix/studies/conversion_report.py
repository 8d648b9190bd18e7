"""``kernelmix report conversion``: how close a converted pretrained model stays to its host.

One command, resumable: Gemma 3 270M (by default) converted with a window of exact softmax, sinks
and features beyond them, on the ``global`` (3 of 18) or ``all`` layers, for each variant:

* ``window`` — the window and sinks alone, the features dropped: what they give by themselves;
* ``performer`` — Performer features (M = I), untrained;
* ``whiten`` — DARKFormer with the function-preserving whitened M, untrained;
* ``darkformer`` — DARKFormer after attention transfer (from the whitened M, :mod:`kernelmix.pretrained.transfer`);
* ``hedgehog`` — LoLCATs' learned feature map after the same transfer;

each measured as it is (stage ``none`` or ``transfer``) and after a short LoRA finetuning (stage
``lora``): the held-out loss (nats/token on documents no calibration or finetuning saw) and the
per-layer attention error on held-out text. Then decoding: the cache's bytes and the time per token
of the host and of the converted global-layer model at 1k, 8k and 32k tokens of context.

Text: the corpus split by document (``val_fraction`` held out, ``seed``): calibration (transfer) and
finetuning windows come from the training documents only, held-out loss and attention errors from
the held-out ones. Finished rows, transfers and finetuning runs are kept in the work directory and
reused when the same settings run again; an interrupted transfer or finetuning run continues.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ..data import load_corpus, split_texts, text_windows
from ..data.windows import WINDOW_RULE
from ..errors import KernelmixError
from ..evaluate import evaluate_windows
from ..locks import run_directory_lock
from ..output import write_json_atomic, write_text_atomic
from ..pretrained import ConversionConfig, FinetuneConfig, convert, finetune, kernels, load_pretrained, set_num_features
from ..pretrained.calibration import capture
from ..pretrained.logit_distill import DistillConfig, distill
from ..pretrained.transfer import TransferConfig, layer_pieces, relative_error, transfer
from .conversion_decode import decode_costs
from .conversion_markdown import plot_report, report_markdown
from .conversion_settings import (  # torch-free (what the command line reads): exported here as before
    LAYER_SETS, TRANSFERRED, VARIANTS, ConversionReportSettings,
)


def conversion_report(settings: ConversionReportSettings, out_dir: str | Path = "runs/conversion-report",
                      work_dir: str | Path | None = None, *, model=None, tokenizer=None, progress: bool = False,
                      log: Callable[[str], None] = print) -> dict:
    """Run the report (module docstring); writes ``results.json``, ``README.md`` and plots to
    ``out_dir``. ``model``/``tokenizer`` override ``settings.model`` (tests pass tiny ones)."""
    out = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else Path("runs") / "report-conversion"
    with contextlib.ExitStack() as stack:
        for directory in (out, work):
            directory.mkdir(parents=True, exist_ok=True)
            stack.enter_context(run_directory_lock(directory, "kernelmix report conversion"))
        return _report(settings, out, work, model, tokenizer, progress, log)


def _report(settings, out: Path, work: Path, model, tokenizer, progress, log) -> dict:
    started = time.perf_counter()
    if model is None:
        model, tokenizer = load_pretrained(settings.model)
    if tokenizer is None:
        raise KernelmixError(f"the report needs {settings.model}'s tokenizer to cut text windows")
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    train_texts, val_texts = split_texts(load_corpus(settings.text).documents(), settings.val_fraction, settings.seed)
    data = {
        "calibration": text_windows(tokenizer, train_texts, settings.calib_len, settings.calib_seqs),
        "finetune": text_windows(tokenizer, train_texts, settings.lora_seq_len),
        "held_out": text_windows(tokenizer, val_texts, settings.eval_len, settings.eval_seqs),
        "error": text_windows(tokenizer, val_texts, settings.error_len, 1),
    }
    _check_apart(data)
    key = {**asdict(settings), "window_rule": WINDOW_RULE}
    rows_file = work / "rows.json"
    done = _load_rows(rows_file, key)
    host_loss = _cached(done, "host", lambda: _loss(model, data["held_out"]), log)
    rows = []
    for layers in settings.layers:
        for variant in settings.variants:
            rows.extend(_variant_rows(settings, model, data, layers, variant, work, done, progress, log))
            write_json_atomic(rows_file, {"key": key, "rows": done})
    if "global" in settings.layers:
        for m in settings.feature_sweep:
            rows.extend(_variant_rows(settings, model, data, "global", "darkformer", work, done, progress, log,
                                      num_features=m))
            write_json_atomic(rows_file, {"key": key, "rows": done})
    if settings.layer_gaps and "global" in settings.layers and "darkformer" in settings.variants:
        _cached(done, "layer_gaps", lambda: _layer_gaps(settings, model, data, work, log), log)
        write_json_atomic(rows_file, {"key": key, "rows": done})
    if settings.estimator_check and "global" in settings.layers and "darkformer" in settings.variants:
        _cached(done, "estimator", lambda: _estimator_check(settings, model, data, work, log), log)
        write_json_atomic(rows_file, {"key": key, "rows": done})
    decode = _cached(done, "decode",
                     lambda: decode_costs(model, settings, _decode_model(settings, model, data, work, log)), log)
    write_json_atomic(rows_file, {"key": key, "rows": done})
    result = {"host_loss": host_loss, "rows": rows, "decode": decode, "settings": asdict(settings),
              "layer_gaps": done.get("layer_gaps"), "estimator": done.get("estimator"),
              "row_seconds": done.get("seconds", {}),
              "tokens": {name: int(x.numel()) for name, x in data.items()}, "machine": _machine(),
              "seconds": time.perf_counter() - started}
    write_json_atomic(out / "results.json", result)
    plot_report(result, out)
    write_text_atomic(out / "README.md", report_markdown(result))
    log(f"wrote {out / 'README.md'}")
    return result


def _check_apart(data: dict) -> None:
    """Calibration and finetuning windows share no window with the held-out ones (they are cut from
    disjoint documents; this checks it, and that there is text at all)."""
    held = {tuple(w.tolist()) for name in ("held_out", "error") for w in data[name]}
    for name in ("calibration", "finetune"):
        if data[name].numel() == 0:
            raise KernelmixError(f"no {name} text: give a corpus with more training documents")
        if any(tuple(w.tolist()) in held for w in data[name]):
            raise KernelmixError(f"{name} windows overlap the held-out windows: the corpus repeats documents; "
                                 "deduplicate it or choose another seed")


def _load_rows(path: Path, key: dict) -> dict:
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    return saved["rows"] if saved.get("key") == key else {}


def _cached(done: dict, name: str, compute, log):
    if name not in done:
        t = time.perf_counter()
        done[name] = compute()
        _timed(done, name, t)
        log(f"{name}: {done[name] if not isinstance(done[name], dict) else 'measured'} "
            f"({time.perf_counter() - t:.0f} s)")
    return done[name]


def _timed(done: dict, name: str, started: float) -> None:
    """Record how long ``name`` took when it was computed (reused rows keep it: the report's total)."""
    done.setdefault("seconds", {})[name] = time.perf_counter() - started


def _loss(model, windows) -> float:
    with torch.no_grad():
        return float(evaluate_windows(model, windows, batch_size=1)["loss"])


def _row_name(variant: str, settings, num_features: int | None) -> str:
    """The variant as the rows name it: ``darkformer m=256`` for a sweep row at another m."""
    return variant if num_features in (None, settings.num_features) else f"{variant} m={num_features}"


#: the settings each stage's result depends on (beyond its layers and variant): a stage's work directory
#: is named by them, so a run with other settings trains afresh instead of resuming another budget's run
_STAGE_INPUTS = {
    "transfer": ("model", "text", "val_fraction", "seed", "num_features", "window", "sinks", "calib_seqs", "calib_len",
                 "transfer_steps", "transfer_objective"),
    "distill": ("kl_steps", "kl_lr"),
    "lora": ("lora_steps", "lora_seq_len", "lora_lr"),
}


def _stage_dir(work: Path, stage: str, tag: str, settings, num_features=None) -> Path:
    """``work/<stage>-<tag>-<digest>``: the digest covers the settings this stage and the ones before it
    depend on (a LoRA run continues a distilled, transferred model)."""
    order = list(_STAGE_INPUTS)
    inputs = {k: getattr(settings, k) for s in order[:order.index(stage) + 1] for k in _STAGE_INPUTS[s]}
    inputs["num_features"] = num_features or settings.num_features
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=list).encode()).hexdigest()[:8]
    return work / f"{stage}-{tag}-{digest}"


def _converted(settings, host, data, layers: str, variant: str, work: Path, progress, log, num_features=None):
    """A fresh copy of ``host`` converted as ``variant`` (transferred for darkformer/hedgehog, then
    distilled on the host's logits with ``kl_steps``), at ``num_features`` (default: the settings' m)."""
    mixer = {"window": "window", "performer": "performer", "whiten": "darkformer", "darkformer": "darkformer",
             "hedgehog": "hedgehog"}[variant]
    config = ConversionConfig(mixer=mixer, layers=layers, num_features=num_features or settings.num_features,
                              window=settings.window, sinks=settings.sinks, seed=settings.seed)
    tag = f"{layers}-{_row_name(variant, settings, num_features).replace(' ', '-')}"
    init = "whiten" if variant in ("whiten", "darkformer") else "identity"
    calibration = data["calibration"][:2, :512] if init == "whiten" else None
    model = convert(copy.deepcopy(host), config, calibration=calibration, init=init)
    record = None
    if variant in TRANSFERRED:
        where = _stage_dir(work, "transfer", tag, settings, num_features)
        record = transfer(model, data["calibration"], TransferConfig(steps=settings.transfer_steps,
                                                                   objective=settings.transfer_objective),
                          out_dir=where, resume=(where / "transfer").is_dir(), progress=progress, log=None)
        if settings.kl_steps:
            where = _stage_dir(work, "distill", tag, settings, num_features)
            record["kl"] = distill(model, data["calibration"], DistillConfig(steps=settings.kl_steps, lr=settings.kl_lr,
                                                                             seed=settings.seed),
                                   out_dir=where, resume=(where / "distill").is_dir(), progress=progress)
    return model, record


def _variant_rows(settings, host, data, layers, variant, work, done, progress, log, num_features=None) -> list[dict]:
    first = "transfer" if variant in TRANSFERRED else "none"
    name = _row_name(variant, settings, num_features)
    lora = variant in settings.lora_variants and name == variant  # the m sweep measures the first stage only
    names = [f"{layers}/{name}/{first}"] + ([f"{layers}/{name}/lora"] if lora else [])
    if all(n in done for n in names):
        return [done[n] for n in names]
    started = time.perf_counter()
    model, record = _converted(settings, host, data, layers, variant, work, progress, log, num_features)
    if names[0] not in done:
        errors = _attention_errors(host, model, data["error"])
        done[names[0]] = {"layers": layers, "variant": name, "stage": first, "loss": _loss(model, data["held_out"]),
                          "attention_error": statistics.median(errors.values()),
                          "per_layer_error": {str(i): e for i, e in errors.items()},
                          "transfer": None if record is None else {i: {"first": v["first"], "last": v["last"]}
                                                                    for i, v in record["layers"].items()},
                          "kl": None if record is None or "kl" not in record else
                          {"first": record["kl"]["first"], "last": record["kl"]["last"]}}
        _timed(done, names[0], started)
        log(f"{names[0]}: loss {done[names[0]]['loss']:.3f}, "
            f"median attention error {done[names[0]]['attention_error']:.3f}")
    if len(names) > 1 and names[1] not in done:
        started = time.perf_counter()
        # LoLCATs' second stage: LoRA on q/k/v with the transferred kernels frozen (trained along at this
        # rate, DARKFormer's M diverged: 3.33 → 4.08 nats on the global layers)
        config = FinetuneConfig(mode="lora", steps=settings.lora_steps, seq_len=settings.lora_seq_len,
                                lr=settings.lora_lr, warmup_steps=2, eval_every=settings.lora_steps, eval_seqs=1,
                                seed=settings.seed, train_kernels=False)
        where = _stage_dir(work, "lora", f"{layers}-{variant}", settings)
        tuned, result = finetune(model, data["finetune"], data["held_out"][:1, :settings.lora_seq_len], config,
                                 out_dir=where, resume=(where / "checkpoints").is_dir(), progress=progress,
                                 label=f"lora {layers}/{variant}")
        done[names[1]] = {"layers": layers, "variant": name, "stage": "lora", "loss": _loss(tuned, data["held_out"]),
                          "attention_error": None, "lora_seconds": result.get("wall_s")}
        _timed(done, names[1], started)
        log(f"{names[1]}: loss {done[names[1]]['loss']:.3f}")
    return [done[n] for n in names]


def _attention_errors(host, model, windows) -> dict[int, float]:
    """Relative error of every converted layer against the host's exact attention, on the host's own
    q/k/v of held-out ``windows`` (pieces as in transfer: the sliding window for local layers)."""
    layers = list(kernels(model))
    captured = capture(model, windows, layers=layers)
    out = {}
    for i in layers:
        attn = model.model.layers[i].self_attn
        length = min(windows.shape[1], getattr(attn, "sliding_window", None) or windows.shape[1])
        pieces = layer_pieces(captured[i], length)
        with torch.no_grad():
            out[i] = sum(relative_error(kernels(model)[i], p).item() for p in pieces) / len(pieces)
    return out


def _layer_gaps(settings, host, data, work, log) -> dict[str, float]:
    """The held-out loss of the global-layer DARKFormer after transfer with only layer i converted
    (the other global layers back on the host's exact attention), for each converted layer i."""
    model, _ = _converted(settings, host, data, "global", "darkformer", work, False, log)
    converted = {i: model.model.layers[i].self_attn.kernelmix_rf for i in kernels(model)}
    losses = {}
    for only in converted:
        for i, kernel in converted.items():  # a layer without a kernel runs transformers' SDPA (the host's)
            if i == only:
                model.model.layers[i].self_attn.kernelmix_rf = kernel
            elif hasattr(model.model.layers[i].self_attn, "kernelmix_rf"):
                del model.model.layers[i].self_attn.kernelmix_rf
        losses[str(only)] = _loss(model, data["held_out"])
        log(f"layer gap: only layer {only} converted: loss {losses[str(only)]:.4f}")
    return losses


ESTIMATOR_SEEDS = (1, 2, 3)  # not the conversion's own seed (settings.seed, 0 by default)


def _estimator_check(settings, host, data, work, log) -> dict:
    """The global layers' held-out attention errors (by layer) with W redrawn at each m of
    ``settings.estimator_check``: for the transferred M (``redrawn``: one entry per seed of
    :data:`ESTIMATOR_SEEDS`; ``own``: the draw it was trained with) and for the whitened M, whose
    kernel is the host's own (``whitened``, seed 1). An estimator's error falls with m; a map fitted
    to its draw of W loses its fit on any other draw."""
    model, _ = _converted(settings, host, data, "global", "darkformer", work, False, log)
    def errors(converted) -> dict[str, float]:
        return {str(i): e for i, e in _attention_errors(host, converted, data["error"]).items()}

    result = {"own": errors(model), "redrawn": {}, "whitened": {}}
    whitened = convert(copy.deepcopy(host), ConversionConfig(mixer="darkformer", layers="global",
                                                             num_features=settings.num_features,
                                                             window=settings.window, sinks=settings.sinks,
                                                             seed=settings.seed),
                       calibration=data["calibration"][:2, :512], init="whiten")
    for m in (settings.num_features, *settings.estimator_check):
        result["redrawn"][str(m)] = []
        for seed in ESTIMATOR_SEEDS:
            set_num_features(model, m, seed=seed)
            result["redrawn"][str(m)].append(errors(model))
        set_num_features(whitened, m, seed=1)
        result["whitened"][str(m)] = errors(whitened)
        log(f"estimator check m={m}: redrawn {result['redrawn'][str(m)]}, whitened {result['whitened'][str(m)]}")
    return result


def _decode_model(settings, host, data, work, log):
    """The model whose decoding is measured: DARKFormer after transfer on the global layers (its
    transfer is reused from the rows when they ran it)."""
    model, _ = _converted(settings, host, data, "global", "darkformer", work, False, log)
    return model


def _machine() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}


__all__ = ["LAYER_SETS", "VARIANTS", "ConversionReportSettings", "conversion_report"]
