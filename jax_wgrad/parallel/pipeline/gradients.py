"""A pipelined step's gradients: the executor's schedule plus Megatron's finalization."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import finalize_grads
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.parallel.mesh import AXES, DATA_PARALLEL, axis_sizes, local_shape
from jax_wgrad.parallel.pipeline.executor import cooldown_sync, stage_gradients
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable, get_schedule
from jax_wgrad.parallel.pipeline.setup import StageSetup

__all__ = ["grad_layout", "schedule_of", "reduce_gradients", "moe_metrics", "pipeline_gradients"]


def grad_layout(stages, ddp: DDPConfig) -> GradLayout:
    """The layout of one device's gradient buckets for ``stages`` (its model and parallel
    layout): the device tree's per-device shapes with the model's grad specs."""
    par = stages.parallel
    sizes = axis_sizes(par)
    full = jax.eval_shape(stages.init_params)
    local = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(local_shape(a.shape, s, sizes), a.dtype),
                         full, stages.param_specs(), is_leaf=lambda x: isinstance(x, P))
    return GradLayout.create(stages.device_tree(local), stages.grad_specs(),
                             dp_size=par.data_parallel_size, ddp=ddp,
                             fusion=par.gradient_accumulation_fusion,
                             expert_dp_size=par.expert_data_parallel_size)


def schedule_of(stages) -> ScheduleTable:
    """The table of ``stages.parallel.pipeline_schedule`` for its stages and microbatches."""
    par = stages.parallel
    return get_schedule(par.pipeline_schedule, par.pipeline_model_parallel_size,
                        par.num_microbatches)


def reduce_gradients(stages, layout: GradLayout, ddp: DDPConfig, table: ScheduleTable,
                     params, tokens: jax.Array, *, grad_hook=None):
    """Schedule + finalization (inside ``shard_map``): ``(synced grads, mean loss, MoE
    metrics)``.

    ``params``: the device tree. The synced gradients are
    :func:`~jax_wgrad.grads.finalize_grads`'s: shards (distributed optimizer) or full
    buckets of the global mean token loss's gradient. ``grad_hook`` (tests: fault
    injection) maps the local buckets before they are finalized. The MoE metrics
    (:func:`moe_metrics`) are ``{}`` for a dense model.
    """
    par = stages.parallel
    buckets, loss_sum, stats = stage_gradients(stages, layout, ddp, table, params, tokens)
    if grad_hook is not None:
        buckets = tuple(grad_hook(buckets))
    setup = StageSetup.of(stages)
    n_local = jnp.float32(setup.num_tokens)
    synced = finalize_grads(
        layout, ddp, buckets, stage_synced=cooldown_sync(ddp, par.pipeline_model_parallel_size),
        num_tokens=n_local, sequence_parallel=par.sequence_parallel,
        pipeline_parallel=par.pipeline_model_parallel_size > 1)
    return synced, setup.mean_loss(loss_sum), moe_metrics(stats, par)


def moe_metrics(stats, par) -> dict[str, jax.Array]:
    """The step's MoE figures from every device's sums (inside ``shard_map``):
    ``moe_aux_loss`` (the load-balancing losses of all MoE layers, each the mean over
    microbatches and data-parallel ranks: the term the gradients include),
    ``moe_tokens_per_expert`` ``[E]`` (routed choices per expert over all MoE layers and
    tokens of the step, before dropping), ``moe_max_load`` (the busiest expert's load over
    the mean: 1 is perfect balance) and ``moe_dropped_fraction`` (dropped / routed)."""
    if not stats:
        return {}
    aux, tokens, dropped = (lax.psum(s, AXES) for s in stats)
    routed = jnp.sum(tokens)
    return {"moe_aux_loss": aux / (par.data_parallel_size * par.num_microbatches),
            "moe_tokens_per_expert": tokens,
            "moe_max_load": jnp.max(tokens) / jnp.maximum(jnp.mean(tokens), 1.0),
            "moe_dropped_fraction": dropped / jnp.maximum(routed, 1.0)}


def pipeline_gradients(stages, mesh: Mesh, params, tokens: jax.Array,
                       ddp: DDPConfig | None = None, *, table: ScheduleTable | None = None):
    """Gradients and mean loss of one global batch; traceable under ``jax.jit``.

    Args:
      stages: the model's per-stage functions (:class:`jax_wgrad.GPTStages`).
      params: canonical parameters sharded as ``stages.param_specs()``.
      tokens: int ``[global_batch_size, S + 1]`` sharded over the data-parallel axes.
      ddp: bucket options (its ``use_distributed_optimizer`` is ignored: the buckets are
        all-reduced so that every rank gets the whole gradient tree).
      table: the schedule (default: ``stages.parallel.pipeline_schedule``'s table).
    Returns:
      ``(grads, loss)``: fp32 gradients sharded like ``params`` and the scalar loss.
    """
    ddp = dataclasses.replace(ddp or DDPConfig(), use_distributed_optimizer=False)
    layout = grad_layout(stages, ddp)
    table = table or schedule_of(stages)
    specs = stages.param_specs()

    def body(p, t):
        synced, loss, _ = reduce_gradients(stages, layout, ddp, table, stages.device_tree(p), t)
        return stages.canonical_tree(layout.buffer.to_tree(synced)), loss

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA_PARALLEL)),
                       out_specs=(specs, P()),
                       check_vma=False)
    return fn(params, tokens)
