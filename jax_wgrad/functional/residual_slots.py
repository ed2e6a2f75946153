"""The layer scan's saved activations written straight into the pipeline's residual slots
(:class:`ResidualSlots`), read back from them by the backward: no copy in or out.

Under ``jax.vjp`` a ``lax.scan`` over layers saves what each iteration's backward needs
as the scan's stacked outputs ``[n, ...]``; a pipeline stage that keeps several
microbatches in flight must then copy those stacks into its slot buffers
``[slots, n, ...]`` after each forward and out of them before each backward (about 1.5 GB
each way per microbatch at Llama-3-8B TP2 PP2). Here each iteration is one
``custom_vjp`` (:func:`stashed_iteration`) that, in its forward, takes the iteration's
own pullback (``jax.vjp`` of the iteration: what its checkpoint policy saves) and writes
its arrays at ``[slot, iteration]`` of the slot buffers, which ride through the scan as
part of its carry (updated in place by XLA); in its backward it rebuilds the pullback from
``[slot, iteration]``. The buffers reach the backward as the **cotangent** of the forward's
buffer output -- the caller seeds the pullback with the buffers as they are then, after
the forward and every other microbatch's forward wrote their own slots -- the same way
the gradient buckets ride a fused linear's backward: nothing of the activations is a
residual of the scan itself.

The pipeline uses them where it keeps more than one slot, and only a layer *loop*
writes them (:func:`~jax_wgrad.functional.scan_layers`): with one slot the scan's stacked
outputs become the buffer without a copy, and a run unrolled whole stacks nothing.

What is *not* written: the iteration's weight slices (inputs of the differentiated
iteration, recognised by identity), re-read from the full stacks in the backward; a
weight is never copied per microbatch. Integer and boolean residuals (e.g. an MoE
layer's routing indices) are stored bitcast to a float type of their width, so that a
cotangent can carry them unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "ResidualSlots",
    "carrier_dtype",
    "live_index",
    "stashed_iteration",
    "stored_residuals",
]

PyTree = Any

_CARRIER = {4: jnp.float32, 2: jnp.bfloat16, 1: jnp.float8_e4m3fn}
"""A float type of each width, to store non-float residuals in (bitcast, exact)."""


def carrier_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The type a residual of ``dtype`` is stored in: itself if floating, else the float
    type of its width (``bool`` as one byte)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return dtype
    width = 1 if dtype == jnp.bool_ else dtype.itemsize
    if width not in _CARRIER:
        raise ValueError(f"ResidualSlots: cannot store a residual of type {dtype}")
    return jnp.dtype(_CARRIER[width])


def _encode(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, carrier_dtype(x.dtype))


def _decode(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    if x.dtype == dtype:
        return x
    if dtype == jnp.bool_:
        return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.bool_)
    return lax.bitcast_convert_type(x, dtype)


class ResidualSlots:
    """The slot buffers of one stage forward's layer scans (module docstring): per scan
    that :func:`~jax_wgrad.functional.scan_layers` runs (one per checkpointed group of
    layers, in order), one buffer ``[num_slots, iterations, ...]`` per array an iteration's
    backward reads.

    Two modes:

    * **recording** (:meth:`recorder`): traced once (shapes only) to learn the buffers;
      each scan gets temporary one-slot buffers and appends its layout to
      :attr:`layouts`;
    * **writing** (``ResidualSlots(buffers, slot)``): each scan takes its buffers in
      order (:meth:`take`) and puts back the updated ones (:meth:`put`); after the
      function :attr:`buffers` are the buffers to keep.

    Attributes:
      layouts: recording: per scan, what one slot of it holds: ``[iterations, ...]`` per
        stored array, in the array's own type.
      buffers: writing: per scan, its buffers.
      slot: writing: the slot (traced int32) this forward writes and its backward reads.
    """

    def __init__(self, buffers: Sequence[Sequence[jax.Array]] | None = None, slot=None):
        self.recording = buffers is None
        self.layouts: list[tuple[jax.ShapeDtypeStruct, ...]] = []
        self.buffers: list[tuple[jax.Array, ...]] = [tuple(b) for b in buffers or ()]
        self.slot = jnp.int32(0) if slot is None else slot
        self._next = 0

    @classmethod
    def recorder(cls) -> ResidualSlots:
        """Slots that record the scans' layouts (trace under ``jax.eval_shape``)."""
        return cls()

    @staticmethod
    def allocate(
        layouts: Sequence[Sequence[jax.ShapeDtypeStruct]], num_slots: int
    ) -> tuple[tuple[jax.Array, ...], ...]:
        """Fresh ``[num_slots, ...]`` buffers of recorded ``layouts`` (each in its
        :func:`carrier_dtype`), uninitialised (``lax.empty``: a slot is read only by the
        backward of the forward that wrote it)."""
        return tuple(
            tuple(lax.empty((num_slots, *s.shape), carrier_dtype(s.dtype)) for s in scan)
            for scan in layouts
        )

    def take(self, iterations: int, probe: Callable[[], Sequence[jax.Array]]) -> tuple:
        """The next scan's buffers (``iterations`` of them per slot); recording,
        ``probe()`` gives one iteration's stored arrays (traced) to lay them out."""
        if self.recording:
            layout = tuple(jax.ShapeDtypeStruct((iterations, *x.shape), x.dtype) for x in probe())
            self.layouts.append(layout)
            self.buffers.append(tuple(ResidualSlots.allocate([layout], 1)[0]))
        if self._next >= len(self.buffers):
            raise ValueError(
                f"ResidualSlots: the forward runs more layer scans than the "
                f"{len(self.buffers)} it was laid out for"
            )
        self._next += 1
        return self.buffers[self._next - 1]

    def put(self, buffers: Sequence[jax.Array]) -> None:
        """The buffers of the scan :meth:`take` last gave, as its forward left them."""
        self.buffers[self._next - 1] = tuple(buffers)


