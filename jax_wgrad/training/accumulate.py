"""Single-device gradient accumulation over microbatches through the fused op.

The one-device version of what the pipeline schedule does per stage: a ``lax.scan``
over microbatches whose carry holds fp32 gradient accumulators. Weights of modules
built with ``gradient_accumulation_fusion=True`` are routed to their
:class:`~jax_wgrad.MainGrad` buffer (:class:`~jax_wgrad.functional.WgradRoutes`, the
mechanism the pipeline uses for its buckets) and accumulate through
:func:`jax_wgrad.ops.wgrad_accumulate` directly into it (in place: the buffer is a scan
carry); every other parameter's gradient is added to an fp32 carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.routes import WgradRoutes
from jax_wgrad.nn import MainGrad

__all__ = ["accumulate_gradients"]


def _merge_main_grads(grads: nnx.State, weight_of: dict, buckets: dict) -> nnx.State:
    """Replaces each fused weight's (zero) gradient by its accumulator (a flat bucket)."""
    flat = dict(nnx.to_flat_state(grads))
    for path, weight_path in weight_of.items():
        weight = flat[weight_path]
        flat[weight_path] = weight.replace(buckets[path].reshape(weight.shape))
    return nnx.from_flat_state(flat)


def accumulate_gradients(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    microbatches: Any,
) -> tuple[jax.Array, nnx.State]:
    """Mean loss and fp32 gradient of the mean loss over ``M`` microbatches.

    Args:
      model: an NNX module; its ``nnx.Param`` leaves are differentiated. Modules with
        :class:`MainGrad` accumulators route their weight gradients through the fused
        op (their ``MainGrad`` values are not modified: accumulation starts from zero).
      loss_fn: ``loss_fn(model, microbatch) -> scalar`` mean loss of one microbatch.
      microbatches: a pytree whose leaves have a leading microbatch axis ``[M, ...]``.
    Returns:
      ``(loss, grads)``: the mean of the ``M`` losses, and an ``nnx.State`` shaped like
      the model's ``nnx.Param`` state holding fp32 gradients of that mean.
    """
    leaves = jax.tree.leaves(microbatches)
    if not leaves:
        raise ValueError("accumulate_gradients: microbatches has no arrays")
    num_micro = leaves[0].shape[0]
    if num_micro < 1 or any(leaf.shape[:1] != (num_micro,) for leaf in leaves):
        raise ValueError(
            "accumulate_gradients: every microbatch leaf needs the same leading axis M >= 1; "
            f"got shapes {[leaf.shape for leaf in leaves]}"
        )
    graphdef, params, main_grads, rest = nnx.split(model, nnx.Param, MainGrad, ...)
    scale = 1.0 / num_micro
    # Each MainGrad is the flat bucket its sibling weight is routed to.
    weight_of = {path: path[:-1] + ("weight",) for path, _ in nnx.to_flat_state(main_grads)}
    known = {path for path, _ in nnx.to_flat_state(params)}
    for path, weight_path in weight_of.items():
        if weight_path not in known:
            raise ValueError(f"MainGrad at {path} has no sibling 'weight' parameter")

    def micro_loss(p, buckets, batch):
        routes = WgradRoutes(buckets)
        flat = dict(nnx.to_flat_state(p))
        for path, weight_path in weight_of.items():
            flat[weight_path] = routes.to_bucket(
                flat[weight_path], path, 0, name="/".join(map(str, weight_path))
            )
        model = nnx.merge(graphdef, nnx.from_flat_state(flat), main_grads, rest)
        return loss_fn(model, batch) * scale, routes.close()

    def body(carry, batch):
        loss_sum, grad_acc, buckets = carry
        (loss, _), vjp = jax.vjp(lambda p, b: micro_loss(p, b, batch), params, buckets)
        g, buckets = vjp((jnp.ones_like(loss), buckets))
        grad_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grad_acc, g)
        return (loss_sum + loss, grad_acc, buckets), None

    zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)
    buckets = {
        path: jnp.zeros(v[...].size, jnp.float32) for path, v in nnx.to_flat_state(main_grads)
    }
    init = (jnp.zeros((), jnp.float32), zeros(params), buckets)
    (loss, grads, buckets), _ = jax.lax.scan(body, init, microbatches)
    return loss, _merge_main_grads(grads, weight_of, buckets)
