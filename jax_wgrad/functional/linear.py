"""Functional linear layer whose backward can fuse weight-gradient accumulation.

``linear(x, w, b, main_grad=acc)`` computes ``x @ w.T + b`` like a plain linear layer, but
its backward does not produce a weight gradient. Instead the weight gradient
``dy^T x`` is accumulated into ``acc`` with :func:`jax_wgrad.ops.wgrad_accumulate`, and
the *updated accumulator* is returned as the cotangent of ``main_grad``. This is how
Megatron's ``gradient_accumulation_fusion`` (``weight.main_grad += dy^T x`` inside the
backward GEMM) maps onto JAX's functional autodiff:

    grads = jax.grad(loss, argnums=(params, main_grads))(...)
    new_main_grads = grads[1]          # == main_grads + dW, updated in place by XLA

The cotangent of ``main_grad`` is therefore *not* a derivative. It is only meaningful
when each accumulator is used by exactly one ``linear`` call per differentiated
function (two uses would add the accumulator twice).

**Many weights in one flat bucket: the threaded form.** When several weights' main grads
are static slices of ONE flat gradient bucket, the bucket cannot be handed to each
``linear`` as above: autodiff would sum their cotangents (``K * bucket + sum dW``).
:func:`linear_into_bucket` instead threads the bucket like a token: it takes the bucket
and returns it unchanged (forward identity, nothing saved but ``x`` and ``w``), and its
backward receives the bucket's incoming cotangent -- everything accumulated so far
downstream -- and returns ``wgrad_accumulate(x, dy, ct, offset=offset)``: the same buffer
with this weight's ``[out, in]`` block added once, in place. Chained through all fused
linears of a function ``f(params, buckets, x) -> (y, buckets)``, ``vjp((dy, carried))``
returns the carried buckets with every block added exactly once. A model's layers do
not thread anything themselves: the caller that owns the buckets attaches each weight to
its block with a :class:`WgradRoutes` context, and :func:`linear` looks its weight up
there (see :class:`WgradRoutes`; the model calls plain ``linear(x, w, b)``).

**Traced offsets: stacked layers in a scan.** ``offset`` may also be a traced position
:class:`~jax_wgrad.ops.BlockOffset` ``(base, i, out * in)`` -- layer ``i`` of a
``lax.scan`` over stacked ``[L, out, in]`` weights that occupy one contiguous region of a
bucket from ``base`` on, computed in 64 bits by the handler, so buckets past ``2**31``
elements work (an int32 scalar array ``o`` is ``BlockOffset(0, o, 1)``). The bucket then
rides in the scan carry; the backward of the scan carries its cotangent, and each
iteration's fused call adds its layer's block in place (the traced-offset form of
:func:`jax_wgrad.ops.wgrad_accumulate`, clamped like ``lax.dynamic_update_slice``)::

    def stack(ws, bucket, x):                      # ws: [L, out, in], out == in
        def layer(carry, xs):
            h, bk = carry
            w, i = xs
            h, bk = linear_into_bucket(h, w, None, bk,
                                       offset=ops.BlockOffset(base, i, w_size))
            return (h, bk), None
        layers = jnp.arange(L, dtype=jnp.int32)
        (y, bucket), _ = jax.lax.scan(layer, (x, bucket), (ws, layers))
        return y, bucket
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_wgrad import ops
from jax_wgrad.functional.collectives import (
    SEQ_DIM,
    all_gather_tiled,
    gather_from_sequence_parallel_region,
    reduce_scatter_tiled,
)
from jax_wgrad.ops.position import advance

__all__ = [
    "ChunkSync",
    "RowPiece",
    "StackRoutes",
    "WgradRoutes",
    "active_routes",
    "linear",
    "linear_into_bucket",
    "reshape_weight",
    "through_bucket",
]


def _check(x: jax.Array, w: jax.Array, b: jax.Array | None) -> None:
    if w.ndim != 2:
        raise ValueError(f"linear: weight must be [out, in], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear: input features {x.shape} do not match weight [out, in] = {w.shape}"
        )
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"linear: bias must have shape ({w.shape[0]},), got {b.shape}")


def _forward(x: jax.Array, w: jax.Array, b: jax.Array | None, precision: int) -> jax.Array:
    y = jnp.matmul(x, w.T.astype(x.dtype), precision=jax.lax.Precision(precision))
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_linear(x, w, b, main_grad, precision):
    return _forward(x, w, b, precision)


def _fused_linear_fwd(x, w, b, main_grad, precision):
    return _forward(x, w, b, precision), (x, w, b, main_grad)


def _dgrad_bgrad(x, w, b, dy, precision):
    dx = jnp.matmul(dy, w.astype(dy.dtype), precision=jax.lax.Precision(precision))
    dx = dx.astype(x.dtype)
    db = None
    if b is not None:
        db = jnp.sum(dy.reshape(-1, dy.shape[-1]), axis=0, dtype=jnp.float32).astype(b.dtype)
    return dx, db


def _fused_linear_bwd(precision, res, dy):
    x, w, b, main_grad = res
    dx, db = _dgrad_bgrad(x, w, b, dy, precision)
    # The updated accumulator travels as the "cotangent" of main_grad (module docstring).
    new_main_grad = ops.wgrad_accumulate(x, dy, main_grad, precision=precision)
    return dx, None, db, new_main_grad


_fused_linear.defvjp(_fused_linear_fwd, _fused_linear_bwd)


# ----------------------------------------------------------------------------- threaded
# Two custom_vjp wrappers, one backward body: a static (int) offset is a nondiff argument
# (the same HLO as ever); a traced one (a BlockOffset pytree, or an int32 array) is a
# regular integer argument, saved as a residual, whose cotangent is None (float0 zeros).


def _gathered(x: jax.Array, axis: str | None) -> jax.Array:
    """``x``, or its sequence-parallel shards all-gathered along :data:`SEQ_DIM`."""
    return x if axis is None else all_gather_tiled(x, axis, SEQ_DIM)


def _threaded_bwd(x, w, b, dy, ct_bucket, offset, precision, gather_axis):
    """``(dx, None, db, bucket)``: ``ct_bucket`` is the bucket with every downstream block
    already added; this weight's block is added to it, in place.

    With ``gather_axis`` (``x`` a sequence-parallel shard), Megatron's column-parallel
    backward (``LinearWithGradAccumulationAndAsyncCommunication``): the input is
    re-gathered beside the data-gradient GEMM, and ``dx`` reduce-scattered beside the
    weight-gradient GEMM. Two optimization barriers say so to XLA's scheduler, which
    otherwise left both collectives with nothing between start and done and every weight
    gradient of a layer after its whole data-gradient chain (Llama-3-8B TP4 on H100s,
    docs/design/aot.md)."""
    x_full = _gathered(x, gather_axis)
    dx, db = _dgrad_bgrad(x, w, b, dy, precision)
    if gather_axis is not None:
        dx, x_full = jax.lax.optimization_barrier((dx, x_full))
        dx = reduce_scatter_tiled(dx, gather_axis, SEQ_DIM)
    bucket = ops.wgrad_accumulate(x_full, dy, ct_bucket, offset=offset, precision=precision)
    if gather_axis is not None:
        dx, bucket = jax.lax.optimization_barrier((dx, bucket))
    return dx, None, db, bucket


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _threaded_linear(x, w, b, bucket, offset, precision, gather_axis):
    return _forward(_gathered(x, gather_axis), w, b, precision), bucket


def _threaded_linear_fwd(x, w, b, bucket, offset, precision, gather_axis):
    # Only x (this rank's shard when gathered), w (and b for its dtype) are saved: the
    # bucket is NOT a residual.
    return (_forward(_gathered(x, gather_axis), w, b, precision), bucket), (x, w, b)


def _threaded_linear_bwd(offset, precision, gather_axis, res, cts):
    x, w, b = res
    return _threaded_bwd(x, w, b, *cts, offset, precision, gather_axis)


_threaded_linear.defvjp(_threaded_linear_fwd, _threaded_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _threaded_linear_at(x, w, b, bucket, offset, precision, gather_axis):
    return _forward(_gathered(x, gather_axis), w, b, precision), bucket


def _threaded_linear_at_fwd(x, w, b, bucket, offset, precision, gather_axis):
    # x, w, b and the offset's int32 index are saved; the bucket is NOT a residual.
    return (_forward(_gathered(x, gather_axis), w, b, precision), bucket), (x, w, b, offset)


def _threaded_linear_at_bwd(precision, gather_axis, res, cts):
    x, w, b, offset = res
    return (*_threaded_bwd(x, w, b, *cts, offset, precision, gather_axis), None)


_threaded_linear_at.defvjp(_threaded_linear_at_fwd, _threaded_linear_at_bwd)


def check_bucket_block(
    who: str, bucket: jax.Array, offset: ops.Offset, size: int, what: str
) -> bool:
    """Checks that a flat float32 ``bucket`` holds ``size`` elements at ``offset``; returns
    whether ``offset`` is traced (a :class:`~jax_wgrad.ops.BlockOffset` or an int32 scalar
    array: only ``N >= size`` is checked, the position is clamped into ``[0, N - size]`` by
    the fused op)."""
    traced = ops.is_traced_offset(offset)
    fits = bucket.ndim == 1 and (
        bucket.shape[0] >= size
        if traced
        else isinstance(offset, int)
        and not isinstance(offset, bool)
        and 0 <= offset <= bucket.shape[0] - size
    )
    if not fits:
        shown = "a traced offset" if traced else f"offset {offset!r}"
        raise ValueError(
            f"{who}: the {what} at {shown} does not fit in a flat bucket of "
            f"shape {tuple(bucket.shape)}"
        )
    if bucket.dtype != jnp.float32:
        raise ValueError(f"{who}: bucket must be float32, got {bucket.dtype}")
    return traced


def linear_into_bucket(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None,
    bucket: jax.Array,
    *,
    offset: ops.Offset,
    precision: ops.PrecisionLike = None,
    gather_axis: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(x @ w.T + b, bucket)``: a linear whose weight gradient goes into a flat bucket.

    Forward: the plain linear, and ``bucket`` returned unchanged (a token). Backward: the
    cotangent of the returned bucket (the buffer accumulated so far) comes back as the
    cotangent of the ``bucket`` input with ``dy^T @ x`` added to its elements
    ``[offset, offset + out * in)`` by :func:`jax_wgrad.ops.wgrad_accumulate` (in place
    under XLA); ``w`` gets a zero gradient. See the module docstring.

    Args:
      x: ``[..., in]`` input; w: ``[out, in]`` weight; b: optional ``[out]`` bias.
      bucket: flat ``[N]`` float32 gradient bucket holding the weight's row-major block.
      offset: element offset of the block in ``bucket``: a Python int (static, any size,
        checked to fit), or a :class:`~jax_wgrad.ops.BlockOffset` ``base + index *
        stride`` / an int32 scalar array (may be traced, e.g. per layer of a ``scan``; the
        exact value is clamped into ``[0, N - out * in]`` like
        ``lax.dynamic_update_slice``).
      precision: matmul precision of all three GEMMs (``jnp.dot``'s meaning and default,
        :func:`jax_wgrad.ops.matmul_precision`).
      gather_axis: ``x`` is this rank's sequence-parallel shard, all-gathered over this
        mesh axis before the GEMM (see :func:`linear`).
    Returns:
      ``(y [..., out] in x.dtype, bucket)``.
    """
    _check(x, w, b)
    level = ops.matmul_precision(precision)
    if check_bucket_block(
        "linear_into_bucket",
        bucket,
        offset,
        w.shape[0] * w.shape[1],
        f"[out, in] = {list(w.shape)} block",
    ):
        return _threaded_linear_at(x, w, b, bucket, offset, level, gather_axis)
    return _threaded_linear(x, w, b, bucket, offset, level, gather_axis)


