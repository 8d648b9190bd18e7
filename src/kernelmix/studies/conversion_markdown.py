"""The conversion report's README (tables, the targets met or missed) and plots, from its
``results.json`` (:func:`report_markdown`, :func:`plot_report`)."""

from __future__ import annotations

from ..output import pyplot

STAGE_ORDER = {"none": 0, "transfer": 0, "lora": 1}
TARGET_GLOBAL = 0.05  # nats/token over the host: DARKFormer after transfer, global layers
TARGET_ALL = 0.5  # nats/token over the host: DARKFormer after transfer + LoRA, all layers
TARGET_ERROR = 0.3  # median per-layer attention error


def _row(result: dict, layers: str, variant: str, stage: str | None = None) -> dict | None:
    for row in result["rows"]:
        if row["layers"] == layers and row["variant"] == variant and (stage is None or row["stage"] == stage):
            return row
    return None


def _distillation(result: dict) -> str:
    """The logit distillation after the transfer, when the report ran one (``kl_steps`` > 0)."""
    s = result["settings"]
    if not s.get("kl_steps"):
        return ""
    done = [row["kl"] for row in result["rows"] if row.get("kl")]
    span = "; ".join(f"KL to the host {kl['first']:.3f} → {kl['last']:.3f}" for kl in done)
    return (f" After each transfer, {s['kl_steps']} steps of end-to-end logit distillation at lr {s['kl_lr']} "
            f"(the kernels trained on KL(host ‖ converted), host frozen{'; ' + span if span else ''}): the "
            "transfer rows include it.")


def _objective(s: dict) -> str:
    """What the transfer matched, when it was not the attention output (the default)."""
    if s.get("transfer_objective", "attention") == "attention":
        return ""
    return (", matching what each layer writes into the residual stream (o_proj, then the post-attention norm: "
            "`--transfer-objective residual`), not its attention output")


