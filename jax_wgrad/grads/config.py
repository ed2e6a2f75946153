"""Gradient buffers, their data-parallel sync and the optimizer step's clipping
(Megatron's ``DistributedDataParallelConfig`` plus ``clip_grad``)."""

from __future__ import annotations

import dataclasses

from jax_wgrad._validation import check_positive

__all__ = ["DDPConfig"]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Gradient buffers, their data-parallel sync, and the optimizer step.

    Megatron's ``DistributedDataParallelConfig`` fields (same names and meaning) plus
    ``clip_grad``, ``use_precision_aware_optimizer`` and ``store_param_remainders`` (from
    Megatron's ``OptimizerConfig``), because this library's
    optimizer step (:class:`jax_wgrad.optim.DistributedOptimizer`) owns clipping, and
    ``overlap_grad_reduce_in_backward`` (this library's: where Megatron's overlap of the
    bucket syncs with the backward needs a layout of its own for stacked layers).
    """

    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state over ``data``: buckets are
    reduce-scattered, each rank updates its shard, parameters are all-gathered."""
    overlap_grad_reduce: bool = False
    """Sync a pipeline stage's gradient buckets in the cooldown, in the tick after the
    stage's last backward (inside the schedule, while the stages before it still run
    theirs); otherwise after the schedule."""
    overlap_grad_reduce_in_backward: bool = False
    """With ``overlap_grad_reduce`` and gradient accumulation fusion: lay the stage's
    fused layer weights out in layer groups, a bucket each, and sync each group's bucket
    while the stage's last backward runs the layers below (Megatron's overlap of the
    bucket reduce-scatters with the backward); the other buckets as above. Costs memory
    traffic and compile time (one loop per group; docs/buckets.md)."""
    bucket_size: int | None = None
    """Approximate elements per bucket. As in Megatron: ``None`` means
    ``max(40_000_000, 1_000_000 * dp)`` with ``overlap_grad_reduce`` and is ignored (one
    bucket per buffer) without it; see :meth:`effective_bucket_size`."""
    average_in_collective: bool = False
    """Average in the collective (divide after the sum) instead of pre-scaling by 1/dp.
    fp32 buckets (the default grad dtype) are always divided after the sum: their 1/dp is
    folded into the token scaling (:mod:`jax_wgrad.grads.finalize`, step 1), so this
    decides for 16-bit buckets."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to a multiple of ``lcm(dp, 128, 2**16)`` (distributed optimizer)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (Megatron's
    ``--clip-grad``, default 1.0)."""
    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer (TransformerEngine's ``FusedAdam``): with it,
    ``store_param_remainders`` acts and Adam's moments may be stored in bf16
    (:func:`jax_wgrad.optim.adamw`). Needs ``use_distributed_optimizer``, as in
    Megatron."""
    store_param_remainders: bool = True
    """With ``use_precision_aware_optimizer``: bf16 parameters keep an int16 remainder
    instead of an fp32 main copy (exact; :class:`jax_wgrad.optim.DistributedOptimizer`),
    2 bytes per parameter less on the distributed optimizer's shard (Megatron's default,
    TransformerEngine >= 2.1)."""

    def __post_init__(self) -> None:
        for name in (
            "use_distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_grad_reduce_in_backward",
            "average_in_collective",
            "pad_buckets_for_high_nccl_busbw",
            "use_precision_aware_optimizer",
            "store_param_remainders",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap_grad_reduce_in_backward and not self.overlap_grad_reduce:
            raise ValueError("overlap_grad_reduce_in_backward requires overlap_grad_reduce")
        if self.use_precision_aware_optimizer and not self.use_distributed_optimizer:
            raise ValueError(  # Megatron's words (core/optimizer/__init__.py)
                "--use-precision-aware-optimizer only supported with distributed optimizer"
            )
        if self.bucket_size is not None:
            check_positive("bucket_size", self.bucket_size)
        clip = self.clip_grad
        if (
            isinstance(clip, bool)
            or not isinstance(clip, (int, float))
            or not (0.0 <= clip < float("inf"))
        ):
            raise ValueError(
                f"clip_grad must be a finite number >= 0 (0 disables clipping), got {clip!r}"
            )

    def effective_bucket_size(self, data_parallel_size: int) -> int | None:
        """Megatron's rule (``DistributedDataParallel.__init__``): without
        ``overlap_grad_reduce`` a single bucket (``None``); with it ``bucket_size`` or,
        if unset, ``max(40_000_000, 1_000_000 * dp)``."""
        if not self.overlap_grad_reduce:
            return None
        if self.bucket_size is None:
            return max(40_000_000, 1_000_000 * data_parallel_size)
        return self.bucket_size
