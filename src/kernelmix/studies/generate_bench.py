"""``kernelmix generate-bench``: generation throughput per mixer, cached vs uncached.

    from kernelmix.studies.generate_bench import GenerateBenchConfig, benchmark_generation, format_bench_table
    rows = benchmark_generation(GenerateBenchConfig(preset="tiny", mixers=["softmax", "performer"]))
    print(format_bench_table(rows))

Every mixer gets a freshly initialised ``preset`` model (same seed) and greedy
:func:`kernelmix.generate.generate` from the same random prompt: *cached* prefills once and then
runs one forward per new token; *uncached* reruns the full forward over the whole sequence per new
token (the slow baseline, on ``uncached_new_tokens`` tokens). tokens/s = ``batch · new tokens`` /
wall time of one call, prefill included, median of ``repeats`` timed calls.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..generate import generate
from ..layers.base import check_positive_int
from ..model import CausalLM, ModelConfig
from ..output import progress_bar
from .demo import DTYPES, sync_device
from .settings import GenerateBenchConfig

def generation_throughput(
    model: CausalLM,
    prompt_length: int,
    new_tokens: int,
    *,
    batch: int = 1,
    use_cache: bool = True,
    repeats: int = 1,
    seed: int = 0,
) -> float:
    """New tokens per second of greedy :func:`~kernelmix.generate.generate` (``batch · new_tokens``
    / wall time of one call, prefill included), median of ``repeats`` timed calls with
    ``time.perf_counter``.

    The prompt is ``batch`` rows of ``prompt_length`` random token ids (seeded); no eos, so every
    call generates exactly ``new_tokens`` tokens. One short untimed call warms up first."""
    for name, value in (("prompt_length", prompt_length), ("new_tokens", new_tokens), ("batch", batch),
                        ("repeats", repeats)):
        check_positive_int(name, value)
    if not isinstance(model, CausalLM):
        raise ValueError(f"model must be a kernelmix CausalLM, got {type(model).__name__}")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_length), generator=g).to(device)
    generate(model, prompt, min(new_tokens, 2), temperature=0.0, use_cache=use_cache)  # warm-up (also validates)
    times = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        generate(model, prompt, new_tokens, temperature=0.0, use_cache=use_cache)
        sync_device(device)
        times.append(time.perf_counter() - start)
    return batch * new_tokens / statistics.median(times)


@dataclass
class BenchRow:
    mixer: str
    parameters: int
    cached_tokens: int
    cached_tokens_per_s: float
    uncached_tokens: int  # 0: not measured
    uncached_tokens_per_s: float | None

    @property
    def speedup(self) -> float | None:
        if self.uncached_tokens_per_s is None:
            return None
        return self.cached_tokens_per_s / self.uncached_tokens_per_s


def benchmark_generation(config: GenerateBenchConfig, *, progress: bool = False) -> list[BenchRow]:
    """Cached vs uncached generation throughput of a freshly initialised ``config.preset`` model
    per mixer (same seed for every mixer); ``config.uncached_new_tokens`` 0 skips the uncached run.
    ``progress`` shows a bar (measurements done, the one running, time left) on stderr."""
    device = torch.device(config.device)
    sizes = dict(batch=config.batch, repeats=config.repeats, seed=config.seed)
    phases = 2 if config.uncached_new_tokens else 1
    bar = progress_bar(progress, "generate-bench", phases * len(config.mixers), fields={"run": "{}"})
    rows = []
    for name in config.mixers:
        torch.manual_seed(config.seed)
        model = CausalLM(ModelConfig.preset(config.preset, mixer=name))
        model = model.to(device=device, dtype=DTYPES[config.dtype]).eval()
        bar.update(run=f"{name} cached")
        cached = generation_throughput(model, config.prompt_length, config.new_tokens, use_cache=True, **sizes)
        bar.advance()
        uncached = None
        if config.uncached_new_tokens:
            bar.update(run=f"{name} uncached")
            uncached = generation_throughput(
                model, config.prompt_length, config.uncached_new_tokens, use_cache=False, **sizes
            )
            bar.advance()
        rows.append(BenchRow(
            name, model.num_parameters(), config.new_tokens, cached, config.uncached_new_tokens, uncached
        ))
    bar.close()
    return rows


def format_bench_table(rows: list[BenchRow]) -> str:
    """A plain-text table of :func:`benchmark_generation` rows."""
    header = (
        f"{'mixer':<12} {'params':>10} {'cached tok/s':>13} {'(tokens)':>9} {'uncached tok/s':>15} "
        f"{'(tokens)':>9} {'cached/uncached':>16}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        uncached = "-" if row.uncached_tokens_per_s is None else f"{row.uncached_tokens_per_s:.1f}"
        speedup = "-" if row.speedup is None else f"{row.speedup:.1f}x"
        lines.append(
            f"{row.mixer:<12} {row.parameters:>10,} {row.cached_tokens_per_s:>13.1f} {row.cached_tokens:>9} "
            f"{uncached:>15} {row.uncached_tokens or '-':>9} {speedup:>16}"
        )
    return "\n".join(lines)


__all__ = ["BenchRow", "GenerateBenchConfig", "benchmark_generation", "format_bench_table", "generation_throughput"]
