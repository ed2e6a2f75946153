"""The GPT's canonical parameters, their sharding, and its per-device gradient layout.

Parameters live outside the modules as one plain nested dict, the *canonical layout*
(independent of the parallel layout)::

    {'embedding': {'word': {'embedding': [V, H]}, 'position': [S, H]},
     'layers':    {'ln1': {...}, 'qkv': {'weight': [L, 3H, H], 'bias': [L, 3H]},
                   'proj': {...}, 'ln2': {...}, 'fc1': {...}, 'fc2': {...}},  # stacked [L]
     'head':      {'final_norm': {...}, 'output': {'weight': [V, H]}}}  # output if untied

The qkv output dim is ordered ``(heads, 3, head_dim)`` (Megatron's interleaved layout) so
a contiguous split over ``tensor`` gives each rank whole heads. :func:`init_params` builds
the full parameters from a seed only, :func:`param_specs` says how they are sharded over
the mesh (layers over ``pipeline`` on their stacked dim, embedding and head replicated over
``pipeline``). On a device the gradients are laid out over the *device tree*
(:func:`device_tree`): ``(per-layer trees of the stage's layers, shared tree)``, both in
forward (registration) order, with :func:`grad_specs` saying what each leaf is.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads.spec import INPUT, LAYERS, OUTPUT, SHARED, STAGE, GradSpec
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.parallel.mesh import PIPELINE, TENSOR

__all__ = [
    "FORWARD_KEY_ORDER",
    "abstract_modules",
    "canonical_tree",
    "device_tree",
    "forward_order",
    "from_forward_order",
    "grad_specs",
    "init_params",
    "param_specs",
    "unstack_layers",
]

Params = dict[str, Any]
DeviceTree = tuple[list, Any]

FORWARD_KEY_ORDER: tuple[str, ...] = (
    "embedding", "word", "position", "layers", "ln1", "qkv", "proj", "ln2", "fc1", "fc2",
    "head", "final_norm", "output", "weight", "scale", "bias")
"""Registration (forward) order of the parameter names: siblings are ordered by their
rank here (embedding -> layers -> head; ln1 -> qkv -> proj -> ln2 -> fc1 -> fc2; a
linear's weight before its bias; a LayerNorm's scale before its bias), as Megatron's
modules register them."""


def forward_order(tree: Mapping[str, Any]) -> collections.OrderedDict:
    """The same parameters as nested ``OrderedDict`` trees in forward (registration) order.

    Plain dicts flatten by sorted key; ``OrderedDict`` flattens in insertion order, so
    :class:`jax_wgrad.grads.GradBuffer` lays this tree out as Megatron lays out the
    model (reverse registration order: the head's last parameter at offset 0).
    """
    rank = {k: i for i, k in enumerate(FORWARD_KEY_ORDER)}
    unknown = [k for k in tree if k not in rank]
    if unknown:
        raise ValueError(f"forward_order: unknown parameter names {unknown}")
    return collections.OrderedDict(
        (k, forward_order(tree[k]) if isinstance(tree[k], Mapping) else tree[k])
        for k in sorted(tree, key=rank.__getitem__))


def from_forward_order(tree: Mapping[str, Any]) -> Params:
    """Inverse of :func:`forward_order`: plain nested dicts."""
    return {k: from_forward_order(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def unstack_layers(stacked: Params) -> list[Params]:
    """``{name: [n, ...]}`` stacked layer parameters (arrays or ``ShapeDtypeStruct``) -> a
    list of ``n`` per-layer dicts."""
    n = jax.tree.leaves(stacked)[0].shape[0]

    def index(a, i):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
        return a[i]

    return [jax.tree.map(lambda a, i=i: index(a, i), stacked) for i in range(n)]


def device_tree(params: Params) -> DeviceTree:
    """Canonical per-device params -> ``(stage layers, shared)`` in forward order: the tree
    the gradient buckets are laid out over (chunks :data:`~jax_wgrad.grads.spec.STAGE`,
    :data:`~jax_wgrad.grads.spec.SHARED`)."""
    layers = [forward_order(p) for p in unstack_layers(params["layers"])]
    return layers, forward_order({"embedding": params["embedding"], "head": params["head"]})


def canonical_tree(tree: DeviceTree) -> Params:
    """Inverse of :func:`device_tree` (layers stacked again)."""
    layers, shared = tree
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[from_forward_order(p) for p in layers])
    shared = from_forward_order(shared)
    return {"embedding": shared["embedding"], "layers": stacked, "head": shared["head"]}


def _pure(module: nnx.Module) -> Params:
    return nnx.to_pure_dict(nnx.split(module)[1])


def _walk(node: Any, fn) -> Any:
    if isinstance(node, nnx.Variable):
        return fn(node)
    return {k: _walk(v, fn) for k, v in node.items()}


def init_params(cfg: GPTConfig, seed: int) -> Params:
    """Full (unsharded) canonical parameters; depend only on ``cfg`` and ``seed``.

    Every part draws from its own ``fold_in`` of the seed, so the values do not depend
    on the parallel layout. Call under ``jax.jit(..., out_shardings=...)`` to create
    them sharded directly.
    """
    key = jax.random.key(seed)
    embedding = GPTEmbedding(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 0)))
    layers = [
        _pure(TransformerLayer(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + i))))
        for i in range(cfg.num_layers)
    ]
    head = GPTHead(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + cfg.num_layers)))
    return {
        "embedding": _pure(embedding),
        "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers),
        "head": _pure(head),
    }


def abstract_modules(cfg: GPTConfig, tp: int = 1, sp: bool = False, attention: str = "xla"):
    """``(embedding, layer, head)`` modules of the layout, shapes only (no arrays)."""
    kw = dict(tp_size=tp, sequence_parallel=sp)
    return (
        nnx.eval_shape(lambda: GPTEmbedding(cfg, **kw, rngs=nnx.Rngs(0))),
        nnx.eval_shape(lambda: TransformerLayer(cfg, **kw, attention=attention,
                                                rngs=nnx.Rngs(0))),
        nnx.eval_shape(lambda: GPTHead(cfg, **kw, rngs=nnx.Rngs(0))),
    )


def _specs(module: nnx.Module, prefix: tuple[str | None, ...]) -> Params:
    def spec(v: nnx.Variable) -> P:
        dims: list[str | None] = [None] * v.get_value().ndim
        axis = v.get_metadata().get("tensor_axis")
        if axis is not None:
            dims[axis] = TENSOR
        return P(*prefix, *dims)

    return _walk(nnx.split(module)[1], spec)


def param_specs(cfg: GPTConfig) -> Params:
    """``PartitionSpec`` for every canonical parameter on the ``(data, tensor,
    pipeline)`` mesh: layers split over ``pipeline`` on the stacked dim; embedding and
    head replicated over ``pipeline`` (only the first / last stage uses them)."""
    emb, layer, head = abstract_modules(cfg)
    return {
        "embedding": _specs(emb, ()),
        "layers": _specs(layer, (PIPELINE,)),
        "head": _specs(head, ()),
    }


def _grad_spec(v: nnx.Variable, chunk: str, roles: set[str], fused_in: str | None) -> GradSpec:
    """A parameter's spec from its metadata (:mod:`jax_wgrad.nn.facts`) and its place."""
    facts = v.get_metadata()
    return GradSpec(chunk=chunk, roles=frozenset(roles),
                    fused_in=fused_in if facts.get("fused_wgrad") else None,
                    tensor_replicated=facts.get("tensor_axis") is None,
                    weight_decay=bool(facts.get("weight_decay")))


def grad_specs(cfg: GPTConfig, num_local_layers: int) -> DeviceTree:
    """The :class:`GradSpec` of every leaf of :func:`device_tree`, from the modules'
    parameter metadata and the model's roles: layers in the stage chunk (their linear
    weights fused in :data:`LAYERS`); embedding and head in the shared chunk, the
    embedding produced by :data:`INPUT`, the head by :data:`OUTPUT`; a tied word embedding
    by both, fused in :data:`OUTPUT` (it is the output layer's weight)."""
    emb, layer, head = (nnx.split(m)[1] for m in abstract_modules(cfg))
    tied = not cfg.untie_embeddings_and_output_weights
    layer_spec = _walk(layer, lambda v: _grad_spec(v, STAGE, {LAYERS}, LAYERS))
    word = _grad_spec(emb["word"]["embedding"], SHARED, {INPUT}, None)
    if tied:  # the output layer's weight IS the word embedding: also OUTPUT's, fused there
        word = dataclasses.replace(word, roles=frozenset({INPUT, OUTPUT}), fused_in=OUTPUT,
                                   tied_embedding=True)
    emb_spec = {"word": {"embedding": word},
                "position": _grad_spec(emb["position"], SHARED, {INPUT}, None)}
    head_spec = _walk(head, lambda v: _grad_spec(v, SHARED, {OUTPUT}, OUTPUT))
    return ([forward_order(layer_spec) for _ in range(num_local_layers)],
            forward_order({"embedding": emb_spec, "head": head_spec}))
