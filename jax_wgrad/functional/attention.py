"""The causal attention core of the GPT layers (and of the plain-JAX benchmark model)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["causal_attention", "rotary_embedding"]


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "xla"
) -> jax.Array:
    """``q``: ``[b, s, heads, head_dim]``, ``k, v``: ``[b, s, groups, head_dim]`` ->
    ``[b, s, heads * head_dim]``.

    Grouped-query attention when ``groups < heads`` (``heads % groups == 0``): query head
    ``h`` attends with key/value head ``h // (heads / groups)`` (Megatron's and Hugging
    Face's ``repeat_kv`` order). ``implementation``: ``"xla"`` (below: fp32 scores and
    softmax, output in ``q.dtype``) or ``"cudnn"`` (:func:`jax.nn.dot_product_attention`'s
    cuDNN flash attention, 16-bit inputs on a CUDA GPU).
    """
    b, s, h, d = q.shape
    g = k.shape[2]
    if h % g or k.shape != v.shape or k.shape[:2] + k.shape[3:] != (b, s, d):
        raise ValueError(
            f"causal_attention: q {q.shape} needs k, v [b, s, groups, d] with "
            f"heads divisible by groups; got k {k.shape}, v {v.shape}"
        )
    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.reshape(b, s, h * d)
    qg = q.reshape(b, s, g, h // g, d)
    scores = jnp.einsum("bqgmd,bkgd->bgmqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgmqk,bkgd->bqgmd", probs, v)
    return out.reshape(b, s, h * d)


def rotary_embedding(x: jax.Array, *, base: float, percent: float = 1.0) -> jax.Array:
    """RoPE of ``x`` ``[b, s, heads, head_dim]`` at positions ``0 .. s - 1`` (the whole
    sequence: apply it after the sequence-parallel all-gather), on the first
    ``percent * head_dim`` dims in the non-interleaved ``rotate_half`` convention
    (Megatron's default, Hugging Face Llama's): angles in fp32, output in ``x.dtype``."""
    s, d = x.shape[1], x.shape[-1]
    rot = int(d * percent)
    if rot % 2 or not 0 < rot <= d:
        raise ValueError(
            f"rotary_embedding: rotary dims {rot} (head_dim {d} x rotary_percent "
            f"{percent}) must be even and positive"
        )
    inv_freq = 1.0 / (base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None]  # [s, rot/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None].astype(x.dtype)
    xr, rest = x[..., :rot], x[..., rot:]
    half = jnp.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return jnp.concatenate([xr * cos + half * sin, rest], -1)
