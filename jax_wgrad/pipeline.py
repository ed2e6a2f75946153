"""One-program 1F1B pipeline: a ``lax.scan`` over schedule ticks inside ``shard_map``.

Schedule (``P`` stages, ``M`` microbatches, stage ``s``, tick ``t``)::

    forward  of microbatch f = t - s            when 0 <= f < M
    backward of microbatch b = t - (2P - 2 - s)  when 0 <= b < M
    T = M + 2P - 2 ticks

Within a tick a stage first runs its forward, then its backward; the last stage runs
the backward of the microbatch it just forwarded. At the end of every tick activations
move ``s -> s+1`` and gradients ``s+1 -> s`` with two acyclic ``ppermute``\\ s. A stage
with no forward (warm-up/cool-down) or no backward in a tick skips that compute with
``lax.cond``, so the whole step costs ``(M + P - 1) * (F + B)`` like Megatron's 1F1B.
Stage ``s`` holds at most ``2 (P - 1 - s) + 1`` microbatches in flight, so the carry has
``K = 2P - 1`` activation slots whatever ``M`` is, and the scan keeps compile time
independent of ``M``.

Backward of a microbatch is an explicit ``jax.vjp`` of the stage, recomputing its forward
from the stored stage INPUT (Megatron's full activation recompute).

Gradients accumulate in the flat fp32 gradient buckets of :class:`jax_wgrad.ddp.GradLayout`
(scan carry): the stage's layers in one chunk, the embedding/head (replicated on every
stage) in another. The stage function is ``f(params, buckets, x) -> (y, buckets)``: the
buckets thread through every fused linear (:func:`jax_wgrad.linear.linear_into_bucket`),
and the backward tick calls ``vjp_fn((dy, carried buckets))``, which returns the carried
buckets with each fused weight's block added once, in place. All other gradients (biases,
LayerNorms, embeddings; everything without fusion) are added to their static bucket slices
(:meth:`GradBuffer.add_tree`). Layers are unrolled so that every offset is static. Each
microbatch backward is seeded with 1: the buckets hold gradients of the token-loss SUM.

With ``overlap_grad_reduce`` a stage syncs its own buckets over ``data`` inside the scan,
at the tick of its last backward (``lax.cond`` on ``tick == last_backward_tick(stage)``),
while earlier stages are still computing their cooldown backwards; otherwise every sync
happens after the scan. The embedding/head buckets are synced after the scan (after the
deferred output-layer drain of issue #4), then :func:`jax_wgrad.ddp.finalize_grads` does
Megatron's remaining finalization (sequence-parallel and tied-embedding all-reduces, token
scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad import deferred, ops
from jax_wgrad.config import DDPConfig
from jax_wgrad.ddp import GradLayout, canonical_tree, finalize_grads, sync_stage_buckets
from jax_wgrad.gpt import LINEAR_LAYERS, GPTStages, forward_order, param_specs, unstack_layers
from jax_wgrad.linear import WgradBuckets

__all__ = ["PipelineCarry", "schedule", "num_slots", "num_ticks", "last_backward_tick",
           "cooldown_sync", "stage_gradients", "reduce_gradients", "pipeline_gradients"]

Params = dict[str, Any]


def num_ticks(num_stages: int, num_microbatches: int) -> int:
    """``T = M + 2P - 2``."""
    return num_microbatches + 2 * num_stages - 2


def num_slots(num_stages: int) -> int:
    """Activation slots per stage, ``2P - 1`` (independent of ``M``)."""
    return 2 * num_stages - 1


def schedule(num_stages: int, num_microbatches: int) -> list[list[tuple[int | None, int | None]]]:
    """The tick table: ``table[t][s] = (forward microbatch, backward microbatch)``,
    ``None`` for a skipped (bubble) slot. Pure Python, for docs and tests."""
    p, m = num_stages, num_microbatches
    table = []
    for t in range(num_ticks(p, m)):
        row = []
        for s in range(p):
            f, b = t - s, t - (2 * p - 2 - s)
            row.append((f if 0 <= f < m else None, b if 0 <= b < m else None))
        table.append(row)
    return table


class PipelineCarry(NamedTuple):
    """Per-device state carried across ticks (O(P) activations, not O(M))."""

    buckets: tuple[jax.Array, ...]
    """Flat fp32 gradient buckets (:class:`jax_wgrad.ddp.GradLayout`): the accumulators.
    Fused linears write their weight's static slice in place; all other gradients are
    added to their slices with ``dynamic_update_slice``."""
    slots: jax.Array
    """``[2P-1, mb, s(/tp), H]`` stage inputs of in-flight microbatches."""
    x_recv: jax.Array
    """``[mb, s(/tp), H]`` activation received from stage ``s-1`` last tick."""
    g_recv: jax.Array
    """``[mb, s(/tp), H]`` gradient received from stage ``s+1`` last tick."""
    loss_sum: jax.Array
    """fp32 scalar: sum of token losses computed on this device (last stage)."""
    stash: tuple[jax.Array, ...] = ()
    """Deferred output-layer wgrad stash (:mod:`jax_wgrad.deferred`), indexed by
    microbatch; filled by the last stage only, ``()`` without deferral."""


def last_backward_tick(stage, num_stages: int, num_microbatches: int):
    """Tick of stage ``stage``'s last backward, ``M + 2P - 3 - s`` (the cooldown sync)."""
    return num_microbatches + 2 * num_stages - 3 - stage


