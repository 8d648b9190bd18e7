"""``kernelmix diagnose``: kernel diagnostics of a pretrained model converted to random features."""

from __future__ import annotations

import sys

from .. import pretrained as cv
from ..data import load_corpus
from ..pretrained import load_pretrained
from ..studies.diagnose import VARIANTS, diagnose, markdown
from .options import int_list

def _cli_diagnose(args) -> int:
    try:
        model, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer files; diagnose needs one")
        docs = [d.text for d in load_corpus(args.text).documents()]
        result = diagnose(model, tok, docs, args.out, layers=cv.parse_layers(args.layers), m_values=int_list(args.m),
                          variants=tuple(v for v in args.variants.split(",") if v), seq_len=args.seq_len,
                          calib_seqs=args.calib_seqs, eval_seqs=args.eval_seqs, seeds=args.seeds,
                          distill_steps=args.distill_steps, e2e_m=int_list(args.e2e_m), progress=True,
                          log=lambda msg: print(f"  {msg}", flush=True))
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    print(f"wrote {args.out}/diagnostics.json, diagnostics.md and PNG plots")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix diagnose``."""
    p = sub.add_parser("diagnose", help="kernel diagnostics of random-feature attention on a pretrained LM (JSON + md + PNG)")
    p.add_argument("model", help="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")
    p.add_argument("--out", default="diagnostics", help="output directory")
    p.add_argument("--text", default="shakespeare", help="real text: corpus name, dir, glob or file (calibration + held-out)")
    p.add_argument("--layers", default="all", help="all | global | local | comma-separated indices")
    p.add_argument("--m", default="16,64,256,1024", help="feature counts")
    p.add_argument("--variants", default=",".join(VARIANTS), help="performer,whiten,distill")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-seqs", type=int, default=2)
    p.add_argument("--eval-seqs", type=int, default=1)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--distill-steps", type=int, default=100)
    p.add_argument("--e2e-m", default="64,256,1024", help="feature counts for the end-to-end loss")
    p.set_defaults(func=_cli_diagnose)
