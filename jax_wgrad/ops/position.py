"""Block positions in a flat gradient bucket that hold at any bucket size.

JAX without x64 computes every integer array in 32 bits: ``jnp.asarray(3087138816,
jnp.int32)`` raises and ``layer * jnp.int32(117440512)`` wraps from layer 19 on. A
position inside a bucket of more than ``2**31 - 1`` elements is therefore never an int32
array. It is either

* a Python ``int`` (static: the fused ops pass it as an int64 FFI attribute), or
* a :class:`BlockOffset` ``(base, index, stride)``, the position ``base + index * stride``
  with ``base`` and ``stride`` static Python ints of any size and ``index`` a small
  (traced) int32 scalar -- a layer number, a model chunk. The handlers receive ``base``
  and ``stride`` as int64 attributes and ``index`` as an int32 operand and combine them in
  64 bits (on a GPU on the device: the index is never copied to the host).

An int32 scalar array given as ``offset`` still works and means ``BlockOffset(0, offset,
1)``. A traced position is CLAMPED into ``[0, N - block]`` like the start index of
``lax.dynamic_update_slice`` (no negative wrapping), the clamp computed on the exact
value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "INT32_MAX",
    "BlockOffset",
    "Offset",
    "advance",
    "as_block_offset",
    "clamped_start_int32",
    "provably_aligned",
]

INT32_MAX = int(np.iinfo(np.int32).max)
INT32_MIN = int(np.iinfo(np.int32).min)
INT64_MAX = int(np.iinfo(np.int64).max)


def _static_int(who: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{who}: {name} must be a static Python int, got {value!r}")
    return int(value)


def _int32_index(who: str, index: Any) -> Any:
    """``index`` as an int32 scalar: a Python int in the int32 range becomes ``np.int32``;
    an array must already be an int32 scalar (a tracer, a jax or numpy array)."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        if not INT32_MIN <= int(index) <= INT32_MAX:
            raise ValueError(
                f"{who}: index {int(index)} is outside the int32 range; "
                "put the large part of the position into base or stride"
            )
        return np.int32(index)
    if (
        not isinstance(index, (jax.Array, np.ndarray, np.generic))
        or jnp.shape(index) != ()
        or jnp.result_type(index) != jnp.int32
    ):
        shown = (
            f"{jnp.result_type(index)}{list(jnp.shape(index))}"
            if hasattr(index, "dtype")
            else repr(index)
        )
        raise ValueError(
            f"{who}: index must be an int32 scalar (traced or not) or a Python int, got {shown}"
        )
    return index


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockOffset:
    """The bucket position ``base + index * stride`` (module docstring).

    A pytree whose only leaf is ``index``: it can be an argument of ``jit``, a ``scan``
    input or carry, a ``custom_vjp`` residual. ``base`` and ``stride`` are static.

    Attributes:
      base: element position for ``index == 0``, a Python int of any size.
      index: int32 scalar, usually traced (a ``scan`` counter, a model chunk); a Python int
        in the int32 range is taken as ``np.int32``.
      stride: elements per unit of ``index``, a Python int of any size.

    The value must be exact in int64 for every int32 index (what the handlers compute):
    ``|base| + 2**31 * |stride| <= 2**63 - 1`` -- a bucket of up to ``2**62`` elements with
    strides up to ``2**31`` elements, or ``2**32`` with a base below ``2**62``.

    Raises:
      ValueError: ``base`` or ``stride`` not static ints, the bound above violated, or an
        ``index`` that is not an int32 scalar.
    """

    base: int
    index: Any
    stride: int

    def __post_init__(self) -> None:
        who = "BlockOffset"
        base = _static_int(who, "base", self.base)
        stride = _static_int(who, "stride", self.stride)
        if abs(base) + 2**31 * abs(stride) > INT64_MAX:
            raise ValueError(
                f"BlockOffset: base + index * stride must be exact in int64 for every int32 "
                f"index (|base| + 2**31 * |stride| <= 2**63 - 1); got base={base}, "
                f"stride={stride}"
            )
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "index", _int32_index(who, self.index))

    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, int]]:
        return (self.index,), (self.base, self.stride)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, int], children: tuple[Any]) -> BlockOffset:
        # Leaves may be anything while jax transforms the tree (tracers, None, sentinels):
        # no validation here; the fields were checked when the position was made.
        out = object.__new__(cls)
        object.__setattr__(out, "base", aux[0])
        object.__setattr__(out, "index", children[0])
        object.__setattr__(out, "stride", aux[1])
        return out

    def value_for(self, index: int) -> int:
        """The exact position for a concrete ``index`` (a Python int)."""
        return self.base + int(index) * self.stride


Offset = int | jax.Array | BlockOffset
"""What an ``offset=`` of the fused ops takes: a static Python int, an int32 scalar array
(``BlockOffset(0, offset, 1)``), or a :class:`BlockOffset`."""


