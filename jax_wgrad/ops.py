"""Fused weight-gradient accumulation: ``main_grad += dy^T @ x`` (temporary scaffold).

This module is the thin Python layer over the XLA FFI custom call. The scaffold body
below is replaced by the FFI primitive in the next commit; the signature is final.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def wgrad_accumulate(x: jax.Array, dy: jax.Array, main_grad: jax.Array) -> jax.Array:
    """Returns ``main_grad + dy^T @ x`` computed in fp32.

    Args:
      x: ``[..., in]`` layer input.
      dy: ``[..., out]`` gradient of the layer output; same leading dims as ``x``.
      main_grad: ``[out, in]`` accumulator, f32 or the 16-bit dtype of the inputs.
    Returns:
      The updated ``[out, in]`` accumulator (same dtype as ``main_grad``).
    """
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    upd = jnp.dot(dy2.T, x2, preferred_element_type=jnp.float32)
    return (main_grad.astype(jnp.float32) + upd).astype(main_grad.dtype)
