"""FP8 training's numbers (Megatron's ``--fp8-format`` / ``--fp8-recipe``): per-tensor
scaling, quantization and the FP8 GEMM, for the library's linears.

**Formats** (Megatron's and TransformerEngine's): ``e4m3`` quantizes the layer inputs,
the weights and the output gradients to ``float8_e4m3fn``; ``hybrid`` keeps E4M3 for the
inputs and weights and uses ``float8_e5m2`` (more range, less precision) for the output
gradients.

**Scaling: per-tensor current scaling** (Megatron's ``--fp8-recipe tensorwise``,
TransformerEngine's ``Float8CurrentScaling``): each tensor is quantized with a scale from
its own absolute maximum, ``amax``, taken just before the GEMM. The scale is a **power of
two**: the largest ``2**e`` with ``amax * 2**e <= fp8_max`` (then ``2**-margin`` times
that, Megatron's ``--fp8-margin``), as TransformerEngine's block-scaling recipes force.
That costs at most one binade of range at the small end and buys exactness: dequantizing
(``value * 2**-e``) is exact in any float type, so the FP8 GEMM's output scale folds into
cuBLASLt's epilogue without a rounding, and the CPU (which computes the GEMM in float32 and
rounds once) gives the GPU's numbers up to the order of the float32 sums.

**Where the amax is taken.** A tensor split over the tensor-parallel ranks (a weight, a
row-parallel input, a column-parallel output gradient, a sequence-parallel shard) is
scaled by the amax over all its shards (a ``pmax`` over ``tensor``: Megatron's amax
reduction over the tensor-parallel group), so that every rank quantizes its shard exactly
as one device would quantize the whole tensor. A tensor every rank holds whole needs no
reduction. Each microbatch's activations and gradients have their own scales; a weight is
scaled anew at each use (its value does not change within a step, so every use gives the
same quantized weight).

**The GEMM.** :func:`fp8_dot` is ``dot_general`` on the FP8 values with the output type
given, times the product of the two dequantization factors: the pattern XLA:GPU's GEMM
rewriter turns into one cuBLASLt FP8 GEMM (``__cublas$lt$matmul$f8``, the scales as its
scale operands; tests/test_aot.py reads it in the H100 compile).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "Fp8Gemm",
    "Fp8Recipe",
    "Fp8Tensor",
    "Fp8Weight",
    "check_fp8_platform",
    "dequantize",
    "fp8_dot",
    "quantized_gradient",
    "quantize",
    "scale_exponent",
]

FP8_FORMATS = ("e4m3", "hybrid")
"""Megatron's ``--fp8-format`` choices."""
FP8_RECIPES = ("tensorwise", "delayed")
"""Megatron's ``--fp8-recipe`` choices that Hopper runs (``mxfp8`` is Blackwell's;
``blockwise`` is not built here)."""
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
"""Megatron's ``--fp8-amax-compute-algo`` choices (delayed scaling)."""

_EXPONENT_LIMIT = 63
"""``|e|`` of a scale ``2**e`` is at most this, so that the product of two dequantization
factors stays a normal float32 (and bfloat16). A tensor whose amax is below ``2**-54``
quantizes to zeros."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a model's linears run in FP8 (Megatron's options, the same names and defaults
    except the recipe, whose default here is ``tensorwise``).

    Attributes:
      format: ``"e4m3"`` or ``"hybrid"`` (``--fp8-format``; module docstring).
      recipe: ``"tensorwise"`` (per-tensor current scaling) or ``"delayed"``
        (``--fp8-recipe``). Only ``tensorwise`` is built: ``delayed`` is refused.
      margin: ``--fp8-margin``: scales are ``2**-margin`` times the largest that fits.
      amax_history_len: ``--fp8-amax-history-len`` (delayed scaling only).
      amax_compute_algo: ``--fp8-amax-compute-algo`` (delayed scaling only).
    """

    format: Literal["e4m3", "hybrid"] = "hybrid"
    recipe: Literal["tensorwise", "delayed"] = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: Literal["max", "most_recent"] = "most_recent"

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ValueError(
                f"fp8_format must be one of {', '.join(FP8_FORMATS)}, got {self.format!r}"
            )
        if self.recipe not in FP8_RECIPES:
            raise ValueError(
                f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.recipe!r}"
            )
        if self.recipe == "delayed":
            raise ValueError(
                "fp8_recipe 'delayed' (amax histories carried through the schedule and "
                "checkpoints) is not built yet; use 'tensorwise' (per-tensor current scaling)"
            )
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"fp8_margin must be an integer >= 0, got {self.margin!r}")
        if (
            not isinstance(self.amax_history_len, int)
            or isinstance(self.amax_history_len, bool)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"fp8_amax_history_len must be an integer >= 1, got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"fp8_amax_compute_algo must be one of {', '.join(AMAX_COMPUTE_ALGOS)}, "
                f"got {self.amax_compute_algo!r}"
            )
        history = (self.amax_history_len, self.amax_compute_algo)
        if self.recipe != "delayed" and history != (1, "most_recent"):
            raise ValueError(
                f"fp8_amax_history_len ({self.amax_history_len}) and fp8_amax_compute_algo "
                f"({self.amax_compute_algo!r}) are delayed scaling's; fp8_recipe "
                f"{self.recipe!r} scales each tensor by its own amax and keeps no history"
            )

    @property
    def forward_dtype(self) -> jnp.dtype:
        """The type of the layer inputs and weights: E4M3."""
        return jnp.dtype(jnp.float8_e4m3fn)

    @property
    def gradient_dtype(self) -> jnp.dtype:
        """The type of the output gradients: E5M2 in ``hybrid``, else E4M3."""
        return jnp.dtype(jnp.float8_e5m2 if self.format == "hybrid" else jnp.float8_e4m3fn)


