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
not thread anything themselves: the caller that owns the buckets routes each weight to its
block (:class:`~jax_wgrad.functional.WgradRoutes`: the weight's NNX variable then carries
its destination as metadata), and the layer hands the variable to :func:`linear`
(``linear(x, self.weight)``; :mod:`jax_wgrad.functional.routes`).

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

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad import ops
from jax_wgrad.functional.collectives import (
    SEQ_DIM,
    all_gather_tiled,
    gather_from_sequence_parallel_region,
    reduce_scatter_tiled,
)
from jax_wgrad.functional.routes import Route, ToBucket, ToPieces, ToSplit, route_of, value_of

__all__ = ["check_bucket_block", "linear", "linear_into_bucket"]


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


def _split_linear(route: Route, x, w, b, precision: int) -> jax.Array:
    """Zero bubble's split linear (:class:`~jax_wgrad.functional.routes.ToSplit`):
    ``x @ stop_gradient(w).T + b + probe``, its input and output recorded."""
    probe = route.routes.probe(route)
    y = _forward(x, jax.lax.stop_gradient(w), b, precision)
    if probe is not None:  # None: only record (to learn the shapes)
        if probe.shape != y.shape:
            raise ValueError(
                f"WgradRoutes: the probe of {route.name} has shape {probe.shape}, the "
                f"linear's output {y.shape}"
            )
        y = y + probe.astype(y.dtype)
    route.routes.record(route, x, y)
    return y


def linear(
    x: jax.Array,
    w: jax.Array | nnx.Variable,
    b: jax.Array | nnx.Variable | None = None,
    *,
    main_grad: jax.Array | None = None,
    precision: ops.PrecisionLike = None,
    gather_axis: str | None = None,
) -> jax.Array:
    """``y = x @ w.T + b``.

    Where ``w``'s gradient goes: with ``main_grad`` into that array; else where ``w``'s
    route says when ``w`` is an NNX variable carrying one (its ``wgrad`` metadata,
    :mod:`jax_wgrad.functional.routes`: a bucket block, or a zero-bubble split); else to
    ``w``'s ordinary cotangent (a plain linear).

    Args:
      x: ``[..., in]`` input.
      w: ``[out, in]`` weight (Megatron/PyTorch layout): an array, or the NNX variable
        holding it (``self.weight``; a ``jax.tree.map`` of it to cast or reshape the value
        keeps its route).
      b: optional ``[out]`` bias (an array or a variable).
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
        :class:`~jax_wgrad.functional.WgradRoutes`' ``async_tp``); elsewhere the gather
        and the linear are composed as two ops.
    Returns:
      ``[..., out]`` output in ``x.dtype``.
    """
    route = route_of(w)
    w, b = value_of(w), value_of(b)
    _check(x, w, b)
    level = ops.matmul_precision(precision)
    if main_grad is not None and route is not None:
        raise ValueError(
            f"linear: {route.name} has a route (a variable carrying its gradient "
            "destination) and a main_grad; give one"
        )
    dest = None if route is None else route.dest
    if gather_axis is not None and not (
        isinstance(dest, (ToBucket, ToPieces)) and route.routes.async_tp
    ):
        x = gather_from_sequence_parallel_region(x, gather_axis, SEQ_DIM)
        gather_axis = None
    if main_grad is not None:
        if main_grad.shape != w.shape:
            raise ValueError(
                f"linear: main_grad shape {main_grad.shape} must equal weight shape {w.shape}"
            )
        return _fused_linear(x, w, b, main_grad, level)
    if route is None:
        return _forward(x, w, b, level)
    if isinstance(dest, ToSplit):
        return _split_linear(route, x, w, b, level)
    return route.into_bucket(
        lambda bk, offset: linear_into_bucket(
            x, w, b, bk, offset=offset, precision=precision, gather_axis=gather_axis
        )
    )
