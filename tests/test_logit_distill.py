"""End-to-end logit distillation of converted kernels (kernelmix.pretrained.logit_distill) on tiny
random Gemma 3 / Llama hosts: the KL to the host falls on held-out text, the host's weights are
untouched, the target is the host itself (checked against an unconverted copy in float64), an
interrupted run resumes exactly, and bad input is refused before work."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelmix import pretrained as cv  # noqa: E402
from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.pretrained.logit_distill import DistillConfig, distill, kl_to_host, scored_positions  # noqa: E402

from .test_convert import ids, tiny_gemma, tiny_llama  # noqa: E402


def _held_out_kl(model, held):
    with torch.no_grad():
        return sum(kl_to_host(model, w[None], torch.arange(2, w.numel() - 1)).item() for w in held) / len(held)


@pytest.mark.parametrize("mixer", ["darkformer", "hedgehog"])
def test_distillation_lowers_the_held_out_kl_and_leaves_the_host(mixer):
    model = cv.convert(tiny_gemma(qk_scale=1.0), cv.ConversionConfig(mixer=mixer, num_features=8, window=2, sinks=0,
                                                                      layers="all"))
    host_weights = {k: v.clone() for k, v in model.state_dict().items() if ".kernelmix_rf." not in k}
    held = ids(2, 24, seed=7)
    flags = [p.requires_grad for k in cv.kernels(model).values() for p in k.trainable()]
    before = _held_out_kl(model, held)
    record = distill(model, ids(40, 24, seed=3), DistillConfig(steps=40, lr=3e-2, positions=24))
    after = _held_out_kl(model, held)
    assert after < 0.97 * before, (before, after)  # a random tiny host: little beyond its window to learn
    assert len(record["losses"]) == 40 and record["last"] < record["first"]
    for k, v in model.state_dict().items():
        if ".kernelmix_rf." not in k:
            assert torch.equal(v, host_weights[k]), k
    assert [p.requires_grad for k in cv.kernels(model).values() for p in k.trainable()] == flags


def test_the_target_is_the_unconverted_host():
    """KL(host ‖ model) computed by hand in float64 from an unconverted copy's logits."""
    host = tiny_gemma(qk_scale=1.0)
    model = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2, sinks=0,
                                                                 layers="all"))
    window, positions = ids(1, 20, seed=5), torch.tensor([3, 7, 11, 18])
    with torch.no_grad():
        p = torch.log_softmax(host(input_ids=window).logits[0, positions].double(), -1)
        q = torch.log_softmax(model(input_ids=window, use_cache=False).logits[0, positions].double(), -1)
        expected = float((p.exp() * (p - q)).sum(-1).mean())
        got = float(kl_to_host(model, window, positions))
    assert expected > 1e-5  # the conversion changes something at these positions
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_scored_positions_skip_the_exact_part_and_are_drawn_reproducibly():
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    drawn = scored_positions(100, 10, 5, g())
    assert drawn.tolist() == sorted(drawn.tolist()) and drawn.min() >= 10 and drawn.max() <= 98 and drawn.numel() == 5
    assert torch.equal(drawn, scored_positions(100, 10, 5, g()))
    assert scored_positions(12, 10, 5, g()).tolist() == [10]  # fewer positions than asked: all of them
    assert scored_positions(6, 10, 5, g()).tolist() == [4]  # the exact part covers the window: its last position


def test_an_interrupted_distillation_resumes_exactly(tmp_path, monkeypatch):
    def fresh():
        return cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2, layers="all"))

    calibration, config = ids(3, 20, seed=4), DistillConfig(steps=8, lr=1e-2, positions=6, checkpoint_every=3)
    whole = fresh()
    distill(whole, calibration, config)

    import kernelmix.pretrained.logit_distill as ld

    calls, real = {"n": 0}, ld.kl_to_host

    def interrupted(model, window, positions):
        calls["n"] += 1
        if calls["n"] == 5:  # step 4: past the checkpoint after step 3
            raise KeyboardInterrupt
        return real(model, window, positions)

    monkeypatch.setattr(ld, "kl_to_host", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(fresh(), calibration, config, out_dir=tmp_path)
    monkeypatch.setattr(ld, "kl_to_host", real)
    with pytest.raises(KernelmixError, match="resume"):
        distill(fresh(), calibration, config, out_dir=tmp_path)
    resumed = fresh()
    record = distill(resumed, calibration, config, out_dir=tmp_path, resume=True)
    for i, kernel in cv.kernels(whole).items():
        assert torch.equal(kernel.transform, cv.kernels(resumed)[i].transform), i
    assert len(record["losses"]) == 8
    assert len(json.loads((tmp_path / "distill.json").read_text())["losses"]) == 8


def test_bad_input_is_refused_before_work():
    with pytest.raises(KernelmixError, match="trainable kernels"):
        distill(tiny_llama(), ids(2, 8))
    with pytest.raises(KernelmixError, match="trainable kernels"):
        distill(cv.convert(tiny_llama(), cv.ConversionConfig(mixer="performer", num_features=8, window=2)), ids(2, 8))
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2))
    with pytest.raises(KernelmixError, match="calibration must be token ids"):
        distill(model, torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="steps"):
        distill(model, ids(2, 8), DistillConfig(steps=0))
    with pytest.raises(KernelmixError, match="resume=True needs"):
        distill(model, ids(2, 8), resume=True)
