"""Fused weight-gradient accumulation: ``main_grad += dy^T @ x`` in place.

The JAX port of apex's ``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16`` used by
Megatron's ``gradient_accumulation_fusion``. :func:`wgrad_accumulate` binds the
``wgrad_accumulate`` primitive, lowered to the XLA FFI custom call
``jax_wgrad_wgrad_accumulate`` with the accumulator (operand 2) aliased to the result.
Inside ``jit`` with the accumulator donated, or as a ``scan`` carry, XLA updates the
buffer in place: one GEMM with beta = 1, no temporary ``dW``.

A named primitive (rather than a bare ``jax.ffi.ffi_call``) makes the op show up as
``wgrad_accumulate`` in compiled HLO and in profiler traces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_wgrad import _ffi

__all__ = ["wgrad_accumulate", "wgrad_accumulate_ref", "bucket_add", "bucket_add_ref",
           "matmul_precision", "fusion_available", "fusion_status"]

fusion_available = _ffi.fusion_available
fusion_status = _ffi.fusion_status

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

WORKSPACE_BYTES = 32 << 20
"""cuBLAS workspace of the CUDA wgrad handler: an extra uint8 result of the custom call,
allocated by XLA with the program's temporaries (cuBLAS recommends 32 MiB on Hopper, 4 MiB
before). 256 bytes of slack let the handler align it as cublasSetWorkspace requires."""

PrecisionLike = jax.lax.Precision | str | tuple | None


def matmul_precision(precision: PrecisionLike = None) -> int:
    """``jnp.dot``'s ``precision`` argument as XLA's number: 0 DEFAULT, 1 HIGH, 2 HIGHEST.

    ``None`` reads ``jax.default_matmul_precision`` (the config or its context manager)
    at trace time, as ``jnp.dot`` does. Strings are jax's (``"bfloat16"``/``"default"``,
    ``"tensorfloat32"``/``"high"``, ``"float32"``/``"highest"``); a pair of values means
    the higher of the two, as XLA takes the maximum over the operands.
    On a GPU, float32 inputs run on TF32 tensor cores at DEFAULT and HIGH and in full fp32
    at HIGHEST (XLA:GPU's rule); XLA:CPU and the CPU handler compute fp32 at every
    precision; 16-bit inputs are unaffected.

    Raises:
      ValueError: for a ``jax.lax.DotAlgorithm``/``DotAlgorithmPreset`` (not supported by
        the fused op) or anything that is not a precision.
    """
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return 0
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        return max(matmul_precision(p) for p in precision)
    try:
        return int(jax.lax.Precision(precision).value)
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            f"wgrad_accumulate: precision must be None, a jax.lax.Precision, one of "
            "'bfloat16', 'tensorfloat32', 'float32', 'default', 'high', 'highest', or a "
            f"pair of these (DotAlgorithm presets are not supported); got {precision!r}"
        ) from None


wgrad_accumulate_p = Primitive("wgrad_accumulate")


@functools.partial(jax.jit, static_argnames=("offset", "precision"))
def _eager(x, dy, main_grad, *, offset, precision):
    return wgrad_accumulate_p.bind(x, dy, main_grad, offset=offset, precision=precision)


wgrad_accumulate_p.def_impl(_eager)
# The result is typed exactly like the accumulator it updates (shape, dtype, and under
# shard_map its varying mesh axes), as jax.ffi.ffi_call types a result like the given aval.
wgrad_accumulate_p.def_abstract_eval(lambda x, dy, main_grad, **_: main_grad)


def _batch_rule(args, dims, *, offset, precision):
    """vmap: broadcast every operand to a leading batch dim; the handlers loop over it.

    This is ``vmap_method="broadcast_all"`` of ``jax.ffi.ffi_call``, chosen because the
    result is a per-example accumulator: an unbatched ``main_grad`` becomes one copy per
    batch element, each accumulating its own ``dy^T x``.
    """
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [
        jnp.broadcast_to(a, (size,) + a.shape) if d is None
        else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    return wgrad_accumulate_p.bind(*moved, offset=offset, precision=precision), 0


batching.primitive_batchers[wgrad_accumulate_p] = _batch_rule


def _wgrad_lowering(platform: str):
    if not _ffi.handler_loaded(platform):
        def unavailable(ctx, *args, **params):  # raised at compile time
            _ffi.require_fusion(platform)
        return unavailable
    rule = jax.ffi.ffi_lowering(_ffi.TARGET, operand_output_aliases={2: 0})
    if platform == "cpu":
        return lambda ctx, *args, offset, precision: rule(
            ctx, *args, offset=offset, precision=np.int32(precision))
    workspace = jax.core.ShapedArray((WORKSPACE_BYTES + 256,), jnp.uint8)

    def with_workspace(ctx, *args, offset, precision):
        # The CUDA handler's second result is its cuBLAS workspace (module docstring).
        ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
        return rule(ctx, *args, offset=offset, precision=np.int32(precision))[:1]
    return with_workspace


for _platform in _ffi.PLATFORMS:
    mlir.register_lowering(wgrad_accumulate_p, _wgrad_lowering(_platform), platform=_platform)


def _validate(x: jax.Array, dy: jax.Array, main_grad: jax.Array, offset: int | None) -> None:
    shapes = f"x {x.dtype}{list(x.shape)}, dy {dy.dtype}{list(dy.shape)}, " \
             f"main_grad {main_grad.dtype}{list(main_grad.shape)}"
    if x.ndim < 2 or dy.ndim != x.ndim:
        raise ValueError(
            f"wgrad_accumulate: x and dy must have the same rank >= 2 ([..., T, features]); "
            f"got {shapes}")
    if x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(
            f"wgrad_accumulate: x and dy must have the same leading (token) dims; got {shapes}")
    block = dy.shape[-1] * x.shape[-1]
    if offset is None and main_grad.shape != (dy.shape[-1], x.shape[-1]):
        raise ValueError(
            "wgrad_accumulate: main_grad must have shape [out, in] = "
            f"[{dy.shape[-1]}, {x.shape[-1]}]; got {shapes}")
    if offset is not None and (main_grad.ndim != 1 or not isinstance(offset, int)
                               or not 0 <= offset <= main_grad.shape[0] - block):
        raise ValueError(
            f"wgrad_accumulate: with offset={offset!r}, main_grad must be a flat buffer [N] "
            f"holding the [out, in] block at [offset, offset + {block}) within N; got {shapes}")
    if x.dtype not in _INPUT_DTYPES or dy.dtype != x.dtype:
        raise ValueError(
            "wgrad_accumulate: x and dy must both be float32, bfloat16 or float16; "
            f"got {shapes}")
    if main_grad.dtype != jnp.float32 and not (
        x.dtype != jnp.float32 and main_grad.dtype == x.dtype
    ):
        raise ValueError(
            "wgrad_accumulate: main_grad must be float32, or the 16-bit dtype of x and dy "
            f"(accumulated in fp32, rounded once); got {shapes}")


def wgrad_accumulate(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: int | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Returns ``main_grad + dy^T @ x``, updating the buffer in place under XLA.

    Args:
      x: ``[..., T, in]`` layer input (f32, bf16 or f16); leading dims are flattened
        into tokens like apex does.
      dy: ``[..., T, out]`` gradient of the layer output, same dtype and leading dims.
      main_grad: ``[out, in]`` accumulator: f32, or the 16-bit dtype of the inputs
        (then accumulated in fp32 and rounded once per call). With ``offset``: a flat
        ``[N]`` buffer (e.g. a gradient bucket) whose elements
        ``[offset, offset + out * in)`` hold the row-major ``[out, in]`` block.
      offset: static element offset of the block in a flat ``main_grad``; only that
        block is read and written, the rest of the buffer is left as it is.
      precision: ``jnp.dot``'s meaning and default (:func:`matmul_precision`): on a GPU
        float32 inputs use TF32 unless ``HIGHEST``, exactly like XLA's own ``dot``.
    Returns:
      The updated accumulator, same shape and dtype as ``main_grad``. With zero
      tokens it is ``main_grad`` itself.
    Raises:
      ValueError: on ranks, shapes, dtypes or a precision other than the above.
      RuntimeError: at compile time, on a platform whose handler was not built.
    """
    _validate(x, dy, main_grad, offset)
    level = matmul_precision(precision)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    if x2.shape[0] == 0:
        return main_grad
    return wgrad_accumulate_p.bind(x2, dy2, main_grad, offset=0 if offset is None else offset,
                                   precision=level)


def wgrad_accumulate_ref(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: int | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Plain-XLA reference of :func:`wgrad_accumulate` (same shapes, precision, rounding)."""
    _validate(x, dy, main_grad, offset)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    upd = jnp.dot(dy2.T, x2, preferred_element_type=jnp.float32,
                  precision=jax.lax.Precision(matmul_precision(precision)))
    if offset is None:
        return (main_grad.astype(jnp.float32) + upd).astype(main_grad.dtype)
    block = main_grad[offset:offset + upd.size].astype(jnp.float32) + upd.reshape(-1)
    return main_grad.at[offset:offset + upd.size].set(block.astype(main_grad.dtype))


# ----------------------------------------------------------------------------- bucket_add

bucket_add_p = Primitive("bucket_add")
"""``bucket_add(bucket, *grads, offsets)``: each gradient added into its block, in place."""


def _bucket_add_xla(bucket, *grads, offsets):
    """The same update in plain XLA: one dynamic-slice/add/dynamic-update-slice per block.

    In place on XLA:CPU, but XLA:GPU copies the whole bucket for each block when the
    offsets are constants (../shared/gpu/FINDINGS.md #6-7); used only on platforms
    without a built handler.
    """
    for g, o in zip(grads, offsets):
        flat = jnp.ravel(g).astype(jnp.float32)
        cur = jax.lax.dynamic_slice(bucket, (o,), (flat.shape[0],)).astype(jnp.float32)
        bucket = jax.lax.dynamic_update_slice(bucket, (cur + flat).astype(bucket.dtype), (o,))
    return bucket


bucket_add_p.def_impl(functools.partial(jax.jit, static_argnames="offsets")(
    lambda bucket, *grads, offsets: bucket_add_p.bind(bucket, *grads, offsets=offsets)))
bucket_add_p.def_abstract_eval(lambda bucket, *grads, offsets: bucket)


def _bucket_add_lowering(platform: str):
    if not _ffi.handler_loaded(platform):
        return mlir.lower_fun(_bucket_add_xla, multiple_results=False)
    rule = jax.ffi.ffi_lowering(_ffi.BUCKET_ADD_TARGET, operand_output_aliases={0: 0})
    return lambda ctx, *args, offsets: rule(ctx, *args,
                                            offsets=np.asarray(offsets, np.int64))


for _platform in _ffi.PLATFORMS:
    mlir.register_lowering(bucket_add_p, _bucket_add_lowering(_platform), platform=_platform)
# Any other platform (TPU, ROCm, ...): plain XLA.
mlir.register_lowering(bucket_add_p, mlir.lower_fun(_bucket_add_xla, multiple_results=False))


def _validate_bucket_add(bucket, grads, offsets) -> None:
    if bucket.ndim != 1 or bucket.dtype not in _INPUT_DTYPES:
        raise ValueError("bucket_add: the bucket must be a flat float32, bfloat16 or float16 "
                         f"array, got {bucket.dtype}{list(bucket.shape)}")
    if len(grads) != len(offsets):
        raise ValueError(f"bucket_add: {len(offsets)} offsets for {len(grads)} gradients")
    spans = []
    for k, (g, o) in enumerate(zip(grads, offsets)):
        where = f"bucket_add: gradient {k} ({g.dtype}{list(g.shape)} at offset {o!r})"
        if g.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{where} must be float32, bfloat16 or float16")
        if not isinstance(o, (int, np.integer)) or isinstance(o, bool) or not (
                0 <= o <= bucket.shape[0] - g.size):
            raise ValueError(f"{where} must be a static int with the block inside the "
                             f"bucket of {bucket.shape[0]} elements")
        if g.size:
            spans.append((int(o), int(o) + g.size))
    spans.sort()
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        if e0 > s1:
            raise ValueError(f"bucket_add: the blocks [{s0}, {e0}) and [{s1}, ...) overlap")


def bucket_add(bucket: jax.Array, grads, offsets) -> jax.Array:
    """Adds each gradient into its own block of a flat gradient bucket, in place.

    ``bucket[o_k : o_k + size(g_k)] += ravel(g_k)`` for every ``k``, computed in fp32 and
    stored in the bucket's dtype: Megatron's ``param.main_grad.add_(param.grad)`` for a
    whole set of parameters. One XLA custom call whose result aliases the bucket: on a
    donated argument or a scan carry no copy of the bucket is made on any backend, and
    the work is proportional to the gradients, not to the bucket. (On a platform without
    a built handler it lowers to plain XLA dynamic-update-slices instead.)

    Args:
      bucket: flat ``[N]`` float32 (or 16-bit) gradient bucket.
      grads: sequence of float32/bfloat16/float16 arrays of any shapes.
      offsets: static element offsets, one per gradient; the blocks must lie inside the
        bucket and not overlap.
    Returns:
      The updated bucket (``bucket`` itself when there is nothing to add).
    Raises:
      ValueError: on a bad bucket, dtype, offset or overlapping blocks.
    """
    grads = list(grads)
    offsets = [int(o) if isinstance(o, np.integer) else o for o in offsets]
    _validate_bucket_add(bucket, grads, offsets)
    keep = [(g, o) for g, o in zip(grads, offsets) if g.size]
    if not keep:
        return bucket
    return bucket_add_p.bind(bucket, *(g for g, _ in keep),
                             offsets=tuple(o for _, o in keep))


def bucket_add_ref(bucket: jax.Array, grads, offsets) -> jax.Array:
    """Plain-XLA reference of :func:`bucket_add` (same rounding)."""
    grads = list(grads)
    _validate_bucket_add(bucket, grads, list(offsets))
    return _bucket_add_xla(bucket, *grads, offsets=tuple(int(o) for o in offsets))
