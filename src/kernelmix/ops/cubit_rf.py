"""Cubit-RF: Cubit's ridge solve with its kernels estimated by positive random features (docs/math.md §12).

Per batch element and query head, with φ the positive features of ``random_features``
(φ(x) = m^{-1/2} exp(W M x̃ − ½‖M x̃‖²), x̃ = d^{-1/4} x; the same W and M for both parts):

    r̂_j  = s_h · r_j / max(‖r_j‖, 1e-6)                                   (Cubit's reference)
    g_ij = φ(r_i d^¼)·φ(r̂_j d^¼) / Σ_{doc(i) ≤ l ≤ i} φ(r_i d^¼)·φ(r̂_l d^¼)   (E[φ·φ] = exp(r_iᵀΣ r̂_j), no 1/√d)
    u_i  = (ρ_i v_i − Σ_{j<i} g_ij u_j) / (g_ii + λ_h)                      (forward substitution)
    o_i  = Σ_{j≤i} φ(q_i)·φ(k_j) u_j / Σ_{j≤i} φ(q_i)·φ(k_j)                (random-feature read-out)

Both sums over j are running states, so the substitution is a recurrence on an m × d_v state:
R_i = Σ_{j≤i} φ(r̂_j d^¼) u_jᵀ with its normaliser z_i = Σ_{j≤i} φ(r̂_j d^¼), and the read-out's
S, z of ``random_feature_attention``. ``cubit_rf_attention`` runs it in chunks (a C × C triangular
solve per chunk, the states carried between chunks, never a T × T matrix), ``cubit_rf_attention_naive``
is the dense float64 reference written from the definition, ``cubit_rf_attention_step`` decodes one
token from a :class:`CubitRFState` of constant size.

Stabilisers (as the random-feature path): the Gram's query side φ(r_i d^¼) is divided by its own
max feature and loses −½‖M r_i‖² (per-row constants: each row of the solve is normalised by its own
Σ_l g-numerators, so they cancel); its key side φ(r̂_j d^¼) is kept at the running max of its
logits within the document (causal, detached), by which every term of row i is scaled alike.
Solves and states are float32 (float64 for float64 inputs) with autocast off.

A NaN or ±inf in k, v, r or ρ at token t (or in ``initial_state``) makes the rows that see it NaN —
rows ≥ t of its document, the rows that continue the state — and the returned state's heads; every
other row is what the clean input gives (as ``cubit_attention`` and ``random_feature_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, overload

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..errors import KernelmixError
from ._backend import check_backend, resolve_backend
from ._common import (
    autocast_off, check_4d, check_chunk_size, check_doc_start, check_per_token_heads, check_qkv, check_state,
    check_tensor, compute_dtype, expand_heads, find_nonfinite, per_head, reaches_causal, recompute_segments,
    scan_syncs, segmented_cummax, split_segments, zero_nonfinite,
)
from .cubit import REFERENCE_NORM_EPS, check_rho, normalize_reference
from .random_features import (
    UNDERFLOW_CHECK,
    RandomFeatureState,
    feature_logits,
    random_feature_attention,
    random_feature_attention_step,
    underflow_floor,
)

if TYPE_CHECKING:  # the overloads' **options (typing.Unpack from Python 3.11)
    from typing_extensions import Unpack


@dataclass
class CubitRFState:
    """Decode state, O(m·d_v) per head whatever the length: ``reference`` holds the Gram side
    (``S`` = R = Σ φ(r̂_j d^¼) u_jᵀ ``[B, H, m, d_v]``, ``z`` = Σ φ(r̂_j d^¼) ``[B, H, m]``, both at
    scale exp(−``shift``), the running max of the reference key logits ``[B, H]``), ``readout`` the
    read-out's :class:`~kernelmix.ops.random_features.RandomFeatureState` (S = Σ φ(k_j) u_jᵀ, z, shift)."""

    reference: RandomFeatureState
    readout: RandomFeatureState

    @property
    def length(self) -> int:
        return self.readout.length


# ---------------------------------------------------------------------------------------------
# Checks


