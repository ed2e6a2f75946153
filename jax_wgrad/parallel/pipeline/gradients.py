"""A pipelined step's gradients: the executor's schedule plus Megatron's finalization."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.chunks import DeviceTree
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import finalize_grads
from jax_wgrad.grads.layout import GradLayout, layer_group_bounds
from jax_wgrad.grads.sink import GradSink
from jax_wgrad.grads.spec import LAYERS, GradSpec
from jax_wgrad.parallel.mesh import DATA_PARALLEL, axis_sizes, local_shape
from jax_wgrad.parallel.pipeline.carry import PipelineCarry
from jax_wgrad.parallel.pipeline.executor import initial_carry, stage_gradients
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.schedules import ScheduleTable, get_schedule

__all__ = [
    "grad_layout",
    "layer_groups",
    "grad_sink",
    "schedule_of",
    "reduce_gradients",
    "carry_shapes",
    "pipeline_gradients",
]


def grad_layout(program: StageProgram, ddp: DDPConfig) -> GradLayout:
    """The layout of one device's gradient buckets for ``program`` (its model and parallel
    layout): the device tree's per-device shapes with the model's grad specs."""
    par = program.parallel
    sizes = axis_sizes(par)
    full = jax.eval_shape(program.init_params)
    local = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(local_shape(a.shape, s, sizes), a.dtype),
        full,
        program.param_specs(),
        is_leaf=lambda x: isinstance(x, P),
    )
    tree, specs = program.device_tree(local), program.grad_specs()
    return GradLayout.create(
        tree,
        specs,
        dp_size=par.data_context_parallel_size,
        ddp=ddp,
        fusion=par.gradient_accumulation_fusion,
        expert_dp_size=par.expert_data_parallel_size,
        layer_groups=layer_groups(program, ddp, tree, specs),
    )


def layer_groups(
    program: StageProgram, ddp: DDPConfig, tree: DeviceTree, specs: DeviceTree
) -> tuple[int, ...] | None:
    """Where the stage's fused layer weights are cut into layer groups, a bucket each
    (:func:`~jax_wgrad.grads.layer_group_bounds`), with
    ``ddp.overlap_grad_reduce_in_backward`` (else ``None``): the stage's last backward
    syncs a group's bucket as it completes it. That needs gradient accumulation fusion
    (the fused GEMMs write the groups' buckets inside the backward), layers run by
    :func:`~jax_wgrad.functional.scan_layers` (:attr:`StageProgram.stacks_layers`), more
    than one data-parallel rank, one model chunk per stage, a backward that is not split
    (zero bubble's ``W`` tasks come after it) and at least two groups of two layers.

    Raises:
      ValueError: the option is on and one of these is missing (which one)."""
    if not ddp.overlap_grad_reduce_in_backward:
        return None
    par = program.parallel
    needs = {
        "gradient accumulation fusion (--gradient-accumulation-fusion)": (
            par.gradient_accumulation_fusion
        ),
        f"a model whose layers run in one scan ({type(program).__name__}.stacks_layers)": (
            program.stacks_layers
        ),
        f"more than one data-parallel rank (data_parallel_size={par.data_parallel_size})": (
            par.data_parallel_size > 1
        ),
        f"one model chunk per stage (num_model_chunks={par.num_model_chunks})": (
            par.num_model_chunks == 1
        ),
        f"a backward that is not split (pipeline schedule {par.pipeline_schedule!r})": (
            not schedule_of(program).split_backward
        ),
    }
    missing = [what for what, ok in needs.items() if not ok]
    if missing:
        raise ValueError("overlap_grad_reduce_in_backward needs " + ", ".join(missing))
    fused = [
        leaf
        for leaf, spec in zip(
            jax.tree.leaves(tree.stage),
            jax.tree.leaves(specs.stage, is_leaf=lambda x: isinstance(x, GradSpec)),
        )
        if spec.fused_in == LAYERS
    ]
    align = par.recompute_num_layers if par.recompute_method == "uniform" else 1
    bucket_size = ddp.effective_bucket_size(par.data_context_parallel_size)
    bounds = (
        layer_group_bounds(
            fused[0].shape[0],
            sum(math.prod(a.shape) for a in fused),
            bucket_size,
            align=align or 1,
        )
        if fused
        else None
    )
    if bounds is None:
        n, numel = (fused[0].shape[0] if fused else 0), sum(math.prod(a.shape) for a in fused)
        raise ValueError(
            f"overlap_grad_reduce_in_backward: the stage's {n} stacked layers (their fused "
            f"weights: {numel} elements, bucket_size {bucket_size}, "
            f"recomputed in runs of {align or 1}) make fewer than two layer groups of two "
            "layers; at least four layers per stage and a bucket_size below half their "
            "fused elements are needed"
        )
    return bounds


def grad_sink(program: StageProgram, layout: GradLayout, table: ScheduleTable) -> GradSink:
    """Where each weight gradient of ``program`` goes under ``table`` (split backward or
    not) and its deferral options."""
    return GradSink.create(
        layout,
        split_backward=table.split_backward,
        num_deferred_microbatches=program.parallel.num_deferred_microbatches,
        split_output=not program.ends_over_pipeline,
    )


def schedule_of(program: StageProgram) -> ScheduleTable:
    """The table of ``program.parallel.pipeline_schedule`` for its stages, microbatches and
    model chunks (interleaved when ``num_model_chunks > 1``)."""
    par = program.parallel
    return get_schedule(
        par.pipeline_schedule,
        par.pipeline_model_parallel_size,
        par.num_microbatches,
        par.num_model_chunks,
        par.microbatch_group_size_per_vp_stage,
    )


def reduce_gradients(
    program: StageProgram,
    sink: GradSink,
    ddp: DDPConfig,
    table: ScheduleTable,
    params: DeviceTree,
    batch: jax.Array,
    *,
    grad_hook=None,
):
    """Schedule + finalization (inside ``shard_map``): ``(synced grads, mean loss,
    metrics)``.

    ``params``: the device tree. The synced gradients are
    :func:`~jax_wgrad.grads.finalize_grads`'s: shards (distributed optimizer) or full
    buckets of the global mean token loss's gradient. ``grad_hook`` (tests: fault
    injection) maps the local buckets before they are finalized. The metrics are the
    program's (:meth:`StageProgram.metrics`; the GPT: its MoE figures, ``{}`` if dense).
    """
    par = program.parallel
    buckets, loss_sum, aux, synced_in_place = stage_gradients(
        program, sink, ddp, table, params, batch
    )
    if grad_hook is not None:
        buckets = tuple(grad_hook(buckets))
    setup = program.setup
    synced = finalize_grads(
        sink.layout,
        ddp,
        buckets,
        synced_in_place=synced_in_place,
        num_tokens=jnp.float32(setup.num_tokens),
        sequence_parallel=par.sequence_parallel,
        pipeline_parallel=par.pipeline_model_parallel_size > 1,
    )
    return synced, setup.mean_loss(loss_sum), program.metrics(aux)


def carry_shapes(
    program: StageProgram, sink: GradSink, ddp: DDPConfig, table: ScheduleTable, mesh
) -> PipelineCarry:
    """The per-device :class:`PipelineCarry` of ``jax.ShapeDtypeStruct`` leaves (what the
    schedule carries: buckets, residual slots, inboxes, W and deferral stashes), traced
    on ``mesh`` without running anything."""

    def per_device(params, batch):
        return initial_carry(program, sink, ddp, table, program.device_tree(params), batch)

    batch = program.setup.global_batch(program.parallel.data_parallel_size)
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(program.param_specs(), P(DATA_PARALLEL)),
        out_specs=P(),
        # Off: the pipeline's loop state is not typed by mesh axes yet (pinned by
        # tests/test_check_vma.py), and this per-device carry, returned under P() for its
        # shapes alone, is not replicated anyway.
        check_vma=False,
    )
    return jax.eval_shape(fn, jax.eval_shape(program.init_params), batch)


def pipeline_gradients(
    program: StageProgram,
    mesh: Mesh,
    params,
    batch: jax.Array,
    ddp: DDPConfig | None = None,
    *,
    table: ScheduleTable | None = None,
):
    """Gradients and mean loss of one global batch; traceable under ``jax.jit``.

    Args:
      program: the model's stage programs (e.g. :class:`jax_wgrad.GPTProgram`).
      params: canonical parameters sharded as ``program.param_specs()``.
      batch: ``[global_batch_size, ...]`` (the GPT: int tokens ``[B, S + 1]``) sharded
        over the data-parallel axes.
      ddp: bucket options (its ``use_distributed_optimizer`` is ignored: the buckets are
        all-reduced so that every rank gets the whole gradient tree).
      table: the schedule (default: ``program.parallel.pipeline_schedule``'s table).
    Returns:
      ``(grads, loss)``: fp32 gradients sharded like ``params`` and the scalar loss.
    """
    ddp = dataclasses.replace(ddp or DDPConfig(), use_distributed_optimizer=False)
    layout = grad_layout(program, ddp)
    table = table or schedule_of(program)
    sink = grad_sink(program, layout, table)
    specs = program.param_specs()

    def body(p, t):
        synced, loss, _ = reduce_gradients(program, sink, ddp, table, program.device_tree(p), t)
        return program.canonical_tree(layout.buffer.to_tree(synced)), loss

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, P(DATA_PARALLEL)),
        out_specs=(specs, P()),
        # Not yet: the pipeline's loop state is not typed by mesh axes (the layer scan's
        # activation carry; pinned by tests/test_check_vma.py).
        check_vma=False,
    )
    return fn(params, batch)
