"""Ragged grouped GEMMs: the expert GEMMs of a dropless MoE layer.

The tokens routed to ``G`` experts are sorted by expert into ``G`` contiguous groups of
rows whose sizes ``group_sizes`` (int32 ``[G]``) are known only at run time. Group ``g``
owns the rows ``[start_g, end_g)``, ``start_g = clamp(sum_{h<g} max(size_h, 0), 0, R)``
and ``end_g = clamp(start_g + max(size_g, 0), 0, R)``: sizes summing past ``R`` are cut at
``R``, and rows past the last group belong to no group.

* :func:`ragged_matmul`: ``y[rows of g] = x[rows of g] @ op(w[g])``, zeros past the
  groups -- the forward of an expert linear (``w [G, out, in]``, ``transpose_rhs=True``)
  and its input gradient (``dy @ w[g]``, ``transpose_rhs=False``);
* :func:`ragged_wgrad_accumulate`: ``main_grad[g] += dy[rows of g]^T @ x[rows of g]``, in
  place (the accumulator, operand 3, is aliased to the result), into a ``[G, out, in]``
  array or the ``G`` blocks of a flat gradient bucket from ``offset`` on: a static int or
  a :class:`~jax_wgrad.ops.BlockOffset` ``base + index * stride`` (the int32 ``index`` is
  operand 4, ``base`` and ``stride`` int64 attributes, combined in 64 bits by the handler;
  a static int ``o`` is ``(o, 0, 0)``), clamped like :func:`jax_wgrad.ops.wgrad_accumulate`'s.

Both lower to XLA FFI custom calls (``jax_wgrad_ragged_matmul``,
``jax_wgrad_ragged_wgrad_accumulate``; ``ffi/ragged_gemm.h``) whose work is proportional
to the rows in groups, unlike ``jax.lax.ragged_dot``, which XLA expands to a dense masked
product (``G`` times the FLOPs) on CPU and GPU. On a Hopper GPU (compute capability 9.0),
bf16 and f16 operands run CUTLASS sm90 grouped GEMMs (``ffi/ragged_gemm_cutlass.cu``;
measured on an H200 at 70% of the bf16 peak at Mixtral's expert shapes) when the feature
dims are multiples of 8 (and the wgrad accumulates into fp32 blocks at 16-byte aligned
positions); other shapes, dtypes and GPUs run the library's WMMA kernels
(``ffi/ragged_gemm_cuda.cu``; 5-8% of the peak), as does every call after
``JAX_WGRAD_RAGGED_KERNEL=wmma`` (read when the CUDA handlers are loaded) or
:func:`set_cuda_kernel` ``("wmma")``. :func:`cuda_kernel_launches` counts what ran. On a
platform whose handlers were not built, or one jax_wgrad has no handlers for (TPU, ROCm),
compiling them raises; the plain-XLA references are :func:`ragged_matmul_ref` and
:func:`ragged_wgrad_accumulate_ref`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.ops.handlers import RAGGED_MATMUL_TARGET, RAGGED_WGRAD_TARGET
from jax_wgrad.ops.position import BlockOffset, Offset, as_block_offset
from jax_wgrad.ops.precision import PrecisionLike, matmul_precision
from jax_wgrad.ops.primitive import FfiPrimitive, ProbeCase
from jax_wgrad.ops.wgrad import FLOAT_DTYPES, add_to_block, added, check_block, check_dtypes

__all__ = [
    "cuda_kernel_launches",
    "set_cuda_kernel",
    "ragged_matmul",
    "ragged_matmul_p",
    "ragged_matmul_ref",
    "ragged_wgrad_accumulate",
    "ragged_wgrad_accumulate_p",
    "ragged_wgrad_accumulate_ref",
    "group_ids",
]

# ---- plain XLA: the references ----------------------------------------------------------


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Group of each of ``rows`` rows (int32 ``[rows]``), ``G`` past the last group, with
    the bounds clamped as the handlers clamp them (module docstring)."""

    def step(start, size):
        end = jnp.minimum(start + jnp.clip(size, 0, rows), rows)
        return end, end

    _, ends = jax.lax.scan(step, jnp.int32(0), group_sizes.astype(jnp.int32))
    return jnp.sum(
        ends[None, :] <= jnp.arange(rows, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32
    )


def _matmul_xla(x, w, group_sizes, *, transpose_rhs, precision):
    gid = group_ids(group_sizes, x.shape[0])
    spec = "rk,nk->rn" if transpose_rhs else "rk,kn->rn"

    def add_group(g, y):  # one f32 product per group; each row keeps only its own
        yg = jnp.einsum(
            spec,
            x,
            w[g],
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision(precision),
        )
        return jnp.where((gid == g)[:, None], yg, y)

    n = w.shape[1] if transpose_rhs else w.shape[2]
    y = jax.lax.fori_loop(0, w.shape[0], add_group, jnp.zeros((x.shape[0], n), jnp.float32))
    return y.astype(x.dtype)


def _group_products(x, dy, group_sizes, precision):
    """``[G, out, in]`` f32: ``dy[rows of g]^T @ x[rows of g]`` per group (masked)."""
    gid = group_ids(group_sizes, x.shape[0])
    return jax.lax.map(
        lambda g: jnp.dot(
            jnp.where((gid == g)[:, None], dy, 0).T,
            x,
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision(precision),
        ),
        jnp.arange(group_sizes.shape[0], dtype=jnp.int32),
    )


# ---- the handlers' self-check (ops.fusion_status) ---------------------------------------


def ragged_rows(sizes: np.ndarray, rows: int) -> list[slice]:
    """Per group, its clamped rows ``slice(start, end)`` (numpy; module docstring)."""
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), rows)
    return [slice(s, e) for s, e in zip(np.concatenate([[0], ends[:-1]]), ends)]


