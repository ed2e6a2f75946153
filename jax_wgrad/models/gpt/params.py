"""The GPT's canonical parameters, their sharding, and its per-device gradient layout.

Parameters live outside the modules as one plain nested dict, the *canonical layout*
(independent of the parallel layout)::

    {'embedding': {'word': {'embedding': [V, H]}, 'position': [S, H]},
     'layers':    {'ln1': {...}, 'qkv': {'weight': [L, 3H, H], 'bias': [L, 3H]},
                   'proj': {...}, 'ln2': {...}, 'fc1': {...}, 'fc2': {...}},  # stacked [L]
     'head':      {'final_norm': {...}, 'output': {'weight': [V, H]}}}  # output if untied

An MoE model (``GPTConfig.num_moe_experts``) stacks its dense layers in ``'layers'``
(``[L_dense]``, absent if every layer is an MoE layer) and its MoE layers in
``'moe_layers'`` (``[L_moe]``: ``ln1``, ``qkv``, ``proj``, ``ln2``, ``'router': [L_moe, E, H]``,
``'experts': {'fc1': [L_moe, E, F, H], 'fc2': [L_moe, E, H, F]}``), both split over
``pipeline`` on the stacked dim and the experts over ``expert`` on ``E``. Every stage has
the same local pattern of MoE and dense layers (``config.validate`` checks it).

The qkv output dim is ordered ``(heads, 3, head_dim)`` (Megatron's interleaved layout) so
a contiguous split over ``tensor`` gives each rank whole heads. :func:`init_params` builds
the full parameters from a seed only, :func:`param_specs` says how they are sharded over
the mesh (layers over ``pipeline`` on their stacked dim, embedding and head replicated over
``pipeline``). On a device the gradients are laid out over the *device tree*
(:func:`device_tree`): a :class:`~jax_wgrad.grads.chunks.DeviceTree` (per-layer trees of
the stage's layers, the expert weights of its MoE layers, the shared tree: one per gradient
chunk) in forward order -- the modules' registration order (:func:`registration_order`) --
with :func:`grad_specs` saying what each leaf is.
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
from jax_wgrad.grads.spec import EXPERTS, INPUT, LAYERS, OUTPUT, SHARED, STAGE
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.models.trees import (
    Order,
    forward_order,
    from_forward_order,
    grad_spec_of,
    pure_dict,
    registration_order,
    specs_of,
    walk_variables,
)
from jax_wgrad.parallel.mesh import PIPELINE, TENSOR

__all__ = [
    "abstract_modules",
    "canonical_tree",
    "device_tree",
    "forward_order",
    "from_forward_order",
    "grad_specs",
    "init_params",
    "layer_loop_length",
    "module_orders",
    "param_specs",
    "period_pattern",
    "registration_order",
]

Params = dict[str, Any]


@functools.cache
def module_orders(cfg: GPTConfig) -> dict[str, Order]:
    """Registration order of the GPT's modules: ``embedding``, ``layer``, ``moe_layer``
    (an MoE model) and ``head``."""
    rngs = lambda: nnx.Rngs(0)
    out = {
        "embedding": registration_order(lambda: GPTEmbedding(cfg, rngs=rngs())),
        "layer": registration_order(lambda: TransformerLayer(cfg, rngs=rngs())),
    }
    if cfg.num_moe_experts is not None:
        out["moe_layer"] = registration_order(lambda: TransformerLayer(cfg, moe=True, rngs=rngs()))
    out["head"] = registration_order(lambda: GPTHead(cfg, rngs=rngs()))
    return out


def _stacks(pattern) -> list[tuple[str, int]]:
    """``(canonical key, index in that stack)`` of each layer of ``pattern``."""
    seen = {"layers": 0, "moe_layers": 0}
    out = []
    for moe in pattern:
        key = "moe_layers" if moe else "layers"
        out.append((key, seen[key]))
        seen[key] += 1
    return out


def period_pattern(cfg: GPTConfig) -> tuple[bool, ...]:
    """Per layer of the repeating period of the layer pattern: an MoE layer. A dense
    model's period is one dense layer; an MoE model's is ``moe_layer_freq`` layers, the
    first one MoE (Megatron's pattern). Every stage holds whole periods
    (``GPTConfig``'s checks)."""
    return cfg.moe_layer_pattern[: cfg.moe_layer_freq if cfg.num_moe_experts else 1]


def layer_loop_length(cfg: GPTConfig, parallel) -> int:
    """Iterations of a model chunk's loop over its layers (its periods of layers,
    :func:`period_pattern`): ``L / (P V)`` layers over the period's length, for a
    :class:`~jax_wgrad.parallel.ParallelConfig` ``parallel`` of ``P`` stages and ``V``
    model chunks per stage."""
    chunks = parallel.pipeline_model_parallel_size * parallel.num_model_chunks
    return cfg.num_layers // chunks // len(period_pattern(cfg))


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


def _shared(embedding: Any, head: Any, orders: dict[str, Order]) -> collections.OrderedDict:
    """The shared tree: the embedding (first in forward order), then the head."""
    return collections.OrderedDict(
        embedding=forward_order(embedding, orders["embedding"]),
        head=forward_order(head, orders["head"]),
    )


def device_tree(params: Params, cfg: GPTConfig) -> DeviceTree:
    """Canonical per-device params -> the :class:`~jax_wgrad.grads.chunks.DeviceTree` in
    forward order, every layer parameter STACKED over the stage's periods
    (:func:`period_pattern`): ``stage`` one tree per layer of the period, each leaf
    ``[periods, ...]``; ``experts`` one stacked ``{fc1, fc2}`` per MoE layer of the period;
    ``shared`` the ``{embedding, head}`` tree. These are the chunks the gradient buckets
    are laid out over (a stacked weight is one contiguous region of its bucket).
    An MoE layer's tree has no ``'experts'``: those are the ``experts`` chunk.
    """
    orders = module_orders(cfg)
    period = period_pattern(cfg)
    counts = {"layers": period.count(False), "moe_layers": period.count(True)}
    stage, experts = [], []
    for key, k in _stacks(period):
        p = dict(jax.tree.map(functools.partial(_position, count=counts[key], k=k), params[key]))
        if key == "moe_layers":
            order = orders["moe_layer"]
            experts.append(forward_order(p.pop("experts"), order["experts"]))
        else:
            order = orders["layer"]
        stage.append(forward_order(p, order))
    return Chunks(
        stage=stage, experts=experts, shared=_shared(params["embedding"], params["head"], orders)
    )


def canonical_tree(tree: DeviceTree, cfg: GPTConfig) -> Params:
    """Inverse of :func:`device_tree`."""
    per_key: dict[str, list] = {"layers": [], "moe_layers": []}
    moe_experts = iter(tree.experts)
    for (key, _), p in zip(_stacks(period_pattern(cfg)), tree.stage):
        p = from_forward_order(p)
        if key == "moe_layers":
            p["experts"] = from_forward_order(next(moe_experts))
        per_key[key].append(p)
    shared = from_forward_order(tree.shared)
    out = {"embedding": shared["embedding"]}
    for key, ps in per_key.items():
        if ps:
            out[key] = jax.tree.map(lambda *xs: _interleave(list(xs)), *ps)
    out["head"] = shared["head"]
    return out


def init_params(cfg: GPTConfig, seed: int) -> Params:
    """Full (unsharded) canonical parameters in ``cfg.params_dtype``; depend only on
    ``cfg`` and ``seed``.

    Every part draws from its own ``fold_in`` of the seed, so the values do not depend
    on the parallel layout. The modules draw in fp32; bf16 parameters
    (``params_dtype="bfloat16"``) are those values rounded to bf16 (the optimizer's fp32
    main parameters start from the bf16 values, as Megatron's copy of its bf16 model). Call
    under ``jax.jit(..., out_shardings=...)`` to create them sharded directly.
    """
    key = jax.random.key(seed)
    embedding = GPTEmbedding(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 0)))
    per_key: dict[str, list] = {"layers": [], "moe_layers": []}
    for i, moe in enumerate(cfg.moe_layer_pattern):
        layer = TransformerLayer(cfg, moe=moe, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + i)))
        per_key["moe_layers" if moe else "layers"].append(pure_dict(layer))
    head = GPTHead(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + cfg.num_layers)))
    out = {"embedding": pure_dict(embedding)}
    for k, ps in per_key.items():
        if ps:
            out[k] = jax.tree.map(lambda *xs: jnp.stack(xs), *ps)
    out["head"] = pure_dict(head)
    dtype = jnp.dtype(cfg.params_dtype)
    return jax.tree.map(lambda a: a.astype(dtype), out)