def _check_projection(projection: Tensor, transform: Tensor | None, heads: int, head_dim: int) -> None:
    """W ``[m, d]`` or ``[H, m, d]`` and M ``[H, d, d]`` (a local equivalent of the random-feature op's check)."""
    check_tensor("projection", projection, "[m, d] or [H, m, d]")
    shape = tuple(projection.shape)
    if projection.dim() not in (2, 3) or shape[-2] <= 0 or shape[-1] != head_dim:
        raise KernelmixError(
            f"projection must be a tensor [m, d] or [H, m, d] with m ≥ 1 and d = the head dim {head_dim}, got {shape}"
        )
    if projection.dim() == 3 and shape[0] != heads:
        raise KernelmixError(f"projection has {shape[0]} heads but q has {heads}; use [m, d] or [H, m, d]")
    if transform is not None:
        check_tensor("transform", transform, "[H, d, d]")
        if tuple(transform.shape) != (heads, head_dim, head_dim):
            raise KernelmixError(
                f"transform (M) must have shape [H, d, d] = {(heads, head_dim, head_dim)}, got {tuple(transform.shape)}"
            )


def check_cubit_rf_inputs(q, k, v, r, projection, rho, transform) -> None:
    """The op's argument checks (shared with the dense ablation, ``cubit_rf_parts``)."""
    check_qkv(q, k, v)
    check_4d("r", r)
    if tuple(r.shape) != tuple(q.shape):
        raise KernelmixError(
            f"r must have the query's shape [B, T, H, d] = {tuple(q.shape)} (the Gram and the read-out share the "
            f"projection W, so d_r = d), got {tuple(r.shape)}"
        )
    check_per_token_heads("rho", rho, q)
    check_rho(rho)
    _check_projection(projection, transform, q.shape[2], q.shape[3])


def _check_cubit_rf_state(op: str, state, batch: int, heads: int, m: int, dv: int) -> None:
    check_state(op, state, CubitRFState, {})
    fields = {"S": ((batch, heads, m, dv), "[B, H, m, d_v]"), "z": ((batch, heads, m), "[B, H, m]"),
              "shift": ((batch, heads), "[B, H]")}
    for part in ("reference", "readout"):
        check_state(f"{op} (state.{part})", getattr(state, part), RandomFeatureState, fields)
    lengths = (state.reference.length, state.readout.length)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths) or lengths[0] != lengths[1]:
        raise KernelmixError(f"{op}: the state is inconsistent: "
                             f"its parts hold {lengths} tokens; pass an unmodified state")


# ---------------------------------------------------------------------------------------------
# Shared pieces


def reference_logits(r: Tensor, ref_scale: Tensor, projection: Tensor,
                     transform: Tensor | None) -> tuple[Tensor, Tensor]:
    """The Gram's log-features ``[B, T, H, m]`` for ``r`` ``[B, T, H, d]`` and ``ref_scale`` ``[H]``:
    (query side: log φ(r_i d^¼) less its per-row constants, key side: log(√m φ(r̂_j d^¼))). The
    x̃ = d^{-1/4} x of the feature map meets x = r d^¼, so E[φ·φ] = exp(r_iᵀ Σ r̂_j), Cubit's kernel."""
    root = r.shape[-1] ** 0.25
    r_hat = normalize_reference(r, ref_scale)
    queries = feature_logits(r * root, projection, transform, norm_term=False)
    return queries, feature_logits(r_hat * root, projection, transform)


def _solve_inputs(r, v, rho, ridge, ref_scale, projection, transform, heads, dtype):
    """(λ ``[H]``, the Gram's query and key log-features, ρ ⊙ v on the query heads), in ``dtype``."""
    r = r.to(dtype)
    lam = per_head("ridge", ridge, heads, r, positive=True)
    s = per_head("ref_scale", ref_scale, heads, r, positive=True)
    a_logits, b_logits = reference_logits(r, s, projection.to(dtype),
                                          None if transform is None else transform.to(dtype))
    values = expand_heads(v, heads).to(dtype)
    if rho is not None:
        values = rho.to(dtype)[..., None] * values
    return lam, a_logits, b_logits, values


