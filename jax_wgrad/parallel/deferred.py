"""Deferred output-layer weight gradients (Megatron's ``defer_embedding_wgrad_compute``).

On the last pipeline stage the output projection to the vocabulary has the largest
weight-gradient GEMM of the model. With deferral the schedule computes only its data
gradient; what the weight gradient needs is kept in a fixed-size, scan-carried *stash*
indexed by microbatch, and :func:`drain` does the GEMMs after the pipeline loop, before
any reduction of that weight's gradient (over ``data``, or between the tied first/last
stage copies -- Megatron drains after launching the data-parallel reduce; we do not).

Semantics are Megatron's: microbatches ``0 .. min(L, M) - 1`` are deferred (``L = 0``:
all ``M``); the others accumulate immediately through the fused op. Two stash layouts:

* ``stash`` (Megatron): per deferred microbatch the output layer's input ``x`` (this
  rank's sequence chunk ``[mb, S/tp, H]`` under sequence parallelism, else ``[mb, S, H]``)
  and ``dy = dlogits`` ``[mb, S, V/tp]`` (all tokens, this rank's vocabulary shard).
* ``recompute``: ``x``, the per-token logsumexp ``[mb, S]`` (fp32) and the labels
  ``[mb, S]``; the drain rebuilds ``dy = scale * (softmax - onehot)`` chunk by chunk from
  ``x W^T`` -- ``O(M T H)`` memory instead of ``O(M T V/tp)``, one extra GEMM per item.

With sequence parallelism the drain does not all-gather ``x``: the token chunks travel
round the ``tensor`` ring with ``ppermute`` (:func:`ring_shift`), two chunk buffers alive
at a time, and ring step ``k`` accumulates ``dy[chunk]^T x_chunk`` with the chunk it holds
while the permute of step ``k`` forwards that chunk -- the GEMM never consumes the transfer
issued beside it (collective matmul; Megatron's double-buffered all-gather).

Every function here runs per device inside ``shard_map`` over ``(data, expert, context,
tensor, pipeline)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad import ops
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import TENSOR
from jax_wgrad.parallel.pipeline.context import Predicate, cond
from jax_wgrad.parallel.pipeline.scopes import DEFERRED_RING

__all__ = ["stash_items", "stash_put", "stash_bytes", "is_deferred", "ring_shift", "drain"]

Stash = tuple[jax.Array, ...]


def stash_bytes(stash: Stash) -> int:
    """Bytes of one device's stash (arrays or shapes)."""
    return sum(jnp.dtype(s.dtype).itemsize * math.prod(s.shape) for s in stash)


def stash_items(
    par: ParallelConfig, x: jax.Array, dy: jax.Array, extras: Callable[[], tuple[jax.Array, ...]]
) -> Stash:
    """What the stash keeps of one microbatch: the output layer's input ``x``
    ``[mb, S, H]`` (this rank's sequence chunk under sequence parallelism: the drain's ring
    brings the others) and ``dy`` (``stash`` mode) or the model's ``extras()`` to rebuild
    it (``recompute`` mode)."""
    if par.sequence_parallel and par.tensor_model_parallel_size > 1:
        chunk = x.shape[1] // par.tensor_model_parallel_size
        x = lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * chunk, chunk, axis=1)
    return (x, dy) if par.defer_mode == "stash" else (x, *extras())


def stash_put(stash: Stash, index, items: Stash) -> Stash:
    """Writes one microbatch's items at ``index`` (in place in the scan carry)."""
    return tuple(
        lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), index, 0)
        for s, v in zip(stash, items)
    )


def is_deferred(par: ParallelConfig, microbatch):
    """Megatron's predicate ``L == 0 or b < L`` (traced ``b``)."""
    return microbatch < par.num_deferred_microbatches


