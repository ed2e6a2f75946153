"""Any NNX model of the form ``embed -> N identical layers -> head`` through the pipeline.

A user's model is a plain Flax NNX module built from the library's layers
(:mod:`jax_wgrad.nn`), callable on one device like any other model. Its config subclasses
:class:`LayerStackConfig` (a frozen dataclass with ``num_layers``, ``seq_length`` and
``hidden_size``) and says how to build it; everything the pipeline needs is derived from
the module itself:

* the model has three attributes: ``embed`` (``tokens [b, s] -> [b, s(/tp), H]``),
  ``layers`` (an ``nnx.List`` of ``num_layers`` layers built alike, ``[b, s(/tp), H]`` to
  the same) and ``head`` (``(x, labels [b, s]) -> fp32 SUM of the token losses``);
* the canonical parameters are ``{"embed": ..., "layers": ... stacked [L, ...], "head":
  ...}`` (:meth:`LayerStackConfig.canonical_params`), split over ``tensor`` / ``pipeline`` as
  the layers' parameter metadata says (:func:`~jax_wgrad.models.trees.specs_of`);
* the gradient layout (stage chunk: the stacked layers; shared chunk: embed and head), which
  weights are fused, decayed or tensor-replicated: from the same metadata
  (:func:`~jax_wgrad.models.trees.grad_spec_of`); the layers run as one ``lax.scan``
  (:func:`~jax_wgrad.functional.scan_layers`, Megatron's recompute options applied per
  layer).

Where each fused weight's gradient goes rides on the weight's variable (its ``wgrad``
metadata, set by the executor: :mod:`jax_wgrad.functional.routes`): the model never sees a
bucket, and the same module computes the single-device loss. ``examples/custom_model.py``
is a Llama built this way. What the stack does not do (the GPT does): tied embeddings, MoE
layers, the vocabulary split over the pipeline, and deferral's ``recompute`` mode.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jax_wgrad.parallel.pipeline.virtual as virtual
from jax_wgrad.functional.recompute import LayerRecompute
from jax_wgrad.functional.stacked import scan_layers
from jax_wgrad.grads.chunks import Chunks, DeviceTree, Window
from jax_wgrad.grads.spec import INPUT, LAYERS, OUTPUT, SHARED, STAGE
from jax_wgrad.models.trees import (
    forward_order,
    from_forward_order,
    grad_spec_of,
    pure_dict,
    registration_order,
    specs_of,
    walk_variables,
)
from jax_wgrad.ops.registry import DENSE_FAMILIES
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline.setup import StageSetup

__all__ = ["LayerStackConfig", "LayerStackProgram"]

Params = dict[str, Any]
PARTS = ("embed", "layers", "head")


class LayerStackConfig:
    """Base of a user model's config (subclass it as a frozen dataclass; see the module
    docstring). The subclass has the fields ``num_layers``, ``seq_length`` and
    ``hidden_size`` and implements :meth:`build`; ``compute_dtype`` (default float32) is
    the activations' dtype between stages."""

    num_layers: int
    seq_length: int
    hidden_size: int
    compute_dtype: str = "float32"

    def build(self, *, tp_size: int, sequence_parallel: bool, rngs: nnx.Rngs) -> nnx.Module:
        """The model for ``tp_size`` tensor ranks (``1``: the single-device model): a module
        with ``embed``, ``layers`` and ``head`` (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build()")

    # -- ModelConfig

    def validate(self, parallel: ParallelConfig) -> None:
        """Raises ``ValueError`` for a layout the stack cannot run."""
        name = type(self).__name__
        stages = parallel.pipeline_model_parallel_size * parallel.num_model_chunks
        if self.num_layers % stages:
            raise ValueError(
                f"{name}: num_layers ({self.num_layers}) must be divisible by "
                f"pipeline_model_parallel_size x virtual pipeline stages ({stages})"
            )
        unsupported = {
            "expert_model_parallel_size > 1 (the stack has no MoE layers)": (
                parallel.expert_model_parallel_size > 1
            ),
            "vocab_parallel_over_pipeline (the head runs on the last stage only)": (
                parallel.vocab_parallel_over_pipeline
            ),
            "defer_mode='recompute' (needs the model's output-gradient recompute; use "
            "'stash')": parallel.defer_embedding_wgrad_compute
            and parallel.defer_mode == "recompute",
        }
        for what, bad in unsupported.items():
            if bad:
                raise ValueError(f"{name}: a layer stack does not support {what}")
        parallel.local_seq_length(self.seq_length)  # sequence parallelism divides it

    def program(self, parallel: ParallelConfig, platform: str | None = None) -> LayerStackProgram:
        """The stage programs for ``parallel``."""
        return LayerStackProgram(self, parallel, platform)

    def shape_differences(self, saved: dict) -> list[tuple[str, Any, Any]]:
        """``(field, saved, this)`` for every field on which a checkpoint's config differs
        (any field may shape the parameters of a user's model)."""
        now = dataclasses.asdict(self)  # type: ignore[call-overload]
        return [(k, saved[k], v) for k, v in now.items() if k in saved and saved[k] != v]

    # -- parameters

    def canonical_params(self, model: nnx.Module | nnx.State | Params) -> Params:
        """A built model's parameters in the canonical form: ``{"embed", "layers" stacked
        [L, ...], "head"}`` (also how its gradients, e.g. ``nnx.grad``'s, are compared)."""
        if isinstance(model, nnx.Module):
            state = pure_dict(model)
        elif isinstance(model, nnx.State):  # e.g. nnx.grad's gradients
            state = nnx.to_pure_dict(model)
        else:
            state = model
        if len(state["layers"]) != self.num_layers:
            raise ValueError(
                f"{type(self).__name__}: the model has {len(state['layers'])} layers, "
                f"num_layers is {self.num_layers}"
            )
        layers = [state["layers"][i] for i in range(self.num_layers)]
        return {
            "embed": state["embed"],
            "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers),
            "head": state["head"],
        }

    def init_params(self, seed: int) -> Params:
        """Full canonical parameters from ``seed`` (the single-device model's)."""
        model = self.build(tp_size=1, sequence_parallel=False, rngs=nnx.Rngs(seed))
        return self.canonical_params(model)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStackProgram:
    """A :class:`LayerStackConfig` model's stage programs
    (:class:`~jax_wgrad.parallel.pipeline.program.StageProgram`): ``pre`` runs ``embed`` on
    ``batch[:, :-1]``, ``body`` this stage's layers as one scan, ``post`` the ``head`` on
    the labels ``batch[:, 1:]``."""

    model: LayerStackConfig
    parallel: ParallelConfig
    platform: str | None = None
    ends_over_pipeline = False  # pre / post on the first / last stage only
    stacks_layers = True  # body: one scan_layers over the stacked layers
    fused_op_families = DENSE_FAMILIES  # no expert layers

    def __post_init__(self) -> None:
        par = self.parallel
        build = lambda tp, sp: self.model.build(tp_size=tp, sequence_parallel=sp, rngs=nnx.Rngs(0))
        sharded = nnx.eval_shape(
            lambda: build(par.tensor_model_parallel_size, par.sequence_parallel)
        )
        full = nnx.eval_shape(lambda: build(1, False))
        parts = {"embed": sharded.embed, "layers": sharded.layers[0], "head": sharded.head}
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("_defs", {k: nnx.split(m)[0] for k, m in parts.items()})
        set_("_states", {k: nnx.split(m)[1] for k, m in parts.items()})
        set_(  # read from the abstract model built above (no rebuild)
            "_orders",
            {
                "embed": registration_order(lambda: full.embed),
                "layers": registration_order(lambda: full.layers[0]),
                "head": registration_order(lambda: full.head),
            },
        )
        set_(
            "_canonical_specs",
            {
                "embed": specs_of(full.embed),
                "layers": specs_of(full.layers[0], (PIPELINE,)),
                "head": specs_of(full.head),
            },
        )
        set_(
            "setup",
            StageSetup.create(
                par,
                seq_length=self.model.seq_length,
                hidden_size=self.model.hidden_size,
                dtype=self.model.compute_dtype,
            ),
        )

    # -- parameters and the device tree

    @property
    def _chunks(self) -> int:
        return self.parallel.num_model_chunks

    def init_params(self, seed: int = 0) -> Params:
        return self.from_canonical(self.model.init_params(seed))

    def canonical_specs(self) -> Params:
        return self._canonical_specs

    def param_specs(self) -> Params:
        return virtual.layout_specs(self._canonical_specs, self._chunks)

    def to_canonical(self, params: Params) -> Params:
        return virtual.to_canonical(params, self._canonical_specs, self._chunks)

    def from_canonical(self, params: Params) -> Params:
        return virtual.from_canonical(params, self._canonical_specs, self._chunks)

    def device_tree(self, params: Params) -> DeviceTree:
        """Per-device layout params -> ``Chunks(stage=[the stacked layers], experts=[],
        shared={embed, head})``, each in forward order."""
        local = virtual.local_stack(params, self._canonical_specs, self._chunks)
        order = lambda k: forward_order(local[k], self._orders[k])
        shared = collections.OrderedDict(embed=order("embed"), head=order("head"))
        return Chunks(stage=[order("layers")], experts=[], shared=shared)

    def canonical_tree(self, tree: DeviceTree) -> Params:
        params = {
            "embed": from_forward_order(tree.shared["embed"]),
            "layers": from_forward_order(tree.stage[0]),
            "head": from_forward_order(tree.shared["head"]),
        }
        return virtual.local_chunks(params, self._canonical_specs, self._chunks)

    def grad_specs(self) -> DeviceTree:
        """Layers in the stage chunk (fused in ``LAYERS``), ``embed`` produced by ``INPUT``
        and ``head`` by ``OUTPUT`` in the shared chunk; fused, decayed and
        tensor-replicated as their parameters' metadata says."""
        spec = lambda part, chunk, role: forward_order(
            walk_variables(self._states[part], lambda v: grad_spec_of(v, chunk, {role}, role)),
            self._orders[part],
        )
        shared = collections.OrderedDict(
            embed=spec("embed", SHARED, INPUT), head=spec("head", SHARED, OUTPUT)
        )
        return Chunks(stage=[spec("layers", STAGE, LAYERS)], experts=[], shared=shared)

    # -- the stage programs

    def _module(self, part: str, params: Any) -> nnx.Module:
        return nnx.merge(self._defs[part], from_forward_order(params))

    def pre(self, params: DeviceTree, batch: jax.Array) -> tuple[jax.Array, tuple]:
        """Tokens ``[mb, S + 1]`` -> ``embed(batch[:, :-1])``."""
        return self._module("embed", params.shared["embed"])(batch[:, :-1]), ()

    def body(
        self, params: DeviceTree, x: jax.Array, layers: Window | None = None
    ) -> tuple[jax.Array, tuple]:
        """This stage's layers (with ``layers``: model chunk ``layers.index``'s) as one scan."""
        stack = params.stage[0]
        rows = None
        if layers is not None and layers.count > 1:
            per_chunk = jax.tree.leaves(stack)[0].shape[0] // layers.count
            rows = (layers.index * per_chunk, per_chunk)
        par = self.parallel
        recompute = LayerRecompute(
            par.recompute_granularity, par.recompute_method, par.recompute_num_layers
        )
        with jax.named_scope("layers"):
            y, _ = scan_layers(
                lambda p, h: (self._module("layers", p)(h), ()),
                x,
                stack,
                rows=rows,
                recompute=recompute,
            )
        return y, ()

    def post(
        self, params: DeviceTree, y: jax.Array, batch: jax.Array, *, output_grad_extras=False
    ) -> tuple[jax.Array, tuple]:
        """``head(y, batch[:, 1:])``: the fp32 sum of the microbatch's token losses."""
        if output_grad_extras:
            self._no_recompute_deferral()
        return self._module("head", params.shared["head"])(y, batch[:, 1:]), ()

    def metrics(self, aux_sum) -> dict[str, jax.Array]:
        return {}

    # -- deferral's recompute mode: not for a layer stack (its head is the user's)

    def _no_recompute_deferral(self):
        raise ValueError(
            f"{type(self.model).__name__}: a layer stack does not support "
            "defer_mode='recompute' (use 'stash')"
        )

    def defer_extras(self, post_aux, batch: jax.Array) -> tuple[jax.Array, ...]:
        self._no_recompute_deferral()

    def recompute_output_grad(self, x: jax.Array, extras, weight: jax.Array) -> jax.Array:
        self._no_recompute_deferral()