def _row_features(a_logits: Tensor) -> Tensor:
    """exp(logits − their max): a per-row constant, detached (it cancels in the row-normalised solve)."""
    return torch.exp(a_logits - a_logits.detach().amax(dim=-1, keepdim=True))


def _key_shift(b_logits: Tensor, doc_start: Tensor | None, start: int, carried: Tensor) -> Tensor:
    """s_i ``[B, H, T]``: the running max of the key logits in the document, at least the carried
    shift for tokens whose document began before this call. Detached."""
    running = segmented_cummax(b_logits.detach().amax(dim=-1).transpose(1, 2), doc_start)
    if doc_start is None:
        return torch.maximum(running, carried[..., None])
    continues = (doc_start < start)[:, None, :]
    return torch.where(continues, torch.maximum(running, carried[..., None]), running)


# ---------------------------------------------------------------------------------------------
# The chunked solve


@dataclass
class _Chunks:
    """Where the chunks lie: absolute positions ``pos`` ``[N, C]``, document starts ``rows_doc``
    ``[B, N, C]`` (None: one document), the key shift ``shift`` ``[B, H, N, C]``, the shift of each
    chunk's last token ``last`` ``[B, H, N]`` and of the token before the chunk ``before`` ``[B, H, N]``."""

    pos: Tensor
    rows_doc: Tensor | None
    shift: Tensor
    last: Tensor
    before: Tensor

    def visible(self) -> Tensor:
        """j ≤ i in the row's document, ``[*, N, C, C]``."""
        causal = self.pos[:, None, :] <= self.pos[:, :, None]
        if self.rows_doc is None:
            return causal[None, None]
        return (causal[None] & (self.pos[None, :, None, :] >= self.rows_doc[..., None]))[:, None]

    def carry_factor(self) -> Tensor:
        """exp(σ_{c−1} − s_i) for rows that continue the carried state, 0 for the others, ``[B, H, N, C]``."""
        gap = self.before[..., None] - self.shift
        if self.rows_doc is not None:
            gap = gap.masked_fill(~(self.rows_doc < self.pos[:, :1])[:, None], float("-inf"))
        return torch.exp(gap)

    def rescale(self) -> Tensor:
        """The carried state's factor from chunk to chunk, exp(σ_{c−1} − σ_c), 0 where the chunk's last
        token starts a new document, ``[B, H, N]``."""
        gap = self.before - self.last
        if self.rows_doc is not None:
            gap = gap.masked_fill(~(self.rows_doc[..., -1] < self.pos[:, 0])[:, None], float("-inf"))
        return torch.exp(gap)

    def own_weights(self, kappa: Tensor) -> Tensor:
        """Each chunk's keys at the scale exp(−σ_c) of its last token, those of its last document only."""
        own = torch.exp(self.shift - self.last[..., None])
        if self.rows_doc is not None:
            in_last_doc = (self.pos[None] >= self.rows_doc[..., -1:])[:, None]  # [B, 1, N, C]
            own = own.masked_fill(~in_last_doc, 0.0)
        return own[..., None] * kappa


def _pad_last(x: Tensor, pad: int) -> Tensor:
    """``x`` with its last entry (last dim) repeated ``pad`` more times."""
    return x if not pad else torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)


def _to_chunks(x: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """``[B, T, H, *]`` → ``[B, H, N, C, *]``, zero padded."""
    x = x.transpose(1, 2)
    pad = n_chunks * chunk - x.shape[2]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], x.shape[1], n_chunks, chunk, x.shape[-1])


