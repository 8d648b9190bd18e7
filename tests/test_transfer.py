"""Attention transfer (kernelmix.pretrained.transfer, kernelmix convert --transfer) on tiny random
Gemma 3 / Llama hosts: the relative error falls, the host is untouched, an interrupted transfer
resumes exactly, bad input is refused before work, and the command saves a transferred model."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelmix import pretrained as cv  # noqa: E402
from kernelmix.errors import KernelmixError  # noqa: E402
from kernelmix.pretrained.calibration import capture  # noqa: E402
from kernelmix.pretrained.transfer import TransferConfig, layer_pieces, relative_error, transfer  # noqa: E402

from .test_convert import ids, tiny_gemma, tiny_llama  # noqa: E402
from .test_finetune import TEXT, SavableByteTokenizer  # noqa: E402


def _held_out_error(model, layer, held):
    pieces = layer_pieces(capture(model, held, layers=[layer])[layer], held.shape[1])
    with torch.no_grad():
        return sum(relative_error(cv.kernels(model)[layer], p).item() for p in pieces) / len(pieces)


@pytest.mark.parametrize("mixer", ["darkformer", "hedgehog"])
def test_transfer_lowers_the_held_out_error_and_leaves_the_host(mixer):
    host = tiny_gemma(qk_scale=1.0)  # sharper attention than a random init's near-uniform one: something to learn
    model = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer=mixer, num_features=16, window=1, sinks=0,
                                                                layers="all"))
    before_host = {k: v.clone() for k, v in model.state_dict().items() if ".kernelmix_rf." not in k}
    held = ids(2, 24, seed=7)
    before = _held_out_error(model, 1, held)
    record = transfer(model, ids(4, 24, seed=3), TransferConfig(steps=40, lr=3e-2))
    after = _held_out_error(model, 1, held)
    assert after < 0.95 * before, (before, after)
    assert record["layers"]["1"]["last"] < record["layers"]["1"]["first"]
    for k, v in model.state_dict().items():
        if ".kernelmix_rf." not in k:
            assert torch.equal(v, before_host[k]), k


def test_performer_and_the_window_have_nothing_to_train_and_are_skipped():
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="performer", num_features=8, window=2))
    record = transfer(model, ids(2, 16), TransferConfig(steps=3))
    assert record["skipped"] == [0, 1] and record["layers"] == {}


def test_an_interrupted_transfer_resumes_exactly(tmp_path, monkeypatch):
    def fresh():
        return cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2, layers="all"))

    calibration = ids(3, 20, seed=4)
    config = TransferConfig(steps=10, lr=1e-2, checkpoint_every=3)
    whole = fresh()
    transfer(whole, calibration, config)

    import kernelmix.pretrained.transfer as tr

    calls = {"n": 0}
    real = tr.relative_error

    def interrupted(kernel, piece, write=None):
        calls["n"] += 1
        if calls["n"] == 14:  # layer 1, step 4 (after layer 0's 10 steps): past the checkpoint at its step 3
            raise KeyboardInterrupt
        return real(kernel, piece, write)

    monkeypatch.setattr(tr, "relative_error", interrupted)
    first = fresh()
    with pytest.raises(KeyboardInterrupt):
        transfer(first, calibration, config, out_dir=tmp_path)
    monkeypatch.setattr(tr, "relative_error", real)
    with pytest.raises(KernelmixError, match="resume"):
        transfer(fresh(), calibration, config, out_dir=tmp_path)
    resumed = fresh()
    record = transfer(resumed, calibration, config, out_dir=tmp_path, resume=True)
    for i, kernel in cv.kernels(whole).items():
        assert torch.equal(kernel.transform, cv.kernels(resumed)[i].transform), i
    assert len(record["layers"]["1"]["losses"]) == 10
    assert json.loads((tmp_path / "transfer.json").read_text())["layers"]["0"]["done"]


def test_a_resume_with_another_budget_is_refused(tmp_path, monkeypatch):
    """Resuming into a checkpoint written with other steps or another objective would silently continue
    (or keep) the old transfer under the new name: it is refused, and names what differs."""
    model = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2, layers="all"))
    import kernelmix.pretrained.transfer as tr

    real = tr.relative_error
    calls = {"n": 0}

    def interrupted(kernel, piece, write=None):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(kernel, piece, write)

    monkeypatch.setattr(tr, "relative_error", interrupted)
    with pytest.raises(KeyboardInterrupt):
        transfer(model, ids(2, 16), TransferConfig(steps=6, checkpoint_every=2), out_dir=tmp_path)
    monkeypatch.setattr(tr, "relative_error", real)
    for changed in (dict(objective="residual"), dict(steps=9)):
        again = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2,
                                                             layers="all"))
        with pytest.raises(KernelmixError, match=f"another budget: {next(iter(changed))}="):
            transfer(again, ids(2, 16), TransferConfig(checkpoint_every=3, **({"steps": 6} | changed)),
                     out_dir=tmp_path, resume=True)
    resumed = transfer(model, ids(2, 16), TransferConfig(steps=6, checkpoint_every=3), out_dir=tmp_path, resume=True)
    assert all(len(entry["losses"]) == 6 for entry in resumed["layers"].values())


def _rms_norm_reference(x, weight, eps):
    """Gemma's RMSNorm written out in float64: x / rms(x) · (1 + w)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.double())


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_residual_write_is_what_the_layer_adds_to_its_residual_stream(family):
    from kernelmix.pretrained.attention import decoder_layers, residual_write

    host = tiny_gemma() if family == "gemma" else tiny_llama()
    layer = decoder_layers(host)[1]
    heads, head_dim = host.config.num_attention_heads, host.config.head_dim
    out = torch.randn(2, 7, heads, head_dim)
    projected = out.reshape(2, 7, -1).double() @ layer.self_attn.o_proj.weight.double().T
    if family == "gemma":  # sandwich norms: the attention branch's output is normalised per token
        norm = layer.post_attention_layernorm
        expected = _rms_norm_reference(projected, norm.weight, norm.eps)
    else:  # Llama's post_attention_layernorm is the MLP's input norm, not on this branch
        expected = projected
    torch.testing.assert_close(residual_write(layer)(out).double(), expected, rtol=1e-5, atol=1e-5)


