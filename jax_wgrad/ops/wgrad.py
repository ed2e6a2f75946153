"""Fused weight-gradient accumulation: ``main_grad += dy^T @ x`` in place.

The JAX port of apex's ``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16`` used by
Megatron's ``gradient_accumulation_fusion``. :func:`wgrad_accumulate` binds the
``wgrad_accumulate`` primitive, lowered to the XLA FFI custom call
``jax_wgrad_wgrad_accumulate`` with the accumulator (operand 2) aliased to the result.
Inside ``jit`` with the accumulator donated, or as a ``scan`` carry, XLA updates the
buffer in place: one GEMM with beta = 1, no temporary ``dW``.

**Grouped experts.** :func:`grouped_wgrad_accumulate` does ``main_grad[e] += dy[e]^T @
x[e]`` for every expert ``e`` of expert weights ``[E, out, in]`` in ONE call of the same
primitives (the same FFI targets, told apart by ranks): on a GPU one strided-batched cuBLAS
GEMM with beta = 1 over the experts, on the CPU one BLAS GEMM per expert. The accumulator
is either the ``[E, out, in]`` array itself or a flat gradient bucket whose ``E``
row-major ``[out, in]`` blocks lie back to back from ``offset`` on -- the layout of an
expert weight's slice of a bucket.

Both primitives are :class:`~jax_wgrad.ops.primitive.FfiPrimitive` specs (named, so the op
shows up as ``wgrad_accumulate`` in compiled HLO and in profiler traces).

**Static or traced offset.** A block of a flat bucket is addressed by ``offset``
(:mod:`jax_wgrad.ops.position`). A Python ``int`` is a static primitive parameter (the
int64 FFI attribute ``offset`` of ``jax_wgrad_wgrad_accumulate``), of any size. A
:class:`~jax_wgrad.ops.BlockOffset` ``(base, index, stride)`` -- e.g. ``(region start, i,
out * in)`` for layer ``i`` of a ``lax.scan`` over stacked layers -- binds
``wgrad_accumulate_at_p`` instead: ``index`` is operand 3 of the FFI target
``jax_wgrad_wgrad_accumulate_at`` (an int32; the accumulator is still operand 2, aliased
to the result), ``base`` and ``stride`` are int64 attributes, and the handler computes
``base + index * stride`` in 64 bits at run time (host memory on the CPU; device memory
on a GPU, never copied back to the host). An int32 scalar array ``o`` is
``BlockOffset(0, o, 1)``. A traced position cannot be checked at trace time, so it is
CLAMPED into ``[0, N - block]`` exactly like XLA's ``DynamicUpdateSlice`` clamps its start
index (``block`` = the elements written: ``out * in``, times ``E`` for grouped experts):
the block lands where ``lax.dynamic_update_slice(bucket, block, (position,),
allow_negative_indices=False)`` would put it with a 64-bit start index. A negative
position is clamped to 0 (jax's default ``allow_negative_indices=True`` would first wrap
it to ``N + position``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.ops.handlers import TARGET, TARGET_AT, fusion_error
from jax_wgrad.ops.position import (
    INT32_MAX,
    BlockOffset,
    Offset,
    as_block_offset,
    clamped_start_int32,
    provably_aligned,
)
from jax_wgrad.ops.precision import PrecisionLike, matmul_precision
from jax_wgrad.ops.primitive import FfiPrimitive, ProbeCase

__all__ = [
    "WORKSPACE",
    "WORKSPACE_BYTES",
    "wgrad_accumulate",
    "wgrad_accumulate_p",
    "wgrad_accumulate_at_p",
    "wgrad_accumulate_ref",
    "grouped_wgrad_accumulate",
    "grouped_wgrad_accumulate_ref",
    "FLOAT_DTYPES",
    "is_traced_offset",
]

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Input (and accumulator) dtypes the handlers take."""

WORKSPACE_BYTES = 32 << 20
"""cuBLAS workspace of the CUDA wgrad handler: an extra uint8 result of the custom call,
allocated by XLA with the program's temporaries (cuBLAS recommends 32 MiB on Hopper, 4 MiB
before). 256 bytes of slack let the handler align it as cublasSetWorkspace requires."""

