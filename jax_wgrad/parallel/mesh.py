"""The ``('data', 'expert', 'context', 'tensor', 'pipeline')`` device mesh and its axis names.

This module is the ONLY place the mesh axis names are spelled: every other module uses
:data:`DATA`, :data:`EXPERT`, :data:`CONTEXT`, :data:`TENSOR`, :data:`PIPELINE` (or
:data:`AXES`, all of them in mesh order) and the groups built from them:
:data:`DATA_PARALLEL` (Megatron's data-parallel group: ``data x expert``, over which the
batch is split), :data:`DATA_CONTEXT_PARALLEL` (Megatron's data-parallel group *with context
parallelism*: ``data x expert x context``, over which dense gradients are synced, the
optimizer state sharded and the tokens counted) and :data:`EXPERT_DATA_PARALLEL`
(Megatron's expert-data-parallel group, with the context ranks: expert gradients are
synced over it). Expert parallelism is carved out of data parallelism, as in Megatron:
``dp = edp * EP``. With ``EP = 1`` the ``expert`` axis has size 1, with ``CP = 1`` the
``context`` axis, and every collective over them is the same as without them.

**Device order: Megatron's ranks.** :func:`make_mesh` lays the devices out in
Megatron-LM's default rank order (``--rank-order tp-cp-ep-dp-pp``): consecutive devices
(``jax.devices()`` lists a host's GPUs together) form a tensor-parallel group, then the
context, expert, data and pipeline ranks follow, pipeline slowest. So tensor parallelism -- the most
frequent and latency-bound collectives -- stays inside a host's NVLink domain whenever
``TP`` divides the GPUs per host, and the pipeline's point-to-point sends are what crosses
hosts. (A plain reshape in axis order would make the pipeline axis fastest: with TP 8 and
PP 4 on hosts of 8 GPUs each tensor group would span four hosts.) Multi-process runs call
:func:`initialize_distributed` first (it wraps :func:`jax.distributed.initialize`); the
mesh then spans ``jax.devices()`` of all processes. :func:`use_virtual_cpu_devices` gives
one host several CPU devices (tests, the CPU example).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jax_wgrad.parallel.config import ParallelConfig

__all__ = [
    "AXES",
    "DATA",
    "EXPERT",
    "CONTEXT",
    "TENSOR",
    "PIPELINE",
    "DATA_PARALLEL",
    "DATA_CONTEXT_PARALLEL",
    "EXPERT_DATA_PARALLEL",
    "expert_parallel_axes",
    "make_mesh",
    "initialize_distributed",
    "use_virtual_cpu_devices",
    "local_shape",
    "axis_sizes",
    "mesh_shape",
]

DATA = "data"
"""Expert-data-parallel axis (``dp / EP`` replicas of every parameter, experts included);
the whole data parallelism when ``EP = 1``."""
EXPERT = "expert"
"""Expert-parallel axis (Megatron EP): carved out of data parallelism, each index holds its
own tokens and ``E / EP`` experts of every Mixture-of-Experts layer
(:func:`jax_wgrad.functional.moe_mlp`); dense parameters are replicated over it. With
parallel folding the expert-parallel group is ``(expert, tensor)`` and this axis has
``EP / tp`` ranks (:func:`expert_parallel_axes`)."""
CONTEXT = "context"
"""Context-parallel axis (Megatron CP): each index holds two load-balanced chunks of every
sequence (:mod:`jax_wgrad.functional.context_parallel`); parameters are replicated over
it."""
TENSOR = "tensor"
"""Tensor-parallel axis: a layer's weights split over it (Megatron TP, and SP)."""
PIPELINE = "pipeline"
"""Pipeline axis: one stage of transformer layers per index."""
AXES: tuple[str, str, str, str, str] = (DATA, EXPERT, CONTEXT, TENSOR, PIPELINE)
"""All mesh axes, in mesh order (per-device state is stacked over all of them)."""
DATA_PARALLEL: tuple[str, str] = (DATA, EXPERT)
"""Megatron's data-parallel group (``dp`` ranks): the batch is split over it."""
DATA_CONTEXT_PARALLEL: tuple[str, str, str] = (DATA, EXPERT, CONTEXT)
"""Megatron's data-parallel group with context parallelism (``dp cp`` ranks): dense
gradients are synced over it, the distributed optimizer shards over it and the loss
counts its tokens over it (each context rank holds ``1 / cp`` of every sequence)."""
EXPERT_DATA_PARALLEL: tuple[str, str] = (DATA, CONTEXT)
"""Megatron's expert-data-parallel group (``dp cp / EP`` ranks): expert gradients are
synced over it (the experts differ along :data:`EXPERT`)."""


def expert_parallel_axes(ep: int, folded: bool) -> str | tuple[str, str] | None:
    """The mesh axes of the expert-parallel group of ``ep`` ranks: ``None`` for one rank,
    :data:`EXPERT`, or ``(EXPERT, TENSOR)`` with Megatron's MoE parallel folding
    (:attr:`~jax_wgrad.parallel.ParallelConfig.folds_experts`: expert rank ``expert_index
    * tp + tensor_index``, the order of the experts' ``PartitionSpec`` on their first
    dim)."""
    if ep == 1:
        return None
    return (EXPERT, TENSOR) if folded else EXPERT


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
            raise ValueError(
                f"use_virtual_cpu_devices({count}): jax already runs with {have} "
                "CPU devices; call it before the first jax computation"
            ) from exc


def axis_sizes(config: ParallelConfig) -> dict[str, int]:
    """``{axis name: size}`` of ``config``'s mesh (its :attr:`~ParallelConfig.mesh_shape`,
    named by :data:`AXES`)."""
    return dict(zip(AXES, config.mesh_shape))


def mesh_shape(mesh: Mesh) -> tuple[int, int, int, int, int]:
    """``(data, expert, context, tensor, pipeline)`` sizes of a built ``mesh`` (to compare with
    :attr:`ParallelConfig.mesh_shape`)."""
    return tuple(int(mesh.shape[a]) for a in AXES)  # type: ignore[return-value]


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
        k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    )
    if not kwargs and not env_hint:
        return False
    jax.distributed.initialize(**kwargs)
    return True


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ``(data, expert, context, tensor, pipeline)`` mesh of ``config.mesh_shape``.

    Args:
      config: the layout; its ``world_size`` must equal the number of devices.
      devices: defaults to ``jax.devices()`` (all processes).
    Returns:
      A :class:`jax.sharding.Mesh` with ``Auto`` axis types, usable by ``jax.jit`` and
      ``jax.shard_map``; ``devices[t + TP * (c + CP * (e + EP * (d + DP * p)))]`` at mesh
      position ``(d, e, c, t, p)`` (Megatron's rank order, module docstring).
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != config.world_size:
        raise ValueError(
            f"ParallelConfig.world_size ({config.world_size}) does not match the "
            f"{len(devices)} devices given"
        )
    data, expert, context, tensor, pipeline = config.mesh_shape
    # rank = t + TP * (c + CP * (e + EP * (d + DP * p))): Megatron's tp-cp-ep-dp-pp order
    ranks = np.empty(len(devices), dtype=object)
    ranks[:] = devices
    grid = ranks.reshape(pipeline, data, expert, context, tensor).transpose(1, 2, 3, 4, 0)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
