"""The GPT as a :class:`~jax_wgrad.layout.program.StageModel`: its modules for the
library's layout, and pure functions of one device's parameter shards for the pipeline
executor."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_wgrad.functional.context_parallel import context_positions, context_tokens
from jax_wgrad.functional.cross_entropy import recompute_dy
from jax_wgrad.functional.fp8 import check_fp8_platform
from jax_wgrad.functional.moe import MoEStats
from jax_wgrad.functional.residual_slots import ResidualSlots
from jax_wgrad.functional.stacked import LayerRecompute, scan_layers
from jax_wgrad.grads.chunks import DeviceTree, Window
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.modules import moe_stats_of
from jax_wgrad.models.gpt.params import (
    abstract_modules,
    init_params,
    model_parts,
    period_pattern,
)
from jax_wgrad.models.parts import ModelParts
from jax_wgrad.nn.tensor_parallel import vocab_axes
from jax_wgrad.ops.fp8 import CUDA_MULTIPLE
from jax_wgrad.ops.handlers import DENSE_FAMILIES
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import AXES, CONTEXT, TENSOR

__all__ = ["GPTProgram"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class GPTProgram:
    """The GPT's stage programs (a :class:`~jax_wgrad.layout.program.StageModel`; the
    library lays it out with :func:`~jax_wgrad.layout.lay_out`).

    Its parts (:meth:`parts`, :func:`~jax_wgrad.models.gpt.params.model_parts`): the
    ``embedding``, the dense and MoE layer kinds in a period of ``moe_layer_freq`` layers,
    the ``head``. In the device tree the layout hands it, ``stage`` holds this stage's
    layers stacked over its periods (one tree per layer of the period), ``experts`` the
    stacked expert weights of its MoE layers (empty for a dense model), ``shared`` the
    ``{embedding, head}`` tree every stage holds. ``pre`` embeds the tokens
    ``batch[:, :-1]``, ``body`` runs the stage's layers (``aux``: the MoE statistics summed
    over them, ``()`` for a dense model), ``post`` the head on the labels ``batch[:, 1:]``
    (``aux``: the per-token logsumexp when asked for the output gradient's extras, which
    the executor does when the deferred output-layer wgrad recomputes its gradient, else
    ``()``).

    Its optional capabilities (:mod:`jax_wgrad.layout.program`): a tied output weight
    (:meth:`tied_output_weight`), the vocabulary over the pipeline
    (:meth:`vocab_over_pipeline`) and the deferral's recompute mode
    (:meth:`defer_extras`, :meth:`recompute_output_grad`).

    ``platform``: the jax platform the programs run on (default: jax's default backend),
    which resolves ``model.attention_backend``.
    """

    model: GPTConfig
    parallel: ParallelConfig
    platform: str | None = None

    def __post_init__(self) -> None:
        if self.platform is None:
            object.__setattr__(self, "platform", jax.default_backend())
        if self.model.fp8_format is not None:
            check_fp8_platform(self.platform)
            if self.platform in ("gpu", "cuda"):
                self._check_fp8_shapes()
        par = self.parallel
        impl = self.model.attention_implementation(self.platform, par)
        if impl != "xla" and not self.model.cudnn_context_parallel(par):
            window = " with a sliding window" if par.cp_comm_type == "p2p" else ""
            raise ValueError(
                f"cp_comm_type {par.cp_comm_type!r}{window} computes its attention blocks "
                f"in XLA; attention_backend {impl!r} runs with cp_comm_type 'a2a' or 'p2p' "
                "without a window ('auto': XLA's blocks here)"
            )
        emb, layer, moe_layer, head = self._graph_defs(self.model)
        object.__setattr__(self, "_emb_def", emb)
        object.__setattr__(self, "_layer_def", layer)
        object.__setattr__(self, "_moe_layer_def", moe_layer)
        object.__setattr__(self, "_head_def", head)
        object.__setattr__(self, "_bf16_defs", self._layer_defs_without_fp8())

    def _graph_defs(self, model: GPTConfig) -> tuple[Any, Any, Any, Any]:
        """The graph defs ``(embedding, dense layer, MoE layer or None, head)`` of
        ``model``'s modules in this layout."""
        modules = abstract_modules(
            model,
            self.parallel.tensor_model_parallel_size,
            self.parallel.sequence_parallel,
            model.attention_implementation(self.platform, self.parallel),
            self.parallel.expert_model_parallel_size,
            self._vocab_pp,
            self._etp,
            self._fold,
            self.parallel.context_parallel_size,
            self.parallel.cp_comm_type,
            # XLA's CPU collective permutes misbehave under the pipeline's conditionals
            "all_to_all" if self.platform == "cpu" else "ppermute",
        )
        return tuple(None if m is None else nnx.split(m)[0] for m in modules)

    def _layer_defs_without_fp8(self) -> tuple[Any, Any] | None:
        """The graph defs ``(dense layer, MoE layer)`` of the layers kept out of FP8
        (``first_last_layers_bf16``), ``None`` when there are none; checks that they are
        whole periods of layers (what one scan iteration runs)."""
        first, last = self.model.layers_in_bf16()
        if (first, last) == (0, 0):
            return None
        self.model.check_layers_in_bf16(self.parallel)  # the program may be built unvalidated
        p = len(self.period)
        for name, n in (
            ("num_layers_at_start_in_bf16", first),
            ("num_layers_at_end_in_bf16", last),
        ):
            if n % p:
                raise ValueError(
                    f"{name} ({n}) must be a multiple of the layers of a period "
                    f"({p}: moe_layer_freq's pattern), which one layer-scan iteration runs"
                )
        _, layer, moe_layer, _ = self._graph_defs(self.model.without_fp8())
        return layer, moe_layer

    def _check_fp8_shapes(self) -> None:
        """On a GPU every FP8 linear's tokens and widths on a tensor rank must be
        multiples of :data:`~jax_wgrad.ops.fp8.CUDA_MULTIPLE` (cuBLASLt's FP8 GEMMs);
        raises ``ValueError`` naming the ones that are not."""
        m, tp = self.model, self.parallel.tensor_model_parallel_size
        gated = 2 if m.swiglu else 1
        sizes = {
            "micro_batch_size x seq_length (tokens of a GEMM)": (
                self.parallel.micro_batch_size * m.seq_length
            ),
            "hidden_size": m.hidden_size,
            "the qkv projection's width / tensor_model_parallel_size": (
                m.query_groups * (m.num_attention_heads // m.query_groups + 2) * m.head_dim // tp
            ),
            "num_attention_heads x kv_channels / tensor_model_parallel_size": (
                m.num_attention_heads * m.head_dim // tp
            ),
            "ffn_hidden_size / tensor_model_parallel_size": gated * m.ffn_hidden_size // tp,
        }
        if m.moe_shared_expert_intermediate_size is not None:
            sizes["moe_shared_expert_intermediate_size / tensor_model_parallel_size"] = (
                m.moe_shared_expert_intermediate_size // tp
            )
        bad = [f"{name} = {v}" for name, v in sizes.items() if v % CUDA_MULTIPLE]
        if bad:
            raise ValueError(
                f"fp8_format on a GPU needs the FP8 GEMMs' sizes to be multiples of "
                f"{CUDA_MULTIPLE} (cuBLASLt's FP8 kernels); not: {'; '.join(bad)}"
            )

    @property
    def tied(self) -> bool:
        return not self.model.untie_embeddings_and_output_weights

    @property
    def _recompute(self) -> LayerRecompute:
        """Megatron's recompute options of the parallel config, applied inside the layer
        scan (:mod:`jax_wgrad.functional.stacked`), whose iterations are periods of
        layers (:attr:`period`): ``recompute_num_layers`` counts layers."""
        par, k = self.parallel, len(self.period)
        n = par.recompute_num_layers
        if n is not None and n % k:
            raise ValueError(
                f"recompute_num_layers ({n}) must be a multiple of the "
                f"{k} layers of the repeating MoE layer pattern "
                f"(moe_layer_freq): the layer scan recomputes whole periods"
            )
        return LayerRecompute(
            par.recompute_granularity, par.recompute_method, None if n is None else n // k
        )

    @property
    def period(self) -> tuple[bool, ...]:
        """Per layer of the repeating period of layers a stage scans over: an MoE layer
        (:func:`~jax_wgrad.models.gpt.params.period_pattern`)."""
        return period_pattern(self.model)

    @property
    def moe(self) -> bool:
        return self.model.num_moe_experts is not None

    @property
    def fused_op_families(self) -> tuple[str, ...]:
        """The op families the layers call with ``gradient_accumulation_fusion``
        (:data:`~jax_wgrad.ops.OP_FAMILIES`): a dense model's
        (:data:`~jax_wgrad.ops.DENSE_FAMILIES`), and for an MoE model its expert
        linears': ``"ragged"`` when dropless (``moe_expert_capacity_factor`` None: the
        ragged GEMMs, forward and backward), else ``"grouped"`` when ``moe_grouped_gemm``
        fuses the expert weight gradients (without it the capacity buffers' GEMMs are
        XLA's)."""
        if not self.moe:
            return DENSE_FAMILIES
        if self.model.moe_expert_capacity_factor is None:
            return (*DENSE_FAMILIES, "ragged")
        return (*DENSE_FAMILIES, "grouped") if self.model.moe_grouped_gemm else DENSE_FAMILIES

    # -- the parts and the capabilities the layout reads

    @property
    def _vocab_pp(self) -> int:
        par = self.parallel
        return par.pipeline_model_parallel_size if par.vocab_parallel_over_pipeline else 1

    @property
    def _etp(self) -> int:
        """Expert-tensor-parallel size of the MoE layers (1 for a dense model)."""
        return self.parallel.expert_tensor_parallel_size if self.moe else 1

    @property
    def _fold(self) -> bool:
        """MoE parallel folding (:attr:`~jax_wgrad.parallel.ParallelConfig.folds_experts`;
        False for a dense model)."""
        return self.parallel.folds_experts if self.moe else False

    def parts(self) -> ModelParts:
        """The GPT's modules for the layout (:func:`~jax_wgrad.models.gpt.params.model_parts`)."""
        return model_parts(self.model, self._etp, self._fold)

    def init_params(self, seed: int = 0) -> Params:
        """Full canonical parameters from ``seed`` (:func:`~jax_wgrad.models.gpt.init_params`)."""
        return init_params(self.model, seed)

    def tied_output_weight(self) -> tuple[str, ...] | None:
        """The word embedding is the output layer's weight unless untied."""
        return ("embedding", "word", "embedding") if self.tied else None

    def vocab_over_pipeline(self) -> tuple[tuple[str, ...], ...]:
        """With ``vocab_parallel_over_pipeline``: the word embedding and (untied) the output
        layer's weight, split over ``(pipeline, tensor)``."""
        if self._vocab_pp == 1:
            return ()
        word = ("embedding", "word", "embedding")
        return (word,) if self.tied else (word, ("head", "output", "weight"))

    # -- the stage programs

    def pre(self, params: DeviceTree, batch: jax.Array) -> tuple[jax.Array, tuple]:
        """Tokens ``[mb, S + 1]`` -> the embedding of ``batch[:, :-1]`` (this context
        rank's tokens of it), ``[mb, s(/tp), H]``."""
        emb = nnx.merge(self._emb_def, params.shared["embedding"])
        cp = self.parallel.context_parallel_size
        if cp == 1:
            return emb(batch[:, :-1]), ()
        positions = context_positions(self.model.seq_length, cp, CONTEXT)
        return emb(self._context_tokens(batch[:, :-1]), positions), ()

    def splits_context(self) -> bool:
        """Context parallelism (:class:`~jax_wgrad.layout.program.SplitsContext`): ``pre``
        and ``post`` take this context rank's load-balanced chunks, the layers' attention
        runs over the ``context`` axis."""
        return True

    def _context_tokens(self, tokens: jax.Array) -> jax.Array:
        """``[mb, S]`` -> this context rank's ``[mb, S / cp]`` (Megatron's
        ``get_batch_on_this_cp_rank``; the batch itself is whole on every context rank)."""
        return context_tokens(tokens, self.parallel.context_parallel_size, CONTEXT)

    def prepare(self, params: DeviceTree) -> list | None:
        """With FP8: the weights of this stage's FP8 linears quantized once for the step
        (:meth:`~jax_wgrad.models.gpt.TransformerLayer.fp8_weights` of every layer,
        stacked ``[n, ...]`` like the layers, one tree per layer of the period), which
        every microbatch's forward and backward then read instead of quantizing them at
        each use (:class:`~jax_wgrad.layout.PreparedWeights`); ``None`` without FP8."""
        if self.model.fp8_format is None:
            return None
        out, experts = [], iter(params.experts)
        for j, moe in enumerate(self.period):
            lp = dict(params.stage[j])
            if moe:
                lp["experts"] = next(experts)
            layer_def = self._moe_layer_def if moe else self._layer_def
            out.append(jax.vmap(lambda s, d=layer_def: nnx.merge(d, s).fp8_weights())(lp))
        return out

    def writes_residual_slots(self) -> bool:
        """The layer scan writes the pipeline's residual slots
        (:class:`~jax_wgrad.layout.WritesResidualSlots`): always."""
        return True

    def body(
        self,
        params: DeviceTree,
        x: jax.Array,
        layers: Window | None = None,
        prepared: list | None = None,
        slots: ResidualSlots | None = None,
    ):
        """This stage's ``L / P`` layers in order (with ``layers``: model chunk
        ``layers.index``'s ``L / (P V)`` of them), as one ``lax.scan`` over its periods of
        layers (:func:`~jax_wgrad.functional.scan_layers`; compile time flat in the
        depth): ``(y, MoE statistics summed over its MoE layers)`` (``()`` for a dense
        model); ``prepared``: :meth:`prepare` of ``params`` (else each FP8 linear
        quantizes its weight at each use: the same values); ``slots``: the pipeline
        forward's residual slots, written by the layer scan (``scan_layers(slots=)``)."""
        stacked = {"stage": params.stage, "experts": params.experts}
        if prepared is not None:
            stacked["fp8_weights"] = prepared
        rows = None
        if layers is not None and layers.count > 1:
            per_chunk = jax.tree.leaves(params.stage)[0].shape[0] // layers.count
            rows = (layers.index * per_chunk, per_chunk)
        with jax.named_scope("transformer_layers"):
            y, stats = scan_layers(
                self._precision_runs(jax.tree.leaves(params.stage)[0].shape[0], rows),
                x,
                stacked,
                unroll=self.model.layer_scan_unroll,
                rows=rows,
                recompute=self._recompute,
                slots=slots,
            )
        if not self.moe:
            return y, ()
        return y, jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)

    def _precision_runs(self, n: int, rows: tuple[Any, int] | None):
        """The layer functions of this call's periods (``scan_layers``' ``layer``): one,
        or with ``first_last_layers_bf16`` (no pipeline parallelism: the stage holds all
        ``n`` periods) the first and last periods' without FP8."""
        if self._bf16_defs is None:
            return self._period
        assert rows is None, "first_last_layers_bf16 is refused with pipeline parallelism"
        p = len(self.period)
        first, last = (k // p for k in self.model.layers_in_bf16())
        first = min(first, n)
        last = min(last, n - first)
        bf16 = lambda params, x: self._period(params, x, self._bf16_defs)
        return ((first, bf16), (n - first - last, self._period), (last, bf16))

    def _period(self, p, x: jax.Array, defs: tuple[Any, Any] | None = None):
        """One period of layers (:func:`~jax_wgrad.models.gpt.params.period_pattern`):
        ``(y, its MoE layers' statistics summed)``; ``defs``: the ``(dense, MoE)`` layer
        graph defs (default: the model's)."""
        dense_def, moe_def = defs or (self._layer_def, self._moe_layer_def)
        experts = iter(p["experts"])
        # the FP8 weights quantized for the step (prepare), for the FP8 layers
        fp8_weights = p.get("fp8_weights") if defs is None else None
        stats: list = []
        for j, moe in enumerate(self.period):
            lp = dict(p["stage"][j])
            if moe:
                lp["experts"] = next(experts)
            layer = nnx.merge(moe_def if moe else dense_def, lp)
            x = layer(x, None if fp8_weights is None else fp8_weights[j])
            stats.extend(moe_stats_of(layer))
        if not self.moe:
            return x, ()
        total = self._stats_zeros()
        for st in stats:
            routed = jnp.sum(st.tokens_per_expert)
            total = MoEStats(
                total.aux_loss + st.aux_loss,
                total.tokens_per_expert + st.tokens_per_expert,
                total.dropped_fraction + st.dropped_fraction * routed,
                total.overflow_rows + st.overflow_rows,
            )
        return x, total

    def _stats_zeros(self) -> MoEStats:
        # aux loss, tokens per expert [E], in dropped_fraction's place the dropped COUNT, and
        # the dropless dispatch's overflow rows.
        e = self.model.num_moe_experts
        zero = jnp.float32(0.0)
        return MoEStats(zero, jnp.zeros((e,), jnp.float32), zero, zero)

    def post(
        self,
        params: DeviceTree,
        y: jax.Array,
        batch: jax.Array,
        *,
        output_grad_extras: bool = False,
    ):
        """Sum of the per-token losses of ``y`` ``[mb, s(/tp), H]`` against
        ``batch[:, 1:]`` (the output layer's weight: the word embedding's when tied); with
        ``output_grad_extras`` its aux is the per-token logsumexp ``[mb, S]`` (fp32)."""
        head = nnx.merge(self._head_def, params.shared["head"])
        out = head(
            y,
            self._context_tokens(batch[:, 1:]),
            weight=self._output_weight(params),
            with_lse=output_grad_extras,
        )
        return out if output_grad_extras else (out, ())

    def logits(self, params: DeviceTree, y: jax.Array) -> jax.Array:
        """The output layer's logits of ``y`` ``[mb, s(/tp), H]`` (the final norm, then the
        output layer; the word embedding's weight when tied): ``[mb, s, V / (P tp)]``, this
        device's share of the (padded) vocabulary, in the compute dtype, the padding
        rows' columns ``-inf``. Inside ``shard_map`` on the last stage (every stage with
        the vocabulary over the pipeline)."""
        head = nnx.merge(self._head_def, params.shared["head"])
        return head.logits(y, self._output_weight(params))

    def _output_weight(self, params: DeviceTree) -> jax.Array | None:
        return params.shared["embedding"]["word"]["embedding"] if self.tied else None

    def metrics(self, aux_sum) -> dict[str, jax.Array]:
        """The step's MoE figures from every device's sums (inside ``shard_map``):
        ``moe_aux_loss`` (the load-balancing losses of all MoE layers, each the mean over
        microbatches and data-parallel ranks: the term the gradients include),
        ``moe_tokens_per_expert`` ``[E]`` (routed choices per expert over all MoE layers
        and tokens of the step, before dropping), ``moe_max_load`` (the busiest expert's
        load over the mean: 1 is perfect balance), ``moe_dropped_fraction`` (dropped /
        routed) and ``moe_dispatch_overflow`` (routed choices the dropless receive buffers
        could not hold, ``--moe-dropless-buffer-factor``: nonzero means the step computed
        wrong numbers); ``{}`` for a dense model."""
        if not self.moe:
            return {}
        aux, tokens, dropped, overflow = (lax.psum(s, AXES) for s in aux_sum)
        routed = jnp.sum(tokens)
        par = self.parallel
        return {
            "moe_aux_loss": aux / (par.data_parallel_size * par.num_microbatches),
            "moe_tokens_per_expert": tokens,
            "moe_max_load": jnp.max(tokens) / jnp.maximum(jnp.mean(tokens), 1.0),
            "moe_dropped_fraction": dropped / jnp.maximum(routed, 1.0),
            "moe_dispatch_overflow": overflow,
        }

    # -- deferred output-layer wgrad, recompute mode (Megatron's stash has no such mode)

    def defer_extras(self, post_aux, batch: jax.Array) -> tuple[jax.Array, ...]:
        """What the recompute-mode stash keeps beside the output layer's input: the
        per-token logsumexp (``post``'s aux) and the labels, ``[mb, S]`` each."""
        return (post_aux, self._context_tokens(batch[:, 1:]).astype(jnp.int32))

    def recompute_output_grad(self, x: jax.Array, extras, weight: jax.Array) -> jax.Array:
        """The output layer's ``dy`` for ``x`` ``[mb, s, H]`` rebuilt from the stashed
        extras (sliced to the same tokens): the cross entropy's gradient."""
        lse, labels = extras
        tp, m = self.parallel.tensor_model_parallel_size, self.model
        return recompute_dy(
            x,
            weight,
            lse,
            labels,
            tp=tp * self._vocab_pp,
            axis_name=vocab_axes(TENSOR, tp, self._vocab_pp),
            vocab_size=None if m.padded_vocab_size == m.vocab_size else m.vocab_size,
        )
