"""``--budget time``: each mixer's measured seconds per training step (:func:`calibrate`), kept in
``calibration.json`` so that the same command reuses them."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import Interrupted, KernelmixError
from ...output import write_json_atomic
from ...training.checkpoint import writing
from ...training.signals import catch_stop_signals, signal_name
from .settings import CALIBRATION_FORMAT, CALIBRATION_WARMUP, REFERENCE_MIXER, CompareConfig

def calibrate(config: CompareConfig, env, note: Callable[[str], None] = print) -> dict[tuple[str, int], float]:
    """--budget time: the seconds per training step of every compared mixer (and of
    :data:`REFERENCE_MIXER` unless ``config.seconds`` is given) at every length, measured in a short
    run of :meth:`CompareConfig.calibration_config` each, or read from ``calibration.json`` where it
    was measured before with the same settings (so the same command reuses its finished runs;
    delete the file to measure again). A stop signal keeps what was measured."""
    from ...training import distributed as distrib

    path = Path(config.out_dir) / "calibration.json"
    saved = _read_calibrations(path)
    distrib.barrier(env)  # every process has read it before rank 0 adds to it
    mixers = list(dict.fromkeys([*config.mixers, *([REFERENCE_MIXER] if config.seconds is None else [])]))
    keys = {(m, t): config.calibration_key(m, t, env.world_size) for t in config.lengths for m in mixers}
    known = sum(key in saved for key in keys.values())
    if known:
        note(f"  {known} of {len(keys)} speeds (seconds per step) from {path}, measured before with these settings; "
             "delete it to measure them again")
    measured = {}
    with catch_stop_signals() as signals:
        for length in config.lengths:
            for mixer in mixers:
                key = keys[mixer, length]
                if key not in saved:
                    saved[key] = _measure_step_seconds(config, mixer, length, env)
                    if env.is_main:
                        with writing(path):
                            write_json_atomic(path, {"format": CALIBRATION_FORMAT, "entries": saved}, indent=1)
                    note(f"  calibrated {mixer} T={length}: {saved[key]['seconds_per_step']:.3g} s per step (median of "
                         f"{config.calibration_steps} steps after {CALIBRATION_WARMUP} untimed)")
                    number = distrib.agree_on_signal(env, signals.received)
                    if number is not None:
                        raise Interrupted(f"kernelmix compare interrupted by {signal_name(number)} while measuring the "
                                          "mixers' speeds for --budget time; the ones measured are kept in "
                                          f"{str(path)!r}: run the same command again to continue", number)
                measured[mixer, length] = float(saved[key]["seconds_per_step"])
    if env.is_main:
        with contextlib.suppress(OSError):
            (Path(config.out_dir) / "calibration").rmdir()  # the calibrations' scratch space, if empty
    return measured


def _read_calibrations(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of ``calibration.json`` (none when it is missing or damaged: measured again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if (not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT
            or not isinstance(data.get("entries"), dict)):
        return {}
    return {k: v for k, v in data["entries"].items()
            if isinstance(v, dict) and isinstance(v.get("seconds_per_step"), (int, float))}


def _measure_step_seconds(config: CompareConfig, mixer: str, length: int, env) -> dict[str, Any]:
    """Train ``mixer`` at ``length`` for the calibration's steps in a scratch directory (removed
    after) and return its seconds per step: the median over the timed steps of each step's time as
    train() logs it (the same clock as a run's tokens/s: optimizer steps only)."""
    from ...training import distributed as distrib
    from ...training import train

    directory = Path(config.out_dir) / "calibration" / f"{mixer}-T{length}"
    train_config = config.calibration_config(mixer, length, directory, env.world_size)
    if env.is_main and directory.exists():  # a calibration interrupted earlier: measured again from the start
        shutil.rmtree(directory)
    distrib.barrier(env)
    try:
        train(train_config, progress=False)
    except Interrupted as stop:
        raise Interrupted(
            f"kernelmix compare interrupted by {signal_name(stop.signal_number)} while measuring the speed of {mixer} "
            f"at T={length} for --budget time; the speeds measured before are kept in calibration.json: run the same "
            "command again to continue", stop.signal_number) from None
    distrib.barrier(env)
    rates = _step_rates(directory / "metrics.jsonl")[CALIBRATION_WARMUP:]
    distrib.barrier(env)  # every process has read the metrics
    if env.is_main:
        shutil.rmtree(directory, ignore_errors=True)
    if not rates:
        raise KernelmixError(f"the calibration of {mixer} at T={length} logged no timed step; "
                             "raise --calibration-steps")
    step_seconds = [config.tokens_per_step / rate for rate in rates]
    return {"mixer": mixer, "length": length, "seconds_per_step": statistics.median(step_seconds),
            "step_seconds": step_seconds, "untimed_steps": CALIBRATION_WARMUP, "threads": torch.get_num_threads(),
            "processes": env.world_size, "device": config.device}


def _step_rates(metrics: Path) -> list[float]:
    """The tokens/s of every logged training step of a run, in order (skipped updates too: they took the time)."""
    rates = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == "train" and record.get("tokens_per_s"):
                rates.append(float(record["tokens_per_s"]))
    return rates
