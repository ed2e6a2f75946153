"""Runs a pipeline schedule table as ONE ``lax.scan`` over ticks inside ``shard_map``.

The executor reads the :class:`~jax_wgrad.parallel.pipeline.schedules.ScheduleTable` (as
arrays indexed by the scan's tick and this device's stage) and knows no schedule formula
and no model: it runs a :class:`~jax_wgrad.parallel.pipeline.program.StageProgram`
(``pre`` on the first stage, ``body`` everywhere, ``post`` on the last) and asks a
:class:`~jax_wgrad.grads.sink.GradSink` where every weight gradient goes. Per tick a
stage runs the ``F``, ``B`` and ``W`` task the table names for it (``lax.cond`` skips an
idle one), optionally syncs its gradient buckets in the cooldown, and exchanges
activations and gradients with its neighbours (:mod:`.transfer`).

* **F** of microbatch ``f``: the stage input (``pre`` of its batch on the first stage,
  else the activation received for ``f``) goes through ``body`` under ``jax.vjp``; the
  pullback's residuals are stored at its slot of the table's ``slot_map``
  (:class:`~jax_wgrad.parallel.pipeline.residuals.ResidualStore`: what
  ``recompute_granularity`` keeps, never a weight or a bucket). On the last stage ``post``
  runs too, with its backward (Megatron's last stage computes the loss in its forward
  step): the loss, and the gradient for the body's output, kept in the gradient inbox for
  this stage's own ``B``.
* **B** of microbatch ``b``: the stored pullback, seeded with the gradient received for
  ``b``. The differentiated function is ``f((params, grads, probes), x) -> (y, grads)``:
  the gradient buckets thread through every fused linear whose sink policy is
  ``accumulate`` (:func:`jax_wgrad.functional.linear_into_bucket`), so the pullback returns
  them with each such weight's block added once, in place; every other gradient is added
  to its block by the sink (in-place ``bucket_add``). With a split backward (zero bubble)
  the stage's fused linears instead add a probe to their outputs: ``B`` computes input
  gradients and each linear's output gradient only, and the ``(x, dy)`` pairs wait in the
  W stash (expert linears keep their grouped call in ``B``; see :mod:`jax_wgrad.grads.sink`).
  On the first stage ``pre``'s backward adds its gradients.
* **W** of microbatch ``w`` (split backward only): the fused ``wgrad_accumulate`` GEMMs of
  its stored pairs (on the last stage the output layer's too, unless deferred).
* **Deferred output-layer wgrad**: a deferred microbatch's output-layer pair is stashed,
  drained after the schedule (:func:`jax_wgrad.parallel.deferred.drain`).
* **Cooldown sync** (``overlap_grad_reduce``): at the stage's last ``B``/``W`` tick (from
  the table) its stage buckets are synced over the data-parallel ranks, and its expert
  buckets over the expert-data-parallel ranks, while earlier stages still compute.

**Interleaved** (``table.num_chunks = V > 1``): a task runs on the model chunk the table
names: ``body`` gets its :class:`~jax_wgrad.grads.chunks.Window` of the stacked layers and
the sink writes its blocks; ``pre``/``post`` run on the first/last virtual stage; the ring
edge is in :mod:`.transfer`. Slots: the table's ``slot_map`` (Megatron's in-flight bound).

The carried state (:class:`~.carry.PipelineCarry`) is bounded by the table, not by ``M``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import DeviceTree, GradState, Window
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import sync_stage_buckets
from jax_wgrad.grads.sink import GradSink, SinkEntry
from jax_wgrad.grads.spec import EXPERTS, INPUT, LAYERS, OUTPUT, STAGE
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.pipeline.carry import PipelineCarry, WPair, put, zeros_of
from jax_wgrad.parallel.pipeline.ends import EndsMixin
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.pipeline.residuals import ResidualStore
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable
from jax_wgrad.parallel.pipeline.transfer import exchange, inbox_index

__all__ = ["cooldown_sync", "initial_carry", "stage_gradients"]


def cooldown_sync(ddp: DDPConfig, num_stages: int) -> bool:
    """Whether stage buckets are synced inside the schedule (``overlap_grad_reduce``):
    only with ``P > 1`` (with one stage the last backward IS the last tick; inside, XLA:CPU
    ran the stage and embedding/head all-reduces concurrently and crashed, notes/issue5.md)."""
    return ddp.overlap_grad_reduce and num_stages > 1


def stage_gradients(
    program: StageProgram,
    sink: GradSink,
    ddp: DDPConfig,
    table: ScheduleTable,
    params: DeviceTree,
    batch: jax.Array,
) -> tuple[tuple[jax.Array, ...], jax.Array, Any]:
    """Per-device body of the schedule (call inside ``shard_map`` over the mesh).

    Args:
      program: the model's stage programs.
      sink: where this device's gradients go (its layout and policies).
      ddp: with ``overlap_grad_reduce`` the stage's buckets are synced over ``data`` inside
        the schedule, after the stage's last backward or weight task.
      table: the schedule; its stages, microbatches and model chunks must match
        ``program.setup`` and ``program.parallel``.
      params: this device's parameters (the device tree).
      batch: ``[M * mb, ...]`` this data rank's batch (``program.setup.batch_shape``).
    Returns:
      ``(buckets, loss_sum, aux_sum)``: this device's buckets (``sink.layout.buffer``'s) of
      token-loss-SUM gradients (stage chunk already synced when overlapping; nothing else
      reduced), its sum of token losses, and its sums of ``body``'s aux.
      :func:`jax_wgrad.grads.finalize_grads` does the rest.
    """
    run = _StageRun(program, sink, ddp, table, params, batch)
    carry, _ = lax.scan(run.tick, run.init_carry(), run.tick_inputs())
    grads = run.drain(carry)
    return sink.layout.concatenated(grads), carry.loss_sum, carry.aux_sum


def initial_carry(
    program: StageProgram,
    sink: GradSink,
    ddp: DDPConfig,
    table: ScheduleTable,
    params: DeviceTree,
    batch: jax.Array,
) -> PipelineCarry:
    """The carry :func:`stage_gradients` starts from (inside ``shard_map``)."""
    return _StageRun(program, sink, ddp, table, params, batch).init_carry()


class _StageRun(EndsMixin):
    """One device's run of a schedule: static context plus the tick's named steps (the
    pipeline's ends: :class:`~.ends.EndsMixin`)."""

    def __init__(
        self,
        program: StageProgram,
        sink: GradSink,
        ddp: DDPConfig,
        table: ScheduleTable,
        params: DeviceTree,
        batch: jax.Array,
    ):
        setup, par = program.setup, program.parallel
        self.program, self.sink, self.ddp, self.table, self.par = program, sink, ddp, table, par
        self.pp, self.m = setup.num_stages, setup.num_microbatches
        shape = (self.pp, self.m, par.num_model_chunks)
        if (table.num_stages, table.num_microbatches, table.num_chunks) != shape:
            raise ValueError(
                f"stage_gradients: schedule {table.name!r} is for "
                f"{table.num_stages} stages x {table.num_microbatches} "
                f"microbatches x {table.num_chunks} model chunks, the program "
                f"has {' x '.join(map(str, shape))}"
            )
        if table.split_backward and not sink.layout.fusion:
            raise ValueError(
                f"stage_gradients: schedule {table.name!r} splits the backward, "
                "which needs gradient accumulation fusion"
            )
        self.micro = setup.microbatches(batch, "stage_gradients")
        self.act = setup.zero_activation()
        self.params = params
        self.stage = setup.stage_index()
        self.is_first, self.is_last = self.stage == 0, self.stage == self.pp - 1
        self.split = table.split_backward
        self.spread = program.ends_over_pipeline
        self.overlap = cooldown_sync(ddp, self.pp)
        self.v = table.num_chunks
        self.depth = (table.inbox_depth("F"), table.inbox_depth("B"))
        self.last_tick = jnp.asarray([table.last_grad_tick(s) for s in range(self.pp)])
        self.res_slot = jnp.asarray(table.slot_map("F", "B"))
        self.w_slot = jnp.asarray(table.slot_map("F", "W")) if self.split else None
        self.fused = sink.layout.fusion
        zeros = sink.layout.zeros() if self.fused else None
        # Probed linears' inputs/outputs and aux: shapes learned by tracing, once.
        chunk0 = (params, zeros)
        self.body_trace = jax.eval_shape(self._body_fn, (*chunk0, None, jnp.int32(0)), self.act)[1]
        self.post_trace = jax.eval_shape(
            self._post_fn, params, zeros, None, self.act, self.micro[0]
        )[1]
        self.body_probes = zeros_of(self.body_trace[1])
        self.post_probes = zeros_of(self.post_trace[1])
        self.store = ResidualStore.create(
            self._body_fn, (*chunk0, self.body_probes, jnp.int32(0)), self.act, has_aux=True
        )
        self.defer = sink.deferred
        self.out_slots = table.live_count(self.pp - 1, "F", "W", self.v - 1) if self.split else 0

    # ------------------------------------------------------------------------ programs

    def _window(self, v) -> Window | None:
        return Window(v, self.v) if self.v > 1 else None

    def _body_fn(self, live, x):
        # ((params, grads, probes, chunk), x) -> ((y, grads), (recorded inputs, outputs,
        # aux)) of model chunk `chunk`'s layers; probes None: records only (traced once for
        # the shapes).
        params, grads, probes, v = live
        tape = self.sink.open(LAYERS, grads, probes)
        y, aux = self.program.body(params, tape.main_grads, x, layers=self._window(v))
        grads, inputs, outputs = tape.close()
        return (y, grads), (inputs, outputs, aux)

    def _post_fn(self, params, grads, probes, y, batch):
        # -> ((loss, grads), (recorded inputs, outputs, aux))
        tape = self.sink.open(OUTPUT, grads, probes)
        loss, aux = self.program.post(params, tape.main_grads, y, batch)
        grads, inputs, outputs = tape.close()
        return (loss, grads), (inputs, outputs, aux)

    def _pre_fn(self, params, grads, batch):
        tape = self.sink.open(INPUT, grads)
        x, _ = self.program.pre(params, tape.main_grads, batch)
        grads, _, _ = tape.close()
        return x, grads

    # ------------------------------------------------------------------------ the scan

    def init_carry(self) -> PipelineCarry:
        inbox = lambda d: jnp.zeros((self.v * d + 1, *self.act.shape), self.act.dtype)
        body_in, body_out, body_aux = self.body_trace
        post_in, post_out, post_aux = self.post_trace
        wstash = {}
        if self.split:
            k = self.table.weight_slots
            for name in body_in:
                wstash[name] = WPair(
                    *(jnp.zeros((k, *s.shape), s.dtype) for s in (body_in[name], body_out[name]))
                )
            for e in self.sink.probed(OUTPUT):
                wstash[e.name] = WPair(
                    *(
                        jnp.zeros((self.out_slots, *s.shape), s.dtype)
                        for s in (post_in[e.name], post_out[e.name])
                    )
                )
        stash = {}
        if self.defer is not None:
            shapes = jax.eval_shape(
                self._defer_items,
                post_in[self.defer.name],
                post_out[self.defer.name],
                post_aux,
                self.micro[0],
            )
            md = self.sink.num_deferred
            stash[self.defer.name] = tuple(jnp.zeros((md, *s.shape), s.dtype) for s in shapes)
        return PipelineCarry(
            grads=self.sink.layout.zeros(),
            residuals=self.store.buffers(self.table.num_slots),
            x_inbox=inbox(self.depth[0]),
            g_inbox=inbox(self.depth[1]),
            loss_sum=jnp.float32(0.0),
            aux_sum=zeros_of(body_aux),
            wstash=wstash,
            deferred=stash,
        )

    def tick_inputs(self):
        """The scan's xs: per tick, its index and the table rows (``int32 [P]`` each):
        the microbatch and the model chunk of each task."""
        t = self.table
        return (
            jnp.arange(t.num_ticks),
            *(
                jnp.asarray(a)
                for a in (
                    t.forward,
                    t.backward,
                    t.weight,
                    t.forward_chunk,
                    t.backward_chunk,
                    t.weight_chunk,
                )
            ),
        )

    def tick(self, c: PipelineCarry, xs) -> tuple[PipelineCarry, None]:
        t, fwd_row, bwd_row, w_row, fc_row, bc_row, wc_row = xs
        f, b, w = fwd_row[self.stage], bwd_row[self.stage], w_row[self.stage]
        fc, bc, wc = fc_row[self.stage], bc_row[self.stage], wc_row[self.stage]
        fwd, bwd = (fwd_row, fc_row), (bwd_row, bc_row)
        ends = self.end_rows(fwd, bwd) if self.spread else None
        x_pre = self.spread_pre(ends[0]) if self.spread else self.act
        with jax.named_scope("forward"):
            c, y = lax.cond(f >= 0, self.forward, lambda c, f, v, x: (c, self.act), c, f, fc, x_pre)
        if self.spread:
            c = self.spread_post(c, ends[1], y)
        with jax.named_scope("backward"):
            c, dx = lax.cond(b >= 0, self.backward, lambda c, b, v: (c, self.act), c, b, bc)
        if self.spread:
            c = self.spread_pre_backward(c, ends[2], dx)
        if self.split:
            with jax.named_scope("weight_gradients"):
                c = lax.cond(w >= 0, self.weight, lambda c, w, v: c, c, w, wc)
        if self.overlap:
            c = c.replace(grads=self.cooldown(c.grads, t))
        return self.exchange(c, y, dx, fwd, bwd), None

    def _inbox(self, kind: int, v, m):
        """Slot of (chunk ``v``, microbatch ``m``) in inbox ``kind`` (0: x, 1: g)."""
        return inbox_index(self.depth[kind], v, m)

    def exchange(self, c: PipelineCarry, y, dx, fwd, bwd) -> PipelineCarry:
        """Sends and receives of the tick (:func:`~.transfer.exchange`)."""
        if self.pp == 1:
            return c
        x_inbox, g_inbox = exchange(
            (c.x_inbox, c.g_inbox),
            y,
            dx,
            fwd,
            bwd,
            stage=self.stage,
            num_stages=self.pp,
            num_chunks=self.v,
            depth=self.depth,
        )
        return c.replace(x_inbox=x_inbox, g_inbox=g_inbox)

    def cooldown(self, grads: GradState, t) -> GradState:
        """This stage's last gradient task is done: sync its buckets now (in the loop)."""
        with jax.named_scope("grad_sync_in_cooldown"):

            def sync(own):
                return (
                    sync_stage_buckets(own[0], self.ddp, STAGE),
                    sync_stage_buckets(own[1], self.ddp, EXPERTS),
                )

            stage, experts = lax.cond(
                t == self.last_tick[self.stage], sync, lambda own: own, (grads.stage, grads.experts)
            )
            return grads.replace(stage=stage, experts=experts)

    # ------------------------------------------------------------------------ tasks

    def _batch(self, i):
        return lax.dynamic_index_in_dim(self.micro, jnp.clip(i, 0, self.m - 1), 0, False)

    def _live(self, c: PipelineCarry, v):
        """What the differentiated body reads that is not stored: the parameters, the
        threaded buckets, the probes, the model chunk."""
        return (self.params, self._threaded(c), self.body_probes, v)

    def forward(self, c: PipelineCarry, f, v, x_pre):
        batch = self._batch(f)
        received = lax.dynamic_index_in_dim(c.x_inbox, self._inbox(0, v, f), 0, keepdims=False)
        pre = (
            (lambda: x_pre) if self.spread else (lambda: self._pre_fn(self.params, None, batch)[0])
        )
        x_in = lax.cond(self.is_first & (v == 0), pre, lambda: received)
        (y, _), (inputs, _, aux), residuals = self.store.forward(
            c.residuals, self.res_slot[self.stage, v, f], self._live(c, v), x_in
        )
        wstash = dict(c.wstash)
        for name, x in inputs.items():
            wstash[name] = wstash[name]._replace(
                x=put(wstash[name].x, x, self.w_slot[self.stage, v, f])
            )
        c = c.replace(
            residuals=residuals, wstash=wstash, aux_sum=jax.tree.map(jnp.add, c.aux_sum, aux)
        )
        # The last virtual stage: loss and the head's backward now; its gradient for the
        # layers' output waits in the gradient inbox for this stage's B.
        if not self.spread:
            c = lax.cond(
                self.is_last & (v == self.v - 1),
                functools.partial(self._post, y=y, batch=batch, f=f),
                lambda c: c,
                c,
            )
        return c, y

    def backward(self, c: PipelineCarry, b, v):
        dy = lax.dynamic_index_in_dim(c.g_inbox, self._inbox(1, v, b), 0, keepdims=False)
        live = self._live(c, v)
        pullback = self.store.pullback(c.residuals, self.res_slot[self.stage, v, b], live)
        (dparams, grads, dys, _), dx = pullback((dy, live[1]))
        grads = self.sink.add(c.grads if grads is None else grads, LAYERS, dparams)
        wstash = dict(c.wstash)
        for name, d in dys.items():
            wstash[name] = wstash[name]._replace(
                dy=put(wstash[name].dy, d, self.w_slot[self.stage, v, b])
            )
        if not self.spread:
            grads = lax.cond(
                self.is_first & (v == 0),
                lambda g: self._pre_backward(g, dx, self._batch(b)),
                lambda g: g,
                grads,
            )
        return c.replace(grads=grads, wstash=wstash), dx

    def _threaded(self, c: PipelineCarry) -> GradState | None:
        return c.grads if self.fused else None  # what the fused linears thread

    def weight(self, c: PipelineCarry, w, v):
        """The fused weight-gradient GEMMs of microbatch ``w``'s stored ``(x, dy)`` pairs
        on chunk ``v``."""
        slot = self.w_slot[self.stage, v, w]
        grads = c.grads
        for e in self.sink.probed(LAYERS):
            grads = self._accumulate_pair(grads, e, c.wstash[e.name], slot, self._window(v))

        def output(grads):
            for e in self.sink.probed(OUTPUT):
                acc = functools.partial(
                    self._accumulate_pair, e=e, pair=c.wstash[e.name], slot=w % self.out_slots
                )
                if e.policy == "defer":  # a deferred microbatch is drained later
                    grads = lax.cond(deferred.is_deferred(self.par, w), lambda g: g, acc, grads)
                else:
                    grads = acc(grads)
            return grads

        if self.sink.probed(OUTPUT) and not self.spread:
            grads = lax.cond(self.is_last & (v == self.v - 1), output, lambda g: g, grads)
        return c.replace(grads=grads)

    def _accumulate_pair(self, grads, e: SinkEntry, pair: WPair, slot, window=None):
        x, dy = (lax.dynamic_index_in_dim(a, slot, 0, keepdims=False) for a in pair)
        return self.sink.accumulate(grads, e, x, dy, window)

    # ------------------------------------------------------------------------ after