def abstract_modules(
    cfg: GPTConfig,
    tp: int = 1,
    sp: bool = False,
    attention: str = "xla",
    ep: int = 1,
    vocab_pp: int = 1,
    etp: int = 1,
):
    """``(embedding, dense layer, MoE layer or None, head)`` modules of the layout, shapes
    only (no arrays); ``vocab_pp``: the pipeline stages the vocabulary is split over;
    ``etp``: the expert-tensor-parallel size."""
    kw = dict(tp_size=tp, sequence_parallel=sp)
    layer = lambda moe: nnx.eval_shape(
        lambda: TransformerLayer(
            cfg, **kw, attention=attention, moe=moe, ep_size=ep, etp_size=etp, rngs=nnx.Rngs(0)
        )
    )
    ends = dict(kw, vocab_pipeline_size=vocab_pp)
    return (
        nnx.eval_shape(lambda: GPTEmbedding(cfg, **ends, rngs=nnx.Rngs(0))),
        layer(False),
        layer(True) if cfg.num_moe_experts is not None else None,
        nnx.eval_shape(lambda: GPTHead(cfg, **ends, rngs=nnx.Rngs(0))),
    )


def param_specs(cfg: GPTConfig, vocab_over_pipeline: bool = False, etp: int = 1) -> Params:
    """``PartitionSpec`` for every canonical parameter on the ``(data, expert, tensor,
    pipeline)`` mesh: layers split over ``pipeline`` on the stacked dim (expert weights
    over ``expert`` too); embedding and head replicated over ``pipeline`` (only the first /
    last stage uses them), except, with ``vocab_over_pipeline``, the word embedding and
    the output weight: their vocabulary dim split over ``(pipeline, tensor)``."""
    emb, layer, moe_layer, head = abstract_modules(cfg, etp=etp)
    out = {"embedding": specs_of(emb, ())}
    pattern = cfg.moe_layer_pattern
    if not all(pattern):
        out["layers"] = specs_of(layer, (PIPELINE,))
    if any(pattern):
        out["moe_layers"] = specs_of(moe_layer, (PIPELINE,))
    out["head"] = specs_of(head, ())
    if vocab_over_pipeline:
        out["embedding"]["word"]["embedding"] = P((PIPELINE, TENSOR), None)
        if "weight" in out["head"].get("output", {}):  # untied
            out["head"]["output"]["weight"] = P((PIPELINE, TENSOR), None)
    return out


