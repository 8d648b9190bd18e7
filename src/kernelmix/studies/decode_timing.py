"""One cached decode step after a prefill, as ``kernelmix bench`` and ``kernelmix gpu-check`` time
it (torch and the ops only: gpu-check runs where the CLI's other dependencies may be missing)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .. import ops


def decode_step_after_prefill(mixer: str, inputs: dict[str, torch.Tensor], position: int, *, chunk_size: int = 64,
                              backend: str = "auto", context: Callable = contextlib.nullcontext) -> Callable[[], None]:
    """A no-argument call that decodes one token, after the fast op has prefilled ``position``
    tokens of ``inputs`` (``[B, ≥ position + 1, H, d]`` q, k, v, r and ``[B, T, H]`` rho, beta;
    ``projection`` and ``transform`` for the random features) and returned its state. Each call
    continues the state the previous one returned, as generation does: a cache that grows in spare
    buffer rows (``append_rows``) is timed appending a row, not re-copying the prefill every call
    (the position drifts by the number of calls, a few dozen). Runs under no_grad and ``context()``."""
    per_token = ("q", "k", "v", "r", "rho", "beta")
    prefix = {key: (val[:, :position] if key in per_token else val) for key, val in inputs.items()}
    last = {key: (val[:, position:position + 1] if key in per_token else val) for key, val in inputs.items()}
    with torch.no_grad(), context():
        if mixer == "softmax":
            _, state = ops.softmax_attention(prefix["q"], prefix["k"], prefix["v"], return_state=True)
            step = lambda state: ops.softmax_attention_step(last["q"], last["k"], last["v"], state)  # noqa: E731
        elif mixer == "cubit":
            _, state = ops.cubit_attention(prefix["q"], prefix["k"], prefix["v"], prefix["r"], rho=prefix["rho"],
                                           chunk_size=chunk_size, return_state=True, backend=backend)
            step = lambda state: ops.cubit_attention_step(last["q"], last["k"], last["v"], last["r"], state, rho=last["rho"])  # noqa: E731
        elif mixer == "deltaformer":
            _, state = ops.deltaformer_attention(prefix["q"], prefix["k"], prefix["v"], beta=prefix["beta"],
                                                 chunk_size=chunk_size, return_state=True, backend=backend)
            step = lambda state: ops.deltaformer_attention_step(last["q"], last["k"], last["v"], state, beta=last["beta"])  # noqa: E731
        else:
            transform = inputs["transform"] if mixer == "darkformer" else None
            _, state = ops.random_feature_attention(prefix["q"], prefix["k"], prefix["v"], inputs["projection"],
                                                    transform=transform, chunk_size=chunk_size, return_state=True,
                                                    backend=backend)
            step = lambda state: ops.random_feature_attention_step(  # noqa: E731
                last["q"], last["k"], last["v"], inputs["projection"], state, transform=transform
            )
    newest = [state]

    def run() -> None:
        with torch.no_grad(), context():
            _, newest[0] = step(newest[0])

    return run


__all__ = ["decode_step_after_prefill"]
