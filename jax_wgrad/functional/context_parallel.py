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

The ring's blocks run on cuDNN's flash attention (``implementation="cudnn"``, without a
sliding window) or in XLA; ``allgather``'s in XLA. An XLA block is computed as
:func:`~jax_wgrad.functional.causal_attention`'s XLA form computes it (fp32 scores and
softmax over a mask from the tokens' positions, so sliding windows and grouped-query
attention work), returning its log-sum-exp. The ring's backward is flash attention's
(:func:`_ring_bwd`: the keys and values passed around again with their gradients, each
block's gradients from the whole attention's output and log-sum-exp); the others' is
``jax``'s: the transposes of ``all_gather`` and ``all_to_all`` send the key and value
gradients back to their ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad.functional.attention import CORE_ATTENTION_SCOPE, causal_attention

__all__ = [
    "ContextParallel",
    "context_parallel_attention",
    "context_positions",
    "context_tokens",
    "load_balanced_positions",
    "runs_cudnn",
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


def runs_cudnn(comm_type: str, window: int | None) -> bool:
    """Whether a ``comm_type`` split can run cuDNN's flash attention: ``a2a`` (the whole
    sequence's core) and ``p2p`` without a sliding window (its blocks); ``allgather``
    computes its blocks in XLA."""
    return comm_type == "a2a" or (comm_type == "p2p" and window is None)


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
      implementation: ``"xla"`` or ``"cudnn"``: the whole-sequence core of ``a2a``
        (:func:`~jax_wgrad.functional.causal_attention`), the blocks of ``p2p`` (cuDNN's
        without a sliding window); ``allgather`` computes its blocks in XLA and refuses
        ``"cudnn"``.
      window: sliding-window attention over ``window`` tokens, or ``None``.
    Returns:
      ``[b, s, heads * d]`` in ``q.dtype``.
    """
    b, s, h, d = q.shape
    if s % 2:
        raise ValueError(f"context_parallel_attention: {s} local tokens are not two chunks")
    with jax.named_scope(CORE_ATTENTION_SCOPE):
        return _attend(q, k, v, positions, context, implementation, window)


def _attend(q, k, v, positions, context: ContextParallel, implementation: str, window):
    """:func:`context_parallel_attention`'s body."""
    b, s, h, d = q.shape
    g, n = k.shape[2], context.size
    if context.comm_type == "a2a":
        return _ulysses(q, k, v, context, implementation, window)
    if implementation != "xla" and not runs_cudnn(context.comm_type, window):
        raise ValueError(
            f"cp_comm_type {context.comm_type!r}"
            + (" with a sliding window" if context.comm_type == "p2p" else "")
            + f" computes its attention blocks in XLA; attention implementation "
            f"{implementation!r} runs with cp_comm_type 'a2a'"
            + (" (or 'p2p' without a window)" if context.comm_type != "p2p" else "")
        )
    qg = q.reshape(b, s, g, h // g, d)
    if context.comm_type == "p2p":
        out = _ring(qg, k, v, positions, context, window, implementation)
    elif context.comm_type == "allgather":
        out = _gathered(qg, k, v, positions, n, context.axis_name, window)
    else:
        raise ValueError(
            f"cp_comm_type must be one of 'p2p', 'allgather', 'a2a', got {context.comm_type!r}"
        )
    return out.astype(q.dtype).reshape(b, s, h * d)


# ------------------------------------------------------------------------------ blocks


def _mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """bool ``[sq, sk]``: query ``i`` sees key ``j`` (causal, and within the window)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    return visible


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """fp32 ``[b, g, m, sq, sk]`` scaled scores of ``q [b, sq, g, m, d]``, ``k [b, sk, g, d]``."""
    scores = jnp.einsum("bqgmd,bkgd->bgmqk", q, k, preferred_element_type=jnp.float32)
    return scores / math.sqrt(q.shape[-1])


def _block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    causal: bool | None,
    window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """One block in XLA: ``q [b, sq, g, m, d]`` over ``k, v [b, sk, g, d]`` with the
    causal (and window) mask of their positions (``causal``, what the mask is without a
    window, is not needed) -> ``(out [b, sq, g, m, d] fp32, lse [b, g, m, sq] fp32)``; a
    row that sees no key gets ``out`` 0 and ``lse`` about ``-1e30``."""
    visible = _mask(q_pos, k_pos, window)
    scores = jnp.where(visible, _scores(q, k), _MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
    out = jnp.einsum("bgmqk,bkgd->bqgmd", probs.astype(v.dtype), v)
    return out.astype(jnp.float32), lse


def _block_grads(q, k, v, q_pos, k_pos, causal, window, lse, out, d_out, delta):
    """The gradients of one block in XLA from the WHOLE attention's ``lse [b, g, m, sq]``,
    output ``out`` and its gradient ``d_out [b, sq, g, m, d]`` (via ``delta =
    rowsum(d_out * out)``; flash attention's backward, the probabilities recomputed):
    ``(dq, dk, dv)`` fp32."""
    visible = _mask(q_pos, k_pos, window)
    probs = jnp.where(visible, jnp.exp(_scores(q, k) - lse[..., None]), 0.0)
    dv = jnp.einsum("bgmqk,bqgmd->bkgd", probs, d_out)
    dp = jnp.einsum("bqgmd,bkgd->bgmqk", d_out, v, preferred_element_type=jnp.float32)
    ds = probs * (dp - delta[..., None]) / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bgmqk,bkgd->bqgmd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bgmqk,bqgmd->bkgd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _cudnn_rules():
    """jax's cuDNN flash-attention forward and backward rules, and the keyword arguments
    both take (``jax._src.cudnn.fused_attention_stablehlo``: the rules of
    :func:`jax.nn.dot_product_attention`'s ``custom_vjp``, called directly because the
    ring's backward hands each block the WHOLE attention's output and log-sum-exp, and the
    public function's backward reads its own). jax 0.10-0.11 and 0.12 differ in a
    ``score_mod`` argument; the keywords are filtered by the rules' signatures."""
    import inspect

    from jax._src.cudnn import fused_attention_stablehlo as fa

    fwd, bwd = fa._dot_product_attention_fwd_rule, fa._dot_product_attention_bwd_rule
    flex = "score_mod" in inspect.signature(bwd).parameters
    return fa, fwd, bwd, flex, inspect.signature(fwd).parameters, inspect.signature(bwd).parameters


def _cudnn_common(q: jax.Array, causal: bool) -> dict:
    """The static arguments of one cuDNN block (``q [b, c, heads, d]``, BTNH)."""
    fa, *_ = _cudnn_rules()
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return dict(
        scale=1.0 / math.sqrt(q.shape[-1]),
        seed=42,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask,
        layout=fa._normalize_layout("BTNH").value,
        sliding_window_length=None,
        score_mod=None,
        cudnn_version=fa.check_cudnn_version(),
        is_training=True,
        return_residual=True,
        score_mod_args=(),
    )


def _cudnn_block(q, k, v, q_pos, k_pos, causal: bool, window: int | None):
    """:func:`_block` by cuDNN's flash attention (``window`` must be ``None``): the block's
    output and log-sum-exp (of the scaled scores, natural log: what
    ``return_residual`` returns)."""
    b, sq, g, m, d = q.shape
    _, fwd, _, _, fwd_params, _ = _cudnn_rules()
    not_used = jnp.zeros(0, q.dtype)
    kw = dict(
        _cudnn_common(q.reshape(b, sq, g * m, d), causal),
        query=q.reshape(b, sq, g * m, d),
        key=k,
        value=v,
        **dict.fromkeys(("bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"), not_used),
        page_table_k=not_used,
        page_table_v=not_used,
    )
    (out, stat), _ = fwd(**{name: kw[name] for name in fwd_params})
    lse = stat.reshape(b, g, m, sq)  # [b, heads, q]: heads group-major, as q's
    return out.reshape(b, sq, g, m, d).astype(jnp.float32), lse


def _cudnn_block_grads(q, k, v, q_pos, k_pos, causal, window, lse, out, d_out, delta):
    """:func:`_block_grads` by cuDNN's flash-attention backward, handed the WHOLE
    attention's output and log-sum-exp as its saved forward (so its ``rowsum(d_out *
    out)`` and recomputed probabilities are the whole attention's): ``(dq, dk, dv)``."""
    b, sq, g, m, d = q.shape
    _, _, bwd, flex, _, bwd_params = _cudnn_rules()
    qh = q.reshape(b, sq, g * m, d)
    not_used = jnp.zeros(0, q.dtype)
    res = (qh, k, v, *(not_used,) * 7, *(((),) if flex else ()))
    res += (lse.reshape(b, g * m, sq), out.astype(q.dtype).reshape(b, sq, g * m, d))
    kw = dict(_cudnn_common(qh, causal), return_residual=False, res=res)
    kw["grad_output"] = d_out.astype(q.dtype).reshape(b, sq, g * m, d)
    dq, dk, dv, *_ = bwd(**{name: kw[name] for name in bwd_params})
    return dq.reshape(b, sq, g, m, d).astype(jnp.float32), dk, dv


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


def _ring_steps(n: int, c: int, r: jax.Array):
    """The ring's steps: per step ``i``, the positions ``[2c]`` of the keys it holds (rank
    ``r - i``'s) and its blocks ``(query row, key row, causal)``, each ``c x c`` tokens
    (module docstring): step 0 the rank's own chunks (three blocks, two of them causal
    diagonal blocks), then two full blocks per step."""
    ar = jnp.arange(c, dtype=jnp.int32)
    for i in range(n):
        src = (r - i) % n
        k_pos = jnp.concatenate([src * c + ar, (2 * n - 1 - src) * c + ar])
        if i == 0:  # (query row, key row, causal: a diagonal block)
            yield k_pos, ((0, 0, True), (c, 0, False), (c, c, True))
        else:  # keys from a lower rank: both query chunks see their first chunk only;
            # from a higher rank: only the second query chunk sees them, both chunks
            start = jnp.where(src < r, 0, c)
            yield k_pos, ((start, 0, False), (c, start, False))


def _rows(x: jax.Array, start, c: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, c, axis=axis)


def _block_rows(q, k, v, q_pos, k_pos, qs, ks, c: int) -> tuple[jax.Array, ...]:
    """A block's ``(q, k, v, q_pos, k_pos)``: ``c`` tokens from query row ``qs`` and key
    row ``ks``."""
    return (
        _rows(q, qs, c),
        _rows(k, ks, c),
        _rows(v, ks, c),
        _rows(q_pos, qs, c, 0),
        _rows(k_pos, ks, c, 0),
    )


def _add_rows(x: jax.Array, start, update: jax.Array, axis: int = 1) -> jax.Array:
    c = update.shape[axis]
    return lax.dynamic_update_slice_in_dim(x, _rows(x, start, c, axis) + update, start, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, positions, context: ContextParallel, window: int | None, blocks: str):
    """``p2p`` (module docstring): ``q [b, 2c, g, m, d]`` -> ``[b, 2c, g, m, d]`` fp32,
    its ``c x c`` blocks computed by ``blocks``: ``"xla"`` (:func:`_block`: fp32 scores and
    softmax, the probabilities recomputed in the backward) or ``"cudnn"``
    (:func:`_cudnn_block`: cuDNN's flash attention, causal on the diagonal). The backward
    (:func:`_ring_bwd`) passes the keys and values around the ring again, with their
    gradients, as Megatron's; only ``q, k, v``, the output and its log-sum-exp are kept
    for it."""
    return _ring_fwd(q, k, v, positions, context, window, blocks)[0]


def _ring_fwd(q, k, v, positions, context: ContextParallel, window: int | None, blocks: str):
    block = _cudnn_block if blocks == "cudnn" else _block
    b, s, g, m, d = q.shape
    c, n = s // 2, context.size
    r = lax.axis_index(context.axis_name)
    out = jnp.zeros((b, s, g, m, d), jnp.float32)
    lse = jnp.full((b, g, m, s), _MASKED, jnp.float32)
    kv, incoming = (k, v), None
    for i, (k_pos, blocks) in enumerate(_ring_steps(n, c, r)):
        kv = kv if incoming is None else incoming
        # the next exchange in flight beside this step's blocks
        incoming = _shift(kv, context) if i + 1 < n else None
        ki, vi = kv
        for qs, ks, causal in blocks:
            new = block(*_block_rows(q, ki, vi, positions, k_pos, qs, ks, c), causal, window)
            o, l_ = _merge((_rows(out, qs, c), _rows(lse, qs, c, 3)), new)
            out = lax.dynamic_update_slice_in_dim(out, o, qs, 1)
            lse = lax.dynamic_update_slice_in_dim(lse, l_, qs, 3)
    # the backward reads the output in the compute dtype, as flash attention's does
    return out, (q, k, v, positions, out.astype(q.dtype), lse)


def _ring_bwd(context: ContextParallel, window: int | None, blocks: str, res, d_out):
    q, k, v, positions, out, lse = res
    grads = _cudnn_block_grads if blocks == "cudnn" else _block_grads
    s = q.shape[1]
    c, n = s // 2, context.size
    r = lax.axis_index(context.axis_name)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.moveaxis(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), 1, -1)  # [b, g, m, s]
    dq = jnp.zeros(q.shape, jnp.float32)
    kv, incoming = (k, v), None
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for i, (k_pos, blocks) in enumerate(_ring_steps(n, c, r)):
        if incoming is not None:  # rank r - i's keys, their gradients of ranks r - i .. r - 1
            kv, dkv = incoming, _shift(dkv, context)
        incoming = _shift(kv, context) if i + 1 < n else None
        ki, vi = kv
        for qs, ks, causal in blocks:
            bq, bk, bv = grads(
                *_block_rows(q, ki, vi, positions, k_pos, qs, ks, c),
                causal,
                window,
                _rows(lse, qs, c, 3),
                _rows(out, qs, c),
                _rows(d_out, qs, c),
                _rows(delta, qs, c, 3),
            )
            dq = _add_rows(dq, qs, bq)
            dkv = (_add_rows(dkv[0], ks, bk), _add_rows(dkv[1], ks, bv))
    if n > 1:  # back to the rank that holds those keys
        dkv = _shift(dkv, context)
    zeros = np.zeros(positions.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), zeros


_ring.defvjp(_ring_fwd, _ring_bwd)


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
    o1, _ = _block(
        q[:, :c], k_all[:, :half], v_all[:, :half], positions[:c], seq[:half], None, window
    )
    o2, _ = _block(q[:, c:], k_all, v_all, positions[c:], seq, None, window)
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