def check_fp8_platform(platform: str) -> None:
    """Raises ``ValueError`` where FP8 GEMMs cannot run: a platform other than the CPU
    (exact, slow) and CUDA GPUs, or a CUDA GPU without FP8 tensor cores (compute
    capability below 8.9). Compiling for GPUs that are not here checks nothing."""
    if platform == "cpu":
        return
    if platform not in ("gpu", "cuda"):
        raise ValueError(
            f"fp8_format runs on CUDA GPUs of compute capability 8.9 or newer and on the "
            f"CPU; the platform is {platform!r}"
        )
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # compiling for GPUs that are not here
        return
    for d in devices:
        capability = getattr(d, "compute_capability", None)
        if capability and tuple(int(p) for p in capability.split(".")[:2]) < (8, 9):
            raise ValueError(
                f"fp8_format needs FP8 tensor cores (compute capability 8.9 or newer: "
                f"Ada, Hopper, Blackwell); {d.device_kind} has {capability}"
            )


class Fp8Tensor(NamedTuple):
    """A quantized tensor: ``value`` (FP8) times ``scale_inv`` (a float32 scalar, a power
    of two) is the real tensor."""

    value: jax.Array
    scale_inv: jax.Array


class Fp8Weight(NamedTuple):
    """A weight ``[out, in]`` quantized once for many GEMMs (TransformerEngine's cached
    FP8 weight, both its copies): ``rowwise`` ``[out, in]`` for the forward GEMM,
    ``columnwise`` ``[in, out]`` (the same values transposed) for the data-gradient GEMM --
    Hopper's FP8 GEMMs take both operands with the contracted dim innermost, so a
    data-gradient GEMM on ``rowwise`` would transpose it first, at every use -- and their
    ``scale_inv``."""

    rowwise: jax.Array
    columnwise: jax.Array
    scale_inv: jax.Array

    @classmethod
    def of(cls, q: Fp8Tensor) -> Fp8Weight:
        """``q`` (a quantized ``[out, in]`` weight) and its transpose."""
        return cls(q.value, q.value.T, q.scale_inv)

    def forward(self) -> Fp8Tensor:
        """``[out, in]``: the forward GEMM's operand."""
        return Fp8Tensor(self.rowwise, self.scale_inv)

    def transposed(self) -> Fp8Tensor:
        """``[in, out]``: the data-gradient GEMM's operand."""
        return Fp8Tensor(self.columnwise, self.scale_inv)


def scale_exponent(amax: jax.Array, dtype: jnp.dtype, margin: int = 0) -> jax.Array:
    """``e`` (int32) of the scale ``2**e`` of a tensor whose absolute maximum is ``amax``:
    the largest with ``amax * 2**e <= max(dtype)``, minus ``margin``, within
    ``[-63, 63]``; 0 for an amax of zero or not finite (the tensor's NaN or Inf then
    reaches the loss).

    Exact (no logarithm): with ``amax = m * 2**k`` and ``max = M * 2**K`` (``m, M`` in
    ``[0.5, 1)``), ``e = K - k`` when ``m <= M``, else ``K - k - 1``.
    """
    big_m, big_k = math.frexp(float(jnp.finfo(dtype).max))
    amax = jnp.asarray(amax, jnp.float32)
    m, k = jnp.frexp(amax)
    e = big_k - k - (m > big_m).astype(jnp.int32) - margin
    e = jnp.where((amax > 0) & jnp.isfinite(amax), e, 0)
    return jnp.clip(e, -_EXPONENT_LIMIT, _EXPONENT_LIMIT).astype(jnp.int32)


def quantize(
    x: jax.Array,
    dtype: jnp.dtype,
    *,
    margin: int = 0,
    amax_axis: str | tuple[str, ...] | None = None,
) -> Fp8Tensor:
    """``x`` (any shape, any float type) quantized to the FP8 ``dtype`` with its
    per-tensor power-of-two scale (module docstring).

    Args:
      x: the tensor (or this rank's shard of it).
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
      margin: Megatron's ``--fp8-margin``.
      amax_axis: ``x`` is a shard of a tensor split over this mesh axis: the amax is
        reduced over it (inside ``shard_map``), so every shard gets the whole tensor's
        scale.
    Returns:
      ``Fp8Tensor(value, scale_inv)``: ``value`` of ``x``'s shape in ``dtype``,
      ``scale_inv = 2**-e`` float32.
    """
    amax = jnp.max(jnp.abs(jax.lax.stop_gradient(x))).astype(jnp.float32)  # no derivative
    if amax_axis is not None:
        amax = jax.lax.pmax(amax, amax_axis)
    e = scale_exponent(amax, dtype, margin)
    top = jnp.float32(jnp.finfo(dtype).max)
    scaled = jnp.clip(x.astype(jnp.float32) * jnp.ldexp(jnp.float32(1), e), -top, top)
    return Fp8Tensor(scaled.astype(dtype), jnp.ldexp(jnp.float32(1), -e))


