"""Kernel diagnostics of a pretrained causal LM converted to random-feature attention.

:func:`diagnose` measures, per converted layer and head, on held-out real text:

* q/k anisotropy of the feature-space inputs (queries q·scaling·√d, post QK-norm and RoPE; keys):
  effective rank exp(H(λ/Σλ)) of the *uncentred* second moment (what enters the estimator's
  variance), the top-5 eigenvalue share, the condition number over the non-zero eigenvalues and the
  number of (numerically) zero directions;
* the relative error ‖o_RF − o‖/‖o‖ of the attention outputs, and of the attention weights on a
  subsample of query rows, against exact softmax attention on the same q/k/v (the host's mask,
  sliding windows included), as a function of m, averaged over draws of W, for
  ``performer`` (= DARKFormer with M = I, the ``identity`` initialisation, bit for bit),
  ``whiten`` (docs/math.md §7 data-aware M, F from calibration text) and ``distill`` (whiten, then
  per-layer attention-output distillation of M at ``distill_m`` features; evaluated with fresh W);
* the empirical variance of φ(q)·φ(k) over iid Gaussian W against the closed form of docs/math.md §6
  (1/m)·K²·(exp((x̃+ỹ)ᵀΣ(x̃+ỹ)) − 1) for sampled causal (q, k) pairs;
* the end-to-end next-token loss and accuracy of the converted model (all chosen layers) per
  variant and m, next to the host's.

Writes ``diagnostics.json``, ``diagnostics.md`` and PNG plots (matplotlib, ``kernelmix[plot]``)
into ``out_dir``. Calibration and held-out text are disjoint (the first ``calib_seqs`` windows
calibrate, the next ``eval_seqs`` are measured).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from .. import pretrained as cv
from ..data.windows import text_windows
from ..evaluate import evaluate_windows
from ..ops import data_aware_transform, random_feature_attention_masked, softmax_attention_masked
from ..output import progress_bar, pyplot
# torch-free (what the command line reads): exported here as before
from .diagnose_settings import VARIANTS, DiagnoseConfig
from .report_files import plot_if_installed, write_json_and_markdown


# ---------------------------------------------------------------------------------------------
# Pieces (testable on their own)


def anisotropy(samples: Tensor) -> list[dict]:
    """Per head of ``samples`` ``[N, H, d]``: eigen-statistics of the uncentred second moment."""
    x = samples.detach().double()
    second = torch.einsum("nhi,nhj->hij", x, x) / x.shape[0]
    evals = torch.linalg.eigvalsh(second).clamp_min(0).flip(-1)  # descending
    out = []
    for ev in evals:
        total = float(ev.sum())
        if total <= 0:
            out.append({"effective_rank": 0.0, "top5_share": float("nan"), "condition": float("nan"),
                        "zero_dims": len(ev)})
            continue
        p = ev / total
        nz = p[p > 0]
        entropy = float(-(nz * nz.log()).sum())
        floor = float(ev[0]) * 1e-10
        positive = ev[ev > floor]
        out.append({
            "effective_rank": math.exp(entropy),
            "top5_share": float(p[:5].sum()),
            "condition": float(positive[0] / positive[-1]),
            "zero_dims": int((ev <= floor).sum()),
        })
    return out


def _visible(c: cv.Captured) -> Tensor:
    batch, _, length_q, _ = c.query.shape
    length_k = c.key.shape[2]
    if c.mask is None:
        rows = torch.arange(length_q)[:, None] + (length_k - length_q)
        return (torch.arange(length_k)[None, :] <= rows).expand(batch, -1, -1)
    return cv.visible_from_mask(c.mask).expand(batch, -1, -1)


def per_head_rel_error(approx: Tensor, exact: Tensor, head_dim: int) -> list[float]:
    """‖a − e‖/‖e‖ per head; tensors ``[B, T, H, d]`` (head_dim = 2) or ``[B, H, T, L]`` (head_dim = 1)."""
    dims = [i for i in range(approx.dim()) if i != head_dim]
    num = (approx.double() - exact.double()).pow(2).sum(dims).sqrt()
    den = exact.double().pow(2).sum(dims).sqrt().clamp_min(1e-300)
    return (num / den).tolist()


def estimator_variance(x: Tensor, y: Tensor, transform: Tensor | None, *, num_features: int = 64, draws: int = 256,
                       generator: torch.Generator | None = None) -> dict:
    """Empirical vs closed-form variance of φ_Σ(x)·φ_Σ(y) (iid Gaussian W, m = ``num_features``) for
    pairs ``x``, ``y`` ``[P, d]`` (feature space: kernel exp(xᵀΣy/√d)), Σ = MᵀM (M = ``transform``
    ``[d, d]`` or None). Returns per-pair K, the empirical and closed-form variances (float64)."""
    d = x.shape[-1]
    xt, yt = x.double() * d**-0.25, y.double() * d**-0.25
    if transform is not None:
        xt, yt = xt @ transform.double().T, yt @ transform.double().T  # M x̃
    kernel = torch.exp((xt * yt).sum(-1))
    s = xt + yt
    closed = kernel.pow(2) * torch.expm1((s * s).sum(-1)) / num_features
    w = torch.randn(draws, num_features, d, generator=generator, dtype=torch.float64)
    fx = torch.exp(torch.einsum("rmd,pd->rpm", w, xt) - 0.5 * (xt * xt).sum(-1)[None, :, None])
    fy = torch.exp(torch.einsum("rmd,pd->rpm", w, yt) - 0.5 * (yt * yt).sum(-1)[None, :, None])
    est = (fx * fy).mean(-1)  # [R, P]
    return {"kernel": kernel, "empirical": est.var(0), "closed": closed, "mean": est.mean(0)}


def _sample_pairs(q: Tensor, k: Tensor, vis: Tensor, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``count`` visible (query row, key col) pairs from batch element 0: indices."""
    rows, cols = torch.nonzero(vis[0], as_tuple=True)
    pick = torch.randint(0, rows.numel(), (count,), generator=generator)
    return rows[pick], cols[pick]


