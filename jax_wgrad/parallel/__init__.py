"""Tier: the device mesh (the only definition of its axis names) and the parallel layout.

:mod:`jax_wgrad.parallel.pipeline` (schedules as data and their executor) and
:mod:`jax_wgrad.parallel.deferred` (deferred output-layer weight gradients) build on the
model and gradient tiers and are imported explicitly.
"""

from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import (
    AXES,
    CONTEXT,
    DATA,
    DATA_CONTEXT_PARALLEL,
    DATA_PARALLEL,
    EXPERT,
    EXPERT_DATA_PARALLEL,
    PIPELINE,
    TENSOR,
    initialize_distributed,
    local_shape,
    make_mesh,
    use_virtual_cpu_devices,
)

__all__ = [
    "AXES",
    "CONTEXT",
    "DATA",
    "DATA_PARALLEL",
    "EXPERT",
    "EXPERT_DATA_PARALLEL",
    "DATA_CONTEXT_PARALLEL",
    "PIPELINE",
    "TENSOR",
    "ParallelConfig",
    "initialize_distributed",
    "local_shape",
    "make_mesh",
    "use_virtual_cpu_devices",
]