def _layout(b_logits, doc_start, start, carried, chunk_size) -> tuple[_Chunks, Tensor, int, int]:
    """(the chunk layout, the key shift ``[B, H, T]``, N, C)."""
    batch, length = b_logits.shape[:2]
    shift = _key_shift(b_logits, doc_start, start, carried)
    chunk = min(chunk_size, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    pos = (start + torch.arange(n_chunks * chunk, device=b_logits.device)).view(n_chunks, chunk)
    rows_doc = None if doc_start is None else _pad_last(doc_start, pad).view(batch, n_chunks, chunk)
    sc = _pad_last(shift, pad).view(*shift.shape[:2], n_chunks, chunk)
    last = sc[..., -1]
    before = torch.cat([carried[..., None], last[..., :-1]], dim=-1)
    return _Chunks(pos, rows_doc, sc, last, before), shift, n_chunks, chunk


def _carry(inputs: list[Tensor], state: Tensor, rescale: Tensor, step) -> tuple[Tensor, Tensor]:
    """Run ``state ← rescale_c · state + step(state, inputs_c)`` over the chunks (dim 2 of every input);
    returns (the state before each chunk stacked on dim 2, the final state)."""
    before = []
    for c, parts in enumerate(zip(*(x.unbind(dim=2) for x in inputs))):
        before.append(state)
        state = rescale[..., c].reshape(*rescale.shape[:2], *([1] * (state.dim() - 2))) * state + step(state, *parts)
    return torch.stack(before, dim=2), state


def _chunked_solve(a_logits, b_logits, values, lam, chunk_size, doc_start, initial, recurrence: str = "torch"):
    """U ``[B, T, H, d_v]`` of the row-normalised substitution and the Gram side's final state; the
    state's recurrence over the chunks by torch or by the Triton kernels (``recurrence``)."""
    batch, length, heads, m = b_logits.shape
    dv = values.shape[-1]
    R, z, carried, start = _starting_state(initial, values, m)
    check_doc_start(doc_start, batch, length, offset=start)
    if length == 0:
        return values, RandomFeatureState(S=R, z=z, shift=carried, length=start)
    chunks, shift, n_chunks, chunk = _layout(b_logits, doc_start, start, carried, chunk_size)
    a = _to_chunks(_row_features(a_logits), n_chunks, chunk)  # [B, H, N, C, m], max 1
    kappa = _to_chunks(torch.exp(b_logits - shift.transpose(1, 2)[..., None]), n_chunks, chunk)  # ≤ 1
    decay = torch.exp(
        (chunks.shift[..., None, :] - chunks.shift[..., :, None]).masked_fill(~chunks.visible(), float("-inf")))
    scores = (a @ kappa.transpose(-1, -2)) * decay  # the Gram numerators within each chunk, at exp(−s_i)
    own, rescale, carry = chunks.own_weights(kappa), chunks.rescale(), chunks.carry_factor()
    z_before, z = _carry([own.sum(dim=-2)], z, rescale, lambda state, own_c: own_c)
    norm = scores.sum(dim=-1) + carry * (a @ z_before[..., None])[..., 0]  # Σ_l numerators, [B, H, N, C]
    flat = norm.reshape(batch, heads, -1)[..., :length]
    UNDERFLOW_CHECK.observe(flat)
    empty = norm <= underflow_floor(norm.dtype)  # padding, or a row whose normaliser underflowed: u = 0
    inv = torch.where(empty, torch.zeros_like(norm), 1.0 / torch.where(empty, torch.ones_like(norm), norm))
    diagonal = torch.where(empty, torch.ones_like(norm), lam[:, None, None].expand_as(norm))
    system = scores * inv[..., None] + torch.diag_embed(diagonal)  # G_c + λI, row by row
    rhs = torch.where(empty[..., None], 0.0, _to_chunks(values, n_chunks, chunk))
    solved = torch.linalg.solve_triangular(system, torch.cat([rhs, (carry * inv)[..., None] * a], -1), upper=False)
    # U_c = L_c⁻¹ ρV_c − L_c⁻¹ diag(f/n) A_c · R_{c−1}: only this product and R's update run chunk by chunk
    def produce(state, x_v, x_a, own_c):
        return own_c.transpose(-1, -2) @ (x_v - x_a @ state)

    if recurrence == "triton":
        from ._triton_cubit_rf import triton_state_recurrence  # imports triton: only when asked for

        r_before, R = triton_state_recurrence(solved[..., :dv], solved[..., dv:], own, rescale, R)
    else:
        r_before, R = _carry([solved[..., :dv], solved[..., dv:], own], R, rescale, produce)
    u = solved[..., :dv] - solved[..., dv:] @ r_before
    u = u.reshape(batch, heads, n_chunks * chunk, dv)[:, :, :length].transpose(1, 2)
    return u, RandomFeatureState(S=R, z=z, shift=chunks.last[..., -1], length=start + length)


def _recomputed_solve(solve, r, v, rho, doc_start, initial_state: CubitRFState | None, chunk_size: int):
    """``solve(r, v, rho, doc_start, reference_state)`` → (U, the Gram side's state) in segments of
    ``_common.RECOMPUTE_SEGMENT_TOKENS`` tokens (a whole number of chunks). Under autograd each is
    checkpointed: the solve's logits, scores and per-chunk states are recomputed in the backward instead
    of kept (beside the read-out's they would double the peak memory), one segment at a time. Without a
    backward the segments keep a long prefill's tiles in the caches."""
    initial = None if initial_state is None else initial_state.reference
    grad = torch.is_grad_enabled()
    # under torch.compile one checkpoint of the whole solve (one graph, as before the segments)
    segments = [(0, r.shape[1])] if torch.compiler.is_compiling() else recompute_segments(r.shape[1], chunk_size)
    us, state = [], initial
    for r_seg, v_seg, rho_seg, doc_seg in zip(*(split_segments(x, segments) for x in (r, v, rho, doc_start))):
        if grad:
            u, state = checkpoint(solve, r_seg, v_seg, rho_seg, doc_seg, state, use_reentrant=False)
        else:
            u, state = solve(r_seg, v_seg, rho_seg, doc_seg, state)
        us.append(u)
    return (us[0] if len(us) == 1 else torch.cat(us, dim=1)), state


def _starting_state(initial: RandomFeatureState | None, values: Tensor, m: int):
    """(R, z, shift, tokens seen) of the Gram side: empty, or ``initial`` in the compute dtype."""
    batch, _, heads, dv = values.shape
    if initial is None:
        return (values.new_zeros(batch, heads, m, dv), values.new_zeros(batch, heads, m),
                values.new_full((batch, heads), float("-inf")), 0)
    dtype = values.dtype
    return initial.S.to(dtype), initial.z.to(dtype), initial.shift.to(dtype), initial.length


# ---------------------------------------------------------------------------------------------
# The ops


class CubitRFOptions(TypedDict, total=False):
    """The keywords of :func:`cubit_rf_attention` besides ``return_state`` (its overloads' ``**options``)."""

    rho: Tensor | None
    ridge: float | Tensor
    ref_scale: float | Tensor
    transform: Tensor | None
    doc_start: Tensor | None
    chunk_size: int
    initial_state: CubitRFState | None
    backend: str


@overload
def cubit_rf_attention(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, projection: Tensor, *, return_state: Literal[False] = False,
    **options: Unpack[CubitRFOptions],
) -> Tensor: ...


@overload
def cubit_rf_attention(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, projection: Tensor, *, return_state: Literal[True],
    **options: Unpack[CubitRFOptions],
) -> tuple[Tensor, CubitRFState]: ...


def cubit_rf_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
    projection: Tensor,
    *,
    rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6,
    ref_scale: float | Tensor = 1.0,
    transform: Tensor | None = None,
    doc_start: Tensor | None = None,
    chunk_size: int = 64,
    initial_state: CubitRFState | None = None,
    return_state: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, CubitRFState]:
    """Cubit-RF attention in chunks, O(T·m·d) time and an O(m·d) state (never a T × T matrix).

    Args:
        q, r: ``[B, T, H, d]``.
        k, v: ``[B, T, H_kv, d]`` (grouped heads are expanded).
        projection: W ``[m, d]`` or ``[H, m, d]``, shared by the Gram and the read-out.
        rho: ``[B, T, H]`` in (0, ∞), or None (ρ ≡ 1).
        ridge, ref_scale: λ and s, floats or ``[H]`` tensors (> 0), with gradients as every other input.
        transform: M ``[H, d, d]`` (shared by both parts), or None.
        doc_start: ``[B, T]`` or None (absolute indices, counting the tokens of ``initial_state``); keeps
            packed documents apart in the solve and the read-out.
        chunk_size: tokens per chunk.
        initial_state: a :class:`CubitRFState` to continue from, or None.
        return_state: also return the state.
        backend: "auto", "torch" or "triton", as in
            :func:`~kernelmix.ops.random_features.random_feature_attention`: with "triton" (or "auto" on a
            GPU in float32) the read-out runs the random-feature kernels and the solve's recurrence over
            the chunks runs ``_triton_cubit_rf``'s; the solve's per-chunk systems are batched torch solves.

    Returns:
        ``[B, T, H, d_v]`` in v's dtype, or ``(out, CubitRFState)`` with ``return_state``; solves and states
        in float32 (float64 for float64 inputs). A Gram row whose normaliser underflows gets u = 0 (and
        warns once, as the random-feature ops)."""
    check_chunk_size(chunk_size)
    check_backend(backend)
    check_cubit_rf_inputs(q, k, v, r, projection, rho, transform)
    heads = q.shape[2]
    if initial_state is not None:
        _check_cubit_rf_state("cubit_rf_attention", initial_state, q.shape[0], heads, projection.shape[-2], v.shape[3])
    guard = find_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads)
    if guard is not None:  # computed on zeroed tokens, and the rows that see them set to NaN below
        k, v, r, rho = (guard.zeroed(name, x) for name, x in (("k", k), ("v", v), ("r", r), ("rho", rho)))
    initial_state, state_bad = _finite_state(initial_state)
    check_doc_start(doc_start, q.shape[0], q.shape[1], offset=0 if initial_state is None else initial_state.length)
    with autocast_off(q):  # solves, logits and states stay ≥ fp32 (the precision policy, _common)
        dtype = compute_dtype(q, k, v, r, projection)
        recurrence = resolve_backend(backend, q.device, dtype)

        def solve(r, v, rho, doc_start, initial):
            lam, a_logits, b_logits, values = _solve_inputs(r, v, rho, ridge, ref_scale, projection, transform, heads,
                                                            dtype)
            return _chunked_solve(a_logits, b_logits, values, lam, chunk_size, doc_start, initial, recurrence)

        u, reference = _recomputed_solve(solve, r, v, rho, doc_start, initial_state, chunk_size)
        out, readout = random_feature_attention(
            q, expand_heads(k, heads), u, projection, transform=transform, chunk_size=chunk_size, doc_start=doc_start,
            initial_state=None if initial_state is None else initial_state.readout, return_state=True, backend=backend,
        )
    state = CubitRFState(reference=reference, readout=readout)
    out, state = _poisoned(out.to(v.dtype), state, guard, state_bad, doc_start, readout.length - q.shape[1])
    return (out, state) if return_state else out


