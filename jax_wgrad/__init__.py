"""jax_wgrad: Megatron-LM's weight-gradient and gradient-buffer optimizations for JAX.

Tiers (bottom up): C++/CUDA FFI handlers in ``ffi/``; :mod:`jax_wgrad.ops` (the
``wgrad_accumulate`` primitive); :func:`linear` (custom_vjp routing weight gradients
into an fp32 main-grad accumulator); Flax NNX modules and training utilities.
"""

from jax_wgrad import ops
from jax_wgrad.accumulate import accumulate_gradients
from jax_wgrad.linear import linear
from jax_wgrad.nn import Linear, MainGrad
from jax_wgrad.ops import fusion_available, fusion_status, wgrad_accumulate

__all__ = [
    "Linear",
    "MainGrad",
    "accumulate_gradients",
    "fusion_available",
    "fusion_status",
    "linear",
    "ops",
    "wgrad_accumulate",
]
