"""A tensor-parallel GPT (pre-LN decoder, causal attention, GELU MLP, learned positions):
its config, NNX modules, canonical parameters and per-stage functions."""

from jax_wgrad.models.gpt.config import GPTConfig, validate
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.models.gpt.params import (
    canonical_tree,
    device_tree,
    forward_order,
    grad_specs,
    init_params,
    param_specs,
    unstack_layers,
)
from jax_wgrad.models.gpt.stages import GPTStages

__all__ = ["GPTConfig", "GPTEmbedding", "GPTHead", "GPTStages", "TransformerLayer",
           "canonical_tree", "device_tree", "forward_order", "grad_specs", "init_params",
           "param_specs", "unstack_layers", "validate"]