# ---------------------------------------------------------------------------------------------
# Non-finite inputs (as the other ops, ``_common``): the op computes on zeroed tokens (and emptied
# state heads) and sets to NaN every row that sees one — the token's own row and the later rows of
# its document, the rows that continue a non-finite state — and the returned state's heads they reach.


def _finite_state(state: CubitRFState | None) -> tuple[CubitRFState | None, Tensor | None]:
    """(``state`` with every head that holds a NaN or ±inf emptied, those heads ``[B, H]``); (state, None)
    when all is finite (checked with a sync where :func:`scan_syncs` allows one)."""
    if state is None:
        return None, None
    parts = (state.reference, state.readout)
    finite = [torch.isfinite(p.S.detach()).flatten(2).all(-1) & torch.isfinite(p.z.detach()).all(-1)
              & (p.shift.detach() < float("inf")) for p in parts]  # a shift of −inf is an empty state
    bad = ~(finite[0] & finite[1])
    if scan_syncs(bad.device) and not bool(bad.any()):
        return state, None
    emptied = [RandomFeatureState(S=p.S.masked_fill(bad[..., None, None], 0.0), z=p.z.masked_fill(bad[..., None], 0.0),
                                  shift=p.shift.masked_fill(bad, float("-inf")), length=p.length) for p in parts]
    return CubitRFState(reference=emptied[0], readout=emptied[1]), bad


