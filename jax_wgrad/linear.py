"""Functional linear layer whose backward can fuse weight-gradient accumulation.

``linear(x, w, b, main_grad=acc)`` computes ``x @ w.T + b`` like a plain linear layer, but
its backward does not produce a weight gradient. Instead the weight gradient
``dy^T x`` is accumulated into ``acc`` with :func:`jax_wgrad.ops.wgrad_accumulate`, and
the *updated accumulator* is returned as the cotangent of ``main_grad``. This is how
Megatron's ``gradient_accumulation_fusion`` (``weight.main_grad += dy^T x`` inside the
backward GEMM) maps onto JAX's functional autodiff:

    grads = jax.grad(loss, argnums=(params, main_grads))(...)
    new_main_grads = grads[1]          # == main_grads + dW, updated in place by XLA

The cotangent of ``main_grad`` is therefore *not* a derivative. It is only meaningful
when each accumulator is used by exactly one ``linear`` call per differentiated
function (two uses would add the accumulator twice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_wgrad import ops

__all__ = ["linear"]


def _check(x: jax.Array, w: jax.Array, b: jax.Array | None) -> None:
    if w.ndim != 2:
        raise ValueError(f"linear: weight must be [out, in], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear: input features {x.shape} do not match weight [out, in] = {w.shape}"
        )
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"linear: bias must have shape ({w.shape[0]},), got {b.shape}")


def _forward(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = jnp.matmul(x, w.T.astype(x.dtype))
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


@jax.custom_vjp
def _fused_linear(x, w, b, main_grad):
    return _forward(x, w, b)


def _fused_linear_fwd(x, w, b, main_grad):
    return _forward(x, w, b), (x, w, b, main_grad)


def _fused_linear_bwd(res, dy):
    x, w, b, main_grad = res
    dx = jnp.matmul(dy, w.astype(dy.dtype)).astype(x.dtype)
    db = None
    if b is not None:
        db = jnp.sum(dy.reshape(-1, dy.shape[-1]), axis=0, dtype=jnp.float32).astype(b.dtype)
    # The updated accumulator travels as the "cotangent" of main_grad (module docstring).
    new_main_grad = ops.wgrad_accumulate(x, dy, main_grad)
    return dx, None, db, new_main_grad


_fused_linear.defvjp(_fused_linear_fwd, _fused_linear_bwd)


def linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    main_grad: jax.Array | None = None,
) -> jax.Array:
    """``y = x @ w.T + b``.

    Args:
      x: ``[..., in]`` input.
      w: ``[out, in]`` weight (Megatron/PyTorch layout).
      b: optional ``[out]`` bias.
      main_grad: optional ``[out, in]`` fp32 (or input-dtype) accumulator. When given,
        the backward accumulates ``dy^T x`` into it through the fused op and returns the
        updated buffer as its cotangent; ``w`` then receives a zero gradient.
    Returns:
      ``[..., out]`` output in ``x.dtype``.
    """
    _check(x, w, b)
    if main_grad is None:
        return _forward(x, w, b)
    if main_grad.shape != w.shape:
        raise ValueError(
            f"linear: main_grad shape {main_grad.shape} must equal weight shape {w.shape}"
        )
    return _fused_linear(x, w, b, main_grad)
