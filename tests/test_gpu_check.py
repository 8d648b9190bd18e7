"""kernelmix gpu-check (issue 16 item 5): the dry run on CPU, end to end, where pydantic cannot be
imported (the GPU machine's situation); part (c) with pydantic; the targets table; the command
line; a failing or interrupted part keeps the others and the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernelmix.studies import gpu_check
from kernelmix.studies.gpu_check import running
from tests.utils import isolated_data_cache

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(Path(__file__).parent / "fixtures" / "train_corpus")

data_cache = pytest.fixture(scope="module", autouse=True, name="data_cache")(isolated_data_cache)

# `python -m kernelmix ...` where `import pydantic` fails, at the smallest sizes: a finder at the
# front of sys.meta_path refuses pydantic, and a second one swaps the study's quick sizes for its
# smoke sizes right after the study is imported (by the command, after it has set TRITON_INTERPRET)
WITHOUT_PYDANTIC = textwrap.dedent("""
    import runpy, sys

    class NoPydantic:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pydantic", "pydantic_core"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)

    class SmokeSizes:
        def find_spec(self, name, path=None, target=None):
            if name != "kernelmix.studies.gpu_check.settings":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                module.quick_sizes = module.smoke_sizes
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path[:0] = [NoPydantic(), SmokeSizes()]
    sys.argv = ["kernelmix", *sys.argv[1:]]
    runpy.run_module("kernelmix", run_name="__main__", alter_sys=True)
