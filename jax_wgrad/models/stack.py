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
  ...}`` (:meth:`LayerStackConfig.canonical_params`); the program hands the library's
  layout these three parts (:meth:`LayerStackProgram.parts`), which derives their sharding
  over ``tensor`` / ``pipeline`` and the gradient layout (stage chunk: the stacked layers;
  shared chunk: embed and head; which weights are fused, decayed or tensor-replicated) from
  the layers' parameter metadata (:class:`~jax_wgrad.layout.StageLayout`); the layers run as
  one ``lax.scan`` (:func:`~jax_wgrad.functional.scan_layers`, Megatron's recompute options
  applied per layer).

Where each fused weight's gradient goes rides on the weight's variable (its ``wgrad``
metadata, set by the executor: :mod:`jax_wgrad.functional.routes`): the model never sees a
bucket, and the same module computes the single-device loss. ``examples/custom_model.py``
is a Llama built this way. What the stack does not do (the GPT does): tied embeddings, MoE
layers, the vocabulary split over the pipeline, and deferral's ``recompute`` mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.residual_slots import ResidualSlots
from jax_wgrad.functional.stacked import LayerRecompute, scan_layers
from jax_wgrad.grads.chunks import DeviceTree, Window
from jax_wgrad.models.parts import LayerKind, ModelParts
from jax_wgrad.ops.handlers import DENSE_FAMILIES
from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["LayerStackConfig", "LayerStackProgram"]

Params = dict[str, Any]


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
        if parallel.expert_model_parallel_size > 1:
            raise ValueError(
                f"{name}: a layer stack does not support expert_model_parallel_size > 1 "
                "(the stack has no MoE layers)"
            )
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
            state = nnx.to_pure_dict(nnx.split(model)[1])
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
        shapes = [
            {jax.tree_util.keystr(k): jnp.shape(a) for k, a in jax.tree.leaves_with_path(layer)}
            for layer in layers
        ]
        for i, layer in enumerate(shapes[1:], 1):  # stacked into one scan: built alike
            for path in sorted(shapes[0].keys() | layer.keys()):
                if layer.get(path) != shapes[0].get(path):
                    have, want = (
                        f"shape {s[path]}" if path in s else "no such parameter"
                        for s in (layer, shapes[0])
                    )
                    raise ValueError(
                        f"{type(self).__name__}: layer {i}'s parameter {path} has {have}, "
                        f"layer 0's {want}: every layer must be built alike (the layers "
                        "of a stage run as one scan over their stacked parameters)"
                    )
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
    """A :class:`LayerStackConfig` model's stage programs (a
    :class:`~jax_wgrad.layout.program.StageModel`; the library lays it out with
    :func:`~jax_wgrad.layout.lay_out`): ``pre`` runs ``embed`` on ``batch[:, :-1]``,
    ``body`` this stage's layers as one scan, ``post`` the ``head`` on the labels
    ``batch[:, 1:]``. It has none of the optional capabilities (a tied output weight, the
    vocabulary over the pipeline, the deferral's recompute mode): the layout refuses the
    options that need them."""

    model: LayerStackConfig
    parallel: ParallelConfig
    platform: str | None = None
    fused_op_families = DENSE_FAMILIES  # no expert layers

    def __post_init__(self) -> None:
        par = self.parallel
        build = lambda tp, sp: self.model.build(tp_size=tp, sequence_parallel=sp, rngs=nnx.Rngs(0))
        sharded = nnx.eval_shape(
            lambda: build(par.tensor_model_parallel_size, par.sequence_parallel)
        )
        defs = {"embed": sharded.embed, "layers": sharded.layers[0], "head": sharded.head}
        object.__setattr__(self, "_defs", {k: nnx.split(m)[0] for k, m in defs.items()})

    def parts(self) -> ModelParts:
        """``embed``, one layer kind ``layers`` (``num_layers`` of it, a period of one),
        ``head``: the single-device model's modules."""
        cfg = self.model
        full = lambda: cfg.build(tp_size=1, sequence_parallel=False, rngs=nnx.Rngs(0))
        return ModelParts(
            embed=("embed", lambda: full().embed),
            kinds=(LayerKind("layers", lambda: full().layers[0]),),
            pattern=(0,) * cfg.num_layers,
            period=(0,),
            head=("head", lambda: full().head),
            seq_length=cfg.seq_length,
            hidden_size=cfg.hidden_size,
            compute_dtype=cfg.compute_dtype,
        )

    def init_params(self, seed: int = 0) -> Params:
        """Full canonical parameters from ``seed`` (:meth:`LayerStackConfig.init_params`)."""
        return self.model.init_params(seed)

    # -- the stage programs

    def _module(self, part: str, params: Any) -> nnx.Module:
        return nnx.merge(self._defs[part], params)

    def pre(self, params: DeviceTree, batch: jax.Array) -> tuple[jax.Array, tuple]:
        """Tokens ``[mb, S + 1]`` -> ``embed(batch[:, :-1])``."""
        return self._module("embed", params.shared["embed"])(batch[:, :-1]), ()

    def writes_residual_slots(self) -> bool:
        """The layer scan writes the pipeline's residual slots
        (:class:`~jax_wgrad.layout.WritesResidualSlots`): always."""
        return True

    def body(
        self,
        params: DeviceTree,
        x: jax.Array,
        layers: Window | None = None,
        slots: ResidualSlots | None = None,
    ) -> tuple[jax.Array, tuple]:
        """This stage's layers (with ``layers``: model chunk ``layers.index``'s) as one
        scan; ``slots``: the pipeline forward's residual slots, written by the scan."""
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
                slots=slots,
            )
        return y, ()

    def post(
        self, params: DeviceTree, y: jax.Array, batch: jax.Array, *, output_grad_extras=False
    ) -> tuple[jax.Array, tuple]:
        """``head(y, batch[:, 1:])``: the fp32 sum of the microbatch's token losses."""
        return self._module("head", params.shared["head"])(y, batch[:, 1:]), ()

    def metrics(self, aux_sum) -> dict[str, jax.Array]:
        return {}
