"""The text of ``kernelmix gpu-check --plan``: plan.md (every kernel, the targets, the roofline) and
the README of its results directory, from the plan's JSON alone."""

from __future__ import annotations

#: The issue's roofline goals, forward + backward of the present kernels against SDPA: (mixers, T, the
#: most × SDPA, the goal in words)
ROOFLINE_GOALS = ((("cubit", "deltaformer", "cubit-bf16", "deltaformer-bf16"), 8192, 2.5, "≤ 2.5× SDPA at 8,192"),
                  (("performer", "darkformer"), 16384, 1 / 3, "≥ 3× faster than SDPA at 16,384"))
CHECK_NAMES = {"programs": "≥ {min_programs} programs (2 per SM) or a reason",
               "registers": "≤ {max_registers} registers",
               "spills": "{max_spilled_bytes} spilled bytes", "compile_s": "compile ≤ {max_compile_s:.0f} s"}


def _kernel_table(rows: list[dict], sms: int) -> list[str]:
    lines = ["| kernel | grid | programs | per SM | launches | products | warps | registers | "
             "spill stores / loads (B) | stack (B) | shared (KiB) | compile (s) | GFLOP | "
             "MB | FLOP/B | roofline (ms) | products alone (ms) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        grid = " × ".join(str(g) for g in r["grid"])
        lines.append(
            f"| {r['name']} | {grid} | {r['programs']:,} | {r['programs'] / sms:.2f} | {r['calls']} | "
            f"{r['precision']} | {r['num_warps']} | "
            f"{r['registers']} | {r['spill_stores']:,} / {r['spill_loads']:,} | {r['stack_bytes']:,} | "
            f"{r['shared_bytes'] / 1024:.0f} | {r['compile_s']:.1f} | {r['flops'] / 1e9:.1f} | {r['bytes'] / 1e6:.0f} "
            f"| {r['intensity']:.1f} | {r['roofline_ms']:.2f} | {r['products_ms']:.2f} |")
    return lines


def _targets(plan: dict) -> list[str]:
    rows = [r for r in plan["kernels"] if r["shape"]["label"] == "target"]
    limits = plan["limits"]
    lines = ["| target | met by | missed by |", "|---|---|---|"]
    for check, title in CHECK_NAMES.items():
        met = [r["name"] for r in rows if r["checks"][check]]
        missed = [r["name"] for r in rows if not r["checks"][check]]
        lines.append(f"| {title.format(**limits)} | {len(met)} of {len(rows)} | {', '.join(missed) or '–'} |")
    lines += ["", "The grids under 2 programs per SM, what bounds them, and why that is right where it is:", ""]
    seen = set()
    for r in rows:
        if r["programs"] < limits["min_programs"] and r["kernel"] not in seen:
            seen.add(r["kernel"])
            why = f" Why fewer is right: {r['why_fewer']}." if r["why_fewer"] else " Not right: a design limit."
            lines.append(f"- `{r['kernel']}`: {r['programs']} programs; {r['grid_bound']}.{why}")
    return lines


def _roofline(plan: dict) -> list[str]:
    lines = ["| mixer | T | SDPA (ms) | present (ms) | of it torch's (ms) | × SDPA | products alone (ms) | × SDPA | "
             "public op (ms) | × SDPA | design, TF32 (ms) | × SDPA | design, bf16 (ms) | × SDPA | "
             "SDPA, same byte rule (ms) | present × it | launches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in plan["roofline"]:
        torch_ms = f"{r['torch_ms']:.2f}" if "torch_ms" in r else "–"
        public = f"{r['public_ms']:.2f} | {r['public_ratio']:.2f}" if "public_ms" in r else "– | –"
        lines.append(f"| {r['mixer']} | {r['length']:,} | {r['sdpa_ms']:.2f} | {r['present_ms']:.2f} | {torch_ms} | "
                     f"{r['present_ratio']:.2f} | {r['products_ms']:.2f} | {r['products_ratio']:.2f} | {public} | "
                     f"{r['design_tf32_ms']:.2f} | "
                     f"{r['design_tf32_ratio']:.2f} | {r['design_bf16_ms']:.2f} | {r['design_bf16_ratio']:.2f} | "
                     f"{r['sdpa_streamed_ms']:.2f} | {r['streamed_ratio']:.2f} | {r['launches']} |")
    lines += ["", "*Products alone*: the present kernels' FLOPs at their peaks over the SMs their grids occupy, "
              "every byte free (the kernels' own *products alone* column above; with the read-out at SDPA's peak "
              "and the random features' torch work as counted): no work on the kernels' bytes (more rows or "
              "columns a program, L2 serving re-read tiles) takes them under it, only fewer products, fuller "
              "grids or a higher peak do. Where it is over a goal, the goal needs other products, not other "
              "bytes.", "",
              "*SDPA, same byte rule*: SDPA's FLOPs at the same peak, but its bytes counted as this model "
              "counts ours, every tile a program streams asked of memory again (flash attention's forward in "
              "programs of 128 query rows streaming K and V; its backward as FlashAttention-2's two kernels: "
              "`plan_costs.sdpa_streamed_cost`), and *present × it* the present kernels with the read-out costed "
              "the same way, against it. The goals below are judged on SDPA at its peak, as the issue states "
              "them; this column says how much of the gap is the model charging our kernels for bytes it does "
              "not charge SDPA for.", "",
              "*Launches*: the Triton kernel launches of one forward + backward (the solve mixers' read-out "
              "not counted). Their host-side cost (Python and the driver, per launch) is not in the roofline; it "
              "is not measured here, and for the solve, whose sequential sub-span solves and pushes launch once "
              "per sub-span, a GPU run should weigh it (CUDA graphs would remove it)."]
    if any(r["mixer"] in ("performer", "darkformer") for r in plan["roofline"]):
        lines += ["", "The random features run on bf16 q, k, v (as gpu-check's bench and a bf16 model). Their "
                  "*present* is the Triton op's kernels plus torch's work around them (*of it torch's*: the "
                  "per-row 1/den and c = −g·o/den, adding the chain's span parts, and DARKFormer's W' = W M and "
                  "its gradients dW = dW' Mᵀ, dM = Wᵀ dW' − d^(−1/2) M C on [H, m, d] and [H, d, d] tensors), "
                  "counted from the aten ops "
                  "one forward + backward runs (`kernelmix.studies.gpu_check.plan_glue`: on meta tensors, every op "
                  "reading its inputs and writing its outputs once). *Public op*: what a model calls, "
                  "`random_feature_attention`, with its guard against non-finite inputs (masks built on every "
                  "call on a GPU) on top. The solve mixers' torch work around their kernels is not counted."]
    return lines + [""] + roofline_goals(plan)


def roofline_goals(plan: dict) -> list[str]:
    """The roofline goals as a table: each mixer's present × SDPA against its goal."""
    lines = ["The issue's goals for the present kernels (their products alone, the public op's ratio, and the "
             "ratio with SDPA's bytes counted by our rule, beside it, not the goal's):", "",
             "| goal | mixer | present × SDPA | products alone × SDPA | public op × SDPA | × SDPA, same byte rule | "
             "met |",
             "|---|---|---:|---:|---:|---:|---|"]
    for mixers, length, most, words in ROOFLINE_GOALS:
        for r in plan["roofline"]:
            if r["mixer"] in mixers and r["length"] == length:
                public = f"{r['public_ratio']:.3f}" if "public_ratio" in r else "–"
                met = "yes" if r["present_ratio"] <= most else f"no (needs ≤ {most:.3g})"
                lines.append(f"| {words} | {r['mixer']} | {r['present_ratio']:.3f} | {r['products_ratio']:.3f} | "
                             f"{public} | "
                             f"{r['streamed_ratio']:.3f} | {met} |")
    return lines


def plan_markdown(plan: dict) -> str:
    """plan.md: the kernels per shape, the targets at the target shape, the roofline."""
    t = plan["target"]
    out = ["# Launch plan of the Triton kernels (sm_90, compiled ahead of time on a CPU)", "",
           f"Every Triton kernel of one differentiated call (forward, then backward), compiled for {t['arch']} with "
           f"the blocks and warps the ops launch with, packed documents on. {t['machine']}: {t['sms']} SMs, "
           f"fp32 {t['fp32_flops'] / 1e12:.0f}, TF32 {t['tf32_flops'] / 1e12:.0f}, bf16 {t['bf16_flops'] / 1e12:.0f} "
           f"TFLOP/s (dense), HBM {t['hbm_bytes_per_s'] / 1e12:.1f} TB/s. FLOPs and bytes are what a launch "
           "executes and asks of memory at its padded tiles (the cost model in "
           "`kernelmix.studies.gpu_check.plan_costs`), summed over a call's launches (*launches*: the span "
           "kernels run once per span, the sequential solves once per sub-span, the pushes after every "
           "sub-span but a span's last, their grid shown the median push's, the sub-spans' logits once per "
           "direction; the random features' chunk states "
           "and their scan twice, the backward recomputes them); the roofline is max(FLOPs / (peak × busy "
           "SMs), bytes / HBM bandwidth) (a lower bound if L2 served no re-read tile; on a GPU it serves some, "
           "so a kernel bound by its bytes may run faster), at the fp32 peak for *products* `fp32` (CUDA cores) "
           "and the TF32 peak for `tf32` (tensor cores: the chunk-parallel solve's products across spans, its "
           "pushes' and its gradients' products, for "
           "T > 1,024; the random features' products of features, states and values; their feature logits "
           "stay fp32-accurate as three TF32 products, at a third of the TF32 peak), and the bf16 peak for "
           "`bf16` (the `-bf16` solve rows: the same solves under `kernelmix.ops.solve_operands(\"bf16\")`, their "
           "span kernels, pushes and gradients reading bf16 copies of x, y, U and db, 2 B an element; at heads up "
           "to 128 wide the forward's `solve_past_span` holds 256 rows a program in two column halves, which "
           "`solve_merge_partials` merges, the transposed `solve_future_span` also forms the gradients of its "
           "pairs, the later spans' rows, and `solve_grad_columns` sums only each span's own rows).", ""]
    for label, shape in plan["shapes"].items():
        rows = [r for r in plan["kernels"] if r["shape"]["label"] == label]
        if not rows:
            continue
        out += [f"## `{label}`: B={shape['batch']}, H={shape['heads']}, T={shape['length']:,}, d={shape['head_dim']}, "
                f"m={shape['features']}, chunk {shape['chunk_size']} ({shape['note']})", ""]
        out += _kernel_table(rows, t["sms"]) + [""]
    out += ["## The targets at the target shape", ""] + _targets(plan) + [""]
    if plan["roofline"]:
        out += ["## Roofline: forward + backward against SDPA", "",
                "*Present*: the kernels above at their grids (the solve mixers add the softmax read-out over U, "
                "costed as SDPA). *Design*: the op's useful products (kernelmix.studies.flops, × 3 for forward + "
                "backward) on tensor cores (TF32 operands, or bf16 operands with fp32 accumulation) over the whole "
                "machine, plus the read-out: a bound no kernel of this op passes. SDPA: "
                "causal flash attention in bf16 at peak (backward 2.5× the forward).", ""]
        out += _roofline(plan) + [""]
    return "\n".join(out)


def plan_readme(plan: dict) -> str:
    """The results directory's README: the command, what it holds, the headline."""
    rows = [r for r in plan["kernels"] if r["shape"]["label"] == "target"]
    small = sum(not r["checks"]["programs"] for r in rows)
    spilling = sum(r["spilled_bytes"] > 0 for r in rows)
    slowest = max(rows, key=lambda r: r["compile_s"]) if rows else None
    compiling = sum(r["compile_s"] for r in plan["kernels"])
    lines = ["# gpu-plan: the Triton kernels' launch report, made without a GPU", "",
             "Produced by `kernelmix gpu-check --plan --out results/gpu-plan`: the "
             f"{len(plan['kernels'])} compiles for sm_90 took {compiling / 60:.1f} min of one CPU core in all "
             f"(Triton {plan['kernels'][0]['triton'] if plan['kernels'] else '?'}); they are kept in `compiled.jsonl`, "
             "so a rerun compiles only kernels whose source or blocks changed.", "",
             "- `plan.md`: every kernel at each shape (grid, programs per SM, registers, spills, shared memory, "
             "compile seconds, FLOPs, bytes, roofline), the targets, and the forward + backward roofline against SDPA.",
             "- `plan.json`: the same numbers (`kernels`: one entry per mixer and kernel and shape).", ""]
    if rows:
        lines += [f"At the target shape: {len(rows)} kernels; {small} launch fewer than "
                  f"{plan['limits']['min_programs']} programs without a reason, {spilling} spill, the slowest compile "
                  f"is {slowest['name']} ({slowest['compile_s']:.0f} s).", ""]
    for label in plan["shapes"]:  # the other shapes: their spills (outside the targets, but seen)
        others = [r for r in plan["kernels"] if r["shape"]["label"] == label]
        if label == "target" or not others:
            continue
        spilled = [f"{r['name']} ({r['spilled_bytes']} B)" for r in others if r["spilled_bytes"] > 0]
        lines += [f"At `{label}`: {len(others)} kernels, {len(spilled)} spill"
                  + (f" (spill stores + loads per thread): {', '.join(spilled)}." if spilled else "."), ""]
    return "\n".join(lines)


__all__ = ["plan_markdown", "plan_readme", "roofline_goals"]