def ring_shift(a: jax.Array, tp: int, axis_name: str = TENSOR) -> jax.Array:
    """Rank ``r``'s ``a`` goes to rank ``(r + 1) % tp`` (rank ``r`` receives ``r - 1``'s).

    Written as two ACYCLIC permutes (the chain ``i -> i+1`` and the wrap ``tp-1 -> 0``)
    added together (a rank in no pair of a permute receives zeros): a ring over ``tensor``
    in a mesh with other axes is a permute with several cycles, which XLA:GPU has
    returned zeros for (``docs/design/pipeline_executor.md``).
    """
    chain = lax.ppermute(a, axis_name, [(i, i + 1) for i in range(tp - 1)])
    wrap = lax.ppermute(a, axis_name, [(tp - 1, 0)])
    return chain + wrap


def drain(
    par: ParallelConfig,
    stash: Stash,
    bucket: jax.Array,
    offset: int,
    recompute: Callable[[jax.Array, tuple], jax.Array] | None = None,
    *,
    active: Predicate | None = None,
    axis_name: str = TENSOR,
) -> jax.Array:
    """Accumulates every stashed microbatch's ``dy^T x`` into the output layer's block
    ``[offset, offset + V/tp * H)`` of the flat ``bucket`` with the fused op.

    A ``lax.scan`` over the stashed microbatches; under sequence parallelism each item is
    a ``tensor`` ring of ``tp`` steps (module docstring). ``recompute`` (recompute mode):
    ``recompute(x, extras) -> dy`` for ``x`` ``[mb, s, H]`` and the stashed extras sliced
    to the same tokens (the model's rebuild of the output gradient, e.g.
    :func:`jax_wgrad.functional.cross_entropy.recompute_dy`).

    ``active`` (traced bool, e.g. "this is the last stage", or a Python bool, static:
    :func:`jax_wgrad.parallel.pipeline.context.cond`): only where it is true are the GEMMs
    computed. The loop over the stash, the ring's permutes and the slicing of each item
    run on EVERY device; a conditional holds only the GEMMs of one item's chunk (and, in
    recompute mode, the rebuild of its ``dy``). Two reasons: the XLA:CPU
    collective-permute is one rendezvous of all devices of the program (its pairs span
    all groups), so a permute inside a branch that other pipeline stages skip hangs; and
    XLA:GPU captures a conditional in a CUDA graph (a conditional node: no predicate
    read back on the host) only when its branch holds nothing it cannot capture -- a
    slice at a traced position is an asynchronous copy it cannot
    (``docs/design/aot.md``). Non-last stages hold a zero stash, so they forward zeros.
    """
    if active is None:
        active = True
    tp, sp = par.tensor_model_parallel_size, par.sequence_parallel
    if (par.defer_mode == "recompute") != (recompute is not None):
        raise ValueError(
            f"deferred.drain: defer_mode {par.defer_mode!r} "
            + ("needs" if recompute is None else "takes no")
            + " recompute"
        )

    dy_of = recompute if recompute is not None else (lambda x, sliced: sliced[0])

    def accumulate(bk, x, sliced, scope):
        """``dy^T x`` of one chunk into ``bk`` where ``active``: ``sliced`` is ``(dy,)``
        or, in recompute mode, the extras sliced to ``x``'s tokens."""
        with jax.named_scope(scope):
            return cond(
                active,
                lambda bk, x, s: ops.wgrad_accumulate(x, dy_of(x, s), bk, offset=offset),
                lambda bk, x, s: bk,
                bk,
                x,
                sliced,
            )

    def one(bk, item):
        x = item[0]
        if not sp:
            return accumulate(bk, x, item[1:], "deferred_wgrad"), None
        chunk = x.shape[1]
        rank = lax.axis_index(axis_name)
        cur = x
        for k in range(tp):
            scope = f"{DEFERRED_RING}{k}"
            with jax.named_scope(scope):
                # Forward the chunk we hold while computing with it: the GEMM below does not
                # depend on this transfer, only the next step's does.
                nxt = ring_shift(cur, tp, axis_name) if k < tp - 1 else None
                src = (rank - k) % tp  # the rank this chunk's tokens belong to
                sliced = tuple(
                    lax.dynamic_slice_in_dim(a, src * chunk, chunk, axis=1) for a in item[1:]
                )
            bk = accumulate(bk, cur, sliced, scope)
            cur = nxt
        return bk, None

    bucket, _ = lax.scan(one, bucket, stash)
    return bucket