def report_markdown(result: dict) -> str:
    s = result["settings"]
    host = result["host_loss"]
    lines = [
        f"# Conversion that keeps the host — {s['model']} on {s['text']}",
        "",
        f"Produced by `kernelmix report conversion` in {result['seconds'] / 60:.1f} min on this machine "
        f"(torch {result['machine']['torch']}, {result['machine']['threads']} threads){_computed(result)}.",
        "",
        f"Every converted layer: exact softmax over the last {s['window']} tokens and the first {s['sinks']} tokens of "
        f"the document (sinks), features (m = {s['num_features']}) for the rest, one normalisation. Held-out loss: "
        f"{result['tokens']['held_out']} tokens ({s['eval_seqs']} × {s['eval_len']}) of documents no calibration or "
        f"finetuning saw; attention error: ‖out − exact‖² / ‖exact‖² per converted layer on the host's own q/k/v of a "
        f"held-out {s['error_len']}-token window (the median over layers in the table). Transfer: "
        f"{s['transfer_steps']} steps per layer on {s['calib_seqs']} × {s['calib_len']} calibration tokens"
        f"{_objective(s)}; LoRA: "
        f"{s['lora_steps']} steps × {s['lora_seq_len']} tokens, "
        f"lr {s['lora_lr']}.{_distillation(result)} One seed ({s['seed']}).",
        "",
        f"**Host: {host:.4f} nats/token.**",
        "",
        "| layers | variant | stage | loss | − host | median attention error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in sorted(result["rows"], key=lambda r: (r["layers"], r["variant"], STAGE_ORDER[r["stage"]])):
        err = "–" if row["attention_error"] is None else f"{row['attention_error']:.3f}"
        lines.append(f"| {row['layers']} | {row['variant']} | {row['stage']} | {row['loss']:.4f} | "
                     f"{row['loss'] - host:+.4f} | {err} |")
    lines += ["", "![held-out loss](loss.png)", "", "![per-layer attention error](attention_error.png)", ""]
    lines += (_per_layer_table(result) + _feature_sweep(result) + _layer_gaps(result) + _estimator(result)
              + _decode_table(result) + _targets(result))
    return "\n".join(lines) + "\n"


def _computed(result: dict) -> str:
    """How long every row took when it was computed (reused rows are not recomputed)."""
    timed = result.get("row_seconds") or {}
    if not timed:
        return "; reused rows are not counted"
    return (f"; {len(timed)} of its rows and measurements have a recorded time, {sum(timed.values()) / 60:.1f} min "
            "when they were computed (in this or earlier invocations; "
            "rows computed before times were recorded count 0)")


def _per_layer_table(result: dict) -> list[str]:
    lines = ["## Per-layer attention error (first stage)", ""]
    for layers in result["settings"]["layers"]:
        rows = [r for r in result["rows"] if r["layers"] == layers and r.get("per_layer_error")]
        if not rows:
            continue
        indices = sorted(rows[0]["per_layer_error"], key=int)
        lines += [f"`{layers}` layers:", "", "| variant | " + " | ".join(indices) + " |",
                  "|---|" + "---:|" * len(indices)]
        for r in rows:
            lines.append(f"| {r['variant']} | " + " | ".join(f"{r['per_layer_error'][i]:.3f}" for i in indices) + " |")
        lines.append("")
    return lines


def _feature_sweep(result: dict) -> list[str]:
    """Global-layer DARKFormer after transfer at each m: whether more features close the gap."""
    s = result["settings"]
    sweep = [(s["num_features"], _row(result, "global", "darkformer", "transfer"))]
    sweep += [(m, _row(result, "global", f"darkformer m={m}", "transfer")) for m in s.get("feature_sweep", ())]
    sweep = sorted((m, r) for m, r in sweep if r is not None)
    if len(sweep) < 2:
        return []
    host = result["host_loss"]
    lines = ["## The gap against the number of features", "",
             "Global layers, DARKFormer after transfer "
             "(same window, sinks, calibration and steps), m features per head:",
             "", "| m | loss − host | median attention error | per-layer error |", "|---:|---:|---:|---|"]
    for m, r in sweep:
        per_layer = ", ".join(f"{i}: {e:.3f}" for i, e in sorted(r["per_layer_error"].items(), key=lambda x: int(x[0])))
        lines.append(f"| {m} | {r['loss'] - host:+.4f} | {r['attention_error']:.3f} | {per_layer} |")
    return lines + [""]


def _layer_gaps(result: dict) -> list[str]:
    """Which global layer carries the gap: the loss with one converted layer at a time."""
    gaps = result.get("layer_gaps")
    row = _row(result, "global", "darkformer", "transfer")
    if not gaps or row is None:
        return []
    host = result["host_loss"]
    lines = ["## Which layer carries the gap", "",
             "Global layers, DARKFormer after transfer, with one converted layer at a time (the other global layers "
             "back on the host's exact attention):", "",
             "| converted layer | attention error | loss | − host |", "|---:|---:|---:|---:|"]
    for layer, loss in sorted(gaps.items(), key=lambda item: int(item[0])):
        lines.append(f"| {layer} | {row['per_layer_error'][layer]:.3f} | {loss:.4f} | {loss - host:+.4f} |")
    lines += [f"| all {len(gaps)} | {row['attention_error']:.3f} (median) | {row['loss']:.4f} | "
              f"{row['loss'] - host:+.4f} |",
              "", f"The one-layer gaps add to {sum(gaps.values()) - len(gaps) * host:+.4f}.", ""]
    return lines


def _estimator(result: dict) -> list[str]:
    """Whether the feature part estimates a kernel: errors with W redrawn at more features."""
    check = result.get("estimator")
    if not check:
        return []
    layers = sorted(check["own"], key=int)
    def span(runs: list[dict], layer: str) -> str:  # min–max over the draws
        low, high = min(r[layer] for r in runs), max(r[layer] for r in runs)
        return f"{low:.3f}–{high:.3f}" if len(runs) > 1 else f"{low:.3f}"

    own = " / ".join(f"{check['own'][i]:.3f}" for i in layers)
    lines = ["## Is the feature part estimating a kernel?", "",
             f"Global layers {' / '.join(layers)}, attention error on the held-out window. *Transferred M*: "
             f"DARKFormer after transfer with W redrawn ({len(next(iter(check['redrawn'].values())))} draws: "
             f"min–max); with the draw it was trained on: {own}. *Whitened M*: the kernel is the host's own, "
             "W drawn once. An estimator of a kernel gets better with m; a map fitted to its draw of W does not "
             "survive a new one.", "",
             "| m | transferred M, W redrawn | whitened M |", "|---:|---|---|"]
    for m in sorted(check["redrawn"], key=int):
        redrawn = " / ".join(span(check["redrawn"][m], i) for i in layers)
        whitened = " / ".join(f"{check['whitened'][m][i]:.3f}" for i in layers)
        lines.append(f"| {int(m):,} | {redrawn} | {whitened} |")
    return lines + [""]


def _decode_table(result: dict) -> list[str]:
    d = result["decode"]
    lines = ["## Decoding: cache bytes and time per token", "",
             "The host against DARKFormer after transfer on the global layers (Gemma's local layers keep their own "
             "512-token window in both). Caches filled to the context directly (see `studies/conversion_decode.py`).",
             "", "| context | host cache | converted cache | host ms/token | converted ms/token |",
             "|---:|---:|---:|---:|---:|"]
    for i, context in enumerate(d["contexts"]):
        lines.append(f"| {context:,} | {d['host']['bytes'][i] / 2**20:.2f} MiB | "
                     f"{d['converted']['bytes'][i] / 2**20:.2f} MiB | {d['host']['ms_per_token'][i]:.1f} | "
                     f"{d['converted']['ms_per_token'][i]:.1f} |")
    lines += ["", "![decode](decode.png)", ""]
    return lines


def _targets(result: dict) -> list[str]:
    host = result["host_loss"]
    lines = ["## The issue's targets, as measured", ""]
    dark_global = _row(result, "global", "darkformer", "transfer")
    if dark_global is not None:
        gap = dark_global["loss"] - host
        lines.append(f"- Global layers, DARKFormer after transfer: {gap:+.3f} nats/token over the host (target ≤ "
                     f"+{TARGET_GLOBAL}): {'met' if gap <= TARGET_GLOBAL else 'missed'}.")
    dark_all = _row(result, "all", "darkformer", "lora")
    if dark_all is not None:
        gap = dark_all["loss"] - host
        lines.append(f"- All layers, DARKFormer after transfer + LoRA: {gap:+.3f} (target ≤ +{TARGET_ALL}): "
                     f"{'met' if gap <= TARGET_ALL else 'missed'}.")
    errors = {r["variant"]: r["attention_error"] for r in result["rows"]
              if r["attention_error"] is not None and r["layers"] == result["settings"]["layers"][0]}
    if "darkformer" in errors:
        ok = errors["darkformer"] <= TARGET_ERROR
        lines.append("- Median per-layer attention error, DARKFormer after transfer "
                     f"({result['settings']['layers'][0]} layers): "
                     f"{errors['darkformer']:.3f} (target ≤ {TARGET_ERROR}): {'met' if ok else 'missed'}; "
                     + ", ".join(f"{v} {e:.3f}" for v, e in errors.items() if v != "darkformer") + ".")
    d = result["decode"]
    flat = len(set(d["converted"]["bytes"])) == 1
    lines.append(f"- Decode memory of the converted model {'flat' if flat else 'NOT flat'} over contexts "
                 f"{', '.join(f'{c:,}' for c in d['contexts'])} ({d['converted']['bytes'][0] / 2**20:.2f} MiB), the "
                 f"host's {d['host']['bytes'][0] / 2**20:.2f} → {d['host']['bytes'][-1] / 2**20:.2f} MiB.")
    return lines + [""]


def plot_report(result: dict, out) -> None:
    plt = pyplot()
    host = result["host_loss"]
    rows = sorted(result["rows"], key=lambda r: (r["layers"], r["variant"], STAGE_ORDER[r["stage"]]))
    # horizontal bars: one readable label per row, however many rows the sweep adds
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.3 * len(rows)))
    labels = [f"{r['layers']} · {r['variant']} · {r['stage']}" for r in rows]
    ax.barh(range(len(rows)), [r["loss"] - host for r in rows],
            color=["C0" if r["stage"] != "lora" else "C1" for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("held-out loss − host (nats/token)")
    ax.set_title(f"{result['settings']['model']}, host {host:.3f} nats/token\n(blue: first stage, orange: + LoRA)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(result["settings"]["layers"]), figsize=(10, 3.5), squeeze=False)
    for ax, layers in zip(axes[0], result["settings"]["layers"]):
        for r in (r for r in rows if r["layers"] == layers and r.get("per_layer_error")):
            indices = sorted(r["per_layer_error"], key=int)
            ax.plot([int(i) for i in indices], [r["per_layer_error"][i] for i in indices], "o-", label=r["variant"],
                    ms=3)
        ax.set_title(f"{layers} layers")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention error (relative MSE)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "attention_error.png", dpi=120)
    plt.close(fig)

    d = result["decode"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in ("host", "converted"):
        a.plot(d["contexts"], [x / 2**20 for x in d[name]["bytes"]], "o-", label=name)
        b.plot(d["contexts"], d[name]["ms_per_token"], "o-", label=name)
    for ax, label in ((a, "cache (MiB)"), (b, "ms per token")):
        ax.set_xscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)
    plt.close(fig)


__all__ = ["plot_report", "report_markdown"]
