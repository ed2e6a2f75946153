"""Megatron's gradient finalization of the bucketed gradients of one step.

Everything runs per device inside ``shard_map`` over the ``(data, expert, tensor,
pipeline)`` mesh, on the buckets of a :class:`~jax_wgrad.grads.layout.GradLayout`: the
:data:`STAGE` and :data:`EXPERTS` chunks (synced in the pipeline cooldown with
``overlap_grad_reduce``, else here) and the :data:`SHARED` chunk (every stage's replica of
the embedding/head).

**Finalization** (:func:`finalize_grads`), in Megatron's order:

1. data-parallel sync of each bucket over its chunk's group (:data:`SYNC_AXES`): scale by
   ``1/dp`` (or 1 with ``average_in_collective``, which divides after the sum) and
   reduce-scatter (distributed optimizer) or all-reduce -- one collective per bucket.
   Expert buckets are synced over the ``dp / EP`` expert-data-parallel ranks with
   Megatron's expert factor: ``1/dp`` as well (``edp/dp`` with ``average_in_collective``,
   whose division is then by ``edp``), so every gradient is the mean over all ``dp``
   data-parallel ranks' tokens. Whatever the options, the net factor of this step is
   ``1/dp``; for **fp32 buckets** (the default grad dtype) it is not applied here but
   folded into step 4's multiply (:func:`prescaled`): the sum is reduced as it is, and
   one shard-sized multiply replaces a pass over every whole bucket before its
   collective (14 GB of memory traffic a step for Llama-3-8B at TP2 PP2 DP2). The result
   is the same sum divided after the reduction, as ``average_in_collective`` asks (and
   bit for bit Megatron's pre-scaling when ``dp`` is a power of two); 16-bit buckets keep
   Megatron's pre-scaling, which protects their range;
2. all-reduce over ``tensor`` of the gradients of parameters replicated over tensor ranks
   under sequence parallelism (LayerNorms, row-parallel biases, positions);
3. the tied word-embedding all-reduce over ``pipeline``: the ``shared`` chunk's
   pipeline-replicated parameters (not the vocabulary shards of a vocabulary split over the
   pipeline, each stage's own);
4. scaling by the number of tokens: the backward is seeded with the token-loss SUM, so
   gradients are multiplied by ``dp / num_tokens`` (the data-parallel average of step 1
   times ``dp`` gives the global sum; divided by the global token count: the gradient of
   the global mean token loss); by ``1 / num_tokens`` for the fp32 buckets whose step 1
   summed without the ``1/dp``.

The norm / clipping / skip / update that follow are
:class:`jax_wgrad.optim.DistributedOptimizer`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.layout import SYNC_AXES, GradLayout
from jax_wgrad.grads.masks import psum_flagged
from jax_wgrad.grads.spec import EXPERTS, STAGE
from jax_wgrad.grads.sync import (
    axis_index,
    axis_size,
    place_shards,
    shard_buckets,
    sync_buckets,
)
from jax_wgrad.ops.position import INT32_MAX
from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL, PIPELINE, TENSOR

__all__ = [
    "DATA_PARALLEL_SYNC_SCOPE",
    "SYNC_IN_BACKWARD_SCOPE",
    "prescaled",
    "sync_chunk",
    "sync_bucket_chunk",
    "chunk_syncable",
    "sync_stage_buckets",
    "finalize_grads",
]

Buckets = tuple[jax.Array, ...]

SYNC_IN_BACKWARD_SCOPE = "grad_sync_in_backward"
"""``jax.named_scope`` of :func:`sync_bucket_chunk`'s collectives (what the compile
report counts as the data-parallel sync inside the last backward)."""

DATA_PARALLEL_SYNC_SCOPE = "data_parallel_sync"
"""``jax.named_scope`` of the data-parallel sync after the schedule (buckets the cooldown
and the last backward did not sync)."""


def sync_chunk(buckets: Buckets, ddp: DDPConfig, chunk: str) -> Buckets:
    """The data-parallel sync of one chunk's buckets over its group (:data:`SYNC_AXES`).
    16-bit buckets (:func:`prescaled`) get Megatron's scaling: ``1/dp`` before the
    collective, or with ``average_in_collective`` 1 for dense and ``edp/dp`` for expert
    buckets, then divided by the group size after it (``ReduceOp.AVG``); fp32 buckets are
    reduced unscaled (their ``1/dp`` is in :func:`finalize_grads`' token scaling)."""
    axis = SYNC_AXES[chunk]
    factor = None
    if chunk == EXPERTS:
        dp, edp = axis_size(DATA_CONTEXT_PARALLEL), axis_size(axis)
        factor = edp / dp if ddp.average_in_collective else 1.0 / dp

    def one(b: jax.Array) -> jax.Array:
        scaled = prescaled(b)
        return sync_buckets(
            (b,),
            axis_name=axis,
            use_distributed_optimizer=ddp.use_distributed_optimizer,
            gradient_scaling_factor=factor if scaled else 1.0,
            average_in_collective=ddp.average_in_collective and scaled,
        )[0]

    return tuple(one(b) for b in buckets)


def chunk_syncable(numel: int, dp: int, num_chunks: int, ddp: DDPConfig) -> bool:
    """Whether a bucket of ``numel`` elements can be synced in ``num_chunks`` equal
    chunks by :func:`sync_bucket_chunk` (every rank's shard split evenly, int32 element
    positions)."""
    per = numel // dp if ddp.use_distributed_optimizer else numel
    return numel % dp == 0 and per % num_chunks == 0 and numel <= INT32_MAX


def sync_bucket_chunk(
    bucket: jax.Array, i: jax.Array, num_chunks: int, ddp: DDPConfig, chunk: str
) -> jax.Array:
    """Chunk ``i`` (traced int32) of ``num_chunks`` of one bucket's data-parallel sync,
    written back in place -- a bucket synced piece by piece while the backward runs
    (layer groups, :class:`~jax_wgrad.grads.GradLayout`).

    With the distributed optimizer the ``[numel]`` bucket is viewed ``[dp, numel / dp]``
    (row ``r``: rank ``r``'s shard) and columns ``[i c, (i + 1) c)`` with ``c = numel /
    dp / num_chunks`` are reduce-scattered: each rank receives its own shard's chunk and
    writes it at its row (what :func:`sync_stage_buckets` leaves for the whole bucket);
    without it elements ``[i c, (i + 1) c)``, ``c = numel / num_chunks``, are all-reduced.
    Scaling as :func:`sync_chunk`. Needs :func:`chunk_syncable`."""
    axis = SYNC_AXES[chunk]
    dp, n = axis_size(axis), bucket.shape[0]
    if not chunk_syncable(n, dp, num_chunks, ddp):
        raise ValueError(
            f"sync_bucket_chunk: a bucket of {n} elements cannot be synced in "
            f"{num_chunks} chunks over {dp} ranks"
        )
    with jax.named_scope(SYNC_IN_BACKWARD_SCOPE):
        if not ddp.use_distributed_optimizer:
            c = n // num_chunks
            part = lax.dynamic_slice_in_dim(bucket, i * c, c)
            return lax.dynamic_update_slice_in_dim(
                bucket, sync_chunk((part,), ddp, chunk)[0], i * c, 0
            )
        c = n // dp // num_chunks
        view = bucket.reshape(dp, n // dp)
        slab = lax.dynamic_slice_in_dim(view, i * c, c, axis=1)  # [dp, c]: row r for rank r
        mine = sync_chunk((slab.reshape(-1),), ddp, chunk)[0]  # [c]: this rank's row, reduced
        view = lax.dynamic_update_slice(view, mine[None], (axis_index(axis), i * c))
        return view.reshape(n)


def prescaled(bucket: jax.Array) -> bool:
    """Whether the data-parallel sync scales ``bucket`` by ``1/dp`` (Megatron's step 1,
    before or, with ``average_in_collective``, after the collective): 16-bit buckets.
    An fp32 bucket is reduced unscaled and its ``1/dp`` folded into the token scaling
    (the module docstring, step 1)."""
    return bucket.dtype != jnp.float32


def sync_stage_buckets(buckets: Buckets, ddp: DDPConfig, chunk: str = STAGE) -> Buckets:
    """The data-parallel sync of a stage's buckets (chunk ``chunk``), in place (for the
    cooldown).

    Returns buckets of the same shapes: all-reduced buckets, or (distributed optimizer)
    each bucket with its reduce-scattered shard written into the rank's own range -- where
    Megatron's reduce-scatter leaves it in the grad buffer. :func:`finalize_grads` takes
    the shards out again with ``stage_synced=True``.
    """
    synced = sync_chunk(buckets, ddp, chunk)
    if not ddp.use_distributed_optimizer:
        return synced
    return place_shards(buckets, synced, axis_name=SYNC_AXES[chunk])


def finalize_grads(
    layout: GradLayout,
    ddp: DDPConfig,
    buckets: Buckets,
    *,
    synced_in_place: Sequence[bool],
    num_tokens: jax.Array,
    sequence_parallel: bool,
    pipeline_parallel: bool,
) -> Buckets:
    """Megatron's gradient finalization (module docstring, steps 1-4).

    Args:
      buckets: this device's buckets (``layout.buffer``): local sums of token-loss
        gradients, some already synced in place.
      synced_in_place: per bucket of ``layout.buffer``: synced already, in place (the
        stage and expert chunks in the pipeline cooldown, a layer group's bucket in the
        last backward: :func:`sync_stage_buckets`' and :func:`sync_bucket_chunk`'s form);
        only this rank's shard is taken out of it.
      num_tokens: fp32 scalar, tokens of this data rank's batch (summed over ``data``
        here, like Megatron's all-reduce of ``num_tokens``).
    Returns:
      Synced gradients of the mean token loss: ``[numel_i / dp]`` shards (distributed
      optimizer) or full ``[numel_i]`` buckets, one per bucket of ``layout.buffer``.
    """
    dist = ddp.use_distributed_optimizer
    if len(synced_in_place) != len(buckets):
        raise ValueError(
            f"finalize_grads: synced_in_place has {len(synced_in_place)} flags for "
            f"{len(buckets)} buckets"
        )
    done = layout.state(tuple(synced_in_place))
    state = layout.state(buckets)
    with jax.named_scope(DATA_PARALLEL_SYNC_SCOPE):

        def sync(name, bks):
            axis = SYNC_AXES[name]
            return tuple(
                (shard_buckets((b,), axis_name=axis)[0] if dist else b)
                if synced
                else sync_chunk((b,), ddp, name)[0]
                for b, synced in zip(bks, done[name])
            )

        state = state.map(sync)
    synced = layout.concatenated(state)
    if sequence_parallel:
        with jax.named_scope("sequence_parallel_grads_all_reduce"):
            synced = psum_flagged(
                layout.buffer,
                synced,
                layout.tensor_replicated_flags,
                TENSOR,
                axis_name=None,
                bucket_axes=layout.bucket_axes if dist else None,
            )
    if pipeline_parallel:
        with jax.named_scope("embedding_grads_all_reduce"):
            synced = _sum_over_pipeline(layout, synced, dist)
    with jax.named_scope("token_scaling"):
        dp = axis_size(DATA_CONTEXT_PARALLEL)
        total = lax.psum(num_tokens, DATA_CONTEXT_PARALLEL)
        scale = (jnp.float32(dp) / total).astype(jnp.float32)
        unscaled = (jnp.float32(1.0) / total).astype(jnp.float32)
        synced = tuple(g * (scale if prescaled(g) else unscaled) for g in synced)
    return synced


def _sum_over_pipeline(layout: GradLayout, synced: Buckets, dist: bool) -> Buckets:
    """The pipeline-replicated parameters' gradients (:attr:`GradSpec.pipeline_shared`)
    summed over ``pipeline`` (:func:`~jax_wgrad.grads.masks.psum_flagged`: a bucket of
    only those whole, one that also holds pipeline-sharded ones by its flagged runs, the
    others untouched)."""
    return psum_flagged(
        layout.buffer,
        synced,
        tuple(spec.pipeline_shared for spec in layout.specs),
        PIPELINE,
        axis_name=None,
        bucket_axes=layout.bucket_axes if dist else None,
    )
