"""Public testing utilities: the single-device reference model users check layouts with."""

from jax_wgrad.testing.moe_reference import reference_moe_mlp
from jax_wgrad.testing.reference import reference_logits, reference_loss

__all__ = ["reference_logits", "reference_loss", "reference_moe_mlp"]
