"""Finetuning converted models (tiny random Gemma 3 / Llama built locally): what each mode trains,
that the loss goes down, resume equality, spikes, the comparison with its outputs, and bad input."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from kernelmix import data  # noqa: E402
from kernelmix import pretrained as cv  # noqa: E402
from kernelmix import pretrained as pt  # noqa: E402
from kernelmix.studies import finetune as ft  # noqa: E402
from kernelmix.training import spikes  # noqa: E402

from .test_convert import tiny_gemma, tiny_llama  # noqa: E402
from .test_diagnose import ByteTokenizer  # noqa: E402

class SavableByteTokenizer(ByteTokenizer):
    def save_pretrained(self, directory):
        pass


TEXT = "the quick brown fox jumps over the lazy dog; " * 12


def windows(count=12, length=32, seed=0):
    """Learnable token windows: a repeated phrase, offsets varying per window."""
    tok = ByteTokenizer()
    stream = torch.tensor(tok(TEXT * 4).input_ids)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def config(**kw):
    base = dict(steps=12, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_seqs=2)
    base.update(kw)
    return pt.FinetuneConfig(**base)


def converted(make=tiny_gemma, mixer="darkformer", m=16):
    return cv.convert(make(), cv.ConversionConfig(mixer=mixer, num_features=m))


def trainable_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_modes_train_what_they_say():
    model, params = pt.prepare_trainable(converted(), config(mode="partial"))
    names = trainable_names(model)
    assert names and all(any(k in n for k in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm",
                                              "kernelmix_rf.transform")) for n in names)
    assert "model.layers.0.self_attn.kernelmix_rf.transform" in names
    assert not any("projection" in n for n in names)  # W is a buffer, never trained
    assert len(params) == len(names)

    model, _ = pt.prepare_trainable(converted(), config(mode="full"))
    names = trainable_names(model)
    assert "model.embed_tokens.weight" not in names and "model.layers.1.mlp.up_proj.weight" in names
    model, _ = pt.prepare_trainable(converted(), config(mode="full", train_embeddings=True))
    assert "model.embed_tokens.weight" in trainable_names(model)

    pytest.importorskip("peft")
    model, _ = pt.prepare_trainable(converted(tiny_llama), config(mode="lora", lora_rank=4), layers="all")
    names = trainable_names(model)
    assert any("lora_A" in n for n in names) and any(n.endswith("kernelmix_rf.transform") for n in names)
    assert not any("mlp" in n or "o_proj" in n for n in names)


@pytest.mark.parametrize("mode", ["partial", "full", "lora"])
def test_finetune_lowers_loss_and_keeps_a_working_model(mode, tmp_path):
    if mode == "lora":
        pytest.importorskip("peft")
    x = windows()
    model, result = pt.finetune(converted(), x, x[:2], config(mode=mode))
    assert result["finished"] and not result["diverged"] and result["steps_done"] == 12
    assert [e["step"] for e in result["evals"]] == [0, 6, 12]
    assert result["final"]["loss"] < result["initial"]["loss"] - 0.1
    assert all(not p.requires_grad for p in model.parameters())
    assert cv.kernels(model)  # still converted (LoRA merged back into a plain converted model)
    cv.save_converted(model, tmp_path / "m")
    again = cv.load_converted(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x[:2]).logits, model(input_ids=x[:2]).logits)


def test_resume_equals_uninterrupted(tmp_path):
    x = windows()
    cfg = config(steps=10, eval_every=4, lr=1e-3)
    _, full = pt.finetune(converted(), x, x[:2], cfg)
    _, part = pt.finetune(converted(), x, x[:2], cfg, out_dir=tmp_path, stop_at=6)
    assert part["steps_done"] == 6 and not part["finished"]
    with pytest.raises(ValueError, match="already holds finetuning checkpoints"):
        pt.finetune(converted(), x, x[:2], cfg, out_dir=tmp_path)
    _, resumed = pt.finetune(converted(), x, x[:2], cfg, out_dir=tmp_path, resume=True)
    # the checkpoint of step 4 is the newest before the stop: steps 5..10 are rerun identically
    assert resumed["finished"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=0, abs=1e-6)
    assert resumed["final"]["loss"] == pytest.approx(full["final"]["loss"], abs=1e-6)
    with pytest.raises(ValueError, match="another finetune config"):
        pt.finetune(converted(), x, x[:2], config(steps=10, eval_every=4, lr=2e-3), out_dir=tmp_path, resume=True)


def test_spikes_and_divergence():
    assert not spikes.is_spike([2.0] * 10, 2.3, window=20, nats=0.5)
    assert spikes.is_spike([2.0] * 10, 2.6, window=20, nats=0.5)
    assert not spikes.is_spike([2.0] * 3, 9.0, window=20, nats=0.5)  # too little history to judge
    assert spikes.is_spike([], float("nan"), window=20, nats=0.5)
    noisy = [2.0, 3.0] * 10  # batch noise of ±0.5 around 2.5: σ ≈ 0.74, threshold 2.5 + 4σ ≈ 5.5
    assert not spikes.is_spike(noisy, 4.0, window=20, nats=0.5) and spikes.is_spike(noisy, 6.0, window=20, nats=0.5)
    history = [2.0] * 10 + [9.0] + [2.0] * 5
    assert [s["step"] for s in spikes.find_spikes(history, window=20, nats=0.5)] == [10]
    # end to end: a forward whose logits are 50× too sharp (at step 8) is a spike; the others are not
    x = windows()
    model = converted(mixer="performer")
    calls = {"train": 0}

    def sharpen(module, inputs, output):
        if not module.training:
            return None
        calls["train"] += 1
        return output * 50 if calls["train"] == 9 else None

    model.lm_head.register_forward_hook(sharpen)
    _, result = pt.finetune(model, x, x[:2], config(steps=12, lr=1e-3))
    assert [s["step"] for s in result["spikes"]] == [8], ([round(v, 3) for v in result["losses"]], result["spikes"])
    assert result["num_spikes"] == 1 and not result["diverged"]


def test_compare_finetune_outputs_and_reuse(tmp_path):
    x = windows()
    host = tiny_gemma()
    logs = []
    report = ft.compare_finetune(host, x, x[:2], config(steps=6, eval_every=3),
                                 variants=("softmax", "performer", "darkformer"),
                                 lrs=(1e-3, 3e-3), num_features=16, init="whiten", out_dir=tmp_path, log=logs.append)
    assert not cv.kernels(host)  # host untouched
    assert [(r["variant"], r["lr"]) for r in report["runs"]] == [
        (v, lr) for v in ("softmax", "performer", "darkformer") for lr in (1e-3, 3e-3)]
    by = {(r["variant"], r["lr"]): r for r in report["runs"]}
    assert by[("softmax", 1e-3)]["num_features"] is None and by[("darkformer", 1e-3)]["init"] == "whiten"
    # equal budget: the same steps and tokens for every run
    assert len({r["tokens"] for r in report["runs"]}) == 1
    for name in ("finetune.json", "finetune.md", "finetune_curves.png"):
        assert (tmp_path / name).is_file()
    assert "| darkformer | 0.003 |" in (tmp_path / "finetune.md").read_text()
    assert not (tmp_path / "runs" / "softmax-lr0.001" / "checkpoints").exists()  # finished: only the result stays
    again = ft.compare_finetune(host, x, x[:2], config(steps=6, eval_every=3), variants=("softmax",), lrs=(1e-3,),
                                out_dir=tmp_path, log=logs.append)
    assert any("reusing" in line for line in logs)
    assert again["runs"][0]["final"] == by[("softmax", 1e-3)]["final"]


def test_token_windows_and_split():
    from kernelmix.data.corpus import Document
    from kernelmix.data.windows import text_windows

    tok = ByteTokenizer()
    docs = [Document(f"d{i}", TEXT) for i in range(10)]
    train, val = data.split_texts(docs, 0.2)
    assert train and val and len(train) + len(val) == 10
    w = text_windows(tok, train, 40)
    assert w.shape[1] == 40 and w[0, 0] == 1  # BOS first
    assert text_windows(tok, train, 40, max_windows=3).shape == (3, 40)
    with pytest.raises(ValueError, match="not enough text"):
        text_windows(tok, ["ab"], 40)
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.split_texts(docs[:1])


def test_bad_input():
    with pytest.raises(ValueError, match="unknown finetuning mode"):
        config(mode="half").validate()
    with pytest.raises(ValueError, match="steps must be a positive int"):
        config(steps=0).validate()
    with pytest.raises(ValueError, match="unknown finetune option"):
        pt.FinetuneConfig.from_dict({"stepz": 3})
    x = windows()
    with pytest.raises(ValueError, match="unknown variant"):
        ft.compare_finetune(tiny_gemma(), x, x[:2], config(), variants=("cosine",))
    with pytest.raises(ValueError, match=r"windows must be \[N, T\]"):
        pt.finetune(converted(), x[0], x[:2], config())
    with pytest.raises(ValueError, match="out of range"):
        ft.build_variant(tiny_gemma(), "performer", num_features=8, layers=[7], init="identity", calibration=None)


def test_cli_finetune(tmp_path, capsys, monkeypatch):
    from kernelmix.cli import main

    host = tiny_gemma()
    host.save_pretrained(tmp_path / "host")
    monkeypatch.setattr("kernelmix.pretrained.load_pretrained",
                        lambda name, **kw: (cv.load_converted(name), SavableByteTokenizer()))
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(TEXT * 2)
    out = tmp_path / "out"
    rc = main(["finetune", str(tmp_path / "host"), "--out", str(out), "--text", str(corpus), "--variants", "performer",
               "--num-features", "8", "--steps", "3", "--seq-len", "32", "--eval-every", "3", "--eval-seqs", "1",
               "--val-fraction", "0.3", "--lr", "1e-3,2e-3"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "finetune.json").read_text())
    assert [r["lr"] for r in data["runs"]] == [1e-3, 2e-3]
    # an already converted model is finetuned as it is and saved
    conv = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8))
    cv.save_converted(conv, tmp_path / "conv")
    rc = main(["finetune", str(tmp_path / "conv"), "--out", str(tmp_path / "out2"), "--text", str(corpus), "--steps",
               "2", "--seq-len", "32", "--eval-every", "2", "--eval-seqs", "1", "--val-fraction", "0.3"])
    assert rc == 0, capsys.readouterr().err
    assert cv.kernels(cv.load_converted(tmp_path / "out2" / "model"))
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["finetune", str(tmp_path / "host"), "--out", str(out), "--text", str(corpus), "--mode", "half"])
    rc = main(["finetune", str(tmp_path / "host"), "--out", str(tmp_path / "o3"), "--text", str(corpus), "--lr=-1"])
    assert rc == 2 and "learning rates must be positive" in capsys.readouterr().err


def test_cubit_variant_finetunes():
    x = windows()
    model = ft.build_variant(tiny_llama(), "cubit", num_features=16, layers="all", init="identity", calibration=None)
    before = [k.log_ridge.detach().clone() for k in cv.kernels(model).values()]
    model, result = pt.finetune(model, x, x[:2], config())
    assert result["final"]["loss"] < result["initial"]["loss"] - 0.1
    after = [k.log_ridge for k in cv.kernels(model).values()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))  # λ learned


def test_resumed_run_metrics_have_each_step_once(tmp_path):
    x = windows()
    cfg = config(steps=8, eval_every=4)
    # steps 5, 6 logged after the step-4 checkpoint
    pt.finetune(converted(), x, x[:2], cfg, out_dir=tmp_path, stop_at=6)
    pt.finetune(converted(), x, x[:2], cfg, out_dir=tmp_path, resume=True)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if r["kind"] == "train"]
    assert steps == list(range(1, 9))
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 4, 8]


def test_a_non_finite_gradient_skips_the_update():
    """A finite loss whose gradient is NaN (seen on Gemma: every M turned NaN after one such step)
    must leave the parameters as they were and count as a spike."""
    x = windows()
    model = converted()
    kernel = cv.kernels(model)[0]
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("nan")) if calls["n"] == 3 else grad

    kernel.transform.register_hook(poison)
    model, result = pt.finetune(model, x, x[:2], config(steps=6, eval_every=6))
    assert calls["n"] == 6
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(sp["step"] == 2 and sp.get("gradient") == "non-finite" for sp in result["spikes"])
    assert result["skipped_updates"] == 1 and not result["diverged"]
    assert result["final"]["loss"] == result["final"]["loss"]  # not NaN


def test_non_finite_losses_in_a_row_stop_the_run_as_diverged():
    guard = spikes.SpikeGuard(window=20, nats=0.5, max_bad_steps=2)
    assert not guard.record(0, 2.0, grad_finite=True, updated=True)
    assert guard.record(1, 2.0, grad_finite=False, updated=False)  # a finite loss, a non-finite gradient
    assert guard.spikes == [{"step": 1, "loss": 2.0, "gradient": "non-finite"}] and not guard.diverged
    assert guard.record(2, float("nan"), grad_finite=None, updated=False)
    assert guard.diverged and guard.skipped == 2 and len(guard.losses) == 3

    x = windows()
    model = converted()
    model.lm_head.register_forward_hook(
        lambda module, inputs, output: output * float("nan") if module.training else None)
    model, result = pt.finetune(model, x, x[:2], config(steps=12, max_bad_steps=3))
    assert result["diverged"] and result["finished"] and result["steps_done"] == 3
    assert result["skipped_updates"] == 3 and result["num_spikes"] == 3
    assert [e["step"] for e in result["evals"]] == [0, 3]  # evaluated where it stopped
    assert all(torch.isfinite(p).all() for p in model.parameters())  # no update was taken


def test_lora_wrapping_raises_no_deprecation_warning():
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model; the
    FutureWarning it raised in every LoRA run is silenced at that one call (it is not our API)."""
    import warnings

    pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model, _ = pt.prepare_trainable(converted(tiny_llama), config(mode="lora", lora_rank=4))
    assert any("lora_A" in n for n in trainable_names(model))


def test_tokens_count_the_windows_given_not_the_config_seq_len():
    """finetune's tokens (and tokens/s) come from the windows it trains on: 24-token windows under a
    config whose seq_len says 32 are 24 tokens each."""
    x = windows(length=24)
    cfg = config(steps=3, eval_every=3, seq_len=32)
    _, result = pt.finetune(converted(), x, x[:2], cfg)
    assert result["tokens"] == 3 * cfg.batch_size * 24
