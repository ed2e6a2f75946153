"""Parameters laid out for virtual pipeline stages (Megatron's interleaved schedule).

With ``V`` model chunks per stage, stage ``s`` holds virtual stages ``s, P + s, ...,
(V - 1) P + s``: the layers ``(v P + s) L / (P V) ...`` -- not a contiguous range of the
canonical ``[L, ...]`` layer stacks, so no sharding of ``[L, ...]`` puts them on it. The
*layout* of such a model reshapes every leaf split over ``pipeline`` on its first dim to
``[V, L / V, ...]``, split over ``pipeline`` on the second: stage ``s`` then holds
``[V, L / (P V), ...]``, row ``v`` its chunk ``v``, exactly Megatron's assignment. Inside
``shard_map`` the per-device ``[V, L / (P V), ...]`` is flattened to the
``[L / P, ...]`` stack the model's device tree reads (chunk ``v``: rows ``v L / (P V)
...``, a :class:`~jax_wgrad.grads.chunks.Window`). With ``V = 1`` every function here is
the identity. Checkpoints and Hugging Face files hold the canonical form
(:func:`to_canonical`); the train state and the step hold the layout
(:func:`from_canonical`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jax_wgrad.parallel.mesh import PIPELINE

__all__ = ["from_canonical", "layout_specs", "local_stack", "local_chunks", "to_canonical"]

PyTree = Any


def _stacked(spec) -> bool:
    return isinstance(spec, P) and len(spec) > 0 and spec[0] == PIPELINE


def _reshape(a, *shape: int):
    if isinstance(a, jax.ShapeDtypeStruct):  # shapes only (layouts are planned from these)
        return jax.ShapeDtypeStruct(shape, a.dtype)
    return a.reshape(shape)


def _map(fn, tree: PyTree, specs: PyTree) -> PyTree:
    return jax.tree.map(
        lambda a, s: fn(a) if _stacked(s) else a, tree, specs, is_leaf=lambda x: isinstance(x, P)
    )


def layout_specs(specs: PyTree, num_chunks: int) -> PyTree:
    """The layout's ``PartitionSpec``\\ s from the canonical ones (module docstring)."""
    if num_chunks == 1:
        return specs
    return jax.tree.map(
        lambda s: P(None, *s) if _stacked(s) else s, specs, is_leaf=lambda x: isinstance(x, P)
    )


def from_canonical(params: PyTree, specs: PyTree, num_chunks: int) -> PyTree:
    """Canonical (global) parameters -> the layout; ``specs``: the canonical specs."""
    if num_chunks == 1:
        return params

    def split(a):
        if a.shape[0] % num_chunks:
            raise ValueError(
                f"a stack of {a.shape[0]} layers does not split into {num_chunks} model chunks"
            )
        return _reshape(a, num_chunks, a.shape[0] // num_chunks, *a.shape[1:])

    return _map(split, params, specs)


def to_canonical(params: PyTree, specs: PyTree, num_chunks: int) -> PyTree:
    """Inverse of :func:`from_canonical`."""
    if num_chunks == 1:
        return params
    return _map(lambda a: _reshape(a, a.shape[0] * a.shape[1], *a.shape[2:]), params, specs)


def local_stack(params: PyTree, specs: PyTree, num_chunks: int) -> PyTree:
    """One device's layout parameters ``[V, L / (P V), ...]`` -> its ``[L / P, ...]``
    stacks, chunk-major (inside ``shard_map``)."""
    return to_canonical(params, specs, num_chunks)


def local_chunks(params: PyTree, specs: PyTree, num_chunks: int) -> PyTree:
    """Inverse of :func:`local_stack`."""
    return (
        _map(
            lambda a: _reshape(a, num_chunks, a.shape[0] // num_chunks, *a.shape[1:]), params, specs
        )
        if num_chunks > 1
        else params
    )
