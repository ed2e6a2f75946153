"""Tier 1: the XLA FFI ops, the handlers they call, and whether those work.

Three floors, each importing only those below it: :mod:`~jax_wgrad.ops.handlers` loads
and registers the compiled handlers (target names, op families, platforms);
:mod:`~jax_wgrad.ops.primitive` and the op modules (:mod:`~jax_wgrad.ops.wgrad`,
:mod:`~jax_wgrad.ops.bucket_add`, :mod:`~jax_wgrad.ops.ragged`, :mod:`~jax_wgrad.ops.fp8`)
declare the ops on them; :mod:`~jax_wgrad.ops.status` runs them to show that they work.

* :func:`wgrad_accumulate`: ``main_grad += dy^T x`` as one GEMM with beta = 1, in place
  (optionally into a flat bucket at an offset: a static int of any size, or a traced
  :class:`BlockOffset` ``base + index * stride`` computed in 64 bits, clamped like
  ``lax.dynamic_update_slice``; an int32 scalar array ``o`` is ``BlockOffset(0, o, 1)``).
* :func:`grouped_wgrad_accumulate`: the same for expert weights ``[E, out, in]``, all
  experts in one call (one strided-batched GEMM on a GPU), into a bucket or an array.
* :func:`ragged_matmul` / :func:`ragged_wgrad_accumulate`: the expert GEMMs of a dropless
  MoE layer on rows sorted into groups of run-time sizes (``y = x_g @ w[g]^T`` per group;
  ``main_grad[g] += dy_g^T x_g`` in place), work proportional to the routed rows.
* :func:`fp8_wgrad_accumulate`: the FP8 form, ``main_grad += (dy_scale_inv dy)^T
  (x_scale_inv x)`` for ``float8_e4m3fn`` inputs and ``float8_e4m3fn`` / ``float8_e5m2``
  gradients, into an fp32 accumulator or bucket block (one cuBLASLt FP8 GEMM on a GPU).
* :func:`bucket_add`: many gradients added into their own blocks of a flat bucket, in place.
* :func:`fusion_status` / :func:`fusion_available` / :func:`require_fusion`: whether the
  handlers of some op families (:data:`OP_FAMILIES`; by default :data:`DENSE_FAMILIES`,
  what a dense model's fused path needs) were shown to work on a platform;
  :func:`op_status`: per op family (:mod:`jax_wgrad.ops.status`).
* :func:`matmul_precision`: ``jnp.dot``'s ``precision`` as the handlers' number.
"""

from jax_wgrad.ops.bucket_add import bucket_add, bucket_add_p, bucket_add_ref
from jax_wgrad.ops.fp8 import (
    fp8_wgrad_accumulate,
    fp8_wgrad_accumulate_at_p,
    fp8_wgrad_accumulate_p,
    fp8_wgrad_accumulate_ref,
)
from jax_wgrad.ops.handlers import DENSE_FAMILIES, OP_FAMILIES
from jax_wgrad.ops.position import BlockOffset, Offset
from jax_wgrad.ops.precision import PrecisionLike, matmul_precision
from jax_wgrad.ops.ragged import (
    ragged_matmul,
    ragged_matmul_p,
    ragged_matmul_ref,
    ragged_wgrad_accumulate,
    ragged_wgrad_accumulate_p,
    ragged_wgrad_accumulate_ref,
)
from jax_wgrad.ops.status import fusion_available, fusion_status, op_status, require_fusion
from jax_wgrad.ops.wgrad import (
    WORKSPACE_BYTES,
    grouped_wgrad_accumulate,
    grouped_wgrad_accumulate_ref,
    is_traced_offset,
    wgrad_accumulate,
    wgrad_accumulate_at_p,
    wgrad_accumulate_p,
    wgrad_accumulate_ref,
)

__all__ = [
    "BlockOffset",
    "DENSE_FAMILIES",
    "OP_FAMILIES",
    "Offset",
    "PrecisionLike",
    "WORKSPACE_BYTES",
    "bucket_add",
    "bucket_add_p",
    "bucket_add_ref",
    "fp8_wgrad_accumulate",
    "fp8_wgrad_accumulate_at_p",
    "fp8_wgrad_accumulate_p",
    "fp8_wgrad_accumulate_ref",
    "fusion_available",
    "fusion_status",
    "grouped_wgrad_accumulate",
    "grouped_wgrad_accumulate_ref",
    "is_traced_offset",
    "matmul_precision",
    "op_status",
    "ragged_matmul",
    "ragged_matmul_p",
    "ragged_matmul_ref",
    "ragged_wgrad_accumulate",
    "ragged_wgrad_accumulate_p",
    "ragged_wgrad_accumulate_ref",
    "require_fusion",
    "wgrad_accumulate",
    "wgrad_accumulate_at_p",
    "wgrad_accumulate_p",
    "wgrad_accumulate_ref",
]