def cooldown_sync(ddp: DDPConfig, num_stages: int) -> bool:
    """Whether stage buckets are synced inside the schedule (``overlap_grad_reduce``).

    Only with ``P > 1``: with one stage the last backward IS the last tick, so the sync
    happens at the same point after the schedule either way. (Doing it "inside" a
    one-stage schedule also let XLA:CPU run the stage and embedding/head all-reduces
    concurrently, which crashed its in-process communicator; see notes/issue5.md.)
    """
    return ddp.overlap_grad_reduce and num_stages > 1


def stage_gradients(
    stages: GPTStages,
    layout: GradLayout,
    ddp: DDPConfig,
    params: Params,
    tokens: jax.Array,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Per-device body of the schedule (call inside ``shard_map`` over ``(data, tensor,
    pipeline)``).

    Args:
      stages: the model pieces for this layout.
      layout: where this device's gradients live.
      ddp: with ``overlap_grad_reduce`` the stage's buckets are synced over ``data`` inside
        the schedule, at the stage's last backward (:func:`jax_wgrad.ddp.sync_stage_buckets`).
      params: this device's parameter shards; layers ``[L/P, ...]``.
      tokens: int ``[global_batch / dp, S + 1]`` this data rank's sequences.
    Returns:
      ``(buckets, loss_sum)``: this device's buckets of token-loss-SUM gradients (stage
      chunk already synced when overlapping; nothing else reduced) and its sum of token
      losses. :func:`jax_wgrad.ddp.finalize_grads` does the rest.
    """
    par, cfg = stages.parallel, stages.model
    pp, tp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    m, mb = par.num_microbatches, par.micro_batch_size
    fusion, sp = par.gradient_accumulation_fusion, par.sequence_parallel
    seq = cfg.seq_length
    s_local = seq // tp if sp else seq
    dtype = jnp.dtype(cfg.compute_dtype)
    k_slots = num_slots(pp)
    overlap = cooldown_sync(ddp, pp)
    defer = par.num_deferred_microbatches > 0
    stash_shapes = deferred.stash_shapes(par, seq, cfg.hidden_size, cfg.vocab_size, dtype)
    len_stash = max(par.num_deferred_microbatches, 1)

    if tokens.shape != (m * mb, seq + 1):
        raise ValueError(
            f"stage_gradients: expected local tokens [{m * mb}, {seq + 1}], got {tokens.shape}"
        )
    micro = tokens.reshape(m, mb, seq + 1)
    stage = lax.axis_index("pipeline") if pp > 1 else jnp.int32(0)
    is_first = stage == 0
    is_last = stage == pp - 1
    act = jnp.zeros((mb, s_local, cfg.hidden_size), dtype)
    layer_params = unstack_layers(params["layers"])
    shared_params = {"embedding": params["embedding"], "head": params["head"]}

    # Static per-leaf flags: which gradients each vjp adds with add_tree (the fused weights'
    # blocks are written by the fused op; the other parts of a tree are known zeros).
    stage_add = [not (fusion and s.path.endswith("['weight']")) for s in layout.stage.slots]
    out_path = _output_path(layout)
    head_add = [s.path.startswith("['head']") or (layout.tied and s.path == out_path)
                for s in layout.shared.slots]
    head_add = [a and not (fusion and s.path == out_path)
                for a, s in zip(head_add, layout.shared.slots)]
    embed_add = [s.path.startswith("['embedding']") for s in layout.shared.slots]

    def take(i):
        return lax.dynamic_index_in_dim(micro, jnp.clip(i, 0, m - 1), 0, keepdims=False)

    def forward(c: PipelineCarry, f) -> tuple[jax.Array, jax.Array]:
        ids = take(f)[:, :-1]
        x_in = lax.cond(
            is_first, lambda: stages.embed(params["embedding"], ids), lambda: c.x_recv
        )
        # The last stage only stores its input: its backward recomputes everything.
        y = lax.cond(
            is_last, lambda: act, lambda: stages.layers(layer_params, None, x_in)
        )
        slots = lax.dynamic_update_index_in_dim(c.slots, x_in, f % k_slots, 0)
        return slots, y

    def layers_fn(lp, bks, x):
        # f(params, buckets, x) -> (y, buckets): the buckets thread through the fused linears.
        wb = WgradBuckets(bks)
        mg = None
        if fusion:
            mg = [{n: wb.slot(*sl[n]) for n in LINEAR_LAYERS} for sl in layout.stage_slots]
        return stages.layers(lp, mg, x), wb.buckets

    def head_backward(shared_bk, h, labels):
        def fn(p, bks, x):
            wb = WgradBuckets(bks)
            mg = wb.slot(*layout.output_slot) if fusion else None
            return stages.head_loss(p, mg, x, labels), wb.buckets

        (loss, _), vjp = jax.vjp(fn, shared_params, shared_bk, h)
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dp, shared_bk, dh = vjp((jnp.float32(1.0), shared_bk))
        shared_bk = layout.shared.add_tree(shared_bk, forward_order(dp), where=head_add)
        return dh, shared_bk, loss

    def deferred_head_backward(shared_bk, stash, h, labels, b):
        # Explicit head backward; the output weight's block is accumulated now (fused op)
        # or its inputs are stashed for the drain, by Megatron's predicate.
        head = deferred.head_backward(stages, params, h, labels)
        zeros_emb = jax.tree.map(jnp.zeros_like, params["embedding"])  # skipped (dead code)
        tree = forward_order({"embedding": zeros_emb, "head": head["dhead"]})
        shared_bk = layout.shared.add_tree(shared_bk, tree, where=head_add)
        bi, off = layout.output_slot

        def now(bk, st):
            bk = list(bk)
            bk[bi] = ops.wgrad_accumulate(head["x_full"], head["dy"], bk[bi], offset=off)
            return tuple(bk), st

        def later(bk, st):
            items = deferred.stash_items(par, head, labels)
            return bk, deferred.stash_put(st, jnp.clip(b, 0, len_stash - 1), items)

        if par.num_deferred_microbatches == m:
            shared_bk, stash = later(shared_bk, stash)
        else:
            shared_bk, stash = lax.cond(deferred.is_deferred(par, b), later, now,
                                        shared_bk, stash)
        return head["dx"], shared_bk, head["loss"], stash

    def embed_backward(shared_bk, dx, ids):
        _, vjp = jax.vjp(lambda p: stages.embed(p, ids), params["embedding"])
        (demb,) = vjp(dx)
        zeros_head = jax.tree.map(jnp.zeros_like, params["head"])  # skipped (dead code)
        tree = forward_order({"embedding": demb, "head": zeros_head})
        return layout.shared.add_tree(shared_bk, tree, where=embed_add)

    def backward(c: PipelineCarry, b):
        tok = take(b)
        ids, labels = tok[:, :-1], tok[:, 1:]
        x_in = lax.dynamic_index_in_dim(c.slots, b % k_slots, 0, keepdims=False)
        stage_bk, shared_bk = layout.split(c.buckets)
        (h, _), layers_vjp = jax.vjp(layers_fn, layer_params, stage_bk, x_in)
        if defer:
            dh, shared_bk, loss, stash = lax.cond(
                is_last,
                lambda a, st: deferred_head_backward(a, st, h, labels, b),
                lambda a, st: (c.g_recv, a, jnp.float32(0.0), st),
                shared_bk, c.stash,
            )
        else:
            dh, shared_bk, loss = lax.cond(
                is_last,
                lambda a: head_backward(a, h, labels),
                lambda a: (c.g_recv, a, jnp.float32(0.0)),
                shared_bk,
            )
            stash = c.stash
        dp, stage_bk, dx = layers_vjp((dh, stage_bk))
        stage_bk = layout.stage.add_tree(stage_bk, [forward_order(d) for d in dp],
                                         where=stage_add)
        shared_bk = lax.cond(
            is_first, lambda a: embed_backward(a, dx, ids), lambda a: a, shared_bk
        )
        return stage_bk + shared_bk, dx, loss, stash

    def tick(c: PipelineCarry, t) -> tuple[PipelineCarry, None]:
        f = t - stage
        b = t - (2 * pp - 2 - stage)
        do_fwd = (f >= 0) & (f < m)
        do_bwd = (b >= 0) & (b < m)
        with jax.named_scope("forward"):
            slots, y = lax.cond(do_fwd, forward, lambda c, f: (c.slots, act), c, f)
        c = c._replace(slots=slots)
        with jax.named_scope("backward"):
            buckets, dx, loss, stash = lax.cond(
                do_bwd, backward,
                lambda c, b: (c.buckets, act, jnp.float32(0.0), c.stash), c, b
            )
        if overlap:
            # Cooldown: this stage's last backward is done -> sync its buckets now, while
            # earlier stages still compute. The predicate depends only on (stage, tick), so
            # every member of a `data` group takes the same branch.
            with jax.named_scope("grad_sync_in_cooldown"):
                stage_bk, shared_bk = layout.split(buckets)
                stage_bk = lax.cond(
                    t == last_backward_tick(stage, pp, m),
                    lambda bk: sync_stage_buckets(bk, ddp),
                    lambda bk: bk,
                    stage_bk,
                )
                buckets = stage_bk + shared_bk
        if pp > 1:
            with jax.named_scope("send_recv"):
                x_recv = lax.ppermute(y, "pipeline", [(i, i + 1) for i in range(pp - 1)])
                g_recv = lax.ppermute(dx, "pipeline", [(i + 1, i) for i in range(pp - 1)])
        else:
            x_recv, g_recv = act, act
        return PipelineCarry(buckets, slots, x_recv, g_recv, c.loss_sum + loss, stash), None

    carry = PipelineCarry(
        buckets=layout.buffer.zeros(),
        slots=jnp.zeros((k_slots, *act.shape), dtype),
        x_recv=act,
        g_recv=act,
        loss_sum=jnp.float32(0.0),
        stash=deferred.init_stash(stash_shapes),
    )
    carry, _ = lax.scan(tick, carry, jnp.arange(num_ticks(pp, m)))
    buckets = carry.buckets
    if defer:
        # Issue #4: the deferred output-layer wgrad drain, GEMMs on the last stage only
        # (`active`; the ring's permutes run everywhere, see deferred.drain), BEFORE
        # finalize_grads reduces the shared buckets over `data` and between the tied
        # first/last stage copies.
        with jax.named_scope("deferred_wgrad_drain"):
            stage_bk, shared_bk = layout.split(buckets)
            bi, off = layout.output_slot

            shared_bk = list(shared_bk)
            shared_bk[bi] = deferred.drain(par, carry.stash, shared_bk[bi], off,
                                           stages.output_weight(params), active=is_last)
            buckets = stage_bk + tuple(shared_bk)
    return buckets, carry.loss_sum


def _output_path(layout: GradLayout) -> str:
    if layout.tied:
        return "['embedding']['word']['embedding']"
    return "['head']['output']['weight']"


def local_num_tokens(stages: GPTStages) -> int:
    """Tokens of one data rank's batch (all count: no loss mask)."""
    par = stages.parallel
    return par.num_microbatches * par.micro_batch_size * stages.model.seq_length


