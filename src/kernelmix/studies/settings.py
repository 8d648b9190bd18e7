"""The configs of the smaller studies: what ``kernelmix demo``, ``bench``, ``generate-bench`` and
``recall`` run (:class:`DemoConfig`, :class:`BenchConfig`, :class:`GenerateBenchConfig`,
:class:`RecallConfig`).

Plain data: this module imports neither torch nor the model, the data or the ops (a check that
needs them imports them when a config is built), so that the command line builds and checks
these commands' options without them. Each study exports its config as before
(``from kernelmix.studies.bench import BenchConfig``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from ..config import Arg, Choice, Distinct, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check
from ..errors import KernelmixError
from ..layers import MIXERS, registry
from ..presets import PRESETS
from .compare.settings import DEFAULT_MIXERS, MIXER_VARIANTS

if TYPE_CHECKING:
    from ..model import ModelConfig

DTYPE_NAMES = ("float32", "bfloat16")  # the dtypes the studies run in (kernelmix.studies.demo.DTYPES)
AUTOCAST_NAMES = ("bfloat16", "float16")  # bench --autocast (kernelmix.studies.bench.AUTOCAST_DTYPES)
PEERS = ("performer-pytorch", "fla-deltaformer-naive", "cubit-dense")  # bench --peers
MAX_NEW_TOKENS = 1024  # generate-bench's default new-token count, where the preset's max_seq_len allows it
RECALL_FORMAT = "kernelmix.recall/1"
# kernelmix.data.recall's (that module imports torch): tests/test_recall.py keeps the two equal
POWER_A = 0.01  # Zoology's default exponent for the query placement


def check_device(text: str):
    """``text`` as a torch device that exists here; ValueError naming the problem otherwise (torch is
    imported here, when a config is checked, not when the command line reads this module)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {text!r} asked for, but torch sees no CUDA device; "
                         "use --device cpu (or a CUDA build of torch)")
    return device


@dataclass
class DemoConfig:
    """What :func:`~kernelmix.studies.demo.run_demo` runs (``kernelmix demo``'s options)."""

    batch: PositiveInt = 2
    length: PositiveInt = 512
    heads: PositiveInt = 4
    head_dim: PositiveInt = 32
    num_features: Annotated[PositiveInt, Field(description="random features m")] = 64
    repeats: PositiveInt = 3
    device: Annotated[str, Field(description="torch device for the fast paths, e.g. cuda")] = "cpu"
    dtype: Annotated[str, Choice(DTYPE_NAMES, "dtype"), Field(description="dtype of the fast paths")] = "float32"

    def __post_init__(self) -> None:
        check(self)
        check_device(self.device)


@dataclass
class BenchConfig:
    """What :func:`~kernelmix.studies.bench.run_bench` measures (``kernelmix bench``'s options)."""

    mixers: Annotated[list[str], Choice(registry.OP_MIXERS, "mixer"), Distinct("mixer"),
                      Field(min_length=1, description="comma-separated (default: all)")] = (
        field(default_factory=lambda: list(registry.OP_MIXERS)))
    lengths: Annotated[list[PositiveInt], Distinct("length"), Field(min_length=1, description="e.g. 256,1024,4096")] = (
        field(default_factory=lambda: [256, 512, 1024, 2048, 4096]))
    decode_positions: Annotated[list[PositiveInt], Distinct("position")] = (
        field(default_factory=lambda: [256, 1024, 4096]))
    batch: PositiveInt = 1
    heads: PositiveInt = 8
    head_dim: PositiveInt = 64
    num_features: PositiveInt = 128
    chunk_size: PositiveInt = 64
    dtype: Annotated[str, Choice(DTYPE_NAMES, "dtype"), Field(description="the inputs' dtype")] = "float32"
    autocast: Annotated[str | None, Choice(AUTOCAST_NAMES, "autocast dtype"), Field(
        description="run the forward passes under torch.autocast in this dtype "
                    "(fp32 inputs; needs --dtype float32)")] = None
    device: str = "cpu"
    repeats: PositiveInt = 3
    memory: Annotated[bool, Field(description="measure peak memory, each op in a fresh process "
                                              "(--no-memory skips it)")] = True
    peers: Annotated[list[str], Choice(PEERS, "peer"), Distinct("peer"), Field(
        description="comma-separated peers measured in the same run: performer-pytorch, fla-deltaformer-naive, "
        "cubit-dense (skipped with a note when not installed)")] = field(default_factory=list)
    peer_max_length: Annotated[PositiveInt, Field(description="largest T for the peers")] = 2048

    def __post_init__(self) -> None:
        check(self)
        check_device(self.device)
        if self.autocast is not None and self.dtype != "float32":
            raise KernelmixError(f"autocast runs fp32 inputs under torch.autocast: use --dtype float32 with --autocast "
                                 f"{self.autocast}, got --dtype {self.dtype}")