def _poisoned(out: Tensor, state: CubitRFState, guard, state_bad: Tensor | None, doc_start, start: int):
    """``out`` with NaN rows where a row sees a non-finite token or continues a non-finite state, and the
    state with NaN in the heads its last row reaches."""
    reached = None if guard is None else reaches_causal(guard.bad, doc_start, start)
    if state_bad is not None:
        continues = (torch.ones(out.shape[:2], dtype=torch.bool, device=out.device) if doc_start is None
                     else doc_start < start)
        carried = continues[:, :, None] & state_bad[:, None, :]
        reached = carried if reached is None else reached | carried
    if reached is None:
        return out, state
    heads = reached[:, -1] if out.shape[1] else state_bad
    nan = float("nan")
    parts = [RandomFeatureState(S=p.S.masked_fill(heads[..., None, None], nan),
                                z=p.z.masked_fill(heads[..., None], nan),
                                shift=p.shift.masked_fill(heads, nan), length=p.length)
             for p in (state.reference, state.readout)]
    return out.masked_fill(reached[..., None], nan), CubitRFState(reference=parts[0], readout=parts[1])


def _naive_features(x: Tensor, projection: Tensor, transform: Tensor | None) -> Tensor:
    """φ(x) = m^{-1/2} exp(W M x̃ − ½‖M x̃‖²), x̃ = d^{-1/4} x, unstabilised, ``[B, T, H, m]``."""
    x = x * x.shape[-1] ** -0.25
    if transform is not None:
        x = torch.einsum("hed,bthd->bthe", transform, x)
    w = projection if projection.dim() == 3 else projection.expand(x.shape[2], -1, -1)
    logits = torch.einsum("bthd,hmd->bthm", x, w) - 0.5 * x.pow(2).sum(dim=-1, keepdim=True)
    return torch.exp(logits) / w.shape[1] ** 0.5


