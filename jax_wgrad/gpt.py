"""Tensor-parallel GPT (pre-LN decoder, causal attention, GELU MLP, learned positions).

The model is three kinds of NNX modules, one per pipeline role:

* :class:`GPTEmbedding` (first stage): vocab-parallel word embedding + positions.
* :class:`TransformerLayer` (every stage holds ``num_layers / P`` of them).
* :class:`GPTHead` (last stage): final LayerNorm, column-parallel output layer (the word
  embedding table when tied) and the vocab-parallel cross entropy.

Parameters live outside the modules as one plain nested dict, the *canonical layout*
(independent of the parallel layout)::

    {'embedding': {'word': {'embedding': [V, H]}, 'position': [S, H]},
     'layers':    {'ln1': {...}, 'qkv': {'weight': [L, 3H, H], 'bias': [L, 3H]},
                   'proj': {...}, 'ln2': {...}, 'fc1': {...}, 'fc2': {...}},  # stacked [L]
     'head':      {'final_norm': {...}, 'output': {'weight': [V, H]}}}  # output if untied

The qkv output dim is ordered ``(heads, 3, head_dim)`` (Megatron's interleaved layout) so
a contiguous split over ``tensor`` gives each rank whole heads. :func:`init_params` builds
the full parameters from a seed only, :func:`param_specs` says how they are sharded over
the ``(data, tensor, pipeline)`` mesh (layers over ``pipeline`` on their stacked dim,
embedding and head replicated over ``pipeline``), and :class:`GPTStages` runs the pieces
on one device's shards inside ``shard_map``. :func:`reference_loss` is an independent
single-device plain-``jnp`` implementation used to check gradients.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_wgrad.config import GPTConfig, ParallelConfig
from jax_wgrad.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_std_for_output_layers,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "TransformerLayer",
    "causal_attention",
    "GPTEmbedding",
    "GPTHead",
    "GPTStages",
    "LINEAR_LAYERS",
    "FORWARD_KEY_ORDER",
    "forward_order",
    "from_forward_order",
    "unstack_layers",
    "init_params",
    "param_specs",
    "reference_loss",
    "sequence_parallel_replicated",
]

Params = dict[str, Any]

LINEAR_LAYERS: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
"""Names of the linear layers of a :class:`TransformerLayer` (fused-wgrad weights)."""


def _dtype(cfg: GPTConfig) -> jnp.dtype:
    return jnp.dtype(cfg.compute_dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str = "xla") -> jax.Array:
    """``q, k, v``: ``[b, s, heads, head_dim]`` -> ``[b, s, heads * head_dim]``.

    ``implementation``: ``"xla"`` (below: fp32 scores and softmax, output in
    ``q.dtype``) or ``"cudnn"`` (:func:`jax.nn.dot_product_attention`'s cuDNN flash
    attention, 16-bit inputs on a CUDA GPU).
    """
    b, s, h, d = q.shape
    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.reshape(b, s, h * d)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.reshape(b, s, h * d)


class TransformerLayer(nnx.Module):
    """Pre-LN decoder layer: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Activations ``[b, s, H]`` (``[b, s / tp, H]`` with sequence parallelism).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = "tensor",
        attention: str = "xla",
        rngs: nnx.Rngs,
    ):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        common = dict(tp_size=tp_size, axis_name=axis_name, sequence_parallel=sequence_parallel)
        out_std = init_std_for_output_layers(cfg.init_method_std, cfg.num_layers)
        self.heads = cfg.num_attention_heads // tp_size
        self.head_dim = cfg.head_dim
        self.attention = attention
        self.ln1 = LayerNorm(h, epsilon=cfg.layernorm_epsilon)
        self.qkv = ColumnParallelLinear(h, 3 * h, init_std=cfg.init_method_std, rngs=rngs, **common)
        self.proj = RowParallelLinear(h, h, init_std=out_std, rngs=rngs, **common)
        self.ln2 = LayerNorm(h, epsilon=cfg.layernorm_epsilon)
        self.fc1 = ColumnParallelLinear(h, f, init_std=cfg.init_method_std, rngs=rngs, **common)
        self.fc2 = RowParallelLinear(f, h, init_std=out_std, rngs=rngs, **common)

    def __call__(
        self, x: jax.Array, *, main_grads: Mapping[str, jax.Array] | None = None
    ) -> jax.Array:
        """``x``: ``[b, s(/tp), H]`` -> same shape.

        ``main_grads``: optional ``{name: fp32 accumulator}`` for the weights of
        ``qkv``, ``proj``, ``fc1``, ``fc2`` (gradient accumulation fusion).
        """
        mg = main_grads or {}
        with jax.named_scope("attention"):
            qkv = self.qkv(self.ln1(x), main_grad=mg.get("qkv"))
            b, s = qkv.shape[:2]
            qkv = qkv.reshape(b, s, self.heads, 3, self.head_dim)
            attn = causal_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2],
                                    implementation=self.attention)
            x = x + self.proj(attn, main_grad=mg.get("proj"))
        with jax.named_scope("mlp"):
            hidden = jax.nn.gelu(self.fc1(self.ln2(x), main_grad=mg.get("fc1")), approximate=False)
            x = x + self.fc2(hidden, main_grad=mg.get("fc2"))
        return x


