"""Artefacts saved by an earlier layout of kernelmix still load and compute what they computed:
a `kernelmix train` run (evaluated, and resumed for more steps), a converted Hugging Face model
(`save_converted`) and a `KernelMixForCausalLM.save_pretrained` directory. They were written by
tests/fixtures/legacy/make_legacy.py before the "one house" redesign; each holds the logits the
code that wrote it computed on fixed token ids."""

import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "tests" / "fixtures" / "legacy"


def expected(name: str) -> dict:
    return torch.load(LEGACY / name / "expected.pt", weights_only=True)


@pytest.fixture
def repo_root(monkeypatch, tmp_path):
    # the run records its corpus relative to the repository root; the data cache starts empty
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KERNELMIX_CACHE", str(tmp_path / "cache"))
    return ROOT


def test_a_saved_training_run_loads_and_computes_the_same_logits(repo_root):
    from kernelmix.training import load_run

    run = load_run(LEGACY / "run")
    saved = expected("run")
    with torch.no_grad():
        logits = run.model(input_ids=saved["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)
    assert run.step == 3 and run.config.layer_mixers() == ["cubit", "darkformer"]


def test_a_saved_training_run_resumes(repo_root, tmp_path):
    from kernelmix.training import run_config, train

    out = tmp_path / "run"
    shutil.copytree(LEGACY / "run", out, ignore=shutil.ignore_patterns("expected.pt"))
    config = run_config(None, ["steps=4"], out_dir=out, resume=True)
    result = train(config, resume=True, progress=False, reschedule=True)  # extends the saved 3-step run on purpose
    assert (result.start_step, result.final_step) == (3, 4)
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())


def test_a_saved_converted_model_loads_and_computes_the_same_logits():
    pytest.importorskip("transformers")
    from kernelmix.pretrained import kernels, load_converted

    model = load_converted(LEGACY / "converted")
    saved = expected("converted")
    assert list(kernels(model)) == [1]
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


def test_a_saved_hugging_face_model_loads_and_computes_the_same_logits():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import kernelmix.hf  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(LEGACY / "hf").eval()
    saved = expected("hf")
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)