@dataclass
class GenerateBenchConfig:
    """What ``kernelmix generate-bench`` measures (and
    :func:`~kernelmix.studies.generate_bench.benchmark_generation` takes)."""

    preset: Annotated[str, Choice(PRESETS, "preset")] = "small"
    mixers: Annotated[list[str], Choice(MIXERS, "mixer"), Distinct("mixer"),
                      Field(min_length=1, description="comma-separated (default: all)")] = (
        field(default_factory=lambda: list(MIXERS)))
    prompt_length: PositiveInt = 32
    new_tokens: Annotated[PositiveInt | None, Field(description=(
        f"new tokens of the cached run (default: {MAX_NEW_TOKENS}, or fewer so that the prompt plus them fit the "
        "preset's max_seq_len)"))] = None
    uncached_new_tokens: Annotated[NonNegativeInt | None, Field(
        description="measure the slow uncached baseline on this many new tokens "
                    "(default: --new-tokens; 0 skips it)")] = None
    batch: PositiveInt = 1
    repeats: PositiveInt = 1
    seed: int = 0
    device: Annotated[str, Field(description="cpu or cuda[:N]")] = "cpu"
    dtype: Annotated[str, Choice(DTYPE_NAMES, "dtype"), Field(description="dtype of the models")] = "float32"

    def __post_init__(self) -> None:
        check(self)
        check_device(self.device)
        max_seq_len = PRESETS[self.preset]["max_seq_len"]
        room = max_seq_len - self.prompt_length
        if self.new_tokens is None:
            if room < 1:
                raise ValueError(
                    f"prompt_length {self.prompt_length} leaves no room for new tokens within the preset's "
                    f"max_seq_len = {max_seq_len}; lower prompt_length"
                )
            self.new_tokens = min(MAX_NEW_TOKENS, room)
        if self.uncached_new_tokens is None:
            self.uncached_new_tokens = self.new_tokens
        longest = max(self.new_tokens, self.uncached_new_tokens)
        if longest > room:
            raise ValueError(
                f"prompt_length {self.prompt_length} + new tokens {longest} is beyond the preset's "
                f"max_seq_len = {max_seq_len}; ask for at most {max(room, 0)} new tokens or a shorter prompt"
            )


