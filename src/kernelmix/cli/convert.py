"""``kernelmix convert``: a pretrained causal LM converted to random-feature (or Cubit) attention."""

from __future__ import annotations

import sys

from ..data import bos_windows, load_corpus
from ..pretrained import INITS, MIXERS, PROJECTIONS, ConversionConfig, convert, load_pretrained, parse_layers, save_converted

def _cli_convert(args) -> int:
    try:
        config = ConversionConfig(mixer=args.mixer, layers=parse_layers(args.layers), num_features=args.num_features,
                                  projection=args.projection, seed=args.seed, chunk_size=args.chunk_size, ridge=args.ridge)
        config.init = args.init
        config.validate()
        model, tok = load_pretrained(args.model)
        calibration = None
        if args.init != "identity":
            if tok is None:
                raise ValueError(f"init={args.init!r} needs the model's tokenizer in {args.model}")
            docs = [d.text for d in load_corpus(args.calib_text).documents()]
            calibration = bos_windows(tok, docs, args.seq_len, args.calib_seqs)
        convert(model, config, calibration=calibration, init=args.init, steps=args.steps, progress=True,
                log=lambda msg: print(f"  {msg}", flush=True))
        save_converted(model, args.out, tok)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted layers {config.layer_indices} to {config.mixer} (m={config.num_features}, init={args.init}); "
          f"saved to {args.out} — reload with kernelmix.pretrained.load_converted({str(args.out)!r})")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix convert``."""
    p = sub.add_parser("convert", help="convert a pretrained causal LM (prepared name or HF dir) to random-feature attention")
    p.add_argument("model", help="a prepared name (gemma3-270m, smollm2-135m) or a local HF causal-LM directory")
    p.add_argument("--out", required=True, help="directory for the converted model (save_pretrained + tokenizer)")
    p.add_argument("--mixer", choices=MIXERS, default="darkformer")
    p.add_argument("--layers", default="all", help="all | global | local | comma-separated indices")
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--projection", choices=PROJECTIONS, default="orthogonal")
    p.add_argument("--init", choices=INITS, default="identity")
    p.add_argument("--calib-text", default="shakespeare", help="corpus for whiten/distill (name, dir, glob or file)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="distillation steps per layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--ridge", type=float, default=4.0, help="cubit (experimental): initial ridge λ")
    p.set_defaults(func=_cli_convert)
