"""jax_wgrad: Megatron-LM's weight-gradient and gradient-buffer optimizations for JAX."""

from jax_wgrad import ops
from jax_wgrad.linear import linear

__all__ = ["ops", "linear"]
