"""Tier: the optimizer step on the bucketed gradients -- Megatron's distributed optimizer
(optax state, and the fp32 main parameters of bf16 parameters, on this rank's bucket
shards) or the replicated one, with Megatron's fp32 global norm, clipping and non-finite
skip; the bytes per parameter of its state beside Megatron's figure."""

from jax_wgrad.optim.distributed import (
    DistributedOptimizer,
    OptimizerState,
    StepInfo,
    join_bf16,
    split_bf16,
)
from jax_wgrad.optim.memory import (
    BytesPerParameter,
    bytes_per_parameter,
    megatron_bytes_per_parameter,
)
from jax_wgrad.optim.transforms import (
    MOMENT_DTYPES,
    adamw,
    add_decayed_weights,
    clip_by_total_norm,
    global_grad_norm,
    scale_by_adam,
)

__all__ = [
    "MOMENT_DTYPES",
    "BytesPerParameter",
    "DistributedOptimizer",
    "OptimizerState",
    "StepInfo",
    "adamw",
    "add_decayed_weights",
    "bytes_per_parameter",
    "clip_by_total_norm",
    "global_grad_norm",
    "megatron_bytes_per_parameter",
    "join_bf16",
    "scale_by_adam",
    "split_bf16",
]
