"""A tensor-parallel GPT (pre-LN decoder, causal attention; GPT-2 by default, with
Megatron's Llama-family options: RMSNorm, RoPE, SwiGLU, grouped-query attention, MoE):
its config, NNX modules, canonical parameters and stage programs."""

from jax_wgrad.models.gpt.config import GPTConfig, validate
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.models.gpt.params import init_params, model_parts, period_pattern
from jax_wgrad.models.gpt.program import GPTProgram

__all__ = [
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "GPTProgram",
    "TransformerLayer",
    "init_params",
    "model_parts",
    "period_pattern",
    "validate",
]
