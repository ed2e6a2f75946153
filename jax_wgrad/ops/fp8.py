"""FP8 fused weight-gradient accumulation, in place:
``main_grad += (dy_scale_inv * dy)^T @ (x_scale_inv * x)``.

The weight-gradient GEMM of FP8 training (TransformerEngine's wgrad GEMM under Megatron's
``gradient_accumulation_fusion``): the layer input ``x`` quantized to ``float8_e4m3fn``, the
output gradient ``dy`` to ``float8_e4m3fn`` or, in Megatron's "hybrid" format, to
``float8_e5m2``; each with its float32 dequantization factor (TransformerEngine's
``scale_inv``, a scalar). :func:`fp8_wgrad_accumulate` binds the ``fp8_wgrad_accumulate``
primitive, lowered to the XLA FFI custom call ``jax_wgrad_fp8_wgrad_accumulate`` with the
fp32 accumulator (operand 2) aliased to the result, exactly like
:func:`~jax_wgrad.ops.wgrad_accumulate`: inside ``jit`` with the accumulator donated, or as
a ``scan`` carry, XLA updates the buffer in place.

**Handlers.** On a GPU one cuBLASLt FP8 matmul with beta = 1 (``ffi/fp8_wgrad_cuda.cu``: the
scales are its A / B scale pointers, the accumulator is C = D; the token-major fp8 operands
are first transposed into scratch for the "TN" layout Hopper's FP8 kernels need). It needs
a GPU of compute capability 8.9 or newer and ``T``, ``in`` and ``out`` multiples of 16, and
refuses other shapes with an error. On the CPU the fp8 values are converted to float
exactly, multiplied by their scale (as :func:`fp8_wgrad_accumulate_ref` does) and
accumulated by the BLAS GEMM path of the bf16 op.

**Static or traced offset**, as for :func:`~jax_wgrad.ops.wgrad_accumulate`
(:mod:`jax_wgrad.ops.wgrad`): a Python ``int`` is the int64 attribute ``offset``; a
:class:`~jax_wgrad.ops.BlockOffset` or an int32 scalar array binds
``fp8_wgrad_accumulate_at_p`` (FFI target ``jax_wgrad_fp8_wgrad_accumulate_at``: int64
attributes ``base`` and ``stride``, the int32 ``index`` the last operand, read on the device
by the CUDA handler) and is CLAMPED into ``[0, N - out * in]`` like
``lax.dynamic_update_slice``'s start index (no negative wrapping).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.ops.handlers import FP8_TARGET, FP8_TARGET_AT, fusion_error
from jax_wgrad.ops.position import Offset, as_block_offset
from jax_wgrad.ops.primitive import FfiPrimitive
from jax_wgrad.ops.wgrad import WORKSPACE, add_to_block, check_block

__all__ = [
    "CUDA_MULTIPLE",
    "X_DTYPES",
    "DY_DTYPES",
    "fp8_wgrad_accumulate",
    "fp8_wgrad_accumulate_p",
    "fp8_wgrad_accumulate_at_p",
    "fp8_wgrad_accumulate_ref",
    "cuda_scratch_bytes",
    "staged",
]

X_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
"""dtype of the FP8 layer input ``x`` (E4M3)."""
DY_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
"""dtypes of the FP8 output gradient ``dy``: E4M3, or E5M2 (Megatron's "hybrid" format)."""

CUDA_MULTIPLE = 16
"""``T``, ``in`` and ``out`` of a GPU call must be multiples of this (cuBLASLt's FP8 GEMMs;
``kFp8Multiple`` of ``ffi/fp8_wgrad_cuda.cu``)."""

_SCRATCH_ALIGN = 256  # the CUDA handler's scratch regions start 256 bytes apart


def cuda_scratch_bytes(tokens: int, d_in: int, d_out: int, *, staged: bool) -> int:
    """Size of the CUDA handler's uint8 ``scratch`` result (``ffi/fp8_wgrad_cuda.cu``:
    ``LayoutOf``): ``x^T [in, T]`` and ``dy^T [out, T]`` (fp8, the TN operands), and, when
    ``staged``, an fp32 ``[out * in]`` staging slot for a block that cannot be updated in
    place (a traced position; a static offset whose start is not 16-byte aligned), each
    rounded up to 256 bytes, plus 256 bytes to align the start."""

    def up(n: int) -> int:
        return -(-n // _SCRATCH_ALIGN) * _SCRATCH_ALIGN

    staging = up(4 * d_out * d_in) if staged else 0
    return up(tokens * d_in) + up(tokens * d_out) + staging + _SCRATCH_ALIGN


def staged(offset: int | None) -> bool:
    """Whether the CUDA handler stages the fp32 block through its scratch: always for a
    traced position (``None``: only known on the device), for a static element ``offset``
    when the block does not start 16 bytes into the buffer (cuBLASLt's C/D alignment)."""
    return offset is None or offset % 4 != 0


def _scratch(platform, x, dy, acc, x_scale_inv, dy_scale_inv, *, offset):
    """CUDA: the cuBLASLt workspace and the scratch (:func:`staged`)."""
    if platform != "cuda":
        return []
    (tokens, d_in), d_out = x.shape, dy.shape[1]
    size = cuda_scratch_bytes(tokens, d_in, d_out, staged=staged(offset))
    return [WORKSPACE, jax.core.ShapedArray((size,), jnp.uint8)]


def _scratch_at(platform, x, dy, acc, x_scale_inv, dy_scale_inv, index, *, base, stride):
    """CUDA: the cuBLASLt workspace and the scratch with a staging slot (always: the block's
    address is only known on the device)."""
    if platform != "cuda":
        return []
    (tokens, d_in), d_out = x.shape, dy.shape[1]
    size = cuda_scratch_bytes(tokens, d_in, d_out, staged=staged(None))
    return [WORKSPACE, jax.core.ShapedArray((size,), jnp.uint8)]


def _fusion_error(platform: str, reason: str) -> str:
    return fusion_error(platform, reason, who="fp8_wgrad_accumulate")


# ---- the primitives ----------------------------------------------------------------------

FP8_WGRAD_ACCUMULATE = FfiPrimitive(
    name="fp8_wgrad_accumulate",
    target=FP8_TARGET,
    attributes={"offset": np.int64},
    aliases={2: 0},
    # One call per batch element (the handlers take no batch dims); an unbatched
    # main_grad is copied per element, each accumulating its own update.
    vmap_method="sequential",
    per_example=(2,),
    family="dense",
    scratch=_scratch,
    unavailable_message=_fusion_error,
)
"""``fp8_wgrad_accumulate(x, dy, main_grad, x_scale_inv, dy_scale_inv, *, offset)``: the
block at the static ``offset`` (0: all of ``main_grad``)."""
FP8_WGRAD_ACCUMULATE_AT = FfiPrimitive(
    name="fp8_wgrad_accumulate_at",
    target=FP8_TARGET_AT,
    attributes={"base": np.int64, "stride": np.int64},
    aliases={2: 0},
    vmap_method="sequential",
    per_example=(2,),
    family="dense",
    scratch=_scratch_at,
    unavailable_message=_fusion_error,
)
"""``fp8_wgrad_accumulate_at(x, dy, main_grad, x_scale_inv, dy_scale_inv, index, *, base,
stride)``: the block at ``base + index * stride`` (int64 parameters, an int32 scalar
``index`` operand), clamped."""
fp8_wgrad_accumulate_p = FP8_WGRAD_ACCUMULATE.primitive
fp8_wgrad_accumulate_at_p = FP8_WGRAD_ACCUMULATE_AT.primitive


def _describe(x, dy, main_grad, x_scale_inv, dy_scale_inv) -> str:
    return ", ".join(
        f"{name} {a.dtype}{list(a.shape)}" if hasattr(a, "dtype") else f"{name} {a!r}"
        for name, a in (
            ("x", x),
            ("dy", dy),
            ("main_grad", main_grad),
            ("x_scale_inv", x_scale_inv),
            ("dy_scale_inv", dy_scale_inv),
        )
    )


def _validate(x, dy, main_grad, x_scale_inv, dy_scale_inv, offset) -> None:
    who = "fp8_wgrad_accumulate"
    shapes = _describe(x, dy, main_grad, x_scale_inv, dy_scale_inv)
    if x.ndim < 2 or dy.ndim != x.ndim or x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(
            f"{who}: x and dy must have the same rank >= 2 and the same leading (token) dims "
            f"([..., T, in] and [..., T, out]); got {shapes}"
        )
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{who}: x must be float8_e4m3fn; got {shapes}")
    if dy.dtype not in DY_DTYPES:
        raise ValueError(
            f"{who}: dy must be float8_e4m3fn or float8_e5m2 (Megatron's hybrid format); "
            f"got {shapes}"
        )
    for name, s in (("x_scale_inv", x_scale_inv), ("dy_scale_inv", dy_scale_inv)):
        if getattr(s, "dtype", None) != jnp.float32 or jnp.shape(s) not in ((), (1,)):
            raise ValueError(
                f"{who}: {name} must be a float32 scalar, shape [] or [1] (the "
                f"dequantization factor); got {shapes}"
            )
    if main_grad.dtype != jnp.float32:
        raise ValueError(f"{who}: main_grad must be float32 (the fp32 accumulator); got {shapes}")
    d_in, d_out = x.shape[-1], dy.shape[-1]
    if offset is None and main_grad.shape != (d_out, d_in):
        raise ValueError(
            f"{who}: main_grad must have shape [out, in] = [{d_out}, {d_in}]; got {shapes}"
        )
    if offset is not None:
        check_block(who, main_grad, offset, d_out * d_in, "[out, in] block", shapes)


def fp8_wgrad_accumulate(
    x: jax.Array,
    dy: jax.Array,
    x_scale_inv: jax.Array,
    dy_scale_inv: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
) -> jax.Array:
    """Returns ``main_grad + (dy_scale_inv * dy)^T @ (x_scale_inv * x)``, updating the
    buffer in place under XLA (one fused GEMM, fp32 accumulation, no temporary ``dW``).

    Args:
      x: ``[..., T, in]`` FP8 layer input, ``float8_e4m3fn``; leading dims are flattened
        into tokens.
      dy: ``[..., T, out]`` FP8 gradient of the layer output, ``float8_e4m3fn`` or
        ``float8_e5m2``, same leading dims.
      x_scale_inv: float32 scalar (shape ``[]`` or ``[1]``): ``x``'s dequantization
        factor (the real input is ``x_scale_inv * x``).
      dy_scale_inv: float32 scalar, the same for ``dy``.
      main_grad: float32 ``[out, in]`` accumulator; with ``offset`` a flat float32 ``[N]``
        buffer (a gradient bucket) whose elements ``[offset, offset + out * in)`` hold the
        row-major ``[out, in]`` block. The rest of the buffer is left as it is.
      offset: element offset of the block in a flat ``main_grad``: a Python int (static,
        any size, checked to fit), or a :class:`~jax_wgrad.ops.BlockOffset` / int32 scalar
        array (may be traced; the exact value is clamped into ``[0, N - out * in]`` like
        ``lax.dynamic_update_slice`` with ``allow_negative_indices=False``).
    Returns:
      The updated accumulator, shape and dtype of ``main_grad``; with zero tokens
      ``main_grad`` itself.
    Raises:
      ValueError: on ranks, shapes or dtypes other than the above (naming them).
      RuntimeError: at compile time, on a platform whose handler was not built; at run time
        on a GPU, for ``T``, ``in`` or ``out`` not multiples of 16 or a GPU without FP8
        tensor cores (compute capability below 8.9).
    """
    _validate(x, dy, main_grad, x_scale_inv, dy_scale_inv, offset)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    if x2.shape[0] == 0:
        return main_grad
    position = as_block_offset(offset)
    if position is not None:
        return FP8_WGRAD_ACCUMULATE_AT.bind(
            x2,
            dy2,
            main_grad,
            x_scale_inv,
            dy_scale_inv,
            jnp.asarray(position.index, jnp.int32),
            base=position.base,
            stride=position.stride,
        )
    return FP8_WGRAD_ACCUMULATE.bind(
        x2, dy2, main_grad, x_scale_inv, dy_scale_inv, offset=0 if offset is None else offset
    )


def fp8_wgrad_accumulate_ref(
    x: jax.Array,
    dy: jax.Array,
    x_scale_inv: jax.Array,
    dy_scale_inv: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
) -> jax.Array:
    """Plain-XLA reference of :func:`fp8_wgrad_accumulate`: dequantize to float32
    (``scale_inv * value``), one float32 dot at ``Precision.HIGHEST``, add to the block."""
    _validate(x, dy, main_grad, x_scale_inv, dy_scale_inv, offset)
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32) * jnp.reshape(x_scale_inv, ())
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(jnp.float32) * jnp.reshape(dy_scale_inv, ())
    update = jnp.dot(
        dy2.T, x2, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
    return add_to_block(main_grad, update, offset)