# A group of zero rows and rows past the groups; sizes summing past the rows (clamped).
_SHORT, _LONG = np.array([2, 0, 3], np.int32), np.array([4, 0, 9], np.int32)


def _matmul_self_check(rng) -> list[ProbeCase]:
    """Both ``w`` layouts, 16-bit data, short and clamped sizes."""

    x = rng.integers(-3, 4, size=(7, 4)).astype(np.float32)
    w = rng.integers(-3, 4, size=(3, 3, 4)).astype(np.float32)  # [G, N, K]
    cases = []
    for sizes, dt, transpose in ((_SHORT, jnp.float32, True), (_LONG, jnp.bfloat16, False)):
        y = np.zeros((7, 3), np.float32)
        for g, rows in enumerate(ragged_rows(sizes, 7)):
            y[rows] = x[rows] @ w[g].T
        cases.append(
            ProbeCase(
                f"ragged_matmul {jnp.dtype(dt).name} transpose_rhs={int(transpose)}",
                lambda x, w, s, t=transpose, d=dt: ragged_matmul(
                    x.astype(d), w.astype(d), s, transpose_rhs=t
                ),
                (x, w if transpose else np.swapaxes(w, 1, 2), sizes),
                y,
            )
        )
    return cases + _aligned_matmul_self_check(rng)


def _aligned_matmul_self_check(rng) -> list[ProbeCase]:
    """bf16 with K = N = 8, shapes the CUDA handlers give to CUTLASS on a Hopper GPU when
    it is chosen (the default ``auto``), so that the self-check verifies the
    kernels that will run: both ``w`` layouts, a group of zero rows, rows past the groups."""
    sizes = np.array([5, 0, 6], np.int32)
    x = rng.integers(-3, 4, size=(16, 8)).astype(np.float32)
    w = rng.integers(-3, 4, size=(3, 8, 8)).astype(np.float32)  # [G, N, K]
    y = np.zeros((16, 8), np.float32)
    for g, rows in enumerate(ragged_rows(sizes, 16)):
        y[rows] = x[rows] @ w[g].T
    return [
        ProbeCase(
            f"ragged_matmul bfloat16 K = N = 8 transpose_rhs={int(transpose)}",
            lambda x, w, s, t=transpose: ragged_matmul(
                x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), s, transpose_rhs=t
            ),
            (x, w if transpose else np.swapaxes(w, 1, 2), sizes),
            y,
        )
        for transpose in (True, False)
    ]