WORKSPACE = jax.core.ShapedArray((WORKSPACE_BYTES + 256,), jnp.uint8)
"""The workspace result of the CUDA handlers that call cuBLAS / cuBLASLt (this op's and
:mod:`jax_wgrad.ops.fp8`'s)."""

# The CUDA handler of the traced-offset form keeps the per-problem GEMM pointers in device
# memory; a 16-byte unit keeps every array of it aligned.
_ALIGN = 16


def cuda_at_scratch(
    x_shape: tuple[int, ...],
    dy_shape: tuple[int, ...],
    acc: jax.core.ShapedArray,
    *,
    base: int,
    stride: int,
) -> tuple[jax.core.ShapedArray, jax.core.ShapedArray]:
    """Extra results of the CUDA ``jax_wgrad_wgrad_accumulate_at`` handler, besides its
    cuBLAS workspace (``ffi/wgrad_accumulate_cuda.cu`` says how each is used):

    * ``pointers``: uint8 ``[4 * P * 8]`` -- the A, B, C pointer arrays of
      ``cublasGemmBatchedEx`` and, per problem, the block to stage (null when it is
      16-byte aligned), ``P`` = batch elements x groups, written on the device by the
      handler's set-up kernel;
    * ``staging``: ``[P * step]`` of the accumulator's dtype, ``step`` = ``out * in``
      rounded up to 16 bytes: where the GEMM accumulates a block whose start in the bucket
      is not 16-byte aligned (cuBLAS's pointer-array GEMMs may use 16-byte vector accesses),
      copied in before and out after; untouched for an aligned block. EMPTY (``[0]``) when
      every block the position ``base + index * stride`` can address is provably 16-byte
      aligned (:func:`~jax_wgrad.ops.position.provably_aligned`: bucket layouts' blocks
      are): the handler then checks the same facts and never stages.
    """
    grouped = acc.ndim + 2 == len(x_shape)
    lead = x_shape[:-3] if grouped else x_shape[:-2]
    problems = int(np.prod(lead, dtype=np.int64)) * (x_shape[-3] if grouped else 1)
    item = jnp.dtype(acc.dtype).itemsize
    block = dy_shape[-1] * x_shape[-1]
    step = -(-block * item // _ALIGN) * _ALIGN // item
    if provably_aligned(
        BlockOffset(base, 0, stride),
        block=block,
        elements=acc.shape[-1],
        itemsize=item,
        alignment=_ALIGN,
    ):
        step = 0
    return (
        jax.core.ShapedArray((4 * problems * 8,), jnp.uint8),
        jax.core.ShapedArray((problems * step,), acc.dtype),
    )


def _scratch(platform, *_, **__):
    """The CUDA handler's second result is its cuBLAS workspace (module docstring)."""
    return [WORKSPACE] if platform == "cuda" else []


def _scratch_at(platform, x, dy, acc, index, *, base, stride, precision):
    if platform != "cuda":
        return []
    return [WORKSPACE, *cuda_at_scratch(x.shape, dy.shape, acc, base=base, stride=stride)]


def _fusion_error(platform: str, reason: str) -> str:
    return fusion_error(platform, reason, who="wgrad_accumulate")


# ---- the handlers' self-check (ops.fusion_status) ---------------------------------------


def _probe_data(rng):
    """Small integers that every precision (TF32 included) and dtype represents exactly:
    ``x [5, 4]``, ``dy [5, 3]``, experts' ``gx [2, 5, 4]``, ``gdy [2, 5, 3]``, a flat
    bucket ``[40]``, and the updates ``dy^T x`` and ``[dy[e]^T x[e] for e]``."""
    x, gx = (rng.integers(-3, 4, size=s).astype(np.float32) for s in ((5, 4), (2, 5, 4)))
    dy, gdy = (rng.integers(-3, 4, size=s).astype(np.float32) for s in ((5, 3), (2, 5, 3)))
    flat = rng.integers(-8, 9, size=40).astype(np.float32)
    return x, dy, gx, gdy, flat, dy.T @ x, np.einsum("eto,eti->eoi", gdy, gx)


def added(flat: np.ndarray, start: int, update: np.ndarray) -> np.ndarray:
    """``flat`` with ``update`` added to its elements from ``start`` on (numpy)."""
    out = flat.copy()
    out[start : start + update.size] += update.ravel()
    return out


def _self_check(rng) -> list[ProbeCase]:
    """Every dtype pair and precision, an offset block; grouped experts into a bucket
    (family ``"grouped"``)."""
    x, dy, gx, gdy, flat, update, grouped = _probe_data(rng)
    acc = rng.integers(-8, 9, size=(3, 4)).astype(np.float32)
    cases = [
        ProbeCase(
            f"float32 {p}",  # TF32 on GPUs unless highest
            lambda x, dy, a, p=p: wgrad_accumulate(x, dy, a, precision=p),
            (x, dy, acc),
            acc + update,
        )
        for p in ("default", "highest")
    ]
    for dt in (jnp.bfloat16, jnp.float16):
        name, xd, dyd = jnp.dtype(dt).name, x.astype(dt), dy.astype(dt)
        cases.append(
            ProbeCase(f"{name} into float32", wgrad_accumulate, (xd, dyd, acc), acc + update)
        )
        cases.append(
            ProbeCase(
                f"{name} into {name}", wgrad_accumulate, (xd, dyd, acc.astype(dt)), acc + update
            )
        )
    return [
        *cases,
        ProbeCase(
            "offset block of a flat bucket",
            lambda x, dy, b: wgrad_accumulate(x, dy, b, offset=7),
            (x, dy, flat),
            added(flat, 7, update),
        ),
        ProbeCase(
            "grouped experts into a bucket",
            lambda x, dy, b: grouped_wgrad_accumulate(x, dy, b, offset=4),
            (gx, gdy, flat),
            added(flat, 4, grouped),
            family="grouped",
        ),
    ]


def _self_check_at(rng) -> list[ProbeCase]:
    """Traced offsets (operands of the program), clamped; 64-bit positions; the grouped
    experts' cases of family ``"grouped"``."""
    x, dy, gx, gdy, flat, update, grouped = _probe_data(rng)
    # 30 for the grouped blocks is clamped to 40 - 24 = 16, as lax.dynamic_update_slice
    # clamps. Positions base + index * stride are combined in 64 bits: (2**32 + 7) - 2 *
    # 2**31 = 7 (in 32 bits every term wraps), and 4 + 3 * 4 = 16 with aligned base and
    # stride (the CUDA handler's unstaged form for an fp32 accumulator).
    return [
        ProbeCase(
            "traced offset block of a flat bucket",
            lambda x, dy, b, o: wgrad_accumulate(x, dy, b, offset=o),
            (x, dy, flat, np.int32(7)),
            added(flat, 7, update),
        ),
        ProbeCase(
            "grouped experts at a traced, clamped offset",
            lambda x, dy, b, o: grouped_wgrad_accumulate(x, dy, b, offset=o),
            (gx, gdy, flat, np.int32(30)),
            added(flat, 16, grouped),
            family="grouped",
        ),
        ProbeCase(
            "block at a 64-bit position base + index * stride",
            lambda x, dy, b, i: wgrad_accumulate(x, dy, b, offset=BlockOffset(2**32 + 7, i, 2**31)),
            (x, dy, flat, np.int32(-2)),
            added(flat, 7, update),
        ),
        ProbeCase(
            "grouped experts at an aligned position base + index * stride",
            lambda x, dy, b, i: grouped_wgrad_accumulate(x, dy, b, offset=BlockOffset(4, i, 4)),
            (gx, gdy, flat, np.int32(3)),
            added(flat, 16, grouped),
            family="grouped",
        ),
    ]


# ---- the primitives ----------------------------------------------------------------------

WGRAD_ACCUMULATE = FfiPrimitive(
    name="wgrad_accumulate",
    target=TARGET,
    attributes={"offset": np.int64, "precision": np.int32},
    aliases={2: 0},
    # broadcast_all: the result is a per-example accumulator, so an unbatched main_grad
    # becomes one copy per batch element, each accumulating its own dy^T x.
    vmap_method="broadcast_all",
    family="dense",  # its grouped experts' cases: "grouped"
    scratch=_scratch,
    unavailable_message=_fusion_error,
    self_check=_self_check,
)
"""``wgrad_accumulate(x, dy, main_grad, *, offset, precision)``: the block at the static
``offset`` (0: all of ``main_grad``)."""
WGRAD_ACCUMULATE_AT = FfiPrimitive(
    name="wgrad_accumulate_at",
    target=TARGET_AT,
    attributes={"base": np.int64, "stride": np.int64, "precision": np.int32},
    aliases={2: 0},
    # The index gets the batch dim too: one block position per batch element, one
    # shared base and stride.
    vmap_method="broadcast_all",
    family="dense",  # its grouped experts' cases: "grouped"
    scratch=_scratch_at,
    unavailable_message=_fusion_error,
    self_check=_self_check_at,
)
"""``wgrad_accumulate_at(x, dy, main_grad, index, *, base, stride, precision)``: the block
at ``base + index * stride`` (int64 parameters, an int32 ``index`` operand ``[*batch]``:
one per vmapped batch element), clamped, instead of a static offset parameter."""
wgrad_accumulate_p = WGRAD_ACCUMULATE.primitive
wgrad_accumulate_at_p = WGRAD_ACCUMULATE_AT.primitive


def is_traced_offset(offset) -> bool:
    """Whether ``offset`` takes the traced-offset path: a :class:`BlockOffset` or an array
    (jax or numpy), not a Python int. Raises ``ValueError`` for an array that is not an
    int32 scalar (:func:`~jax_wgrad.ops.position.as_block_offset`)."""
    return as_block_offset(offset) is not None


def _validate(x: jax.Array, dy: jax.Array, main_grad: jax.Array, offset) -> None:
    shapes = (
        f"x {x.dtype}{list(x.shape)}, dy {dy.dtype}{list(dy.shape)}, "
        f"main_grad {main_grad.dtype}{list(main_grad.shape)}"
    )
    if x.ndim < 2 or dy.ndim != x.ndim:
        raise ValueError(
            f"wgrad_accumulate: x and dy must have the same rank >= 2 ([..., T, features]); "
            f"got {shapes}"
        )
    if x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(
            f"wgrad_accumulate: x and dy must have the same leading (token) dims; got {shapes}"
        )
    block = dy.shape[-1] * x.shape[-1]
    if offset is None and main_grad.shape != (dy.shape[-1], x.shape[-1]):
        raise ValueError(
            "wgrad_accumulate: main_grad must have shape [out, in] = "
            f"[{dy.shape[-1]}, {x.shape[-1]}]; got {shapes}"
        )
    if offset is not None:
        check_block("wgrad_accumulate", main_grad, offset, block, "[out, in] block", shapes)
    check_dtypes("wgrad_accumulate", x, dy, main_grad, shapes)


def check_block(who: str, main_grad: jax.Array, offset, block: int, what: str, shapes: str) -> None:
    """A flat ``main_grad [N]`` holds ``block`` elements from ``offset`` on: checked fully
    for a static int offset; for a traced position only ``N >= block`` (it is clamped)."""
    if is_traced_offset(offset):
        if main_grad.ndim != 1 or main_grad.shape[0] < block:
            raise ValueError(
                f"{who}: with a traced offset, main_grad must be a flat buffer [N] with N >= "
                f"{block} (the {what}; the offset is clamped into [0, N - {block}]); got "
                f"{shapes}"
            )
        return
    if (
        main_grad.ndim != 1
        or not isinstance(offset, int)
        or isinstance(offset, bool)
        or not 0 <= offset <= main_grad.shape[0] - block
    ):
        raise ValueError(
            f"{who}: with offset={offset!r}, main_grad must be a flat buffer [N] "
            f"holding the {what} at [offset, offset + {block}) within N; got {shapes}"
        )


def check_dtypes(who: str, x: jax.Array, dy: jax.Array, main_grad: jax.Array, shapes: str) -> None:
    """The dtypes the handlers take: x and dy f32/bf16/f16 alike; main_grad f32 or theirs."""
    if x.dtype not in FLOAT_DTYPES or dy.dtype != x.dtype:
        raise ValueError(f"{who}: x and dy must both be float32, bfloat16 or float16; got {shapes}")
    if main_grad.dtype != jnp.float32 and not (
        x.dtype != jnp.float32 and main_grad.dtype == x.dtype
    ):
        raise ValueError(
            f"{who}: main_grad must be float32, or the 16-bit dtype of x and dy "
            f"(accumulated in fp32, rounded once); got {shapes}"
        )


def add_to_block(main_grad: jax.Array, update: jax.Array, offset: Offset | None) -> jax.Array:
    """Reference accumulation: ``main_grad + update`` in fp32, rounded once to its dtype;
    with ``offset``, into the flat elements ``[offset, offset + update.size)`` only. A
    traced position is clamped into ``[0, N - update.size]`` on its exact value, as the
    handlers do (``lax.dynamic_slice`` / ``dynamic_update_slice`` at the clamped start).

    Raises:
      ValueError: with an ``offset``, a buffer of more than ``2**31 - 1`` elements (XLA's
        slice indices are int32 without x64: this reference cannot address it exactly;
        the fused ops can).
    """
    if offset is None:
        return (main_grad.astype(jnp.float32) + update).astype(main_grad.dtype)
    if main_grad.shape[-1] > INT32_MAX:
        raise ValueError(
            f"the plain-XLA reference addresses flat buffers of at most {INT32_MAX} "
            f"elements (int32 slice indices); got main_grad {main_grad.dtype}"
            f"{list(main_grad.shape)} -- use the fused op for larger buckets"
        )
    position = as_block_offset(offset)
    if position is not None:
        start = clamped_start_int32(position, main_grad.shape[0] - update.size)
        old = jax.lax.dynamic_slice(main_grad, (start,), (update.size,))
        new = (old.astype(jnp.float32) + update.reshape(-1)).astype(main_grad.dtype)
        return jax.lax.dynamic_update_slice(main_grad, new, (start,))
    block = main_grad[offset : offset + update.size].astype(jnp.float32) + update.reshape(-1)
    return main_grad.at[offset : offset + update.size].set(block.astype(main_grad.dtype))


def bind(
    x: jax.Array, dy: jax.Array, main_grad: jax.Array, offset: Offset | None, precision: int
) -> jax.Array:
    """Binds the static-offset primitive for an int (or no) offset, the traced-offset one
    for a :class:`BlockOffset` or an int32 scalar array."""
    position = as_block_offset(offset)
    if position is not None:
        return WGRAD_ACCUMULATE_AT.bind(
            x,
            dy,
            main_grad,
            jnp.asarray(position.index, jnp.int32),
            base=position.base,
            stride=position.stride,
            precision=precision,
        )
    return WGRAD_ACCUMULATE.bind(
        x, dy, main_grad, offset=0 if offset is None else offset, precision=precision
    )


def wgrad_accumulate(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
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
      offset: element offset of the block in a flat ``main_grad``; only that block is
        read and written, the rest of the buffer is left as it is. A Python int is static
        (any size, checked to fit); a :class:`~jax_wgrad.ops.BlockOffset` ``(base, index,
        stride)`` (e.g. a stacked weight's start, a ``scan`` index, the block size) or an
        int32 scalar array (``BlockOffset(0, offset, 1)``) may be traced: its exact
        value is clamped into ``[0, N - out * in]`` like ``lax.dynamic_update_slice``'s
        start index with ``allow_negative_indices=False`` (module docstring).
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
    return bind(x2, dy2, main_grad, offset, level)


def wgrad_accumulate_ref(
    x: jax.Array,
    dy: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Plain-XLA reference of :func:`wgrad_accumulate` (same shapes, precision, rounding)."""
    _validate(x, dy, main_grad, offset)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    upd = jnp.dot(
        dy2.T,
        x2,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision(matmul_precision(precision)),
    )
    return add_to_block(main_grad, upd, offset)


# ---- grouped experts ----------------------------------------------------------------------


def _validate_grouped(x: jax.Array, dy: jax.Array, main_grad: jax.Array, offset) -> None:
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
    _validate_grouped(x, dy, main_grad, offset)
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
    _validate_grouped(x, dy, main_grad, offset)
    upd = jnp.einsum(
        "eto,eti->eoi",
        dy,
        x,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision(matmul_precision(precision)),
    )
    return add_to_block(main_grad, upd, offset)
