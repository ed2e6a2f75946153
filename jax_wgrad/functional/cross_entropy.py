"""Vocab-parallel cross entropy: the one implementation of the output layer's loss math.

Used by the GPT head (:func:`vocab_parallel_cross_entropy`), by the deferred output-layer
weight gradient (:mod:`jax_wgrad.parallel.deferred`: its explicit head backward and its
``recompute`` mode, which rebuilds the logits' gradient from :func:`vocab_parallel_logsumexp`
with :func:`logits_grad`), and the vocab-range mask also by the embedding lookup
(:func:`vocab_shard_index`). Logits are ``[..., vocab / tp]``, this rank's vocabulary shard;
the vocabulary is never gathered. A padded vocabulary's padding columns are masked to
``-inf`` before any of it (:func:`mask_vocab_padding`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_wgrad.parallel.mesh import TENSOR

__all__ = [
    "mask_vocab_padding",
    "vocab_shard_index",
    "logits_grad",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
    "recompute_dy",
]


def vocab_shard_index(
    ids: jax.Array, local_vocab: int, axis_name: str | None
) -> tuple[jax.Array, jax.Array]:
    """Global token ids -> (index into this rank's vocabulary shard, in-shard mask).

    The shard of tensor rank ``r`` is ``[r * local_vocab, (r + 1) * local_vocab)``; ids
    outside it get index 0 and mask False. ``axis_name=None``: one shard (tp = 1).
    """
    start = jax.lax.axis_index(axis_name) * local_vocab if axis_name is not None else 0
    local = ids - start
    in_range = (local >= 0) & (local < local_vocab)
    return jnp.where(in_range, local, 0), in_range


def mask_vocab_padding(
    logits: jax.Array, vocab_size: int | None, axis_name: str | tuple[str, ...] | None
) -> jax.Array:
    """``logits`` ``[..., V_padded / shards]`` (this rank's vocabulary shard, as
    :func:`vocab_shard_index` numbers them) with the columns of the padding rows -- global
    ids ``>= vocab_size`` -- set to ``-inf``: excluded from the softmax, so the loss and
    every gradient are those of the unpadded model and the padding gets zero gradient.
    ``vocab_size=None``: no padding (``logits`` returned as they are)."""
    local = logits.shape[-1]
    if vocab_size is None:
        return logits
    start = jax.lax.axis_index(axis_name) * local if axis_name is not None else 0
    ids = start + jnp.arange(local)
    return jnp.where(ids < vocab_size, logits, jnp.array(-jnp.inf, logits.dtype))


def logits_grad(probs: jax.Array, local: jax.Array, in_range: jax.Array) -> jax.Array:
    """``d loss / d logits`` of the token loss: ``softmax - onehot(label)`` on this
    rank's shard (``probs``: ``[..., V/tp]`` softmax; ``local``, ``in_range``: from
    :func:`vocab_shard_index` of the labels)."""
    onehot = jax.nn.one_hot(local, probs.shape[-1], dtype=probs.dtype)
    return probs - onehot * in_range[..., None].astype(probs.dtype)


def vocab_parallel_cross_entropy(
    logits: jax.Array, labels: jax.Array, *, tp_size: int = 1, axis_name: str = TENSOR
) -> jax.Array:
    """Per-token cross entropy from vocab-sharded logits, never gathering the vocab.

    Args:
      logits: ``[..., vocab / tp]`` this rank's slice of the logits (any float dtype;
        computed in fp32).
      labels: int ``[...]`` global token ids.
      axis_name: the tensor axis (``jax_wgrad.parallel.TENSOR``).
    Returns:
      fp32 ``[...]`` loss per token, identical on every tensor rank.
    """
    if tp_size == 1:
        return _cross_entropy_local(logits, labels)
    return _vocab_parallel_ce(logits, labels, axis_name)


def vocab_parallel_logsumexp(logits: jax.Array, tp: int, axis_name: str) -> jax.Array:
    """fp32 ``[...]`` logsumexp over the whole (sharded) vocabulary of ``[..., V/tp]``."""
    lf = logits.astype(jnp.float32)
    mx = jnp.max(lf, axis=-1)
    if tp > 1:
        mx = jax.lax.pmax(mx, axis_name)
    mx = jax.lax.stop_gradient(mx)
    se = jnp.sum(jnp.exp(lf - mx[..., None]), axis=-1)
    if tp > 1:
        se = jax.lax.psum(se, axis_name)
    return mx + jnp.log(se)


def _cross_entropy_local(logits, labels):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked


def _vp_ce_forward(logits, labels, axis_name):
    logits = logits.astype(jnp.float32)
    logits_max = jax.lax.pmax(jnp.max(logits, axis=-1), axis_name)
    shifted = logits - logits_max[..., None]
    local, in_range = vocab_shard_index(labels, logits.shape[-1], axis_name)
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
    grad = logits_grad(softmax, local, in_range) * g[..., None]
    return grad.astype(dtype_token.dtype), None


_vocab_parallel_ce.defvjp(_vp_ce_fwd, _vp_ce_bwd)


def recompute_dy(
    x: jax.Array,
    w: jax.Array,
    lse: jax.Array,
    labels: jax.Array,
    *,
    tp: int,
    scale: float = 1.0,
    axis_name: str = TENSOR,
    vocab_size: int | None = None,
) -> jax.Array:
    """``dy = scale * (softmax - onehot)`` over this rank's vocabulary shard for the
    tokens of ``x`` ``[..., H]`` (``lse``, ``labels``: ``[...]``): the vocab-parallel
    cross entropy's gradient, rebuilt from the stashed logsumexp (``vocab_size``: the true
    vocabulary of padded rows, whose ``dy`` is 0 -- :func:`mask_vocab_padding`)."""
    axes = axis_name if tp > 1 else None
    logits = mask_vocab_padding(jnp.matmul(x, w.T.astype(x.dtype)), vocab_size, axes)
    local, in_range = vocab_shard_index(labels, logits.shape[-1], axes)
    soft = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    dy = logits_grad(soft, local, in_range) * scale
    return dy.astype(x.dtype)
