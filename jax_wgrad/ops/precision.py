"""Matmul precision with ``jnp.dot``'s meaning, as the number XLA and the handlers use."""

from __future__ import annotations

import jax

__all__ = ["PrecisionLike", "matmul_precision"]

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
