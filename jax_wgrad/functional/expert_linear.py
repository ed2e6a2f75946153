"""The expert linears of an MoE layer, with their weight gradients routed into buckets.

Two token layouts, one set of ``custom_vjp`` rules:

* **Capacity** (:func:`grouped_linear`): ``x [E, C, in]``, every expert a buffer of ``C``
  rows (zero-padded): batched GEMMs in XLA; the fused weight gradient is ONE
  :func:`jax_wgrad.ops.grouped_wgrad_accumulate` call.
* **Dropless** (:func:`ragged_linear`): ``x [R, in]`` with the tokens sorted by expert into
  ``E`` contiguous groups whose sizes ``group_sizes [E]`` are known only at run time (rows
  past the groups are padding): forward, input gradient and weight gradient are the
  library's ragged grouped GEMMs (:func:`jax_wgrad.ops.ragged_matmul`,
  :func:`jax_wgrad.ops.ragged_wgrad_accumulate`), whose work is the rows actually routed
  (``jax.lax.ragged_dot`` lowers densely: ``E`` times the work, on CPUs and on H100s).

Weight gradients go either to ``w``'s ordinary cotangent, or -- ``bucket`` given -- with
ONE fused call per expert linear into that expert weight's blocks of a flat
fp32 bucket, in place (``w`` then gets a zero gradient; the bucket travels as the
"cotangent" of the threaded bucket, see :mod:`jax_wgrad.functional.linear`).

**Delayed expert wgrad** (``overlap_wgrad=True``, Megatron's
``--overlap-dispatch-backward-with-experts-wgrad``): the weight-gradient GEMM is made to
start only after the data-gradient GEMM (an ``optimization_barrier`` on ``(x, dy, dx)``)
and nothing downstream depends on it except the gradient itself, so XLA may run it while
the dispatch-backward all-to-all is in flight. Without it the data gradient is released
only after the weight gradient (the serial baseline). Both compute the same operations:
bitwise equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_wgrad import ops
from jax_wgrad.functional.linear import check_bucket_block
from jax_wgrad.functional.saved import SAVED

__all__ = ["grouped_linear", "ragged_linear"]


# ------------------------------------------------- the two layouts' GEMMs (static `kind`)
def _forward(kind, x, w, sizes, precision):
    if kind == "ragged":
        return checkpoint_name(
            ops.ragged_matmul(x, w.astype(x.dtype), sizes, transpose_rhs=True, precision=precision),
            SAVED,
        )  # a custom call: dots_saveable cannot see it
    return jnp.einsum("eci,eoi->eco", x, w.astype(x.dtype), precision=jax.lax.Precision(precision))


def _dgrad(kind, dy, w, sizes, precision, dtype):
    if kind == "ragged":
        dx = ops.ragged_matmul(
            dy, w.astype(dy.dtype), sizes, transpose_rhs=False, precision=precision
        )
    else:
        dx = jnp.einsum(
            "eco,eoi->eci", dy, w.astype(dy.dtype), precision=jax.lax.Precision(precision)
        )
    return dx.astype(dtype)


def _wgrad_into(kind, x, dy, sizes, acc, offset, precision):
    """``acc`` with every expert's ``dy_e^T x_e`` added to its block (``offset``: of expert
    0's block in a flat ``acc``; ``None``: ``acc`` is ``[E, out, in]``)."""
    if kind == "ragged":
        return ops.ragged_wgrad_accumulate(x, dy, sizes, acc, offset=offset, precision=precision)
    return ops.grouped_wgrad_accumulate(x, dy, acc, offset=offset, precision=precision)


def _wgrad(kind, x, dy, sizes, w, precision):
    """The ordinary gradient of ``w``."""
    if kind == "ragged":
        return _wgrad_into(
            kind, x, dy, sizes, jnp.zeros(w.shape, jnp.float32), None, precision
        ).astype(w.dtype)
    return jnp.einsum(
        "eco,eci->eoi",
        dy,
        x,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision(precision),
    ).astype(w.dtype)


def _ordered(x, dy, dx, wgrad, overlap):
    """Runs ``wgrad(x, dy)`` after the data gradient ``dx`` (overlap) or holds ``dx`` back
    until the weight gradient is done (the serial baseline); returns ``(dx, wgrad)``."""
    if overlap:
        x, dy, dx = jax.lax.optimization_barrier((x, dy, dx))
        return dx, wgrad(x, dy)
    new = wgrad(x, dy)
    return jax.lax.optimization_barrier((dx, new))


# ---------------------------------------------------------------------- custom_vjp rules
# Threaded into a bucket: a static (int) offset is a nondiff argument, a traced one (a
# BlockOffset pytree or an int32 array) a regular integer argument saved as a residual
# (cotangent None); one backward body.
def _threaded_bwd_body(kind, x, w, sizes, dy, ct_bucket, offset, precision, overlap):
    """``(dx, zeros like w, None for the sizes, bucket + every expert's block)``."""
    dx = _dgrad(kind, dy, w, sizes, precision, x.dtype)
    wgrad = lambda x, dy: _wgrad_into(kind, x, dy, sizes, ct_bucket, offset, precision)
    dx, new_bucket = _ordered(x, dy, dx, wgrad, overlap)
    return dx, jnp.zeros_like(w), None, new_bucket


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _threaded(x, w, sizes, bucket, offset, kind, precision, overlap):
    return _forward(kind, x, w, sizes, precision), bucket