def _wgrad_self_check(rng) -> list[ProbeCase]:
    """16-bit data and accumulator, a flat bucket at a static offset, at a traced, clamped
    offset and at a 64-bit position ``base + index * stride``."""

    x = rng.integers(-3, 4, size=(7, 4)).astype(np.float32)
    dy = rng.integers(-3, 4, size=(7, 3)).astype(np.float32)
    acc = rng.integers(-8, 9, size=(3, 3, 4)).astype(np.float32)
    flat = rng.integers(-8, 9, size=40).astype(np.float32)
    bucket = np.concatenate([flat, flat[:1]])  # 41 elements: 36 fit from 5 on
    short, long = (np.stack([dy[r].T @ x[r] for r in ragged_rows(s, 7)]) for s in (_SHORT, _LONG))
    x8, dy8 = (rng.integers(-3, 4, size=(7, 8)).astype(np.float32) for _ in range(2))
    acc8 = rng.integers(-8, 9, size=(3, 8, 8)).astype(np.float32)
    return [
        ProbeCase(
            "ragged_wgrad_accumulate float32",
            ragged_wgrad_accumulate,
            (x, dy, _SHORT, acc),
            acc + short,
        ),
        ProbeCase(
            "ragged_wgrad_accumulate bfloat16 into bfloat16",
            lambda x, dy, s, a: ragged_wgrad_accumulate(
                x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16), s, a.astype(jnp.bfloat16)
            ),
            (x, dy, _LONG, acc),
            acc + long,
        ),
        ProbeCase(
            "ragged_wgrad_accumulate float16 into a bucket",
            lambda x, dy, s, b: ragged_wgrad_accumulate(
                x.astype(jnp.float16), dy.astype(jnp.float16), s, b, offset=5
            ),
            (x, dy, _SHORT, bucket),
            added(bucket, 5, short),
        ),
        ProbeCase(
            "ragged_wgrad_accumulate at a traced, clamped offset",  # 30 clamped to 40 - 36
            lambda x, dy, s, b, o: ragged_wgrad_accumulate(x, dy, s, b, offset=o),
            (x, dy, _LONG, flat, np.int32(30)),
            added(flat, 4, long),
        ),
        ProbeCase(  # shapes CUTLASS takes on a Hopper GPU when chosen (out = in = 8)
            "ragged_wgrad_accumulate bfloat16 into float32, out = in = 8",
            lambda x, dy, s, a: ragged_wgrad_accumulate(
                x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16), s, a
            ),
            (x8, dy8, _SHORT, acc8),
            acc8 + np.stack([dy8[r].T @ x8[r] for r in ragged_rows(_SHORT, 7)]),
        ),
        ProbeCase(
            "ragged_wgrad_accumulate at a 64-bit position base + index * stride",
            lambda x, dy, s, b, i: ragged_wgrad_accumulate(
                x, dy, s, b, offset=BlockOffset(2**33 + 5, i, 2**31)
            ),
            (x, dy, _SHORT, bucket, np.int32(-4)),
            added(bucket, 5, short),
        ),
    ]


# ---- the CUDA handlers' scratch and kernel choice ----------------------------------------

# The CUDA handlers' scratch result (ffi/ragged_gemm_cutlass.h: ScratchBytes): CUTLASS's
# workspace (at most 128 KiB: TMA descriptors per SM, 84,480 bytes on 132-SM H100/H200s;
# the handler checks the device's need on every call) and per group 128 bytes of device
# arrays (problem shape, A/B/C/D pointers and strides), plus alignment slack. Only calls
# CUTLASS may run get it: 16-bit operands (and, for the wgrad, an fp32 accumulator);
# others get an empty buffer.
CUTLASS_WORKSPACE_BYTES = 128 << 10
CUTLASS_BYTES_PER_GROUP = 128
_CUTLASS_SLACK = 256 + 256


def cutlass_scratch_bytes(groups: int) -> int:
    """Bytes of the CUDA handlers' scratch result for ``groups`` groups (16-bit operands)."""
    return _CUTLASS_SLACK + CUTLASS_WORKSPACE_BYTES + CUTLASS_BYTES_PER_GROUP * groups


