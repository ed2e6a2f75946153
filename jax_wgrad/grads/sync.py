"""Data-parallel sync of flat gradient buckets (Megatron's ``start_grad_sync``).

Everything here runs inside ``jax.shard_map``: one collective per bucket over the data
axis (:func:`sync_buckets`), and the rank's contiguous shard of a replicated bucket
(:func:`shard_buckets`, what a tiled reduce-scatter leaves on it).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["AxisName", "axis_size", "axis_index", "sync_buckets", "shard_buckets"]

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
        if not (isinstance(gradient_scaling_factor, (int, float))
                and gradient_scaling_factor == 1.0):
            b = b * jnp.asarray(gradient_scaling_factor, b.dtype)
        if use_distributed_optimizer:
            if b.shape[0] % dp:
                raise ValueError(
                    f"sync_buckets: bucket {i} has {b.shape[0]} elements, not divisible by the "
                    f"{dp} ranks of {axis_name!r}; plan the buffer with "
                    f"use_distributed_optimizer=True and dp_size={dp}")
            r = lax.psum_scatter(b, axis_name, scatter_dimension=0, tiled=True)
        else:
            r = lax.psum(b, axis_name)
        if average_in_collective:
            r = r / jnp.asarray(dp, r.dtype)
        out.append(r)
    return tuple(out)


def shard_buckets(buckets: Sequence[jax.Array | np.ndarray], *, axis_name: AxisName
                  ) -> Buckets:
    """This rank's contiguous ``numel / dp`` slice of each (replicated) bucket.

    The slice a tiled reduce-scatter leaves on the rank (``buckets.shard_range``). Used for
    master weights and per-element masks. Call inside ``shard_map``.
    """
    dp = axis_size(axis_name)
    rank = axis_index(axis_name)
    out = []
    for i, b in enumerate(buckets):
        if b.ndim != 1 or b.shape[0] % dp:
            raise ValueError(f"shard_buckets: bucket {i} of shape {b.shape} is not a flat "
                             f"array divisible by the {dp} ranks of {axis_name!r}")
        size = b.shape[0] // dp
        out.append(lax.dynamic_slice(jnp.asarray(b), (rank * size,), (size,)))
    return tuple(out)
