"""The per-run plan: everything a run's steps share, built once (:class:`TrainPlan`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.models.gpt.config import GPTConfig, validate
from jax_wgrad.models.gpt.stages import GPTStages
from jax_wgrad.ops import require_fusion
from jax_wgrad.ops.registry import load_error
from jax_wgrad.optim.distributed import DistributedOptimizer
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import DATA_PARALLEL, PIPELINE, TENSOR, mesh_shape
from jax_wgrad.parallel.pipeline.gradients import grad_layout, schedule_of
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable

__all__ = ["TrainPlan", "mesh_shape"]


@dataclasses.dataclass(frozen=True, eq=False)
class TrainPlan:
    """One run's static plan, built once by :meth:`create` and handed to
    :func:`~jax_wgrad.training.init_train_state`, :func:`~jax_wgrad.training.build_train_step`
    and whoever logs it (the example's gradient-buffer line).

    Attributes:
      model, parallel, ddp: the three configs (validated against each other).
      mesh: the ``(data, expert, tensor, pipeline)`` mesh.
      stages: the model's per-stage functions for this layout and platform.
      layout: where every device's gradients live (flat buckets per chunk).
      optimizer: the distributed (or replicated) optimizer over those buckets.
      table: the pipeline schedule.
    """

    model: GPTConfig
    parallel: ParallelConfig
    ddp: DDPConfig
    mesh: Mesh
    stages: GPTStages
    layout: GradLayout
    optimizer: DistributedOptimizer
    table: ScheduleTable

    @classmethod
    def create(cls, model: GPTConfig, parallel: ParallelConfig, mesh: Mesh,
               tx: optax.GradientTransformation, *, ddp: DDPConfig | None = None,
               check_fusion: bool = True) -> TrainPlan:
        """Validates the configs against each other and the mesh, and builds the plan.

        Args:
          tx: the optax transformation (element-wise; :func:`default_optimizer` is
            Megatron's AdamW with its weight-decay mask).
          check_fusion: with ``gradient_accumulation_fusion``, prove the fused handler
            works by running a test call on the mesh's platform
            (:func:`~jax_wgrad.ops.require_fusion`). ``False`` when only compiling
            (:mod:`jax_wgrad.aot`: nothing can run): then only the handler's being
            built and registered -- what the lowering needs -- is required.
        Raises:
          ValueError: a layout that does not divide the model, or a mesh that is not
            ``parallel``'s; RuntimeError: fusion asked for on a platform without a
            working handler (Megatron's wording), or, with ``check_fusion=False``,
            without a loaded one.
        """
        ddp = ddp or DDPConfig()
        validate(parallel, model)
        if parallel.mesh_shape != mesh_shape(mesh):
            raise ValueError(f"TrainPlan: mesh (data, expert, tensor, pipeline) = "
                             f"{mesh_shape(mesh)} "
                             f"does not match the parallel config's {parallel.mesh_shape}")
        platform = mesh.devices.flat[0].platform
        if parallel.gradient_accumulation_fusion and check_fusion:
            require_fusion(platform, who="gradient_accumulation_fusion")
        elif parallel.gradient_accumulation_fusion and load_error(platform) is not None:
            raise RuntimeError(f"gradient_accumulation_fusion: the fused path cannot be "
                               f"lowered for platform '{platform}': {load_error(platform)}")
        stages = GPTStages(model, parallel, platform=platform)
        layout = grad_layout(stages, ddp)
        optimizer = DistributedOptimizer.create(
            layout.buffer, tx, data_axis=DATA_PARALLEL, bucket_axes=layout.bucket_axes,
            model_axes=(TENSOR, PIPELINE),
            clip_grad=ddp.clip_grad or None, weight_decay_mask=layout.weight_decay_flags(),
            duplicated={TENSOR: layout.tensor_replicated(), PIPELINE: layout.shared_flags()})
        return cls(model, parallel, ddp, mesh, stages, layout, optimizer, schedule_of(stages))

    @property
    def param_shardings(self) -> dict[str, Any]:
        """``NamedSharding`` of every canonical parameter on the mesh."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.stages.param_specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def buffer_summary(self) -> str:
        """One line: the gradient buffer of pipeline stage 0 (buckets, padding)."""
        buf, lay = self.layout.buffer, self.layout
        padding = (buf.numel - buf.param_numel) / buf.numel
        return (f"gradient buffer of pipeline stage 0: {buf.num_buckets} bucket(s) "
                f"({lay.stage.num_buckets} stage + "
                + (f"{lay.experts.num_buckets} expert + " if lay.experts.num_buckets else "")
                + f"{lay.shared.num_buckets} embedding/head), "
                f"{buf.param_numel:,} gradient elements, {buf.numel:,} buffer elements, "
                f"padding {100 * padding:.2f}%")
