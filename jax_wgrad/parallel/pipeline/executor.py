"""Runs a pipeline schedule table as ONE ``lax.scan`` over ticks inside ``shard_map``.

The executor reads the :class:`~jax_wgrad.parallel.pipeline.schedules.ScheduleTable` (as
arrays indexed by the scan's tick and this device's stage) and knows no schedule formula:
per tick a stage runs the forward and then the backward task the table names for it
(``lax.cond`` skips an idle one), optionally syncs its gradient buckets in the cooldown, and
exchanges activations and gradients with its neighbours (two acyclic ``ppermute``\\ s).

* **Forward** of microbatch ``f``: the stage input is the embedding of its tokens on the
  first stage, else the activation received for ``f``; it is stored at slot
  ``f % num_slots`` (the stage's in-flight inputs) and the stage's layers run on it (the
  last stage only stores its input).
* **Backward** of microbatch ``b``: an explicit ``jax.vjp`` of the stage recomputing its
  forward from the stored input (Megatron's full activation recompute), seeded with the
  gradient received for ``b`` (with the head's loss on the last stage, seeded with 1: the
  buckets hold gradients of the token-loss SUM). The stage function is
  ``f(params, buckets, x) -> (y, buckets)``: the buckets thread through every fused linear
  (:func:`jax_wgrad.functional.linear_into_bucket`), so ``vjp((dy, carried buckets))``
  returns them with each fused weight's block added once, in place; every other gradient
  is added to its block by :meth:`~jax_wgrad.grads.GradBuffer.add_tree` (in-place
  ``bucket_add``). Which leaves each part adds comes from the layout's specs
  (:meth:`~jax_wgrad.grads.GradLayout.added_by`).
* **Cooldown sync** (``overlap_grad_reduce``): at the tick of the stage's last backward
  (from the table) its stage buckets are synced over ``data`` while earlier stages still
  compute; the predicate depends only on ``(stage, tick)``, so every member of a data group
  takes the same branch.
* **Deferred output-layer wgrad** (:mod:`jax_wgrad.parallel.deferred`): the last stage
  stashes the output layer's weight-gradient inputs of the microbatches the deferral
  predicate names and drains them after the scan.

Carried state per device (:class:`PipelineCarry`): the buckets, ``num_slots`` stored stage
inputs, the inboxes of received activations and gradients, the loss sum and the stash;
bounded by the table, not by ``M``, so compile time does not grow with ``M``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad import ops
from jax_wgrad.functional.linear import WgradBuckets
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import sync_stage_buckets
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.grads.spec import INPUT, LAYERS, OUTPUT, SHARED, STAGE
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable

__all__ = ["PipelineCarry", "cooldown_sync", "stage_gradients"]


class PipelineCarry(NamedTuple):
    """Per-device state carried across ticks (bounded by the schedule, not by ``M``)."""

    buckets: tuple[jax.Array, ...]
    """Flat fp32 gradient buckets (:class:`~jax_wgrad.grads.GradLayout`): the accumulators."""
    slots: jax.Array
    """``[num_slots, mb, s(/tp), H]`` stage inputs of in-flight microbatches."""
    x_inbox: jax.Array
    """``[depth + 1, mb, s(/tp), H]`` activations received, by microbatch; the last slot
    takes what arrives in a tick where the sender ran no forward."""
    g_inbox: jax.Array
    """``[depth + 1, mb, s(/tp), H]`` gradients received, likewise."""
    loss_sum: jax.Array
    """fp32 scalar: sum of token losses computed on this device (last stage)."""
    stash: tuple[jax.Array, ...] = ()
    """Deferred output-layer wgrad stash, indexed by microbatch (last stage only)."""


def cooldown_sync(ddp: DDPConfig, num_stages: int) -> bool:
    """Whether stage buckets are synced inside the schedule (``overlap_grad_reduce``).

    Only with ``P > 1``: with one stage the last backward IS the last tick, so the sync
    happens at the same point after the schedule either way. (Doing it "inside" a
    one-stage schedule also let XLA:CPU run the stage and embedding/head all-reduces
    concurrently, which crashed its in-process communicator; see notes/issue5.md.)
    """
    return ddp.overlap_grad_reduce and num_stages > 1


def stage_gradients(stages, layout: GradLayout, ddp: DDPConfig, table: ScheduleTable,
                    params, tokens: jax.Array) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Per-device body of the schedule (call inside ``shard_map`` over the mesh).

    Args:
      stages: the model's per-stage functions (:class:`jax_wgrad.models.gpt.GPTStages`).
      layout: where this device's gradients live.
      ddp: with ``overlap_grad_reduce`` the stage's buckets are synced over ``data`` inside
        the schedule, at the stage's last backward.
      table: the schedule; its stages and microbatches must match ``stages.parallel``.
      params: this device's parameters as the device tree ``(layers, shared)``.
      tokens: int ``[global_batch / dp, S + 1]`` this data rank's sequences.
    Returns:
      ``(buckets, loss_sum)``: this device's buckets of token-loss-SUM gradients (stage
      chunk already synced when overlapping; nothing else reduced) and its sum of token
      losses. :func:`jax_wgrad.grads.finalize_grads` does the rest.
    """
    run = _StageRun(stages, layout, ddp, table, params, tokens)
    carry, _ = lax.scan(run.tick, run.init_carry(), run.tick_inputs())
    return run.drain(carry), carry.loss_sum


