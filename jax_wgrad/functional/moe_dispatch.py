"""Token dispatch and combine of the MoE layer (Megatron's ``alltoall`` dispatcher), in
static shapes, inside ``shard_map``.

Two dispatchers, one interface: ``dispatch(x, experts)`` gives the rows the experts of this
rank compute on, ``combine(out, gates)`` brings the expert outputs back to the tokens and
sums each token's ``k`` choices weighted by the gates.

* :class:`CapacityDispatch` (``moe_expert_capacity_factor`` set): every expert a buffer of
  ``C`` slots per source rank (``[E, C, H]``, zero-padded; choices past ``C`` dropped,
  Megatron's ``"position"`` policy), exchanged with one ``all_to_all``: the experts see
  ``[E/EP, EP * C, H]`` (batched GEMMs).
* :class:`DroplessDispatch` (Megatron's default: no capacity): the ``T k`` choices sorted by
  expert (stable: k-major, then token order), so each expert's tokens are one contiguous
  group, and each expert rank's share one contiguous range; exchanged exactly
  (:func:`ragged_all_to_all`: each source's rows land back to back in the receiver's buffer
  of ``receive_rows`` rows) after a small ``all_to_all`` of the counts; on receipt the rows
  are ordered by local expert (``group_sizes [E/EP]``), the ragged GEMMs' input (work: the
  routed rows only). The buffer holds the worst case ``EP T k`` unless
  ``buffer_factor`` bounds it to ``ceil(factor T k)`` rows; rows past the bound are not
  sent and counted (:meth:`DroplessDispatch.overflow`), so that a step that exceeded it is
  refused by the training loop instead of training on wrong numbers.

**Fused permutations** (``permute_fusion``, Megatron's ``--moe-permute-fusion``): the four
row permutations of the dropless dispatcher (choices to sorted rows, received rows to
expert order and back, sorted rows to choices) are :func:`permute_rows`, a gather whose
gradient is a gather by the inverse permutation, instead of a gather whose gradient is a
scatter-add (and, for the last, a scatter whose gradient is a gather). No scatter is left
in either direction, and each permutation fuses into its neighbour: the unpermute into the
gate-weighted sum of a token's ``k`` choices, the dispatch's gradient into the sum over
them. The same numbers up to the order of that sum.

**Expert tensor parallelism** (``expert_tensor_axis``, Megatron's
``--expert-tensor-parallel-size`` = tp; MoE with tp needs sequence parallelism, so every
tensor rank routes its own tokens): after the expert exchange the rows are all-gathered over
the tensor ranks (their counts too), the experts' weights are split over ``tensor``
(column- then row-parallel) and their partial outputs reduce-scattered back to the tensor
rank the tokens came from (Megatron's ``gather_from_sequence_parallel_region`` /
``reduce_scatter_to_sequence_parallel_region`` on the expert-tensor group).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_wgrad.functional.collectives import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from jax_wgrad.functional.saved import SAVED

__all__ = [
    "EMULATED_EXCHANGE_SCOPE",
    "permute_rows",
    "CapacityDispatch",
    "DroplessDispatch",
    "dispatch_slots",
    "group_by_expert",
    "ragged_all_to_all",
    "receive_rows",
]


def _exclusive_cumsum(a: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def dispatch_slots(experts: jax.Array, num_experts: int, capacity: int):
    """Queue positions of every (token, choice): ``(slot [T, k], kept [T, k] bool)``.

    Choices are queued k-major (all first choices in token order, then all second
    choices, ...); a choice whose position reaches ``capacity`` is dropped.
    """
    t, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(-1), num_experts, dtype=jnp.int32)  # [k*T, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot = position.reshape(k, t).T
    return slot, slot < capacity


def group_by_expert(counts: jax.Array, starts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Where each received row goes when the rows are ordered by local expert.

    Args:
      counts: int32 ``[S, E_l]``: source ``s`` sent ``counts[s, j]`` rows of local expert
        ``j``, back to back in expert order from row ``starts[s]`` of the buffer.
      starts: int32 ``[S]``: where each source's rows begin in the buffer of ``rows`` rows.
    Returns:
      ``(dest [rows], group_sizes [E_l])``: buffer row ``p`` goes to row ``dest[p]`` of the
      expert-ordered rows (experts contiguous, within an expert the sources in order);
      ``dest = rows`` (out of bounds) for the rows no source filled.
    """
    s, e_l = counts.shape
    sizes = jnp.sum(counts, axis=0)
    sent = jnp.sum(counts, axis=1)  # [S]
    p = jnp.arange(rows, dtype=jnp.int32)
    # The source of each row: the last one starting at or before it (a source sending
    # nothing shares its start with the next one, whose rows these are).
    src = jnp.clip(jnp.searchsorted(starts, p, side="right") - 1, 0, s - 1)
    i = p - starts[src]  # row within its source's block
    ends = jnp.cumsum(counts, axis=1)  # [S, E_l]
    j = jax.vmap(lambda e, ii: jnp.searchsorted(e, ii, side="right"))(ends[src], i)
    jc = jnp.minimum(j, e_l - 1)
    start_in_source = (ends - counts)[src, jc]
    before = _exclusive_cumsum(counts, axis=0)[src, jc]
    dest = _exclusive_cumsum(sizes)[jc] + before + i - start_in_source
    filled = (i >= 0) & (i < sent[src])
    return jnp.where(filled, dest, rows).astype(jnp.int32), sizes.astype(jnp.int32)


