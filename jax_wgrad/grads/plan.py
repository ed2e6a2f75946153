"""Bucket layout of the flat gradient buffer (Megatron's ``_ParamAndGradBuffer``), pure Python.

Megatron-LM (``megatron/core/distributed/param_and_grad_buffer.py``,
``_ParamAndGradBuffer.__init__``) keeps every parameter's gradient in one contiguous buffer
and splits that buffer into *buckets* that are reduced (all-reduce, or reduce-scatter with the
distributed optimizer) as soon as backward has filled them. This module computes the same
layout, with the same numbers, from the parameter sizes alone, so that JAX code can slice one
flat fp32 buffer with static offsets.

The rules, in the order Megatron applies them while walking the parameters:

* Parameters are visited in **reverse registration order** (``params[::-1]``), which roughly
  follows backprop order: the last layer's gradients are ready first and land at offset 0.
* With the distributed optimizer each parameter's start is rounded up to a multiple of
  **64** elements (``_pad_start_of_param_if_needed``: 128-byte alignment for >= 16-bit
  values). Without it there is no padding at all.
* A bucket closes right after the parameter that makes ``param_end - bucket_start >=
  bucket_size`` (``bucket_size=None``: never, i.e. one bucket). Parameters are never split.
* With the distributed optimizer a bucket's end is rounded up to a multiple of
  ``lcm(dp_size, 128)``, or ``lcm(dp_size, 128, 2**16)`` with
  ``pad_buckets_for_high_nccl_busbw`` (``_pad_end_of_bucket_if_needed``). The flag has no
  effect without the distributed optimizer, exactly as in Megatron. The next bucket starts
  at the padded end, so every bucket can be sharded evenly over the data-parallel ranks.
* With the distributed optimizer a parameter flagged ``shared_embedding`` gets a bucket of
  its own (``_does_param_require_new_bucket``): a non-empty current bucket is closed before
  it, and its bucket is closed right after it. Without the distributed optimizer the flag is
  ignored, as in Megatron.
* ``numel_unpadded`` of a bucket is ``last_param_end - bucket_start``: it counts the 64-element
  alignment gaps between parameters but not the bucket-end padding. One subtlety is kept from
  Megatron: when a shared-embedding parameter closes the current bucket, that bucket's
  ``numel_unpadded`` runs to the embedding's *64-aligned* start (Megatron pads the start
  before calling ``_update_bucket_metadata(param_start_index)``).

Example (the numbers of Megatron's ``test_param_to_index_alignment_with_padding``)::

    >>> plan = plan_buckets([16, 4], dp_size=1, bucket_size=None,
    ...                     use_distributed_optimizer=True)
    >>> plan.param_ranges          # weight (registered first) is laid out last
    ((64, 80, 0), (0, 4, 0))
    >>> plan.buckets[0].numel_unpadded, plan.buckets[0].numel
    (80, 128)
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

__all__ = [
    "PARAM_ALIGNMENT",
    "BUCKET_ALIGNMENT",
    "HIGH_NCCL_BUSBW_ALIGNMENT",
    "Bucket",
    "BucketPlan",
    "ParamShard",
    "bucket_end_divisor",
    "param_shards",
    "plan_buckets",
    "shard_range",
]

PARAM_ALIGNMENT = 64
"""Parameter starts are multiples of this under the distributed optimizer (128 bytes at 16 bits)."""
BUCKET_ALIGNMENT = 128
"""Bucket ends are multiples of ``lcm(dp_size, 128)`` (256 bytes at 16 bits)."""
HIGH_NCCL_BUSBW_ALIGNMENT = 2**16
"""Extra bucket-end factor with ``pad_buckets_for_high_nccl_busbw``."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: the buffer slice ``[offset, offset + numel)``.

    Attributes:
      bucket_id: index of the bucket; bucket 0 holds the last-registered parameters.
      offset: start of the bucket in the flat buffer (Megatron's ``bucket.offset``).
      numel_unpadded: ``last_param_end - offset``; includes the 64-alignment gaps between
        parameters, not the padding at the bucket's end.
      numel: padded size (Megatron's ``bucket.grad_data.numel()``); divisible by
        ``lcm(dp_size, 128)`` under the distributed optimizer.
      param_indices: input indices of the bucket's parameters, in buffer order (ascending
        offset, i.e. reverse registration order; Megatron's ``bucket.params_list``).
    """

    bucket_id: int
    offset: int
    numel_unpadded: int
    numel: int
    param_indices: tuple[int, ...]

    @property
    def end(self) -> int:
        """One past the bucket's last (padded) element in the flat buffer."""
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Layout of the flat gradient buffer, as returned by :func:`plan_buckets`.

    Attributes:
      param_ranges: for input ``k``, ``(start, end, bucket_id)`` of its slice in the flat
        buffer (Megatron's ``param_index_map[param]``); ``end - start == numels[k]``.
      buckets: the buckets in buffer order.
      numel: total padded buffer size (Megatron's ``buffer.numel``).
      numel_unpadded: sum of the buckets' ``numel_unpadded`` (Megatron's
        ``buffer.numel_unpadded``).
      dp_size, bucket_size, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw:
        the arguments the plan was made with.
    """

    param_ranges: tuple[tuple[int, int, int], ...]
    buckets: tuple[Bucket, ...]
    numel: int
    numel_unpadded: int
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    pad_buckets_for_high_nccl_busbw: bool

    @property
    def num_params(self) -> int:
        """Number of parameters (elements of ``numels``)."""
        return len(self.param_ranges)

    @property
    def param_numel(self) -> int:
        """Elements that hold parameters (sum of ``numels``)."""
        return sum(end - start for start, end, _ in self.param_ranges)

    @property
    def padding(self) -> int:
        """Buffer elements that hold no parameter: alignment gaps plus bucket-end padding."""
        return self.numel - self.param_numel

    @property
    def padding_fraction(self) -> float:
        """``padding / numel``: the fraction of the buffer wasted on padding."""
        return self.padding / self.numel if self.numel else 0.0

    def summary(self) -> str:
        """A short human-readable description, one line per bucket (like Megatron's log)."""
        opt = "distributed optimizer"
        if not self.use_distributed_optimizer:
            opt = "no " + opt
        lines = [
            f"{len(self.buckets)} bucket(s), {self.num_params} params, dp_size={self.dp_size}, "
            f"bucket_size={self.bucket_size}, {opt}: {self.param_numel} param elements, "
            f"{self.numel} buffer elements, padding {self.padding} "
            f"({100.0 * self.padding_fraction:.2f}%)"
        ]
        for b in self.buckets:
            lines.append(
                f"  bucket {b.bucket_id}: offset {b.offset}, {len(b.param_indices)} params, "
                f"{b.numel_unpadded} unpadded, {b.numel} padded"
            )
        return "\n".join(lines)


def _pad(n: int, divisor: int) -> int:
    """Rounds ``n`` up to a multiple of ``divisor`` (Megatron's ``_pad``, in integers)."""
    return -(-n // divisor) * divisor


def _check_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def bucket_end_divisor(dp_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """Multiple that bucket ends are padded to under the distributed optimizer.

    ``lcm(dp_size, 128)``, or ``lcm(dp_size, 128, 2**16)`` with
    ``pad_buckets_for_high_nccl_busbw`` (Megatron's ``_pad_end_of_bucket_if_needed``).
    """
    dp_size = _check_int("dp_size", dp_size, minimum=1)
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(dp_size, BUCKET_ALIGNMENT, HIGH_NCCL_BUSBW_ALIGNMENT)
    return math.lcm(dp_size, BUCKET_ALIGNMENT)


def plan_buckets(
    numels: Sequence[int],
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embedding: Sequence[bool] | None = None,
) -> BucketPlan:
    """Lays parameters out in a flat gradient buffer split into buckets, like Megatron.

    Follows ``_ParamAndGradBuffer.__init__`` step for step (see the module docstring for the
    rules).

    Args:
      numels: number of elements of each parameter, in registration (forward) order. All
        must be positive integers; at least one is required (Megatron cannot build an empty
        buffer either).
      dp_size: data-parallel world size (>= 1); bucket ends are padded to a multiple of it
        under the distributed optimizer.
      bucket_size: a bucket closes once it spans at least this many elements; ``None``
        makes one bucket (plus the shared embedding's own bucket, see below).
      use_distributed_optimizer: enables the 64-element parameter alignment, the bucket-end
        padding and the shared-embedding bucket.
      pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp_size, 128, 2**16)``
        instead of ``lcm(dp_size, 128)``. Only meaningful with the distributed optimizer.
      shared_embedding: optional flags, one per parameter: the word embedding shared between
        the first and last pipeline stage. Under the distributed optimizer each flagged
        parameter gets a bucket of its own.
    Returns:
      A :class:`BucketPlan`.
    Raises:
      ValueError: on a non-positive numel, ``dp_size < 1``, ``bucket_size <= 0``, an empty
        ``numels`` or a ``shared_embedding`` whose length differs from ``numels``.
    """
    numels = [_check_int(f"numels[{k}]", n, minimum=1) for k, n in enumerate(numels)]
    if not numels:
        raise ValueError("numels must name at least one parameter, got an empty sequence")
    dp_size = _check_int("dp_size", dp_size, minimum=1)
    if bucket_size is not None:
        bucket_size = _check_int("bucket_size", bucket_size, minimum=1)
    if shared_embedding is None:
        shared = [False] * len(numels)
    else:
        shared = [bool(s) for s in shared_embedding]
        if len(shared) != len(numels):
            raise ValueError(
                f"shared_embedding has {len(shared)} flags but numels has {len(numels)} entries"
            )
    use_distributed_optimizer = bool(use_distributed_optimizer)
    pad_buckets_for_high_nccl_busbw = bool(pad_buckets_for_high_nccl_busbw)
    walk = _BucketWalk(
        bucket_end_divisor(dp_size, pad_buckets_for_high_nccl_busbw), use_distributed_optimizer
    )
    param_ranges, buckets = walk.run(numels, shared, bucket_size)
    plan = BucketPlan(
        param_ranges=param_ranges,
        buckets=buckets,
        numel=buckets[-1].end,
        numel_unpadded=sum(b.numel_unpadded for b in buckets),
        dp_size=dp_size,
        bucket_size=bucket_size,
        use_distributed_optimizer=use_distributed_optimizer,
        pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
    )
    # Megatron's own post-conditions.
    assert plan.numel_unpadded <= plan.numel
    if use_distributed_optimizer:
        assert plan.numel % dp_size == 0
    else:
        assert plan.numel == plan.numel_unpadded
    return plan


class _BucketWalk:
    """Megatron's walk over the parameters in reverse registration order, closing buckets
    (``_ParamAndGradBuffer.__init__``; the rules are in the module docstring)."""

    def __init__(self, end_divisor: int, use_distributed_optimizer: bool):
        self.end_divisor = end_divisor
        self.distributed = use_distributed_optimizer
        self.buckets: list[Bucket] = []
        self.bucket_start = 0
        self.bucket_params: list[int] = []

    def pad_param_start(self, index: int) -> int:
        return _pad(index, PARAM_ALIGNMENT) if self.distributed else index

    def close(self, last_end: int) -> int:
        """Megatron's ``_update_bucket_metadata``: ``numel_unpadded`` runs to ``last_end``,
        the bucket end is padded, and the next bucket starts there (returned)."""
        end = _pad(last_end, self.end_divisor) if self.distributed else last_end
        self.buckets.append(
            Bucket(
                bucket_id=len(self.buckets),
                offset=self.bucket_start,
                numel_unpadded=last_end - self.bucket_start,
                numel=end - self.bucket_start,
                param_indices=tuple(self.bucket_params),
            )
        )
        self.bucket_start, self.bucket_params = end, []
        return end

    def run(self, numels: list[int], shared: list[bool], bucket_size: int | None):
        """``(param_ranges, buckets)`` of the plan."""
        param_ranges: list[tuple[int, int, int] | None] = [None] * len(numels)
        param_start = param_end = 0
        for k in reversed(range(len(numels))):
            own_bucket = shared[k] and self.distributed
            param_start = self.pad_param_start(param_start)
            if own_bucket and self.bucket_params:
                # Close the pending bucket at the embedding's aligned start (as Megatron does).
                param_start = self.close(param_start)
            param_end = param_start + numels[k]
            param_ranges[k] = (param_start, param_end, len(self.buckets))
            self.bucket_params.append(k)
            full = bucket_size is not None and param_end - self.bucket_start >= bucket_size
            param_start = self.close(param_end) if full or own_bucket else param_end
        if self.bucket_params:
            self.close(param_end)
        return tuple(param_ranges), tuple(self.buckets)


def shard_range(bucket: Bucket, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """``(start, end)`` in the flat buffer of ``dp_rank``'s shard of ``bucket``.

    The bucket is cut into ``dp_size`` equal contiguous shards, rank ``r`` owning the
    ``r``-th (Megatron's ``shard_buffer``). This is the slice a reduce-scatter leaves on that
    rank and the slice its distributed optimizer updates. The shard ignores parameter
    boundaries; :func:`param_shards` gives the pieces of parameters inside it.

    Raises:
      ValueError: if ``dp_rank`` is not in ``[0, dp_size)`` or ``bucket.numel`` is not
        divisible by ``dp_size`` (it always is for a plan made with the distributed optimizer
        and the same ``dp_size``).
    """
    dp_size = _check_int("dp_size", dp_size, minimum=1)
    dp_rank = _check_int("dp_rank", dp_rank, minimum=0)
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank must be < dp_size={dp_size}, got {dp_rank}")
    if bucket.numel % dp_size:
        raise ValueError(
            f"bucket {bucket.bucket_id} has {bucket.numel} elements, not divisible by "
            f"dp_size={dp_size} (plan it with use_distributed_optimizer=True)"
        )
    size = bucket.numel // dp_size
    start = bucket.offset + dp_rank * size
    return start, start + size


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """The part of one parameter that lies in a data-parallel rank's shard of a bucket.

    Mirrors the ranges of Megatron's ``DistributedOptimizer._build_model_gbuf_param_range_map``.

    Attributes:
      param_index: input index of the parameter.
      buffer_start, buffer_end: the piece's slice of the flat buffer ("gbuf_world").
      shard_start, shard_end: the same slice relative to the rank's shard ("gbuf_local").
      param_start, param_end: the same slice within the flattened parameter ("param").
    """

    param_index: int
    buffer_start: int
    buffer_end: int
    shard_start: int
    shard_end: int
    param_start: int
    param_end: int


def param_shards(
    plan: BucketPlan, bucket_id: int, dp_rank: int, dp_size: int | None = None
) -> tuple[ParamShard, ...]:
    """Pieces of the parameters of bucket ``bucket_id`` owned by ``dp_rank``, in buffer order.

    Only non-empty pieces are returned; padding is skipped. ``dp_size`` defaults to the
    plan's.
    """
    if dp_size is None:
        dp_size = plan.dp_size
    if not 0 <= bucket_id < len(plan.buckets):
        raise ValueError(f"bucket_id must be in [0, {len(plan.buckets)}), got {bucket_id}")
    bucket = plan.buckets[bucket_id]
    lo, hi = shard_range(bucket, dp_rank, dp_size)
    pieces = []
    for k in bucket.param_indices:
        start, end, _ = plan.param_ranges[k]
        a, b = max(start, lo), min(end, hi)
        if a < b:
            pieces.append(ParamShard(k, a, b, a - lo, b - lo, a - start, b - start))
    return tuple(pieces)
