"""``kernelmix recall``: multi-query associative recall per mixer, width and difficulty."""

from __future__ import annotations

import sys

from ..errors import Interrupted
from ..studies.settings import RecallConfig
from .commands import summary
from .options import add_options, from_args
from .paths import output_dir


def add_command(sub) -> None:
    """Register ``kernelmix recall``."""
    p = sub.add_parser(
        "recall", help=summary("recall"),
        description="Train a small model per mixer, width, sequence length and number of key-value pairs on MQAR "
        "sequences generated on the fly (keys and values from disjoint parts of the vocabulary, every key asked "
        "again later), score it on the query positions of a held-out set, and write results.json, results.md "
        "(accuracy: mixer x difficulty) and accuracy_vs_pairs.png. Finished cells in the output directory are "
        "reused, so an interrupted run continues where it stopped. The defaults take about 10 minutes on 2 CPU cores.",
    )
    add_options(p, RecallConfig)  # --threads: added and applied by kernelmix.cli.main
    p.set_defaults(func=_cli_recall, parser=p)


def _cli_recall(args) -> int:
    try:
        config = from_args(RecallConfig, args)
        output_dir(config.out_dir, "--out")  # a file or an unwritable parent is said now, not after training
    except ValueError as error:
        args.parser.error(str(error))
    from ..studies.recall import format_markdown, run_recall

    try:
        results = run_recall(config)
    except Interrupted as stop:  # SIGINT/SIGTERM: finished cells are saved; the message says how to go on
        print(stop, file=sys.stderr)
        return stop.exit_code
    print(format_markdown(results))
    return 0
