"""The causal attention core of the GPT layers (and of the plain-JAX benchmark model)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["causal_attention"]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str = "xla") -> jax.Array:
    """``q, k, v``: ``[b, s, heads, head_dim]`` -> ``[b, s, heads * head_dim]``.

    ``implementation``: ``"xla"`` (below: fp32 scores and softmax, output in
    ``q.dtype``) or ``"cudnn"`` (:func:`jax.nn.dot_product_attention`'s cuDNN flash
    attention, 16-bit inputs on a CUDA GPU).
    """
    b, s, h, d = q.shape
    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.reshape(b, s, h * d)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.reshape(b, s, h * d)
