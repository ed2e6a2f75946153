"""Shapes of the models people train, as ``GPTConfig`` arguments (:data:`PRESETS`).

The full-size shapes are those of the published Hugging Face configs (Llama-3 and 3.1
8B / 70B, Mistral 7B v0.3, Qwen2.5 7B, Mixtral 8x7B, Qwen3 8B and 30B-A3B); the ``-tiny``
ones keep each family's architecture at a size a CPU trains in seconds. :func:`preset`
builds a config, overrides winning (the example's ``--model NAME`` with flags).
"""

from __future__ import annotations

from typing import Any

from jax_wgrad.models.gpt.config import GPTConfig

__all__ = ["PRESETS", "preset"]

_LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    group_query_attention=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    layernorm_epsilon=1e-5,
)
_LLAMA31 = dict(
    rope_scaling=True,
    rope_scaling_factor=8.0,
    rope_scaling_low_freq_factor=1.0,
    rope_scaling_high_freq_factor=4.0,
    rope_scaling_original_max_position_embeddings=8192,
)
_LLAMA3_8B = dict(
    _LLAMA,
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=128256,
    seq_length=8192,
    rotary_base=500000.0,
)
_LLAMA3_70B = dict(
    _LLAMA3_8B, num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672
)
_QWEN3 = dict(  # q/k RMSNorm per head (head_dim 128 at every published size)
    _LLAMA,
    qk_layernorm=True,
    vocab_size=151936,
    seq_length=32768,
    rotary_base=1000000.0,
    layernorm_epsilon=1e-6,
)
_TINY = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    seq_length=128,
    vocab_size=256,
)

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_70B,
    # Llama 3.1 (and 3.3 70B): Llama 3's shapes with its RoPE scaling (factor 8 over an
    # original 8192 positions); the published configs allow 131072 positions, the preset
    # trains at 8192 (--seq-length changes it).
    "llama3.1-8b": dict(_LLAMA3_8B, **_LLAMA31),
    "llama3.1-70b": dict(_LLAMA3_70B, **_LLAMA31),
    "mistral-7b": dict(
        _LLAMA,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32768,
        seq_length=32768,
        rotary_base=1000000.0,
    ),
    "qwen2.5-7b": dict(
        _LLAMA,
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        seq_length=32768,
        rotary_base=1000000.0,
        add_qkv_bias=True,
        layernorm_epsilon=1e-6,
    ),
    "mixtral-8x7b": dict(
        _LLAMA,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        seq_length=32768,
        rotary_base=1000000.0,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=14336,
    ),
    # Qwen3 (max_position_embeddings 40960; 32768 native context)
    "qwen3-8b": dict(
        _QWEN3,
        num_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=12288,
    ),
    # 128 experts, top-8, renormalised (norm_topk_prob true), experts on every layer
    # (intermediate_size 6144 is the unused dense width), no shared expert
    "qwen3-30b-a3b": dict(
        _QWEN3,
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,  # != 2048 / 32
        ffn_hidden_size=6144,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
    ),
    "llama3-tiny": dict(_LLAMA, **_TINY, rotary_base=500000.0),
    # the scaling at a tiny size: an original 64 positions puts head_dim 16's frequencies in
    # all three bands (kept, interpolated, divided by the factor)
    "llama3.1-tiny": dict(
        _LLAMA,
        **_TINY,
        rotary_base=500000.0,
        **{**_LLAMA31, "rope_scaling_original_max_position_embeddings": 64},
    ),
    "mistral-tiny": dict(_LLAMA, **_TINY, rotary_base=1000000.0),
    "qwen2.5-tiny": dict(
        _LLAMA, **_TINY, rotary_base=1000000.0, add_qkv_bias=True, layernorm_epsilon=1e-6
    ),
    "qwen3-tiny": dict(_QWEN3, **{**_TINY, "kv_channels": 32}),
    "qwen3-moe-tiny": dict(
        _QWEN3,
        **{**_TINY, "kv_channels": 32},
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
    ),
    "mixtral-tiny": dict(
        _LLAMA,
        **_TINY,
        rotary_base=1000000.0,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=128,
    ),
}
"""``GPTConfig`` arguments per model name."""


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of preset ``name`` with ``overrides``; a clear error for an
    unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})