def _threaded_fwd(x, w, sizes, bucket, offset, kind, precision, overlap):
    return (_forward(kind, x, w, sizes, precision), bucket), (x, w, sizes)


def _threaded_bwd(offset, kind, precision, overlap, res, cts):
    x, w, sizes = res
    return _threaded_bwd_body(kind, x, w, sizes, *cts, offset, precision, overlap)


_threaded.defvjp(_threaded_fwd, _threaded_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _threaded_at(x, w, sizes, bucket, offset, kind, precision, overlap):
    return _forward(kind, x, w, sizes, precision), bucket


def _threaded_at_fwd(x, w, sizes, bucket, offset, kind, precision, overlap):
    return (_forward(kind, x, w, sizes, precision), bucket), (x, w, sizes, offset)


def _threaded_at_bwd(kind, precision, overlap, res, cts):
    x, w, sizes, offset = res
    return (*_threaded_bwd_body(kind, x, w, sizes, *cts, offset, precision, overlap), None)


_threaded_at.defvjp(_threaded_at_fwd, _threaded_at_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _plain(x, w, sizes, kind, precision, overlap):
    return _forward(kind, x, w, sizes, precision)


def _plain_fwd(x, w, sizes, kind, precision, overlap):
    return _forward(kind, x, w, sizes, precision), (x, w, sizes)


def _plain_bwd(kind, precision, overlap, res, dy):
    x, w, sizes = res
    dx = _dgrad(kind, dy, w, sizes, precision, x.dtype)
    dx, dw = _ordered(x, dy, dx, lambda x, dy: _wgrad(kind, x, dy, sizes, w, precision), overlap)
    return dx, dw, None


_plain.defvjp(_plain_fwd, _plain_bwd)


def _expert_linear(kind, x, w, sizes, bucket, offset, precision, overlap_wgrad):
    level = ops.matmul_precision(precision)
    if bucket is None:
        return _plain(x, w, sizes, kind, level, overlap_wgrad)
    if check_bucket_block(
        f"{kind} expert linear", bucket, offset, w.size, f"{list(w.shape)} blocks"
    ):
        return _threaded_at(x, w, sizes, bucket, offset, kind, level, overlap_wgrad)
    return _threaded(x, w, sizes, bucket, offset, kind, level, overlap_wgrad)


def grouped_linear(
    x: jax.Array,
    w: jax.Array,
    *,
    bucket: jax.Array | None = None,
    offset: ops.Offset = 0,
    precision: ops.PrecisionLike = None,
    overlap_wgrad: bool = False,
):
    """Per-expert ``y[e] = x[e] @ w[e]^T`` over capacity buffers.

    Args:
      x: ``[E, C, in]``; w: ``[E, out, in]``.
      bucket: optional flat fp32 gradient bucket threaded like
        :func:`jax_wgrad.functional.linear_into_bucket`: the backward adds every expert's
        ``dy[e]^T x[e]`` to its blocks ``[offset, offset + E * out * in)`` with ONE
        grouped fused call (``w`` then gets a zero gradient).
      offset: a Python int (static, any size, checked to fit), or a
        :class:`~jax_wgrad.ops.BlockOffset` ``base + index * stride`` / an int32 scalar
        array (may be traced, e.g. per layer of a ``scan``; the exact value is clamped into
        ``[0, N - E * out * in]`` like ``lax.dynamic_update_slice``).
      overlap_wgrad: the delayed-wgrad order (module docstring).
    Returns:
      ``y [E, C, out]``, and the bucket token when ``bucket`` is given.
    """
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(
            f"grouped_linear: x must be [E, C, in] and w [E, out, in]; got x "
            f"{list(x.shape)}, w {list(w.shape)}"
        )
    return _expert_linear("dense", x, w, None, bucket, offset, precision, overlap_wgrad)


def ragged_linear(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    bucket: jax.Array | None = None,
    offset: ops.Offset = 0,
    precision: ops.PrecisionLike = None,
    overlap_wgrad: bool = False,
):
    """Per-expert ``y[rows of e] = x[rows of e] @ w[e]^T`` over tokens sorted by expert.

    Args:
      x: ``[R, in]``: expert ``e``'s tokens are rows ``[sum(sizes[:e]), sum(sizes[:e+1]))``;
        rows past the last group are padding (their outputs are zeros).
      w: ``[E, out, in]``.
      group_sizes: int32 ``[E]`` rows per expert (traced; bounds clamped into ``[0, R]``).
      bucket, offset, precision, overlap_wgrad: as for :func:`grouped_linear`
        (the fused wgrad is ONE :func:`jax_wgrad.ops.ragged_wgrad_accumulate` call; an
        expert with no rows adds nothing).
    Returns:
      ``y [R, out]``, and the bucket token when ``bucket`` is given.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"ragged_linear: x must be [R, in], w [E, out, in] and group_sizes "
            f"[E]; got x {list(x.shape)}, w {list(w.shape)}, group_sizes "
            f"{list(group_sizes.shape)}"
        )
    return _expert_linear(
        "ragged",
        x,
        w,
        group_sizes.astype(jnp.int32),
        bucket,
        offset,
        precision,
        overlap_wgrad,
    )
