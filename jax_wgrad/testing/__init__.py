"""Public testing utilities: the single-device reference model users check layouts with."""

from jax_wgrad.testing.moe_reference import reference_moe_mlp
from jax_wgrad.testing.reference import fp8_reference_linear, reference_logits, reference_loss

__all__ = ["fp8_reference_linear", "reference_logits", "reference_loss", "reference_moe_mlp"]