def _scratch(nbytes: int) -> list[jax.core.ShapedArray]:
    return [jax.core.ShapedArray((nbytes,), jnp.uint8)]


def _sixteen_bit(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _matmul_scratch(platform, x, w, group_sizes, **_):
    if platform != "cuda":
        return []
    return _scratch(cutlass_scratch_bytes(w.shape[0]) if _sixteen_bit(x.dtype) else 0)


def _wgrad_scratch(platform, x, dy, group_sizes, main_grad, index, **_):
    if platform != "cuda":
        return []
    cutlass = _sixteen_bit(x.dtype) and jnp.dtype(main_grad.dtype) == jnp.dtype(jnp.float32)
    return _scratch(cutlass_scratch_bytes(group_sizes.shape[0]) if cutlass else 0)


def _cuda_module():
    import importlib

    return importlib.import_module("jax_wgrad._wgrad_ffi_cuda")


def set_cuda_kernel(kernel: str) -> str:
    """Chooses the CUDA ragged handlers' kernels for the calls they enqueue from now on:
    ``"auto"`` (CUTLASS on Hopper where it applies, else WMMA) or ``"wmma"`` (always the
    WMMA kernels). Returns the previous choice. Process-wide; a program already recorded
    into a CUDA graph keeps its kernels (``jax.clear_caches()`` recompiles). The initial
    choice is ``JAX_WGRAD_RAGGED_KERNEL`` (``auto`` when unset). The ragged family's
    self-check (:func:`jax_wgrad.ops.op_status`) checks the kernels chosen when it runs,
    once per process (it includes shapes CUTLASS takes): choose with the environment
    variable to have the kernels that will run checked before use.

    Raises:
      ValueError: another name.
      ImportError: the CUDA handlers are not built or cannot be loaded.
    """
    if kernel not in ("auto", "wmma"):
        raise ValueError(f"set_cuda_kernel: kernel must be 'auto' or 'wmma', got {kernel!r}")
    module = _cuda_module()
    previous = module.ragged_kernel()
    module.set_ragged_kernel(kernel)
    return previous


def cuda_kernel_launches() -> dict[str, int]:
    """How often the CUDA ragged handlers enqueued CUTLASS and WMMA kernels since they were
    loaded: ``{"cutlass": n, "wmma": m}`` (a call recorded into a CUDA graph counts once,
    when recorded).

    Raises:
      ImportError: the CUDA handlers are not built or cannot be loaded.
    """
    return dict(_cuda_module().ragged_kernel_launches())


# ---- primitives ------------------------------------------------------------------------

# Other platforms (TPU, ROCm, ...) have no lowering, so jax refuses to compile (as for
# ops.wgrad_accumulate); the plain-XLA references are there to call instead. vmap is a
# loop over the batch (lax.map); an unbatched accumulator gets one copy per example.
RAGGED_MATMUL = FfiPrimitive(
    name="ragged_matmul",
    target=RAGGED_MATMUL_TARGET,
    attributes={"transpose_rhs": np.int32, "precision": np.int32},
    abstract=lambda x, w, group_sizes, *, transpose_rhs, precision: x.update(
        shape=(x.shape[0], w.shape[1] if transpose_rhs else w.shape[2])
    ),
    vmap_method="sequential",
    family="ragged",
    scratch=_matmul_scratch,
    self_check=_matmul_self_check,
)
"""``ragged_matmul(x, w, group_sizes, *, transpose_rhs, precision) -> y``."""
RAGGED_WGRAD_ACCUMULATE = FfiPrimitive(
    name="ragged_wgrad_accumulate",
    target=RAGGED_WGRAD_TARGET,
    attributes={"base": np.int64, "stride": np.int64, "precision": np.int32},
    aliases={3: 0},
    vmap_method="sequential",
    family="ragged",
    per_example=(3,),
    scratch=_wgrad_scratch,
    self_check=_wgrad_self_check,
)
"""``ragged_wgrad_accumulate(x, dy, group_sizes, main_grad, index, *, base, stride,
precision) -> main_grad``: group 0's block at ``base + index * stride`` (an int32 scalar
operand, int64 parameters; read only for a flat ``main_grad``)."""
ragged_matmul_p = RAGGED_MATMUL.primitive
ragged_wgrad_accumulate_p = RAGGED_WGRAD_ACCUMULATE.primitive


# ---- validation ------------------------------------------------------------------------


def _shapes(**arrays) -> str:
    return ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items())


