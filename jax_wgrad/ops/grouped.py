"""Grouped fused weight-gradient accumulation for expert weights ``[E, out, in]``.

``main_grad[e] += dy[e]^T @ x[e]`` for every expert ``e`` in ONE call of the
``wgrad_accumulate`` primitive (the same FFI target, told apart by ranks): on a GPU one
strided-batched cuBLAS GEMM with beta = 1 over the experts, on the CPU one BLAS GEMM per
expert; in place when XLA aliases the accumulator (donated, or a ``scan`` carry). The
accumulator is either the ``[E, out, in]`` array itself or a flat gradient bucket whose
``E`` row-major ``[out, in]`` blocks lie back to back from ``offset`` on -- the layout
of an expert weight's slice of a bucket. ``offset`` is a static Python int, or a traced
:class:`~jax_wgrad.ops.BlockOffset` / int32 scalar (its exact value clamped into
``[0, N - E * out * in]``, see :mod:`jax_wgrad.ops.wgrad`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_wgrad.ops.position import Offset
from jax_wgrad.ops.precision import PrecisionLike, matmul_precision
from jax_wgrad.ops.wgrad import add_to_block, bind, check_block, check_dtypes

__all__ = ["grouped_wgrad_accumulate", "grouped_wgrad_accumulate_ref"]


def _validate(x: jax.Array, dy: jax.Array, main_grad: jax.Array, offset) -> None:
    shapes = (
        f"x {x.dtype}{list(x.shape)}, dy {dy.dtype}{list(dy.shape)}, "
        f"main_grad {main_grad.dtype}{list(main_grad.shape)}"
    )
    if x.ndim != 3 or dy.ndim != 3 or x.shape[:2] != dy.shape[:2]:
        raise ValueError(
            "grouped_wgrad_accumulate: x and dy must be [E, T, in] and [E, T, out] with the "
            f"same E and T; got {shapes}"
        )
    e, _, d_in = x.shape
    d_out = dy.shape[2]
    if offset is None and main_grad.shape != (e, d_out, d_in):
        raise ValueError(
            f"grouped_wgrad_accumulate: main_grad must have shape [E, out, in] = "
            f"[{e}, {d_out}, {d_in}]; got {shapes}"
        )
    if offset is not None:
        check_block(
            "grouped_wgrad_accumulate",
            main_grad,
            offset,
            e * d_out * d_in,
            "[E, out, in] blocks",
            shapes,
        )
    check_dtypes("grouped_wgrad_accumulate", x, dy, main_grad, shapes)


def grouped_wgrad_accumulate(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Returns ``main_grad`` with ``dy[e]^T @ x[e]`` added to every expert's block.

    Args:
      x: ``[E, T, in]`` expert inputs (f32, bf16 or f16), ``T`` tokens per expert (its
        capacity).
      dy: ``[E, T, out]`` gradients of the expert outputs, same dtype.
      main_grad: ``[E, out, in]`` accumulator (f32, or the 16-bit dtype of the inputs), or
        with ``offset`` a flat ``[N]`` buffer holding the ``E`` blocks back to back at
        ``[offset, offset + E * out * in)``; the rest is left as it is.
      offset: element offset of expert 0's block in a flat ``main_grad``: a Python int
        (static, any size, checked to fit), a :class:`~jax_wgrad.ops.BlockOffset` or an
        int32 scalar array (may be traced; the exact value is clamped into
        ``[0, N - E * out * in]`` like ``lax.dynamic_update_slice`` with
        ``allow_negative_indices=False``).
      precision: ``jnp.dot``'s meaning and default (:func:`matmul_precision`).
    Returns:
      The updated accumulator, shape and dtype of ``main_grad``.
    Raises:
      ValueError: on ranks, shapes, dtypes or a bad precision.
      RuntimeError: at compile time, on a platform whose handler was not built.
    """
    _validate(x, dy, main_grad, offset)
    level = matmul_precision(precision)
    if x.shape[0] * x.shape[1] == 0:
        return main_grad
    return bind(x, dy, main_grad, offset, level)


def grouped_wgrad_accumulate_ref(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Plain-XLA reference of :func:`grouped_wgrad_accumulate` (same rounding)."""
    _validate(x, dy, main_grad, offset)
    upd = jnp.einsum(
        "eto,eti->eoi",
        dy,
        x,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision(matmul_precision(precision)),
    )
    return add_to_block(main_grad, upd, offset)