def cubit_rf_attention_naive(  # the fast path's parameters (same meanings), less chunking, backend and state
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, projection: Tensor, *, rho: Tensor | None = None,
    ridge: float | Tensor = 1e-6, ref_scale: float | Tensor = 1.0, transform: Tensor | None = None,
    doc_start: Tensor | None = None,
) -> Tensor:
    """Dense float64 reference, straight from the definition: the T × T estimated Gram matrix,
    row-normalised, one ``solve_triangular``, the T × T estimated read-out weights.

    Args:
        q, k, v, r, projection, rho, ridge, ref_scale, transform, doc_start: as :func:`cubit_rf_attention`
            (the same shapes and meanings).

    Returns:
        The output, ``[B, T, H, d_v]`` in v's dtype. Computed in float64."""
    check_cubit_rf_inputs(q, k, v, r, projection, rho, transform)
    batch, length, heads, d = q.shape
    check_doc_start(doc_start, batch, length)
    guard, (k, v, r, rho) = zero_nonfinite({"k": k, "v": v, "r": r, "rho": rho}, heads)
    f64 = torch.float64
    lam = per_head("ridge", ridge, heads, q.to(f64), positive=True)
    s = per_head("ref_scale", ref_scale, heads, q.to(f64), positive=True)
    w, m = projection.to(f64), None if transform is None else transform.to(f64)
    rr = r.to(f64)
    r_hat = s[:, None] * rr / rr.norm(dim=-1, keepdim=True).clamp_min(REFERENCE_NORM_EPS)
    visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if doc_start is not None:
        visible = visible & (torch.arange(length, device=q.device)[None, None, :] >= doc_start[:, :, None])[:, None]

    def weights(left: Tensor, right: Tensor) -> Tensor:  # row-normalised φ(left_i)·φ(right_j), j visible
        kernel = torch.einsum("bihm,bjhm->bhij", _naive_features(left, w, m), _naive_features(right, w, m))
        kernel = kernel.masked_fill(~visible, 0.0)
        return kernel / kernel.sum(dim=-1, keepdim=True)

    gram = weights(rr * d**0.25, r_hat * d**0.25)
    values = expand_heads(v, heads).to(f64)
    if rho is not None:
        values = rho.to(f64)[..., None] * values
    system = gram + lam[:, None, None] * torch.eye(length, dtype=f64, device=q.device)
    u = torch.linalg.solve_triangular(system, values.transpose(1, 2), upper=False)  # [B, H, T, d_v]
    out = (weights(q.to(f64), expand_heads(k, heads).to(f64)) @ u).transpose(1, 2)
    return guard.poison_visible(out, visible).to(v.dtype)  # every row that sees a non-finite token: NaN


