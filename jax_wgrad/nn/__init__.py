"""Tier 3: Flax NNX modules -- the fused-accumulation ``Linear`` with its ``MainGrad``,
Megatron's tensor-parallel layers and ``LayerNorm``. Parameters carry their facts as
variable metadata (:func:`jax_wgrad.nn.facts.param_facts`)."""

from jax_wgrad.nn.facts import param_facts
from jax_wgrad.nn.linear import Linear, MainGrad
from jax_wgrad.nn.norm import LayerNorm, RMSNorm
from jax_wgrad.nn.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_std_for_output_layers,
)

__all__ = [
    "ColumnParallelLinear",
    "LayerNorm",
    "Linear",
    "MainGrad",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "init_std_for_output_layers",
    "param_facts",
]