Iteration = Callable[[Sequence[jax.Array], PyTree, jax.Array], PyTree]
"""``(weight slices, state, index) -> output``: one iteration of a layer scan, its weight
slices (arrays) and its state (carry and scanned inputs) differentiated."""


def stashed_iteration(
    body: Iteration,
    reslice: Callable[[Sequence[jax.Array], jax.Array], Sequence[jax.Array]],
    stacks: Sequence[jax.Array],
    slices: Sequence[jax.Array],
    state: PyTree,
    buffers: tuple[jax.Array, ...],
    index: jax.Array,
    it: jax.Array,
    slot: jax.Array,
) -> tuple[PyTree, tuple[jax.Array, ...]]:
    """``body(slices, state, index)``, its pullback's arrays written at ``[slot, it]`` of
    ``buffers`` (module docstring): ``(output, buffers)``.

    Args:
      body: the iteration (:data:`Iteration`); differentiated in ``slices`` and ``state``.
      reslice: ``(stacks, index) -> slices``: how ``slices`` were read from ``stacks``
        (the backward reads them again instead of storing them).
      stacks: the full weight stacks (no gradient flows to them through here: it flows
        through ``slices``, read from them outside).
      slices: the iteration's weight slices, ``reslice(stacks, index)``.
      state: what else the iteration reads (carry, scanned inputs), differentiated.
      buffers: the scan's slot buffers ``[slots, iterations, ...]``
        (:meth:`ResidualSlots.take`).
      index: a pytree of int32 scalars, what ``reslice`` and ``body`` read (e.g. the
        first layer's index).
      it: int32, the iteration's row of ``buffers``.
      slot: int32, the slot.
    """
    return _stashed(body, reslice, _Layout(), stacks, slices, state, buffers, index, it, slot)


class _Layout:
    """The pullback's structure learned by the forward trace, read by the backward's
    (static: the same for every iteration and microbatch)."""

    treedef: Any = None
    live: tuple[int | None, ...] = ()
    dtypes: tuple[jnp.dtype, ...] = ()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _stashed(body, reslice, layout, stacks, slices, state, buffers, index, it, slot):
    return body(slices, state, index), buffers


def live_index(leaves: Sequence[Any], live: PyTree) -> list[int | None]:
    """Per pullback leaf, its index in ``jax.tree.leaves(live)`` when it is one of those
    arrays (the same object: an input the backward can read again instead of storing
    it), else ``None`` (to store)."""
    ids = {id(x): i for i, x in enumerate(jax.tree.leaves(live))}
    return [ids.get(id(x)) for x in leaves]


def stored_residuals(
    body: Iteration, slices: Sequence[jax.Array], state: PyTree, index: PyTree
) -> list[jax.Array]:
    """The arrays of ``body``'s pullback that :func:`stashed_iteration` writes (traced:
    what :meth:`ResidualSlots.take` lays out when recording)."""
    return _trace(_Layout(), body, slices, state, index)[1]


def _trace(layout: _Layout, body, slices, state, index):
    """``body``'s output and the arrays of its pullback to store; fills ``layout``."""
    out, pullback = jax.vjp(lambda s, st: body(s, st, index), slices, state)
    leaves, layout.treedef = jax.tree.flatten(pullback)
    layout.live = tuple(live_index(leaves, slices))
    stored = [x for x, k in zip(leaves, layout.live) if k is None]
    layout.dtypes = tuple(x.dtype for x in stored)
    return out, stored


def _stashed_fwd(body, reslice, layout, stacks, slices, state, buffers, index, it, slot):
    out, stored = _trace(layout, body, slices, state, index)
    if len(stored) != len(buffers) or any(
        b.shape[2:] != x.shape or b.dtype != carrier_dtype(x.dtype) for b, x in zip(buffers, stored)
    ):
        raise ValueError(
            "ResidualSlots: the iteration's residuals "
            f"{[(x.shape, x.dtype) for x in stored]} differ from the slots laid out for it "
            f"{[(b.shape[2:], b.dtype) for b in buffers]}"
        )
    new = tuple(
        lax.dynamic_update_slice(b, _encode(x)[None, None], (slot, it, *(0,) * x.ndim))
        for b, x in zip(buffers, stored)
    )
    return (out, new), (stacks, index, it, slot)


def _stashed_bwd(body, reslice, layout, residuals, cts):
    stacks, index, it, slot = residuals
    ct_out, buffers = cts
    slices = jax.tree.leaves(reslice(stacks, index))
    stored = iter(
        _decode(
            lax.dynamic_slice(b, (slot, it, *(0,) * (b.ndim - 2)), (1, 1, *b.shape[2:]))[0, 0],
            dtype,
        )
        for b, dtype in zip(buffers, layout.dtypes)
    )
    leaves = [next(stored) if k is None else slices[k] for k in layout.live]
    pullback = jax.tree.unflatten(layout.treedef, leaves)
    d_slices, d_state = pullback(ct_out)
    return None, d_slices, d_state, buffers, None, None, None


_stashed.defvjp(_stashed_fwd, _stashed_bwd)
