"""Does the error after o_proj rank the global layers as their loss gaps do (11 > 5 > 17)?

Run from the repository root after the command in README.md (it reads that run's transfer from
runs/conv-layers/work): `python results/conversion-layers/o_proj_check.py > results/conversion-layers/o_proj_check.log`.
On the held-out 2,048-token window of the report: each global layer's relative error before and
after its output projection, and the absolute squared error after it."""
import torch
from pathlib import Path
from kernelmix.studies.conversion_settings import ConversionReportSettings
from kernelmix.studies import conversion_report as cr
from kernelmix.pretrained import load_pretrained, kernels
from kernelmix.pretrained.calibration import capture
from kernelmix.pretrained.transfer import layer_pieces
from kernelmix.data import load_corpus, split_texts, text_windows
torch.set_num_threads(1)
s = ConversionReportSettings(layers=("global",), variants=("darkformer",), feature_sweep=(), lora_variants=())
host, tok = load_pretrained(s.model)
for p in host.parameters(): p.requires_grad_(False)
host.eval()
tr, va = split_texts(load_corpus(s.text).documents(), s.val_fraction, s.seed)
data = {"calibration": text_windows(tok, tr, s.calib_len, s.calib_seqs), "error": text_windows(tok, va, s.error_len, 1)}
model, _ = cr._converted(s, host, data, "global", "darkformer", Path("runs/conv-layers/work"), False, print)
layers = list(kernels(model))
captured = capture(model, data["error"], layers=layers)
with torch.no_grad():
    for i in layers:
        attn = model.model.layers[i].self_attn
        piece = layer_pieces(captured[i], 2048)[0]
        out = kernels(model)[i].attend(piece.query, piece.key, piece.value, None, piece.scaling).float()
        y = piece.target
        e = out - y
        T = y.shape[1]
        wo = lambda x: attn.o_proj(x.reshape(1, T, -1).to(attn.o_proj.weight.dtype)).float()
        pre = e.pow(2).mean() / y.pow(2).mean()
        post = wo(e).pow(2).mean() / wo(y).pow(2).mean()
        print(f"layer {i}: rel err pre {pre:.4f} post-o_proj {post:.4f}  abs post {wo(e).pow(2).mean():.4e}  abs exact post {wo(y).pow(2).mean():.4e}", flush=True)