def as_block_offset(offset: Any) -> BlockOffset | None:
    """``None`` for a static offset (``None`` or a Python int), else the
    :class:`BlockOffset` it means (an int32 scalar array ``o`` -> ``BlockOffset(0, o, 1)``).

    Raises:
      ValueError: an array that is not an int32 scalar.
    """
    if isinstance(offset, BlockOffset):
        return offset
    if not isinstance(offset, (jax.Array, np.ndarray, np.generic)):
        return None  # None, ints; floats, bools, ...: rejected by the static checks
    if jnp.shape(offset) != () or jnp.result_type(offset) != jnp.int32:
        raise ValueError(
            f"offset must be a Python int (static), a BlockOffset(base, index, stride) or "
            f"an int32 scalar array (traced); got {jnp.result_type(offset)}"
            f"{list(jnp.shape(offset))}"
        )
    return BlockOffset(0, offset, 1)


def advance(offset: Offset, index: jax.Array | int, stride: int) -> BlockOffset:
    """The position ``offset + index * stride`` as one :class:`BlockOffset` (e.g. layer
    ``index`` of a weight stacked from ``offset`` on, ``stride`` elements per layer).

    A Python int ``offset`` becomes the base. A :class:`BlockOffset` ``(b, j, s)`` (or an
    int32 array, ``(0, j, 1)``) combines when ``s`` is a multiple of ``stride``: the
    index becomes ``j * (s // stride) + index`` (int32 arithmetic on small indices: a model
    chunk and a layer); ``s == 0`` drops ``j``.

    Raises:
      ValueError: a traced ``offset`` whose stride is not a multiple of ``stride`` (two
        independent traced terms do not fit one ``BlockOffset``), or a combined factor
        outside the int32 range.
    """
    stride = _static_int("advance", "stride", stride)
    given = as_block_offset(offset)
    if given is None:
        return BlockOffset(_static_int("advance", "offset", offset), index, stride)
    if given.stride == 0:
        return BlockOffset(given.base, index, stride)
    if stride == 0 or given.stride % stride:
        raise ValueError(
            f"advance: cannot add index * {stride} to the traced position {given.base} + "
            f"index * {given.stride}: its stride must be 0 or a multiple of {stride} (pass "
            "a Python int offset, or a BlockOffset with such a stride)"
        )
    factor = given.stride // stride
    if factor > INT32_MAX:
        raise ValueError(
            f"advance: the stride {given.stride} is {factor} times {stride}, "
            "outside the int32 range of the combined index"
        )
    return BlockOffset(given.base, given.index * jnp.int32(factor) + index, stride)


def clamped_start_int32(offset: BlockOffset, max_offset: int) -> jax.Array:
    """int32 ``clamp(base + index * stride, 0, max_offset)`` computed exactly in 32-bit
    arithmetic (the plain-XLA references' start index); ``index`` may be batched.

    The int32 indices whose position lies in ``[0, max_offset]`` form one interval; indices
    below or above it clamp to one end, and inside it the position is ``max_offset`` or
    less away from the interval's first position, so nothing wraps.

    Raises:
      ValueError: ``max_offset`` outside ``[0, 2**31 - 1]`` (the start index of an XLA
        slice must be an int32 without x64).
    """
    if not 0 <= max_offset <= INT32_MAX:
        raise ValueError(
            f"clamped_start_int32: max_offset {max_offset} is outside [0, {INT32_MAX}]"
        )
    b, s = offset.base, offset.stride
    i = jnp.asarray(offset.index, jnp.int32)
    if s == 0:
        return jnp.full(jnp.shape(i), min(max(b, 0), max_offset), jnp.int32)
    # [first, last]: the indices whose position is inside [0, max_offset] (maybe empty).
    if s > 0:
        first, last = -(b // s), (max_offset - b) // s
        below, above = 0, max_offset  # i < first / i > last
    else:
        first, last = -((max_offset - b) // -s), b // -s
        below, above = max_offset, 0
    lo, hi = max(first, INT32_MIN), min(last, INT32_MAX)

    def compare(op, bound: int, always: bool) -> jax.Array | bool:
        if INT32_MIN <= bound <= INT32_MAX:
            return op(i, jnp.int32(bound))
        return always

    is_below = compare(jnp.less, first, first > INT32_MAX)
    is_above = compare(jnp.greater, last, last < INT32_MIN)
    if lo > hi:  # no int32 index lands inside: every one clamps to an end
        inside = jnp.zeros_like(i)
    elif lo == hi:
        inside = jnp.full(jnp.shape(i), b + lo * s, jnp.int32)
    else:  # |s| <= max_offset here, and (clip(i) - lo) * |s| <= max_offset
        step = jnp.clip(i, jnp.int32(lo), jnp.int32(hi)) - jnp.int32(lo)
        inside = jnp.int32(b + lo * s) + step * jnp.int32(s)
    return jnp.where(
        is_below, jnp.int32(below), jnp.where(is_above, jnp.int32(above), inside)
    ).astype(jnp.int32)


def provably_aligned(
    offset: BlockOffset, *, block: int, elements: int, itemsize: int, alignment: int = 16
) -> bool:
    """Whether every block the fused op can address from ``offset`` starts ``alignment``
    bytes after an aligned buffer start, whatever the index: ``base``, ``stride``, the
    block (``block`` elements: the next group's start) and the accumulator's length
    ``elements`` (the clamp's upper end ``elements - groups * block``, and the next batch
    element's buffer) all multiples of ``alignment`` bytes."""
    if alignment % itemsize:
        return False
    unit = alignment // itemsize
    return all(v % unit == 0 for v in (offset.base, offset.stride, block, elements))
