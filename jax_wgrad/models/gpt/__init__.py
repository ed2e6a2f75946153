"""A tensor-parallel GPT (pre-LN decoder, causal attention; GPT-2 by default, with
Megatron's Llama-family options: RMSNorm, RoPE, SwiGLU, grouped-query attention, MoE):
its config, NNX modules, canonical parameters and stage programs."""

from jax_wgrad.models.gpt.config import GPTConfig, validate
from jax_wgrad.models.gpt.logits import single_device_logits
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.models.gpt.params import (
    canonical_tree,
    device_tree,
    forward_order,
    grad_specs,
    init_params,
    module_orders,
    param_specs,
    period_pattern,
    registration_order,
)
from jax_wgrad.models.gpt.program import GPTProgram

__all__ = [
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "GPTProgram",
    "TransformerLayer",
    "canonical_tree",
    "device_tree",
    "forward_order",
    "grad_specs",
    "init_params",
    "module_orders",
    "param_specs",
    "period_pattern",
    "registration_order",
    "single_device_logits",
    "validate",
]
