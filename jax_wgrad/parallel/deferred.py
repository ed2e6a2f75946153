"""Deferred output-layer weight gradients (Megatron's ``defer_embedding_wgrad_compute``).

On the last pipeline stage the output projection to the vocabulary has the largest
weight-gradient GEMM of the model. With deferral the schedule computes only its data
gradient; what the weight gradient needs is kept in a fixed-size, scan-carried *stash*
indexed by microbatch, and :func:`drain` does the GEMMs after the pipeline loop, before
any reduction of that weight's gradient (over ``data``, or between the tied first/last
stage copies -- Megatron drains after launching the data-parallel reduce; we do not).

Semantics are Megatron's: microbatches ``0 .. min(L, M) - 1`` are deferred (``L = 0``:
all ``M``); the others accumulate immediately through the fused op. Two stash layouts:

* ``stash`` (Megatron): per deferred microbatch the output layer's input ``x`` (this
  rank's sequence chunk ``[mb, S/tp, H]`` under sequence parallelism, else ``[mb, S, H]``)
  and ``dy = dlogits`` ``[mb, S, V/tp]`` (all tokens, this rank's vocabulary shard).
* ``recompute``: ``x``, the per-token logsumexp ``[mb, S]`` (fp32) and the labels
  ``[mb, S]``; the drain rebuilds ``dy = scale * (softmax - onehot)`` chunk by chunk from
  ``x W^T`` -- ``O(M T H)`` memory instead of ``O(M T V/tp)``, one extra GEMM per item.

With sequence parallelism the drain does not all-gather ``x``: the token chunks travel
round the ``tensor`` ring with ``ppermute`` (:func:`ring_shift`), two chunk buffers alive
at a time, and ring step ``k`` accumulates ``dy[chunk]^T x_chunk`` with the chunk it holds
while the permute of step ``k`` forwards that chunk -- the GEMM never consumes the transfer
issued beside it (collective matmul; Megatron's double-buffered all-gather).

Every function here runs per device inside ``shard_map`` over ``(data, expert, tensor, pipeline)``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad import ops
from jax_wgrad.functional.cross_entropy import (
    logits_grad,
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
    vocab_shard_index,
)
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import TENSOR

__all__ = ["stash_shapes", "init_stash", "stash_put", "stash_bytes", "is_deferred",
           "head_backward", "ring_shift", "recompute_dy", "drain"]

Stash = tuple[jax.Array, ...]


def stash_shapes(par: ParallelConfig, seq_length: int, hidden: int, vocab: int,
                 dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of the per-device stash (``()`` without deferral)."""
    md = par.num_deferred_microbatches
    if md == 0:
        return ()
    tp, mb = par.tensor_model_parallel_size, par.micro_batch_size
    x = jax.ShapeDtypeStruct((md, mb, par.local_seq_length(seq_length), hidden),
                             jnp.dtype(dtype))
    if par.defer_mode == "stash":
        return (x, jax.ShapeDtypeStruct((md, mb, seq_length, vocab // tp), jnp.dtype(dtype)))
    return (x, jax.ShapeDtypeStruct((md, mb, seq_length), jnp.float32),
            jax.ShapeDtypeStruct((md, mb, seq_length), jnp.int32))


def init_stash(shapes) -> Stash:
    return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)


def stash_bytes(shapes) -> int:
    """Bytes of one device's stash."""
    return sum(jnp.dtype(s.dtype).itemsize * math.prod(s.shape) for s in shapes)


def stash_put(stash: Stash, index, items: Stash) -> Stash:
    """Writes one microbatch's items at ``index`` (in place in the scan carry)."""
    return tuple(lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), index, 0)
                 for s, v in zip(stash, items))


def is_deferred(par: ParallelConfig, microbatch):
    """Megatron's predicate ``L == 0 or b < L`` (traced ``b``)."""
    return microbatch < par.num_deferred_microbatches


def head_backward(stages, shared, x: jax.Array, labels: jax.Array, *,
                  scale: float = 1.0, axis_name: str = TENSOR) -> dict[str, Any]:
    """Explicit forward + backward of the head with the output layer's weight gradient
    left out: final norm -> output projection -> vocab-parallel cross entropy.

    Args:
      stages: the model's per-stage functions (:class:`jax_wgrad.models.gpt.GPTStages`:
        ``final_norm`` and ``output_weight`` of the shared tree).
      shared: this device's shared parameter tree (embedding, head).
      x: ``[mb, s(/tp), H]`` last transformer layer output.
      labels: int ``[mb, S]``.
      scale: seed of the loss SUM's gradient (the loss scale).
    Returns:
      dict with ``loss`` (token-loss sum), ``dx`` (``[mb, s(/tp), H]``), ``dshared`` (the
      shared tree's gradients from the final norm; the output weight's entry is zero),
      ``x_local`` (output-layer
      input, this rank's chunk), ``x_full`` (gathered over the sequence under SP), ``dy``
      (``[mb, S, V/tp]`` dlogits) and ``lse`` (``[mb, S]`` fp32 logsumexp).
    """
    par = stages.parallel
    tp, sp = par.tensor_model_parallel_size, par.sequence_parallel
    w = stages.output_weight(shared)
    xn, norm_vjp = jax.vjp(stages.final_norm, shared, x)
    xg = lax.all_gather(xn, axis_name, axis=1, tiled=True) if sp else xn
    logits = jnp.matmul(xg, w.T.astype(xg.dtype))
    tok_loss, ce_vjp = jax.vjp(
        lambda lg: vocab_parallel_cross_entropy(lg, labels, tp_size=tp, axis_name=axis_name),
        logits)
    (dy,) = ce_vjp(jnp.full(tok_loss.shape, scale, tok_loss.dtype))
    dxg = jnp.matmul(dy, w.astype(dy.dtype)).astype(xg.dtype)
    if sp:
        dxn = lax.psum_scatter(dxg, axis_name, scatter_dimension=1, tiled=True)
    elif tp > 1:
        dxn = lax.psum(dxg, axis_name)
    else:
        dxn = dxg
    dshared, dx = norm_vjp(dxn)
    lse = None
    if par.defer_mode == "recompute":
        lse = vocab_parallel_logsumexp(logits, tp, axis_name)
    return dict(loss=jnp.sum(tok_loss), dx=dx, dshared=dshared, x_local=xn, x_full=xg, dy=dy,
                lse=lse)