def reduce_gradients(
    stages: GPTStages,
    layout: GradLayout,
    ddp: DDPConfig,
    params: Params,
    tokens: jax.Array,
    *,
    grad_hook=None,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Schedule + finalization (inside ``shard_map``): ``(synced grads, mean loss)``.

    The synced gradients are :func:`jax_wgrad.ddp.finalize_grads`'s: shards (distributed
    optimizer) or full buckets of the global mean token loss's gradient. ``grad_hook``
    (tests: fault injection) maps the local buckets before they are finalized.
    """
    par = stages.parallel
    buckets, loss_sum = stage_gradients(stages, layout, ddp, params, tokens)
    if grad_hook is not None:
        buckets = tuple(grad_hook(buckets))
    n_local = jnp.float32(local_num_tokens(stages))
    synced = finalize_grads(
        layout, ddp, buckets, stage_synced=cooldown_sync(ddp, par.pipeline_model_parallel_size),
        num_tokens=n_local,
        sequence_parallel=par.sequence_parallel,
        pipeline_parallel=par.pipeline_model_parallel_size > 1)
    loss = lax.psum(loss_sum, ("data", "pipeline")) / lax.psum(n_local, "data")
    return synced, loss


def pipeline_gradients(
    stages: GPTStages,
    mesh: Mesh,
    params: Params,
    tokens: jax.Array,
    ddp: DDPConfig | None = None,
) -> tuple[Params, jax.Array]:
    """Gradients and mean loss of one global batch; traceable under ``jax.jit``.

    Args:
      params: canonical parameters sharded as :func:`jax_wgrad.gpt.param_specs`.
      tokens: int ``[global_batch_size, S + 1]`` sharded over ``data``.
      ddp: bucket options (its ``use_distributed_optimizer`` is ignored: the buckets are
        all-reduced so that every rank gets the whole gradient tree).
    Returns:
      ``(grads, loss)``: fp32 gradients sharded like ``params`` and the scalar loss.
    """
    ddp = dataclasses.replace(ddp or DDPConfig(), use_distributed_optimizer=False)
    layout = GradLayout.create(stages.model, stages.parallel.mesh_shape, ddp)
    specs = param_specs(stages.model)

    def body(p, t):
        synced, loss = reduce_gradients(stages, layout, ddp, p, t)
        return canonical_tree(layout.buffer.to_tree(synced)), loss

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=(specs, P()),
        check_vma=False,
    )
    return fn(params, tokens)
