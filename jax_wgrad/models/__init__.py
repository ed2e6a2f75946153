"""Tier: models built from the NNX layers: the GPT (:mod:`jax_wgrad.models.gpt`) and any
user model of the form ``embed -> N identical layers -> head``
(:class:`~jax_wgrad.models.stack.LayerStackConfig`). A model supplies its modules
(:class:`~jax_wgrad.models.parts.ModelParts`) and its stage functions; the layout tier
(:mod:`jax_wgrad.layout`) derives everything else from the modules' metadata."""

from jax_wgrad.models.parts import LayerKind, ModelParts
from jax_wgrad.models.stack import LayerStackConfig, LayerStackProgram

__all__ = ["LayerKind", "LayerStackConfig", "LayerStackProgram", "ModelParts"]
