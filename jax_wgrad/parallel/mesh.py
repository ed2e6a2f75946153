"""The ``('data', 'tensor', 'pipeline')`` device mesh and its axis names.

This module is the ONLY place the mesh axis names are spelled: every other module uses
:data:`DATA`, :data:`TENSOR`, :data:`PIPELINE` (or :data:`AXES`, all of them in mesh order).

The mesh is built with :func:`jax.make_mesh`, which picks a topology-aware device order
on GPU/TPU and the plain device order on CPU. Multi-process runs call
:func:`initialize_distributed` first (it wraps :func:`jax.distributed.initialize`); the
mesh then spans ``jax.devices()`` of all processes. :func:`use_virtual_cpu_devices` gives
one host several CPU devices (tests, the CPU example).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["AXES", "DATA", "TENSOR", "PIPELINE", "EXPERT", "make_mesh", "initialize_distributed",
           "use_virtual_cpu_devices", "local_shape"]

DATA = "data"
"""Data-parallel axis: replicas of the model, gradient buckets reduced over it."""
TENSOR = "tensor"
"""Tensor-parallel axis: a layer's weights split over it (Megatron TP, and SP)."""
PIPELINE = "pipeline"
"""Pipeline axis: one stage of transformer layers per index."""
AXES: tuple[str, str, str] = (DATA, TENSOR, PIPELINE)
"""All mesh axes, in mesh order (per-device state is stacked over all of them)."""
EXPERT = "expert"
"""Expert-parallel axis of a Mixture-of-Experts layer (:func:`jax_wgrad.functional.moe_mlp`):
carved out of data parallelism, each rank holds its own tokens and ``E / EP`` experts. Not
yet part of the GPT mesh (:data:`AXES`)."""


def use_virtual_cpu_devices(count: int) -> None:
    """Gives the CPU platform ``count`` devices on this host (multi-device code on CPU).

    Call it right after importing jax, before the first jax computation or
    ``jax.devices()``: jax reads it when it initialises its backends. Other platforms
    (a GPU) are unaffected.

    Raises:
      ValueError: if ``count`` is not a positive int, or jax's backends are already
        initialised with another CPU device count.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"use_virtual_cpu_devices: count must be a positive int, got {count!r}")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as exc:
        have = jax.device_count("cpu")
        if have != count:
            raise ValueError(f"use_virtual_cpu_devices({count}): jax already runs with {have} "
                             "CPU devices; call it before the first jax computation") from exc


def local_shape(shape: Sequence[int], spec, sizes: dict[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of global ``shape`` sharded as ``spec``
    (a ``PartitionSpec``) on a mesh of axis ``sizes``."""
    dims = list(shape)
    for d, axis in enumerate(tuple(spec)):
        if axis is not None:
            for name in (axis,) if isinstance(axis, str) else axis:
                dims[d] //= sizes[name]
    return tuple(dims)


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
