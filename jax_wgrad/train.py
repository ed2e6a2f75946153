"""Train state and the jitted, donating train step over the ``(data, tensor, pipeline)`` mesh.

``step(state, tokens) -> (state, metrics)`` runs the 1F1B pipeline
(:func:`jax_wgrad.pipeline.pipeline_gradients`), whose gradients are already summed over
``data`` (a plain all-reduce for now), then applies an optax optimizer with ordinary
GSPMD-sharded arrays. Metrics: ``loss`` (global mean token loss) and ``grad_norm``
(global L2 norm of the gradients, before clipping).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import _ffi
from jax_wgrad.config import GPTConfig, ParallelConfig, validate
from jax_wgrad.gpt import GPTStages, init_params, param_specs
from jax_wgrad.pipeline import pipeline_gradients

__all__ = [
    "TrainState",
    "default_optimizer",
    "param_shardings",
    "init_train_state",
    "shard_batch",
    "build_train_step",
]


class TrainState(NamedTuple):
    """Everything that changes from step to step (a pytree)."""

    step: jax.Array
    params: dict[str, Any]
    opt_state: Any


def default_optimizer(
    lr: float | optax.Schedule,
    *,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_grad: float = 1.0,
) -> optax.GradientTransformation:
    """Megatron's defaults: Adam(W) with global-norm clipping, no decay on biases,
    LayerNorm parameters and positions (only on ``weight`` / ``embedding`` leaves)."""

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", None) in ("weight", "embedding"), params
        )

    return optax.chain(
        optax.clip_by_global_norm(clip_grad),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


def param_shardings(mesh: Mesh, model: GPTConfig) -> dict[str, Any]:
    """``NamedSharding`` of every canonical parameter on ``mesh``."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(model), is_leaf=lambda x: isinstance(x, P)
    )


def init_train_state(
    model: GPTConfig,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    seed: int,
) -> TrainState:
    """Full parameters from ``seed`` (identical for every layout), created sharded."""
    shardings = param_shardings(mesh, model)
    params = jax.jit(lambda: init_params(model, seed), out_shardings=shardings)()
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        # Scalars (e.g. Adam's count) come back on one device: replicate them on the mesh.
        lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
        jax.jit(optimizer.init)(params),
    )
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return TrainState(step, params, opt_state)


def shard_batch(mesh: Mesh, tokens: np.ndarray) -> jax.Array:
    """Global ``[global_batch, S + 1]`` host batch -> array sharded over ``data``.

    Every process passes the same global batch (see :mod:`jax_wgrad.data`); each
    keeps the rows of its own devices, so this works for multi-process runs too.
    """
    sharding = NamedSharding(mesh, P("data"))
    return jax.make_array_from_callback(tokens.shape, sharding, lambda idx: tokens[idx])


def build_train_step(
    model: GPTConfig,
    parallel: ParallelConfig,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    state: TrainState,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """A jitted ``step(state, tokens) -> (state, metrics)`` donating ``state``.

    Args:
      state: an initial state (only its shardings are used, to pin the output
        shardings so the donated buffers are reused).
    """
    validate(parallel, model)
    if parallel.gradient_accumulation_fusion:
        _ffi.require_fusion(mesh.devices.flat[0].platform, who="gradient_accumulation_fusion")
    stages = GPTStages(model, parallel)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)

    def step(state: TrainState, tokens: jax.Array):
        grads, loss = pipeline_gradients(stages, mesh, state.params, tokens)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(state.step + 1, params, opt_state)
        return new_state, {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(step, donate_argnums=0, out_shardings=(state_shardings, None))
