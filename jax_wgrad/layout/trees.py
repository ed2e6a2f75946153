"""Parameter trees of NNX modules as the gradient layout reads them, for any model.

A model's per-device parameters are laid out in flat gradient buckets in *forward order*:
each module's parameters in the order its ``__init__`` registers them
(:func:`registration_order`, Megatron's order), as nested ``OrderedDict`` trees
(:func:`forward_order`). Their sharding over the mesh (:func:`specs_of`) and their
:class:`~jax_wgrad.grads.GradSpec` (:func:`grad_spec_of`) come from the facts the library's
layers attach to every ``nnx.Param`` as metadata (:func:`jax_wgrad.nn.facts.param_facts`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.spec import GradSpec
from jax_wgrad.parallel.mesh import EXPERT, TENSOR

__all__ = [
    "Order",
    "forward_order",
    "from_forward_order",
    "grad_spec_of",
    "registration_order",
    "specs_of",
    "walk_variables",
]

Params = dict[str, Any]

Order = dict[str, "Order | None"]
"""A module's parameter names in registration order, nested (``None`` at a parameter)."""


def registration_order(make: Callable[[], nnx.Module]) -> Order:
    """The parameter names of the module ``make()`` builds, in the order its ``__init__``
    assigns them (its structure: Megatron registers parameters in forward order).

    Built under ``jax.eval_shape`` (no arrays); read from the instance's attributes,
    which keep assignment order (an NNX state sorts its keys).
    """
    found: dict[str, Order] = {}

    def build():
        found["order"] = _order(make())
        return 0

    jax.eval_shape(build)
    return found["order"]


def _order(node: Any) -> Order | None:
    if isinstance(node, nnx.Variable):
        return None
    return {
        k: _order(v) for k, v in vars(node).items() if isinstance(v, (nnx.Module, nnx.Variable))
    }


def forward_order(tree: Mapping[str, Any], order: Order) -> collections.OrderedDict:
    """The same parameters as nested ``OrderedDict`` trees in ``order`` (a module's
    :func:`registration_order`).

    Plain dicts flatten by sorted key; ``OrderedDict`` flattens in insertion order, so
    :class:`jax_wgrad.grads.GradBuffer` lays this tree out as Megatron lays out the
    model (reverse registration order: the head's last parameter at offset 0).
    """
    unknown = [k for k in tree if k not in order]
    if unknown:
        raise ValueError(
            f"forward_order: parameters {unknown} are not in the module's structure {list(order)}"
        )
    return collections.OrderedDict(
        (k, forward_order(tree[k], order[k]) if isinstance(tree[k], Mapping) else tree[k])
        for k in order
        if k in tree
    )


def from_forward_order(tree: Mapping[str, Any]) -> Params:
    """Inverse of :func:`forward_order`: plain nested dicts."""
    return {k: from_forward_order(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def walk_variables(node: Any, fn: Callable[[nnx.Variable], Any]) -> Any:
    """``fn`` of every variable of an NNX state ``node``, as plain nested dicts."""
    if isinstance(node, nnx.Variable):
        return fn(node)
    return {k: walk_variables(v, fn) for k, v in node.items()}


def specs_of(module: nnx.Module, prefix: tuple[str | None, ...] = ()) -> Params:
    """``PartitionSpec`` of every parameter of ``module`` (an abstract one will do) from
    its ``tensor_axis`` / ``expert_axis`` metadata, after ``prefix`` (e.g. ``(PIPELINE,)``
    for parameters stacked over the layers split over the stages)."""

    def spec(v: nnx.Variable) -> P:
        dims: list[tuple[str, ...]] = [()] * v.get_value().ndim
        facts = v.get_metadata()
        # expert first: a dim split over both is (expert, tensor), Megatron's parallel
        # folding (jax_wgrad.parallel.mesh.expert_parallel_axes)
        for fact, axis_name in (("expert_axis", EXPERT), ("tensor_axis", TENSOR)):
            if facts.get(fact) is not None:
                dims[facts[fact]] += (axis_name,)
        return P(*prefix, *(None if not d else d[0] if len(d) == 1 else d for d in dims))

    return walk_variables(nnx.split(module)[1], spec)


def grad_spec_of(v: nnx.Variable, chunk: str, roles: set[str], fused_in: str | None) -> GradSpec:
    """A parameter's spec from its metadata (:mod:`jax_wgrad.nn.facts`) and its place."""
    facts = v.get_metadata()
    return GradSpec(
        chunk=chunk,
        roles=frozenset(roles),
        fused_in=fused_in if facts.get("fused_wgrad") else None,
        tensor_replicated=facts.get("tensor_axis") is None,
        weight_decay=bool(facts.get("weight_decay")),
    )
