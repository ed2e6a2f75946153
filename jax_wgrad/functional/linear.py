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
from jax_wgrad.functional.fp8 import (
    Fp8Gemm,
    Fp8Tensor,
    Fp8Weight,
    dequantize,
    fp8_dot,
    quantized_gradient,
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


def _dgrad_bgrad(x, w, b, dy, precision):
    dx = jnp.matmul(dy, w.astype(dy.dtype), precision=jax.lax.Precision(precision))
    dx = dx.astype(x.dtype)
    return dx, _bgrad(b, dy)


def _bgrad(b, dy):
    if b is None:
        return None
    return jnp.sum(dy.reshape(-1, dy.shape[-1]), axis=0, dtype=jnp.float32).astype(b.dtype)


# ------------------------------------------------------------------------------- FP8
# With an Fp8Gemm the three GEMMs run on quantized operands (jax_wgrad.functional.fp8):
# the forward saves the quantized input (half the bytes of a bf16 one) and the weight as
# given, and `qw`, the weight quantized once per step by the caller (None: quantized at
# each use, in the forward and again in the backward: the same values either way).


def _weight_rowwise(w, qw: Fp8Weight | None, fp8: Fp8Gemm) -> Fp8Tensor:
    """The forward GEMM's ``[out, in]`` FP8 weight: ``qw``'s, or ``w`` quantized."""
    return fp8.weight(w) if qw is None else qw.forward()


def _weight_columnwise(w, qw: Fp8Weight | None, fp8: Fp8Gemm) -> Fp8Tensor:
    """The data-gradient GEMM's ``[in, out]`` FP8 weight: ``qw``'s, or ``w`` quantized and
    transposed (one fusion)."""
    if qw is not None:
        return qw.transposed()
    q = fp8.weight(w)
    return Fp8Tensor(q.value.T, q.scale_inv)


def _fp8_forward(qx: Fp8Tensor, qw: Fp8Tensor, b, dtype) -> jax.Array:
    """``y [..., out]`` in ``dtype`` from the quantized input ``qx [..., in]`` and weight
    ``qw [out, in]``."""
    y = fp8_dot(qx, qw, (((qx.value.ndim - 1,), (1,)), ((), ())), dtype)
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


def _fp8_dgrad(qdy: Fp8Tensor, qwt: Fp8Tensor, dtype) -> jax.Array:
    """``dx [..., in]`` in ``dtype`` from the quantized output gradient ``qdy [..., out]``
    and the transposed weight ``qwt [in, out]`` (both contracted on their last dim)."""
    return fp8_dot(qdy, qwt, (((qdy.value.ndim - 1,), (1,)), ((), ())), dtype)


def _fp8_wgrad(qx: Fp8Tensor, qdy: Fp8Tensor, bucket, offset) -> jax.Array:
    """``bucket`` with ``dy^T x`` (from the quantized pair) added at ``offset``, in place."""
    return ops.fp8_wgrad_accumulate(
        qx.value, qdy.value, qx.scale_inv, qdy.scale_inv, bucket, offset=offset
    )


def _gathered_fp8(qx: Fp8Tensor, axis: str | None) -> Fp8Tensor:
    """``qx``, or its sequence-parallel shards all-gathered (the FP8 values: half the bytes
    of a bf16 gather; the scale is already the whole tensor's)."""
    return qx if axis is None else Fp8Tensor(_gathered(qx.value, axis), qx.scale_inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_linear(x, w, b, qw, fp8):
    return _fp8_forward(fp8.input(x), _weight_rowwise(w, qw, fp8), b, x.dtype)


def _fp8_linear_fwd(x, w, b, qw, fp8):
    qx = fp8.input(x)
    return _fp8_forward(qx, _weight_rowwise(w, qw, fp8), b, x.dtype), (qx, w, b, qw)


def _fp8_linear_bwd(fp8, res, dy):
    """The plain FP8 linear's backward: ``dw`` from an FP8 GEMM (``w``'s type)."""
    qx, w, b, qw = res
    qdy = fp8.gradient(dy)
    n = qx.value.ndim - 1
    lead = tuple(range(n))
    dw = fp8_dot(qdy, qx, ((lead, lead), ((), ())), jnp.float32).astype(w.dtype)
    dx = _fp8_dgrad(qdy, _weight_columnwise(w, qw, fp8), dy.dtype)
    return dx, dw, _bgrad(b, dy), None


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused_linear(x, w, b, main_grad, qw, precision, fp8):
    if fp8 is not None:
        return _fp8_forward(fp8.input(x), _weight_rowwise(w, qw, fp8), b, x.dtype)
    return _forward(x, w, b, precision)


def _fused_linear_fwd(x, w, b, main_grad, qw, precision, fp8):
    if fp8 is not None:
        qx = fp8.input(x)
        y = _fp8_forward(qx, _weight_rowwise(w, qw, fp8), b, x.dtype)
        return y, (qx, w, b, main_grad, qw)
    return _forward(x, w, b, precision), (x, w, b, main_grad, qw)


def _fused_linear_bwd(precision, fp8, res, dy):
    x, w, b, main_grad, qw = res
    if fp8 is not None:
        qdy = fp8.gradient(dy)
        dx, db = _fp8_dgrad(qdy, _weight_columnwise(w, qw, fp8), dy.dtype), _bgrad(b, dy)
        return dx, None, db, _fp8_wgrad(x, qdy, main_grad, None), None
    dx, db = _dgrad_bgrad(x, w, b, dy, precision)
    # The updated accumulator travels as the "cotangent" of main_grad (module docstring).
    new_main_grad = ops.wgrad_accumulate(x, dy, main_grad, precision=precision)
    return dx, None, db, new_main_grad, None


_fused_linear.defvjp(_fused_linear_fwd, _fused_linear_bwd)


# ----------------------------------------------------------------------------- threaded
# Two custom_vjp wrappers, one backward body: a static (int) offset is a nondiff argument
# (the same HLO as ever); a traced one (a BlockOffset pytree, or an int32 array) is a
# regular integer argument, saved as a residual, whose cotangent is None (float0 zeros).


def _gathered(x: jax.Array, axis: str | None) -> jax.Array:
    """``x``, or its sequence-parallel shards all-gathered along :data:`SEQ_DIM`."""
    return x if axis is None else all_gather_tiled(x, axis, SEQ_DIM)


def _threaded_bwd(x, w, b, dy, ct_bucket, offset, precision, gather_axis, fp8=None, qw=None):
    """``(dx, None, db, bucket)``: ``ct_bucket`` is the bucket with every downstream block
    already added; this weight's block is added to it, in place.

    With ``gather_axis`` (``x`` a sequence-parallel shard), Megatron's column-parallel
    backward (``LinearWithGradAccumulationAndAsyncCommunication``): the input is
    re-gathered beside the data-gradient GEMM, and ``dx`` reduce-scattered beside the
    weight-gradient GEMM. Two optimization barriers say so to XLA's scheduler, which
    otherwise left both collectives with nothing between start and done and every weight
    gradient of a layer after its whole data-gradient chain (Llama-3-8B TP4 on H100s,
    docs/design/aot.md). With ``fp8`` (an :class:`~jax_wgrad.functional.fp8.Fp8Gemm`),
    ``x`` is the quantized input and the GEMMs are FP8 ones (``qw``: the quantized weight,
    or ``None``)."""
    if fp8 is not None:
        x_full = _gathered_fp8(x, gather_axis)
        qdy = fp8.gradient(dy)
        dx, db = _fp8_dgrad(qdy, _weight_columnwise(w, qw, fp8), dy.dtype), _bgrad(b, dy)
    else:
        x_full = _gathered(x, gather_axis)
        dx, db = _dgrad_bgrad(x, w, b, dy, precision)
    if gather_axis is not None:
        dx, x_full = jax.lax.optimization_barrier((dx, x_full))
        dx = reduce_scatter_tiled(dx, gather_axis, SEQ_DIM)
    if fp8 is not None:
        bucket = _fp8_wgrad(x_full, qdy, ct_bucket, offset)
    else:
        bucket = ops.wgrad_accumulate(x_full, dy, ct_bucket, offset=offset, precision=precision)
    if gather_axis is not None:
        dx, bucket = jax.lax.optimization_barrier((dx, bucket))
    return dx, None, db, bucket


def _threaded_forward(x, w, b, qw, precision, gather_axis, fp8):
    """``(y, saved input)``: the forward of a linear into a bucket; the saved input is
    ``x`` as given (this rank's shard when gathered), quantized with ``fp8``."""
    if fp8 is None:
        return _forward(_gathered(x, gather_axis), w, b, precision), x
    qx = fp8.input(x, gather_axis)
    y = _fp8_forward(_gathered_fp8(qx, gather_axis), _weight_rowwise(w, qw, fp8), b, x.dtype)
    return y, qx


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _threaded_linear(x, w, b, bucket, qw, offset, precision, gather_axis, fp8):
    return _threaded_forward(x, w, b, qw, precision, gather_axis, fp8)[0], bucket


def _threaded_linear_fwd(x, w, b, bucket, qw, offset, precision, gather_axis, fp8):
    # Only x (this rank's shard when gathered; quantized with fp8), w (and b for its
    # dtype) and the quantized weight are saved: the bucket is NOT a residual.
    y, saved = _threaded_forward(x, w, b, qw, precision, gather_axis, fp8)
    return (y, bucket), (saved, w, b, qw)


def _threaded_linear_bwd(offset, precision, gather_axis, fp8, res, cts):
    x, w, b, qw = res
    dx, dw, db, bucket = _threaded_bwd(x, w, b, *cts, offset, precision, gather_axis, fp8, qw)
    return dx, dw, db, bucket, None


_threaded_linear.defvjp(_threaded_linear_fwd, _threaded_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _threaded_linear_at(x, w, b, bucket, offset, qw, precision, gather_axis, fp8):
    return _threaded_forward(x, w, b, qw, precision, gather_axis, fp8)[0], bucket


def _threaded_linear_at_fwd(x, w, b, bucket, offset, qw, precision, gather_axis, fp8):
    # x (quantized with fp8), w, b, the quantized weight and the offset's int32 index are
    # saved; the bucket is NOT a residual.
    y, saved = _threaded_forward(x, w, b, qw, precision, gather_axis, fp8)
    return (y, bucket), (saved, w, b, offset, qw)


def _threaded_linear_at_bwd(precision, gather_axis, fp8, res, cts):
    x, w, b, offset, qw = res
    grads = _threaded_bwd(x, w, b, *cts, offset, precision, gather_axis, fp8, qw)
    return (*grads, None, None)


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
    fp8: Fp8Gemm | None = None,
    fp8_weight: Fp8Weight | None = None,
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
      fp8: run the three GEMMs in FP8 (see :func:`linear`).
      fp8_weight: ``w`` already quantized (see :func:`linear`).
    Returns:
      ``(y [..., out] in x.dtype, bucket)``.
    """
    _check(x, w, b)
    level = _precision(precision, fp8)
    _check_fp8_weight(w, fp8, fp8_weight)
    if check_bucket_block(
        "linear_into_bucket",
        bucket,
        offset,
        w.shape[0] * w.shape[1],
        f"[out, in] = {list(w.shape)} block",
    ):
        return _threaded_linear_at(x, w, b, bucket, offset, fp8_weight, level, gather_axis, fp8)
    return _threaded_linear(x, w, b, bucket, fp8_weight, offset, level, gather_axis, fp8)


def _check_fp8_weight(w: jax.Array, fp8: Fp8Gemm | None, qw: Fp8Weight | None) -> None:
    """A quantized weight needs ``fp8``, and ``w``'s shape (its transpose's)."""
    if qw is None:
        return
    if fp8 is None:
        raise ValueError("linear: fp8_weight (a quantized weight) needs fp8 (an Fp8Gemm)")
    ok = isinstance(qw, Fp8Weight) and (qw.rowwise.shape, qw.columnwise.shape) == (
        w.shape,
        w.shape[::-1],
    )
    if not ok:
        got = (qw.rowwise.shape, qw.columnwise.shape) if isinstance(qw, Fp8Weight) else qw
        raise ValueError(
            f"linear: fp8_weight must be an Fp8Weight of the weight's shape {w.shape} (and "
            f"its transpose's), got {got!r}"
        )


def _precision(precision: ops.PrecisionLike, fp8: Fp8Gemm | None) -> int:
    """The matmul precision level; refused with ``fp8`` (the GEMMs are FP8 ones)."""
    if fp8 is not None and precision is not None:
        raise ValueError(
            f"linear: precision ({precision!r}) is for float GEMMs; with fp8 the GEMMs run "
            "on FP8 values with float32 accumulation (pass precision=None)"
        )
    return ops.matmul_precision(precision)


def _split_linear(
    route: Route, x, w, b, precision: int, fp8: Fp8Gemm | None, qw: Fp8Weight | None
) -> jax.Array:
    """Zero bubble's split linear (:class:`~jax_wgrad.functional.routes.ToSplit`):
    ``x @ stop_gradient(w).T + b + probe``, its input and output recorded.

    With ``fp8`` the forward and the data-gradient GEMMs are FP8 ones, and the input is
    recorded, and the output gradient reaches the probe, as their FP8 values dequantized
    (exact in ``x``'s type): the ``W`` task's weight-gradient GEMM then computes on the
    FP8 values, at the 16-bit rate (the same numbers as an FP8 GEMM's)."""
    probe = route.routes.probe(route)
    if fp8 is None:
        y, recorded = _forward(x, jax.lax.stop_gradient(w), b, precision), x
    else:
        y = _fp8_linear(x, jax.lax.stop_gradient(w), None, qw, fp8)
        recorded = dequantize(fp8.input(jax.lax.stop_gradient(x)), x.dtype)
    if probe is not None:  # None: only record (to learn the shapes)
        if probe.shape != y.shape:
            raise ValueError(
                f"WgradRoutes: the probe of {route.name} has shape {probe.shape}, the "
                f"linear's output {y.shape}"
            )
        y = y + probe.astype(y.dtype)
    if fp8 is not None:
        y = quantized_gradient(y, fp8)  # the probe's gradient: dy's FP8 values
        if b is not None:
            y = y + b.astype(y.dtype)  # the bias gradient from dy itself
    route.routes.record(route, recorded, y)
    return y


def linear(
    x: jax.Array,
    w: jax.Array | nnx.Variable,
    b: jax.Array | nnx.Variable | None = None,
    *,
    main_grad: jax.Array | None = None,
    precision: ops.PrecisionLike = None,
    gather_axis: str | None = None,
    fp8: Fp8Gemm | None = None,
    fp8_weight: Fp8Weight | None = None,
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
      fp8: run the forward, data-gradient and weight-gradient GEMMs in FP8
        (:class:`~jax_wgrad.functional.fp8.Fp8Gemm`: the recipe, and which operands are
        split over the tensor-parallel axis): the input, the weight and the output
        gradient quantized with per-tensor scales
        (:mod:`jax_wgrad.functional.fp8`), the weight gradient added to the fp32 bucket
        block or ``main_grad`` by :func:`jax_wgrad.ops.fp8_wgrad_accumulate` (a plain
        linear's in an FP8 GEMM too); the bias and its gradient stay in high precision.
        The forward saves the quantized input, half a bf16 one. ``precision`` must then
        be ``None``.
      fp8_weight: with ``fp8``, ``w`` already quantized by ``fp8.weight``, with its
        transpose (an :class:`~jax_wgrad.functional.fp8.Fp8Weight`: the same values), used
        by the forward and data-gradient GEMMs instead of quantizing ``w`` at each use --
        what a caller does once per step for a weight every microbatch uses
        (TransformerEngine's FP8 weight cache). ``w`` still says where its gradient goes.
    Returns:
      ``[..., out]`` output in ``x.dtype``.
    """
    route = route_of(w)
    w, b = value_of(w), value_of(b)
    _check(x, w, b)
    level = _precision(precision, fp8)
    _check_fp8_weight(w, fp8, fp8_weight)
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
        return _fused_linear(x, w, b, main_grad, fp8_weight, level, fp8)
    if route is None:
        return _forward(x, w, b, level) if fp8 is None else _fp8_linear(x, w, b, fp8_weight, fp8)
    if isinstance(dest, ToSplit):
        return _split_linear(route, x, w, b, level, fp8, fp8_weight)
    return route.into_bucket(
        lambda bk, offset: linear_into_bucket(
            x,
            w,
            b,
            bk,
            offset=offset,
            precision=precision,
            gather_axis=gather_axis,
            fp8=fp8,
            fp8_weight=fp8_weight,
        )
    )
