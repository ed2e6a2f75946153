"""Per-element versions of per-parameter flags over the flat buckets.

The distributed optimizer and the gradient finalization act on whole buckets or on a
rank's shard of them, which cut through parameters; a per-parameter flag (weight decay,
tensor-replicated, pipeline-shared) becomes a per-element mask: :func:`flat_mask` as static
numpy arrays, :func:`local_mask` traced inside ``shard_map`` for the rank's shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad.grads.buffer import GradBuffer
from jax_wgrad.grads.sync import AxisName, axis_index, axis_size

__all__ = ["flat_mask", "local_mask"]

PyTree = Any
Buckets = tuple[jax.Array, ...]


def flat_mask(buffer: GradBuffer, flags: PyTree | Sequence[bool], *,
              dtype: Any = np.float32) -> tuple[np.ndarray, ...]:
    """Per-element version of a per-parameter flag: one numpy array per bucket.

    Args:
      flags: tree of bools shaped like the parameters, or a sequence of bools in
        flatten order (e.g. ``True`` where weight decay applies).
      dtype: dtype of the result (float32: 1.0 / 0.0).
    Returns:
      Static numpy arrays, ``[bucket_numels[i]]`` each; padding is 0.
    """
    values = buffer.flag_values(flags)
    out = [np.zeros((n,), dtype) for n in buffer.bucket_numels]
    for s, v in zip(buffer.slots, values):
        if v:
            out[s.bucket][s.offset:s.offset + s.size] = 1
    return tuple(out)


def local_mask(buffer: GradBuffer, flags: PyTree | Sequence[bool], *,
               axis_name: AxisName | None,
               bucket_axes: Sequence[AxisName] | None = None) -> Buckets:
    """Per-element bool mask of this rank's shard of each bucket (or whole buckets).

    The traced counterpart of :func:`flat_mask` for use inside ``shard_map``: built from
    the flagged parameters' ``[start, end)`` runs with ``searchsorted`` over the rank's
    global element indices, so no bucket-sized constant enters the program.

    Args:
      flags: as in :func:`flat_mask`.
      axis_name: the data axis whose rank selects the shard (``shard_buckets``'s
        slicing); ``None`` for the whole buckets.
      bucket_axes: instead of ``axis_name`` for every bucket, one axis per bucket (a
        buffer whose parts are sharded over different groups).
    Returns:
      One bool array per bucket, ``[shard_numels[i]]`` or ``[bucket_numels[i]]``.
    """
    values = buffer.flag_values(flags)
    if bucket_axes is None:
        bucket_axes = [axis_name] * buffer.num_buckets
    out = []
    for i, n in enumerate(buffer.bucket_numels):
        axis_name = bucket_axes[i]
        if axis_name is None:
            dp, rank = 1, 0
        else:
            dp, rank = axis_size(axis_name), axis_index(axis_name)
        if n % dp:
            raise ValueError(f"local_mask: bucket {i} ({n} elements) is not "
                             f"divisible by the {dp} ranks of {axis_name!r}")
        size = n // dp
        runs: list[list[int]] = []  # merged [start, end) of flagged slots, in order
        for k in buffer.bucket_leaves[i]:
            s = buffer.slots[k]
            if not values[k]:
                continue
            if runs and runs[-1][1] == s.offset:
                runs[-1][1] = s.offset + s.size
            else:
                runs.append([s.offset, s.offset + s.size])
        if not runs:
            out.append(jnp.zeros((size,), bool))
            continue
        if runs == [[0, n]]:
            out.append(jnp.ones((size,), bool))
            continue
        starts = jnp.asarray([r[0] for r in runs], jnp.int32)
        ends = jnp.asarray([r[1] for r in runs], jnp.int32)
        idx = rank * size + lax.iota(jnp.int32, size)
        pos = jnp.searchsorted(starts, idx, side="right") - 1
        out.append((pos >= 0) & (idx < ends[jnp.maximum(pos, 0)]))
    return tuple(out)
