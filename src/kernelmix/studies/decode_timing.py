"""One cached decode step after a prefill, as ``kernelmix bench`` and ``kernelmix gpu-check`` time
it (torch and the ops only: gpu-check runs where the CLI's other dependencies may be missing)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..layers import registry


def decode_step_after_prefill(mixer: str, inputs: dict[str, torch.Tensor], position: int, *, chunk_size: int = 64,
                              backend: str = "auto", context: Callable = contextlib.nullcontext) -> Callable[[], None]:
    """A no-argument call that decodes one token, after the fast op has prefilled ``position``
    tokens of ``inputs`` (``[B, ≥ position + 1, H, d]`` q, k, v, r and ``[B, T, H]`` rho, beta;
    ``projection`` and ``transform`` for the random features) and returned its state (the mixer's
    registered op and step calls, :mod:`kernelmix.ops.calls`). Each call continues the state the
    previous one returned, as generation does: a cache that grows in spare buffer rows
    (``append_rows``) is timed appending a row, not re-copying the prefill every call (the position
    drifts by the number of calls, a few dozen). Runs under no_grad and ``context()``."""
    per_token = ("q", "k", "v", "r", "rho", "beta")
    prefix = {key: (val[:, :position] if key in per_token else val) for key, val in inputs.items()}
    last = {key: (val[:, position:position + 1] if key in per_token else val) for key, val in inputs.items()}
    call, step_call = registry.op_call(mixer), registry.step_call(mixer)
    with torch.no_grad(), context():
        _, state = call(prefix, chunk_size=chunk_size, backend=backend, return_state=True)
    newest = [state]

    def run() -> None:
        with torch.no_grad(), context():
            _, newest[0] = step_call(last, newest[0])

    return run


__all__ = ["decode_step_after_prefill"]
