"""LayerNorm and RMSNorm as Flax NNX modules (fp32 statistics, output in the input
dtype), and :func:`make_norm` picking one by Megatron's ``--normalization`` name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.nn.facts import param_facts

__all__ = ["LayerNorm", "RMSNorm", "NORMALIZATIONS", "make_norm"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""Megatron's ``--normalization`` choices."""


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, computed in fp32, output in the input dtype.

    Parameters ``scale`` / ``bias`` ``[hidden]`` are replicated over ``tensor``; with
    sequence parallelism each rank sees only its sequence chunk, so their gradients
    must be all-reduced over ``tensor`` (the gradient finalization does that). No
    weight decay (Megatron's default).
    """

    def __init__(self, hidden_size: int, *, epsilon: float = 1e-5):
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((hidden_size,), jnp.float32), **param_facts(None))
        self.bias = nnx.Param(jnp.zeros((hidden_size,), jnp.float32), **param_facts(None))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[..., hidden]`` -> ``[..., hidden]``."""
        with jax.named_scope("layer_norm"):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
            return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim (Llama's): ``x * rsqrt(mean(x^2) + eps)`` with fp32
    statistics, cast to the input dtype, times ``scale`` ``[hidden]`` (as Hugging Face's
    ``LlamaRMSNorm``: the scale multiplies in the input dtype). No bias; replicated over
    ``tensor``, no weight decay, like :class:`LayerNorm`."""

    def __init__(self, hidden_size: int, *, epsilon: float = 1e-5):
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((hidden_size,), jnp.float32), **param_facts(None))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[..., hidden]`` -> ``[..., hidden]``."""
        with jax.named_scope("rms_norm"):
            xf = x.astype(jnp.float32)
            y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.epsilon)
            return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def make_norm(kind: str, hidden_size: int, *, epsilon: float) -> LayerNorm | RMSNorm:
    """``kind``: ``"LayerNorm"`` or ``"RMSNorm"`` (Megatron's ``--normalization``)."""
    if kind not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {kind!r}")
    return (LayerNorm if kind == "LayerNorm" else RMSNorm)(hidden_size, epsilon=epsilon)
