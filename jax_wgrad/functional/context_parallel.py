"""Context parallelism (Megatron's ``--context-parallel-size``): the attention core over a
sequence split across the ``context`` axis.

**Layout** (Megatron's causal load balancing, ``get_batch_on_this_cp_rank``): a sequence
of ``S`` tokens is cut into ``2 cp`` chunks of ``c = S / (2 cp)`` and context rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r``, in that order (:func:`context_positions`), so
every rank has the same share of the causal mask's work. Everything but the attention core
is token-local; the core exchanges keys and values over the axis, one of three ways
(:func:`context_parallel_attention`, Megatron's ``--cp-comm-type``):

- ``p2p`` (ring attention): ``cp`` steps; step 0 attends to the rank's own chunks, step
  ``i`` to those of rank ``r - i``, received from the previous rank by a ``ppermute``
  issued before step ``i - 1``'s attention (the exchange in flight beside it). Each step's
  partial output is merged with its log-sum-exp. With the load-balanced layout a step
  ``i >= 1`` needs only half its blocks (Megatron's): keys from a lower rank are all
  before chunk ``r``, so both query chunks attend to its first chunk only; keys from a
  higher rank are all after chunk ``r`` and before chunk ``2 cp - 1 - r``, so only the
  second query chunk attends, to both. Both cases are two ``c x c`` blocks, picked with
  dynamic slices (no conditional: the program is the same on every rank).
- ``allgather``: keys and values all-gathered over ``context``, put in sequence order, and
  each query chunk attends to the prefix it can see (the first chunk to the first half
  of the sequence, the second to all of it).
- ``a2a`` (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a split of the
  query heads and key/value groups (``cp`` must divide this rank's groups), the whole
  sequence's causal attention runs on ``1 / cp`` of the heads (any implementation,
  cuDNN's included), and a second all-to-all trades back.

Blocks are computed as :func:`~jax_wgrad.functional.causal_attention`'s XLA form computes
them (fp32 scores and softmax over a mask from the tokens' positions, so sliding windows
and grouped-query attention work), returning the block's log-sum-exp. The backward is
``jax``'s: the transposes of ``ppermute``, ``all_gather`` and ``all_to_all`` send the key
and value gradients back to their ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad.functional.attention import causal_attention

__all__ = [
    "ContextParallel",
    "context_parallel_attention",
    "context_positions",
    "context_tokens",
    "load_balanced_positions",
]

_MASKED = -1e30
"""Score of a masked (query, key) pair: finite, so a row with no visible key in a block
gives a finite log-sum-exp that the merge weighs by ``exp(-1e30)``, i.e. 0."""


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How an attention core is split over the context ranks.

    Attributes:
      size: ``cp``, the ranks along ``axis_name``.
      comm_type: ``"p2p"``, ``"allgather"`` or ``"a2a"`` (module docstring).
      axis_name: the mesh axis (:data:`~jax_wgrad.parallel.mesh.CONTEXT`).
      ring_shift: how ``p2p`` passes a block to the next rank: ``"ppermute"`` (a
        collective permute), or ``"all_to_all"`` (the block in its slot of ``cp``, the
        others zero) for XLA's CPU runtime, whose collective permutes rendezvous over
        every device of the program by op id: run under the pipeline's conditionals by
        one stage's devices, they pair with another stage's sends (measured: wrong values
        at PP 2), while an all-to-all's rendezvous is its replica group's.
    """

    size: int
    comm_type: Literal["p2p", "allgather", "a2a"]
    axis_name: str
    ring_shift: Literal["ppermute", "all_to_all"] = "ppermute"


def load_balanced_positions(seq_length: int, cp: int, rank: int) -> np.ndarray:
    """int32 ``[S / cp]``: the positions context rank ``rank`` holds, chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` (module docstring)."""
    c = seq_length // (2 * cp)
    return np.concatenate(
        [
            np.arange(rank * c, (rank + 1) * c),
            np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c),
        ]
    ).astype(np.int32)


def context_positions(seq_length: int, cp: int, axis_name: str) -> jax.Array:
    """int32 ``[S / cp]``: this context rank's positions (inside ``shard_map``; ``0 .. S -
    1`` when ``cp`` is 1)."""
    if cp == 1:
        return jnp.arange(seq_length, dtype=jnp.int32)
    c = seq_length // (2 * cp)
    r = lax.axis_index(axis_name)
    first = r * c + jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([first, (2 * cp - 1 - r) * c + jnp.arange(c, dtype=jnp.int32)])


