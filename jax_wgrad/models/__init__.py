"""Tier: models built from the NNX layers (:mod:`jax_wgrad.models.gpt`)."""
