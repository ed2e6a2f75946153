"""The per-run plan: everything a run's steps share, built once (:class:`TrainPlan`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.grads.sink import GradSink
from jax_wgrad.layout.program import StageModel, lay_out
from jax_wgrad.ops import require_fusion
from jax_wgrad.ops.handlers import load_error
from jax_wgrad.optim.distributed import DistributedOptimizer
from jax_wgrad.optim.memory import BytesPerParameter, bytes_per_parameter
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL, PIPELINE, TENSOR, mesh_shape
from jax_wgrad.parallel.pipeline.gradients import grad_layout, grad_sink, schedule_of
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.schedules import ScheduleTable

__all__ = ["ModelConfig", "TrainPlan", "mesh_shape"]


@runtime_checkable
class ModelConfig(Protocol):
    """What a plan needs of a model's config (:class:`~jax_wgrad.GPTConfig` is one): a
    frozen dataclass (its fields are what a checkpoint compares) that checks itself
    against a parallel layout, builds its stage programs and names the fields on which a
    checkpoint's parameters would not fit it."""

    def validate(self, parallel: ParallelConfig) -> None:
        """Raises ``ValueError`` if the layout does not divide the model."""

    def program(
        self, parallel: ParallelConfig, platform: str | None = None
    ) -> StageModel | StageProgram:
        """The model's stage functions for ``parallel`` on ``platform``: a
        :class:`~jax_wgrad.layout.program.StageModel` (its NNX modules and ``pre`` /
        ``body`` / ``post``; the library lays it out), or a whole :class:`StageProgram`
        that lays out its own parameters."""

    def shape_differences(self, saved: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """``(field, saved, this)`` for every field that fixes the parameters' shapes on
        which ``saved`` (a checkpoint's ``dataclasses.asdict`` of its model config) and
        this config disagree; ``[]`` if the checkpoint's parameters fit this model (what
        :mod:`~jax_wgrad.training.checkpoint` checks before loading them)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TrainPlan:
    """One run's static plan, built once by :meth:`create` and handed to
    :func:`~jax_wgrad.training.init_train_state`, :func:`~jax_wgrad.training.build_train_step`
    and whoever logs it (the example's gradient-buffer line).

    Attributes:
      model, parallel, ddp: the three configs (validated against each other); ``model``
        is any :class:`ModelConfig`.
      mesh: the ``(data, expert, context, tensor, pipeline)`` mesh.
      program: the model's stage program for this layout and platform (a
        :class:`~jax_wgrad.layout.program.StageModel` laid out by
        :func:`~jax_wgrad.layout.lay_out`).
      layout: where every device's gradients live (flat buckets per chunk).
      sink: where each weight gradient goes during the schedule.
      optimizer: the distributed (or replicated) optimizer over those buckets.
      table: the pipeline schedule.
    """

    model: ModelConfig
    parallel: ParallelConfig
    ddp: DDPConfig
    mesh: Mesh
    program: StageProgram
    layout: GradLayout
    sink: GradSink
    optimizer: DistributedOptimizer
    table: ScheduleTable

    @classmethod
    def create(
        cls,
        model: ModelConfig,
        parallel: ParallelConfig,
        mesh: Mesh,
        tx: optax.GradientTransformation,
        *,
        ddp: DDPConfig | None = None,
        check_fusion: bool = True,
    ) -> TrainPlan:
        """Validates the configs against each other and the mesh, and builds the plan.

        Args:
          tx: the optax transformation (element-wise; :func:`default_optimizer` is
            Megatron's AdamW with its weight-decay mask).
          check_fusion: with ``gradient_accumulation_fusion``, prove the fused handlers
            of the op families the model's layers call (its program's
            ``fused_op_families``: a dense model's, plus an MoE model's expert GEMMs) work
            by test calls on the mesh's platform
            (:func:`~jax_wgrad.ops.require_fusion`). ``False`` when only compiling
            (:mod:`jax_wgrad.aot`: nothing can run): then only the handler's being
            built and registered -- what the lowering needs -- is required.
        Raises:
          ValueError: a layout that does not divide the model, or a mesh that is not
            ``parallel``'s; RuntimeError: fusion asked for on a platform without
            working handlers for one of those op families (Megatron's wording, naming
            the family), or, with ``check_fusion=False``, without a loaded one.
        """
        ddp = ddp or DDPConfig()
        model.validate(parallel)
        if parallel.mesh_shape != mesh_shape(mesh):
            raise ValueError(
                f"TrainPlan: mesh (data, expert, context, tensor, pipeline) = "
                f"{mesh_shape(mesh)} "
                f"does not match the parallel config's {parallel.mesh_shape}"
            )
        platform = mesh.devices.flat[0].platform
        fusion = parallel.gradient_accumulation_fusion
        if fusion and not check_fusion and load_error(platform) is not None:
            raise RuntimeError(
                f"gradient_accumulation_fusion: the fused path cannot be "
                f"lowered for platform '{platform}': {load_error(platform)}"
            )
        program = lay_out(model.program(parallel, platform))
        if fusion and check_fusion:  # the op families the program's layers call
            require_fusion(
                platform, who="gradient_accumulation_fusion", families=program.fused_op_families
            )
        layout = grad_layout(program, ddp)
        optimizer = DistributedOptimizer.create(
            layout.buffer,
            tx,
            data_axis=DATA_CONTEXT_PARALLEL,
            bucket_axes=layout.bucket_axes,
            model_axes=(TENSOR, PIPELINE),
            clip_grad=ddp.clip_grad or None,
            weight_decay_mask=layout.weight_decay_flags(),
            duplicated={TENSOR: layout.tensor_replicated(), PIPELINE: layout.shared_flags()},
            store_param_remainders=ddp.use_precision_aware_optimizer and ddp.store_param_remainders,
        )
        table = schedule_of(program)
        return cls(
            model,
            parallel,
            ddp,
            mesh,
            program,
            layout,
            grad_sink(program, layout, table),
            optimizer,
            table,
        )

    @property
    def param_shardings(self) -> dict[str, Any]:
        """``NamedSharding`` of every canonical parameter on the mesh."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.program.param_specs(),
            is_leaf=lambda x: isinstance(x, P),
        )

    def bytes_per_parameter(self) -> BytesPerParameter:
        """One device's training state per parameter by category (params, gradient
        buckets, optimizer) beside Megatron's formula:
        :func:`jax_wgrad.optim.bytes_per_parameter` of the plan's optimizer."""
        return bytes_per_parameter(self.optimizer)

    def buffer_summary(self) -> str:
        """Two lines: the gradient buffer of pipeline stage 0 (buckets, padding), and one
        device's bytes per parameter by category beside Megatron's figure
        (:meth:`bytes_per_parameter`)."""
        buf, lay = self.layout.buffer, self.layout
        padding = (buf.numel - buf.param_numel) / buf.numel
        return (
            f"gradient buffer of pipeline stage 0: {buf.num_buckets} bucket(s) "
            f"({lay.stage.num_buckets} stage + "
            + (f"{lay.experts.num_buckets} expert + " if lay.experts.num_buckets else "")
            + f"{lay.shared.num_buckets} embedding/head), "
            f"{buf.param_numel:,} gradient elements, {buf.numel:,} buffer elements, "
            f"padding {100 * padding:.2f}%\n" + self.bytes_per_parameter().summary()
        )