def context_tokens(x: jax.Array, cp: int, axis_name: str, axis: int = 1) -> jax.Array:
    """This context rank's tokens of ``x`` along ``axis`` (of length ``S``): ``x`` itself
    when ``cp`` is 1, else its two chunks (:func:`context_positions`)."""
    if cp == 1:
        return x
    return jnp.take(x, context_positions(x.shape[axis], cp, axis_name), axis=axis)


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    context: ContextParallel,
    *,
    implementation: str = "xla",
    window: int | None = None,
) -> jax.Array:
    """Causal attention of this context rank's queries over the whole sequence.

    Args:
      q: ``[b, s, heads, d]``, this rank's ``s = S / cp`` tokens (its two chunks).
      k, v: ``[b, s, groups, d]`` (grouped-query attention when ``groups < heads``).
      positions: int32 ``[s]``, :func:`context_positions` (RoPE is applied before).
      context: the split (:class:`ContextParallel`).
      implementation: the whole-sequence core of ``a2a`` (``"xla"`` or ``"cudnn"``,
        :func:`~jax_wgrad.functional.causal_attention`); ``p2p`` and ``allgather``
        compute their blocks in XLA and refuse ``"cudnn"``.
      window: sliding-window attention over ``window`` tokens, or ``None``.
    Returns:
      ``[b, s, heads * d]`` in ``q.dtype``.
    """
    b, s, h, d = q.shape
    g, n = k.shape[2], context.size
    if s % 2:
        raise ValueError(f"context_parallel_attention: {s} local tokens are not two chunks")
    if context.comm_type == "a2a":
        return _ulysses(q, k, v, context, implementation, window)
    if implementation != "xla":
        raise ValueError(
            f"cp_comm_type {context.comm_type!r} computes its attention blocks in XLA; "
            f"attention implementation {implementation!r} runs with cp_comm_type 'a2a'"
        )
    qg = q.reshape(b, s, g, h // g, d)
    if context.comm_type == "p2p":
        out = _ring(qg, k, v, positions, context, window)
    elif context.comm_type == "allgather":
        out = _gathered(qg, k, v, positions, n, context.axis_name, window)
    else:
        raise ValueError(
            f"cp_comm_type must be one of 'p2p', 'allgather', 'a2a', got {context.comm_type!r}"
        )
    return out.astype(q.dtype).reshape(b, s, h * d)


# ------------------------------------------------------------------------------ blocks


def _block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """One block: ``q [b, sq, g, m, d]`` over ``k, v [b, sk, g, d]`` with the causal
    (and window) mask of their positions -> ``(out [b, sq, g, m, d] fp32, lse [b, g, m,
    sq] fp32)``; a row that sees no key gets ``out`` 0 and ``lse`` about ``-1e30``."""
    scores = jnp.einsum("bqgmd,bkgd->bgmqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    scores = jnp.where(visible, scores, _MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
    out = jnp.einsum("bgmqk,bkgd->bqgmd", probs.astype(v.dtype), v)
    return out.astype(jnp.float32), lse


def _merge(
    acc: tuple[jax.Array, jax.Array] | None, new: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions of the same queries over disjoint keys, merged by their
    log-sum-exps (``out [b, q, g, m, d]``, ``lse [b, g, m, q]``)."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = jnp.logaddexp(l1, l2)
    w = lambda lse_i: jnp.moveaxis(jnp.exp(lse_i - lse), -1, 1)[..., None]  # [b, q, g, m, 1]
    return o1 * w(l1) + o2 * w(l2), lse


def _select(pred: jax.Array, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _shift(x, context: ContextParallel):
    """``x`` (a pytree) of the previous context rank (:attr:`ContextParallel.ring_shift`)."""
    n, axis = context.size, context.axis_name
    if context.ring_shift == "ppermute":
        return lax.ppermute(x, axis, [(j, (j + 1) % n) for j in range(n)])
    r = lax.axis_index(axis)

    def one(a):
        slots = lax.dynamic_update_index_in_dim(
            jnp.zeros((n, *a.shape), a.dtype), a, (r + 1) % n, 0
        )
        got = lax.all_to_all(slots, axis, split_axis=0, concat_axis=0)
        return lax.dynamic_index_in_dim(got, (r - 1) % n, 0, keepdims=False)

    return jax.tree.map(one, x)


def _ring(q, k, v, positions, context: ContextParallel, window: int | None) -> jax.Array:
    """``p2p`` (module docstring): ``q [b, 2c, g, m, d]`` -> ``[b, 2c, g, m, d]`` fp32."""
    c, n = q.shape[1] // 2, context.size
    r = lax.axis_index(context.axis_name)
    q1, q2, p1, p2 = q[:, :c], q[:, c:], positions[:c], positions[c:]
    kv = (k, v)
    # step 0, this rank's own chunks: chunk r sees itself (causal), chunk 2cp-1-r both
    acc1 = _block(q1, k[:, :c], v[:, :c], p1, p1, window)
    acc2 = _block(q2, k, v, p2, positions, window)
    incoming = _shift(kv, context) if n > 1 else None
    for i in range(1, n):
        kv = incoming
        if i + 1 < n:  # the next exchange in flight beside this step's blocks
            incoming = _shift(kv, context)
        ki, vi = kv
        src = (r - i) % n
        c0 = jnp.int32(c)
        kpos = jnp.concatenate(
            [
                src * c0 + jnp.arange(c, dtype=jnp.int32),
                (2 * n - 1 - src) * c0 + jnp.arange(c, dtype=jnp.int32),
            ]
        )
        lower = src < r  # keys all before chunk r: both query chunks, the first key chunk
        start = jnp.where(lower, 0, c)
        qa = lax.dynamic_slice_in_dim(q, start, c, axis=1)  # q1 (lower) or q2
        pa = lax.dynamic_slice_in_dim(positions, start, c)
        kb = lax.dynamic_slice_in_dim(ki, start, c, axis=1)  # the key chunk q2 also sees
        vb = lax.dynamic_slice_in_dim(vi, start, c, axis=1)
        kpb = lax.dynamic_slice_in_dim(kpos, start, c)
        block_a = _block(qa, ki[:, :c], vi[:, :c], pa, kpos[:c], window)
        block_b = _block(q2, kb, vb, p2, kpb, window)
        acc2 = _merge(acc2, block_b)
        acc1, acc2 = (
            _select(lower, _merge(acc1, block_a), acc1),
            _select(lower, acc2, _merge(acc2, block_a)),
        )
    return jnp.concatenate([acc1[0], acc2[0]], axis=1)


def _in_sequence_order(x: jax.Array, n: int) -> jax.Array:
    """The ``cp`` ranks' tokens gathered rank by rank on dim 1 (rank ``j``: chunks ``j``
    and ``2 cp - 1 - j``) -> in sequence order: static slices and a reversal, no gather
    (whose transpose would be a scatter)."""
    b, s2, *rest = x.shape
    c = s2 // (2 * n)
    ranks = x.reshape(b, n, 2, c, *rest)
    chunks = jnp.concatenate([ranks[:, :, 0], jnp.flip(ranks[:, :, 1], axis=1)], axis=1)
    return chunks.reshape(b, s2, *rest)


def _in_rank_order(x: jax.Array, n: int) -> jax.Array:
    """The inverse of :func:`_in_sequence_order`."""
    b, s2, *rest = x.shape
    c = s2 // (2 * n)
    chunks = x.reshape(b, 2 * n, c, *rest)
    first, second = chunks[:, :n], jnp.flip(chunks[:, n:], axis=1)
    return jnp.stack([first, second], axis=2).reshape(b, s2, *rest)


def _gathered(q, k, v, positions, n: int, axis: str, window: int | None) -> jax.Array:
    """``allgather`` (module docstring): ``q [b, 2c, g, m, d]`` -> ``[b, 2c, g, m, d]``
    fp32."""
    c = q.shape[1] // 2
    k_all, v_all = (
        _in_sequence_order(lax.all_gather(x, axis, axis=1, tiled=True), n) for x in (k, v)
    )
    seq = jnp.arange(2 * n * c, dtype=jnp.int32)
    half = n * c  # chunk r < cp ends by the middle of the sequence
    o1, _ = _block(q[:, :c], k_all[:, :half], v_all[:, :half], positions[:c], seq[:half], window)
    o2, _ = _block(q[:, c:], k_all, v_all, positions[c:], seq, window)
    return jnp.concatenate([o1, o2], axis=1)


def _ulysses(q, k, v, context: ContextParallel, implementation: str, window) -> jax.Array:
    """``a2a`` (module docstring): ``[b, s, heads, d]`` -> ``[b, s, heads * d]``."""
    b, s, h, d = q.shape
    g, n, axis = k.shape[2], context.size, context.axis_name
    if g % n:
        raise ValueError(
            f"cp_comm_type 'a2a' splits the attention heads over context_parallel_size "
            f"({n}): this rank's {g} key/value groups (of {h} query heads) do not divide"
        )

    def to_heads(x):  # [b, s, k, d] -> [b, S, k / cp, d] in sequence order
        return _in_sequence_order(
            lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True), n
        )

    out = causal_attention(
        to_heads(q), to_heads(k), to_heads(v), implementation=implementation, window=window
    )
    out = _in_rank_order(out.reshape(b, n * s, h // n, d), n)
    out = lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
    return out.reshape(b, s, h * d)