def test_the_residual_objective_lowers_its_error_and_trains_only_the_kernels():
    from kernelmix.pretrained.attention import decoder_layers, residual_write

    host = tiny_gemma(qk_scale=1.0)
    with torch.no_grad():  # a norm weight far from 0, so the write is not o_proj up to a constant
        for layer in decoder_layers(host):
            layer.post_attention_layernorm.weight.normal_(0.0, 2.0)
    model = cv.convert(copy.deepcopy(host), cv.ConversionConfig(mixer="darkformer", num_features=16, window=1,
                                                                sinks=0, layers="all"))
    before_host = {k: v.clone() for k, v in model.state_dict().items() if ".kernelmix_rf." not in k}
    held = ids(2, 24, seed=7)
    write = residual_write(decoder_layers(model)[1])

    def held_out():
        pieces = layer_pieces(capture(model, held, layers=[1])[1], held.shape[1])
        with torch.no_grad():
            for piece in pieces:
                piece.written = write(piece.target)
            return sum(relative_error(cv.kernels(model)[1], p, write).item() for p in pieces) / len(pieces)

    before = held_out()
    record = transfer(model, ids(4, 24, seed=3), TransferConfig(steps=40, lr=3e-2, objective="residual"))
    assert held_out() < 0.95 * before
    assert record["config"]["objective"] == "residual"
    for name, value in model.named_parameters():
        if ".kernelmix_rf." not in name:
            assert value.requires_grad and value.grad is None, name  # frozen for the transfer, restored after
            assert torch.equal(value, before_host[name]), name