def dequantize(q: Fp8Tensor, dtype: jnp.dtype) -> jax.Array:
    """``q.value * q.scale_inv`` in ``dtype``: exact in any float type with float32's
    exponent range (an FP8 value has at most 4 significant bits, the scale is a power of
    two)."""
    return q.value.astype(dtype) * q.scale_inv.astype(dtype)


def fp8_dot(
    a: Fp8Tensor,
    b: Fp8Tensor,
    dimension_numbers: tuple,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """``lax.dot_general`` of two quantized tensors, dequantized: the FP8 values
    multiplied with float32 accumulation, the result in ``out_dtype`` times
    ``a.scale_inv * b.scale_inv`` (a power of two: exact). One cuBLASLt FP8 GEMM on a
    Hopper GPU (module docstring)."""
    y = jax.lax.dot_general(
        a.value, b.value, dimension_numbers, preferred_element_type=jnp.dtype(out_dtype)
    )
    return y * (a.scale_inv * b.scale_inv).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
    """One linear's FP8 GEMMs: the recipe, and which of its tensors are split over the
    tensor-parallel ``axis`` (their amax reduced over it; module docstring).

    Attributes:
      recipe: the :class:`Fp8Recipe`.
      axis: the tensor-parallel mesh axis (``None``: nothing is split).
      sharded: the tensors split over ``axis``, of ``"x"`` (the input), ``"w"`` (the
        weight) and ``"dy"`` (the output gradient).
      token_axis: the mesh axis the tokens are split over (context parallelism's; ``None``:
        none): the input's and the output gradient's amax are reduced over it too
        (Megatron's amax reduction group with context parallelism).
    """

    recipe: Fp8Recipe
    axis: str | None = None
    sharded: frozenset[str] = frozenset()
    token_axis: str | None = None

    @classmethod
    def column(cls, recipe: Fp8Recipe, axis: str | None, token_axis: str | None = None) -> Fp8Gemm:
        """A column-parallel linear: the weight and the output (gradient) split over
        ``axis``; its input whole (a sequence-parallel shard is reduced where the linear
        gathers it)."""
        return cls(recipe, axis, frozenset({"w", "dy"}) if axis else frozenset(), token_axis)

    @classmethod
    def row(cls, recipe: Fp8Recipe, axis: str | None, token_axis: str | None = None) -> Fp8Gemm:
        """A row-parallel linear: the input and the weight split over ``axis``; the
        output gradient whole (the reduction's conjugate gives every rank all of it)."""
        return cls(recipe, axis, frozenset({"x", "w"}) if axis else frozenset(), token_axis)

    def _axis(self, name: str, shard_axis: str | None = None) -> str | tuple[str, ...] | None:
        """The mesh axes ``name``'s amax is reduced over."""
        split = (
            shard_axis if shard_axis is not None else self.axis if name in self.sharded else None
        )
        axes = (() if split is None else (split,)) + (
            (self.token_axis,) if self.token_axis is not None and name in ("x", "dy") else ()
        )
        return axes[0] if len(axes) == 1 else (axes or None)

    def input(self, x: jax.Array, shard_axis: str | None = None) -> Fp8Tensor:
        """The input quantized (E4M3); ``shard_axis``: ``x`` is a sequence-parallel shard
        over that axis, to be gathered."""
        r = self.recipe
        return quantize(x, r.forward_dtype, margin=r.margin, amax_axis=self._axis("x", shard_axis))

    def weight(self, w: jax.Array) -> Fp8Tensor:
        """The weight quantized (E4M3)."""
        r = self.recipe
        return quantize(w, r.forward_dtype, margin=r.margin, amax_axis=self._axis("w"))

    def gradient(self, dy: jax.Array) -> Fp8Tensor:
        """The output gradient quantized (E5M2 in ``hybrid``, else E4M3)."""
        r = self.recipe
        return quantize(dy, r.gradient_dtype, margin=r.margin, amax_axis=self._axis("dy"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def quantized_gradient(y: jax.Array, gemm: Fp8Gemm) -> jax.Array:
    """Identity; its gradient is quantized as ``gemm``'s output gradient and dequantized
    (exactly): what zero bubble's split linear hands both its data-gradient GEMM and its
    weight-gradient task, so that the ``W`` task's GEMM sees the FP8 values."""
    return y


def _quantized_gradient_fwd(y, gemm):
    return y, None


def _quantized_gradient_bwd(gemm, _, g):
    return (dequantize(gemm.gradient(g), g.dtype),)


quantized_gradient.defvjp(_quantized_gradient_fwd, _quantized_gradient_bwd)
