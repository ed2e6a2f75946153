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
returns the carried buckets with every block added exactly once. :class:`WgradBuckets`
does the chaining for layers that only know their own slot (``main_grad=slot``)::

    def stage(params, buckets, x):
        wb = WgradBuckets(buckets)
        y = linear(x, params["w"], main_grad=wb.slot(bucket=0, offset=128))
        y = linear(y, params["w2"], main_grad=wb.slot(bucket=0, offset=0))
        return y, wb.buckets

    y, vjp_fn = jax.vjp(stage, params, buckets, x)
    dparams, buckets, dx = vjp_fn((dy, buckets))   # buckets += both blocks

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

import jax
import jax.numpy as jnp

from jax_wgrad import ops

__all__ = ["linear", "linear_into_bucket", "WgradBuckets", "BucketSlot", "WgradSplit", "SplitSlot"]


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


def _threaded_bwd(x, w, b, dy, ct_bucket, offset, precision):
    """``(dx, None, db, bucket)``: ``ct_bucket`` is the bucket with every downstream block
    already added; this weight's block is added to it, in place."""
    dx, db = _dgrad_bgrad(x, w, b, dy, precision)
    return dx, None, db, ops.wgrad_accumulate(x, dy, ct_bucket, offset=offset, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _threaded_linear(x, w, b, bucket, offset, precision):
    return _forward(x, w, b, precision), bucket


def _threaded_linear_fwd(x, w, b, bucket, offset, precision):
    # Only x, w (and b for its dtype) are saved: the bucket is NOT a residual.
    return (_forward(x, w, b, precision), bucket), (x, w, b)


def _threaded_linear_bwd(offset, precision, res, cts):
    x, w, b = res
    return _threaded_bwd(x, w, b, *cts, offset, precision)


_threaded_linear.defvjp(_threaded_linear_fwd, _threaded_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _threaded_linear_at(x, w, b, bucket, offset, precision):
    return _forward(x, w, b, precision), bucket


def _threaded_linear_at_fwd(x, w, b, bucket, offset, precision):
    # x, w, b and the offset's int32 index are saved; the bucket is NOT a residual.
    return (_forward(x, w, b, precision), bucket), (x, w, b, offset)


def _threaded_linear_at_bwd(precision, res, cts):
    x, w, b, offset = res
    return (*_threaded_bwd(x, w, b, *cts, offset, precision), None)


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
        return _threaded_linear_at(x, w, b, bucket, offset, level)
    return _threaded_linear(x, w, b, bucket, offset, level)


class WgradBuckets:
    """Threads a tuple of flat gradient buckets through the fused linears of one function.

    A small mutable holder, like an NNX variable: create it INSIDE the function being
    differentiated from that function's bucket arguments, hand :meth:`slot`s to the
    layers (``main_grad=slot``), and return :attr:`buckets` as outputs. Each fused
    ``linear`` replaces its bucket by the token returned from :func:`linear_into_bucket`,
    so the buckets flow through every fused linear in call order.
    """

    def __init__(self, buckets):
        self._buckets = list(buckets)

    @property
    def buckets(self) -> tuple[jax.Array, ...]:
        """The current bucket tokens (return these from the differentiated function)."""
        return tuple(self._buckets)

    def slot(self, bucket: int, offset: ops.Offset) -> BucketSlot:
        """The main grad of one weight: elements ``[offset, offset + out * in)`` of
        bucket ``bucket``; ``offset`` a Python int, or a :class:`~jax_wgrad.ops.BlockOffset`
        / int32 scalar array (traced, e.g. inside a ``scan`` over stacked layers; see
        :func:`linear_into_bucket`)."""
        if not 0 <= bucket < len(self._buckets):
            raise ValueError(
                f"WgradBuckets.slot: bucket {bucket} out of range (have {len(self._buckets)})"
            )
        return BucketSlot(self, bucket, offset)

    def thread(self, bucket: int, fn):
        """``out, new = fn(buckets[bucket])``; keeps ``new`` as that bucket's token and
        returns ``out`` (how a fused layer threads its bucket)."""
        out, self._buckets[bucket] = fn(self._buckets[bucket])
        return out

    def _linear(self, x, w, b, bucket: int, offset: ops.Offset, precision) -> jax.Array:
        return self.thread(
            bucket, lambda bk: linear_into_bucket(x, w, b, bk, offset=offset, precision=precision)
        )


class WgradSplit:
    """Splits each fused linear's backward for zero-bubble pipelining (B and W tasks).

    Create it INSIDE the function being differentiated from that function's ``probes``
    argument (one zero array per fused linear, shaped like its output; ``None`` entries
    only record the linears' inputs and outputs, e.g. under ``jax.eval_shape``) and hand
    :meth:`slot`\\ s to the layers (``main_grad=slot``). Fused linear ``k`` then computes
    ``x @ stop_gradient(w).T + b + probes[k]`` and records its input ``x`` in
    :attr:`inputs` (return them as auxiliary outputs). Differentiating with respect to the
    probes gives every linear's output gradient ``dy_k`` while no weight-gradient GEMM is
    computed (the weights are held out of differentiation); the ``W`` task later runs
    ``wgrad_accumulate(x_k, dy_k, bucket, offset)`` for each.
    """

    def __init__(self, probes):
        self._probes = list(probes)
        self.inputs: list[jax.Array | None] = [None] * len(self._probes)
        self.outputs: list[jax.Array | None] = [None] * len(self._probes)

    def slot(self, index: int) -> SplitSlot:
        """The split main grad of fused linear number ``index``."""
        if not 0 <= index < len(self._probes):
            raise ValueError(
                f"WgradSplit.slot: linear {index} out of range (have {len(self._probes)} probes)"
            )
        return SplitSlot(self, index)

    def _linear(self, x, w, b, index: int, precision: int) -> jax.Array:
        probe = self._probes[index]
        y = _forward(x, jax.lax.stop_gradient(w), b, precision)
        if probe is not None:  # None: only record (to learn the shapes)
            if probe.shape != y.shape:
                raise ValueError(
                    f"WgradSplit: probe {index} has shape {probe.shape}, the "
                    f"linear's output {y.shape}"
                )
            y = y + probe.astype(y.dtype)
        self.inputs[index], self.outputs[index] = x, y
        return y


@dataclasses.dataclass(frozen=True)
class SplitSlot:
    """Fused linear ``index`` of a :class:`WgradSplit` (``main_grad=`` of :func:`linear`)."""

    owner: WgradSplit
    index: int


@dataclasses.dataclass(frozen=True)
class BucketSlot:
    """Where one weight's main grad lives in threaded buckets (``main_grad=`` of
    :func:`linear`); made by :meth:`WgradBuckets.slot`. ``offset`` is a Python int, or a
    :class:`~jax_wgrad.ops.BlockOffset` / int32 scalar array (traced)."""

    owner: WgradBuckets
    bucket: int
    offset: ops.Offset


def linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    main_grad: jax.Array | BucketSlot | SplitSlot | None = None,
    precision: ops.PrecisionLike = None,
) -> jax.Array:
    """``y = x @ w.T + b``.

    Args:
      x: ``[..., in]`` input.
      w: ``[out, in]`` weight (Megatron/PyTorch layout).
      b: optional ``[out]`` bias.
      main_grad: optional ``[out, in]`` fp32 (or input-dtype) accumulator. When given,
        the backward accumulates ``dy^T x`` into it through the fused op and returns the
        updated buffer as its cotangent; ``w`` then receives a zero gradient. Or a
        :class:`BucketSlot`: the weight's block in threaded flat buckets
        (:func:`linear_into_bucket`), or a :class:`SplitSlot` (zero-bubble: the weight
        gradient is left to a later task, :class:`WgradSplit`).
      precision: matmul precision of the forward, data-gradient and weight-gradient
        GEMMs, with ``jnp.dot``'s meaning and default (``jax.default_matmul_precision``;
        see :func:`jax_wgrad.ops.matmul_precision`): on a GPU float32 uses TF32 unless
        ``"highest"``, fused or not.
    Returns:
      ``[..., out]`` output in ``x.dtype``.
    """
    _check(x, w, b)
    level = ops.matmul_precision(precision)
    if main_grad is None:
        return _forward(x, w, b, level)
    if isinstance(main_grad, BucketSlot):
        return main_grad.owner._linear(x, w, b, main_grad.bucket, main_grad.offset, level)
    if isinstance(main_grad, SplitSlot):
        return main_grad.owner._linear(x, w, b, main_grad.index, level)
    if main_grad.shape != w.shape:
        raise ValueError(
            f"linear: main_grad shape {main_grad.shape} must equal weight shape {w.shape}"
        )
    return _fused_linear(x, w, b, main_grad, level)
