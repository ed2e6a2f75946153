"""optax pieces for flat bucket shards, and Megatron's fp32 global norm and clipping.

A shard cuts through parameters, so per-leaf optax masks (``optax.adamw(mask=...)``) cannot
be used on flat shards: :func:`adamw` / :func:`add_decayed_weights` take the weight-decay mask
at update time as the extra argument ``weight_decay_mask`` (per element on shards, per
leaf on trees). :func:`global_grad_norm` and :func:`clip_by_total_norm` are Megatron's
``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = [
    "MOMENT_DTYPES",
    "add_decayed_weights",
    "adamw",
    "clip_by_total_norm",
    "global_grad_norm",
    "scale_by_adam",
]

PyTree = Any


def add_decayed_weights(weight_decay: float) -> optax.GradientTransformationExtraArgs:
    """``updates + weight_decay * mask * params`` with a per-element mask from extra args.

    Like :func:`optax.add_decayed_weights`, but the mask arrives at update time as the extra
    argument ``weight_decay_mask``: a pytree like ``params`` whose leaves broadcast against
    them (bool/float per element on flat shards, or a scalar per leaf on a tree). Missing or
    ``None``: decay everything.
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, weight_decay_mask=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("add_decayed_weights needs params")
        if weight_decay_mask is None:
            decayed = jax.tree.map(lambda g, p: g + weight_decay * p, updates, params)
        else:
            decayed = jax.tree.map(
                lambda g, p, m: g + weight_decay * jnp.asarray(m, p.dtype) * p,
                updates,
                params,
                weight_decay_mask,
            )
        return decayed, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


MOMENT_DTYPES = (jnp.float32, jnp.bfloat16)
"""The dtypes Adam's moments may be stored in (:func:`scale_by_adam`): Megatron's
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` ``fp32`` and ``bf16``. (Megatron's ``fp16`` and
``fp8`` store scaled moments, TransformerEngine's per-tensor scales, which are not built.)"""


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    exp_avg_dtype: Any = None,
    exp_avg_sq_dtype: Any = None,
) -> optax.GradientTransformation:
    """:func:`optax.scale_by_adam` whose moments are *stored* in ``exp_avg_dtype`` (first)
    and ``exp_avg_sq_dtype`` (second) but computed in fp32, as Megatron's precision-aware
    optimizer (TransformerEngine's ``FusedAdam``) does: each step reads the stored moments,
    updates them and computes the update in fp32, and rounds the new moments to their
    dtype (to nearest) for storage. ``None`` (both): exactly :func:`optax.scale_by_adam`.

    Args:
      exp_avg_dtype, exp_avg_sq_dtype: one of :data:`MOMENT_DTYPES` or ``None`` (the
        main parameters' dtype, fp32).
    Raises:
      ValueError: another dtype.
    """
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype is not None and jnp.dtype(dtype) not in map(jnp.dtype, MOMENT_DTYPES):
            allowed = ", ".join(jnp.dtype(d).name for d in MOMENT_DTYPES)
            raise ValueError(f"scale_by_adam: {name} must be one of {allowed}, got {dtype!r}")
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    if exp_avg_dtype is None and exp_avg_sq_dtype is None:
        return inner
    stored = lambda tree, dtype: jax.tree.map(lambda x: x.astype(dtype or jnp.float32), tree)

    def init_fn(params):
        state = inner.init(params)
        return state._replace(
            mu=stored(state.mu, exp_avg_dtype), nu=stored(state.nu, exp_avg_sq_dtype)
        )

    def update_fn(updates, state, params=None):  # fp32 moments in, stored ones out
        wide = state._replace(mu=stored(state.mu, None), nu=stored(state.nu, None))
        updates, new = inner.update(updates, wide, params)
        return updates, new._replace(
            mu=stored(new.mu, exp_avg_dtype), nu=stored(new.nu, exp_avg_sq_dtype)
        )

    return optax.GradientTransformation(init_fn, update_fn)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    *,
    exp_avg_dtype: Any = None,
    exp_avg_sq_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """:func:`optax.adamw` whose weight-decay mask is the ``weight_decay_mask`` extra arg.

    The same chain as optax (``scale_by_adam`` -> decay -> ``scale_by_learning_rate``), so
    results equal ``optax.adamw(..., mask=tree)`` on the full tree. ``exp_avg_dtype``,
    ``exp_avg_sq_dtype``: the moments' storage dtypes (:func:`scale_by_adam`).
    """
    return optax.chain(
        scale_by_adam(
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
        ),
        add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def global_grad_norm(
    grads: PyTree,
    *,
    axis_names: Sequence[str] = (),
    weights: PyTree | None = None,
) -> jax.Array:
    """L2 norm in fp32 of gradients spread over devices (Megatron's ``get_grad_norm_fp32``).

    ``sqrt(psum_{axis_names}(sum_leaves sum(weights * g**2)))``. ``weights`` (a pytree like
    ``grads`` whose leaves broadcast against them, e.g. a 0/1 scalar per leaf or a
    per-element mask) makes every element count once overall: set it to 0 on all but one
    of the devices holding a copy.

    Args:
      grads: pytree of gradient arrays (any float dtype; squared in fp32).
      axis_names: mesh axes over which devices hold *different* parts (summed).
      weights: optional per-leaf/per-element multipliers.
    Returns:
      fp32 scalar, identical on all devices of ``axis_names``.
    """
    leaves = jax.tree.leaves(grads)
    if weights is None:
        ws = [None] * len(leaves)
    else:
        ws = jax.tree.leaves(weights)
        if len(ws) != len(leaves):
            raise ValueError(
                f"global_grad_norm: {len(ws)} weight leaves for {len(leaves)} gradient leaves"
            )
    total = jnp.zeros((), jnp.float32)
    for g, w in zip(leaves, ws):
        sq = jnp.square(g.astype(jnp.float32))
        if w is not None:
            sq = sq * jnp.asarray(w, jnp.float32)
        total = total + jnp.sum(sq)
    if axis_names:
        total = lax.psum(total, tuple(axis_names))
    return jnp.sqrt(total)


def clip_by_total_norm(
    grads: PyTree, max_norm: float, total_norm: jax.Array
) -> tuple[PyTree, jax.Array]:
    """Megatron's ``clip_grad_by_total_norm_fp32``: scale by ``max_norm / (norm + 1e-6)``.

    The coefficient is clamped to 1 (multiplying by 1.0 leaves gradients bit-identical), so
    gradients change only when it is below 1.

    Returns:
      ``(clipped grads, coefficient)``.
    """
    coeff = jnp.minimum(jnp.float32(max_norm) / (total_norm + 1e-6), 1.0).astype(jnp.float32)
    return jax.tree.map(lambda g: g * coeff.astype(g.dtype), grads), coeff
