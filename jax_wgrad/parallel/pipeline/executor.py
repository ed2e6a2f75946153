"""Runs a pipeline schedule table as ONE ``lax.scan`` over ticks inside ``shard_map``.

The executor reads the :class:`~jax_wgrad.parallel.pipeline.schedules.ScheduleTable` (as
arrays indexed by the scan's tick and this device's stage) and knows no schedule formula:
per tick a stage runs the ``F``, ``B`` and ``W`` task the table names for it (``lax.cond``
skips an idle one), optionally syncs its gradient buckets in the cooldown, and exchanges
activations and gradients with its neighbours (two acyclic ``ppermute``\\ s) into
per-microbatch inbox slots.

* **F** of microbatch ``f``: the stage input (the embedding of its tokens on the first
  stage, else the activation received for ``f``) goes through the stage's layers under
  ``jax.vjp``; the pullback's residuals are stored at slot ``f % num_slots``
  (:class:`~jax_wgrad.parallel.pipeline.residuals.ResidualStore`: what
  ``recompute_granularity`` keeps, never a weight or a bucket). On the last stage the
  head runs too: loss, and the head's backward, whose gradient for the layers' output is
  kept in the gradient inbox for this stage's own ``B``.
* **B** of microbatch ``b``: the stored pullback, seeded with the gradient received for
  ``b``. The stage function is ``f((params, buckets), x) -> (y, buckets)``: the buckets
  thread through every fused linear (:func:`jax_wgrad.functional.linear_into_bucket`), so
  the pullback returns them with each fused weight's block added once, in place; every
  other gradient is added to its block by :meth:`~jax_wgrad.grads.GradBuffer.add_tree`
  (in-place ``bucket_add``), for the leaves the layout's specs name. The stage's own
  buckets are its stage chunk and its expert chunk (the expert weights of its MoE layers).
  With a split backward
  (zero bubble) the fused linears instead add a probe to their outputs
  (:class:`~jax_wgrad.functional.WgradSplit`): ``B`` computes input gradients and each
  linear's output gradient only, storing ``(x, dy)`` pairs in the W stash. The expert
  linears of MoE layers keep their grouped weight-gradient call in ``B`` (their buckets
  thread through ``B``; they get no ``W`` task).
* **W** of microbatch ``w`` (split backward only): the fused ``wgrad_accumulate`` GEMMs of
  its stored pairs into the stage's buckets (and, on the last stage, the output layer's).
* **Cooldown sync** (``overlap_grad_reduce``): at the stage's last ``B``/``W`` tick (from
  the table) its stage buckets are synced over the data-parallel ranks, and its expert
  buckets over the expert-data-parallel ranks, while earlier stages still compute.

Carried state per device (:class:`PipelineCarry`) is bounded by the table, not by ``M``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad import ops
from jax_wgrad.functional.linear import WgradBuckets, WgradSplit
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import sync_stage_buckets
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.grads.spec import EXPERTS, INPUT, LAYERS, SHARED, STAGE
from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline import head
from jax_wgrad.parallel.pipeline.residuals import ResidualStore
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable
from jax_wgrad.parallel.pipeline.setup import StageSetup

__all__ = ["PipelineCarry", "cooldown_sync", "stage_gradients"]


class PipelineCarry(NamedTuple):
    """Per-device state carried across ticks (bounded by the schedule, not by ``M``)."""

    buckets: tuple[jax.Array, ...]
    """Flat fp32 gradient buckets (:class:`~jax_wgrad.grads.GradLayout`): the accumulators."""
    residuals: tuple[jax.Array, ...]
    """``[num_slots, ...]`` per stored residual of the stage forward (the stage input alone
    with full recomputation)."""
    x_inbox: jax.Array
    """``[depth + 1, mb, s(/tp), H]`` activations received, by microbatch; the last slot
    takes what arrives in a tick where the sender ran no forward."""
    g_inbox: jax.Array
    """``[depth + 1, mb, s(/tp), H]`` gradients received (the last stage: its head's)."""
    loss_sum: jax.Array
    """fp32 scalar: sum of token losses computed on this device (last stage)."""
    stash: tuple[jax.Array, ...] = ()
    """Deferred output-layer wgrad stash, indexed by microbatch (last stage only)."""
    wstash: tuple[jax.Array, ...] = ()
    """Split backward: per fused linear ``[weight_slots, ...]`` inputs then output
    gradients, then the output layer's pair (:class:`head.OutputStash`)."""
    moe_stats: tuple[jax.Array, ...] = ()
    """MoE models: this device's sums over its forwards of the stage's MoE statistics
    (:meth:`GPTStages.moe_stats_zeros`: aux loss, tokens per expert, dropped count)."""


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
        the schedule, after the stage's last backward or weight task.
      table: the schedule; its stages and microbatches must match ``stages.parallel``.
      params: this device's parameters as the device tree ``(layers, experts, shared)``.
      tokens: int ``[global_batch / dp, S + 1]`` this data rank's sequences.
    Returns:
      ``(buckets, loss_sum, moe_stats)``: this device's buckets of token-loss-SUM
      gradients (stage chunk already synced when overlapping; nothing else reduced), its
      sum of token losses, and its MoE statistics' sums (``()`` for a dense model).
      :func:`jax_wgrad.grads.finalize_grads` does the rest.
    """
    run = _StageRun(stages, layout, ddp, table, params, tokens)
    carry, _ = lax.scan(run.tick, run.init_carry(), run.tick_inputs())
    return run.drain(carry), carry.loss_sum, carry.moe_stats


class _StageRun:
    """One device's run of a schedule: static context plus the tick's named steps."""

    def __init__(self, stages, layout: GradLayout, ddp: DDPConfig, table: ScheduleTable,
                 params, tokens: jax.Array):
        par, cfg, setup = stages.parallel, stages.model, StageSetup.of(stages)
        self.stages, self.layout, self.ddp, self.table, self.par = stages, layout, ddp, table, par
        self.pp, self.m = setup.num_stages, setup.num_microbatches
        if (table.num_stages, table.num_microbatches) != (self.pp, self.m):
            raise ValueError(f"stage_gradients: schedule {table.name!r} is for "
                             f"{table.num_stages} stages x {table.num_microbatches} "
                             f"microbatches, the layout has {self.pp} x {self.m}")
        if table.split_backward and not par.gradient_accumulation_fusion:
            raise ValueError(f"stage_gradients: schedule {table.name!r} splits the backward, "
                             "which needs gradient accumulation fusion")
        self.micro = setup.microbatches(tokens, "stage_gradients")
        self.act = setup.zero_activation()
        layers, experts, self.shared = params
        self.layer_params = (layers, experts)
        self.stage = setup.stage_index()
        self.is_first, self.is_last = self.stage == 0, self.stage == self.pp - 1
        self.fusion, self.split = par.gradient_accumulation_fusion, table.split_backward
        self.moe = cfg.num_moe_experts is not None
        self.overlap = cooldown_sync(ddp, self.pp)
        self.depth = (table.inbox_depth("F"), table.inbox_depth("B"))
        self.last_tick = jnp.asarray([table.last_grad_tick(s) for s in range(self.pp)])
        self.head = head.LastStage(stages, layout, table, self.act, setup.seq_length)
        own_bk, _ = layout.split_own(layout.buffer.zeros())
        if self.split:
            self.wlist = _fused_list(layout)
            # The probes are zeros and live like the weights: never stored.
            self.store = ResidualStore.create(
                self._split_fn, par.recompute_granularity,
                (self.layer_params, self._zero_probes(), own_bk[layout.num_stage_buckets:]),
                self.act, has_aux=True)
        else:
            self.store = ResidualStore.create(self._layers_fn, par.recompute_granularity,
                                              (self.layer_params, own_bk), self.act,
                                              has_aux=self.moe)

    # ------------------------------------------------------------------------ the scan

    def init_carry(self) -> PipelineCarry:
        inbox = lambda d: jnp.zeros((d + 1, *self.act.shape), self.act.dtype)
        wstash = ()
        if self.split:
            k = self.table.weight_slots
            xs, ys = self._linear_shapes()
            wstash = tuple(jnp.zeros((k, *s.shape), s.dtype) for s in xs + ys)
        return PipelineCarry(
            buckets=self.layout.buffer.zeros(),
            residuals=self.store.buffers(self.table.num_slots),
            x_inbox=inbox(self.depth[0]), g_inbox=inbox(self.depth[1]),
            loss_sum=jnp.float32(0.0), stash=self.head.init_stash(),
            wstash=wstash + self.head.init_output_stash(),
            moe_stats=tuple(self.stages.moe_stats_zeros()) if self.moe else ())

    def tick_inputs(self):
        """The scan's xs: per tick, its index and the table rows (``int32 [P]`` each)."""
        t = self.table
        return (jnp.arange(t.num_ticks), jnp.asarray(t.forward), jnp.asarray(t.backward),
                jnp.asarray(t.weight))

    def tick(self, c: PipelineCarry, xs) -> tuple[PipelineCarry, None]:
        t, fwd_row, bwd_row, w_row = xs
        f, b, w = fwd_row[self.stage], bwd_row[self.stage], w_row[self.stage]
        with jax.named_scope("forward"):
            c, y = lax.cond(f >= 0, self.forward, lambda c, f: (c, self.act), c, f)
        with jax.named_scope("backward"):
            c, dx = lax.cond(b >= 0, self.backward, lambda c, b: (c, self.act), c, b)
        if self.split:
            with jax.named_scope("weight_gradients"):
                c = lax.cond(w >= 0, self.weight, lambda c, w: c, c, w)
        if self.overlap:
            c = c._replace(buckets=self.cooldown(c.buckets, t))
        return self.exchange(c, y, dx, fwd_row, bwd_row), None

    def exchange(self, c: PipelineCarry, y, dx, fwd_row, bwd_row) -> PipelineCarry:
        """Activations go ``s -> s+1``, gradients ``s+1 -> s`` (acyclic permutes); each is
        kept at its microbatch's inbox slot until the task that consumes it runs."""
        if self.pp == 1:
            return c
        with jax.named_scope("send_recv"):
            x_recv = lax.ppermute(y, PIPELINE, [(i, i + 1) for i in range(self.pp - 1)])
            g_recv = lax.ppermute(dx, PIPELINE, [(i + 1, i) for i in range(self.pp - 1)])
        prev = fwd_row[jnp.maximum(self.stage - 1, 0)]
        nxt = bwd_row[jnp.minimum(self.stage + 1, self.pp - 1)]
        x_slot = _inbox_slot(prev, self.depth[0], self.is_first)
        g_slot = _inbox_slot(nxt, self.depth[1], self.is_last)
        return c._replace(x_inbox=lax.dynamic_update_index_in_dim(c.x_inbox, x_recv, x_slot, 0),
                          g_inbox=lax.dynamic_update_index_in_dim(c.g_inbox, g_recv, g_slot, 0))

    def cooldown(self, buckets, t):
        """This stage's last gradient task is done: sync its buckets now (in the loop)."""
        with jax.named_scope("grad_sync_in_cooldown"):
            stage_bk, expert_bk, shared_bk = self.layout.split(buckets)

            def sync(bks):
                return (sync_stage_buckets(bks[0], self.ddp, STAGE),
                        sync_stage_buckets(bks[1], self.ddp, EXPERTS))

            stage_bk, expert_bk = lax.cond(t == self.last_tick[self.stage], sync,
                                           lambda bks: bks, (stage_bk, expert_bk))
            return stage_bk + expert_bk + shared_bk

    # ------------------------------------------------------------------------ tasks

    def _tokens(self, i):
        return lax.dynamic_index_in_dim(self.micro, jnp.clip(i, 0, self.m - 1), 0,
                                        keepdims=False)

    def forward(self, c: PipelineCarry, f):
        tok = self._tokens(f)
        received = lax.dynamic_index_in_dim(c.x_inbox, f % self.depth[0], 0, keepdims=False)
        x_in = lax.cond(self.is_first, lambda: self.stages.embed(self.shared, tok[:, :-1]),
                        lambda: received)
        slot = f % self.table.num_slots
        own_bk, shared_bk = self.layout.split_own(c.buckets)
        wstash = c.wstash
        if self.split:
            ebk = own_bk[self.layout.num_stage_buckets:]
            (y, _), (xs, stats), residuals = self.store.forward(
                c.residuals, slot, (self.layer_params, self._zero_probes(), ebk), x_in)
            n = len(self.wlist)
            wstash = _put(wstash[:n], xs, f % self.table.weight_slots) + wstash[n:]
        elif self.moe:
            (y, _), stats, residuals = self.store.forward(c.residuals, slot,
                                                          (self.layer_params, own_bk), x_in)
        else:
            (y, _), residuals = self.store.forward(c.residuals, slot,
                                                   (self.layer_params, own_bk), x_in)
        if self.moe:  # this forward's MoE statistics join the step's sums
            c = c._replace(moe_stats=tuple(a + b for a, b in zip(c.moe_stats, stats)))
        # The last stage: loss and the head's backward now; its gradient for the layers'
        # output waits in the gradient inbox for this stage's B.
        shared_bk, g_inbox, loss, stash, wstash = lax.cond(
            self.is_last, self.head.run, self.head.skip, self.shared, shared_bk, c.g_inbox,
            c.stash, wstash, y, tok[:, 1:], f)
        c = c._replace(buckets=own_bk + shared_bk, residuals=residuals, g_inbox=g_inbox,
                       loss_sum=c.loss_sum + loss, stash=stash, wstash=wstash)
        return c, y

    def backward(self, c: PipelineCarry, b):
        ids = self._tokens(b)[:, :-1]
        dy = lax.dynamic_index_in_dim(c.g_inbox, b % self.depth[1], 0, keepdims=False)
        slot = b % self.table.num_slots
        own_bk, shared_bk = self.layout.split_own(c.buckets)
        wstash = c.wstash
        if self.split:
            ns = self.layout.num_stage_buckets
            pullback = self.store.pullback(c.residuals, slot,
                                           (self.layer_params, self._zero_probes(), own_bk[ns:]))
            (dp, dys, ebk), dx = pullback((dy, own_bk[ns:]))
            own_bk = own_bk[:ns] + tuple(ebk)
            n = len(self.wlist)
            wstash = wstash[:n] + _put(wstash[n:2 * n], dys, b % self.table.weight_slots) \
                + wstash[2 * n:]
        else:
            pullback = self.store.pullback(c.residuals, slot, (self.layer_params, own_bk))
            (dp, own_bk), dx = pullback((dy, own_bk))
        own_bk = self._add_own(own_bk, dp)
        shared_bk = lax.cond(self.is_first, lambda a: self._embed_backward(a, dx, ids),
                             lambda a: a, shared_bk)
        return c._replace(buckets=own_bk + shared_bk, wstash=wstash), dx

    def _add_own(self, own_bk, dp):
        """Adds the layers' ordinary gradients ``dp = (layers, experts)`` to the stage and
        expert chunks (the leaves their specs say the backward adds)."""
        n, lay = self.layout.num_stage_buckets, self.layout
        stage_bk = lay.stage.add_tree(own_bk[:n], dp[0], where=lay.added_by(STAGE, LAYERS))
        expert_bk = own_bk[n:]
        if lay.experts.num_buckets:
            expert_bk = lay.experts.add_tree(expert_bk, dp[1],
                                             where=lay.added_by(EXPERTS, LAYERS))
        return stage_bk + expert_bk

    def weight(self, c: PipelineCarry, w):
        """The fused weight-gradient GEMMs of microbatch ``w``'s stored ``(x, dy)`` pairs."""
        slot, n = w % self.table.weight_slots, len(self.wlist)
        own_bk, shared_bk = self.layout.split_own(c.buckets)
        stage_bk = list(own_bk)
        for k, (bi, off) in enumerate(self.wlist):
            x = lax.dynamic_index_in_dim(c.wstash[k], slot, 0, keepdims=False)
            dy = lax.dynamic_index_in_dim(c.wstash[n + k], slot, 0, keepdims=False)
            stage_bk[bi] = ops.wgrad_accumulate(x, dy, stage_bk[bi], offset=off)
        shared_bk = lax.cond(self.is_last, self.head.weight, lambda bk, st, w: bk, shared_bk,
                             c.wstash[2 * n:], w)
        return c._replace(buckets=tuple(stage_bk) + shared_bk)

    def _embed_backward(self, shared_bk, dx, ids):
        _, vjp = jax.vjp(lambda sh: self.stages.embed(sh, ids), self.shared)
        (dshared,) = vjp(dx)
        return self.layout.shared.add_tree(shared_bk, dshared,
                                           where=self.layout.added_by(SHARED, INPUT))

    # ------------------------------------------------------------------------ stage functions

    def _layers_fn(self, live, x):
        # ((params, buckets), x) -> (y, buckets): the buckets thread through the fused linears.
        lp, bks = live
        wb = WgradBuckets(bks)
        mg = None
        if self.fusion:
            trees = tuple(jax.tree.map(lambda s: wb.slot(*s), t,
                                       is_leaf=lambda s: isinstance(s, tuple))
                          for t in self.layout.own_fused_slots(LAYERS))
            mg = self.stages.layer_main_grads(trees)
        if self.moe:  # the MoE statistics are the forward's auxiliary output
            y, stats = self.stages.layers(lp, mg, x, with_stats=True)
            return (y, wb.buckets), tuple(stats)
        return self.stages.layers(lp, mg, x), wb.buckets

    def _split_fn(self, live, x):
        # ((params, probes, expert buckets), x) -> ((y, expert buckets), aux = (inputs of
        # the fused linears, MoE statistics)): zero bubble's B.
        lp, probes, ebk = live
        wb = WgradBuckets(ebk)
        out, ws = self._split_layers(lp, x, probes, wb)
        y, stats = out if self.moe else (out, ())
        return (y, wb.buckets), (list(ws.inputs), tuple(stats))

    def _split_layers(self, lp, x, probes, wb: WgradBuckets | None = None):
        ws = WgradSplit(probes)
        slots = self.layout.fused_slots(STAGE, LAYERS)
        leaves, treedef = jax.tree.flatten(slots, is_leaf=lambda s: isinstance(s, tuple))
        numbered = iter(range(len(self.wlist)))
        trees = jax.tree.unflatten(treedef, [None if s is None else ws.slot(next(numbered))
                                             for s in leaves])
        # Expert linears: their grouped fused call into the threaded expert buckets.
        experts = jax.tree.map(lambda s: None if wb is None else wb.slot(*s),
                               self.layout.fused_slots(EXPERTS, LAYERS),
                               is_leaf=lambda s: isinstance(s, tuple))
        mg = self.stages.layer_main_grads((trees, experts))
        return self.stages.layers(lp, mg, x, with_stats=self.moe), ws

    def _linear_shapes(self):
        """Shapes of the fused linears' inputs and outputs (the W stash's pairs), traced
        once without probes."""
        if not hasattr(self, "_shapes"):
            def trace(lp, x):
                _, ws = self._split_layers(lp, x, [None] * len(self.wlist))
                return list(ws.inputs), list(ws.outputs)
            self._shapes = jax.eval_shape(trace, self.layer_params, self.act)
        return self._shapes

    def _zero_probes(self):
        return [jnp.zeros(s.shape, s.dtype) for s in self._linear_shapes()[1]]

    # ------------------------------------------------------------------------ after

    def drain(self, carry: PipelineCarry) -> tuple[jax.Array, ...]:
        """The deferred output-layer wgrad drain (:func:`head.LastStage.drain`), before the
        shared buckets are reduced over ``data`` and between the tied stage copies."""
        own_bk, shared_bk = self.layout.split_own(carry.buckets)
        return own_bk + self.head.drain(shared_bk, carry.stash, self.shared, self.is_last)


def _inbox_slot(microbatch, depth: int, no_sender):
    # Nothing sent (idle sender, or no neighbour): the spare slot `depth`, never read.
    return jnp.where((microbatch < 0) | no_sender, depth, microbatch % depth)


def _put(buffers, values, slot) -> tuple[jax.Array, ...]:
    return tuple(lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), slot, 0)
                 for b, v in zip(buffers, values))


def _fused_list(layout: GradLayout) -> list[tuple[int, int]]:
    """``(bucket, offset)`` of the stage's fused weights, in the slot tree's flatten order
    (the numbering of :class:`WgradSplit`'s linears)."""
    slots = layout.fused_slots(STAGE, LAYERS)
    return [s for s in jax.tree.leaves(slots, is_leaf=lambda s: isinstance(s, tuple))
            if s is not None]
