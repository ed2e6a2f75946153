"""The GPT as per-stage pure functions of the device tree, for the pipeline executor."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.moe import MoEStats

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

    Everything works on the *device tree* ``(layers, experts, shared)`` of
    :func:`~jax_wgrad.models.gpt.params.device_tree`: ``layers`` is the list of this
    stage's per-layer trees, ``experts`` the expert weights of its MoE layers (empty for a
    dense model), ``shared`` the embedding/head tree every stage holds. The
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
        emb, layer, moe_layer, head = abstract_modules(
            self.model, self.parallel.tensor_model_parallel_size, self.parallel.sequence_parallel,
            self.model.attention_implementation(self.platform),
            self.parallel.expert_model_parallel_size)
        object.__setattr__(self, "_emb_def", nnx.split(emb)[0])
        object.__setattr__(self, "_layer_def", nnx.split(layer)[0])
        object.__setattr__(self, "_moe_layer_def",
                           None if moe_layer is None else nnx.split(moe_layer)[0])
        object.__setattr__(self, "_head_def", nnx.split(head)[0])

    @property
    def tied(self) -> bool:
        return not self.model.untie_embeddings_and_output_weights

    @property
    def num_local_layers(self) -> int:
        return self.model.num_layers // self.parallel.pipeline_model_parallel_size

    @property
    def local_pattern(self) -> tuple[bool, ...]:
        """Per layer of a stage: an MoE layer (the same on every stage)."""
        return self.model.moe_layer_pattern[:self.num_local_layers]

    # -- parameters and the device tree

    def init_params(self, seed: int = 0) -> Params:
        """Full canonical parameters from ``seed`` (:func:`~jax_wgrad.models.gpt.init_params`)."""
        return init_params(self.model, seed)

    def param_specs(self) -> Params:
        """``PartitionSpec`` of every canonical parameter on the mesh."""
        return param_specs(self.model)

    def device_tree(self, params: Params):
        """Canonical per-device params -> ``(layers, experts, shared)``."""
        return device_tree(params, self.local_pattern)

    def canonical_tree(self, tree) -> Params:
        """Inverse of :meth:`device_tree`."""
        return canonical_tree(tree, self.local_pattern)

    def grad_specs(self):
        """:class:`~jax_wgrad.grads.GradSpec` of every leaf of the device tree."""
        return grad_specs(self.model, self.num_local_layers)

    # -- the pipeline's pieces

    def embed(self, shared, ids: jax.Array) -> jax.Array:
        """int ``[b, s]`` -> ``[b, s(/tp), H]`` (first stage)."""
        return nnx.merge(self._emb_def, from_forward_order(shared["embedding"]))(ids)

    def layers(
        self,
        stage_params: tuple[Sequence[Mapping], Sequence[Mapping]],
        main_grads: Sequence[Mapping[str, Any]] | None,
        x: jax.Array,
        *,
        with_stats: bool = False,
    ):
        """This stage's ``L / P`` layers in order, unrolled.

        Unrolled, not scanned, so that each layer's main grads are STATIC slices of the
        flat gradient buckets. ``stage_params``: ``(layers, experts)`` of the device tree.
        ``main_grads``: per layer ``{linear name: main grad}`` (an ``[out, in]``
        accumulator or a :class:`~jax_wgrad.functional.BucketSlot`; an MoE layer's
        ``"experts"``: its two expert weights' slots), or ``None``;
        :meth:`layer_main_grads` builds them from per-leaf slot trees.

        Returns ``y``, or with ``with_stats`` ``(y, stats)``: the stage's MoE layers'
        statistics summed (:meth:`moe_stats_zeros` for a stage without MoE layers).
        """
        layer_params, expert_params = stage_params
        stats: list = []
        experts = iter(expert_params)
        with jax.named_scope("transformer_layers"):
            for i, (p, moe) in enumerate(zip(layer_params, self.local_pattern)):
                mg = None if main_grads is None else main_grads[i]
                p = from_forward_order(p)
                if moe:
                    p["experts"] = from_forward_order(next(experts))
                x = nnx.merge(self._moe_layer_def if moe else self._layer_def, p)(
                    x, main_grads=mg, moe_stats=stats)
        if not with_stats:
            return x
        total = self.moe_stats_zeros()
        for st in stats:
            routed = jnp.sum(st.tokens_per_expert)
            total = MoEStats(total.aux_loss + st.aux_loss,
                             total.tokens_per_expert + st.tokens_per_expert,
                             total.dropped_fraction + st.dropped_fraction * routed)
        return x, total

    def moe_stats_zeros(self) -> MoEStats:
        """Zero :class:`~jax_wgrad.functional.MoEStats` sums: ``aux_loss``,
        ``tokens_per_expert [E]`` and, in ``dropped_fraction``'s place, the dropped COUNT
        (what :meth:`layers` sums over a stage's MoE layers)."""
        e = self.model.num_moe_experts or 0
        return MoEStats(jnp.float32(0.0), jnp.zeros((e,), jnp.float32), jnp.float32(0.0))

    def layer_main_grads(self, slot_trees) -> list[dict[str, Any]]:
        """``(layers, experts)`` trees (shaped like the stage's parameters) holding a main
        grad at each fused weight -> per-layer ``{linear name: main grad}`` for
        :meth:`layers`."""
        layer_trees, expert_trees = slot_trees
        experts = iter(expert_trees)
        out = []
        for tree, moe in zip(layer_trees, self.local_pattern):
            mg = {n: tree[n]["weight"] for n in LINEAR_LAYERS
                  if n in tree and tree[n]["weight"] is not None}
            if moe:
                e = next(experts)
                if e["fc1"] is not None:
                    mg["experts"] = (e["fc1"], e["fc2"])
            out.append(mg)
        return out

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