# ----------------------------------------------------------------------------- routes
# Where each weight's gradient goes is attached to the weight by the caller that owns the
# gradient buckets (the pipeline executor, a test), not passed through the model: a
# WgradRoutes context, active while the model runs, maps weight ARRAYS (by identity, the
# very array objects the caller hands to the model) to a destination, and every fused
# linear of this module looks its weight up. This module alone touches the routes' state.


@dataclasses.dataclass(frozen=True)
class _ToBucket:
    """The weight's ``[out, in]`` block at ``offset`` of threaded bucket ``key``."""

    key: Hashable
    offset: ops.Offset
    name: str


@dataclasses.dataclass(frozen=True)
class RowPiece:
    """Rows ``[rows[0], rows[1])`` of a stacked ``[n, ...]`` weight's gradient: one
    contiguous block of bucket ``key`` from element ``offset`` on, row ``rows[0]``'s
    block first (a gradient layout in layer groups,
    :class:`~jax_wgrad.grads.SlotPiece`)."""

    key: Hashable
    offset: int
    rows: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class _ToPieces:
    """A stacked weight whose rows live in several buckets (only :func:`scan_layers`
    reads it: each part of its scan adds its rows to its piece)."""

    pieces: tuple[RowPiece, ...]
    name: str

    def piece(self, rows: tuple[int, int]) -> RowPiece:
        for p in self.pieces:
            if p.rows[0] <= rows[0] and rows[1] <= p.rows[1]:
                return p
        raise AssertionError(f"{self.name}: no piece holds rows {rows}")


