"""The shared part of every mixer layer: q/k/v/o projections, RoPE, input and cache checks.

A layer maps ``hidden_states`` ``[B, T, hidden_size]`` to an output of the same shape and a
:class:`LayerCache`::

    out, cache = layer(x[:, :6])            # prefill: the parallel op, which also builds the cache
    out2, cache = layer(x[:, 6:7], cache)   # decode: continue from the cache

Subclasses (one per mixer, see :mod:`kernelmix.layers`) take the shared keyword arguments of
:class:`MixerLayer` (the head geometry, defined once there, named by :data:`SHARED_OPTIONS`) and spell
only their own, which their ``OPTIONS`` lists::

    class DeltaFormerMixer(MixerLayer):
        OPTIONS = ("w",)                    # its own options; also in its registry entry (MixerInfo.options)

        def __init__(self, *, w: str = "k", **shared: Any) -> None:
            super().__init__(**shared)      # a misspelt option is a TypeError here

(a test keeps ``OPTIONS``, the registry entry and ``__init__`` equal), own the
initialisation of their parameters (:meth:`MixerLayer.reset_parameters`), and implement

* ``_extras(hidden_states, q=..., k=..., k_raw=..., rotary=...)`` → dict of per-token tensors
  ``[B, T, ...]`` the op needs besides q, k, v (Cubit's r and ρ, DeltaFormer's β and w);
* ``_parallel(q, k, v, extras)`` → ``(o, state)``: the whole sequence at once, no cache;
* ``_step(q, k, v, extras, state)`` → ``(o, state)``: one token (T = 1) from a cache.

The default ``_mix`` runs ``_parallel`` without a cache and ``_step`` per token with one; the
random-feature mixers override ``_mix`` to continue a whole chunk from their recurrent state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import KernelmixError
from ..ops import SOLVE_OPERAND_CHOICES, check_backend
from .rope import DEFAULT_THETA, RopeTables, apply_rope, rope_positions
# torch-free: exported here as before
from .settings import SHARED_OPTIONS, check_bool, check_choice, check_head_geometry, check_positive_int


@dataclass
class LayerCache:
    """What a layer keeps between calls.

    * ``mixer``: registry name of the layer that built it (``"softmax"``, ``"cubit"``, …);
    * ``position``: number of tokens seen so far (the RoPE offset of the next token);
    * ``state``: the op's decode state (``SoftmaxState``, ``CubitState``, ``DeltaFormerState``,
      ``RandomFeatureState`` or ``CubitRFState``);
    * ``num_heads``, ``num_kv_heads``, ``head_dim``: the head layout of the layer, so a cache
      handed to a differently shaped layer is rejected instead of silently misread.

    Caches are values: ``forward`` returns a new one and never modifies the one passed in.
    """

    mixer: str
    position: int
    state: Any
    num_heads: int
    num_kv_heads: int
    head_dim: int


def init_linear(linear: nn.Linear | None, std: float | None) -> None:
    """Weights ~ N(0, std²) and zero bias, or with ``std`` None PyTorch's default ``nn.Linear`` init
    (nothing for None)."""
    if linear is None:
        return
    if std is None:
        linear.reset_parameters()
        return
    nn.init.normal_(linear.weight, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def _state_batch_size(state: Any) -> int | None:
    """Batch size of the first tensor field of a dataclass state (None if it has none)."""
    if dataclasses.is_dataclass(state):
        for f in dataclasses.fields(state):
            value = getattr(state, f.name)
            if isinstance(value, Tensor) and value.dim() > 0:
                return value.shape[0]
    return None


class MixerLayer(nn.Module):
    """Base class of the token-mixer layers (not used directly; see the registry).

    Keyword-only arguments shared by every mixer:

    * ``hidden_size``: model width D (input and output last dim).
    * ``num_heads``: query heads H.
    * ``head_dim``: per-head dim d (default ``hidden_size // num_heads``); must be even (RoPE).
    * ``num_kv_heads``: key/value heads H_kv (default ``num_heads``); fewer than ``num_heads``
      gives grouped-query attention and needs ``num_heads % num_kv_heads == 0``.
    * ``rope_theta``: RoPE base θ (default 10000).
    * ``bias``: bias in the q/k/v/o projections (default False).
    * ``chunk_size``: block size of the chunked ops (does not change the result).
    * ``backend``: the ops' implementation, "auto" (Triton kernels on CUDA where triton imports,
      the PyTorch paths elsewhere), "torch" or "triton" (see :mod:`kernelmix.ops`); same numbers
      up to rounding. Softmax attention is PyTorch's fused kernel whatever it says.

    Parameters: ``q_proj`` (D → H·d), ``k_proj`` and ``v_proj`` (D → H_kv·d), ``o_proj`` (H·d → D).
    """

    #: registry name; set by each subclass
    mixer_name: str = ""
    #: the subclass's own keyword arguments, in ``__init__`` order (the shared ones are
    #: :data:`SHARED_OPTIONS`); set by each subclass that has any
    OPTIONS: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        rope_theta: float = DEFAULT_THETA,
        bias: bool = False,
        chunk_size: int = 64,
        backend: str = "auto",
    ) -> None:
        # nn.Module's init directly, not super(): the random-feature layers are also a
        # RandomFeatureMap, whose own __init__ they replace by init_feature_map.
        nn.Module.__init__(self)
        head_dim, num_kv_heads = check_head_geometry(hidden_size, num_heads, head_dim, num_kv_heads)
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
            raise KernelmixError(f"rope_theta must be a positive number, got {rope_theta!r}")
        bias = check_bool("bias", bias)
        chunk_size = check_positive_int("chunk_size", chunk_size)
        backend = check_backend(backend)

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.rope_theta = float(rope_theta)
        self.bias = bias
        self.chunk_size = chunk_size
        self.backend = backend

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Initialise every parameter of the layer. The model calls this with its std; a new layer
        is initialised as by ``reset_parameters()`` (PyTorch's default init of the projections).

        ``q_proj``, ``k_proj``, ``v_proj`` ~ N(0, std²) and ``o_proj`` ~ N(0, out_std²)
        (``out_std`` defaults to ``std``; the model passes GPT-2's residual scaling), biases 0; with
        ``std`` None, PyTorch's default ``nn.Linear`` init. Subclasses extend this with their own
        parameters, projections first in the order they were created (the RNG draws follow it)."""
        for name in ("q_proj", "k_proj", "v_proj"):
            init_linear(getattr(self, name), std)
        init_linear(self.o_proj, std if out_std is None else out_std)

    # ----------------------------------------------------------------------------------------
    # helpers for subclasses

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """Apply this layer's RoPE to ``x`` ``[B, T, H, d]`` at ``positions`` ``[T]`` or ``[B, T]``."""
        return apply_rope(x, positions, theta=self.rope_theta)

    def extra_repr(self) -> str:
        return (
            f"mixer={self.mixer_name!r}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, rope_theta={self.rope_theta:g}, "
            f"chunk_size={self.chunk_size}, backend={self.backend!r}"
        )

    # ----------------------------------------------------------------------------------------
    # checks

    def _check_hidden_states(self, hidden_states: Any) -> None:
        if not isinstance(hidden_states, Tensor):
            raise KernelmixError(
                f"hidden_states must be a torch.Tensor of shape [B, T, {self.hidden_size}], got "
                f"{type(hidden_states).__name__}; pass a torch.Tensor (e.g. torch.as_tensor(x, dtype=torch.float32))"
            )
        if hidden_states.dim() != 3:
            raise KernelmixError(
                f"hidden_states must have shape [B, T, hidden_size] = [B, T, {self.hidden_size}] (3 dims), got "
                f"{hidden_states.dim()} dims with shape {tuple(hidden_states.shape)}; add a batch dim with "
                f"x.unsqueeze(0) for a single sequence"
            )
        if hidden_states.shape[-1] != self.hidden_size:
            raise KernelmixError(
                f"hidden_states last dim must be hidden_size = {self.hidden_size}, got shape "
                f"{tuple(hidden_states.shape)}"
            )
        if hidden_states.shape[1] == 0:
            raise KernelmixError("hidden_states has no tokens (T = 0); pass at least one token")
        if not hidden_states.is_floating_point():
            raise KernelmixError(f"hidden_states must be a floating tensor, got {hidden_states.dtype}")

    def _check_cache(self, cache: Any, batch_size: int) -> None:
        if not isinstance(cache, LayerCache):
            raise KernelmixError(
                f"cache must be a LayerCache returned by this layer's forward (or None), got {type(cache).__name__}"
            )
        if cache.mixer != self.mixer_name:
            raise KernelmixError(
                f"cache was built by a {cache.mixer!r} layer, this is a {self.mixer_name!r} layer; "
                f"pass each layer its own cache"
            )
        ours = (self.num_heads, self.num_kv_heads, self.head_dim)
        theirs = (cache.num_heads, cache.num_kv_heads, cache.head_dim)
        if ours != theirs:
            raise KernelmixError(
                f"cache has (num_heads, num_kv_heads, head_dim) = {theirs}, this layer has {ours}; "
                f"the cache belongs to a differently shaped layer"
            )
        length = getattr(cache.state, "length", None)
        if length is not None and length != cache.position:
            raise KernelmixError("cache is inconsistent: "
                                 f"position {cache.position} but its state holds {length} tokens")
        state_batch = _state_batch_size(cache.state)
        if state_batch is not None and state_batch != batch_size:
            raise KernelmixError(
                f"cache was built for batch size {state_batch}, hidden_states has batch size {batch_size}"
            )
        self._check_state(cache.state)

    def _check_state(self, state: Any) -> None:
        """Mixer-specific cache checks (e.g. the number of random features); default: none."""

    # ----------------------------------------------------------------------------------------
    # forward

    def forward(
        self,
        hidden_states: Tensor,
        cache: LayerCache | None = None,
        *,
        position_ids: Tensor | None = None,
        doc_start: Tensor | None = None,
    ) -> tuple[Tensor, LayerCache]:
        """Mix ``hidden_states`` ``[B, T, hidden_size]`` causally; returns ``(output, cache)``.

        Without ``cache`` the sequence starts at index 0 and the parallel op runs; with one, the
        tokens continue the cached sequence at indices ``cache.position + arange(T)``.

        ``position_ids`` ``[B, T]`` (optional): RoPE positions (default: the token indices).
        ``doc_start`` ``[B, T]`` (optional): index of the first token of each token's document, in
        the same indexing as the cache (tokens never read across a document boundary). Left padding
        and packed documents are both expressed this way; see ``kernelmix.model``.
        """
        self._check_hidden_states(hidden_states)
        batch, length, _ = hidden_states.shape
        if cache is not None:
            self._check_cache(cache, batch)
        offset = 0 if cache is None else cache.position
        if position_ids is None:
            positions = rope_positions(offset, length, device=hidden_states.device)
        elif tuple(position_ids.shape) != (batch, length) or position_ids.is_floating_point():
            raise KernelmixError(
                f"position_ids must be an integer tensor of shape [B, T] = {(batch, length)}, "
                f"got {position_ids.dtype} {tuple(position_ids.shape)}"
            )
        else:
            positions = position_ids

        q = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        k_raw = self.k_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        rotary = RopeTables.at(positions, self.head_dim, theta=self.rope_theta, dtype=q.dtype)  # once for q, k (and r)
        q = rotary.apply(q)
        k = rotary.apply(k_raw)
        extras = self._extras(hidden_states, q=q, k=k, k_raw=k_raw, rotary=rotary)
        extras["doc_start"] = doc_start
        out, state = self._mix(q, k, v, extras, None if cache is None else cache.state)
        out = self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))
        new_cache = LayerCache(
            mixer=self.mixer_name,
            position=offset + length,
            state=state,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        return out, new_cache

    def _extras(self, hidden_states: Tensor, *, q: Tensor, k: Tensor, k_raw: Tensor, rotary: RopeTables) -> dict:
        """Per-token tensors ``[B, T, ...]`` (or None) the op needs besides q, k, v (``rotary``: the
        rotation q and k got, for anything else rotated at their positions)."""
        return {}

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, Any]:
        """Run the op: parallel without a state, else one ``_step`` per token."""
        if state is None:
            return self._parallel(q, k, v, extras)
        outputs = []
        for t in range(q.shape[1]):
            extras_t = {name: None if x is None else x[:, t : t + 1] for name, x in extras.items()}
            o_t, state = self._step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], extras_t, state)
            outputs.append(o_t)
        return torch.cat(outputs, dim=1), state

    def _parallel(self, q: Tensor, k: Tensor, v: Tensor, extras: dict) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def _step(self, q: Tensor, k: Tensor, v: Tensor, extras: dict, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError



def check_solve_operands(value: Any) -> str | None:
    """A solve mixer's ``solve_operands`` option: None (the default, or the caller's
    :func:`kernelmix.ops.solve_operands` block) or one of its choices."""
    return None if value is None else check_choice("solve_operands", value, SOLVE_OPERAND_CHOICES)

__all__ = ["SHARED_OPTIONS", "LayerCache", "MixerLayer", "check_bool", "check_choice", "check_head_geometry",
           "check_positive_int", "check_solve_operands", "init_linear"]
