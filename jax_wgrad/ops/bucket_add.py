"""In-place block adds into a flat gradient bucket (Megatron's ``main_grad.add_(grad)``).

:func:`bucket_add` binds the ``bucket_add`` primitive, lowered to the XLA FFI custom call
``jax_wgrad_bucket_add`` with the bucket (operand 0) aliased to the result: every gradient
reads and writes only its own block, so on a donated argument or a scan carry no bucket is
copied, on CPU and GPU alike (a ``dynamic_update_slice`` at a constant offset copies the
whole bucket per block on XLA:GPU). Where the handler is unavailable it lowers to
:func:`bucket_add_ref`'s plain XLA instead (:class:`~jax_wgrad.ops.primitive.FfiPrimitive`'s
``fallback``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad.ops.handlers import BUCKET_ADD_TARGET
from jax_wgrad.ops.position import INT32_MAX
from jax_wgrad.ops.primitive import FfiPrimitive, ProbeCase
from jax_wgrad.ops.wgrad import FLOAT_DTYPES, added

__all__ = ["bucket_add", "bucket_add_p", "bucket_add_ref"]


def _bucket_add_xla(bucket, *grads, offsets):
    """The same update in plain XLA: one dynamic-slice/add/dynamic-update-slice per block.

    In place on XLA:CPU, but XLA:GPU copies the whole bucket for each block when the
    offsets are constants (docs/design/h100_findings.md, section 1); used only on platforms
    without a built handler. XLA's slice starts are int32 without x64, so an offset past
    ``2**31 - 1`` raises ``ValueError`` here (the handler takes int64 offsets).
    """
    for g, o in zip(grads, offsets):
        if o > INT32_MAX:
            raise ValueError(
                f"bucket_add: the plain-XLA path addresses offsets up to "
                f"{INT32_MAX} (int32 slice starts), got offset {o} for a "
                f"{g.dtype}{list(g.shape)} gradient in a bucket of "
                f"{bucket.shape[0]} elements; use a platform with the "
                "jax_wgrad handler"
            )
        flat = jnp.ravel(g).astype(jnp.float32)
        cur = jax.lax.dynamic_slice(bucket, (o,), (flat.shape[0],)).astype(jnp.float32)
        bucket = jax.lax.dynamic_update_slice(bucket, (cur + flat).astype(bucket.dtype), (o,))
    return bucket


def _self_check(rng) -> list[ProbeCase]:
    """Several blocks, a 16-bit gradient into a float32 bucket."""

    flat = rng.integers(-8, 9, size=40).astype(np.float32)
    g1 = np.arange(1, 4, dtype=np.float32)
    g2 = (np.arange(6, dtype=np.float32) - 2).reshape(2, 3)
    return [
        ProbeCase(
            "bucket_add of several blocks",
            lambda b, g1, g2: bucket_add(b, [g1, g2.astype(jnp.bfloat16)], [2, 30]),
            (flat, g1, g2),
            added(added(flat, 2, g1), 30, g2),
        )
    ]


BUCKET_ADD = FfiPrimitive(
    name="bucket_add",
    target=BUCKET_ADD_TARGET,
    attributes={"offsets": np.int64},
    aliases={0: 0},
    vmap_method=None,
    family="bucket_add",
    # Where the handler is unavailable, and on any other platform (TPU, ROCm, ...).
    fallback=_bucket_add_xla,
    self_check=_self_check,
)
bucket_add_p = BUCKET_ADD.primitive
"""``bucket_add(bucket, *grads, offsets)``: each gradient added into its block, in place."""


def _validate_bucket_add(bucket, grads, offsets) -> None:
    if bucket.ndim != 1 or bucket.dtype not in FLOAT_DTYPES:
        raise ValueError(
            "bucket_add: the bucket must be a flat float32, bfloat16 or float16 "
            f"array, got {bucket.dtype}{list(bucket.shape)}"
        )
    if len(grads) != len(offsets):
        raise ValueError(f"bucket_add: {len(offsets)} offsets for {len(grads)} gradients")
    spans = []
    for k, (g, o) in enumerate(zip(grads, offsets)):
        where = f"bucket_add: gradient {k} ({g.dtype}{list(g.shape)} at offset {o!r})"
        if g.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{where} must be float32, bfloat16 or float16")
        if (
            not isinstance(o, (int, np.integer))
            or isinstance(o, bool)
            or not (0 <= o <= bucket.shape[0] - g.size)
        ):
            raise ValueError(
                f"{where} must be a static int with the block inside the "
                f"bucket of {bucket.shape[0]} elements"
            )
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
    return BUCKET_ADD.bind(bucket, *(g for g, _ in keep), offsets=tuple(o for _, o in keep))


def bucket_add_ref(bucket: jax.Array, grads, offsets) -> jax.Array:
    """Plain-XLA reference of :func:`bucket_add` (same rounding)."""
    grads = list(grads)
    _validate_bucket_add(bucket, grads, list(offsets))
    return _bucket_add_xla(bucket, *grads, offsets=tuple(int(o) for o in offsets))
