"""The GPT's NNX modules, one per pipeline role: embedding (first stage), decoder layer
(every stage), head (last stage).

* :class:`GPTEmbedding`: vocab-parallel word embedding + learned positions.
* :class:`TransformerLayer`: pre-LN decoder layer (causal attention, GELU MLP, or a
  Mixture-of-Experts MLP on the layers of ``GPTConfig.moe_layer_pattern``); every stage
  holds ``num_layers / P`` of them.
* :class:`GPTHead`: final LayerNorm, column-parallel output layer (the word embedding table
  when tied) and the vocab-parallel cross entropy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.attention import causal_attention
from jax_wgrad.functional.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
)
from jax_wgrad.functional.moe import attach_aux_loss, moe_mlp
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.nn.facts import param_facts
from jax_wgrad.nn.norm import LayerNorm
from jax_wgrad.nn.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_std_for_output_layers,
)
from jax_wgrad.parallel.mesh import EXPERT, TENSOR

__all__ = ["TransformerLayer", "MoEExperts", "GPTEmbedding", "GPTHead"]


def _dtype(cfg: GPTConfig) -> jnp.dtype:
    return jnp.dtype(cfg.compute_dtype)


class MoEExperts(nnx.Module):
    """The expert weights of one MoE layer: ``fc1 [E/EP, F, H]``, ``fc2 [E/EP, H, F]``
    (split over the expert axis on dim 0, replicated over tensor ranks; no biases)."""

    def __init__(self, cfg: GPTConfig, *, ep_size: int, rngs: nnx.Rngs):
        e, h, f = cfg.num_moe_experts // ep_size, cfg.hidden_size, cfg.moe_ffn_hidden_size
        facts = param_facts(None, weight_decay=True, fused_wgrad=cfg.moe_grouped_gemm,
                            expert_axis=0)
        out_std = init_std_for_output_layers(cfg.init_method_std, cfg.num_layers)
        self.fc1 = nnx.Param(cfg.init_method_std
                             * jax.random.normal(rngs.params(), (e, f, h), jnp.float32), **facts)
        self.fc2 = nnx.Param(out_std * jax.random.normal(rngs.params(), (e, h, f), jnp.float32),
                             **facts)


class TransformerLayer(nnx.Module):
    """Pre-LN decoder layer: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Activations ``[b, s, H]`` (``[b, s / tp, H]`` with sequence parallelism). With
    ``moe=True`` the MLP is ``cfg``'s Mixture of Experts (:func:`~jax_wgrad.functional.moe_mlp`):
    a router ``[E, H]`` and :class:`MoEExperts` (``ep_size`` expert-parallel ranks over
    :data:`~jax_wgrad.parallel.mesh.EXPERT`); each tensor rank routes its own tokens.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = TENSOR,
        attention: str = "xla",
        moe: bool = False,
        ep_size: int = 1,
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
        self.moe = cfg.moe_config() if moe else None
        if self.moe is None:
            self.fc1 = ColumnParallelLinear(h, f, init_std=cfg.init_method_std, rngs=rngs,
                                            **common)
            self.fc2 = RowParallelLinear(f, h, init_std=out_std, rngs=rngs, **common)
            return
        self.router = nnx.Param(cfg.init_method_std * jax.random.normal(
            rngs.params(), (cfg.num_moe_experts, h), jnp.float32),
            **param_facts(None, weight_decay=True))
        self.experts = MoEExperts(cfg, ep_size=ep_size, rngs=rngs)
        self.ep_size, self.tp_size = ep_size, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1

    def __call__(
        self, x: jax.Array, *, main_grads: Mapping[str, Any] | None = None,
        moe_stats: list | None = None,
    ) -> jax.Array:
        """``x``: ``[b, s(/tp), H]`` -> same shape.

        ``main_grads``: optional, shaped like the layer's parameter tree (missing entries
        and ``None`` leaves: not fused): at each linear's ``weight`` an fp32 accumulator or
        a slot (gradient accumulation fusion); an MoE layer's ``experts`` entry holds its
        ``fc1`` and ``fc2`` expert weights' BucketSlot objects. ``moe_stats``: a list an MoE
        layer appends its :class:`~jax_wgrad.functional.MoEStats` to (return them from the
        traced function).
        """
        mg = main_grads or {}
        weight = lambda name: (mg.get(name) or {}).get("weight")
        with jax.named_scope("attention"):
            qkv = self.qkv(self.ln1(x), main_grad=weight("qkv"))
            b, s = qkv.shape[:2]
            qkv = qkv.reshape(b, s, self.heads, 3, self.head_dim)
            attn = causal_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2],
                                    implementation=self.attention)
            x = x + self.proj(attn, main_grad=weight("proj"))
        if self.moe is not None:
            experts = mg.get("experts") or {}
            slots = (experts.get("fc1"), experts.get("fc2"))
            return x + self._moe_mlp(self.ln2(x), None if slots[0] is None else slots,
                                     moe_stats)
        with jax.named_scope("mlp"):
            hidden = jax.nn.gelu(self.fc1(self.ln2(x), main_grad=weight("fc1")),
                                 approximate=False)
            x = x + self.fc2(hidden, main_grad=weight("fc2"))
        return x

    def _moe_mlp(self, h: jax.Array, main_grads, moe_stats: list | None) -> jax.Array:
        """``[b, s(/tp), H]`` -> the MoE MLP's output; its aux loss joins the backward
        weighted by the microbatch's token count (:func:`attach_aux_loss`)."""
        b, s, hid = h.shape
        with jax.named_scope("moe"):
            params = {"router": self.router[...], "fc1": self.experts.fc1[...],
                      "fc2": self.experts.fc2[...]}
            y, stats = moe_mlp(params, h.reshape(b * s, hid), self.moe,
                               expert_axis=EXPERT if self.ep_size > 1 else None,
                               sequence_axis=TENSOR if self.sequence_parallel else None,
                               main_grads=main_grads)
            if moe_stats is not None:
                moe_stats.append(stats)
            tokens = b * s * (self.tp_size if self.sequence_parallel else 1)
            return attach_aux_loss(y, stats.aux_loss, float(tokens)).reshape(b, s, hid)


class GPTEmbedding(nnx.Module):
    """Word (vocab-parallel) plus learned position embedding; first pipeline stage."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = TENSOR,
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
            **param_facts(None),
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
        axis_name: str = TENSOR,
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
        with_lse: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x``: ``[b, s(/tp), H]``, ``labels``: int ``[b, s]`` -> fp32 scalar SUM of the
        per-token losses (identical on every tensor rank); with ``with_lse`` also the fp32
        ``[b, s]`` logsumexp of the logits over the whole vocabulary (what the deferred
        output-layer wgrad's recompute mode keeps)."""
        with jax.named_scope("output_layer"):
            logits = self.output(self.final_norm(x), weight, main_grad=main_grad)
        with jax.named_scope("cross_entropy"):
            losses = vocab_parallel_cross_entropy(
                logits, labels, tp_size=self.tp_size, axis_name=self.axis_name
            )
        if not with_lse:
            return jnp.sum(losses)
        lse = vocab_parallel_logsumexp(jax.lax.stop_gradient(logits), self.tp_size,
                                       self.axis_name)  # kept, never differentiated
        return jnp.sum(losses), lse
