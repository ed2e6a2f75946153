"""Megatron's tensor- and sequence-parallel collectives, each paired with its conjugate.

Each is a ``custom_vjp`` pairing the forward op with its Megatron conjugate (``copy_to``
<-> all-reduce, all-gather <-> reduce-scatter, ...). Autodiff therefore never has to
transpose a raw collective, and the layers behave identically with ``check_vma`` on or
off. Call them inside ``jax.shard_map``; ``axis_name`` is the tensor axis
(:data:`jax_wgrad.parallel.TENSOR`). Activations are ``[batch, seq, hidden]``.
"""

from __future__ import annotations

import functools

import jax

__all__ = [
    "SEQ_DIM",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_last_dim",
    "all_gather_tiled",
    "reduce_scatter_tiled",
]

SEQ_DIM = 1
"""Sequence dim of ``[batch, seq, hidden]`` activations."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tensor_parallel_region(x: jax.Array, axis_name: str) -> jax.Array:
    """Identity forward, all-reduce (sum) of the gradient over ``axis_name``."""
    return x


def _copy_fwd(x, axis_name):
    return x, None


def _copy_bwd(axis_name, _, g):
    return (jax.lax.psum(g, axis_name),)


copy_to_tensor_parallel_region.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tensor_parallel_region(x: jax.Array, axis_name: str) -> jax.Array:
    """All-reduce (sum) forward over ``axis_name``, identity backward."""
    return jax.lax.psum(x, axis_name)


def _reduce_fwd(x, axis_name):
    return jax.lax.psum(x, axis_name), None


def _reduce_bwd(axis_name, _, g):
    return (g,)


reduce_from_tensor_parallel_region.defvjp(_reduce_fwd, _reduce_bwd)


def all_gather_tiled(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
    """The tensor-parallel all-gather along ``dim`` (the shards concatenated), no custom
    gradient: the region functions below and the fused column-parallel backward
    (:mod:`jax_wgrad.functional.linear`) use it."""
    return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)


def reduce_scatter_tiled(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
    """The tensor-parallel reduce-scatter along ``dim`` (each rank keeps its summed
    shard), no custom gradient."""
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)


def _split(x, axis_name, dim):
    n = jax.lax.axis_size(axis_name)
    size = x.shape[dim] // n
    start = jax.lax.axis_index(axis_name) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_from_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """All-gather along ``dim`` forward, reduce-scatter backward."""
    return all_gather_tiled(x, axis_name, dim)


gather_from_sequence_parallel_region.defvjp(
    lambda x, a, d: (all_gather_tiled(x, a, d), None),
    lambda a, d, _, g: (reduce_scatter_tiled(g, a, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_scatter_to_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """Reduce-scatter along ``dim`` forward, all-gather backward."""
    return reduce_scatter_tiled(x, axis_name, dim)


reduce_scatter_to_sequence_parallel_region.defvjp(
    lambda x, a, d: (reduce_scatter_tiled(x, a, d), None),
    lambda a, d, _, g: (all_gather_tiled(g, a, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def scatter_to_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """Keeps this rank's chunk of ``dim`` forward, all-gather backward."""
    return _split(x, axis_name, dim)


scatter_to_sequence_parallel_region.defvjp(
    lambda x, a, d: (_split(x, a, d), None),
    lambda a, d, _, g: (all_gather_tiled(g, a, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_last_dim(x, axis_name):
    """All-gather along the last dim forward (Megatron's ``gather_output``), keep this
    rank's chunk backward."""
    return all_gather_tiled(x, axis_name, x.ndim - 1)


gather_last_dim.defvjp(
    lambda x, a: (all_gather_tiled(x, a, x.ndim - 1), None),
    lambda a, _, g: (_split(g, a, g.ndim - 1),),
)
