"""The GPT's NNX modules, one per pipeline role: embedding (first stage), decoder layer
(every stage), head (last stage).

* :class:`GPTEmbedding`: vocab-parallel word embedding + learned positions.
* :class:`TransformerLayer`: pre-LN decoder layer (causal attention, GELU MLP, or a
  Mixture-of-Experts MLP on the layers of ``GPTConfig.moe_layer_pattern``); every stage
  holds ``num_layers / P`` of them.
* :class:`GPTHead`: final norm, column-parallel output layer (the word embedding table
  when tied) and the vocab-parallel cross entropy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.attention import causal_attention, rotary_embedding
from jax_wgrad.functional.context_parallel import (
    ContextParallel,
    context_parallel_attention,
    context_positions,
)
from jax_wgrad.functional.cross_entropy import (
    mask_vocab_padding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
)
from jax_wgrad.functional.fp8 import Fp8Weight
from jax_wgrad.functional.moe import attach_aux_loss, moe_mlp
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.nn.facts import param_facts
from jax_wgrad.nn.norm import make_norm
from jax_wgrad.nn.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_std_for_output_layers,
    vocab_axes,
)
from jax_wgrad.parallel.mesh import CONTEXT, PIPELINE, TENSOR, expert_parallel_axes

__all__ = [
    "GPTEmbedding",
    "GPTHead",
    "MoEExperts",
    "SharedExpertMLP",
    "TransformerLayer",
    "moe_stats_of",
    "ATTENTION_SCOPE",
    "SHARED_EXPERT_SCOPE",
    "MLP_SCOPE",
    "MOE_SCOPE",
    "EMBEDDING_SCOPE",
    "CROSS_ENTROPY_SCOPE",
    "OUTPUT_LAYER_SCOPE",
]

# The GPT's named scopes (``op_name`` metadata of the compiled program), which the
# estimate's breakdown reads (:func:`jax_wgrad.aot.estimate.part_of`).
ATTENTION_SCOPE = "attention"
"""A layer's attention: its norm, the projections and the core."""
MLP_SCOPE = "mlp"
"""A dense layer's MLP."""
MOE_SCOPE = "moe"
"""An MoE layer's routed experts (router, dispatch, experts, combine)."""
SHARED_EXPERT_SCOPE = "shared_expert"
EMBEDDING_SCOPE = "embedding"
OUTPUT_LAYER_SCOPE = "output_layer"
CROSS_ENTROPY_SCOPE = "cross_entropy"


def _dtype(cfg: GPTConfig) -> jnp.dtype:
    return jnp.dtype(cfg.compute_dtype)


