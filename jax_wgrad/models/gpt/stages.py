"""The GPT as per-stage pure functions of the device tree, for the pipeline executor."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.modules import LINEAR_LAYERS
from jax_wgrad.models.gpt.params import (
    abstract_modules,
    canonical_tree,
    device_tree,
    from_forward_order,
    grad_specs,
    init_params,
    param_specs,
)
from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["GPTStages"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GPTStages:
    """The model's pieces as pure functions of one device's parameter shards.

    Everything works on the *device tree* ``(layers, shared)`` of
    :func:`~jax_wgrad.models.gpt.params.device_tree`: ``layers`` is the list of this
    stage's per-layer trees, ``shared`` the embedding/head tree every stage holds. The
    pipeline executor (:mod:`jax_wgrad.parallel.pipeline`) calls :meth:`embed` on the first
    stage, :meth:`layers` everywhere and :meth:`head_loss` on the last stage; gradients
    are laid out over the same tree (:meth:`grad_specs`).

    ``platform``: the jax platform the stages run on (default: jax's default backend),
    which resolves ``model.attention_backend``.
    """

    model: GPTConfig
    parallel: ParallelConfig
    platform: str | None = None

    def __post_init__(self) -> None:
        if self.platform is None:
            object.__setattr__(self, "platform", jax.default_backend())
        emb, layer, head = abstract_modules(
            self.model, self.parallel.tensor_model_parallel_size, self.parallel.sequence_parallel,
            self.model.attention_implementation(self.platform))
        object.__setattr__(self, "_emb_def", nnx.split(emb)[0])
        object.__setattr__(self, "_layer_def", nnx.split(layer)[0])
        object.__setattr__(self, "_head_def", nnx.split(head)[0])

    @property
    def tied(self) -> bool:
        return not self.model.untie_embeddings_and_output_weights

    @property
    def num_local_layers(self) -> int:
        return self.model.num_layers // self.parallel.pipeline_model_parallel_size

    # -- parameters and the device tree

    def init_params(self, seed: int = 0) -> Params:
        """Full canonical parameters from ``seed`` (:func:`~jax_wgrad.models.gpt.init_params`)."""
        return init_params(self.model, seed)

    def param_specs(self) -> Params:
        """``PartitionSpec`` of every canonical parameter on the mesh."""
        return param_specs(self.model)

    def device_tree(self, params: Params):
        """Canonical per-device params -> ``(layers, shared)``."""
        return device_tree(params)

    def canonical_tree(self, tree) -> Params:
        """Inverse of :meth:`device_tree`."""
        return canonical_tree(tree)

    def grad_specs(self):
        """:class:`~jax_wgrad.grads.GradSpec` of every leaf of the device tree."""
        return grad_specs(self.model, self.num_local_layers)

    # -- the pipeline's pieces

    def embed(self, shared, ids: jax.Array) -> jax.Array:
        """int ``[b, s]`` -> ``[b, s(/tp), H]`` (first stage)."""
        return nnx.merge(self._emb_def, from_forward_order(shared["embedding"]))(ids)

    def layers(
        self,
        layer_params: Sequence[Mapping],
        main_grads: Sequence[Mapping[str, Any]] | None,
        x: jax.Array,
    ) -> jax.Array:
        """This stage's ``L / P`` layers in order, unrolled.

        Unrolled, not scanned, so that each layer's main grads are STATIC slices of the
        flat gradient buckets. ``main_grads``: per layer ``{linear name: main grad}`` (an
        ``[out, in]`` accumulator or a :class:`~jax_wgrad.functional.BucketSlot`), or
        ``None``; :meth:`layer_main_grads` builds them from per-leaf slot trees.
        """
        with jax.named_scope("transformer_layers"):
            for i, p in enumerate(layer_params):
                mg = None if main_grads is None else main_grads[i]
                x = nnx.merge(self._layer_def, from_forward_order(p))(x, main_grads=mg)
            return x

    def layer_main_grads(self, slot_trees: Sequence[Mapping]) -> list[dict[str, Any]]:
        """Per-layer trees (shaped like the layer's parameters) holding a main grad at each
        fused weight -> per-layer ``{linear name: main grad}`` for :meth:`layers`."""
        return [{n: tree[n]["weight"] for n in LINEAR_LAYERS if tree[n]["weight"] is not None}
                for tree in slot_trees]

    def head_loss(self, shared, main_grad, x: jax.Array, labels: jax.Array) -> jax.Array:
        """Sum of per-token losses of ``x`` ``[b, s(/tp), H]`` (last stage); ``main_grad``
        accumulates the output-layer weight gradient."""
        head = nnx.merge(self._head_def, from_forward_order(shared["head"]))
        weight = shared["embedding"]["word"]["embedding"] if self.tied else None
        return head(x, labels, weight=weight, main_grad=main_grad)

    def final_norm(self, shared, x: jax.Array) -> jax.Array:
        """The head's final LayerNorm of ``x``."""
        return nnx.merge(self._head_def, from_forward_order(shared["head"])).final_norm(x)

    def output_weight(self, shared) -> jax.Array:
        """The output layer's ``[V / tp, H]`` weight shard (the word embedding when tied)."""
        if self.tied:
            return shared["embedding"]["word"]["embedding"]
        return shared["head"]["output"]["weight"]
