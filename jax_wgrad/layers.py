"""Tensor-parallel layers (Megatron semantics) as Flax NNX modules.

Every module here runs on ONE device's shard inside ``jax.shard_map`` and talks to its
tensor-parallel peers with explicit collectives over ``axis_name`` (default
``'tensor'``). With ``tp_size == 1`` the collectives are skipped, so the same modules run
unsharded outside ``shard_map`` too.

Activations are ``[batch, seq, hidden]``. With sequence parallelism the activations
between blocks are ``[batch, seq / tp, hidden]``: column-parallel layers all-gather the
sequence before their GEMM and row-parallel layers reduce-scatter after theirs.

Each collective is a ``custom_vjp`` pairing the forward op with its Megatron conjugate
(``copy_to`` <-> all-reduce, all-gather <-> reduce-scatter, ...). Autodiff therefore never
has to transpose a raw collective, and the layers behave identically with
``check_vma`` on or off.

Parameters carry a ``tensor_axis`` metadata entry: the dim split over ``tensor``
(``None`` for replicated parameters). :mod:`jax_wgrad.gpt` turns it into
``PartitionSpec``\\ s.

With ``main_grad=acc`` a linear layer's weight gradient goes through
:func:`jax_wgrad.linear` into the fp32 accumulator ``acc`` (gradient accumulation
fusion); see that function for the cotangent convention. ``main_grad`` may also be a
:class:`jax_wgrad.linear.BucketSlot`: the weight's block of a flat gradient bucket
threaded through the layers (:func:`jax_wgrad.linear.linear_into_bucket`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.linear import BucketSlot, linear
from jax_wgrad.ops import PrecisionLike

__all__ = [
    "LayerNorm",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "SEQ_DIM",
    "init_std_for_output_layers",
]

SEQ_DIM = 1
"""Sequence dim of ``[batch, seq, hidden]`` activations."""


# --------------------------------------------------------------------------- collectives


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tensor_parallel_region(x: jax.Array, axis_name: str) -> jax.Array:
    """Identity forward, all-reduce (sum) of the gradient over ``axis_name``."""
    return x


def _copy_fwd(x, axis_name):
    return x, None


def _copy_bwd(axis_name, _, g):
    return (jax.lax.psum(g, axis_name),)


copy_to_tensor_parallel_region.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tensor_parallel_region(x: jax.Array, axis_name: str) -> jax.Array:
    """All-reduce (sum) forward over ``axis_name``, identity backward."""
    return jax.lax.psum(x, axis_name)


def _reduce_fwd(x, axis_name):
    return jax.lax.psum(x, axis_name), None


def _reduce_bwd(axis_name, _, g):
    return (g,)


reduce_from_tensor_parallel_region.defvjp(_reduce_fwd, _reduce_bwd)


def _all_gather(x, axis_name, dim):
    return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)


def _reduce_scatter(x, axis_name, dim):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)


def _split(x, axis_name, dim):
    n = jax.lax.axis_size(axis_name)
    size = x.shape[dim] // n
    start = jax.lax.axis_index(axis_name) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_from_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """All-gather along ``dim`` forward, reduce-scatter backward."""
    return _all_gather(x, axis_name, dim)


gather_from_sequence_parallel_region.defvjp(
    lambda x, a, d: (_all_gather(x, a, d), None),
    lambda a, d, _, g: (_reduce_scatter(g, a, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_scatter_to_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """Reduce-scatter along ``dim`` forward, all-gather backward."""
    return _reduce_scatter(x, axis_name, dim)


reduce_scatter_to_sequence_parallel_region.defvjp(
    lambda x, a, d: (_reduce_scatter(x, a, d), None),
    lambda a, d, _, g: (_all_gather(g, a, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def scatter_to_sequence_parallel_region(
    x: jax.Array, axis_name: str, dim: int = SEQ_DIM
) -> jax.Array:
    """Keeps this rank's chunk of ``dim`` forward, all-gather backward."""
    return _split(x, axis_name, dim)


scatter_to_sequence_parallel_region.defvjp(
    lambda x, a, d: (_split(x, a, d), None),
    lambda a, d, _, g: (_all_gather(g, a, d),),
)


