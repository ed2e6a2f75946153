"""Tier: the optimizer step on the bucketed gradients -- Megatron's distributed optimizer
(fp32 master weights and optax state on this rank's bucket shards) or the replicated one,
with Megatron's fp32 global norm, clipping and non-finite skip."""

from jax_wgrad.optim.distributed import DistributedOptimizer, OptimizerState, StepInfo
from jax_wgrad.optim.transforms import (
    adamw,
    add_decayed_weights,
    clip_by_total_norm,
    global_grad_norm,
)

__all__ = ["DistributedOptimizer", "OptimizerState", "StepInfo", "adamw",
           "add_decayed_weights", "clip_by_total_norm", "global_grad_norm"]