def _check_sizes(who: str, group_sizes, groups: int | None, shapes: str) -> jax.Array:
    """group_sizes as int32 [G]; ``groups``: the G it must have (None: any)."""
    group_sizes = jnp.asarray(group_sizes)
    if (
        group_sizes.ndim != 1
        or groups not in (None, group_sizes.shape[0])
        or not jnp.issubdtype(group_sizes.dtype, jnp.integer)
    ):
        want = "[G]" if groups is None else f"[G] = [{groups}]"
        raise ValueError(f"{who}: group_sizes must be an integer array {want}; got {shapes}")
    return group_sizes.astype(jnp.int32)


def _check_matmul(x, w, group_sizes, transpose_rhs) -> jax.Array:
    shapes = _shapes(x=x, w=w, group_sizes=jnp.asarray(group_sizes))
    layout = (
        "[G, N, K] (transpose_rhs=True)" if transpose_rhs else "[G, K, N] (transpose_rhs=False)"
    )
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"ragged_matmul: x must be [R, K] and w {layout}; got {shapes}")
    k = w.shape[2] if transpose_rhs else w.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"ragged_matmul: x [R, K] and w {layout} disagree on K; got {shapes}")
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(
            "ragged_matmul: x and w must share one dtype: float32, bfloat16 or "
            f"float16; got {shapes}"
        )
    return _check_sizes("ragged_matmul", group_sizes, w.shape[0], shapes)


def _check_wgrad(x, dy, group_sizes, main_grad, offset) -> jax.Array:
    who = "ragged_wgrad_accumulate"
    shapes = _shapes(x=x, dy=dy, group_sizes=jnp.asarray(group_sizes), main_grad=main_grad)
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"{who}: x and dy must be [R, in] and [R, out]; got {shapes}")
    group_sizes = _check_sizes(who, group_sizes, None, shapes)
    groups = group_sizes.shape[0]
    d_out, d_in = dy.shape[1], x.shape[1]
    if offset is None and main_grad.shape != (groups, d_out, d_in):
        raise ValueError(
            f"{who}: main_grad must have shape [G, out, in] = "
            f"[{groups}, {d_out}, {d_in}]; got {shapes}"
        )
    if offset is not None:
        check_block(who, main_grad, offset, groups * d_out * d_in, "[G, out, in] blocks", shapes)
    check_dtypes(who, x, dy, main_grad, shapes)
    return group_sizes


# ---- public functions ------------------------------------------------------------------


