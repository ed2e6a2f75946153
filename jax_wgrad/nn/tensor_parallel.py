"""Tensor-parallel layers (Megatron semantics) as Flax NNX modules.

Every module here runs on ONE device's shard inside ``jax.shard_map`` and talks to its
tensor-parallel peers with the conjugate collectives of
:mod:`jax_wgrad.functional.collectives` over ``axis_name`` (default
:data:`jax_wgrad.parallel.TENSOR`). With ``tp_size == 1`` the collectives are skipped, so
the same modules run unsharded outside ``shard_map`` too.

Activations are ``[batch, seq, hidden]``. With sequence parallelism the activations
between blocks are ``[batch, seq / tp, hidden]``: column-parallel layers all-gather the
sequence before their GEMM and row-parallel layers reduce-scatter after theirs.

A linear layer's weight gradient goes where its weight variable's route sends it (its
``wgrad`` metadata, :mod:`jax_wgrad.functional.routes`: gradient accumulation fusion into
a bucket block, or a zero-bubble split; set by whoever owns the buckets, e.g. the pipeline
executor), else to the weight's ordinary gradient: the layers hand their weight
*variables* to :func:`~jax_wgrad.functional.linear` and take no gradient argument.

Every parameter carries its facts as NNX variable metadata (:func:`param_facts`): the
dim split over ``tensor`` (``tensor_axis``), whether weight decay applies, and whether its
gradient can come from the fused GEMM. Models read them back to lay out gradients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_wgrad.functional.collectives import (
    SEQ_DIM,
    copy_to_tensor_parallel_region,
    gather_last_dim,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from jax_wgrad.functional.cross_entropy import vocab_shard_index
from jax_wgrad.functional.fp8 import Fp8Gemm, Fp8Recipe, Fp8Weight
from jax_wgrad.functional.linear import linear
from jax_wgrad.functional.saved import SAVED
from jax_wgrad.nn.facts import param_facts
from jax_wgrad.ops import PrecisionLike
from jax_wgrad.parallel.mesh import PIPELINE, TENSOR

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_axes",
    "init_std_for_output_layers",
]


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class ColumnParallelLinear(nnx.Module):
    """``Y = X A^T + b`` with ``A`` (``[out, in]``) split over its output dim.

    Each rank holds ``weight [out / tp, in]`` and ``bias [out / tp]`` and produces its
    ``[..., out / tp]`` slice of ``Y`` (all-gathered to ``[..., out]`` when
    ``gather_output``). Input: ``[b, s, in]``, or ``[b, s / tp, in]`` with sequence
    parallelism (all-gathered on the sequence before the GEMM).

    ``gated=True`` (SwiGLU's fused gate and up projections, Megatron's ``linear_fc1``):
    ``weight [2, out / tp, in]`` (``[0]`` gate, ``[1]`` up; split over ``tensor`` on dim
    1, so each rank holds the gate and up rows of the same ``out / tp`` features,
    Megatron's per-rank layout) and the output is ``[..., 2 * out / tp]``: this rank's
    gate features, then its up features.

    ``fp8``: its GEMMs in FP8 (:func:`~jax_wgrad.functional.linear`'s ``fp8``; the weight
    and the output gradient scaled by their amax over the tensor ranks); ``token_axis``:
    the tokens are split over this mesh axis too (context parallelism), the input's and
    the output gradient's amax reduced over it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        axis_name: str = TENSOR,
        use_bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        init_std: float = 0.02,
        precision: PrecisionLike = None,
        gated: bool = False,
        fp8: Fp8Recipe | None = None,
        token_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        if out_features % tp_size != 0:
            raise ValueError(
                f"ColumnParallelLinear: out_features ({out_features}) must be divisible "
                f"by tensor_model_parallel_size ({tp_size})"
            )
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.precision = precision
        self.fp8 = (
            None
            if fp8 is None
            else Fp8Gemm.column(fp8, axis_name if tp_size > 1 else None, token_axis)
        )
        local_out = out_features // tp_size
        lead, axis = ((2,), 1) if gated else ((), 0)
        self.weight = (
            None
            if skip_weight_param_allocation
            else nnx.Param(
                _normal(rngs, (*lead, local_out, in_features), init_std),
                **param_facts(axis, weight_decay=True, fused_wgrad=True),
            )
        )
        self.bias = (
            nnx.Param(jnp.zeros((*lead, local_out), jnp.float32), **param_facts(axis))
            if use_bias
            else None
        )

    def quantized_weight(self) -> Fp8Weight:
        """The weight ``[out / tp, in]`` (gated: ``[2 out / tp, in]``) quantized as its
        FP8 GEMMs quantize it, with its transpose (``fp8`` set): what a step computes once
        for every microbatch (``__call__``'s ``fp8_weight``)."""
        w = self.weight[...]
        return Fp8Weight.of(self.fp8.weight(w.reshape(-1, w.shape[-1])))

    def __call__(
        self,
        x: jax.Array,
        weight: nnx.Variable | jax.Array | None = None,
        fp8_weight: Fp8Weight | None = None,
    ) -> jax.Array:
        """``x``: ``[b, s(/tp), in]`` -> ``[b, s, out / tp]`` (or ``out``).

        Args:
          weight: overrides the layer's own weight (Megatron's tied output layer: the
            word embedding's variable, whose route it keeps); required when built with
            ``skip_weight_param_allocation``.
          fp8_weight: the weight already quantized (:meth:`quantized_weight`), for the
            FP8 GEMMs (:func:`~jax_wgrad.functional.linear`'s ``fp8_weight``).
        """
        with jax.named_scope("column_parallel_linear"):
            if weight is None:
                if self.weight is None:
                    raise ValueError("ColumnParallelLinear: weight was not allocated; pass it")
                weight = self.weight
            gather = self.axis_name if self.sequence_parallel else None  # inside linear
            if self.tp_size > 1 and not self.sequence_parallel:
                x = copy_to_tensor_parallel_region(x, self.axis_name)
            bias = None if self.bias is None else self.bias[...].reshape(-1)
            # gated: [2 F/tp, in]; a mapped variable keeps its route (row-major block)
            w = jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), weight)
            y = linear(
                x,
                w,
                bias,
                precision=self.precision,
                gather_axis=gather,
                fp8=self.fp8,
                fp8_weight=fp8_weight,
            )
            if self.gather_output and self.tp_size > 1:
                y = gather_last_dim(y, self.axis_name)
            return y


