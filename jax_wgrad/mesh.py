"""The ``('data', 'tensor', 'pipeline')`` device mesh.

Built with :func:`jax.make_mesh`, which picks a topology-aware device order on GPU/TPU
and the plain device order on CPU. Multi-process runs call
:func:`initialize_distributed` first (it wraps :func:`jax.distributed.initialize`); the
mesh then spans ``jax.devices()`` of all processes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jax_wgrad.config import ParallelConfig

__all__ = ["AXES", "DATA", "TENSOR", "PIPELINE", "make_mesh", "initialize_distributed"]

DATA = "data"
TENSOR = "tensor"
PIPELINE = "pipeline"
AXES: tuple[str, str, str] = (DATA, TENSOR, PIPELINE)


def initialize_distributed(**kwargs) -> bool:
    """Calls :func:`jax.distributed.initialize` when this is a multi-process launch.

    A launch counts as multi-process when keyword arguments are given or a cluster
    environment jax recognises is present (``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI,
    ...). Returns whether it initialised. Call it before anything touches devices.
    """
    env_hint = any(
        k in os.environ
        for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    )
    if not kwargs and not env_hint:
        return False
    jax.distributed.initialize(**kwargs)
    return True


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ``(data, tensor, pipeline)`` mesh of ``config.mesh_shape``.

    Args:
      config: the layout; its ``world_size`` must equal the number of devices.
      devices: defaults to ``jax.devices()`` (all processes).
    Returns:
      A :class:`jax.sharding.Mesh` with ``Auto`` axis types, usable by ``jax.jit`` and
      ``jax.shard_map``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != config.world_size:
        raise ValueError(
            f"ParallelConfig.world_size ({config.world_size}) does not match the "
            f"{len(devices)} devices given"
        )
    return jax.make_mesh(
        config.mesh_shape,
        AXES,
        axis_types=(AxisType.Auto,) * len(AXES),
        devices=devices,
    )