ChunkSync = Callable[[jax.Array, jax.Array], jax.Array]
"""``sync(bucket_cotangent, i) -> bucket_cotangent``: the data-parallel sync of chunk
``i`` (traced int32) of a completed bucket, in place (see :class:`WgradRoutes`'s
``on_complete``)."""


@dataclasses.dataclass(frozen=True)
class _ToSplit:
    """Zero-bubble split backward: probe ``index`` (its gradient is the linear's ``dy``)."""

    index: int
    name: str


_LOCAL = threading.local()  # per tracing thread: the active routes, innermost last


def _active() -> list[WgradRoutes]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def active_routes() -> WgradRoutes | None:
    """The innermost active :class:`WgradRoutes` (``with routes:``) of this thread, or
    ``None``."""
    stack = _active()
    return stack[-1] if stack else None


class WgradRoutes:
    """Where the weight gradients of one differentiated call go (a trace-time context).

    Create it INSIDE the function being differentiated, from that function's bucket and
    probe arguments; attach weights with :meth:`to_bucket` / :meth:`to_split` (the array
    objects the model will hand to :func:`linear`, matched by identity); run the model
    under ``with routes:``; return :attr:`buckets` (and :attr:`inputs` for a split
    backward) from the function. A model's layers never see a bucket::

        def stage(params, buckets, x):
            routes = WgradRoutes(buckets)
            routes.to_bucket(params["w1"], 0, offset=128)
            routes.to_bucket(params["w2"], 0, offset=0)
            with routes:
                y = model(params, x)          # plain linear(x, w) calls
            return y, routes.buckets

        y, vjp_fn = jax.vjp(stage, params, buckets, x)
        dparams, buckets, dx = vjp_fn((dy, buckets))   # buckets += both blocks

    * **to a bucket** (Megatron's gradient accumulation fusion): the weight's linear
      threads the bucket like a token (:func:`linear_into_bucket`): its backward adds
      ``dy^T x`` to the weight's block in place; each use of the weight adds once;
    * **to a split probe** (zero bubble, ``probes[index]``, a zero array shaped like the
      linear's output; ``None``: only record, e.g. under ``jax.eval_shape``): the linear
      computes ``x @ stop_gradient(w).T + b + probe`` and records its input in
      :attr:`inputs` and its output in :attr:`outputs`; differentiating with respect to
      the probe gives its ``dy`` while no weight-gradient GEMM runs (the ``W`` task later
      runs ``wgrad_accumulate(x, dy, ...)``).

    * **to row pieces** (:meth:`to_pieces`; a gradient layout in layer groups): a weight
      stacked ``[n, ...]`` whose rows live in several buckets, each group of rows a
      bucket of its own; only :func:`~jax_wgrad.functional.scan_layers` reads it: it cuts
      its scan at the pieces, each part threading its piece's bucket.

    ``on_complete(key, k)`` (optional; the last backward of a step) asks, for the bucket
    ``key`` of a layer group that :func:`~jax_wgrad.functional.scan_layers` has just
    completed in the backward, for a :data:`ChunkSync` that syncs it in ``k`` chunks
    while the backward runs the ``k`` iterations of the group below (``None``: leave
    it): Megatron's reduce-scatter of a bucket as soon as its gradients are complete,
    overlapped with the rest of the backward.

    ``async_tp`` (default: without ``on_complete``): a sequence-parallel column-parallel
    linear into a bucket runs Megatron's asynchronous backward (:func:`linear`'s
    ``gather_axis``), its collectives beside its GEMMs. A backward that syncs layer groups'
    chunks leaves them composed as before: XLA:GPU keeps one collective in flight, and the
    chunk runs beside the layer's weight-gradient GEMMs once the layer's data gradient is
    done, which the asynchronous backward would hold back until the last weight gradient
    (the H100 compiles of the ``-groups-graphs`` rows lost their overlapped sync).

    A weight attached but never used by a fused linear would lose its gradient:
    :meth:`check_used` (called by the executor after each call) raises then.
    """

    def __init__(
        self,
        buckets: Mapping[Hashable, jax.Array] | Sequence[jax.Array] = (),
        probes: Sequence[jax.Array | None] = (),
        *,
        on_complete: Callable[[Hashable, int], ChunkSync | None] | None = None,
        async_tp: bool | None = None,
    ):
        self.on_complete = on_complete
        self.async_tp = on_complete is None if async_tp is None else async_tp
        self._keyed = isinstance(buckets, Mapping)
        self._tokens: dict[Hashable, jax.Array] = (
            dict(buckets) if self._keyed else dict(enumerate(buckets))
        )
        self._probes = list(probes)
        self.inputs: list[jax.Array | None] = [None] * len(self._probes)
        self.outputs: list[jax.Array | None] = [None] * len(self._probes)
        # id(weight) -> (weight, destination): the weight is held so its id stays unique.
        self._routes: dict[int, tuple[jax.Array, _ToBucket | _ToSplit | _ToPieces]] = {}
        self._used: set[int] = set()

    # -- attaching weights

    def to_bucket(
        self, weight: jax.Array, bucket: Hashable, offset: ops.Offset, *, name: str = ""
    ) -> None:
        """``weight``'s gradient is added to ``buckets[bucket]`` from element ``offset`` on
        (a Python int, or a traced :class:`~jax_wgrad.ops.BlockOffset` / int32 scalar, see
        :func:`linear_into_bucket`); ``name`` is for error messages."""
        if bucket not in self._tokens:
            raise ValueError(
                f"WgradRoutes.to_bucket: bucket {bucket!r} out of range (have {list(self._tokens)})"
            )
        self._attach(weight, _ToBucket(bucket, offset, name or f"weight {weight.shape}"))

    def to_split(self, weight: jax.Array, index: int, *, name: str = "") -> None:
        """``weight``'s linear is split for zero bubble with probe ``probes[index]``."""
        if not 0 <= index < len(self._probes):
            raise ValueError(
                f"WgradRoutes.to_split: probe {index} out of range "
                f"(have {len(self._probes)} probes)"
            )
        self._attach(weight, _ToSplit(index, name or f"weight {weight.shape}"))

    def to_pieces(self, weight: jax.Array, pieces: Sequence[RowPiece], *, name: str = "") -> None:
        """``weight`` (stacked ``[n, ...]``) has its rows' gradients in several buckets:
        ``pieces`` cover rows ``0 .. n`` in order (each piece's rows one block of its
        bucket). Only :func:`~jax_wgrad.functional.scan_layers` can run such a weight."""
        name = name or f"weight {weight.shape}"
        pieces = tuple(pieces)
        bounds = [p.rows for p in pieces]
        n = weight.shape[0] if weight.ndim else 0
        if (
            not pieces
            or bounds[0][0] != 0
            or bounds[-1][1] != n
            or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:]))
            or any(r[0] >= r[1] for r in bounds)
        ):
            raise ValueError(
                f"WgradRoutes.to_pieces: the pieces of {name} must cover its rows 0..{n} "
                f"in order, got rows {bounds}"
            )
        for p in pieces:
            if p.key not in self._tokens:
                raise ValueError(
                    f"WgradRoutes.to_pieces: bucket {p.key!r} out of range "
                    f"(have {list(self._tokens)})"
                )
        self._attach(weight, _ToPieces(pieces, name))

    def _attach(self, weight: jax.Array, dest: _ToBucket | _ToSplit | _ToPieces) -> None:
        if id(weight) in self._routes:
            raise ValueError(
                f"WgradRoutes: {dest.name} is already attached (as "
                f"{self._routes[id(weight)][1].name}); one destination per weight array"
            )
        self._routes[id(weight)] = (weight, dest)

    # -- the context

    def __enter__(self) -> WgradRoutes:
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = _active()
        if not stack or stack[-1] is not self:
            raise RuntimeError("WgradRoutes: contexts exited out of order")
        stack.pop()

    # -- results

    @property
    def buckets(self) -> tuple[jax.Array, ...] | dict[Hashable, jax.Array]:
        """The current bucket tokens, in the form given (a tuple, or a dict by key)."""
        return dict(self._tokens) if self._keyed else tuple(self._tokens.values())

    def check_used(self) -> None:
        """Raises ``ValueError`` naming every attached weight no fused linear used."""
        unused = [d.name for i, (_, d) in self._routes.items() if i not in self._used]
        if unused:
            raise ValueError(
                f"WgradRoutes: {', '.join(unused)} had a gradient destination but no "
                "jax_wgrad linear used the array (a weight must reach the layer unchanged: "
                "a cast, reshape or copy before the linear is a different array); its "
                "gradient would be lost"
            )

    # -- what the fused linears call

    def _find(self, weight: jax.Array) -> _ToBucket | _ToSplit | _ToPieces | None:
        hit = self._routes.get(id(weight))
        if hit is None or hit[0] is not weight:
            return None
        self._used.add(id(weight))
        return hit[1]

    def _thread(self, key: Hashable, fn: Callable[[jax.Array], tuple[Any, jax.Array]]):
        out, self._tokens[key] = fn(self._tokens[key])
        return out

    def _split_linear(self, dest: _ToSplit, x, w, b, precision: int) -> jax.Array:
        probe = self._probes[dest.index]
        y = _forward(x, jax.lax.stop_gradient(w), b, precision)
        if probe is not None:  # None: only record (to learn the shapes)
            if probe.shape != y.shape:
                raise ValueError(
                    f"WgradRoutes: the probe of {dest.name} has shape {probe.shape}, the "
                    f"linear's output {y.shape}"
                )
            y = y + probe.astype(y.dtype)
        if self.inputs[dest.index] is not None:
            raise ValueError(
                f"WgradRoutes: {dest.name} is split for zero bubble and used twice in one "
                "call (its W task keeps one (x, dy) pair)"
            )
        self.inputs[dest.index], self.outputs[dest.index] = x, y
        return y

    # -- stacked layers (scan_layers)

    def stack(self, leaves: Sequence[jax.Array]) -> StackRoutes:
        """The routes of weights stacked ``[n, ...]`` over the layers of a ``lax.scan``
        (:func:`~jax_wgrad.functional.scan_layers`): their buckets ride in the scan's
        carry, each layer's block at a traced :class:`~jax_wgrad.ops.BlockOffset`."""
        return StackRoutes(self, [self._find(a) for a in leaves])