class RowParallelLinear(nnx.Module):
    """``Y = X A^T + b`` with ``A`` (``[out, in]``) split over its input dim.

    Each rank holds ``weight [out, in / tp]`` and consumes its ``[..., in / tp]`` slice of
    ``X`` (Megatron's ``input_is_parallel=True``). The partial products are all-reduced
    (or reduce-scattered on the sequence with sequence parallelism); the bias
    ``[out]`` is added after the reduction, once.

    ``fp8``: its GEMMs in FP8 (:func:`~jax_wgrad.functional.linear`'s ``fp8``; the input
    and the weight scaled by their amax over the tensor ranks); ``token_axis``: as
    :class:`ColumnParallelLinear`'s.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        axis_name: str = TENSOR,
        use_bias: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        precision: PrecisionLike = None,
        fp8: Fp8Recipe | None = None,
        token_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        if in_features % tp_size != 0:
            raise ValueError(
                f"RowParallelLinear: in_features ({in_features}) must be divisible "
                f"by tensor_model_parallel_size ({tp_size})"
            )
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.precision = precision
        self.fp8 = (
            None
            if fp8 is None
            else Fp8Gemm.row(fp8, axis_name if tp_size > 1 else None, token_axis)
        )
        self.weight = nnx.Param(
            _normal(rngs, (out_features, in_features // tp_size), init_std),
            **param_facts(1, weight_decay=True, fused_wgrad=True),
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), jnp.float32), **param_facts(None))
            if use_bias
            else None
        )

    def quantized_weight(self) -> Fp8Weight:
        """The weight ``[out, in / tp]`` quantized as its FP8 GEMMs quantize it, with its
        transpose (``fp8`` set): what a step computes once for every microbatch
        (``__call__``'s ``fp8_weight``)."""
        return Fp8Weight.of(self.fp8.weight(self.weight[...]))

    def __call__(self, x: jax.Array, fp8_weight: Fp8Weight | None = None) -> jax.Array:
        """``x``: ``[b, s, in / tp]`` -> ``[b, s(/tp), out]``; ``fp8_weight``: the weight
        already quantized (:meth:`quantized_weight`)."""
        with jax.named_scope("row_parallel_linear"):
            y = linear(
                x,
                self.weight,
                None,
                precision=self.precision,
                fp8=self.fp8,
                fp8_weight=fp8_weight,
            )
            if self.tp_size > 1:
                if self.sequence_parallel:
                    y = reduce_scatter_to_sequence_parallel_region(y, self.axis_name, SEQ_DIM)
                else:
                    y = reduce_from_tensor_parallel_region(y, self.axis_name)
                # Kept for the backward unless the layer is recomputed in full: otherwise a
                # backward that needs it (the attention's output, under the MLP's norm)
                # recomputes the reduction -- a collective Megatron never repeats -- from
                # the saved partial product, which is tp times larger with SP.
                y = checkpoint_name(y, SAVED)
            if self.bias is not None:
                y = y + self.bias[...].astype(y.dtype)
            return y


class VocabParallelEmbedding(nnx.Module):
    """Embedding table ``[vocab, hidden]`` split over the vocab dim.

    Each rank looks up the ids in its vocab range, zeroes the others, and the partial
    results are all-reduced over ``tensor`` (reduce-scattered on the sequence with
    ``sequence_parallel``: output ``[b, s / tp, hidden]``). With ``pipeline_size > 1`` the
    vocabulary is split over ``(pipeline, tensor)`` (:data:`~jax_wgrad.parallel.PIPELINE`
    major) and the partial results are first summed over ``pipeline``: every stage returns
    the embedding (its backward: the cotangents summed over ``pipeline``, so the stage that
    uses the output feeds every stage's rows).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_size: int = 1,
        axis_name: str = TENSOR,
        sequence_parallel: bool = False,
        pipeline_size: int = 1,
        init_std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        if num_embeddings % (tp_size * pipeline_size) != 0:
            raise ValueError(
                f"VocabParallelEmbedding: vocab size ({num_embeddings}) must be divisible "
                f"by tensor_model_parallel_size ({tp_size})"
                + (
                    f" x pipeline_model_parallel_size ({pipeline_size})"
                    if pipeline_size > 1
                    else ""
                )
            )
        self.tp_size = tp_size
        self.pipeline_size = pipeline_size
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.embedding = nnx.Param(
            _normal(rngs, (num_embeddings // (tp_size * pipeline_size), embedding_dim), init_std),
            **param_facts(0, weight_decay=True),
        )

    def __call__(self, ids: jax.Array, *, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """``ids``: int ``[b, s]`` -> ``[b, s(/tp), hidden]`` in ``dtype``.

        The backward scatter-adds the token gradients in fp32 whatever the table's dtype
        (:func:`take_rows`): a 16-bit scatter-add rounds every partial sum and, on text-like
        ids (a few rows hit by most tokens), is two orders of magnitude slower on a GPU
        (``docs/design/h100_findings.md``, section 2).
        """
        with jax.named_scope("vocab_parallel_embedding"):
            table = self.embedding[...]
            if self.tp_size * self.pipeline_size == 1:
                return take_rows(table, ids).astype(dtype)
            axes = vocab_axes(self.axis_name, self.tp_size, self.pipeline_size)
            local, in_range = vocab_shard_index(ids, table.shape[0], axes)
            out = take_rows(table, local).astype(dtype)
            out = jnp.where(in_range[..., None], out, jnp.zeros((), dtype))
            if self.pipeline_size > 1:
                out = jax.lax.psum(out, PIPELINE)
            if self.tp_size == 1:
                return out
            if self.sequence_parallel:
                return reduce_scatter_to_sequence_parallel_region(out, self.axis_name, SEQ_DIM)
            return reduce_from_tensor_parallel_region(out, self.axis_name)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``: rows of ``table`` ``[V, H]`` for integer ``ids`` ``[...]`` (in
    ``[0, V)``) -> ``[..., H]`` in the table's dtype.

    Its gradient with respect to the table is the token gradients scatter-added in fp32
    and rounded once to the table's dtype (what Megatron's embedding backward does for
    bf16 parameters: PyTorch accumulates in fp32); an fp32 table takes ``jnp.take``'s own
    gradient (the same fp32 scatter-add)."""
    if table.dtype == jnp.float32:
        return jnp.take(table, ids, axis=0)
    return _take_rows_fp32_grad(table, ids)


@jax.custom_vjp
def _take_rows_fp32_grad(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _take_rows_fwd(table, ids):
    # Only the ids and the table's shape and dtype are needed by the backward.
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _take_rows_bwd(res, dy):
    ids, like, rows = res
    grad = (
        jnp.zeros((rows, dy.shape[-1]), jnp.float32)
        .at[ids]
        .add(dy.astype(jnp.float32), mode="drop")
    )
    return grad.astype(like.dtype), None


_take_rows_fp32_grad.defvjp(_take_rows_fwd, _take_rows_bwd)


def vocab_axes(axis_name: str, tp_size: int, pipeline_size: int):
    """The mesh axes a vocabulary is split over: ``tensor``, or ``(pipeline, tensor)``
    (``pipeline`` alone when ``tp_size == 1``); ``None`` when it is not split."""
    axes = ((PIPELINE,) if pipeline_size > 1 else ()) + ((axis_name,) if tp_size > 1 else ())
    return None if not axes else axes[0] if len(axes) == 1 else axes


def init_std_for_output_layers(init_method_std: float, num_layers: int) -> float:
    """Megatron's ``scaled_init_method_normal``: ``std / sqrt(2 * num_layers)``."""
    return init_method_std / math.sqrt(2.0 * num_layers)
