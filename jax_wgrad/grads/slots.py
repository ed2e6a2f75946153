"""Where each parameter's gradient lives in a :class:`~jax_wgrad.grads.GradBuffer`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.grads.plan import BucketPlan

__all__ = ["ParamSlot", "BufferGroup", "leaf_shape_dtype", "flag_tree"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives.

    Attributes:
      path: ``jax.tree_util.keystr`` of the leaf's key path (e.g. ``"['layer']['w']"``).
      index: position of the leaf in the tree's flatten order.
      shape, param_dtype: the (per-device) parameter's shape and dtype.
      bucket: index of its bucket in the buffer's tuple.
      offset: start of its elements within that bucket array (row-major flattening).
      size: number of elements.
    """

    path: str
    index: int
    shape: tuple[int, ...]
    param_dtype: np.dtype
    bucket: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class BufferGroup:
    """One ``(param dtype, grad dtype)`` group: Megatron's per-dtype ``_ParamAndGradBuffer``.

    Attributes:
      param_dtype, grad_dtype: the group's dtypes.
      leaf_indices: flatten indices of its parameters, in registration order.
      plan: the bucket layout (``plan.param_ranges[k]`` is for ``leaf_indices[k]``;
        offsets there are relative to the group's buffer, not to a bucket).
      first_bucket: index of the group's bucket 0 in the buffer's tuple.
    """

    param_dtype: np.dtype
    grad_dtype: np.dtype
    leaf_indices: tuple[int, ...]
    plan: BucketPlan
    first_bucket: int


def leaf_shape_dtype(path: str, leaf) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of a float parameter leaf (array or ShapeDtypeStruct), checked."""
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise ValueError(
            f"GradBuffer: leaf {path} must be an array or jax.ShapeDtypeStruct, got "
            f"{type(leaf).__name__}"
        )
    shape = tuple(int(d) for d in leaf.shape)
    dtype = np.dtype(leaf.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"GradBuffer: leaf {path} has non-float dtype {dtype}")
    if int(np.prod(shape, dtype=np.int64)) == 0:
        raise ValueError(f"GradBuffer: leaf {path} has no elements (shape {shape})")
    return shape, dtype


def flag_tree(name: str, tree: PyTree, treedef, n: int) -> tuple[bool, ...]:
    """Per-leaf booleans from a tree shaped like the parameters (or ``None``: all False)."""
    if tree is None:
        return (False,) * n
    leaves, got = jax.tree.flatten(tree)
    if got != treedef:
        raise ValueError(
            f"GradBuffer: {name} must have the parameter tree's structure {treedef}, got {got}"
        )
    return tuple(bool(v) for v in leaves)
