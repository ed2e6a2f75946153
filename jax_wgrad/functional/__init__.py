"""Tier 2: pure functions over arrays -- the custom_vjp linears that route weight
gradients into fp32 main grads or flat buckets (a weight's destination rides on its NNX
variable as metadata: :mod:`~jax_wgrad.functional.routes`), Megatron's conjugate
collectives, the vocab-parallel cross entropy, the attention core and the expert-parallel
MoE MLP. No modules: a function takes arrays, or the variables holding them."""

from jax_wgrad.functional.attention import (
    RopeScaling,
    causal_attention,
    rope_frequencies,
    rotary_embedding,
)
from jax_wgrad.functional.collectives import (
    SEQ_DIM,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_last_dim,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from jax_wgrad.functional.context_parallel import (
    ContextParallel,
    context_parallel_attention,
    context_positions,
    context_tokens,
    load_balanced_positions,
)
from jax_wgrad.functional.cross_entropy import (
    logits_grad,
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
    vocab_shard_index,
)
from jax_wgrad.functional.expert_linear import grouped_linear, ragged_linear
from jax_wgrad.functional.linear import linear, linear_into_bucket
from jax_wgrad.functional.moe import MoEConfig, MoEStats, moe_mlp
from jax_wgrad.functional.residual_slots import ResidualSlots
from jax_wgrad.functional.routes import Route, RowPiece, WgradRoutes, route_of, value_of
from jax_wgrad.functional.stacked import LayerRecompute, scan_layers

__all__ = [
    "SEQ_DIM",
    "ContextParallel",
    "context_parallel_attention",
    "context_positions",
    "context_tokens",
    "load_balanced_positions",
    "LayerRecompute",
    "MoEConfig",
    "MoEStats",
    "ResidualSlots",
    "Route",
    "RowPiece",
    "WgradRoutes",
    "causal_attention",
    "rotary_embedding",
    "rope_frequencies",
    "RopeScaling",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_last_dim",
    "grouped_linear",
    "ragged_linear",
    "linear",
    "linear_into_bucket",
    "scan_layers",
    "route_of",
    "value_of",
    "logits_grad",
    "moe_mlp",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
    "vocab_shard_index",
]