class StackRoutes:
    """The routes of one ``lax.scan`` over stacked layers (made by
    :meth:`WgradRoutes.stack`; ``dests[k]``: leaf ``k``'s destination or ``None``).

    ``keys``: the bucket tokens every part of the scan carries; ``probes``: the stacked
    probes ``[n, ...]`` of the split leaves (scan inputs). ``parts``: the row ranges at
    which the scan is cut when some leaves' gradients live in row pieces (a layout in
    layer groups; ``()``: one scan): part ``p`` carries :meth:`carried` ``(p)`` -- the
    keys above, its pieces' buckets and the buckets of the part above it, which the
    backward completes before it runs part ``p`` (:meth:`completed`). Per layer,
    :meth:`layer` makes the routes of that layer's slices; after the scan,
    :meth:`finish` hands the tokens and the stacked records back to the outer routes.
    """

    def __init__(self, outer: WgradRoutes, dests: list[_ToBucket | _ToSplit | _ToPieces | None]):
        self._outer = outer
        self._dests = dests
        self.keys: tuple[Hashable, ...] = tuple(
            dict.fromkeys(d.key for d in dests if isinstance(d, _ToBucket))
        )
        self._split = [(k, d) for k, d in enumerate(dests) if isinstance(d, _ToSplit)]
        pieces = [d for d in dests if isinstance(d, _ToPieces)]
        cuts = {tuple(p.rows for p in d.pieces) for d in pieces}
        if len(cuts) > 1:
            raise ValueError(
                "scan_layers: the stacked weights laid out in row pieces must share one "
                f"cut into groups of layers, got {sorted(cuts)}"
            )
        self.parts: tuple[tuple[int, int], ...] = cuts.pop() if cuts else ()
        self._pieces = pieces

    @property
    def on_complete(self) -> Callable[[Hashable, int], ChunkSync | None] | None:
        """The outer routes' ``on_complete`` (:class:`WgradRoutes`)."""
        return self._outer.on_complete

    def part_keys(self, part: int) -> tuple[Hashable, ...]:
        """The buckets of the row pieces of part ``part`` (``()`` past the last part)."""
        if not 0 <= part < len(self.parts):
            return ()
        return tuple(dict.fromkeys(d.piece(self.parts[part]).key for d in self._pieces))

    def completed(self, part: int) -> tuple[Hashable, ...]:
        """The buckets complete in the backward when it reaches part ``part``: those of
        the part above that no part from ``part`` down and no other weight of the scan
        writes."""
        below = set(self.keys).union(*(self.part_keys(q) for q in range(part + 1)))
        return tuple(k for k in self.part_keys(part + 1) if k not in below)

    def carried(self, part: int | None) -> tuple[Hashable, ...]:
        """The tokens part ``part`` of the scan carries (``None``: the uncut scan)."""
        if part is None:
            return self.keys
        return tuple(dict.fromkeys(self.keys + self.part_keys(part) + self.part_keys(part + 1)))

    def tokens(self, keys: Sequence[Hashable]) -> tuple[jax.Array, ...]:
        """The outer routes' current tokens of ``keys``."""
        return tuple(self._outer._tokens[k] for k in keys)

    @property
    def probes(self) -> list[jax.Array | None]:
        return [self._outer._probes[d.index] for _, d in self._split]

    def layer(
        self,
        keys: Sequence[Hashable],
        tokens: Sequence[jax.Array],
        layer_leaves: Sequence[jax.Array],
        index: jax.Array,
        probes: Sequence[jax.Array | None],
        part: int | None = None,
    ) -> WgradRoutes:
        """The routes of layer ``index`` (traced int32, of the FULL stacks) in part
        ``part``: ``layer_leaves[k]`` is leaf ``k``'s slice ``[...]``; its bucket block at
        ``BlockOffset(offset, index, size)`` (exact at any bucket size; a row piece's
        offset counted from its first row); ``tokens``: the part's carried ``keys``;
        ``probes``: this layer's probes of the split leaves."""
        inner = WgradRoutes(dict(zip(keys, tokens)), probes, async_tp=self._outer.async_tp)
        j = 0
        for leaf, dest in zip(layer_leaves, self._dests):
            size = math.prod(leaf.shape)
            if isinstance(dest, _ToBucket):
                inner.to_bucket(leaf, dest.key, advance(dest.offset, index, size), name=dest.name)
            elif isinstance(dest, _ToPieces):
                piece = dest.piece(self.parts[part])
                base = piece.offset - piece.rows[0] * size
                inner.to_bucket(leaf, piece.key, advance(base, index, size), name=dest.name)
            elif isinstance(dest, _ToSplit):
                inner.to_split(leaf, j, name=dest.name)
                j += 1
        return inner

    @staticmethod
    def layer_result(routes: WgradRoutes, keys: Sequence[Hashable]):
        """``(tokens, inputs, outputs)`` of a layer's routes after the layer ran."""
        routes.check_used()
        return tuple(routes._tokens[k] for k in keys), routes.inputs, routes.outputs

    def put(self, keys: Sequence[Hashable], tokens: Sequence[jax.Array]) -> None:
        """A part's carried tokens after its scan, into the outer routes."""
        for key, token in zip(keys, tokens):
            self._outer._tokens[key] = token

    def finish(self, inputs, outputs) -> None:
        """The stacked records ``[k, ...]`` into the outer routes."""
        for j, (_, dest) in enumerate(self._split):
            self._outer.inputs[dest.index] = inputs[j]
            self._outer.outputs[dest.index] = outputs[j]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sync_when_complete(
    sync: ChunkSync | None, token: jax.Array, own: jax.Array, h: jax.Array, i: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(token, own, h)`` unchanged, applied to the inputs of a layer (or of a group of
    layers run as one iteration); the backward reaches it when their backward is done,
    and syncs chunk ``i`` (traced int32) of ``token``'s cotangent -- a completed bucket
    -- in place by ``sync(ct, i)``, beside the layers' weight gradients:

    * the chunk is cut after the data gradient (``h``'s cotangent; the two are joined by
      an optimization barrier first), so its collective is issued once the layers'
      tensor-parallel collectives are;
    * the synced bucket is joined with ``own``'s cotangent (the bucket the layers'
      weight gradients are added to, complete for them) and with the data gradient, so
      the chunk's write-back waits for those GEMMs and the layers below wait for the
      write-back: XLA:GPU's scheduler keeps the collective in flight over the weight
      gradients' GEMMs (without the data gradient in that join it put the last layer's
      GEMMs after the write-back, beside nothing but memory-bound kernels). A chunk
      slower than the weight gradients beside it delays the layers below.

    Why there: XLA:GPU runs every asynchronous collective on one communication stream
    and its scheduler keeps one in flight at a time
    (``--xla_gpu_experimental_parallel_collective_overlap_limit``, default 1), and the
    data gradient's GEMMs already hide the tensor-parallel collectives; the weight
    gradients' GEMMs are what a data-parallel collective can run beside. Issued before
    the layers' backward instead, straight-line code (an unrolled layer loop) left half
    of the chunks with only memory-bound kernels between start and done.

    ``sync`` ``None``: a backward that does not sync (the residuals are the same), the
    cotangents pass unchanged.
    """
    return token, own, h


def _sync_fwd(sync, token, own, h, i):
    return (token, own, h), i


def _sync_bwd(sync, i, cts):
    ct, ct_own, ct_h = cts
    if sync is None:
        return ct, ct_own, ct_h, None
    ct, ct_h = jax.lax.optimization_barrier((ct, ct_h))
    ct, ct_own, ct_h = jax.lax.optimization_barrier((sync(ct, i), ct_own, ct_h))
    return ct, ct_own, ct_h, None


sync_when_complete.defvjp(_sync_fwd, _sync_bwd)


def _destination(weight: jax.Array) -> tuple[WgradRoutes | None, _ToBucket | _ToSplit | None]:
    """The active routes and ``weight``'s destination there (``None`` when it has none)."""
    routes = active_routes()
    return routes, None if routes is None else routes._find(weight)