class MoEExperts(nnx.Module):
    """The expert weights of one MoE layer: ``fc1 [E/EP, F/etp, H]`` (``[E/EP, 2, F/etp, H]``
    with SwiGLU: gate rows, then up rows), ``fc2 [E/EP, H, F/etp]``, no biases; split over
    the expert axis on dim 0 and, with expert tensor parallelism (``etp_size`` > 1), over
    ``tensor`` on ``F``; with parallel folding (``folded``) over ``(expert, tensor)`` on
    dim 0; else replicated over the tensor ranks."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        ep_size: int,
        etp_size: int = 1,
        folded: bool = False,
        rngs: nnx.Rngs,
    ):
        e, h = cfg.num_moe_experts // ep_size, cfg.hidden_size
        f = cfg.moe_ffn_hidden_size // etp_size
        split = etp_size > 1
        facts = lambda f_axis: param_facts(
            f_axis if split else (0 if folded else None),
            weight_decay=True,
            fused_wgrad=cfg.moe_grouped_gemm,
            expert_axis=0,
        )
        out_std = init_std_for_output_layers(cfg.init_method_std, cfg.num_layers)
        fc1 = (e, 2, f, h) if cfg.swiglu else (e, f, h)
        self.fc1 = nnx.Param(
            cfg.init_method_std * jax.random.normal(rngs.params(), fc1, jnp.float32),
            **facts(len(fc1) - 2),
        )
        self.fc2 = nnx.Param(
            out_std * jax.random.normal(rngs.params(), (e, h, f), jnp.float32), **facts(2)
        )


class SharedExpertMLP(nnx.Module):
    """Megatron's shared experts (``--moe-shared-expert-intermediate-size``): a dense MLP
    of that width beside the routed experts, tensor-parallel like the dense MLP (its
    linears' weight gradients fused into the layer buckets like any dense linear)."""

    def __init__(self, cfg: GPTConfig, *, common: dict, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.moe_shared_expert_intermediate_size
        out_std = init_std_for_output_layers(cfg.init_method_std, cfg.num_layers)
        self.swiglu = cfg.swiglu
        self.fc1 = ColumnParallelLinear(
            h,
            f,
            use_bias=cfg.add_bias_linear,
            gated=cfg.swiglu,
            init_std=cfg.init_method_std,
            rngs=rngs,
            **common,
        )
        self.fc2 = RowParallelLinear(
            f, h, use_bias=cfg.add_bias_linear, init_std=out_std, rngs=rngs, **common
        )

    def __call__(self, x: jax.Array, fp8_weights: Mapping[str, Fp8Weight] | None = None):
        """``[b, s(/tp), H]`` -> same shape; ``fp8_weights``: ``fc1``'s and ``fc2``'s
        weights already quantized (by name; see :meth:`TransformerLayer.fp8_weights`)."""
        return _mlp(self, x, fp8_weights)


def _mlp(module: nnx.Module, x: jax.Array, fp8_weights: Mapping[str, Fp8Weight] | None):
    """``module.fc2(act(module.fc1(x)))``: GELU, or SwiGLU on this rank's gate features and
    its up features; ``fp8_weights``: ``fc1``'s and ``fc2``'s weights already quantized."""
    fp8_weights = fp8_weights or {}
    hidden = module.fc1(x, fp8_weight=fp8_weights.get("fc1"))
    if module.swiglu:
        gate, up = jnp.split(hidden, 2, axis=-1)
        hidden = jax.nn.silu(gate) * up
    else:
        hidden = jax.nn.gelu(hidden, approximate=False)
    return module.fc2(hidden, fp8_weight=fp8_weights.get("fc2"))


class TransformerLayer(nnx.Module):
    """Pre-LN decoder layer: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Activations ``[b, s, H]`` (``[b, s / tp, H]`` with sequence parallelism). With
    ``moe=True`` the MLP is ``cfg``'s Mixture of Experts (:func:`~jax_wgrad.functional.moe_mlp`):
    a router ``[E, H]`` and :class:`MoEExperts` (``ep_size`` expert-parallel ranks over
    :data:`~jax_wgrad.parallel.mesh.EXPERT`; ``etp_size`` > 1: expert tensor parallelism
    over the tensor ranks; ``fold_experts``: Megatron's parallel folding, the ``ep_size``
    ranks spanning ``(expert, tensor)``,
    :attr:`~jax_wgrad.parallel.ParallelConfig.folds_experts`), plus a
    :class:`SharedExpertMLP` when the model has shared experts; each tensor rank routes its
    own tokens. ``cp_size`` > 1: context parallelism over
    :data:`~jax_wgrad.parallel.mesh.CONTEXT` (``[b, s, H]`` holds this context rank's
    ``S / cp`` tokens; the attention core exchanges keys and values by ``cp_comm_type``,
    :func:`~jax_wgrad.functional.context_parallel_attention`).
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
        etp_size: int = 1,
        fold_experts: bool = False,
        cp_size: int = 1,
        cp_comm_type: str = "p2p",
        cp_ring_shift: str = "ppermute",
        rngs: nnx.Rngs,
    ):
        h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
        common = dict(
            tp_size=tp_size,
            axis_name=axis_name,
            sequence_parallel=sequence_parallel,
            fp8=cfg.fp8_config(),
            token_axis=CONTEXT if cp_size > 1 else None,
        )
        out_std = init_std_for_output_layers(cfg.init_method_std, cfg.num_layers)
        norm = lambda width: make_norm(cfg.normalization, width, epsilon=cfg.layernorm_epsilon)
        groups, heads = cfg.query_groups, cfg.num_attention_heads
        self.groups, self.per_group = groups // tp_size, heads // groups
        self.head_dim = d
        self.attention = attention
        self.context = (
            ContextParallel(cp_size, cp_comm_type, CONTEXT, cp_ring_shift) if cp_size > 1 else None
        )
        self.window = cfg.attention_window  # sliding-window attention (None: none)
        self.rope = (
            (cfg.rotary_base, cfg.rotary_percent, cfg.rope_scaling_config())
            if cfg.position_embedding_type == "rope"
            else None
        )
        self.swiglu = cfg.swiglu
        self.ln1 = norm(h)
        # Megatron's GQA layout: per query group its query heads, then its key and value head.
        self.qkv = ColumnParallelLinear(
            h,
            groups * (self.per_group + 2) * d,
            use_bias=cfg.add_bias_linear or cfg.add_qkv_bias,
            init_std=cfg.init_method_std,
            rngs=rngs,
            **common,
        )
        if cfg.qk_layernorm:
            self.q_norm, self.k_norm = norm(d), norm(d)
        self.proj = RowParallelLinear(
            heads * d, h, use_bias=cfg.add_bias_linear, init_std=out_std, rngs=rngs, **common
        )
        self.ln2 = norm(h)
        self.moe = cfg.moe_config() if moe else None
        if self.moe is None:
            self.fc1 = ColumnParallelLinear(
                h,
                f,
                use_bias=cfg.add_bias_linear,
                gated=cfg.swiglu,
                init_std=cfg.init_method_std,
                rngs=rngs,
                **common,
            )
            self.fc2 = RowParallelLinear(
                f, h, use_bias=cfg.add_bias_linear, init_std=out_std, rngs=rngs, **common
            )
            return
        self.router = nnx.Param(
            cfg.init_method_std
            * jax.random.normal(rngs.params(), (cfg.num_moe_experts, h), jnp.float32),
            **param_facts(None, weight_decay=True),
        )
        self.experts = MoEExperts(
            cfg, ep_size=ep_size, etp_size=etp_size, folded=fold_experts, rngs=rngs
        )
        if cfg.moe_shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpertMLP(cfg, common=common, rngs=rngs)
            self.shared_expert_overlap = cfg.moe_shared_expert_overlap
        self.ep_size, self.tp_size, self.etp_size = ep_size, tp_size, etp_size
        self.fold_experts = fold_experts
        self.sequence_parallel = sequence_parallel and tp_size > 1

    def _fp8_linears(self) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
        """The linears that run in FP8, by name (``"shared_expert"``'s as a dict)."""
        linears = {"qkv": self.qkv, "proj": self.proj}
        if self.moe is None:
            linears.update(fc1=self.fc1, fc2=self.fc2)
        return {k: m for k, m in linears.items() if m.fp8 is not None}

    def fp8_weights(self) -> dict[str, Any]:
        """The weights of the linears that run in FP8, quantized as their GEMMs quantize
        them (:meth:`~jax_wgrad.nn.ColumnParallelLinear.quantized_weight`), by name
        (``{"qkv": Fp8Weight, ..., "shared_expert": {"fc1": ..., "fc2": ...}}``; empty
        without FP8): what a step computes once, before its microbatches, and hands to
        every call (``__call__``'s ``fp8_weights``), as TransformerEngine caches a
        weight's FP8 copy over the microbatches of a step."""
        out: dict[str, Any] = {k: m.quantized_weight() for k, m in self._fp8_linears().items()}
        shared = getattr(self, "shared_expert", None)
        if shared is not None and shared.fc1.fp8 is not None:
            out["shared_expert"] = {
                k: getattr(shared, k).quantized_weight() for k in ("fc1", "fc2")
            }
        return out

    def __call__(self, x: jax.Array, fp8_weights: Mapping[str, Any] | None = None) -> jax.Array:
        """``x``: ``[b, s(/tp), H]`` -> same shape; ``fp8_weights``: :meth:`fp8_weights`
        of this layer's parameters (else each FP8 linear quantizes its weight at each use:
        the same values).

        An MoE layer records its :class:`~jax_wgrad.functional.MoEStats` in the
        ``nnx.Intermediate`` ``moe_stats``, one per call (read them back with
        :func:`moe_stats_of`).
        """
        fw = fp8_weights or {}
        with jax.named_scope(ATTENTION_SCOPE):
            attended = self._attention(self.ln1(x), fw.get("qkv"))
            x = x + self.proj(attended, fp8_weight=fw.get("proj"))
        if self.moe is not None:
            h = self.ln2(x)
            y = self._moe_mlp(h)
            if hasattr(self, "shared_expert"):
                if not self.shared_expert_overlap:  # after the routed experts (Megatron)
                    y, h = jax.lax.optimization_barrier((y, h))
                with jax.named_scope(SHARED_EXPERT_SCOPE):
                    y = y + self.shared_expert(h, fw.get("shared_expert"))
            return x + y
        with jax.named_scope(MLP_SCOPE):
            return x + _mlp(self, self.ln2(x), fw)

    def _attention(self, h: jax.Array, qkv_fp8_weight: Fp8Weight | None = None) -> jax.Array:
        """``[b, s(/tp), H]`` -> the attention output ``[b, s, heads/tp * d]`` of this
        rank's query groups (the whole sequence, or this context rank's ``S / cp`` tokens
        at their positions: the qkv projection all-gathers it under sequence parallelism,
        so RoPE sees positions ``0 .. S-1``)."""
        qkv = self.qkv(h, fp8_weight=qkv_fp8_weight)
        b, s = qkv.shape[:2]
        m, d = self.per_group, self.head_dim
        qkv = qkv.reshape(b, s, self.groups, m + 2, d)
        q = qkv[:, :, :, :m].reshape(b, s, self.groups * m, d)
        k, v = qkv[:, :, :, m], qkv[:, :, :, m + 1]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cp = self.context
        positions = None if cp is None else context_positions(s * cp.size, cp.size, CONTEXT)
        if self.rope is not None:
            base, percent, scaling = self.rope
            rope = dict(base=base, percent=percent, scaling=scaling, positions=positions)
            q, k = rotary_embedding(q, **rope), rotary_embedding(k, **rope)
        if cp is not None:
            return context_parallel_attention(
                q, k, v, positions, cp, implementation=self.attention, window=self.window
            )
        return causal_attention(q, k, v, implementation=self.attention, window=self.window)

    def _sequence_axes(self) -> str | tuple[str, ...] | None:
        """The axes a sequence's tokens are split over (the router's load-balancing
        statistics are summed over them): ``tensor`` under sequence parallelism, and
        ``context``."""
        axes = ((TENSOR,) if self.sequence_parallel else ()) + (
            () if self.context is None else (CONTEXT,)
        )
        return axes[0] if len(axes) == 1 else (axes or None)

    def _moe_mlp(self, h: jax.Array) -> jax.Array:
        """``[b, s(/tp), H]`` -> the MoE MLP's output; its aux loss joins the backward
        weighted by the microbatch's token count (:func:`attach_aux_loss`)."""
        b, s, hid = h.shape
        with jax.named_scope(MOE_SCOPE):
            params = {
                "router": self.router[...],
                "fc1": self.experts.fc1,  # the variables: their routes
                "fc2": self.experts.fc2,
            }
            y, stats = moe_mlp(
                params,
                h.reshape(b * s, hid),
                self.moe,
                expert_axis=expert_parallel_axes(self.ep_size, self.fold_experts),
                expert_tensor_axis=TENSOR if self.etp_size > 1 else None,
                sequence_axis=self._sequence_axes(),
            )
            # What Module.sow did, without it: flax 0.12.6 deprecates sow outside
            # nnx.capture, which flax 0.12.0-0.12.5 do not have.
            before = self.moe_stats.get_value() if hasattr(self, "moe_stats") else ()
            self.moe_stats = nnx.Intermediate((*before, stats))
            tokens = b * s * (self.tp_size if self.sequence_parallel else 1)
            tokens *= 1 if self.context is None else self.context.size
            return attach_aux_loss(y, stats.aux_loss, float(tokens)).reshape(b, s, hid)


def moe_stats_of(layer: nnx.Module) -> tuple:
    """The :class:`~jax_wgrad.functional.MoEStats` an MoE layer recorded in its calls
    since the last read (``()`` for none), removed from the layer."""
    if not hasattr(layer, "moe_stats"):
        return ()
    stats = layer.moe_stats.get_value()
    del layer.moe_stats
    return tuple(stats)


class GPTEmbedding(nnx.Module):
    """Word (vocab-parallel) plus learned position embedding; first pipeline stage (with
    ``vocab_pipeline_size > 1``: the word table split over ``(pipeline, tensor)``, run by
    every stage, :class:`~jax_wgrad.nn.VocabParallelEmbedding`)."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = TENSOR,
        vocab_pipeline_size: int = 1,
        rngs: nnx.Rngs,
    ):
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.dtype = _dtype(cfg)
        self.word = VocabParallelEmbedding(
            cfg.padded_vocab_size,  # the padding rows: initialised as the others (Megatron)
            cfg.hidden_size,
            tp_size=tp_size,
            axis_name=axis_name,
            sequence_parallel=sequence_parallel,
            pipeline_size=vocab_pipeline_size,
            init_std=cfg.init_method_std,
            rngs=rngs,
        )
        if cfg.position_embedding_type == "learned_absolute":  # rope: in the attention
            self.position = nnx.Param(
                cfg.init_method_std
                * jax.random.normal(rngs.params(), (cfg.seq_length, cfg.hidden_size), jnp.float32),
                **param_facts(None),
            )

    def __call__(self, ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``ids``: int ``[b, s]`` at ``positions`` (int ``[s]``, default ``0 .. s - 1``; a
        context rank's :func:`~jax_wgrad.functional.context_positions`) -> ``[b, s(/tp),
        H]`` in the compute dtype."""
        with jax.named_scope(EMBEDDING_SCOPE):
            x = self.word(ids, dtype=self.dtype)
            if not hasattr(self, "position"):
                return x
            s_local = x.shape[1]
            start = 0
            if self.sequence_parallel:
                start = jax.lax.axis_index(self.axis_name) * s_local
            table = self.position[...]
            if positions is not None:
                table = jnp.take(table, positions, axis=0)
            pos = jax.lax.dynamic_slice_in_dim(table, start, s_local, axis=0)
            return x + pos.astype(self.dtype)[None]


class GPTHead(nnx.Module):
    """Final norm, output layer and vocab-parallel cross entropy; last stage.

    With tied embeddings the output layer allocates no weight and is given the word
    embedding table ``[V / tp, H]`` at call time. With ``vocab_pipeline_size = P > 1`` the
    output layer's vocabulary is split over ``(pipeline, tensor)`` (``[V / (P tp), H]``) and
    every stage runs the head on the last stage's ``x`` (summed over ``pipeline`` from the
    last stage; its backward sums every stage's share of ``dx`` back to it): the final
    norm on each, its own logits, the cross entropy reduced over ``(pipeline, tensor)``.

    ``V`` is the padded vocabulary (``cfg.padded_vocab_size``); the padding rows' logits
    are ``-inf`` (:meth:`logits`), so the loss and gradients are the unpadded model's.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        axis_name: str = TENSOR,
        vocab_pipeline_size: int = 1,
        rngs: nnx.Rngs,
    ):
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.vocab_pipeline_size = vocab_pipeline_size
        self.final_norm = make_norm(
            cfg.normalization, cfg.hidden_size, epsilon=cfg.layernorm_epsilon
        )
        padded = cfg.padded_vocab_size
        self.vocab_size = cfg.vocab_size if padded != cfg.vocab_size else None
        self.output = ColumnParallelLinear(
            cfg.hidden_size,
            padded // vocab_pipeline_size,
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
        weight: nnx.Variable | jax.Array | None = None,
        with_lse: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x``: ``[b, s(/tp), H]``, ``labels``: int ``[b, s]`` -> fp32 scalar SUM of the
        per-token losses (identical on every tensor rank); with ``with_lse`` also the fp32
        ``[b, s]`` logsumexp of the logits over the whole vocabulary (what the deferred
        output-layer wgrad's recompute mode keeps)."""
        pp = self.vocab_pipeline_size
        shards, axes = self.tp_size * pp, vocab_axes(self.axis_name, self.tp_size, pp)
        if pp > 1:  # the last stage's x on every stage
            last = jax.lax.axis_index(PIPELINE) == pp - 1
            x = jax.lax.psum(jnp.where(last, x, jnp.zeros((), x.dtype)), PIPELINE)
        logits = self.logits(x, weight)
        with jax.named_scope(CROSS_ENTROPY_SCOPE):
            losses = vocab_parallel_cross_entropy(logits, labels, tp_size=shards, axis_name=axes)
        if not with_lse:
            return jnp.sum(losses)
        lse = vocab_parallel_logsumexp(
            jax.lax.stop_gradient(logits), shards, axes
        )  # kept, never differentiated
        return jnp.sum(losses), lse

    def logits(self, x: jax.Array, weight: nnx.Variable | jax.Array | None = None) -> jax.Array:
        """The final norm and output layer of ``x`` ``[b, s(/tp), H]`` (already the last
        stage's on every stage with the vocabulary over the pipeline): ``[b, s, V / (P
        tp)]``, this device's vocabulary shard, the padding rows' columns ``-inf``
        (:func:`~jax_wgrad.functional.cross_entropy.mask_vocab_padding`)."""
        pp = self.vocab_pipeline_size
        with jax.named_scope(OUTPUT_LAYER_SCOPE):
            logits = self.output(self.final_norm(x), weight)
            if self.vocab_size is None:
                return logits
            axes = vocab_axes(self.axis_name, self.tp_size, pp)
            return mask_vocab_padding(logits, self.vocab_size, axes)
