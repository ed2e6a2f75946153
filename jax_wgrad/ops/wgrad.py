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

from jax_wgrad.ops import registry
from jax_wgrad.ops.precision import PrecisionLike, matmul_precision

__all__ = ["WORKSPACE_BYTES", "wgrad_accumulate", "wgrad_accumulate_p", "wgrad_accumulate_ref",
           "FLOAT_DTYPES"]

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Input (and accumulator) dtypes the handlers take."""

WORKSPACE_BYTES = 32 << 20
"""cuBLAS workspace of the CUDA wgrad handler: an extra uint8 result of the custom call,
allocated by XLA with the program's temporaries (cuBLAS recommends 32 MiB on Hopper, 4 MiB
before). 256 bytes of slack let the handler align it as cublasSetWorkspace requires."""

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
    if not registry.handler_loaded(platform):
        def unavailable(ctx, *args, **params):  # raised at compile time
            registry.require_fusion(platform)
        return unavailable
    rule = jax.ffi.ffi_lowering(registry.TARGET, operand_output_aliases={2: 0})
    if platform == "cpu":
        return lambda ctx, *args, offset, precision: rule(
            ctx, *args, offset=offset, precision=np.int32(precision))
    workspace = jax.core.ShapedArray((WORKSPACE_BYTES + 256,), jnp.uint8)

    def with_workspace(ctx, *args, offset, precision):
        # The CUDA handler's second result is its cuBLAS workspace (module docstring).
        ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
        return rule(ctx, *args, offset=offset, precision=np.int32(precision))[:1]
    return with_workspace


for _platform in registry.PLATFORMS:
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
    check_dtypes("wgrad_accumulate", x, dy, main_grad, shapes)


def check_dtypes(who: str, x: jax.Array, dy: jax.Array, main_grad: jax.Array,
                 shapes: str) -> None:
    """The dtypes the handlers take: x and dy f32/bf16/f16 alike; main_grad f32 or theirs."""
    if x.dtype not in FLOAT_DTYPES or dy.dtype != x.dtype:
        raise ValueError(f"{who}: x and dy must both be float32, bfloat16 or float16; "
                         f"got {shapes}")
    if main_grad.dtype != jnp.float32 and not (
        x.dtype != jnp.float32 and main_grad.dtype == x.dtype
    ):
        raise ValueError(
            f"{who}: main_grad must be float32, or the 16-bit dtype of x and dy "
            f"(accumulated in fp32, rounded once); got {shapes}")


def add_to_block(main_grad: jax.Array, update: jax.Array, offset: int | None) -> jax.Array:
    """Reference accumulation: ``main_grad + update`` in fp32, rounded once to its dtype;
    with ``offset``, into the flat elements ``[offset, offset + update.size)`` only."""
    if offset is None:
        return (main_grad.astype(jnp.float32) + update).astype(main_grad.dtype)
    block = main_grad[offset:offset + update.size].astype(jnp.float32) + update.reshape(-1)
    return main_grad.at[offset:offset + update.size].set(block.astype(main_grad.dtype))


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
    return add_to_block(main_grad, upd, offset)