def _pieces_outside_scan(dest: _ToPieces):
    raise ValueError(
        f"WgradRoutes: {dest.name} has its gradient in {len(dest.pieces)} row pieces (a "
        "layout in layer groups); only scan_layers can run a weight stacked that way, "
        "each layer's slice in its own iteration"
    )


def reshape_weight(weight: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``weight.reshape(shape)`` with ``weight``'s gradient destination (a reshape keeps the
    row-major block): what a layer uses to hand a reshaped weight to :func:`linear`."""
    out = weight.reshape(shape)
    if out is not weight:
        routes, dest = _destination(weight)
        if dest is not None:
            routes._attach(out, dest)
    return out


def through_bucket(
    weight: jax.Array,
    plain: Callable[[], Any],
    into_bucket: Callable[[jax.Array, ops.Offset], tuple[Any, jax.Array]],
) -> Any:
    """For fused layers other than :func:`linear` (the expert linears): ``into_bucket(
    bucket, offset)`` with the active routes' bucket of ``weight`` (threaded: it returns
    ``(out, new bucket)``, ``out`` is returned), or ``plain()`` when ``weight`` has no
    destination. Raises ``ValueError`` for a weight split for zero bubble (only
    :func:`linear` splits)."""
    routes, dest = _destination(weight)
    if dest is None:
        return plain()
    if isinstance(dest, _ToSplit):
        raise ValueError(f"WgradRoutes: {dest.name} cannot be split for zero bubble here")
    if isinstance(dest, _ToPieces):
        _pieces_outside_scan(dest)
    return routes._thread(dest.key, lambda bk: into_bucket(bk, dest.offset))


def linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    main_grad: jax.Array | None = None,
    precision: ops.PrecisionLike = None,
    gather_axis: str | None = None,
) -> jax.Array:
    """``y = x @ w.T + b``.

    Where ``w``'s gradient goes: with ``main_grad`` into that array; else where the
    active :class:`WgradRoutes` attach ``w`` (the array object itself: a bucket block,
    or a zero-bubble split); else to ``w``'s ordinary cotangent (a plain linear).

    Args:
      x: ``[..., in]`` input.
      w: ``[out, in]`` weight (Megatron/PyTorch layout).
      b: optional ``[out]`` bias.
      main_grad: optional ``[out, in]`` fp32 (or input-dtype) accumulator. When given,
        the backward accumulates ``dy^T x`` into it through the fused op and returns the
        updated buffer as its cotangent; ``w`` then receives a zero gradient.
      precision: matmul precision of the forward, data-gradient and weight-gradient
        GEMMs, with ``jnp.dot``'s meaning and default (``jax.default_matmul_precision``;
        see :func:`jax_wgrad.ops.matmul_precision`): on a GPU float32 uses TF32 unless
        ``"highest"``, fused or not.
      gather_axis: Megatron's sequence-parallel column-parallel input: ``x`` is this
        rank's ``[b, s / tp, in]`` shard of the sequence, all-gathered over this mesh
        axis before the GEMM (its backward reduce-scatters ``dx``, as
        :func:`~jax_wgrad.functional.gather_from_sequence_parallel_region`). Into a
        bucket, the backward saves only the shard and runs Megatron's asynchronous
        column-parallel backward (``_threaded_bwd``; unless the routes say otherwise,
        :class:`WgradRoutes`'s ``async_tp``); elsewhere the gather and the linear are
        composed as two ops.
    Returns:
      ``[..., out]`` output in ``x.dtype``.
    """
    _check(x, w, b)
    level = ops.matmul_precision(precision)
    routes, dest = (None, None) if main_grad is not None else _destination(w)
    if gather_axis is not None and not (
        isinstance(dest, (_ToBucket, _ToPieces)) and routes.async_tp
    ):
        x = gather_from_sequence_parallel_region(x, gather_axis, SEQ_DIM)
        gather_axis = None
    if main_grad is not None:
        if main_grad.shape != w.shape:
            raise ValueError(
                f"linear: main_grad shape {main_grad.shape} must equal weight shape {w.shape}"
            )
        return _fused_linear(x, w, b, main_grad, level)
    if dest is None:
        return _forward(x, w, b, level)
    if isinstance(dest, _ToSplit):
        return routes._split_linear(dest, x, w, b, level)
    if isinstance(dest, _ToPieces):
        _pieces_outside_scan(dest)
    return routes._thread(
        dest.key,
        lambda bk: linear_into_bucket(
            x, w, b, bk, offset=dest.offset, precision=precision, gather_axis=gather_axis
        ),
    )
