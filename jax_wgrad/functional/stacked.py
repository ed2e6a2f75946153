"""Layers with stacked parameters as ONE ``lax.scan``, their fused weight gradients still
accumulated in place into their bucket blocks (:func:`scan_layers`).

A stage's ``n`` layers of the same structure hold each parameter stacked, ``[n, ...]``;
in a gradient bucket a stacked weight ``[n, out, in]`` is one contiguous region, layer
``i``'s block at ``offset + i * out * in``. A ``lax.scan`` traces the layer once, so its
compile time does not grow with ``n`` (``unroll`` trades it back for straight-line code);
the weight-gradient slots handed to the layer are rebuilt per iteration:

* a :class:`~jax_wgrad.functional.BucketSlot` of a stacked weight becomes the slot of
  layer ``i``'s block, at the TRACED position ``BlockOffset(offset, i, size)`` (the fused
  op's traced-offset form, exact in 64 bits at any bucket size), and the buckets it writes ride in the scan's carry -- so the scan's
  backward carries their cotangent and each iteration adds its layer's block in place;
* a :class:`~jax_wgrad.functional.SplitSlot` (zero bubble) of a stacked weight takes its
  probe ``[n, ...]`` as a scan input and records the layer inputs as a scan output
  ``[n, ...]``: the ``W`` task's pair is then the stacked ``(x, dy)``, one grouped fused
  call (:func:`jax_wgrad.ops.grouped_wgrad_accumulate`: ``n`` blocks back to back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.functional.linear import BucketSlot, SplitSlot, WgradBuckets, WgradSplit
from jax_wgrad.ops.position import advance

__all__ = ["scan_layers"]

PyTree = Any


def _is_slot(x) -> bool:
    return x is None or isinstance(x, (BucketSlot, SplitSlot))


def scan_layers(layer: Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]],
                x: jax.Array, params: PyTree, main_grads: PyTree | None, *,
                unroll: int = 1, rows: tuple[Any, int] | None = None) -> tuple[jax.Array, PyTree]:
    """``for i in range(n): x, aux_i = layer(params[i], main_grads[i], x)`` as a scan.

    Args:
      layer: ``(params of one layer, its main grads or None, x) -> (x, aux)``.
      x: the first layer's input (the scan carry).
      params: the layers' parameters, every leaf stacked ``[n, ...]``.
      main_grads: ``None``, or a tree shaped like ``params`` with a slot (``BucketSlot`` /
        ``SplitSlot`` of the STACKED weight: its bucket block, its probe ``[k, ...]`` for
        the ``k`` layers run) or ``None`` at each leaf.
      unroll: layers per iteration of the loop (``lax.scan``'s ``unroll``); ``n``: no loop
        (straight-line code, the offsets constant; compile time grows with ``n``).
      rows: ``(start, k)``: run only layers ``start .. start + k - 1`` (``start`` may be
        traced: a model chunk of an interleaved stage), read from the full stacks inside
        the loop (no copy of the chunk's weights); default: all ``n``.
    Returns:
      ``(x after the layers, aux stacked [k, ...])``. The threaded buckets and the
      split records of the slots' owners are updated as if each layer had been called.
    """
    leaves, treedef = jax.tree.flatten(params)
    n = leaves[0].shape[0]
    if any(a.shape[:1] != (n,) for a in leaves):
        raise ValueError(f"scan_layers: every parameter must be stacked [n, ...] with one n; "
                         f"got {[tuple(a.shape) for a in leaves]}")
    start, count = (jnp.int32(0), n) if rows is None else (jnp.asarray(rows[0], jnp.int32),
                                                            rows[1])
    if rows is not None and not 0 < count <= n:
        raise ValueError(f"scan_layers: rows {rows!r} outside the {n} stacked layers")
    take = (lambda p, i: p) if rows is None else (
        lambda p, i: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, start + i, 0, False),
                                  params))
    xs_params = params if rows is None else None
    if main_grads is None:
        def plain(h, xs):
            p, i = xs
            return layer(take(p, i), None, h)
        return lax.scan(plain, x, (xs_params, jnp.arange(count, dtype=jnp.int32)),
                        unroll=min(unroll, count))

    slots = treedef.flatten_up_to(jax.tree.map(lambda s: s, main_grads, is_leaf=_is_slot))
    # Threaded buckets: one carry entry per (owner, bucket) a BucketSlot writes.
    owners: dict[int, WgradBuckets] = {}
    threaded: list[tuple[int, int]] = []
    for s in slots:
        if isinstance(s, BucketSlot):
            owners.setdefault(id(s.owner), s.owner)
            if (id(s.owner), s.bucket) not in threaded:
                threaded.append((id(s.owner), s.bucket))
    split = [(k, s) for k, s in enumerate(slots) if isinstance(s, SplitSlot)]
    probes = [s.owner._probes[s.index] for _, s in split]

    def step(carry, xs):
        h, bks = carry
        p, i, probe = xs
        inner = WgradBuckets(bks)
        ws = WgradSplit(probe)
        per_layer = list(slots)
        for k, s in enumerate(slots):
            if isinstance(s, BucketSlot):
                size = math.prod(leaves[k].shape[1:])
                offset = advance(s.offset, start + i, size)
                per_layer[k] = inner.slot(threaded.index((id(s.owner), s.bucket)), offset)
        for j, (k, _) in enumerate(split):
            per_layer[k] = ws.slot(j)
        h, aux = layer(take(p, i), jax.tree.unflatten(treedef, per_layer), h)
        return (h, inner.buckets), (aux, ws.inputs, ws.outputs)

    bks0 = tuple(owners[o]._buckets[b] for o, b in threaded)
    xs = (xs_params, jnp.arange(count, dtype=jnp.int32), probes)
    (y, bks), (aux, inputs, outputs) = lax.scan(step, (x, bks0), xs,
                                                unroll=min(unroll, count))
    for (o, b), bk in zip(threaded, bks):
        owners[o]._buckets[b] = bk
    for j, (_, s) in enumerate(split):
        s.owner.inputs[s.index], s.owner.outputs[s.index] = inputs[j], outputs[j]
    return y, aux
