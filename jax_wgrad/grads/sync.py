"""Data-parallel sync of flat gradient buckets (Megatron's ``start_grad_sync``).

Everything here runs inside ``jax.shard_map``: one collective per bucket over the data
axis (:func:`sync_buckets`), the rank's contiguous shard of a replicated bucket
(:func:`shard_buckets`, what a tiled reduce-scatter leaves on it), and the shards written
back into the rank's own range (:func:`place_shards`). A rank's shard is addressed as row
``rank`` of the bucket viewed as ``[dp, numel / dp]``, never as the element position
``rank * numel / dp``, which is not an int32 past ``2**31`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["AxisName", "axis_size", "axis_index", "sync_buckets", "shard_buckets", "place_shards"]

AxisName = str | tuple[str, ...]
Buckets = tuple[jax.Array, ...]


def axis_size(axis_name: AxisName) -> int:
    """Devices along ``axis_name`` (a mesh axis or a tuple of them)."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    size = 1
    for n in names:
        size *= lax.axis_size(n)
    return size


def axis_index(axis_name: AxisName) -> jax.Array:
    """This device's index along ``axis_name`` (a mesh axis or a tuple of them)."""
    return lax.axis_index(axis_name if isinstance(axis_name, str) else tuple(axis_name))


def sync_buckets(
    buckets: Sequence[jax.Array],
    *,
    axis_name: AxisName,
    use_distributed_optimizer: bool,
    gradient_scaling_factor: float | jax.Array | None = None,
    average_in_collective: bool = False,
) -> Buckets:
    """Data-parallel gradient sync, one collective per bucket (Megatron's ``start_grad_sync``).

    Call inside ``shard_map``. Each bucket is first multiplied by
    ``gradient_scaling_factor`` (skipped when it is the constant 1), then

    * ``use_distributed_optimizer``: ``psum_scatter(tiled=True)`` over ``axis_name``; rank
      ``r`` keeps the ``r``-th contiguous ``numel / dp`` slice (= ``buckets.shard_range``);
    * otherwise: ``psum`` (all-reduce), every rank keeps the whole bucket.

    With ``average_in_collective`` the factor defaults to 1 and the reduced result is divided
    by the axis size after the collective (the JAX spelling of NCCL's ``ReduceOp.AVG``:
    XLA has no averaging reduce-scatter; dividing the shard costs ``numel / dp`` flops).
    Without it the factor defaults to ``1 / dp`` (pre-scaling, Megatron's default).

    Args:
      buckets: flat per-bucket arrays ``[numel_i]`` (this device's accumulated grads).
      axis_name: the data-parallel mesh axis (or a tuple of axes, e.g. data and context).
      use_distributed_optimizer: reduce-scatter instead of all-reduce.
      gradient_scaling_factor: pre-collective scale; default as above (MoE expert grads
        pass ``expert_dp / dp`` here, as Megatron does).
      average_in_collective: Megatron's ``average_in_collective``.
    Returns:
      Tuple of ``[numel_i / dp]`` shards (distributed optimizer) or ``[numel_i]`` buckets.
    Raises:
      ValueError: under the distributed optimizer, if a bucket is not divisible by dp.
    """
    dp = axis_size(axis_name)
    if gradient_scaling_factor is None:
        gradient_scaling_factor = 1.0 if average_in_collective else 1.0 / dp
    out = []
    for i, b in enumerate(buckets):
        if b.ndim != 1:
            raise ValueError(f"sync_buckets: bucket {i} must be flat, got shape {b.shape}")
        if not (
            isinstance(gradient_scaling_factor, (int, float)) and gradient_scaling_factor == 1.0
        ):
            b = b * jnp.asarray(gradient_scaling_factor, b.dtype)
        if use_distributed_optimizer:
            if b.shape[0] % dp:
                raise ValueError(
                    f"sync_buckets: bucket {i} has {b.shape[0]} elements, not divisible by the "
                    f"{dp} ranks of {axis_name!r}; plan the buffer with "
                    f"use_distributed_optimizer=True and dp_size={dp}"
                )
            r = lax.psum_scatter(b, axis_name, scatter_dimension=0, tiled=True)
        else:
            r = lax.psum(b, axis_name)
        if average_in_collective:
            r = r / jnp.asarray(dp, r.dtype)
        out.append(r)
    return tuple(out)


def _check_sharded(
    who: str, i: int, b: jax.Array | np.ndarray, dp: int, axis_name: AxisName
) -> int:
    """Elements per rank of flat bucket ``i`` (divisible by ``dp``)."""
    if b.ndim != 1 or b.shape[0] % dp:
        raise ValueError(
            f"{who}: bucket {i} of shape {b.shape} is not a flat "
            f"array divisible by the {dp} ranks of {axis_name!r}"
        )
    return b.shape[0] // dp


def shard_buckets(buckets: Sequence[jax.Array | np.ndarray], *, axis_name: AxisName) -> Buckets:
    """This rank's contiguous ``numel / dp`` slice of each (replicated) bucket.

    The slice a tiled reduce-scatter leaves on the rank (``buckets.shard_range``): row
    ``rank`` of the bucket viewed as ``[dp, numel / dp]`` (exact at any bucket size). Used
    for master weights and per-element masks. Call inside ``shard_map``.

    Returns:
      One ``[numel_i / dp]`` array per bucket.
    """
    dp = axis_size(axis_name)
    rank = axis_index(axis_name)
    out = []
    for i, b in enumerate(buckets):
        size = _check_sharded("shard_buckets", i, b, dp, axis_name)
        out.append(
            lax.dynamic_index_in_dim(jnp.asarray(b).reshape(dp, size), rank, 0, keepdims=False)
        )
    return tuple(out)


def place_shards(
    buckets: Sequence[jax.Array], shards: Sequence[jax.Array], *, axis_name: AxisName
) -> Buckets:
    """Each bucket with this rank's shard range overwritten by its shard (the inverse of
    :func:`shard_buckets`; where Megatron's reduce-scatter leaves the shard in the grad
    buffer). Row ``rank`` of the ``[dp, numel / dp]`` view, exact at any bucket size. Call
    inside ``shard_map``.

    Args:
      buckets: flat ``[numel_i]`` buckets; shards: ``[numel_i / dp]`` each.
    Returns:
      The ``[numel_i]`` buckets.
    """
    dp = axis_size(axis_name)
    rank = axis_index(axis_name)
    out = []
    for i, (b, s) in enumerate(zip(buckets, shards, strict=True)):
        size = _check_sharded("place_shards", i, b, dp, axis_name)
        if s.shape != (size,):
            raise ValueError(
                f"place_shards: shard {i} has shape {s.shape}, bucket {i} "
                f"{b.shape} needs ({size},) per rank of {axis_name!r}"
            )
        rows = lax.dynamic_update_index_in_dim(b.reshape(dp, size), s, rank, 0)
        out.append(rows.reshape(-1))
    return tuple(out)