class GPTEmbedding(nnx.Module):
    """Word (vocab-parallel) plus learned position embedding; first pipeline stage."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = "tensor",
        rngs: nnx.Rngs,
    ):
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.dtype = _dtype(cfg)
        self.word = VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            tp_size=tp_size,
            axis_name=axis_name,
            sequence_parallel=sequence_parallel,
            init_std=cfg.init_method_std,
            rngs=rngs,
        )
        self.position = nnx.Param(
            cfg.init_method_std
            * jax.random.normal(rngs.params(), (cfg.seq_length, cfg.hidden_size), jnp.float32),
            tensor_axis=None,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``ids``: int ``[b, s]`` -> ``[b, s(/tp), H]`` in the compute dtype."""
        with jax.named_scope("embedding"):
            x = self.word(ids, dtype=self.dtype)
            s_local = x.shape[1]
            start = 0
            if self.sequence_parallel:
                start = jax.lax.axis_index(self.axis_name) * s_local
            pos = jax.lax.dynamic_slice_in_dim(self.position[...], start, s_local, axis=0)
            return x + pos.astype(self.dtype)[None]


class GPTHead(nnx.Module):
    """Final LayerNorm, output layer and vocab-parallel cross entropy; last stage.

    With tied embeddings the output layer allocates no weight and is given the word
    embedding table ``[V / tp, H]`` at call time.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = "tensor",
        rngs: nnx.Rngs,
    ):
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.final_norm = LayerNorm(cfg.hidden_size, epsilon=cfg.layernorm_epsilon)
        self.output = ColumnParallelLinear(
            cfg.hidden_size,
            cfg.vocab_size,
            tp_size=tp_size,
            axis_name=axis_name,
            use_bias=False,
            sequence_parallel=sequence_parallel,
            skip_weight_param_allocation=not cfg.untie_embeddings_and_output_weights,
            init_std=cfg.init_method_std,
            rngs=rngs,
        )

    def __call__(
        self,
        x: jax.Array,
        labels: jax.Array,
        *,
        weight: jax.Array | None = None,
        main_grad: jax.Array | None = None,
    ) -> jax.Array:
        """``x``: ``[b, s(/tp), H]``, ``labels``: int ``[b, s]`` -> fp32 scalar SUM of the
        per-token losses (identical on every tensor rank)."""
        with jax.named_scope("output_layer"):
            logits = self.output(self.final_norm(x), weight, main_grad=main_grad)
        with jax.named_scope("cross_entropy"):
            losses = vocab_parallel_cross_entropy(
                logits, labels, tp_size=self.tp_size, axis_name=self.axis_name
            )
        return jnp.sum(losses)


# --------------------------------------------------------------------------- params

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
    :class:`jax_wgrad.grad_buffer.GradBuffer` lays this tree out as Megatron lays out the
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


def _specs(module: nnx.Module, prefix: tuple[str | None, ...]) -> Params:
    def spec(v: nnx.Variable) -> P:
        dims: list[str | None] = [None] * v.get_value().ndim
        axis = v.get_metadata().get("tensor_axis")
        if axis is not None:
            dims[axis] = "tensor"
        return P(*prefix, *dims)

    return _walk(nnx.split(module)[1], spec)


def _abstract_parts(cfg: GPTConfig, tp: int, sp: bool, attention: str = "xla"):
    kw = dict(tp_size=tp, sequence_parallel=sp)
    return (
        nnx.eval_shape(lambda: GPTEmbedding(cfg, **kw, rngs=nnx.Rngs(0))),
        nnx.eval_shape(lambda: TransformerLayer(cfg, **kw, attention=attention,
                                                rngs=nnx.Rngs(0))),
        nnx.eval_shape(lambda: GPTHead(cfg, **kw, rngs=nnx.Rngs(0))),
    )


def param_specs(cfg: GPTConfig) -> Params:
    """``PartitionSpec`` for every canonical parameter on the ``(data, tensor,
    pipeline)`` mesh: layers split over ``pipeline`` on the stacked dim; embedding and
    head replicated over ``pipeline`` (only the first / last stage uses them)."""
    emb, layer, head = _abstract_parts(cfg, 1, False)
    return {
        "embedding": _specs(emb, ()),
        "layers": _specs(layer, ("pipeline",)),
        "head": _specs(head, ()),
    }


def sequence_parallel_replicated(specs: Params) -> Params:
    """Bool pytree: parameters replicated over ``tensor`` whose gradients must be
    all-reduced over ``tensor`` under sequence parallelism (LayerNorms, row-parallel
    biases, positions: each rank only sees its sequence chunk)."""
    return jax.tree.map(
        lambda s: "tensor" not in tuple(s), specs, is_leaf=lambda x: isinstance(x, P)
    )


# --------------------------------------------------------------------------- stages


@dataclasses.dataclass(frozen=True)
class GPTStages:
    """The model's pieces as pure functions of parameter dicts, on one device's shards.

    Built once per layout; used inside ``shard_map`` by :mod:`jax_wgrad.pipeline`. With
    ``parallel.gradient_accumulation_fusion`` the functions take fp32 main-grad
    accumulators for every linear weight. ``platform``: the jax platform the stages run
    on (default: jax's default backend), which resolves ``model.attention_backend``.
    """

    model: GPTConfig
    parallel: ParallelConfig
    platform: str | None = None

    def __post_init__(self) -> None:
        if self.platform is None:
            object.__setattr__(self, "platform", jax.default_backend())
        emb, layer, head = _abstract_parts(
            self.model, self.parallel.tensor_model_parallel_size, self.parallel.sequence_parallel,
            self.model.attention_implementation(self.platform))
        object.__setattr__(self, "_emb_def", nnx.split(emb)[0])
        object.__setattr__(self, "_layer_def", nnx.split(layer)[0])
        object.__setattr__(self, "_head_def", nnx.split(head)[0])

    @property
    def tied(self) -> bool:
        return not self.model.untie_embeddings_and_output_weights

    def embed(self, embedding_params: Params, ids: jax.Array) -> jax.Array:
        """int ``[b, s]`` -> ``[b, s(/tp), H]``."""
        return nnx.merge(self._emb_def, embedding_params)(ids)

    def layers(
        self,
        layer_params: Sequence[Params],
        main_grads: Sequence[Mapping[str, Any]] | None,
        x: jax.Array,
    ) -> jax.Array:
        """This stage's ``L / P`` layers in order, unrolled.

        ``layer_params``: one param dict per layer (:func:`unstack_layers`). Unrolled, not
        scanned, so that each layer's main grads are STATIC slices of the flat gradient
        buckets. ``main_grads``: per layer ``{name: main grad}`` (an ``[out, in]``
        accumulator or a :class:`~jax_wgrad.linear.BucketSlot`), or ``None``.
        """
        with jax.named_scope("transformer_layers"):
            for i, p in enumerate(layer_params):
                mg = None if main_grads is None else main_grads[i]
                x = nnx.merge(self._layer_def, p)(x, main_grads=mg)
            return x

    def head_loss(
        self,
        params: Params,
        main_grad: jax.Array | None,
        x: jax.Array,
        labels: jax.Array,
    ) -> jax.Array:
        """Sum of per-token losses of ``x`` ``[b, s(/tp), H]``; ``params`` is the full
        per-device dict (for the tied word embedding); ``main_grad`` accumulates the
        output-layer weight gradient."""
        head = nnx.merge(self._head_def, dict(params["head"]))
        weight = params["embedding"]["word"]["embedding"] if self.tied else None
        return head(x, labels, weight=weight, main_grad=main_grad)


    def final_norm(self, head_params: Params, x: jax.Array) -> jax.Array:
        """The head's final LayerNorm of ``x`` (``head_params``: ``params["head"]``)."""
        return nnx.merge(self._head_def, dict(head_params)).final_norm(x)

    def output_weight(self, params: Params) -> jax.Array:
        """The output layer's ``[V / tp, H]`` weight shard (the word embedding when tied)."""
        if self.tied:
            return params["embedding"]["word"]["embedding"]
        return params["head"]["output"]["weight"]


# --------------------------------------------------------------------------- reference


def _ln_ref(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_loss(params: Params, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Mean next-token cross entropy of a plain single-device fp32 GPT.

    ``tokens``: int ``[B, S + 1]``; inputs are ``tokens[:, :-1]``, labels
    ``tokens[:, 1:]``. Independent of the parallel layers (no collectives, no NNX).
    """
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = ids.shape
    nh, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.layernorm_epsilon
    emb = params["embedding"]
    x = emb["word"]["embedding"][ids] + emb["position"][:s][None]

    def layer(x, p):
        h = _ln_ref(x, p["ln1"], eps)
        qkv = (h @ p["qkv"]["weight"].T + p["qkv"]["bias"]).reshape(b, s, nh, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, -1), v).reshape(b, s, nh * hd)
        x = x + a @ p["proj"]["weight"].T + p["proj"]["bias"]
        h = _ln_ref(x, p["ln2"], eps)
        h = jax.nn.gelu(h @ p["fc1"]["weight"].T + p["fc1"]["bias"], approximate=False)
        return x + h @ p["fc2"]["weight"].T + p["fc2"]["bias"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    head = params["head"]
    x = _ln_ref(x, head["final_norm"], eps)
    w = head["output"]["weight"] if "output" in head else emb["word"]["embedding"]
    logits = x @ w.T
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))
