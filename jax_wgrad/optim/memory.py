"""Bytes per parameter of one device's training state, beside Megatron's figure.

Megatron's distributed-optimizer documentation gives the memory of parameters, gradient
buffers and (Adam) optimizer state per parameter, ``d`` the data-parallel size:

=============================  ==============  ===================
parameters, gradient buffers    no distributed  distributed
=============================  ==============  ===================
bf16 params, fp32 grads         18              ``2 + 4 + 12/d``
fp32 params, fp32 grads         16              ``4 + 4 + 8/d``
fp16 params, fp16 grads         20              ``2 + 2 + 16/d``
=============================  ==============  ===================

(The optimizer's share: Adam's two fp32 moments, 8 bytes; an fp32 copy of 16-bit
parameters, 4; an fp32 copy of 16-bit gradients, 4.) :func:`bytes_per_parameter` measures
the same categories from a :class:`~jax_wgrad.optim.DistributedOptimizer`'s bucket layout
and its optax state's shapes (no arrays, no devices) and states Megatron's figure beside
them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from jax_wgrad.optim.distributed import F32, DistributedOptimizer

__all__ = ["BytesPerParameter", "bytes_per_parameter", "megatron_bytes_per_parameter"]

ADAM_BYTES = 8
"""Adam's fp32 first and second moments per parameter (Megatron's figure assumes Adam)."""


def _bytes(tree: Any) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def megatron_bytes_per_parameter(
    param_dtype: Any, grad_dtype: Any, dp: int
) -> tuple[int, int, int]:
    """Megatron's ``(params, grads, optimizer numerator)`` bytes per parameter for Adam:
    the optimizer holds ``numerator / dp`` bytes per parameter (``dp = 1`` without the
    distributed optimizer).

    Args:
      param_dtype, grad_dtype: the parameter and gradient-buffer dtypes.
      dp: the data-parallel size the optimizer state is sharded over (>= 1).
    Raises:
      ValueError: ``dp`` < 1.
    """
    if dp < 1:
        raise ValueError(f"megatron_bytes_per_parameter: dp must be >= 1, got {dp}")
    p, g = np.dtype(param_dtype), np.dtype(grad_dtype)
    return p.itemsize, g.itemsize, 4 * (p != F32) + 4 * (g != F32) + ADAM_BYTES


@dataclasses.dataclass(frozen=True)
class BytesPerParameter:
    """One device's training state per parameter element it holds, by category (bytes),
    and Megatron's figure for the same dtypes and data-parallel sizes.

    Attributes:
      num_params: parameter elements one device holds (every leaf of its device tree:
        its tensor/expert shard of its pipeline stage's layers, and the embedding and
        head every stage holds).
      params: the parameters (2: bf16, 4: fp32).
      grads: the flat gradient buckets, padding included (4: fp32).
      master: the optimizer's fp32 copy of 16-bit parameters (``4/DP`` with the
        distributed optimizer, 4 without; ``2/DP`` as int16 remainders of bf16 parameters,
        ``DDPConfig.store_param_remainders``; 0 for fp32 parameters: they are their own
        main parameters).
      moments: the optax state (Adam: ``8/DP``, or 8; ``4/DP`` with bf16 moments).
      megatron: Megatron's figure (Adam) for the same parameter/gradient dtypes and
        data-parallel sizes, weighted by the parameters of each bucket (no padding).
      formula: Megatron's formula with its numbers, e.g. ``"2 + 4 + 12/2"``; terms of
        buckets that differ (another dtype, the expert-data-parallel size) are joined by
        ``" | "`` with their share of the parameters.
      distributed: whether the optimizer state is sharded over the data-parallel ranks.
    """

    num_params: int
    params: float
    grads: float
    master: float
    moments: float
    megatron: float
    formula: str
    distributed: bool

    @property
    def optimizer(self) -> float:
        """``master + moments``."""
        return self.master + self.moments

    @property
    def total(self) -> float:
        """``params + grads + optimizer``."""
        return self.params + self.grads + self.optimizer

    def summary(self) -> str:
        """One line, e.g. ``bytes per parameter on a device: params 2.00 + grads 4.00 +
        optimizer 6.00 (main params 2.00, optax 4.00) = 12.00; Megatron
        (distributed optimizer): 2 + 4 + 12/2 = 12.00``."""
        mode = "distributed optimizer" if self.distributed else "no distributed optimizer"
        return (
            f"bytes per parameter on a device ({self.num_params:,} parameters): params "
            f"{self.params:.2f} + grads {self.grads:.2f} + optimizer {self.optimizer:.2f} "
            f"(main params {self.master:.2f}, optax {self.moments:.2f}) = "
            f"{self.total:.2f}; Megatron ({mode}, Adam): {self.formula} = "
            f"{self.megatron:.2f}"
        )


def bytes_per_parameter(optimizer: DistributedOptimizer) -> BytesPerParameter:
    """Bytes per parameter by category of one device's training state under
    ``optimizer`` (a :class:`~jax_wgrad.training.TrainPlan`'s ``optimizer``), and
    Megatron's figure for the same dtypes and data-parallel sizes.

    A pure function of the bucket layout (per-device parameter shapes and dtypes, bucket
    sizes, data-parallel sizes) and the optax transformation (its state's shapes by
    :func:`jax.eval_shape`): no array is made, no device is used.

    Args:
      optimizer: the distributed (or replicated) optimizer of a plan.
    Returns:
      :class:`BytesPerParameter`. E.g. Llama-3-8B on (dp 2, tp 2, pp 2) with the
      distributed optimizer and bf16 parameters: params 2, grads ~4, optimizer ~6
      (main params 2 + Adam 4), Megatron ``2 + 4 + 12/2 = 12``.
    """
    buf = optimizer.buffer
    n = buf.param_numel
    state = optimizer.state_shapes()
    terms: dict[tuple[int, int, int, int], int] = defaultdict(int)
    for s in buf.slots:
        for piece in s.pieces:  # a leaf laid out in row groups has a piece per bucket
            d = buf.bucket_dp_sizes[piece.bucket] if optimizer.distributed else 1
            p, g, o = megatron_bytes_per_parameter(
                s.param_dtype, buf.bucket_dtypes[piece.bucket], d
            )
            terms[(p, g, o, d)] += piece.size
    megatron = sum(k * (p + g + o / d) for (p, g, o, d), k in terms.items()) / n
    text = lambda p, g, o, d: f"{p} + {g} + {o}" + (f"/{d}" if d > 1 else "")
    if len(terms) == 1:
        formula = text(*next(iter(terms)))
    else:
        formula = " | ".join(
            f"{text(*t)} ({100 * k / n:.0f}%)"
            for t, k in sorted(terms.items(), key=lambda tk: -tk[1])
        )
    return BytesPerParameter(
        num_params=n,
        params=sum(s.size * np.dtype(s.param_dtype).itemsize for s in buf.slots) / n,
        grads=sum(k * np.dtype(d).itemsize for k, d in zip(buf.bucket_numels, buf.bucket_dtypes))
        / n,
        master=_bytes(state.master) / n,
        moments=_bytes(state.inner) / n,
        megatron=megatron,
        formula=formula,
        distributed=optimizer.distributed,
    )
