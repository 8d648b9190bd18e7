"""How many digits does float32 keep in each trained model's gradient? For every run of the study
(its final weights) and for the same model at initialisation: the loss and the gradient of all
parameters in float32 and in float64 (the same weights, cast), on 8 windows of 256 bytes of Python
source (this repository's src/kernelmix/model.py, a file of the kind the models trained on), and
the relative error ‖g32 − g64‖ / ‖g64‖. A model whose float32 gradient is less accurate hands its
optimizer more rounding, step after step. Writes conditioning.md next to this file.

    python3 results/rounding/conditioning.py
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from kernelmix.model import CausalLM
from kernelmix.training import load_run

HERE = Path(__file__).resolve().parent
TEXT = HERE.parents[1] / "src" / "kernelmix" / "model.py"


def _windows() -> torch.Tensor:
    data = torch.tensor(list(TEXT.read_bytes()[: 8 * 257]), dtype=torch.long)
    return data.view(8, 257)


def _loss_and_grad(model: torch.nn.Module, windows: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(windows[:, :-1], labels=windows[:, :-1], use_cache=False).loss
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def gradient_error(model: torch.nn.Module, windows: torch.Tensor) -> float:
    model = model.float().eval()  # eval: no dropout (the study trains with none either)
    _, g32 = _loss_and_grad(model, windows)
    _, g64 = _loss_and_grad(model.double(), windows)
    return ((g32 - g64).norm() / g64.norm()).item()


def main() -> None:
    torch.set_num_threads(1)
    windows = _windows()
    rows: dict[str, dict[str, list[float]]] = {}
    for run_dir in sorted((HERE / "lr-0.003" / "runs").iterdir()):
        run = load_run(run_dir)
        mixer = run_dir.name.split("-T")[0]
        seed = int(run_dir.name.split("-s")[1].split("-")[0])
        trained = gradient_error(run.model, windows)
        initial = gradient_error(CausalLM(run.model.config, seed=seed), windows)
        rows.setdefault(mixer, {"trained": [], "initial": []})
        rows[mixer]["trained"].append(trained)
        rows[mixer]["initial"].append(initial)
        print(f"{run_dir.name}: float32 gradient relative error {initial:.1e} at init, {trained:.1e} trained", flush=True)
    lines = ["# How accurate is each model's float32 gradient?", "",
             "`python3 results/rounding/conditioning.py`: ‖g32 − g64‖ / ‖g64‖ of the gradient of all parameters, "
             "the same weights in float32 and float64, 8 × 256 bytes of Python source; the runs of `lr-0.003/` "
             "(seeds 0 and 1: both values) and the same models at initialisation.", "",
             "| mixer | at initialisation | trained (300 steps) |", "|---|---:|---:|"]
    for mixer, values in rows.items():
        cells = [" / ".join(f"{v:.1e}" for v in values[key]) for key in ("initial", "trained")]
        lines.append(f"| {mixer} | {cells[0]} | {cells[1]} |")
    (HERE / "conditioning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
