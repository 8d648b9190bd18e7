"""``kernelmix pretrained prepare|list``: real pretrained LMs offline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..config import Arg, Choice, Field, check
from ..pretrained.settings import KNOWN_MODELS, cache_dir
from .commands import summary
from .options import add_options, from_args
from .paths import output_dir

_CACHE_HELP = "cache root (default $KERNELMIX_CACHE or ~/.cache/kernelmix/pretrained)"


@dataclass
class ListOptions:
    cache: Annotated[str | None, Field(description=_CACHE_HELP)] = None

    def __post_init__(self) -> None:
        check(self)


@dataclass
class PrepareOptions:
    """The arguments of :func:`kernelmix.pretrained.prepare`."""

    name: Annotated[str, Choice(sorted(KNOWN_MODELS), "pretrained model"), Arg(positional=True)]
    cache: Annotated[str | None, Field(description=_CACHE_HELP)] = None
    dtype: Annotated[str, Choice(("bfloat16", "float32"), "dtype"), Field(description="dtype of the saved weights")] = (
        "bfloat16")
    force: Annotated[bool, Field(description="redo the preparation")] = False

    def __post_init__(self) -> None:
        check(self)


def _cli_prepare(args) -> int:
    from ..pretrained import prepare
    from ..studies.demo import DTYPES

    opts = from_args(PrepareOptions, args)
    output_dir(cache_dir(opts.cache), "--cache")  # before the minute of dequantizing
    # errors (a missing package, a full disk) are KernelmixError, ImportError or OSError: kernelmix prints them
    path = prepare(opts.name, root=opts.cache, dtype=DTYPES[opts.dtype], force=opts.force,
                   progress=lambda msg: print(f"  {msg}", flush=True))
    print(f"prepared {opts.name} in {path}")
    return 0


def _cli_list(args) -> int:
    root = cache_dir(from_args(ListOptions, args).cache)
    for name, known in KNOWN_MODELS.items():
        ready = (root / name / ".kernelmix-prepared").exists()
        print(f"{name:14s} {'prepared' if ready else 'not prepared':13s} {known.description}; install: {known.install}")
    print(f"cache: {root}")
    return 0


def add_command(sub) -> None:
    """Register ``kernelmix pretrained prepare|list`` on an argparse sub-parser set."""
    parser = sub.add_parser("pretrained", help=summary("pretrained"))
    psub = parser.add_subparsers(dest="pretrained_command", required=True)
    prep = psub.add_parser("prepare", help="one-time GGUF → safetensors preparation (model + tokenizer)")
    add_options(prep, PrepareOptions)
    prep.set_defaults(func=_cli_prepare)
    lst = psub.add_parser("list", help="known models and whether they are prepared")
    add_options(lst, ListOptions)
    lst.set_defaults(func=_cli_list)