# --------------------------------------------------------------------------- layers


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, computed in fp32, output in the input dtype.

    Parameters ``scale`` / ``bias`` ``[hidden]`` are replicated over ``tensor``; with
    sequence parallelism each rank sees only its sequence chunk, so their gradients
    must be all-reduced over ``tensor`` (the pipeline does that).
    """

    def __init__(self, hidden_size: int, *, epsilon: float = 1e-5):
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((hidden_size,), jnp.float32), tensor_axis=None)
        self.bias = nnx.Param(jnp.zeros((hidden_size,), jnp.float32), tensor_axis=None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[..., hidden]`` -> ``[..., hidden]``."""
        with jax.named_scope("layer_norm"):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
            return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class ColumnParallelLinear(nnx.Module):
    """``Y = X A^T + b`` with ``A`` (``[out, in]``) split over its output dim.

    Each rank holds ``weight [out / tp, in]`` and ``bias [out / tp]`` and produces its
    ``[..., out / tp]`` slice of ``Y`` (all-gathered to ``[..., out]`` when
    ``gather_output``). Input: ``[b, s, in]``, or ``[b, s / tp, in]`` with sequence
    parallelism (all-gathered on the sequence before the GEMM).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        axis_name: str = "tensor",
        use_bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        init_std: float = 0.02,
        precision: PrecisionLike = None,
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
        local_out = out_features // tp_size
        self.weight = (
            None
            if skip_weight_param_allocation
            else nnx.Param(_normal(rngs, (local_out, in_features), init_std), tensor_axis=0)
        )
        self.bias = (
            nnx.Param(jnp.zeros((local_out,), jnp.float32), tensor_axis=0)
            if use_bias
            else None
        )

    def __call__(
        self,
        x: jax.Array,
        weight: jax.Array | None = None,
        *,
        main_grad: jax.Array | BucketSlot | None = None,
    ) -> jax.Array:
        """``x``: ``[b, s(/tp), in]`` -> ``[b, s, out / tp]`` (or ``out``).

        Args:
          weight: overrides the layer's own weight (Megatron's tied output layer);
            required when built with ``skip_weight_param_allocation``.
          main_grad: fp32 ``[out / tp, in]`` accumulator for fused wgrad accumulation,
            or a :class:`~jax_wgrad.linear.BucketSlot` in threaded flat buckets.
        """
        with jax.named_scope("column_parallel_linear"):
            if weight is None:
                if self.weight is None:
                    raise ValueError("ColumnParallelLinear: weight was not allocated; pass it")
                weight = self.weight[...]
            if self.tp_size > 1:
                if self.sequence_parallel:
                    x = gather_from_sequence_parallel_region(x, self.axis_name, SEQ_DIM)
                else:
                    x = copy_to_tensor_parallel_region(x, self.axis_name)
            bias = None if self.bias is None else self.bias[...]
            y = linear(x, weight, bias, main_grad=main_grad, precision=self.precision)
            if self.gather_output and self.tp_size > 1:
                y = _gather_last_dim(y, self.axis_name)
            return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_last_dim(x, axis_name):
    return _all_gather(x, axis_name, x.ndim - 1)


_gather_last_dim.defvjp(
    lambda x, a: (_all_gather(x, a, x.ndim - 1), None),
    lambda a, _, g: (_split(g, a, g.ndim - 1),),
)


class RowParallelLinear(nnx.Module):
    """``Y = X A^T + b`` with ``A`` (``[out, in]``) split over its input dim.

    Each rank holds ``weight [out, in / tp]`` and consumes its ``[..., in / tp]`` slice of
    ``X`` (Megatron's ``input_is_parallel=True``). The partial products are all-reduced
    (or reduce-scattered on the sequence with sequence parallelism); the bias
    ``[out]`` is added after the reduction, once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        axis_name: str = "tensor",
        use_bias: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        precision: PrecisionLike = None,
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
        self.weight = nnx.Param(
            _normal(rngs, (out_features, in_features // tp_size), init_std), tensor_axis=1
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), jnp.float32), tensor_axis=None)
            if use_bias
            else None
        )

    def __call__(
        self, x: jax.Array, *, main_grad: jax.Array | BucketSlot | None = None
    ) -> jax.Array:
        """``x``: ``[b, s, in / tp]`` -> ``[b, s(/tp), out]``; ``main_grad`` as in
        :class:`ColumnParallelLinear`."""
        with jax.named_scope("row_parallel_linear"):
            y = linear(x, self.weight[...], None, main_grad=main_grad, precision=self.precision)
            if self.tp_size > 1:
                if self.sequence_parallel:
                    y = reduce_scatter_to_sequence_parallel_region(y, self.axis_name, SEQ_DIM)
                else:
                    y = reduce_from_tensor_parallel_region(y, self.axis_name)
            if self.bias is not None:
                y = y + self.bias[...].astype(y.dtype)
            return y


