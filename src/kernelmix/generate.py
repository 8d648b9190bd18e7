"""Autoregressive generation with the model's cache.

    from kernelmix.generate import generate
    tokens = generate(model, prompt, 64, temperature=0.0)                     # greedy
    tokens = generate(model, prompt, 64, top_p=0.9, generator=torch.Generator().manual_seed(0))

With ``use_cache=True`` (the default) the prompt is prefilled in one forward and every new token
is one forward of a single token that continues the cache: constant work per token for Performer
and DARKFormer (their cache is an m×d state per head), O(t) for softmax, Cubit and DeltaFormer
(their cache grows with the sequence). ``use_cache=False`` recomputes the full forward over the
whole sequence at every step — the slow baseline, kept for measurement and as a reference.

Batched prompts of different lengths are LEFT-padded and described by ``attention_mask`` (1 for
real tokens, 0 for padding); the model masks the padding out, so each row generates what it would
alone. Its throughput, cached vs uncached, is measured by :mod:`kernelmix.studies.generate_bench`
(``kernelmix generate-bench``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .errors import KernelmixError
from .model import CausalLM

# ---------------------------------------------------------------------------------------------
# Validation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    if value is None:
        return
    if not _is_int(value) or not 0 <= value < vocab_size:
        raise KernelmixError(f"{name} must be a token id in [0, {vocab_size}) (vocab_size) or None, got {value!r}")


def check_left_padded(mask: Tensor) -> None:
    """Refuse an ``attention_mask`` ``[B, T]`` (bool) that is not LEFT-padded: in every row the zeros
    come first and the last token is real. Generation continues each row after its last token, so
    a right-padded row would continue after its padding (Hugging Face's ``generate`` only warns)."""
    ends_in_padding = ~mask[:, -1]
    gap = mask[:, :-1] & ~mask[:, 1:]  # a real token followed by padding
    bad = (ends_in_padding | gap.any(dim=1)).nonzero()
    if len(bad):
        row = int(bad[0])
        where = "ends in padding" if bool(ends_in_padding[row]) else (
            f"has padding after a real token at index {int(gap[row].nonzero()[0])}")
        raise KernelmixError(
            f"generation needs LEFT padding, but row {row} of attention_mask {where}: each row is continued after "
            "its last token, so its padding must come first. Pad batched prompts on the left — with a Hugging Face "
            'tokenizer, set tokenizer.padding_side = "left" before tokenizing'
        )


def _check_generate_args(
    model: Any,
    input_ids: Any,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    eos_token_id: Any,
    pad_token_id: Any,
    attention_mask: Any,
    generator: Any,
    use_cache: Any,
) -> Tensor | None:
    """Raise KernelmixError for any bad argument; returns the attention mask as bool (or None)."""
    if not isinstance(model, CausalLM):
        raise KernelmixError(f"model must be a kernelmix CausalLM, got {type(model).__name__}")
    config = model.config
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise KernelmixError(
            f"input_ids must be a [B, T] tensor of token ids, got {got}; add a batch dim with ids.unsqueeze(0)"
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise KernelmixError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}; pass ids.long()")
    if torch.iinfo(input_ids.dtype).max < config.vocab_size - 1:
        # the new tokens are returned in the prompt's dtype: a larger id would wrap around silently
        raise KernelmixError(
            f"input_ids are {input_ids.dtype}, which cannot hold the token ids this model generates (up to "
            f"{config.vocab_size - 1}); pass input_ids.long()"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise KernelmixError("input_ids must hold at least one prompt token per row, "
                             f"got shape {tuple(input_ids.shape)}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= config.vocab_size:
        raise KernelmixError(
            f"token ids must lie in [0, {config.vocab_size}) (vocab_size), got min {low} and max {high}"
        )
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise KernelmixError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise KernelmixError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise KernelmixError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0
    ):
        raise KernelmixError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    _check_token_id("eos_token_id", eos_token_id, config.vocab_size)
    _check_token_id("pad_token_id", pad_token_id, config.vocab_size)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise KernelmixError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != input_ids.device.type:
            raise KernelmixError(
                f"generator is on {generator.device} but input_ids are on {input_ids.device}; "
                "sample with a generator on the model's device"
            )
    if not isinstance(use_cache, bool):
        raise KernelmixError(f"use_cache must be True or False, got {use_cache!r}")

    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise KernelmixError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise KernelmixError("attention_mask must hold only 0 (padding) and 1 (real token)")
        mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        check_left_padded(mask)

    prompt_length = input_ids.shape[1] if mask is None else int(mask.sum(dim=1).max())
    if prompt_length + max_new_tokens > config.max_seq_len:
        raise KernelmixError(
            f"a prompt of {prompt_length} tokens plus max_new_tokens={max_new_tokens} is "
            f"{prompt_length + max_new_tokens} positions, beyond the model's max_seq_len = {config.max_seq_len}; "
            "shorten the prompt or ask for fewer new tokens"
        )
    return mask


# ---------------------------------------------------------------------------------------------
# Sampling


def _select(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> Tensor:
    """Next token ids ``[B]`` from last-position logits ``[B, V]``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if top_k is not None and top_k < vocab:
        # exactly k tokens survive, even with ties (so top_k=1 is the argmax, as in greedy)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, torch.topk(logits, top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # nucleus: keep the smallest set of most likely tokens whose probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays (mass_before = 0)
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class _EvalMode:
    """``model.eval()`` for the duration of a block, then every submodule's own mode restored."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modes: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for module, mode in self.modes:
            module.training = mode


# ---------------------------------------------------------------------------------------------
# Generation


def generate(
    model: CausalLM,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Continue each row of ``input_ids`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~kernelmix.model.CausalLM`.
        input_ids: ``[B, T]`` prompts (left-padded when their lengths differ, with ``attention_mask``).
        max_new_tokens: the most tokens to add per row.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it and sampled.
        top_k: (≥ 1) sample only among the k most likely tokens (``top_k=1`` is greedy).
        top_p: in (0, 1], nucleus sampling — the smallest set of most likely tokens whose probability
            reaches ``top_p`` (the most likely token is always kept).
        eos_token_id: a row that has emitted it emits ``pad_token_id`` after it; when every row has,
            generation stops.
        pad_token_id: what follows a row's end (default: ``eos_token_id``).
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for LEFT padding. New tokens need no mask.
        generator: a ``torch.Generator`` on the model's device, for reproducible sampling.
        use_cache: prefill once, then one token per forward (default). ``False`` reruns the full
            forward over the whole sequence every step (the slow reference).

    Returns:
        ``[B, T + n]``: the prompt (padding included, unchanged) followed by the ``n`` new tokens, where
        ``n == max_new_tokens`` unless every row emitted ``eos_token_id`` earlier (the tensor is padded to
        the *generated* length, as in Hugging Face). Runs under ``torch.no_grad`` in eval mode (dropout
        off); the model's train/eval mode is restored afterwards. Raises
        :class:`~kernelmix.errors.KernelmixError` (a ``ValueError``) for bad arguments, including a longest
        prompt plus ``max_new_tokens`` beyond ``config.max_seq_len`` and a right-padded ``attention_mask``
        (:func:`check_left_padded`)."""
    mask = _check_generate_args(
        model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id,
        attention_mask, generator, use_cache,
    )
    if pad_token_id is None:
        pad_token_id = eos_token_id
    batch = input_ids.shape[0]
    if max_new_tokens == 0:
        return input_ids.clone()

    with torch.no_grad(), _EvalMode(model):
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        new_tokens: list[Tensor] = []
        model_mask = None if mask is None else mask.long()
        out = model(input_ids, attention_mask=model_mask, use_cache=use_cache)
        cache = out.cache
        for step in range(max_new_tokens):
            token = _select(out.logits[:, -1], float(temperature), top_k, top_p, generator).to(input_ids.dtype)
            if eos_token_id is not None:
                token = torch.where(done, torch.full_like(token, pad_token_id), token)
                done = done | (token == eos_token_id)
            new_tokens.append(token)
            if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
                break
            if use_cache:
                out = model(token[:, None], cache=cache)
                cache = out.cache
            else:
                sequence = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
                if model_mask is not None:
                    model_mask = torch.cat([model_mask, model_mask.new_ones(batch, 1)], dim=1)
                out = model(sequence, attention_mask=model_mask, use_cache=False)
        return torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)


__all__ = ["check_left_padded", "generate"]
