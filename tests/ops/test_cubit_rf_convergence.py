"""Cubit-RF approaches exact Cubit as the number of random features m grows (docs/math.md §12).

The kernels are the same by construction — E[φ(r_i d^¼)·φ(r̂_j d^¼)] = exp(r_iᵀ r̂_j), Cubit's Gram
kernel with no 1/√d, and E[φ(q)·φ(k)] = exp(qᵀk/√d), its softmax read-out at the default scale — so
the only difference is the Monte-Carlo error of the estimates. The tests measure the relative RMSE of
the output against ``cubit_attention_naive`` for increasing m and check that it falls as m^{-1/2}.

The same helpers print the table of docs/math.md §12::

    python -m tests.ops.test_cubit_rf_convergence                 # synthetic inputs
    python -m tests.ops.test_cubit_rf_convergence --run RUN_DIR   # a trained Cubit model's layers

where the error is also split by its source: the Gram estimate alone (estimated U, exact softmax
read-out) and the read-out alone (exact U, random-feature read-out).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from kernelmix.ops import (
    cubit_attention_naive,
    cubit_rf_attention,
    cubit_solve,
    orthogonal_random_features,
    positive_random_features,
    random_feature_attention_naive,
    softmax_attention_naive,
)
from kernelmix.ops.cubit import normalize_reference
from tests.utils import rel_rmse

F64 = torch.float64


def synthetic_inputs(*, T: int = 64, heads: int = 4, d: int = 16, seed: int = 0, ridge: float = 1e-2) -> dict:
    """Moderate scales, where the estimates are usable: ‖r‖ ≈ 1.2 (Gram logits |r_iᵀr̂_j| ≤ ‖r_i‖),
    ‖q‖, ‖k‖ ≈ 2 (read-out logits ≈ ±1 after 1/√d); LRR factors in (0.5, 2)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {
        "q": 0.5 * randn(1, T, heads, d), "k": 0.5 * randn(1, T, heads, d), "v": randn(1, T, heads, d),
        "r": 0.3 * randn(1, T, heads, d), "rho": 0.5 + 1.5 * torch.sigmoid(randn(1, T, heads)),
        "ridge": torch.full((heads,), ridge, dtype=F64), "ref_scale": torch.ones(heads, dtype=F64),
    }


def _estimated_solution(x: dict, projection: torch.Tensor) -> torch.Tensor:
    """U = (Ĝ + λI)⁻¹ (ρ ⊙ V) with the random-feature Gram, densely (the Gram part of Cubit-RF alone)."""
    d = x["r"].shape[-1]
    left = positive_random_features(x["r"] * d**0.25, projection)
    right = positive_random_features(normalize_reference(x["r"], x["ref_scale"]) * d**0.25, projection)
    kernel = torch.einsum("bihm,bjhm->bhij", left, right).tril()
    gram = kernel / kernel.sum(dim=-1, keepdim=True)
    system = gram + x["ridge"][:, None, None] * torch.eye(gram.shape[-1], dtype=gram.dtype)
    values = (x["rho"][..., None] * x["v"]).transpose(1, 2)
    return torch.linalg.solve_triangular(system, values, upper=False).transpose(1, 2)


def errors_against_cubit(x: dict, m_values, draws: int = 4, seed: int = 100) -> list[dict]:
    """For each m: the mean over ``draws`` orthogonal W of the relative RMSE against exact Cubit of
    Cubit-RF (``total``), of the estimated Gram with the exact read-out (``gram``) and of the exact
    solve with the estimated read-out (``readout``)."""
    coefficients = {"rho": x["rho"], "ridge": x["ridge"], "ref_scale": x["ref_scale"]}
    exact = cubit_attention_naive(x["q"], x["k"], x["v"], x["r"], **coefficients)
    u_exact, _ = cubit_solve(x["r"], x["v"], **coefficients)
    heads, d = x["q"].shape[2:]
    rows = []
    for m in m_values:
        sums = {"total": 0.0, "gram": 0.0, "readout": 0.0}
        for draw in range(draws):
            w = orthogonal_random_features(m, d, num_heads=heads, generator=torch.Generator().manual_seed(seed + draw),
                                           dtype=F64)
            sums["total"] += rel_rmse(cubit_rf_attention(x["q"], x["k"], x["v"], x["r"], w, **coefficients), exact)
            gram_only = softmax_attention_naive(x["q"], x["k"], _estimated_solution(x, w))
            sums["gram"] += rel_rmse(gram_only, exact)
            sums["readout"] += rel_rmse(random_feature_attention_naive(x["q"], x["k"], u_exact, w), exact)
        rows.append({"m": m, **{name: total / draws for name, total in sums.items()}})
    return rows


