"""Tier: gradients in Megatron's flat, padded buckets -- their plan, buffer, layout, sync
and finalization. Knows nothing of the model: a layout is built from per-parameter
:class:`GradSpec`\\ s (:mod:`jax_wgrad.grads.spec`).

**Why a tuple of per-bucket arrays and not one flat array with bucket offsets.** A bucket
is the unit of communication (one reduce-scatter or all-reduce each) and, in the pipeline
cooldown, the unit whose sync can start once its last gradient is in. With one array per
bucket each collective consumes a whole array (no slice that XLA might copy), each bucket
is its own scan-carry leaf (updated in place, donated independently) and a bucket can be
reduced, freed or kept without touching the others. Megatron's single allocation with
bucket *views* has no JAX counterpart (arrays have no views), so contiguity across buckets
buys nothing here. Inside a bucket the layout is exactly Megatron's
(:func:`plan_buckets`), so ``offset`` values and shard ranges match.

**Chunks.** Megatron keeps one buffer per model chunk (and dtype);
:meth:`GradBuffer.concatenate` joins separately planned buffers into one whose tree is the
tuple of their trees and whose buckets are theirs, in order -- a pipeline stage's own
layers and the embedding/head parameters that are shared between stages and synced at a
different time.
"""

from jax_wgrad.grads.buffer import BufferGroup, GradBuffer, ParamSlot, SlotPiece
from jax_wgrad.grads.chunks import Chunks, DeviceTree, GradState
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import finalize_grads, sync_stage_buckets
from jax_wgrad.grads.layout import GradLayout, layer_group_bounds
from jax_wgrad.grads.masks import flat_mask, local_mask, psum_flagged
from jax_wgrad.grads.plan import (
    BucketPlan,
    bucket_end_divisor,
    param_shards,
    plan_buckets,
    shard_range,
)
from jax_wgrad.grads.sink import GradSink, SinkEntry, Tape
from jax_wgrad.grads.spec import CHUNKS, INPUT, LAYERS, OUTPUT, ROLES, SHARED, STAGE, GradSpec
from jax_wgrad.grads.sync import shard_buckets, sync_buckets

__all__ = [
    "BucketPlan",
    "BufferGroup",
    "CHUNKS",
    "Chunks",
    "DDPConfig",
    "DeviceTree",
    "GradBuffer",
    "GradLayout",
    "layer_group_bounds",
    "GradSink",
    "GradSpec",
    "GradState",
    "SinkEntry",
    "Tape",
    "INPUT",
    "LAYERS",
    "OUTPUT",
    "ParamSlot",
    "SlotPiece",
    "ROLES",
    "SHARED",
    "STAGE",
    "bucket_end_divisor",
    "finalize_grads",
    "flat_mask",
    "local_mask",
    "param_shards",
    "plan_buckets",
    "psum_flagged",
    "shard_buckets",
    "shard_range",
    "sync_buckets",
    "sync_stage_buckets",
]