def grad_specs(cfg: GPTConfig, vocab_over_pipeline: bool = False, etp: int = 1) -> DeviceTree:
    """The :class:`GradSpec` of every leaf of :func:`device_tree`, from the modules'
    parameter metadata and the model's roles: layers in the stage chunk (their linear
    weights fused in :data:`LAYERS`), the MoE layers' expert weights in the expert chunk;
    embedding and head in the shared chunk, the embedding produced by :data:`INPUT`, the
    head by :data:`OUTPUT`; a tied word embedding by both, fused in :data:`OUTPUT` (it is
    the output layer's weight)."""
    emb, layer, moe_layer, head = (
        None if m is None else nnx.split(m)[1] for m in abstract_modules(cfg, etp=etp)
    )
    orders = module_orders(cfg)
    tied = not cfg.untie_embeddings_and_output_weights
    layer_spec = walk_variables(layer, lambda v: grad_spec_of(v, STAGE, {LAYERS}, LAYERS))
    layer_specs, expert_specs = [], []
    for moe in period_pattern(cfg):
        if not moe:
            layer_specs.append(forward_order(layer_spec, orders["layer"]))
            continue
        spec = {k: v for k, v in moe_layer.items() if k != "experts"}
        layer_specs.append(
            forward_order(
                walk_variables(spec, lambda v: grad_spec_of(v, STAGE, {LAYERS}, LAYERS)),
                orders["moe_layer"],
            )
        )
        expert_specs.append(
            forward_order(
                walk_variables(
                    moe_layer["experts"], lambda v: grad_spec_of(v, EXPERTS, {LAYERS}, LAYERS)
                ),
                orders["moe_layer"]["experts"],
            )
        )
    word = grad_spec_of(emb["word"]["embedding"], SHARED, {INPUT}, None)
    word = dataclasses.replace(word, pipeline_sharded=vocab_over_pipeline)
    if tied:  # the output layer's weight IS the word embedding: also OUTPUT's, fused there
        word = dataclasses.replace(
            word, roles=frozenset({INPUT, OUTPUT}), fused_in=OUTPUT, tied_embedding=True
        )
    emb_spec = walk_variables(emb, lambda v: grad_spec_of(v, SHARED, {INPUT}, None))
    emb_spec["word"]["embedding"] = word
    head_spec = walk_variables(head, lambda v: grad_spec_of(v, SHARED, {OUTPUT}, OUTPUT))
    if "weight" in head_spec.get("output", {}):  # untied
        head_spec["output"]["weight"] = dataclasses.replace(
            head_spec["output"]["weight"], pipeline_sharded=vocab_over_pipeline
        )
    return Chunks(
        stage=layer_specs, experts=expert_specs, shared=_shared(emb_spec, head_spec, orders)
    )
