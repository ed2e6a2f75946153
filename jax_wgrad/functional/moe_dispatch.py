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
  group; exchanged with one ``all_to_all`` of a worst-case ``[EP, T k, H]`` buffer plus the
  ``[EP, E/EP]`` counts (bytes worst-case, because XLA:CPU cannot compile
  ``ragged_all_to_all``); on receipt the rows are ordered by local expert: ``[EP T k, H]``
  with ``group_sizes [E/EP]``, the ragged GEMMs' input (work: the routed rows only).

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

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_wgrad.functional.collectives import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from jax_wgrad.functional.saved import SAVED

__all__ = ["CapacityDispatch", "DroplessDispatch", "dispatch_slots", "group_by_expert"]


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


def group_by_expert(counts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Where each received row goes when the rows are ordered by local expert.

    Args:
      counts: int32 ``[S, E_l]``: source ``s`` sent ``counts[s, j]`` rows of local expert
        ``j``, back to back in expert order at the start of its ``rows`` slots.
    Returns:
      ``(dest [S, rows], group_sizes [E_l])``: row ``i`` of source ``s`` goes to row
      ``dest[s, i]`` of ``[S * rows]`` (experts contiguous, within an expert the sources in
      order); ``dest = S * rows`` (out of bounds) for the slots past what ``s`` sent.
    """
    s, e_l = counts.shape
    sizes = jnp.sum(counts, axis=0)
    ends = jnp.cumsum(counts, axis=1)  # [S, E_l]
    i = jnp.arange(rows, dtype=jnp.int32)
    j = jax.vmap(lambda e: jnp.searchsorted(e, i, side="right"))(ends)  # [S, rows]
    jc = jnp.minimum(j, e_l - 1)
    start_in_source = jnp.take_along_axis(ends - counts, jc, axis=1)
    before = jnp.take_along_axis(_exclusive_cumsum(counts, axis=0), jc, axis=1)
    dest = _exclusive_cumsum(sizes)[jc] + before + i[None] - start_in_source
    return jnp.where(j < e_l, dest, s * rows).astype(jnp.int32), sizes.astype(jnp.int32)


def _rows_at(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` on dim 0, zeros where ``index`` is out of bounds."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The collectives of one MoE layer: ``expert_axis`` (``ep`` ranks) and, with expert
    tensor parallelism, ``tensor_axis`` (``tp`` ranks)."""

    expert_axis: str | None
    ep: int
    tensor_axis: str | None = None

    def expert_all_to_all(self, buf: jax.Array) -> jax.Array:
        if self.expert_axis is None:
            return buf
        return jax.lax.all_to_all(buf, self.expert_axis, 0, 0, tiled=True)

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
    """Sorted, ragged rows (module docstring)."""

    num_experts: int = 0

    def dispatch(self, x: jax.Array, experts: jax.Array):
        """``x [T, H]``, ``experts [T, k]`` -> ``(rows [R, H], group_sizes [E/EP], state)``:
        ``R = T k`` rows on one expert rank without expert tensor parallelism, else
        ``S T k`` for ``S`` sources; rows past the groups are zeros."""
        t, h = x.shape
        tk = experts.size
        flat = experts.T.reshape(-1)  # choice c = kk * T + token
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted position -> c
        counts = jnp.zeros((self.num_experts,), jnp.int32).at[flat].add(1)
        rows = x[order % t]  # [T k, H] grouped by expert
        if self.expert_axis is None and self.tensor_axis is None:
            return rows, counts, (order, None, None, None)
        e_l = self.num_experts // self.ep
        per_rank = counts.reshape(self.ep, e_l)
        sent = jnp.sum(per_rank, axis=1)
        start = _exclusive_cumsum(sent)
        i = jnp.arange(tk, dtype=jnp.int32)
        send = _rows_at(rows, jnp.where(i[None] < sent[:, None], start[:, None] + i[None], tk))
        recv = self.expert_all_to_all(send)  # [EP(src), T k, H]
        recv_counts = self.expert_all_to_all(per_rank)  # [EP(src), E_l]
        recv = self.tensor_gather(recv, 0).reshape(-1, tk, h)  # [S, T k, H]
        if self.tensor_axis is not None:
            recv_counts = jax.lax.all_gather(recv_counts, self.tensor_axis, axis=0, tiled=True)
        dest, sizes = group_by_expert(recv_counts, tk)
        s = dest.shape[0]
        source = (
            jnp.full((s * tk + 1,), s * tk, jnp.int32)
            .at[dest.reshape(-1)]
            .set(jnp.arange(s * tk, dtype=jnp.int32), mode="drop")[:-1]
        )
        local = checkpoint_name(_rows_at(recv.reshape(s * tk, h), source), SAVED)
        return local, sizes, (order, dest, start, sent)

    def combine(self, out: jax.Array, gates: jax.Array, state) -> jax.Array:
        order, dest, start, sent = state
        t, k = gates.shape
        h = out.shape[-1]
        if dest is None:
            sorted_out = out
        else:
            back = _rows_at(out, dest.reshape(-1)).reshape(dest.shape[0], t * k, h)
            back = self.tensor_reduce_scatter(back, 0)  # [EP, T k, H]
            back = checkpoint_name(self.expert_all_to_all(back), SAVED)  # [EP(dst), T k, H]
            p = jnp.arange(t * k, dtype=jnp.int32)
            rank = jnp.searchsorted(jnp.cumsum(sent), p, side="right")
            sorted_out = _rows_at(back.reshape(-1, h), rank * (t * k) + p - start[rank])
        per_choice = jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)
        return jnp.einsum("kth,tk->th", per_choice.reshape(k, t, h), gates.astype(out.dtype))

    def kept(self, state) -> jax.Array | None:
        return None