# ---------------------------------------------------------------------------------------------
# The diagnostics (what they measure: DiagnoseConfig, in .diagnose_settings)


def diagnose(model, tokenizer, texts: Sequence[str], out_dir: str | Path | None = None,
             config: DiagnoseConfig | None = None, *, progress: bool = True, plots: bool = True,
             log: Any = None) -> dict:
    """Run the diagnostics of ``config`` (default :class:`DiagnoseConfig`) on an *unconverted*
    host ``model`` (left unchanged) and its tokenizer; ``texts`` are documents of real text.
    Returns the results dict (also written to ``out_dir``)."""
    c = DiagnoseConfig() if config is None else config
    if cv.kernels(model):
        raise ValueError("diagnose takes the original (unconverted) model")
    layers, m_values, variants, seq_len, calib_seqs, eval_seqs, seeds, seed = (
        c.layers, c.m_values, c.variants, c.seq_len, c.calib_seqs, c.eval_seqs, c.seeds, c.seed)
    say = log or (lambda msg: None)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    ids = text_windows(tokenizer, texts, seq_len, calib_seqs + eval_seqs, min_windows=calib_seqs + eval_seqs)
    calib, held = ids[:calib_seqs], ids[calib_seqs:]
    probe = cv.convert(copy.deepcopy(model),
                       cv.ConversionConfig(mixer="darkformer", layers=layers, num_features=c.distill_m, seed=seed,
                                           window=0, sinks=0))
    kernels = cv.kernels(probe)
    t = time.perf_counter()
    cal = cv.capture(probe, calib)
    ev = cv.capture(probe, held)
    timings["capture_s"] = time.perf_counter() - t
    say(f"captured q/k/v of layers {list(kernels)} in {timings['capture_s']:.1f} s")

    transforms, distill_history = _variant_transforms(
        probe, cal, variants, eps=c.eps, distill_steps=c.distill_steps, distill_lr=c.distill_lr, progress=progress,
        log=log, timings=timings,
    )

    layer_results = []
    bar = progress_bar(progress, "attention errors", len(kernels) * len(variants) * len(m_values) * seeds)
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(seed + 1)
    sampling = dict(m_values=m_values, seeds=seeds, weight_rows=c.weight_rows, variance_pairs=c.variance_pairs,
                    variance_draws=c.variance_draws, variance_m=c.variance_m)
    for i, kernel in kernels.items():
        entry = _layer_diagnostics(kernel, ev[i], {v: transforms[v][i] for v in variants}, gen, bar, **sampling)
        entry = {"layer": i, "local": bool(cv.is_local(model.model.layers[i].self_attn)), **entry}
        layer_results.append(entry)
        say(f"layer {i}: errors done ({time.perf_counter() - t:.1f} s)")
    bar.close()
    timings["attention_errors_s"] = time.perf_counter() - t

    t = time.perf_counter()
    e2e = _end_to_end(model, held, transforms, variants, c.e2e_m, layers=layers, seed=seed, say=say)
    timings["end_to_end_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_all

    result = {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_type": model.config.model_type,
        "layers": list(kernels),
        "settings": {"m_values": list(m_values), "variants": list(variants), "seq_len": seq_len,
                     "calib_seqs": calib_seqs, "eval_seqs": eval_seqs, "seeds": seeds,
                     "weight_rows": int(min(c.weight_rows, seq_len)), "distill_steps": c.distill_steps,
                     "distill_m": c.distill_m, "eps": c.eps, "seed": seed,
                     "note": "identity init ≡ performer (M = F = I) bit for bit"},
        "per_layer": layer_results,
        "summary": _summary(layer_results, variants, m_values),
        "distill_loss": {str(i): {"first": h[0], "last": h[-1]} for i, h in distill_history.items()},
        "end_to_end": e2e,
        "timings": timings,
    }
    if out_dir is not None:
        write_report(result, out_dir, plots=plots)
    return result


def _eye_like(kernel) -> Tensor:
    return torch.eye(kernel.head_dim).expand(kernel.num_heads, -1, -1)

Transforms = dict[str, dict[int, "tuple[Tensor, Tensor] | None"]]


def _variant_transforms(probe, cal, variants, *, eps, distill_steps, distill_lr, progress, log,
                        timings) -> tuple[Transforms, dict]:
    """(M, F) per variant and layer — None for ``performer`` (the identity) — and the distillation
    losses: ``whiten`` from the calibration statistics, ``distill`` trained from the whitened start."""
    kernels = cv.kernels(probe)
    transforms: Transforms = {v: {} for v in variants}
    t = time.perf_counter()
    for i, kernel in kernels.items():
        q, k = cv.token_samples(cal[i], kernel)
        white = data_aware_transform(q, k, eps)
        for v in variants:
            transforms[v][i] = None if v == "performer" else (white[0].float(), white[1].float())
    timings["whiten_s"] = time.perf_counter() - t
    distill_history: dict = {}
    if "distill" in variants:
        t = time.perf_counter()
        for i, kernel in kernels.items():
            with torch.no_grad():
                kernel.transform.copy_(transforms["distill"][i][0])
                kernel.query_fold.copy_(transforms["distill"][i][1])
        distill_history = cv.distill(probe, cal, steps=distill_steps, lr=distill_lr, progress=progress, log=log)
        for i, kernel in kernels.items():
            transforms["distill"][i] = (kernel.transform.detach().clone(), kernel.query_fold.detach().clone())
        timings["distill_s"] = time.perf_counter() - t
    return transforms, distill_history


@torch.no_grad()
def _layer_diagnostics(kernel, items, transforms, gen, bar, *, m_values, seeds, weight_rows, variance_pairs,
                       variance_draws, variance_m) -> dict:
    """One layer: anisotropy of q and k, output and weight errors per variant and m, and the
    estimator's variance against the closed form on sampled causal pairs."""
    c = items[0]
    q_feat, k_feat = cv.token_samples(items, kernel)
    entry: dict = {"q": anisotropy(q_feat), "k": anisotropy(k_feat), "errors": {}, "variance": {}}
    exact = cv.exact_output(c).float()
    vis = _visible(c)
    length_q = c.query.shape[2]
    rows = torch.linspace(0, length_q - 1, min(weight_rows, length_q)).round().long().unique()
    q_base = kernel.feature_queries(c.query.float(), c.scaling, fold=_eye_like(kernel))
    k_in = c.key.transpose(1, 2).float()
    v_in = c.value.transpose(1, 2).float()
    _, w_exact = softmax_attention_masked(q_base[:, rows], k_in, v_in, vis[:, rows])
    for v, mf in transforms.items():
        transform, fold = (None, None) if mf is None else mf
        q_rows = q_base[:, rows] if fold is None else torch.einsum("hij,bthj->bthi", fold, q_base[:, rows])
        per_m = {}
        for m in m_values:
            out_err, w_err = [], []
            for s in range(seeds):
                kernel.projection = kernel.draw_projection(torch.Generator().manual_seed(1000 * s + m), m)
                approx = kernel.attend(c.query.float(), c.key.float(), c.value.float(), c.mask, c.scaling,
                                       transform=transform if transform is not None else _eye_like(kernel),
                                       fold=fold if fold is not None else _eye_like(kernel))
                out_err.append(per_head_rel_error(approx.float(), exact, 2))
                _, w_rf = random_feature_attention_masked(q_rows, k_in, v_in, kernel.projection, vis[:, rows],
                                                          transform=transform)
                w_err.append(per_head_rel_error(w_rf, w_exact, 1))
                bar.advance()
            per_m[str(m)] = {"output": _mean_lists(out_err), "weights": _mean_lists(w_err)}
        entry["errors"][v] = per_m
        entry["variance"][v] = _variance_on_pairs(kernel, q_base, k_in, vis, transform, fold, gen, pairs=variance_pairs,
                                                  draws=variance_draws, num_features=variance_m)
    return entry


def _variance_on_pairs(kernel, q_base, k_in, vis, transform, fold, gen, *, pairs, draws, num_features) -> dict:
    """Median over sampled causal (q, k) pairs, pooled over heads, of the empirical variance of
    φ(q)·φ(k) over the closed form, and of the closed form's relative standard deviation."""
    ri, ci = _sample_pairs(q_base, k_in, vis, pairs, gen)
    ratios, rel_std = [], []
    for h in range(kernel.num_heads):
        kh = h // (kernel.num_heads // kernel.num_kv_heads)
        x = q_base[0, ri, h]
        if fold is not None:
            x = x @ fold[h].T
        y = k_in[0, ci, kh]
        res = estimator_variance(x, y, None if transform is None else transform[h], num_features=num_features,
                                 draws=draws, generator=gen)
        ok = res["closed"] > 0
        ratios.extend((res["empirical"][ok] / res["closed"][ok]).tolist())
        rel_std.extend((res["closed"][ok].sqrt() / res["kernel"][ok]).tolist())
    return {"m": num_features, "median_empirical_over_closed": _median(ratios),
            "median_closed_rel_std": _median(rel_std)}


def _end_to_end(model, held, transforms, variants, e2e_m, *, layers, seed, say) -> dict:
    """Next-token loss and accuracy of the host and of the model converted (all chosen layers) per
    variant and m, on the held-out windows."""
    e2e = {"host": evaluate_windows(model, held)}
    for v in variants:
        e2e[v] = {}
        for m in e2e_m:
            conv = cv.convert(copy.deepcopy(model), cv.ConversionConfig(mixer="darkformer", layers=layers,
                                                                        num_features=m, seed=seed, window=0, sinks=0))
            with torch.no_grad():
                for i, kernel in cv.kernels(conv).items():
                    if transforms[v][i] is not None:
                        kernel.transform.copy_(transforms[v][i][0])
                        kernel.query_fold.copy_(transforms[v][i][1])
            e2e[v][str(m)] = evaluate_windows(conv, held)
            say(f"end to end {v} m={m}: {e2e[v][str(m)]}")
            del conv
    return e2e



def _mean_lists(lists: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*lists)]


