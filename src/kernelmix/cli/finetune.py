"""``kernelmix finetune``: converted models finetuned on real text at equal m and budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .. import pretrained as cv
from ..data import load_text_windows
from ..pretrained import MODES, FinetuneConfig, finetune, load_pretrained
from ..studies.finetune import DEFAULT_VARIANTS, INITS, compare_finetune, markdown
from .options import float_list

def _cli_finetune(args) -> int:
    try:
        config = FinetuneConfig(mode=args.mode, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                                lr=float_list(args.lr)[0], warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                                eval_seqs=args.eval_seqs, train_embeddings=args.train_embeddings, lora_rank=args.lora_rank,
                                seed=args.seed, spike_nats=args.spike_nats)
        config.validate()
        lrs = float_list(args.lr)
        variants = [v for v in args.variants.split(",") if v]
        layers = cv.parse_layers(args.layers)
        torch.set_num_threads(args.threads) if args.threads else None
        host, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer files; finetune needs one")
        train_w, val_w = load_text_windows(tok, args.text, config.seq_len, val_fraction=args.val_fraction,
                                           eval_seqs=config.eval_seqs, seed=args.seed)
        say = (lambda msg: print(f"  {msg}", flush=True))
        if cv.kernels(host):  # an already converted model: finetune it as it is and save it
            if len(lrs) != 1:
                raise ValueError("an already converted model is finetuned at one learning rate; give one --lr")
            out = Path(args.out)
            model, result = finetune(host, train_w, val_w, config, out_dir=out / "run", resume=args.resume,
                                     progress=True, label="converted")
            cv.save_converted(model, out / "model", tok)
            (out / "result.json").write_text(json.dumps(result, indent=1))
            print(f"val loss {result['initial']['loss']:.4f} → {result['final']['loss']:.4f} "
                  f"(acc {result['final']['accuracy']:.3f}), {result['num_spikes']} spikes; saved the model to {out / 'model'}")
            return 0
        report = compare_finetune(host, train_w, val_w, config, variants=variants, lrs=lrs, num_features=args.num_features,
                                  layers=layers, init=args.init, calib_windows=args.calib_seqs, distill_steps=args.distill_steps,
                                  out_dir=args.out, progress=True, log=say)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"wrote {args.out}/finetune.json, finetune.md and finetune_curves.png ({report['wall_s']:.0f} s)")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix finetune``."""
    p = sub.add_parser(
        "finetune",
        help="finetune converted models on real text: softmax vs Performer vs DARKFormer at equal m and budget (+ lr sweep)",
        description="Convert MODEL per variant (softmax = the host unchanged), finetune each with the same data, steps, m "
                    "and seed at each learning rate, and write finetune.json/md and curves. A MODEL directory that is "
                    "already converted (kernelmix convert) is finetuned as it is and saved to OUT/model. Finished runs "
                    "in OUT are reused; an interrupted run continues from its last checkpoint.",
    )
    p.add_argument("model", help="a prepared name (gemma3-270m, smollm2-135m), a local HF causal-LM directory, or a converted one")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="softmax,performer,darkformer (and cubit, experimental)")
    p.add_argument("--mode", choices=MODES, default="partial")
    p.add_argument("--num-features", type=int, default=64, help="m for performer and darkformer (equal m)")
    p.add_argument("--layers", default="all", help="all | global | local | comma-separated indices")
    p.add_argument("--init", choices=INITS, default="whiten", help="DARKFormer initialisation")
    p.add_argument("--text", default="shakespeare", help="corpus name, dir, glob or file (split by document)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", default="1e-4", help="learning rate, or several (comma-separated) for a sweep")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-seqs", type=int, default=4)
    p.add_argument("--calib-seqs", type=int, default=2, help="training windows used to whiten/distill")
    p.add_argument("--distill-steps", type=int, default=100)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--train-embeddings", action="store_true", help="mode=full: train the embedding / LM head too")
    p.add_argument("--spike-nats", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--resume", action="store_true", help="converted MODEL only: continue from OUT/run's last checkpoint")
    p.set_defaults(func=_cli_finetune)
