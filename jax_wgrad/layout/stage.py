"""A model's parameters laid out for the pipeline, derived from its NNX modules
(:class:`StageLayout`).

From a model's :class:`~jax_wgrad.models.parts.ModelParts` -- its ``embed``, layer kinds
and ``head`` as abstract NNX modules -- and the parallel layout, the layout derives every
form of the parameters and everything the gradient machinery needs, from the modules'
parameter metadata (:mod:`jax_wgrad.nn.facts`) alone:

* the **canonical form** ``{embed key: ..., one stack [n, ...] per layer kind present,
  head key: ...}`` (what checkpoints and Hugging Face files hold) and its sharding over
  the mesh (:meth:`StageLayout.canonical_specs`: a parameter over ``tensor`` where its
  ``tensor_axis`` says, over ``expert`` where its ``expert_axis`` says, the layer stacks
  over ``pipeline`` on their stacked dim);
* the **layout** (:meth:`StageLayout.param_specs`): the canonical form unless
  interleaved, where the stacks are regrouped by model chunk
  (:mod:`jax_wgrad.layout.virtual`);
* the **device tree** (:meth:`StageLayout.device_tree`): one device's parameters as the
  gradient buckets are laid out over them -- a :class:`~jax_wgrad.grads.chunks.Chunks`
  of the stage's layers (one tree per layer of the period, each leaf stacked over the
  stage's periods), the expert weights of its layers, and the shared ``embed``/``head``
  tree, each in forward order (the modules' registration order, Megatron's);
* the **gradient specs** (:meth:`StageLayout.grad_specs`): per leaf of the device tree its
  chunk, the roles whose backward produce its gradient, whether the fused GEMM writes it,
  whether it is decayed, replicated over ``tensor``, split over the pipeline.

Two capabilities change the layout (the model says so through the optional protocols of
:mod:`jax_wgrad.layout.program`): a **tied output weight** (an ``embed`` parameter the head
also uses as its output layer's weight: its gradient produced by both roles, fused in the
head's) and the **vocabulary over the pipeline** (parameters whose vocabulary dim is split
over ``(pipeline, tensor)``, held by every stage).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.chunks import Chunks, DeviceTree
from jax_wgrad.grads.spec import EXPERTS, INPUT, LAYERS, OUTPUT, SHARED, STAGE, GradSpec
from jax_wgrad.layout import virtual
from jax_wgrad.layout.setup import StageSetup
from jax_wgrad.layout.trees import (
    Order,
    forward_order,
    from_forward_order,
    grad_spec_of,
    registration_order,
    specs_of,
    walk_variables,
)
from jax_wgrad.models.parts import ModelParts
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import PIPELINE, TENSOR

__all__ = ["StageLayout"]

Params = dict[str, Any]
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
    """The layout of one model on one parallel layout (module docstring).

    Attributes:
      parts: the model's modules and their placement.
      parallel: the parallel layout.
      tied_output_weight: the canonical path of the ``embed`` parameter the head uses as
        its output layer's weight (e.g. ``("embedding", "word", "embedding")``), or
        ``None``.
      vocab_over_pipeline: canonical paths of the parameters whose vocabulary dim (their
        first, split over ``tensor``) is split over ``(pipeline, tensor)``; ``()``: none.
      setup: the per-step stage set-up (:class:`~jax_wgrad.layout.setup.StageSetup`).
    """

    parts: ModelParts
    parallel: ParallelConfig
    tied_output_weight: Path | None = None
    vocab_over_pipeline: tuple[Path, ...] = ()
    setup: StageSetup = dataclasses.field(init=False)

    stacks_layers = True
    """The device tree stacks a stage's layers over its periods: the model's ``body``
    runs them with :func:`~jax_wgrad.functional.scan_layers`."""

    def __post_init__(self) -> None:
        parts = self.parts
        object.__setattr__(
            self,
            "setup",
            StageSetup.create(
                self.parallel,
                seq_length=parts.seq_length,
                hidden_size=parts.hidden_size,
                dtype=parts.compute_dtype,
                sample_shape=parts.sample_shape,
                sample_dtype=parts.sample_dtype,
            ),
        )

    # -------------------------------------------------------------------- the modules

    @functools.cached_property
    def _builders(self) -> dict:
        """Each part's constructor, by canonical key."""
        parts = self.parts
        return {parts.embed[0]: parts.embed[1], **{k.key: k.build for k in parts.kinds}} | {
            parts.head[0]: parts.head[1]
        }

    @functools.cached_property
    def _modules(self) -> dict[str, nnx.Module]:
        """Each part as an abstract module (``nnx.eval_shape``), by canonical key."""
        return {key: nnx.eval_shape(build) for key, build in self._builders.items()}

    @functools.cached_property
    def _states(self) -> dict[str, nnx.State]:
        """Each part's abstract parameter state, by canonical key."""
        return {key: nnx.split(m)[1] for key, m in self._modules.items()}

    @functools.cached_property
    def _orders(self) -> dict[str, Order]:
        """Each part's parameter names in the order its ``__init__`` registers them
        (Megatron's order), by canonical key: read from a real construction under
        ``jax.eval_shape`` (an abstract module's attributes are sorted)."""
        return {key: registration_order(build) for key, build in self._builders.items()}

    @property
    def _num_chunks(self) -> int:
        return self.parallel.num_model_chunks

    # -------------------------------------------------------------------- the forms

    def canonical_specs(self) -> Params:
        """``PartitionSpec`` of every canonical parameter on the ``(data, expert, tensor,
        pipeline)`` mesh."""
        return self._canonical_specs

    @functools.cached_property
    def _canonical_specs(self) -> Params:
        parts, modules = self.parts, self._modules
        out = {parts.embed[0]: specs_of(modules[parts.embed[0]])}
        for kind in parts.present:
            out[kind.key] = specs_of(modules[kind.key], (PIPELINE,))
        out[parts.head[0]] = specs_of(modules[parts.head[0]])
        for path in self.vocab_over_pipeline:
            spec = _at(out, path)
            if len(spec) == 0 or spec[0] != TENSOR:
                raise ValueError(
                    f"StageLayout: {'/'.join(path)} has spec {spec}; a vocabulary split over "
                    "the pipeline must be split over tensor on its first dim"
                )
            _set(out, path, P((PIPELINE, TENSOR), *spec[1:]))
        return out

    def param_specs(self) -> Params:
        """``PartitionSpec`` of every parameter of the layout on the mesh."""
        return virtual.layout_specs(self.canonical_specs(), self._num_chunks)

    def to_canonical(self, params: Params) -> Params:
        """Layout parameters (global) -> canonical ones (checkpoints, Hugging Face)."""
        return virtual.to_canonical(params, self.canonical_specs(), self._num_chunks)

    def from_canonical(self, params: Params) -> Params:
        """Canonical parameters (global) -> the layout."""
        return virtual.from_canonical(params, self.canonical_specs(), self._num_chunks)

    def device_tree(self, params: Params) -> DeviceTree:
        """Per-device layout parameters -> the device tree (module docstring): ``stage``
        one tree per layer of the period, each leaf stacked ``[periods, ...]``;
        ``experts`` the expert weights of each layer of the period whose kind has them;
        ``shared`` the ``{embed, head}`` tree. A stacked weight is one contiguous region
        of its bucket."""
        parts = self.parts
        local = virtual.local_stack(params, self.canonical_specs(), self._num_chunks)
        stage, experts = [], []
        for i, position, count in _positions(parts.period):
            kind = parts.kinds[i]
            take = functools.partial(_position, count=count, k=position)
            p = dict(jax.tree.map(take, local[kind.key]))
            order = self._orders[kind.key]
            if kind.experts is not None:
                experts.append(forward_order(p.pop(kind.experts), order[kind.experts]))
            stage.append(forward_order(p, order))
        return Chunks(stage=stage, experts=experts, shared=self._shared(local))

    def canonical_tree(self, tree: DeviceTree) -> Params:
        """Inverse of :meth:`device_tree`."""
        parts = self.parts
        per_kind: dict[int, list] = collections.defaultdict(list)
        moe_experts = iter(tree.experts)
        for (i, _, _), p in zip(_positions(parts.period), tree.stage):
            p = from_forward_order(p)
            kind = parts.kinds[i]
            if kind.experts is not None:
                p[kind.experts] = from_forward_order(next(moe_experts))
            per_kind[i].append(p)
        shared = from_forward_order(tree.shared)
        out = {parts.embed[0]: shared[parts.embed[0]]}
        for i, ps in sorted(per_kind.items()):
            out[parts.kinds[i].key] = jax.tree.map(lambda *xs: _interleave(list(xs)), *ps)
        out[parts.head[0]] = shared[parts.head[0]]
        return virtual.local_chunks(out, self.canonical_specs(), self._num_chunks)

    def grad_specs(self) -> DeviceTree:
        """The :class:`~jax_wgrad.grads.GradSpec` of every leaf of :meth:`device_tree`,
        from the modules' parameter metadata and the parts' roles: the layers in the
        stage chunk (their linear weights fused in :data:`LAYERS`), expert weights in the
        expert chunk; ``embed`` and ``head`` in the shared chunk, produced by
        :data:`INPUT` and :data:`OUTPUT`; a tied output weight by both, fused in
        :data:`OUTPUT` (it is the output layer's weight)."""
        parts, states = self.parts, self._states
        layers = lambda chunk: lambda v: grad_spec_of(v, chunk, {LAYERS}, LAYERS)
        stage, experts = [], []
        for i, _, _ in _positions(parts.period):
            kind = parts.kinds[i]
            state, order = states[kind.key], self._orders[kind.key]
            body = {k: v for k, v in state.items() if k != kind.experts}
            stage.append(forward_order(walk_variables(body, layers(STAGE)), order))
            if kind.experts is not None:
                experts.append(
                    forward_order(
                        walk_variables(state[kind.experts], layers(EXPERTS)), order[kind.experts]
                    )
                )
        specs = {
            parts.embed[0]: walk_variables(
                states[parts.embed[0]], lambda v: grad_spec_of(v, SHARED, {INPUT}, INPUT)
            ),
            parts.head[0]: walk_variables(
                states[parts.head[0]], lambda v: grad_spec_of(v, SHARED, {OUTPUT}, OUTPUT)
            ),
        }
        for path in self.vocab_over_pipeline:
            _set(specs, path, dataclasses.replace(_at(specs, path), pipeline_sharded=True))
        if self.tied_output_weight is not None:
            # The output layer's weight IS this parameter: OUTPUT's too, fused there.
            spec: GradSpec = _at(specs, self.tied_output_weight)
            _set(
                specs,
                self.tied_output_weight,
                dataclasses.replace(
                    spec, roles=frozenset({INPUT, OUTPUT}), fused_in=OUTPUT, tied_embedding=True
                ),
            )
        return Chunks(stage=stage, experts=experts, shared=self._shared(specs))

    def _shared(self, tree: Params) -> collections.OrderedDict:
        """The shared tree: ``embed`` (first in forward order), then ``head``."""
        (e, _), (h, _) = self.parts.embed, self.parts.head
        return collections.OrderedDict(
            [
                (e, forward_order(tree[e], self._orders[e])),
                (h, forward_order(tree[h], self._orders[h])),
            ]
        )


def _positions(period: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Per layer of ``period``: ``(kind, its index among the period's layers of that kind,
    how many of them the period has)``."""
    seen: collections.Counter = collections.Counter()
    counts = collections.Counter(period)
    out = []
    for i in period:
        out.append((i, seen[i], counts[i]))
        seen[i] += 1
    return out


def _position(a, count: int, k: int):
    """``[n * count, ...]`` -> ``[n, ...]``: every ``count``-th layer from ``k`` on."""
    if count == 1:
        return a
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((a.shape[0] // count, *a.shape[1:]), a.dtype)
    return a.reshape(a.shape[0] // count, count, *a.shape[1:])[:, k]


def _interleave(arrays: list) -> Any:
    """Inverse of :func:`_position` over ``k``: ``count`` arrays ``[n, ...]`` ->
    ``[n * count, ...]``."""
    if len(arrays) == 1:
        return arrays[0]
    stacked = jnp.stack(arrays, axis=1)
    return stacked.reshape(-1, *stacked.shape[2:])


def _at(tree: Params, path: Path) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Params, path: Path, value: Any) -> None:
    _at(tree, path[:-1])[path[-1]] = value