def _median(values: list[float]) -> float | None:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    values.sort()
    return values[len(values) // 2]


def _summary(layers: list[dict], variants, m_values) -> dict:
    """Mean over layers and heads of the output / weight errors per variant and m."""
    out = {}
    for v in variants:
        out[v] = {}
        for m in m_values:
            o = [e for L in layers for e in L["errors"][v][str(m)]["output"]]
            w = [e for L in layers for e in L["errors"][v][str(m)]["weights"]]
            out[v][str(m)] = {"output": sum(o) / len(o), "weights": sum(w) / len(w)}
    return out


def write_report(result: dict, out_dir: str | Path, *, plots: bool = True) -> Path:
    """``diagnostics.json``, ``diagnostics.md`` and (matplotlib permitting) PNG plots."""
    out = Path(out_dir)
    write_json_and_markdown(out, "diagnostics", result, markdown(result))
    if plots:
        plot_if_installed(_plots, result, out)
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Kernel diagnostics — {result['model']}", "",
             f"layers {result['layers']}; held-out {s['eval_seqs']}×{s['seq_len']} tokens, calibration "
             f"{s['calib_seqs']}×{s['seq_len']}; {s['seeds']} draws of W per m; "
             f"weights on {s['weight_rows']} rows; {s['note']}.", "",
             "## Relative error vs exact softmax (mean over layers and heads)", "",
             "| variant | m | output rel. error | weights rel. error |", "|---|---:|---:|---:|"]
    for v, per_m in result["summary"].items():
        for m, e in per_m.items():
            lines.append(f"| {v} | {m} | {e['output']:.4f} | {e['weights']:.4f} |")
    lines += ["", "## Per layer (mean over heads): anisotropy and output error at the largest m", ""]
    m_last = str(s["m_values"][-1])
    variants = s["variants"]
    lines.append("| layer | local | eff. rank q | eff. rank k | top-5 q | top-5 k | zero dims q/k | " +
                 " | ".join(f"{v} m={m_last}" for v in variants) + " |")
    lines.append("|---:|:---:|---:|---:|---:|---:|---:|" + "---:|" * len(variants))
    for L in result["per_layer"]:
        mean = lambda key, side: sum(h[key] for h in L[side]) / len(L[side])  # noqa: E731
        errs = " | ".join(f"{sum(L['errors'][v][m_last]['output']) / len(L['errors'][v][m_last]['output']):.4f}"
                          for v in variants)
        lines.append(f"| {L['layer']} | {'yes' if L['local'] else 'no'} | {mean('effective_rank', 'q'):.1f} | "
                     f"{mean('effective_rank', 'k'):.1f} | {mean('top5_share', 'q'):.2f} | "
                     f"{mean('top5_share', 'k'):.2f} | "
                     f"{max(h['zero_dims'] for h in L['q'])}/{max(h['zero_dims'] for h in L['k'])} | {errs} |")
    lines += ["", "## Estimator variance (iid W): empirical vs the closed form of docs/math.md §6 (median over layers)",
              "", "| variant | m | median empirical/closed | median closed-form rel. std |", "|---|---:|---:|---:|"]
    for v in variants:
        r = [L["variance"][v]["median_empirical_over_closed"] for L in result["per_layer"]]
        sd = [L["variance"][v]["median_closed_rel_std"] for L in result["per_layer"]]
        m = result["per_layer"][0]["variance"][v]["m"] if result["per_layer"] else ""
        lines.append(f"| {v} | {m} | {_fmt(_median([x for x in r if x is not None]))} | "
                     f"{_fmt(_median([x for x in sd if x is not None]))} |")
    e2e = result["end_to_end"]
    lines += ["", "## End to end (held-out next-token prediction)", "", "| model | m | loss | accuracy |",
              "|---|---:|---:|---:|", f"| host | – | {e2e['host']['loss']:.4f} | {e2e['host']['accuracy']:.4f} |"]
    for v in variants:
        for m, r in e2e[v].items():
            lines.append(f"| {v} | {m} | {r['loss']:.4f} | {r['accuracy']:.4f} |")
    lines += ["", "## Wall times (s)", "", "| stage | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["timings"].items()]
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _plots(result: dict, out: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("output", "weights")):
        for v, per_m in result["summary"].items():
            ms = [int(m) for m in per_m]
            ax.loglog(ms, [per_m[str(m)][key] for m in ms], marker="o", label=v)
        ax.set_xlabel("random features m")
        ax.set_ylabel(f"relative error of attention {key}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']}: random-feature attention vs exact softmax")
    fig.tight_layout()
    fig.savefig(out / "error_vs_m.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    layers = [L["layer"] for L in result["per_layer"]]
    for side in ("q", "k"):
        ax.plot(layers, [sum(h["effective_rank"] for h in L[side]) / len(L[side]) for L in result["per_layer"]],
                marker="o", label=side)
    ax.set_xlabel("layer")
    ax.set_ylabel("effective rank (mean over heads)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "anisotropy.png", dpi=120)
    plt.close(fig)


__all__ = ["VARIANTS", "DiagnoseConfig", "anisotropy", "diagnose", "estimator_variance", "markdown",
           "per_head_rel_error", "write_report"]
