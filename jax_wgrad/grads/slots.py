"""Where each parameter's gradient lives in a :class:`~jax_wgrad.grads.GradBuffer`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.grads.plan import BucketPlan

__all__ = ["SlotPiece", "ParamSlot", "BufferGroup", "leaf_shape_dtype", "flag_tree"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class SlotPiece:
    """One contiguous block of a parameter's gradient in one bucket.

    Attributes:
      bucket: index of the bucket in the buffer's tuple.
      offset: start of the block within that bucket array.
      size: number of elements of the block.
      rows: ``(start, stop)`` of the parameter's axis 0 the block holds, row-major
        (``leaf[start:stop].ravel()``, ``(stop - start) * prod(shape[1:])`` elements);
        ``None`` when the block is the whole parameter.
    """

    bucket: int
    offset: int
    size: int
    rows: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives.

    An ordinary parameter is one block of one bucket (one :class:`SlotPiece`, ``rows``
    ``None``); a stacked parameter laid out in row groups (``GradBuffer.create(...,
    row_groups=..., split_rows=...)``) has one piece per row group, in row order, each in
    its own bucket. (With a single row group, ``row_groups=(0, n)``, that is one piece with
    ``rows=(0, n)``: one block, not ``split``.)

    Attributes:
      path: ``jax.tree_util.keystr`` of the leaf's key path (e.g. ``"['layer']['w']"``).
      index: position of the leaf in the tree's flatten order.
      shape, param_dtype: the (per-device) parameter's shape and dtype.
      size: number of elements of the whole parameter (the sum of the pieces' sizes).
      pieces: its blocks, in row order (a single piece for an ordinary parameter).
    """

    path: str
    index: int
    shape: tuple[int, ...]
    param_dtype: np.dtype
    size: int
    pieces: tuple[SlotPiece, ...]

    @property
    def split(self) -> bool:
        """Whether the parameter's gradient is in more than one block (row groups):
        ``bucket`` and ``offset`` are then undefined, read ``pieces``."""
        return len(self.pieces) > 1

    def _single(self, what: str) -> SlotPiece:
        if self.split:
            raise ValueError(
                f"ParamSlot.{what}: {self.path} is laid out in {len(self.pieces)} row groups; "
                "read slot.pieces"
            )
        return self.pieces[0]

    @property
    def bucket(self) -> int:
        """Index of its bucket in the buffer's tuple (a parameter in one piece only).

        Raises:
          ValueError: the parameter is laid out in row groups.
        """
        return self._single("bucket").bucket

    @property
    def offset(self) -> int:
        """Start of its elements within its bucket array, row-major (a parameter in one
        piece only).

        Raises:
          ValueError: the parameter is laid out in row groups.
        """
        return self._single("offset").offset

    def piece_shape(self, piece: SlotPiece) -> tuple[int, ...]:
        """Shape of the part of the parameter ``piece`` holds: ``shape``, or
        ``(stop - start, *shape[1:])`` for rows ``(start, stop)``."""
        if piece.rows is None:
            return self.shape
        start, stop = piece.rows
        return (stop - start, *self.shape[1:])

    def piece_of(self, leaf: jax.Array, piece: SlotPiece) -> jax.Array:
        """The part of ``leaf`` (shaped like the parameter) that ``piece`` holds."""
        if piece.rows is None:
            return leaf
        start, stop = piece.rows
        return leaf[start:stop]


@dataclasses.dataclass(frozen=True)
class BufferGroup:
    """One ``(param dtype, grad dtype)`` group: Megatron's per-dtype ``_ParamAndGradBuffer``.

    Its buckets are consecutive in the buffer's tuple: first one bucket per row group
    (``row_plans``, only in the group holding the leaves laid out in row groups), then the
    buckets of ``plan``.

    Attributes:
      param_dtype, grad_dtype: the group's dtypes.
      leaf_indices: flatten indices of all its parameters, in registration order (those
        laid out in row groups included).
      plan: the bucket layout of its parameters not laid out in row groups (``None`` if it
        has none): ``plan.param_ranges[k]`` is for the ``k``-th of ``leaf_indices`` whose
        pieces have ``rows=None``; offsets there are relative to the plan's own buffer,
        not to a bucket. Its bucket ``b`` is the buffer's bucket ``first_bucket +
        len(row_plans) + b``.
      first_bucket: index of the group's first bucket in the buffer's tuple.
      row_plans: one single-bucket plan per row group, in bucket order (the last rows
        first): ``row_plans[j]`` is the buffer's bucket ``first_bucket + j`` and its
        ``param_ranges[k]`` is for the ``k``-th of ``leaf_indices`` laid out in row groups
        (its block of that group's rows).
    """

    param_dtype: np.dtype
    grad_dtype: np.dtype
    leaf_indices: tuple[int, ...]
    plan: BucketPlan | None
    first_bucket: int
    row_plans: tuple[BucketPlan, ...] = ()


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