""")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k != gpu_check.INTERPRETER_ENV}  # the command sets it
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYDANTIC, "gpu-check", "--device", "cpu", "--quick", "--out", str(out),
         "--threads", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    return done, out, json.loads((out / "gpu_check.json").read_text())


def test_dry_run_without_pydantic_writes_parts_a_and_b(dry_run):
    done, out, report = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = report["parts"]
    assert report["environment"][gpu_check.INTERPRETER_ENV] == "1"
    assert "not importable" in report["environment"]["pydantic"]
    # (a): every op, both backends, both dtypes, all within the test suite's tolerances
    checks = parts["a"]["checks"]
    triton = gpu_check.triton_import_error() is None
    assert parts["a"]["status"] == "done" and parts["a"]["backends"] == (["triton", "torch"] if triton else ["torch"])
    assert {c["op"] for c in checks} == {spec.name for spec in gpu_check.OP_CHECKS}
    assert len(checks) == len(gpu_check.OP_CHECKS) * 2 * len(parts["a"]["backends"])
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    assert all(0 < c["value_error"] <= c["tolerance"] and c["worst_grad_error"] <= c["tolerance"] for c in checks)
    # (b): every mixer timed at the length, decode at both positions, a row per target
    bench = parts["b"]
    assert bench["status"] == "done" and bench["backend"] == ("triton" if triton else "torch")
    # (and the solve mixers with bf16 operands: "cubit-bf16", "deltaformer-bf16")
    assert set(gpu_check.solve_variants()) == {"cubit-bf16", "deltaformer-bf16"}
    assert {(r["mixer"], r["length"]) for r in bench["records"] if r["forward_backward_ms"]} == {
        (m, 16) for m in [*gpu_check.MIXERS, *gpu_check.solve_variants()]}
    assert {(d["mixer"], d["position"]) for d in bench["decode"] if d["step_ms"]} == {
        (m, p) for m in gpu_check.MIXERS for p in (8, 16)}
    # per solve mixer: time, memory, the long length (with bf16 operands: time, memory); per random-feature mixer
    # (cubit-rf too): time, decode; fla's
    targets = 5 * len(gpu_check.family("solve")) + 2 * len(gpu_check.family("random-features")) + 1
    assert targets == 17 and len(bench["targets"]) == targets
    assert any(t["passed"] is None for t in bench["targets"])  # no fla, no CUDA peak
    # (c): said why it did not run, and what to do
    assert parts["c"]["status"].startswith("not run") and "pip install pydantic" in parts["c"]["status"]


def test_dry_run_writes_markdown_plots_and_progress_lines(dry_run):
    done, out, _ = dry_run
    markdown = (out / "gpu_check.md").read_text()
    for title in ("## (a) op checks", "## (b) bench", "## (b) decode latency", "## (b) targets (issue 16)"):
        assert title in markdown
    assert "| cubit_attention | " in markdown and "FAIL" not in markdown.split("## (b) bench")[0]
    for name in ("bench_time.png", "decode.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "(a) cubit_solve backend=torch float32 T=20 chunk=16 GQA docs: ok" in done.stdout
    assert "(b) T=16 darkformer: fwd" in done.stdout and "(c) not run" in done.stdout


def test_compare_part_with_pydantic(tmp_path):
    part: dict = {}
    overrides = dict(mixers=["softmax", "performer"], corpus=CORPUS, model={"hidden_size": 32})
    gpu_check.run_compare_part(part, gpu_check.smoke_sizes(), torch.device("cpu"), tmp_path, overrides,
                               lambda text: None)
    assert [row["mixer"] for row in part["summary"]] == ["softmax", "performer"]
    assert all(row["val_loss"] > 0 and row["steps"] == 1 for row in part["summary"])
    assert (tmp_path / "compare" / "results.json").exists()


def _record(mixer, length, ms, peak=None):
    return {"mixer": mixer, "length": length, "forward_backward_ms": ms, "peak_memory_mib": peak}


def test_targets_read_the_ratios_of_the_run():
    sizes = gpu_check.full_sizes()
    records = [_record("softmax", 8192, 10.0, 100.0), _record("cubit", 8192, 24.0, 150.0),
               _record("cubit-bf16", 8192, 20.0, 150.0),
               _record("deltaformer", 8192, 26.0, 250.0), _record("softmax", 16384, 40.0),
               _record("performer", 16384, 10.0), _record("darkformer", 16384, 20.0),
               _record("cubit", 65536, 900.0), _record(gpu_check.FLA_PEER, 8192, 30.0)]
    decode = [{"mixer": "performer", "position": 1024, "step_ms": 1.0},
              {"mixer": "performer", "position": 32768, "step_ms": 1.1},
              {"mixer": "darkformer", "position": 1024, "step_ms": 1.0},
              {"mixer": "darkformer", "position": 32768, "step_ms": 1.5}]
    rows = {row["target"]: row for row in gpu_check.evaluate_targets(records, decode, sizes, fla_ran=True)}
    assert rows["cubit fwd+bwd ≤ 2.5× SDPA's at T=8192"]["passed"] is True  # 2.4×
    assert rows["deltaformer fwd+bwd ≤ 2.5× SDPA's at T=8192"]["passed"] is False  # 2.6×
    assert rows["cubit-bf16 fwd+bwd ≤ 2.5× SDPA's at T=8192"]["measured"] == 2.0  # the bf16 operands' variant
    assert rows["deltaformer-bf16 fwd+bwd ≤ 2.5× SDPA's at T=8192"]["passed"] is None  # not measured
    assert rows["cubit peak memory ≤ 2× SDPA's at T=8192"]["measured"] == 1.5
    assert rows["deltaformer peak memory ≤ 2× SDPA's at T=8192"]["passed"] is False
    assert rows["cubit runs at T=65536"]["passed"] and rows["deltaformer runs at T=65536"]["passed"] is False
    assert rows["performer fwd+bwd ≥ 3× faster than SDPA at T=16384"]["passed"] is True  # 4×
    assert rows["darkformer fwd+bwd ≥ 3× faster than SDPA at T=16384"]["passed"] is False  # 2×
    assert rows["performer decode at position 32768 ≤ 1.2× position 1024"]["passed"] is True
    assert rows["darkformer decode at position 32768 ≤ 1.2× position 1024"]["passed"] is False
    assert rows[f"deltaformer fwd+bwd ≤ {gpu_check.FLA_PEER}'s at T=8192"]["passed"] is True
    missing = gpu_check.evaluate_targets(records[:1], [], sizes, fla_ran=False)
    assert all(row["passed"] is None or row["target"].endswith("T=65536") for row in missing)
    assert "flash-linear-attention did not run" in missing[-1]["note"]


def test_the_full_cli_lists_gpu_check_with_the_same_options(capsys):
    from kernelmix.cli import build_parser, main
    from kernelmix.cli import gpu_check as command

    args = build_parser().parse_args(["gpu-check", "--out", "x", "--device", "cpu", "--quick", "--skip", "b,c",
                                      "--lengths", "16,32"])
    assert args.func is command.run
    options = command.options_from(args)
    assert ((options.device, options.quick, options.skip, options.lengths, options.threads)
            == ("cpu", True, "b,c", "16,32", None))
    assert command.parse_lengths(options.lengths) == (16, 32) and command.parse_skip(options.skip) == ("b", "c")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "gpu-check" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code, message", [
    (["--skip", "d"], 2, "--skip: unknown part(s) d"),
    (["--lengths", "1024,x"], 2, "--lengths: expected comma-separated integers"),
    (["--device", "tpu"], 2, "invalid choice: 'tpu'"),
    ([], 2, "the following arguments are required: --out"),
])
def test_bad_options_are_refused_before_any_work(argv, code, message, tmp_path, capsys):
    from kernelmix.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        main(["gpu-check", *argv, *(["--out", str(out)] if argv else [])])
    assert stop.value.code == code and message in capsys.readouterr().err
    assert not out.exists()


def test_cuda_without_a_gpu_names_the_dry_run(tmp_path, capsys):
    from kernelmix.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["gpu-check", "--out", str(tmp_path / "out")]) == 1
    assert "--device cpu --quick" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_failing_part_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def broken(part, *args):
        raise RuntimeError("kernel exploded")

    def bench(part, *args):
        part.update(records=[], decode=[], targets=[], notes=["stub"])

    monkeypatch.setattr(running, "run_op_checks", broken)
    monkeypatch.setattr(running, "run_bench", bench)
    report = gpu_check.run_gpu_check(gpu_check.GpuCheckConfig(device="cpu", quick=True, skip=("c",)), tmp_path)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["parts"]["a"]["status"] == "failed: RuntimeError: kernel exploded"
    assert "kernel exploded" in saved["parts"]["a"]["traceback"]
    assert saved["parts"]["b"]["status"] == "done" and saved["parts"]["c"]["status"] == "skipped (--skip)"
    assert gpu_check.exit_status(report) == 1


def test_ctrl_c_keeps_the_finished_parts(tmp_path, monkeypatch):
    def checks(part, *args):
        part.update(checks=[], passed=0, failed=0)

    def interrupted(part, *args):
        part["records"] = [_record("softmax", 16, 1.0)]
        raise KeyboardInterrupt

    monkeypatch.setattr(running, "run_op_checks", checks)
    monkeypatch.setattr(running, "run_bench", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_gpu_check(gpu_check.GpuCheckConfig(device="cpu", quick=True), tmp_path)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["parts"]["a"]["status"] == "done"
    assert saved["parts"]["b"]["status"].startswith("interrupted") and saved["parts"]["b"]["records"]
    assert saved["parts"]["c"]["status"] == "pending"
    assert "interrupted" in (tmp_path / "gpu_check.md").read_text()