class VocabParallelEmbedding(nnx.Module):
    """Embedding table ``[vocab, hidden]`` split over the vocab dim.

    Each rank looks up the ids in its vocab range, zeroes the others, and the partial
    results are all-reduced over ``tensor`` (reduce-scattered on the sequence with
    ``sequence_parallel``: output ``[b, s / tp, hidden]``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_size: int = 1,
        axis_name: str = "tensor",
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        if num_embeddings % tp_size != 0:
            raise ValueError(
                f"VocabParallelEmbedding: vocab size ({num_embeddings}) must be divisible "
                f"by tensor_model_parallel_size ({tp_size})"
            )
        self.tp_size = tp_size
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.embedding = nnx.Param(
            _normal(rngs, (num_embeddings // tp_size, embedding_dim), init_std),
            tensor_axis=0,
        )

    def __call__(self, ids: jax.Array, *, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """``ids``: int ``[b, s]`` -> ``[b, s(/tp), hidden]`` in ``dtype``.

        The rows are gathered from the table in its own dtype (fp32) and cast afterwards,
        so the backward scatter-adds the token gradients in fp32: a 16-bit scatter-add
        rounds every partial sum and, on text-like ids (a few rows hit by most tokens),
        is two orders of magnitude slower on a GPU (../shared/gpu/FINDINGS.md #7).
        """
        with jax.named_scope("vocab_parallel_embedding"):
            table = self.embedding[...]
            if self.tp_size == 1:
                return jnp.take(table, ids, axis=0).astype(dtype)
            local_vocab = table.shape[0]
            start = jax.lax.axis_index(self.axis_name) * local_vocab
            local = ids - start
            in_range = (local >= 0) & (local < local_vocab)
            out = jnp.take(table, jnp.where(in_range, local, 0), axis=0).astype(dtype)
            out = jnp.where(in_range[..., None], out, jnp.zeros((), dtype))
            if self.sequence_parallel:
                return reduce_scatter_to_sequence_parallel_region(out, self.axis_name, SEQ_DIM)
            return reduce_from_tensor_parallel_region(out, self.axis_name)


# --------------------------------------------------------------------------- loss


def vocab_parallel_cross_entropy(
    logits: jax.Array, labels: jax.Array, *, tp_size: int = 1, axis_name: str = "tensor"
) -> jax.Array:
    """Per-token cross entropy from vocab-sharded logits, never gathering the vocab.

    Args:
      logits: ``[..., vocab / tp]`` this rank's slice of the logits (any float dtype;
        computed in fp32).
      labels: int ``[...]`` global token ids.
    Returns:
      fp32 ``[...]`` loss per token, identical on every tensor rank.
    """
    if tp_size == 1:
        return _cross_entropy_local(logits, labels)
    return _vocab_parallel_ce(logits, labels, axis_name)


def _cross_entropy_local(logits, labels):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked


def _vp_ce_forward(logits, labels, axis_name):
    logits = logits.astype(jnp.float32)
    local_vocab = logits.shape[-1]
    start = jax.lax.axis_index(axis_name) * local_vocab
    logits_max = jax.lax.pmax(jnp.max(logits, axis=-1), axis_name)
    shifted = logits - logits_max[..., None]
    local = labels - start
    in_range = (local >= 0) & (local < local_vocab)
    local = jnp.where(in_range, local, 0)
    picked = jnp.take_along_axis(shifted, local[..., None], axis=-1)[..., 0]
    picked = jax.lax.psum(jnp.where(in_range, picked, 0.0), axis_name)
    exp = jnp.exp(shifted)
    sum_exp = jax.lax.psum(jnp.sum(exp, axis=-1), axis_name)
    loss = jnp.log(sum_exp) - picked
    softmax = exp / sum_exp[..., None]
    return loss, (softmax, local, in_range)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _vocab_parallel_ce(logits, labels, axis_name):
    return _vp_ce_forward(logits, labels, axis_name)[0]


def _vp_ce_fwd(logits, labels, axis_name):
    loss, res = _vp_ce_forward(logits, labels, axis_name)
    return loss, (res, jnp.zeros((), logits.dtype))


def _vp_ce_bwd(axis_name, res, g):
    (softmax, local, in_range), dtype_token = res
    onehot = jax.nn.one_hot(local, softmax.shape[-1], dtype=softmax.dtype)
    grad = softmax - onehot * in_range[..., None].astype(softmax.dtype)
    grad = grad * g[..., None]
    return grad.astype(dtype_token.dtype), None


_vocab_parallel_ce.defvjp(_vp_ce_fwd, _vp_ce_bwd)


def init_std_for_output_layers(init_method_std: float, num_layers: int) -> float:
    """Megatron's ``scaled_init_method_normal``: ``std / sqrt(2 * num_layers)``."""
    return init_method_std / math.sqrt(2.0 * num_layers)