def stash_items(par: ParallelConfig, head: dict[str, Any], labels: jax.Array) -> Stash:
    """What :func:`head_backward`'s microbatch puts in the stash."""
    if par.defer_mode == "stash":
        return (head["x_local"], head["dy"])
    return (head["x_local"], head["lse"], labels.astype(jnp.int32))


def ring_shift(a: jax.Array, tp: int, axis_name: str = TENSOR) -> jax.Array:
    """Rank ``r``'s ``a`` goes to rank ``(r + 1) % tp`` (rank ``r`` receives ``r - 1``'s).

    Written as two ACYCLIC permutes (the chain ``i -> i+1`` and the wrap ``tp-1 -> 0``)
    added together (a rank in no pair of a permute receives zeros): a ring over ``tensor``
    in a mesh with other axes is a permute with several cycles, which XLA:GPU has
    returned zeros for (DESIGN.md, traps).
    """
    chain = lax.ppermute(a, axis_name, [(i, i + 1) for i in range(tp - 1)])
    wrap = lax.ppermute(a, axis_name, [(tp - 1, 0)])
    return chain + wrap


def recompute_dy(x: jax.Array, w: jax.Array, lse: jax.Array, labels: jax.Array, *,
                 tp: int, scale: float = 1.0, axis_name: str = TENSOR) -> jax.Array:
    """``dy = scale * (softmax - onehot)`` over this rank's vocabulary shard for the
    tokens of ``x`` ``[..., H]`` (``lse``, ``labels``: ``[...]``): the vocab-parallel
    cross entropy's gradient, rebuilt from the stashed logsumexp."""
    logits = jnp.matmul(x, w.T.astype(x.dtype))
    local, in_range = vocab_shard_index(labels, logits.shape[-1], axis_name if tp > 1 else None)
    soft = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    dy = logits_grad(soft, local, in_range) * scale
    return dy.astype(x.dtype)


def drain(par: ParallelConfig, stash: Stash, bucket: jax.Array, offset: int,
          weight: jax.Array, *, active=None, scale: float = 1.0,
          axis_name: str = TENSOR) -> jax.Array:
    """Accumulates every stashed microbatch's ``dy^T x`` into the output layer's block
    ``[offset, offset + V/tp * H)`` of the flat ``bucket`` with the fused op.

    A ``lax.scan`` over the stashed microbatches; under sequence parallelism each item is
    a ``tensor`` ring of ``tp`` steps (module docstring). ``weight``: the output layer's
    ``[V/tp, H]`` shard (recompute mode only).

    ``active`` (traced bool, e.g. "this is the last stage"): only where it is true are the
    GEMMs computed. Without sequence parallelism the whole drain is one ``lax.cond``. With
    it, the ring's permutes run on EVERY device and only the GEMMs are conditional: the
    XLA:CPU collective-permute is one rendezvous of all devices of the program (its pairs
    span all groups), so a permute inside a branch that other pipeline stages skip hangs.
    Non-last stages hold a zero stash, so they forward zeros.
    """
    if active is None:
        active = jnp.bool_(True)
    tp, sp = par.tensor_model_parallel_size, par.sequence_parallel
    recompute = par.defer_mode == "recompute"

    def dy_of(item, x, start, length):
        if recompute:
            _, lse, labels = item
            lse = lax.dynamic_slice_in_dim(lse, start, length, axis=1)
            labels = lax.dynamic_slice_in_dim(labels, start, length, axis=1)
            return recompute_dy(x, weight, lse, labels, tp=tp, scale=scale,
                                axis_name=axis_name)
        return lax.dynamic_slice_in_dim(item[1], start, length, axis=1)

    def one(bk, item):
        x = item[0]
        if not sp:
            with jax.named_scope("deferred_wgrad"):
                return ops.wgrad_accumulate(x, dy_of(item, x, 0, x.shape[1]), bk,
                                            offset=offset), None
        chunk = x.shape[1]
        rank = lax.axis_index(axis_name)
        cur = x
        for k in range(tp):
            with jax.named_scope(f"deferred_wgrad_ring{k}"):
                # Forward the chunk we hold while computing with it: the GEMM below does not
                # depend on this transfer, only the next step's does.
                nxt = ring_shift(cur, tp, axis_name) if k < tp - 1 else None
                src = (rank - k) % tp  # the rank this chunk's tokens belong to
                bk = lax.cond(
                    active,
                    lambda bk, cur=cur, src=src: ops.wgrad_accumulate(
                        cur, dy_of(item, cur, src * chunk, chunk), bk, offset=offset),
                    lambda bk: bk, bk)
                cur = nxt
        return bk, None

    if not sp:
        return lax.cond(active, lambda bk: lax.scan(one, bk, stash)[0], lambda bk: bk, bucket)
    bucket, _ = lax.scan(one, bucket, stash)
    return bucket