@dataclass
class RecallConfig:
    """What ``kernelmix recall`` trains. The defaults (6 mixers × width 64 × T=64 × pairs 4, 8, 16,
    600 steps × 32 sequences per cell) finish in under 10 minutes on 2 CPU cores (measured: see
    results/recall/README.md); docs/recall.md says why each setting is what it is."""

    mixers: Annotated[list[str], Choice(MIXER_VARIANTS, "mixer"), Distinct("mixer"),
                      Field(min_length=1, description="comma-separated")] = (
        field(default_factory=lambda: list(DEFAULT_MIXERS)))
    widths: Annotated[list[PositiveInt], Distinct("width"),
                      Field(min_length=1, description="model widths (hidden sizes), e.g. 32,64,128")] = (
        field(default_factory=lambda: [64]))
    lengths: Annotated[list[Annotated[int, Field(ge=4)]], Distinct("length"),
                       Field(min_length=1, description="sequence lengths T")] = (
        field(default_factory=lambda: [64]))
    pairs: Annotated[list[PositiveInt], Distinct("pair count"), Field(min_length=1, description=(
        "numbers of key-value pairs (a cell with 4 x pairs > T is skipped)"))] = (
        field(default_factory=lambda: [4, 8, 16]))
    vocab_size: Annotated[int,
                          Field(ge=3, description="vocabulary: a filler token, then keys and values, half each")] = 128
    layers: Annotated[PositiveInt, Field(description="blocks of the model (recall needs at least 2)")] = 2
    heads: Annotated[PositiveInt, Field(description="heads per mixer (head dim = width / heads)")] = 1
    init_std: Annotated[PositiveFloat,
                        Field(description="the model's initializer_range (std of the projections at init)")] = 0.1
    embed_std: Annotated[PositiveFloat, Field(description="std of the token embedding at init")] = 0.3
    train_queries: Annotated[str, Choice(("all", "pairs"), "train_queries"), Field(description=(
        "queries per training sequence: all (every slot after the pairs) or pairs "
        "(one per pair, as held out)"))] = "all"
    steps: Annotated[PositiveInt, Field(description="optimizer steps per cell")] = 600
    batch_size: Annotated[PositiveInt, Field(description="sequences per step")] = 32
    lr: Annotated[PositiveFloat, Field(description="peak learning rate")] = 2e-3
    min_lr: Annotated[NonNegativeFloat | None, Field(description=(
        "the cosine decay's end (default: lr, i.e. no decay after warmup)"))] = None
    warmup_steps: NonNegativeInt = 40
    weight_decay: NonNegativeFloat = 0.1
    power_a: Annotated[float,
                       Field(gt=0, le=1, description="query placement: P(slot) ~ (slot+1)^(power_a-1); 1: uniform")] = (
        POWER_A)
    eval_examples: Annotated[PositiveInt, Field(description="held-out sequences per (T, pairs)")] = 256
    seed: Annotated[NonNegativeInt, Field(description="initial weights and the training batches")] = 0
    eval_seed: Annotated[NonNegativeInt, Field(description="the held-out set (must differ from --seed)")] = 1
    out_dir: Annotated[str, Arg(flag="--out"), Field(description="output directory")] = "runs/recall"
    device: Annotated[str, Choice(("auto", "cpu", "cuda"), "device")] = "cpu"

    def __post_init__(self) -> None:
        check(self)
        if self.min_lr is None:  # held: a decay lowers the rate before the jump to recall has come
            self.min_lr = self.lr
        if self.min_lr > self.lr:
            raise KernelmixError(f"min_lr must be at most lr, got min_lr={self.min_lr}, lr={self.lr}; lower min_lr "
                                 "or leave it out (= lr)")
        if self.seed == self.eval_seed:
            raise KernelmixError(f"seed and eval_seed are both {self.seed}: the held-out set must come from another "
                                 f"seed than the training batches; pass e.g. --eval-seed {self.seed + 1}")
        self.widths, self.lengths, self.pairs = sorted(self.widths), sorted(self.lengths), sorted(self.pairs)
        from ..data.recall import key_range

        keys = len(key_range(self.vocab_size))
        if max(self.pairs) > keys:
            raise KernelmixError(f"pairs {max(self.pairs)} need as many distinct keys, but vocab_size "
                                 f"{self.vocab_size} has {keys} key tokens; "
                                 f"use --vocab-size {2 * max(self.pairs) + 1} or more, or fewer pairs")
        if not self.cells():
            raise KernelmixError("no (T, pairs) cell fits: a sequence of length T holds at most T / 4 pairs (pairs "
                                 f"and their queries), got lengths {self.lengths} and pairs {self.pairs}; use longer "
                                 "lengths or fewer pairs")
        for width in self.widths:  # a width the heads do not divide fails now, not after the first cells
            self.model_config(self.mixers[0], width, self.lengths[0])

    def cells(self) -> list[tuple[int, int]]:
        """The (T, pairs) that fit (4 · pairs <= T), in table order."""
        return [(t, n) for t in self.lengths for n in self.pairs if 4 * n <= t]

    def skipped(self) -> list[tuple[int, int]]:
        return [(t, n) for t in self.lengths for n in self.pairs if 4 * n > t]

    def model_config(self, mixer: str, width: int, length: int) -> ModelConfig:
        from ..model import ModelConfig

        base, options = MIXER_VARIANTS[mixer]
        if width % self.heads:
            raise KernelmixError(f"width {width} is not a multiple of heads {self.heads}; use widths that {self.heads} "
                                 "divides or change --heads")
        # untied embeddings and init_std 0.1 rather than the library's tied 0.02: with 0.02 the attention
        # logits start so flat that a 2-layer model sits for thousands of steps at "guess one of the
        # values" (docs/recall.md, "Why these settings"). The SwiGLU is as wide as the model, not 8/3 of
        # it: recall is the mixers' work, and the MLP was 60% of each step's time.
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=width, num_layers=self.layers, num_heads=self.heads,
                           intermediate_size=width, max_seq_len=length, chunk_size=min(64, length), mixer=base,
                           tie_embeddings=False, initializer_range=self.init_std,
                           mixer_options=json.loads(json.dumps(options)))

    def run_key(self, mixer: str, width: int, length: int, pairs: int) -> str:
        """A hash of everything that defines the cell and its evaluation (not out_dir or the grid)."""
        settings = {
            "format": RECALL_FORMAT, "mixer": mixer, "model": self.model_config(mixer, width, length).to_dict(),
            "length": length, "pairs": pairs, "device": self.device,
            **{name: getattr(self, name) for name in ("embed_std", "steps", "batch_size", "lr", "min_lr",
                                                      "warmup_steps", "weight_decay", "power_a", "train_queries",
                                                      "eval_examples", "seed", "eval_seed")},
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = [
    "AUTOCAST_NAMES", "DTYPE_NAMES", "MAX_NEW_TOKENS", "PEERS", "POWER_A", "RECALL_FORMAT", "BenchConfig", "DemoConfig",
    "GenerateBenchConfig", "RecallConfig", "check_device",
]
