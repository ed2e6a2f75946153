"""The ``jax.ad_checkpoint.checkpoint_name`` of activations the pipeline's default
recompute policies keep although ``jax.checkpoint``'s ``dots_saveable`` cannot see them:
outputs of the library's custom-call GEMMs (the ragged expert GEMMs), of the MoE
layer's token exchanges and of a row-parallel linear's tensor-parallel reduction (so the
backward neither recomputes the forward's expert GEMMs nor repeats its all-to-alls or
reduce-scatters). The per-layer recompute policies
(:mod:`jax_wgrad.functional.stacked`) save this name unless the layer is recomputed
(``recompute_granularity="full"``)."""

from __future__ import annotations

__all__ = ["SAVED"]

SAVED = "jax_wgrad_saved"
"""Checkpoint name of an activation to keep for the backward."""