def _solve_step(a_logits, b_logits, values, lam, doc_start, state: RandomFeatureState | None):
    """One row of the substitution: u_t ``[B, H, d_v]`` and the Gram side's new state."""
    batch, heads, m = b_logits.shape
    R, z, shift, length = _starting_state(state, values[:, None], m)
    check_doc_start(doc_start, batch, 1, offset=length)
    key_max = b_logits.detach().amax(dim=-1)
    keeps = (torch.ones_like(key_max, dtype=torch.bool) if doc_start is None
             else (doc_start[:, :1] < length).expand_as(key_max))
    new_shift = torch.where(keeps, torch.maximum(shift, key_max), key_max)
    rescale = torch.exp((shift - new_shift).masked_fill(~keeps, float("-inf")))
    R = torch.where(keeps[..., None, None], rescale[..., None, None] * R, torch.zeros_like(R))
    kappa = torch.exp(b_logits - new_shift[..., None])
    z = torch.where(keeps[..., None], rescale[..., None] * z, torch.zeros_like(z)) + kappa
    a = _row_features(a_logits)
    norm, diagonal = (a * z).sum(dim=-1), (a * kappa).sum(dim=-1)
    UNDERFLOW_CHECK.observe(norm)
    empty = norm <= underflow_floor(norm.dtype)
    safe = torch.where(empty, torch.ones_like(norm), norm)[..., None]
    u = (values - torch.einsum("bhm,bhmd->bhd", a, R) / safe) / (diagonal[..., None] / safe + lam[:, None])
    u = torch.where(empty[..., None], torch.zeros_like(u), u)
    R = R + kappa[..., None] * u[..., None, :]
    return u, RandomFeatureState(S=R, z=z, shift=new_shift, length=length + 1)


def cubit_rf_attention_step(  # one token of the fast path's inputs (same meanings) and the decode state
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, projection: Tensor, state: CubitRFState | None, *,
    rho: Tensor | None = None, ridge: float | Tensor = 1e-6, ref_scale: float | Tensor = 1.0,
    transform: Tensor | None = None, doc_start: Tensor | None = None,
) -> tuple[Tensor, CubitRFState]:
    """Decode one token in O(m·d) work and state, whatever the position.

    u_t = (ρ_t v_t − g_t·R / n_t) / (g_tt + λ) from the Gram state, then the random-feature read-out
    step with v := u_t.

    Args:
        q, r: ``[B, 1, H, d]`` (one token).
        k, v: ``[B, 1, H_kv, d]``.
        projection, transform, rho, ridge, ref_scale: as :func:`cubit_rf_attention` (``rho`` ``[B, 1, H]``).
        state: the :class:`CubitRFState` of the tokens before.
        doc_start: ``[B, 1]`` or None; where it equals ``state.length`` both states restart.

    Returns:
        ``(out [B, 1, H, d_v], state)``."""
    check_cubit_rf_inputs(q, k, v, r, projection, rho, transform)
    if q.shape[1] != 1:
        raise KernelmixError(f"a decode step takes one token (T=1), got T={q.shape[1]}; "
                             "use cubit_rf_attention for prefill")
    heads = q.shape[2]
    if state is not None:
        _check_cubit_rf_state("cubit_rf_attention_step", state, q.shape[0], heads, projection.shape[-2], v.shape[3])
    with autocast_off(q):
        dtype = compute_dtype(q, k, v, r, projection)
        lam, a_logits, b_logits, values = _solve_inputs(r, v, rho, ridge, ref_scale, projection, transform, heads,
                                                        dtype)
        u, reference = _solve_step(
            a_logits[:, 0], b_logits[:, 0], values[:, 0], lam, doc_start, None if state is None else state.reference
        )
        out, readout = random_feature_attention_step(
            q, expand_heads(k, heads), u[:, None], projection, None if state is None else state.readout,
            transform=transform, doc_start=doc_start,
        )
    return out.to(v.dtype), CubitRFState(reference=reference, readout=readout)


__all__ = ["CubitRFState", "cubit_rf_attention", "cubit_rf_attention_naive", "cubit_rf_attention_step",
           "reference_logits"]
