"""What every (mixer, length) trains under a compare's budget (tokens, FLOPs or time): :func:`plan_budget`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import KernelmixError
from .settings import REFERENCE_MIXER, CompareConfig

@dataclass
class BudgetPlan:
    """What every (mixer, length) trains under a config's budget: ``steps``; ``flops_per_token``
    (training FLOPs); ``reference``: per length, the equal amount per run (tokens, FLOPs or
    seconds); ``seconds_per_step``: the time budget's calibration (else empty)."""

    budget: str
    steps: dict[tuple[str, int], int]
    flops_per_token: dict[tuple[str, int], float]
    reference: dict[int, float]
    seconds_per_step: dict[tuple[str, int], float] = field(default_factory=dict)

    def to_dict(self, config: CompareConfig) -> dict[str, Any]:
        """The ``budget`` record of results.json (the token budget's has the fields it always had)."""
        tokens = config.tokens_per_run
        if self.budget == "tokens":
            return {"equal": "tokens", "tokens_per_run": tokens, "tokens_per_step": config.tokens_per_step,
                    "steps": config.steps, "note": "equal training tokens per run; mixers differ in cost per token, "
                    "see each run's flops and train_s"}
        record = {
            "equal": self.budget, "tokens_per_step": config.tokens_per_step, "steps": config.steps,
            "reference": "--seconds" if config.seconds is not None else REFERENCE_MIXER,
            ("flops_per_run" if self.budget == "flops" else "seconds_per_run"): {
                str(t): v for t, v in self.reference.items()},
            "steps_per_run": {m: {str(t): self.steps[m, t] for t in config.lengths} for m in config.mixers},
        }
        if self.budget == "flops":
            record["note"] = (f"equal training FLOPs per run: {REFERENCE_MIXER}'s for {config.steps} steps × "
                              f"{config.tokens_per_step:,} tokens at each length (analytic counts, "
                              "kernelmix.studies.flops); each mixer trains round(those FLOPs / its FLOPs per step) "
                              "steps, its warmup scaled to them")
        else:
            record["seconds_per_step"] = {m: {str(t): v for (m2, t), v in self.seconds_per_step.items() if m2 == m}
                                          for m in sorted({m for m, _ in self.seconds_per_step})}
            record["note"] = ("equal training seconds per run on this machine, from a calibration of each mixer's "
                              "seconds per step; measured, so noisy (±10-30% on a shared machine): "
                              "compare each run's train_s")
        return record


def plan_budget(config: CompareConfig, vocab_size: int,
                seconds_per_step: dict[tuple[str, int], float] | None = None) -> BudgetPlan:
    """The steps of every (mixer, length) under ``config.budget``: ``config.steps`` for tokens; for
    FLOPs and time ``round(reference / cost of one step)`` (a KernelmixError where that is 0), the reference being what
    :data:`REFERENCE_MIXER` spends on ``steps × tokens_per_step`` tokens (time: ``config.seconds``
    when given). ``seconds_per_step``: the time budget's calibration, per (mixer, length)."""
    if config.budget == "time" and seconds_per_step is None:
        raise ValueError("the time budget needs the calibration's seconds_per_step (see calibrate)")
    tokens = config.steps * config.tokens_per_step
    mixers = list(dict.fromkeys([*config.mixers, REFERENCE_MIXER]))
    flops = {(m, t): config.flops_per_token(m, t, vocab_size) for m in mixers for t in config.lengths}
    steps: dict[tuple[str, int], int] = {}
    reference: dict[int, float] = {}
    for length in config.lengths:
        if config.budget == "tokens":
            reference[length] = float(tokens)
            steps.update({(m, length): config.steps for m in config.mixers})
            continue
        if config.budget == "flops":
            reference[length] = tokens * flops[REFERENCE_MIXER, length]
            step_cost = {m: flops[m, length] * config.tokens_per_step for m in config.mixers}
        else:
            reference[length] = (config.seconds if config.seconds is not None
                                 else config.steps * seconds_per_step[REFERENCE_MIXER, length])
            step_cost = {m: seconds_per_step[m, length] for m in config.mixers}
        short = {m: step_cost[m] for m in config.mixers if round(reference[length] / step_cost[m]) < 1}
        if short:  # one step would be over the budget, and the results would claim the budget
            raise KernelmixError(_budget_below_one_step(config, length, reference[length], short))
        for mixer in config.mixers:  # round() ties to even
            steps[mixer, length] = round(reference[length] / step_cost[mixer])
    return BudgetPlan(config.budget, steps, flops, reference, dict(seconds_per_step or {}))


def _budget_below_one_step(config: CompareConfig, length: int, budget: float, cost: dict[str, float]) -> str:
    """The message for a budget that buys some mixer less than half a training step at ``length``."""
    unit = "s" if config.budget == "time" else " FLOPs"
    worst = max(cost, key=cost.get)
    given = f"--seconds {config.seconds:g}" if config.seconds is not None else (
        f"--steps {config.steps} of {REFERENCE_MIXER} ({budget:.3g}{unit})")
    needed = f"--seconds {2 * cost[worst]:.2g} or more" if config.seconds is not None else (
        f"--steps {math.ceil(config.steps * cost[worst] / budget)} or more")
    each = ", ".join(f"{m} {c:.3g}{unit}" for m, c in cost.items())
    return (f"the {config.budget} budget at length {length}, {given}, is less than one training step of "
            f"{', '.join(cost)} (one step: {each}): each would train one step, over the budget, while the results "
            f"claim the budget; give {needed}")
