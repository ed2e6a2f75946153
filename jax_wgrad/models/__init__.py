"""Tier: models built from the NNX layers: the GPT (:mod:`jax_wgrad.models.gpt`) and any
user model of the form ``embed -> N identical layers -> head``
(:class:`~jax_wgrad.models.stack.LayerStackConfig`)."""

from jax_wgrad.models.stack import LayerStackConfig, LayerStackProgram

__all__ = ["LayerStackConfig", "LayerStackProgram"]
