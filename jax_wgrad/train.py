"""Train state and the jitted, donating train step over the ``(data, tensor, pipeline)`` mesh.

``step(state, tokens) -> (state, metrics)`` is ONE ``shard_map`` program: the 1F1B
pipeline accumulates gradients in flat fp32 buckets (:mod:`jax_wgrad.pipeline`), the
buckets are synced and finalized (:mod:`jax_wgrad.ddp`: data-parallel reduce-scatter or
all-reduce per bucket -- in the pipeline cooldown with ``overlap_grad_reduce`` --, the
sequence-parallel and tied-embedding all-reduces, token scaling), and
:class:`jax_wgrad.dist_optimizer.DistributedOptimizer` takes the step: global fp32 norm
(each parameter counted once), clipping, skip on a non-finite norm, optax on this rank's
shards (``use_distributed_optimizer``) or on the replicated tree, all-gather of the
updated parameters. Options: :class:`jax_wgrad.config.DDPConfig`.

Metrics: ``loss`` (global mean token loss), ``grad_norm`` (global L2 norm before
clipping), ``skipped`` (the step was skipped: non-finite norm; nothing changed).

The optimizer state is per device (fp32 master weights and optax state of the device's
shard); it is stored as global arrays with a leading device axis
(``PartitionSpec(("data", "tensor", "pipeline"))``).
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
from jax_wgrad import dist_optimizer
from jax_wgrad.config import DDPConfig, GPTConfig, ParallelConfig, validate
from jax_wgrad.ddp import GradLayout, canonical_tree, device_tree
from jax_wgrad.gpt import GPTStages, init_params, param_specs
from jax_wgrad.pipeline import reduce_gradients

__all__ = [
    "TrainState",
    "DEVICE_AXES",
    "default_optimizer",
    "make_optimizer",
    "param_shardings",
    "init_train_state",
    "shard_batch",
    "build_train_step",
]

DEVICE_AXES = ("data", "tensor", "pipeline")
"""Per-device state (optimizer) is stacked on a leading axis sharded over all mesh axes."""


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
    eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    """Megatron's defaults: AdamW, decay only on ``weight`` / word ``embedding`` leaves
    (not biases, LayerNorms, positions). The decay mask is applied per element by the
    train step (:func:`jax_wgrad.dist_optimizer.adamw`); clipping is ``DDPConfig.clip_grad``."""
    return dist_optimizer.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


def _mesh_shape(mesh: Mesh) -> tuple[int, int, int]:
    return tuple(int(mesh.shape[a]) for a in DEVICE_AXES)  # type: ignore[return-value]


def make_optimizer(
    model: GPTConfig, mesh: Mesh, optimizer: optax.GradientTransformation, ddp: DDPConfig
) -> tuple[GradLayout, dist_optimizer.DistributedOptimizer]:
    """The gradient layout of every device and the optimizer over its buckets.

    Weight decay on ``weight`` / word ``embedding`` leaves (passed to ``optimizer`` as the
    ``weight_decay_mask`` extra argument); the norm counts tensor-replicated parameters and
    the pipeline-replicated embedding/head once.
    """
    layout = GradLayout.create(model, _mesh_shape(mesh), ddp)
    opt = dist_optimizer.DistributedOptimizer.create(
        layout.buffer, optimizer, data_axis="data", model_axes=("tensor", "pipeline"),
        clip_grad=ddp.clip_grad or None, weight_decay_mask=layout.weight_decay_flags(),
        duplicated={"tensor": layout.tensor_replicated(), "pipeline": layout.shared_flags()})
    return layout, opt


def param_shardings(mesh: Mesh, model: GPTConfig) -> dict[str, Any]:
    """``NamedSharding`` of every canonical parameter on ``mesh``."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(model), is_leaf=lambda x: isinstance(x, P)
    )


def _stack(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _unstack(tree):
    return jax.tree.map(lambda x: x[0], tree)


def init_train_state(
    model: GPTConfig,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    seed: int,
    *,
    ddp: DDPConfig | None = None,
) -> TrainState:
    """Full parameters from ``seed`` (identical for every layout), created sharded, and
    each device's optimizer state (fp32 master + optax state of its shard)."""
    ddp = ddp or DDPConfig()
    shardings = param_shardings(mesh, model)
    params = jax.jit(lambda: init_params(model, seed), out_shardings=shardings)()
    _, opt = make_optimizer(model, mesh, optimizer, ddp)
    init = jax.shard_map(lambda p: _stack(opt.init(device_tree(p))), mesh=mesh,
                         in_specs=(param_specs(model),), out_specs=P(DEVICE_AXES),
                         check_vma=False)
    opt_state = jax.jit(init)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
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
    *,
    ddp: DDPConfig | None = None,
    debug_grad_hook: Callable[[tuple[jax.Array, ...], jax.Array], tuple[jax.Array, ...]]
    | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """A jitted ``step(state, tokens) -> (state, metrics)`` donating ``state``.

    Args:
      state: an initial state from :func:`init_train_state` with the same ``ddp`` (only
        its shardings are used, to pin the output shardings so donated buffers are reused).
      ddp: buckets, sync, distributed optimizer and clipping options.
      debug_grad_hook: for fault-injection tests: ``hook(local buckets, step) -> buckets``
        applied to each device's accumulated buckets before they are synced.
    """
    ddp = ddp or DDPConfig()
    validate(parallel, model)
    if parallel.mesh_shape != _mesh_shape(mesh):
        raise ValueError(f"build_train_step: mesh (data, tensor, pipeline) = "
                         f"{_mesh_shape(mesh)} does not match the parallel config's "
                         f"{parallel.mesh_shape}")
    if parallel.gradient_accumulation_fusion:
        _ffi.require_fusion(mesh.devices.flat[0].platform, who="gradient_accumulation_fusion")
    stages = GPTStages(model, parallel, platform=mesh.devices.flat[0].platform)
    layout, opt = make_optimizer(model, mesh, optimizer, ddp)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    specs = param_specs(model)

    def body(params, opt_state, tokens, step):
        hook = None if debug_grad_hook is None else (lambda b: debug_grad_hook(b, step))
        synced, loss = reduce_gradients(stages, layout, ddp, params, tokens, grad_hook=hook)
        new_tree, new_opt_state, info = opt.step(device_tree(params), synced,
                                                 _unstack(opt_state))
        metrics = {"loss": loss, "grad_norm": info.grad_norm, "skipped": info.skipped}
        return canonical_tree(new_tree), _stack(new_opt_state), metrics

    per_device = jax.shard_map(
        body, mesh=mesh,
        in_specs=(specs, P(DEVICE_AXES), P("data"), P()),
        out_specs=(specs, P(DEVICE_AXES), P()),
        check_vma=False,
    )

    def step(state: TrainState, tokens: jax.Array):
        params, opt_state, metrics = per_device(state.params, state.opt_state, tokens,
                                                state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(step, donate_argnums=0, out_shardings=(state_shardings, None))