def ragged_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = True,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Returns ``y [R, N]``: ``x[rows of g] @ op(w[g])`` for every group, zeros past them.

    Args:
      x: ``[R, K]`` rows sorted by group (f32, bf16 or f16).
      w: ``[G, N, K]`` (``transpose_rhs=True``, ``op(w) = w^T``: expert weights
        ``[E, out, in]`` in the forward) or ``[G, K, N]`` (``transpose_rhs=False``,
        ``op(w) = w``: the input gradient ``dy @ w[g]``), the dtype of ``x``.
      group_sizes: integer ``[G]`` rows per group, in order; clamped as the module
        docstring says (sizes may sum to less than ``R``, or past it).
      transpose_rhs: which layout ``w`` has (above).
      precision: ``jnp.dot``'s meaning and default (:func:`matmul_precision`).
    Returns:
      ``[R, N]`` in the dtype of ``x``, accumulated in fp32 and rounded once.
    Raises:
      ValueError: on ranks, shapes or dtypes other than the above.
      RuntimeError: at compile time, on a platform whose handler was not built.
    """
    group_sizes = _check_matmul(x, w, group_sizes, transpose_rhs)
    level = matmul_precision(precision)
    n = w.shape[1] if transpose_rhs else w.shape[2]
    if 0 in (x.shape[0], x.shape[1], n, w.shape[0]):
        return jnp.zeros((x.shape[0], n), x.dtype)
    return RAGGED_MATMUL.bind(
        x, w, group_sizes, transpose_rhs=int(bool(transpose_rhs)), precision=level
    )


def ragged_matmul_ref(
    x, w, group_sizes, *, transpose_rhs: bool = True, precision: PrecisionLike = None
) -> jax.Array:
    """Plain-XLA reference of :func:`ragged_matmul` (same clamping and rounding; ``G``
    dense products, masked)."""
    group_sizes = _check_matmul(x, w, group_sizes, transpose_rhs)
    return _matmul_xla(
        x, w, group_sizes, transpose_rhs=bool(transpose_rhs), precision=matmul_precision(precision)
    )


def _position_operands(offset: Offset | None) -> tuple[jax.Array, dict[str, int]]:
    """The handler's ``(index operand, {base, stride})`` of a position: a static int ``o``
    (or ``None``: 0) is ``base = o`` with a constant index 0 and ``stride = 0``."""
    position = as_block_offset(offset)
    if position is None:
        return jnp.asarray(np.int32(0)), {"base": offset or 0, "stride": 0}
    return (
        jnp.asarray(position.index, jnp.int32),
        {"base": position.base, "stride": position.stride},
    )


def ragged_wgrad_accumulate(
    x: jax.Array,
    dy: jax.Array,
    group_sizes: jax.Array,
    main_grad: jax.Array,
    *,
    offset: Offset | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Returns ``main_grad`` with ``dy[rows of g]^T @ x[rows of g]`` added to every
    group's ``[out, in]`` block, updated in place under XLA (donated, or a scan carry).

    Args:
      x: ``[R, in]`` expert inputs, rows sorted by group (f32, bf16 or f16).
      dy: ``[R, out]`` gradients of the expert outputs, same dtype.
      group_sizes: integer ``[G]`` rows per group, clamped as :func:`ragged_matmul`'s.
        A group of zero rows leaves its block as it is; rows past the groups are not read.
      main_grad: ``[G, out, in]`` accumulator (f32, or the 16-bit dtype of the inputs:
        accumulated in fp32, rounded once), or with ``offset`` a flat ``[N]`` buffer
        holding the ``G`` blocks back to back at ``[offset, offset + G * out * in)``.
      offset: element offset of group 0's block in a flat ``main_grad``: a Python int
        (static, any size, checked to fit), a :class:`~jax_wgrad.ops.BlockOffset` or an
        int32 scalar array (may be traced; the exact value is clamped into
        ``[0, N - G * out * in]`` like ``lax.dynamic_update_slice`` with
        ``allow_negative_indices=False``).
      precision: ``jnp.dot``'s meaning and default (:func:`matmul_precision`).
    Returns:
      The updated accumulator, shape and dtype of ``main_grad``.
    Raises:
      ValueError: on ranks, shapes, dtypes or an offset that does not fit.
      RuntimeError: at compile time, on a platform whose handler was not built.
    """
    group_sizes = _check_wgrad(x, dy, group_sizes, main_grad, offset)
    level = matmul_precision(precision)
    if 0 in (x.shape[0], x.shape[1], dy.shape[1], group_sizes.shape[0]):
        return main_grad
    index, position = _position_operands(offset)
    return RAGGED_WGRAD_ACCUMULATE.bind(
        x, dy, group_sizes, main_grad, index, **position, precision=level
    )


def ragged_wgrad_accumulate_ref(
    x, dy, group_sizes, main_grad, *, offset: Offset | None = None, precision: PrecisionLike = None
) -> jax.Array:
    """Plain-XLA reference of :func:`ragged_wgrad_accumulate` (same clamping, rounding)."""
    group_sizes = _check_wgrad(x, dy, group_sizes, main_grad, offset)
    return add_to_block(
        main_grad, _group_products(x, dy, group_sizes, matmul_precision(precision)), offset
    )