class _StageRun:
    """One device's run of a schedule: static context plus the tick's named steps."""

    def __init__(self, stages, layout: GradLayout, ddp: DDPConfig, table: ScheduleTable,
                 params, tokens: jax.Array):
        par, cfg = stages.parallel, stages.model
        self.stages, self.layout, self.ddp, self.table, self.par = stages, layout, ddp, table, par
        self.pp, self.m, self.mb = par.pipeline_model_parallel_size, par.num_microbatches, \
            par.micro_batch_size
        if (table.num_stages, table.num_microbatches) != (self.pp, self.m):
            raise ValueError(f"stage_gradients: schedule {table.name!r} is for "
                             f"{table.num_stages} stages x {table.num_microbatches} "
                             f"microbatches, the layout has {self.pp} x {self.m}")
        seq = cfg.seq_length
        if tokens.shape != (self.m * self.mb, seq + 1):
            raise ValueError(f"stage_gradients: expected local tokens "
                             f"[{self.m * self.mb}, {seq + 1}], got {tokens.shape}")
        self.micro = tokens.reshape(self.m, self.mb, seq + 1)
        s_local = seq // par.tensor_model_parallel_size if par.sequence_parallel else seq
        self.act = jnp.zeros((self.mb, s_local, cfg.hidden_size), jnp.dtype(cfg.compute_dtype))
        self.layer_params, self.shared = params
        self.stage = lax.axis_index(PIPELINE) if self.pp > 1 else jnp.int32(0)
        self.is_first, self.is_last = self.stage == 0, self.stage == self.pp - 1
        self.fusion = par.gradient_accumulation_fusion
        self.overlap = cooldown_sync(ddp, self.pp)
        self.defer = par.num_deferred_microbatches > 0
        self.stash_shapes = deferred.stash_shapes(par, seq, cfg.hidden_size, cfg.vocab_size,
                                                  self.act.dtype)
        self.num_slots = table.num_slots
        self.depth = (table.inbox_depth("F"), table.inbox_depth("B"))
        self.last_tick = jnp.asarray([table.last_backward_tick(s) for s in range(self.pp)])
        self.out_slot = layout.fused_slot(SHARED, OUTPUT) if self.fusion else None

    # ------------------------------------------------------------------------ the scan

    def init_carry(self) -> PipelineCarry:
        inbox = lambda d: jnp.zeros((d + 1, *self.act.shape), self.act.dtype)
        return PipelineCarry(
            buckets=self.layout.buffer.zeros(),
            slots=jnp.zeros((self.num_slots, *self.act.shape), self.act.dtype),
            x_inbox=inbox(self.depth[0]), g_inbox=inbox(self.depth[1]),
            loss_sum=jnp.float32(0.0), stash=deferred.init_stash(self.stash_shapes))

    def tick_inputs(self):
        """The scan's xs: per tick, its index and the table rows (``int32 [P]`` each)."""
        return (jnp.arange(self.table.num_ticks), jnp.asarray(self.table.forward),
                jnp.asarray(self.table.backward))

    def tick(self, c: PipelineCarry, xs) -> tuple[PipelineCarry, None]:
        t, fwd_row, bwd_row = xs
        f, b = fwd_row[self.stage], bwd_row[self.stage]
        with jax.named_scope("forward"):
            slots, y = lax.cond(f >= 0, self.forward, lambda c, f: (c.slots, self.act), c, f)
        c = c._replace(slots=slots)
        with jax.named_scope("backward"):
            buckets, dx, loss, stash = lax.cond(
                b >= 0, self.backward,
                lambda c, b: (c.buckets, self.act, jnp.float32(0.0), c.stash), c, b)
        if self.overlap:
            buckets = self.cooldown(buckets, t)
        x_inbox, g_inbox = self.exchange(c, y, dx, fwd_row, bwd_row)
        return PipelineCarry(buckets, slots, x_inbox, g_inbox, c.loss_sum + loss, stash), None

    def exchange(self, c: PipelineCarry, y, dx, fwd_row, bwd_row):
        """Activations go ``s -> s+1``, gradients ``s+1 -> s`` (acyclic permutes); each is
        kept at its microbatch's inbox slot until the task that consumes it runs."""
        if self.pp == 1:
            return c.x_inbox, c.g_inbox
        with jax.named_scope("send_recv"):
            x_recv = lax.ppermute(y, PIPELINE, [(i, i + 1) for i in range(self.pp - 1)])
            g_recv = lax.ppermute(dx, PIPELINE, [(i + 1, i) for i in range(self.pp - 1)])
        prev = fwd_row[jnp.maximum(self.stage - 1, 0)]
        nxt = bwd_row[jnp.minimum(self.stage + 1, self.pp - 1)]
        x_inbox = lax.dynamic_update_index_in_dim(
            c.x_inbox, x_recv, self._inbox_slot(prev, self.depth[0], self.is_first), 0)
        g_inbox = lax.dynamic_update_index_in_dim(
            c.g_inbox, g_recv, self._inbox_slot(nxt, self.depth[1], self.is_last), 0)
        return x_inbox, g_inbox

    @staticmethod
    def _inbox_slot(microbatch, depth: int, no_sender):
        # Nothing sent (idle sender, or no neighbour): the spare slot `depth`, never read.
        return jnp.where((microbatch < 0) | no_sender, depth, microbatch % depth)

    def cooldown(self, buckets, t):
        """This stage's last backward is done: sync its buckets now (inside the loop)."""
        with jax.named_scope("grad_sync_in_cooldown"):
            stage_bk, shared_bk = self.layout.split(buckets)
            stage_bk = lax.cond(t == self.last_tick[self.stage],
                                lambda bk: sync_stage_buckets(bk, self.ddp), lambda bk: bk,
                                stage_bk)
            return stage_bk + shared_bk

    # ------------------------------------------------------------------------ tasks

    def _tokens(self, i):
        return lax.dynamic_index_in_dim(self.micro, jnp.clip(i, 0, self.m - 1), 0,
                                        keepdims=False)

    def forward(self, c: PipelineCarry, f) -> tuple[jax.Array, jax.Array]:
        ids = self._tokens(f)[:, :-1]
        received = lax.dynamic_index_in_dim(c.x_inbox, f % self.depth[0], 0, keepdims=False)
        x_in = lax.cond(self.is_first, lambda: self.stages.embed(self.shared, ids),
                        lambda: received)
        # The last stage only stores its input: its backward recomputes everything.
        y = lax.cond(self.is_last, lambda: self.act,
                     lambda: self.stages.layers(self.layer_params, None, x_in))
        slots = lax.dynamic_update_index_in_dim(c.slots, x_in, f % self.num_slots, 0)
        return slots, y

    def backward(self, c: PipelineCarry, b):
        tok = self._tokens(b)
        ids, labels = tok[:, :-1], tok[:, 1:]
        x_in = lax.dynamic_index_in_dim(c.slots, b % self.num_slots, 0, keepdims=False)
        received = lax.dynamic_index_in_dim(c.g_inbox, b % self.depth[1], 0, keepdims=False)
        stage_bk, shared_bk = self.layout.split(c.buckets)
        (h, _), layers_vjp = jax.vjp(self._layers_fn, self.layer_params, stage_bk, x_in)
        if self.defer:
            dh, shared_bk, loss, stash = lax.cond(
                self.is_last, lambda a, st: self._deferred_head_backward(a, st, h, labels, b),
                lambda a, st: (received, a, jnp.float32(0.0), st), shared_bk, c.stash)
        else:
            dh, shared_bk, loss = lax.cond(
                self.is_last, lambda a: self._head_backward(a, h, labels),
                lambda a: (received, a, jnp.float32(0.0)), shared_bk)
            stash = c.stash
        dp, stage_bk, dx = layers_vjp((dh, stage_bk))
        stage_bk = self.layout.stage.add_tree(stage_bk, dp,
                                              where=self.layout.added_by(STAGE, LAYERS))
        shared_bk = lax.cond(self.is_first, lambda a: self._embed_backward(a, dx, ids),
                             lambda a: a, shared_bk)
        return stage_bk + shared_bk, dx, loss, stash

    def _layers_fn(self, lp, bks, x):
        # f(params, buckets, x) -> (y, buckets): the buckets thread through the fused linears.
        wb = WgradBuckets(bks)
        mg = None
        if self.fusion:
            trees = jax.tree.map(lambda s: wb.slot(*s), self.layout.fused_slots(STAGE, LAYERS),
                                 is_leaf=lambda s: isinstance(s, tuple))
            mg = self.stages.layer_main_grads(trees)
        return self.stages.layers(lp, mg, x), wb.buckets

    def _head_backward(self, shared_bk, h, labels):
        def fn(shared, bks, x):
            wb = WgradBuckets(bks)
            mg = wb.slot(*self.out_slot) if self.fusion else None
            return self.stages.head_loss(shared, mg, x, labels), wb.buckets

        (loss, _), vjp = jax.vjp(fn, self.shared, shared_bk, h)
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dshared, shared_bk, dh = vjp((jnp.float32(1.0), shared_bk))
        shared_bk = self.layout.shared.add_tree(shared_bk, dshared,
                                                where=self.layout.added_by(SHARED, OUTPUT))
        return dh, shared_bk, loss

    def _deferred_head_backward(self, shared_bk, stash, h, labels, b):
        # Explicit head backward; the output weight's block is accumulated now (fused op)
        # or its inputs are stashed for the drain, by Megatron's predicate.
        head = deferred.head_backward(self.stages, self.shared, h, labels)
        shared_bk = self.layout.shared.add_tree(shared_bk, head["dshared"],
                                                where=self.layout.added_by(SHARED, OUTPUT))
        bi, off = self.out_slot
        n_stash = max(self.par.num_deferred_microbatches, 1)

        def now(bk, st):
            bk = list(bk)
            bk[bi] = ops.wgrad_accumulate(head["x_full"], head["dy"], bk[bi], offset=off)
            return tuple(bk), st

        def later(bk, st):
            items = deferred.stash_items(self.par, head, labels)
            return bk, deferred.stash_put(st, jnp.clip(b, 0, n_stash - 1), items)

        if self.par.num_deferred_microbatches == self.m:
            shared_bk, stash = later(shared_bk, stash)
        else:
            shared_bk, stash = lax.cond(deferred.is_deferred(self.par, b), later, now,
                                        shared_bk, stash)
        return head["dx"], shared_bk, head["loss"], stash

    def _embed_backward(self, shared_bk, dx, ids):
        _, vjp = jax.vjp(lambda sh: self.stages.embed(sh, ids), self.shared)
        (dshared,) = vjp(dx)
        return self.layout.shared.add_tree(shared_bk, dshared,
                                           where=self.layout.added_by(SHARED, INPUT))

    # ------------------------------------------------------------------------ after

    def drain(self, carry: PipelineCarry) -> tuple[jax.Array, ...]:
        """The deferred output-layer wgrad drain, GEMMs on the last stage only (the ring's
        permutes run everywhere, see :func:`deferred.drain`), BEFORE the shared buckets
        are reduced over ``data`` and between the tied first/last stage copies."""
        if not self.defer:
            return carry.buckets
        with jax.named_scope("deferred_wgrad_drain"):
            stage_bk, shared_bk = self.layout.split(carry.buckets)
            bi, off = self.out_slot
            shared_bk = list(shared_bk)
            shared_bk[bi] = deferred.drain(self.par, carry.stash, shared_bk[bi], off,
                                           self.stages.output_weight(self.shared),
                                           active=self.is_last)
            return stage_bk + tuple(shared_bk)