def receive_rows(tokens_k: int, ep: int, buffer_factor: float | None) -> int:
    """Rows of an expert rank's dropless receive buffer for ``tokens_k`` (= ``T k``) routed
    choices per source rank and ``ep`` sources: the worst case ``ep T k`` without a
    factor, else ``ceil(factor T k)`` rounded up to a multiple of 8 and at most the worst
    case."""
    worst = ep * tokens_k
    if buffer_factor is None:
        return worst
    return min(worst, -(-math.ceil(buffer_factor * tokens_k) // 8) * 8)


def _ragged_exchange_via(
    all_to_all: Callable[[jax.Array], jax.Array],
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
) -> jax.Array:
    """:func:`jax.lax.ragged_all_to_all`'s result from ``all_to_all`` (dim 0, tiled) of
    worst-case ``[EP, n, ...]`` buffers: ``n`` = the operand's rows or the output's,
    whichever is fewer (what one peer sends another fits both)."""
    rows = operand.shape[0]
    n = min(rows, output.shape[0])
    i = jnp.arange(n, dtype=jnp.int32)
    take = jnp.where(i[None] < send_sizes[:, None], input_offsets[:, None] + i[None], rows)
    recv = all_to_all(_rows_at(operand, take))  # [EP(src), N, ...]
    offsets = all_to_all(output_offsets)  # where each source's rows go here
    put = jnp.where(i[None] < recv_sizes[:, None], offsets[:, None] + i[None], output.shape[0])
    return output.at[put.reshape(-1)].set(recv.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str | tuple[str, ...],
) -> jax.Array:
    """:func:`jax.lax.ragged_all_to_all` (same arguments: to peer ``d`` this rank sends
    ``send_sizes[d]`` rows of ``operand`` from ``input_offsets[d]``, landing at
    ``output_offsets[d]`` of ``d``'s ``output``; from peer ``s`` it receives
    ``recv_sizes[s]`` rows), exact-sized where the backend has the collective (GPUs; TPUs)
    and emulated with one worst-case ``all_to_all`` where it does not (XLA:CPU): chosen
    when the program is lowered for its platform (:func:`jax.lax.platform_dependent`)."""

    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    invariant = tuple(a for a in names if a not in getattr(jax.typeof(output), "vma", ()))
    if invariant:
        # the result varies over the axes (jax types it as the output buffer, the emulation
        # as what was scattered into it): the same type on both branches
        output = jax.lax.pcast(output, invariant, to="varying")

    def native(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

    def emulated(*args):
        with jax.named_scope(EMULATED_EXCHANGE_SCOPE):
            return _ragged_exchange_via(
                lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True), *args
            )

    return jax.lax.platform_dependent(
        operand,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        cpu=emulated,
        default=native,
    )


EMULATED_EXCHANGE_SCOPE = "emulated_ragged_all_to_all"
"""The named scope of :func:`ragged_all_to_all`'s emulation (XLA:CPU: no such collective)."""


def _rows_at(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` on dim 0, zeros where ``index`` is out of bounds."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def permute_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[index]`` on dim 0 (zeros where ``index`` is out of bounds) whose gradient is a
    gather too (module docstring, fused permutations).

    Args:
      x: ``[R, ...]``.
      index: int32 ``[N]``: the row of ``x`` each result row takes (``>= R``: none).
      inverse: int32 ``[m, R]``: for each row ``r`` of ``x`` the result rows that took it,
        at most ``m`` (out of bounds, ``>= N``, where fewer): ``index[inverse[j, r]] == r``
        for every in-bounds entry, and every result row with an in-bounds ``index``
        listed once.
    Returns:
      ``[N, ...]``; its gradient ``dx[r] = sum_j g[inverse[j, r]]``, no scatter.
    """
    return _rows_at(x, index)


def _permute_rows_fwd(x, index, inverse):
    return _rows_at(x, index), (index, inverse)


def _permute_rows_bwd(residuals, g):
    _, inverse = residuals
    dx = _rows_at(g, inverse[0])
    for j in range(1, inverse.shape[0]):
        dx = dx + _rows_at(g, inverse[j])
    return dx, None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _inverse_permutation(order: jax.Array) -> jax.Array:
    """``inv`` with ``inv[order[p]] = p`` (``order`` a permutation of ``0 .. n-1``)."""
    n = order.shape[0]
    return (
        jnp.zeros((n,), jnp.int32)
        .at[order]
        .set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    )


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The collectives of one MoE layer: ``expert_axis`` (``ep`` ranks; a tuple of mesh
    axes with parallel folding, e.g. ``(expert, tensor)``) and, with expert tensor
    parallelism, ``tensor_axis`` (``tp`` ranks)."""

    expert_axis: str | tuple[str, ...] | None
    ep: int
    tensor_axis: str | None = None

    def expert_all_to_all(self, buf: jax.Array) -> jax.Array:
        if self.expert_axis is None:
            return buf
        return jax.lax.all_to_all(buf, self.expert_axis, 0, 0, tiled=True)

    def ragged_exchange(
        self,
        operand: jax.Array,
        output: jax.Array,
        input_offsets: jax.Array,
        send_sizes: jax.Array,
        output_offsets: jax.Array,
        recv_sizes: jax.Array,
    ) -> jax.Array:
        """:func:`ragged_all_to_all` over the expert ranks (a local copy with one):
        ``operand [N, H]`` into ``output [M, H]``, the four int32 ``[EP]`` arrays as there."""
        args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
        if self.expert_axis is None:
            return _ragged_exchange_via(lambda a: a, *args)
        return ragged_all_to_all(*args, axis_name=self.expert_axis)

    def tensor_gather(self, buf: jax.Array, dim: int) -> jax.Array:
        if self.tensor_axis is None:
            return buf
        return gather_from_sequence_parallel_region(buf, self.tensor_axis, dim)

    def tensor_reduce_scatter(self, buf: jax.Array, dim: int) -> jax.Array:
        if self.tensor_axis is None:
            return buf
        return reduce_scatter_to_sequence_parallel_region(buf, self.tensor_axis, dim)


@dataclasses.dataclass(frozen=True)
class CapacityDispatch(_Exchange):
    """Capacity buffers (module docstring); ``capacity`` slots per expert per source."""

    num_experts: int = 0
    capacity: int = 0

    def dispatch(self, x: jax.Array, experts: jax.Array):
        """``x [T, H]``, ``experts [T, k]`` -> ``(rows [E/EP, S C, H], None, state)`` with
        ``S = EP`` sources (``EP tp`` with expert tensor parallelism)."""
        t, h = x.shape
        k = experts.shape[1]
        slot, kept = dispatch_slots(experts, self.num_experts, self.capacity)
        target = jnp.where(kept, slot, self.capacity)  # dropped -> out of bounds: dropped
        buf = (
            jnp.zeros((self.num_experts, self.capacity, h), x.dtype)
            .at[experts, target]
            .set(jnp.broadcast_to(x[:, None, :], (t, k, h)), mode="drop")
        )
        buf = self.expert_all_to_all(buf)  # [EP(src) * E_l, C, H]
        e_l = self.num_experts // self.ep
        local = buf.reshape(self.ep, e_l, self.capacity, h).transpose(1, 0, 2, 3)
        local = self.tensor_gather(local, 1)  # [E_l, S, C, H]
        local = checkpoint_name(local.reshape(e_l, -1, h), SAVED)
        return local, None, (experts, target, kept)

    def combine(self, out: jax.Array, gates: jax.Array, state) -> jax.Array:
        experts, target, kept = state
        e_l, _, h = out.shape
        out = out.reshape(e_l, -1, self.ep, self.capacity, h)
        out = self.tensor_reduce_scatter(out, 1)  # [E_l, 1, EP, C, H]
        out = out.reshape(e_l, self.ep, self.capacity, h).transpose(1, 0, 2, 3)
        back = checkpoint_name(
            self.expert_all_to_all(out.reshape(e_l * self.ep, self.capacity, h)), SAVED
        )
        picked = back.at[experts, target].get(mode="fill", fill_value=0)  # [T, k, H]
        weights = jnp.where(kept, gates, 0.0).astype(out.dtype)
        return jnp.einsum("tkh,tk->th", picked, weights)

    def kept(self, state) -> jax.Array:
        return state[2]


@dataclasses.dataclass(frozen=True)
class DroplessDispatch(_Exchange):
    """Sorted, ragged rows (module docstring); ``buffer_factor``: the receive buffer's
    bound (:func:`receive_rows`; ``None``: the worst case)."""

    num_experts: int = 0
    buffer_factor: float | None = None
    permute_fusion: bool = False
    """:func:`permute_rows` for the permutations (module docstring)."""

    def _permute(self, x: jax.Array, index: jax.Array, inverse) -> jax.Array:
        """``x[index]`` on dim 0 (zeros out of bounds); fused: :func:`permute_rows` with
        ``inverse()`` (``[m, R]``)."""
        return permute_rows(x, index, inverse()) if self.permute_fusion else _rows_at(x, index)

    def dispatch(self, x: jax.Array, experts: jax.Array):
        """``x [T, H]``, ``experts [T, k]`` -> ``(rows [R, H], group_sizes [E/EP], state)``:
        ``R = T k`` rows on one expert rank, else ``etp B`` with ``B`` =
        :func:`receive_rows` (``etp`` = expert tensor ranks); rows past the groups are
        zeros."""
        t, h = x.shape
        tk, k = experts.size, experts.shape[1]
        flat = experts.T.reshape(-1)  # choice c = kk * T + token
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted position -> c
        # c -> its sorted position (fused permutations only)
        inv = _inverse_permutation(order) if self.permute_fusion else None
        counts = jnp.zeros((self.num_experts,), jnp.int32).at[flat].add(1)
        # [T k, H] grouped by expert; token t's choices kk are at inv[kk T + t]
        rows = self._permute(x, order % t, lambda: inv.reshape(k, t))
        if self.expert_axis is None and self.tensor_axis is None:
            return rows, counts, (order, inv, None)
        e_l = self.num_experts // self.ep
        per_rank = counts.reshape(self.ep, e_l)
        sent = jnp.sum(per_rank, axis=1)  # [EP(dst)]
        start = _exclusive_cumsum(sent)  # where each destination's rows begin in `rows`
        cap = receive_rows(tk, self.ep, self.buffer_factor)
        # The counts to the receivers; each receiver places its sources back to back,
        # keeps what fits in its `cap` rows and tells every source where and how many.
        recv_counts = self.expert_all_to_all(per_rank)  # [EP(src), E_l]
        src_start = self.expert_all_to_all(start)  # [EP(src)]: my rows in each source's
        recv_sizes = jnp.sum(recv_counts, axis=1)
        fit = jnp.clip(cap - _exclusive_cumsum(recv_sizes), 0, recv_sizes)
        recv_start = _exclusive_cumsum(fit)  # <= cap (= cap for sources that do not fit)
        fit_counts = jnp.clip(fit[:, None] - _exclusive_cumsum(recv_counts, axis=1), 0, recv_counts)
        overflow = jnp.sum(recv_sizes - fit)
        placed = self.expert_all_to_all(jnp.stack([recv_start, fit], axis=1))  # [EP(dst), 2]
        out_start, send_n = placed[:, 0], placed[:, 1]
        recv = self.ragged_exchange(
            rows, jnp.zeros((cap, h), rows.dtype), start, send_n, out_start, fit
        )  # [cap, H]
        etp = 1 if self.tensor_axis is None else jax.lax.axis_size(self.tensor_axis)
        recv = self.tensor_gather(recv, 0)  # [etp cap, H]
        starts = recv_start
        if self.tensor_axis is not None:
            fit_counts = jax.lax.all_gather(fit_counts, self.tensor_axis, axis=0, tiled=True)
            rank = jnp.arange(etp, dtype=jnp.int32)[:, None] * cap
            starts = (rank + jax.lax.all_gather(recv_start, self.tensor_axis, axis=0)).reshape(-1)
        dest, sizes = group_by_expert(fit_counts, starts, etp * cap)
        source = (
            jnp.full((etp * cap + 1,), etp * cap, jnp.int32)
            .at[dest]
            .set(jnp.arange(etp * cap, dtype=jnp.int32), mode="drop")[:-1]
        )
        local = checkpoint_name(self._permute(recv, source, lambda: dest[None]), SAVED)
        exchanged = (dest, source, recv_start, fit, src_start, send_n, overflow)
        return local, sizes, (order, inv, exchanged)

    def combine(self, out: jax.Array, gates: jax.Array, state) -> jax.Array:
        order, inv, exchanged = state
        t, k = gates.shape
        h = out.shape[-1]
        if exchanged is None:
            sorted_out = out
        else:
            dest, source, recv_start, fit, src_start, send_n, _ = exchanged
            # [etp cap, H] in the received order
            back = self._permute(out, dest, lambda: source[None])
            back = self.tensor_reduce_scatter(back, 0)  # [cap, H]
            sorted_out = checkpoint_name(
                self.ragged_exchange(
                    back, jnp.zeros((t * k, h), back.dtype), recv_start, fit, src_start, send_n
                ),
                SAVED,
            )  # [T k, H] in this rank's sorted order
        if self.permute_fusion:  # a gather (by the inverse order), fused into the sum
            per_choice = permute_rows(sorted_out, inv, order[None])
        else:
            per_choice = jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)
        return jnp.einsum("kth,tk->th", per_choice.reshape(k, t, h), gates.astype(out.dtype))

    def kept(self, state) -> jax.Array | None:
        return None

    def overflow(self, state) -> jax.Array:
        """Scalar int32: the routed rows this expert rank's receive buffer could not hold
        (0 within the bound; never more than 0 without ``buffer_factor``)."""
        exchanged = state[2]
        return jnp.zeros((), jnp.int32) if exchanged is None else exchanged[-1]