def test_bad_input_is_refused_before_work():
    with pytest.raises(KernelmixError, match="needs a converted model"):
        transfer(tiny_llama(), ids(2, 8))
    model = cv.convert(tiny_llama(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2))
    with pytest.raises(KernelmixError, match="calibration must be token ids"):
        transfer(model, torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="steps"):
        transfer(model, ids(2, 8), TransferConfig(steps=0))


def test_cli_convert_with_transfer(tmp_path, capsys, monkeypatch):
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
    args = ["convert", str(tmp_path / "host"), "--out", str(out), "--mixer", "hedgehog", "--num-features", "8",
            "--window", "4", "--calib-text", str(corpus), "--seq-len", "32", "--calib-seqs", "2", "--transfer",
            "--transfer-steps", "5"]
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "transfer layer 1: relative error" in printed and "after attention transfer" in printed
    loaded = cv.load_converted(out)
    assert (cv.kernels(loaded)[1].mixer == "hedgehog" and (out / "transfer.json").is_file()
            and not (out / "transfer").exists())
    with pytest.raises(SystemExit):  # --resume without --transfer
        main(args[:-3] + ["--resume"])
    assert "pass --transfer" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an objective without --transfer
        main(args[:-3] + ["--transfer-objective", "residual"])
    assert "pass --transfer" in capsys.readouterr().err


def test_cli_convert_with_transfer_then_logit_distillation(tmp_path, capsys, monkeypatch):
    """--kl-steps trains the transferred kernels on the host's next-token distribution: the saved
    model differs from the transfer-only one, distill.json stays, the checkpoints go."""
    from kernelmix.cli import main

    host = tiny_gemma()
    host.save_pretrained(tmp_path / "host")
    monkeypatch.setattr("kernelmix.pretrained.load_pretrained",
                        lambda name, **kw: (cv.load_converted(name), SavableByteTokenizer()))
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(TEXT * 2)
    base = ["convert", str(tmp_path / "host"), "--mixer", "darkformer", "--num-features", "8", "--window", "4",
            "--calib-text", str(corpus), "--seq-len", "32", "--calib-seqs", "2", "--transfer", "--transfer-steps", "3"]
    assert main(base + ["--out", str(tmp_path / "plain")]) == 0, capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "kl"), "--kl-steps", "3", "--kl-lr", "1e-2"]) == 0, (
        capsys.readouterr().err)
    printed = capsys.readouterr().out
    assert "logit distillation: KL(host ‖ converted)" in printed and "3 steps of logit distillation" in printed
    record = json.loads((tmp_path / "kl" / "distill.json").read_text())
    assert len(record["losses"]) == 3 and not (tmp_path / "kl" / "distill").exists()
    plain, tuned = (cv.kernels(cv.load_converted(tmp_path / name))[1] for name in ("plain", "kl"))
    assert not torch.equal(plain.transform, tuned.transform)
    with pytest.raises(SystemExit):  # --kl-steps without --transfer
        main(base[:-3] + ["--out", str(tmp_path / "x"), "--kl-steps", "2"])
    assert "--kl-steps distils after the attention transfer" in capsys.readouterr().err


@pytest.mark.parametrize("train_kernels", [False, True])
def test_lora_after_transfer_can_freeze_the_kernels(train_kernels):
    from kernelmix.pretrained import FinetuneConfig, finetune

    from .test_finetune import windows

    model = cv.convert(tiny_gemma(), cv.ConversionConfig(mixer="darkformer", num_features=8, window=2, layers="all"))
    before = {i: k.transform.detach().clone() for i, k in cv.kernels(model).items()}
    config = FinetuneConfig(mode="lora", steps=3, seq_len=32, lr=1e-2, warmup_steps=1, eval_every=3, eval_seqs=1,
                            train_kernels=train_kernels)
    tuned, _ = finetune(model, windows(), windows(2, seed=1), config)
    unchanged = all(torch.equal(k.transform, before[i]) for i, k in cv.kernels(tuned).items())
    assert unchanged != train_kernels