def decay_exponent(rows: list[dict], key: str = "total") -> float:
    """The least-squares slope of log(error) against log(m): −½ for a Monte-Carlo error."""
    xs = torch.tensor([math.log(r["m"]) for r in rows], dtype=F64)
    ys = torch.tensor([math.log(r[key]) for r in rows], dtype=F64)
    xs = xs - xs.mean()
    return float((xs * (ys - ys.mean())).sum() / xs.pow(2).sum())


def test_error_against_exact_cubit_falls_as_one_over_root_m():
    rows = errors_against_cubit(synthetic_inputs(), (16, 256, 4096), draws=3)
    totals = [r["total"] for r in rows]
    assert totals[0] > totals[1] > totals[2], rows
    assert -0.7 <= decay_exponent(rows) <= -0.35, rows  # measured ≈ −0.5: Monte-Carlo error
    assert totals[2] <= 0.25 * totals[0], rows
    for part in ("gram", "readout"):  # each estimate alone converges too
        assert rows[0][part] > rows[1][part] > rows[2][part], rows


@pytest.mark.slow
@pytest.mark.parametrize("ridge", [1e-6, 1e-2, 0.1])
def test_convergence_at_every_ridge(ridge):
    rows = errors_against_cubit(synthetic_inputs(ridge=ridge, T=128), (16, 64, 256, 1024, 4096, 16384), draws=4)
    assert all(a["total"] > b["total"] for a, b in zip(rows, rows[1:])), rows
    assert -0.7 <= decay_exponent(rows) <= -0.35, rows


# ---------------------------------------------------------------------------------------------
# the table of docs/math.md §12


def trained_layer_inputs(run_dir: str, text: str, length: int) -> list[tuple[str, dict]]:
    """What each Cubit layer of a trained model hands its op on ``text`` (first ``length`` tokens):
    q, k, v, r, ρ (captured at the layer's ``_mix``) and its ridge and reference scale. Grouped
    key/value heads are expanded to the query heads."""
    from kernelmix.ops import expand_heads
    from kernelmix.training.runs import load_run

    run = load_run(run_dir)
    ids = torch.tensor([run.tokenizer.encode(text)[:length]])
    captured = []
    for index, block in enumerate(run.model.blocks):
        layer = block.mixer
        original = layer._mix

        def capture(q, k, v, extras, state, layer=layer, original=original, index=index):
            heads = q.shape[2]
            coefficients = {n: c.detach().double() for n, c in layer._coefficients().items()}
            tensors = {"q": q, "k": expand_heads(k, heads), "v": expand_heads(v, heads), "r": extras["r"],
                       "rho": extras["rho"]}
            if tensors["rho"] is None:
                tensors["rho"] = torch.ones(q.shape[:3])
            captured.append((f"layer {index}", {**{n: t.detach().double() for n, t in tensors.items()},
                                                **coefficients}))
            return original(q, k, v, extras, state)

        layer._mix = capture
    with torch.no_grad():
        run.model(ids)
    return captured


def _table(rows_by_source: list[tuple[str, list[dict]]]) -> str:
    lines = ["| inputs | m | Cubit-RF | Gram estimate only | read-out estimate only |", "|---|---:|---:|---:|---:|"]
    for source, rows in rows_by_source:
        for row in rows:
            lines.append(f"| {source} | {row['m']} | {row['total']:.3f} | {row['gram']:.3f} | {row['readout']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a `kernelmix train` run directory of a cubit model")
    parser.add_argument("--text", help="a text file to run the model on (default: this file)")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--m", default="16,64,256,1024,4096")
    parser.add_argument("--draws", type=int, default=4)
    args = parser.parse_args()
    m_values = [int(m) for m in args.m.split(",")]
    torch.set_num_threads(1)
    if args.run is None:
        sources = [(f"synthetic, λ = {ridge:g}", synthetic_inputs(ridge=ridge)) for ridge in (1e-6, 1e-2, 0.1)]
    else:
        with open(args.text or __file__) as f:
            sources = trained_layer_inputs(args.run, f.read(), args.length)
    results = []
    for source, x in sources:
        rows = errors_against_cubit(x, m_values, draws=args.draws)
        results.append((source, rows))
        print(f"{source}: decay exponent {decay_exponent(rows):.2f}", flush=True)
    print(_table(results))


if __name__ == "__main__":
    main()
