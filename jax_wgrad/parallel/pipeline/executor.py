"""Runs a pipeline schedule table as ONE ``lax.scan`` over ticks inside ``shard_map``.

The executor reads the :class:`~jax_wgrad.parallel.pipeline.schedules.ScheduleTable` (as
arrays indexed by the scan's tick and this device's stage) and knows no schedule formula
and no model: it runs a :class:`~jax_wgrad.parallel.pipeline.program.StageProgram`
(``pre`` on the first stage, ``body`` everywhere, ``post`` on the last) and asks a
:class:`~jax_wgrad.grads.sink.GradSink` where every weight gradient goes. Per tick a
stage runs the ``F``, ``B`` and ``W`` task the table names for it (``lax.cond`` skips an
idle one), optionally syncs its gradient buckets in the cooldown, and exchanges
activations and gradients with its neighbours (two acyclic ``ppermute``\\ s) into
per-microbatch inbox slots.

* **F** of microbatch ``f``: the stage input (``pre`` of its batch on the first stage,
  else the activation received for ``f``) goes through ``body`` under ``jax.vjp``; the
  pullback's residuals are stored at slot ``f % num_slots``
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

The carried state (:class:`~.carry.PipelineCarry`) is bounded by the table, not by ``M``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import DeviceTree, GradState
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import sync_stage_buckets
from jax_wgrad.grads.sink import GradSink, SinkEntry
from jax_wgrad.grads.spec import EXPERTS, INPUT, LAYERS, OUTPUT, STAGE
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.mesh import PIPELINE, TENSOR
from jax_wgrad.parallel.pipeline.carry import PipelineCarry, WPair, inbox_slot, put, zeros_of
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.pipeline.residuals import ResidualStore
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable

__all__ = ["cooldown_sync", "initial_carry", "stage_gradients"]


def cooldown_sync(ddp: DDPConfig, num_stages: int) -> bool:
    """Whether stage buckets are synced inside the schedule (``overlap_grad_reduce``).

    Only with ``P > 1``: with one stage the last backward IS the last tick, so the sync
    happens at the same point after the schedule either way. (Doing it "inside" a
    one-stage schedule also let XLA:CPU run the stage and embedding/head all-reduces
    concurrently, which crashed its in-process communicator; see notes/issue5.md.)
    """
    return ddp.overlap_grad_reduce and num_stages > 1


def stage_gradients(program: StageProgram, sink: GradSink, ddp: DDPConfig,
                    table: ScheduleTable, params: DeviceTree, batch: jax.Array
                    ) -> tuple[tuple[jax.Array, ...], jax.Array, Any]:
    """Per-device body of the schedule (call inside ``shard_map`` over the mesh).

    Args:
      program: the model's stage programs.
      sink: where this device's gradients go (its layout and policies).
      ddp: with ``overlap_grad_reduce`` the stage's buckets are synced over ``data`` inside
        the schedule, after the stage's last backward or weight task.
      table: the schedule; its stages and microbatches must match ``program.setup``.
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


def initial_carry(program: StageProgram, sink: GradSink, ddp: DDPConfig, table: ScheduleTable,
                  params: DeviceTree, batch: jax.Array) -> PipelineCarry:
    """The carry :func:`stage_gradients` starts from (inside ``shard_map``)."""
    return _StageRun(program, sink, ddp, table, params, batch).init_carry()


class _StageRun:
    """One device's run of a schedule: static context plus the tick's named steps."""

    def __init__(self, program: StageProgram, sink: GradSink, ddp: DDPConfig,
                 table: ScheduleTable, params: DeviceTree, batch: jax.Array):
        setup, par = program.setup, program.parallel
        self.program, self.sink, self.ddp, self.table, self.par = program, sink, ddp, table, par
        self.pp, self.m = setup.num_stages, setup.num_microbatches
        if (table.num_stages, table.num_microbatches) != (self.pp, self.m):
            raise ValueError(f"stage_gradients: schedule {table.name!r} is for "
                             f"{table.num_stages} stages x {table.num_microbatches} "
                             f"microbatches, the program has {self.pp} x {self.m}")
        if table.split_backward and not sink.layout.fusion:
            raise ValueError(f"stage_gradients: schedule {table.name!r} splits the backward, "
                             "which needs gradient accumulation fusion")
        self.micro = setup.microbatches(batch, "stage_gradients")
        self.act = setup.zero_activation()
        self.params = params
        self.stage = setup.stage_index()
        self.is_first, self.is_last = self.stage == 0, self.stage == self.pp - 1
        self.split = table.split_backward
        self.overlap = cooldown_sync(ddp, self.pp)
        self.depth = (table.inbox_depth("F"), table.inbox_depth("B"))
        self.last_tick = jnp.asarray([table.last_grad_tick(s) for s in range(self.pp)])
        self.fused = sink.layout.fusion
        zeros = sink.layout.zeros() if self.fused else None
        # Probed linears' inputs/outputs and aux: shapes learned by tracing, once.
        self.body_trace = jax.eval_shape(self._body_fn, (params, zeros, None), self.act)[1]
        self.post_trace = jax.eval_shape(self._post_fn, params, zeros, None, self.act,
                                         self.micro[0])[1]
        self.body_probes = zeros_of(self.body_trace[1])
        self.post_probes = zeros_of(self.post_trace[1])
        self.store = ResidualStore.create(self._body_fn, par.recompute_granularity,
                                          (params, zeros, self.body_probes), self.act,
                                          has_aux=True)
        self.defer = sink.deferred
        self.out_slots = table.live_count(table.num_stages - 1, "F", "W") if self.split else 0

    # ------------------------------------------------------------------------ programs

    def _body_fn(self, live, x):
        # ((params, grads, probes), x) -> ((y, grads), (recorded inputs, outputs, aux));
        # probes None: records only (traced once for the shapes).
        params, grads, probes = live
        tape = self.sink.open(LAYERS, grads, probes)
        y, aux = self.program.body(params, tape.main_grads, x)
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
        inbox = lambda d: jnp.zeros((d + 1, *self.act.shape), self.act.dtype)
        body_in, body_out, body_aux = self.body_trace
        post_in, post_out, post_aux = self.post_trace
        wstash = {}
        if self.split:
            k = self.table.weight_slots
            for name in body_in:
                wstash[name] = WPair(*(jnp.zeros((k, *s.shape), s.dtype)
                                       for s in (body_in[name], body_out[name])))
            for e in self.sink.probed(OUTPUT):
                wstash[e.name] = WPair(*(jnp.zeros((self.out_slots, *s.shape), s.dtype)
                                         for s in (post_in[e.name], post_out[e.name])))
        stash = {}
        if self.defer is not None:
            shapes = jax.eval_shape(self._defer_items, post_in[self.defer.name],
                                    post_out[self.defer.name], post_aux, self.micro[0])
            md = self.sink.num_deferred
            stash[self.defer.name] = tuple(jnp.zeros((md, *s.shape), s.dtype) for s in shapes)
        return PipelineCarry(
            grads=self.sink.layout.zeros(),
            residuals=self.store.buffers(self.table.num_slots),
            x_inbox=inbox(self.depth[0]), g_inbox=inbox(self.depth[1]),
            loss_sum=jnp.float32(0.0), aux_sum=zeros_of(body_aux),
            wstash=wstash, deferred=stash)

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
            c = c.replace(grads=self.cooldown(c.grads, t))
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
        x_slot = inbox_slot(prev, self.depth[0], self.is_first)
        g_slot = inbox_slot(nxt, self.depth[1], self.is_last)
        return c.replace(x_inbox=lax.dynamic_update_index_in_dim(c.x_inbox, x_recv, x_slot, 0),
                         g_inbox=lax.dynamic_update_index_in_dim(c.g_inbox, g_recv, g_slot, 0))

    def cooldown(self, grads: GradState, t) -> GradState:
        """This stage's last gradient task is done: sync its buckets now (in the loop)."""
        with jax.named_scope("grad_sync_in_cooldown"):
            def sync(own):
                return (sync_stage_buckets(own[0], self.ddp, STAGE),
                        sync_stage_buckets(own[1], self.ddp, EXPERTS))

            stage, experts = lax.cond(t == self.last_tick[self.stage], sync, lambda own: own,
                                      (grads.stage, grads.experts))
            return grads.replace(stage=stage, experts=experts)

    # ------------------------------------------------------------------------ tasks

    def _batch(self, i):
        return lax.dynamic_index_in_dim(self.micro, jnp.clip(i, 0, self.m - 1), 0,
                                        keepdims=False)

    def forward(self, c: PipelineCarry, f):
        batch = self._batch(f)
        received = lax.dynamic_index_in_dim(c.x_inbox, f % self.depth[0], 0, keepdims=False)
        x_in = lax.cond(self.is_first, lambda: self._pre_fn(self.params, None, batch)[0],
                        lambda: received)
        slot = f % self.table.num_slots
        (y, _), (inputs, _, aux), residuals = self.store.forward(
            c.residuals, slot, (self.params, self._threaded(c), self.body_probes), x_in)
        wstash = dict(c.wstash)
        for name, x in inputs.items():
            wstash[name] = wstash[name]._replace(
                x=put(wstash[name].x, x, f % self.table.weight_slots))
        c = c.replace(residuals=residuals, wstash=wstash,
                      aux_sum=jax.tree.map(jnp.add, c.aux_sum, aux))
        # The last stage: loss and the head's backward now; its gradient for the layers'
        # output waits in the gradient inbox for this stage's B.
        c = lax.cond(self.is_last, functools.partial(self._post, y=y, batch=batch, f=f),
                     lambda c: c, c)
        return c, y

    def _post(self, c: PipelineCarry, *, y, batch, f) -> PipelineCarry:
        """``post`` and its backward for microbatch ``f`` (last stage)."""
        threaded = self._threaded(c)
        (loss, _), vjp, (inputs, _, aux) = jax.vjp(
            functools.partial(self._post_fn, batch=batch), self.params, threaded,
            self.post_probes, y, has_aux=True)
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dparams, grads, dys, dh = vjp((jnp.float32(1.0), threaded))
        grads = c.grads if grads is None else grads
        c = c.replace(grads=self.sink.add(grads, OUTPUT, dparams),
                      loss_sum=c.loss_sum + loss,
                      g_inbox=lax.dynamic_update_index_in_dim(
                          c.g_inbox, dh.astype(c.g_inbox.dtype), f % self.depth[1], 0))
        for e in self.sink.probed(OUTPUT):
            c = self._output_pair(c, e, inputs[e.name], dys[e.name], aux, batch, f)
        return c

    def _output_pair(self, c: PipelineCarry, e: SinkEntry, x, dy, aux, batch, f):
        """The output layer's ``(x, dy)`` of microbatch ``f``: deferred to the drain,
        kept for its ``W`` task, or accumulated now (Megatron's deferral predicate)."""
        def now(c):
            if self.split:
                pair = c.wstash[e.name]
                slot = f % self.out_slots
                pair = WPair(put(pair.x, x, slot), put(pair.dy, dy, slot))
                return c.replace(wstash={**c.wstash, e.name: pair})
            return c.replace(grads=self.sink.accumulate(c.grads, e, x, dy))

        def later(c):
            items = self._defer_items(x, dy, aux, batch)
            index = jnp.clip(f, 0, self.sink.num_deferred - 1)
            stash = deferred.stash_put(c.deferred[e.name], index, items)
            return c.replace(deferred={**c.deferred, e.name: stash})

        if e.policy != "defer":
            return now(c)
        if self.sink.num_deferred == self.m:
            return later(c)
        return lax.cond(deferred.is_deferred(self.par, f), later, now, c)

    def _defer_items(self, x, dy, aux, batch) -> tuple[jax.Array, ...]:
        """What the deferral stash keeps of one microbatch: the output layer's input, this
        rank's sequence chunk of it under sequence parallelism (the drain's ring brings
        the others), and ``dy`` (Megatron's stash) or the program's extras to rebuild it
        (recompute mode)."""
        if self.par.sequence_parallel and self.par.tensor_model_parallel_size > 1:
            chunk = x.shape[1] // self.par.tensor_model_parallel_size
            x = lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * chunk, chunk, axis=1)
        if self.par.defer_mode == "stash":
            return (x, dy)
        return (x, *self.program.defer_extras(aux, batch))

    def backward(self, c: PipelineCarry, b):
        dy = lax.dynamic_index_in_dim(c.g_inbox, b % self.depth[1], 0, keepdims=False)
        slot = b % self.table.num_slots
        threaded = self._threaded(c)
        pullback = self.store.pullback(c.residuals, slot, (self.params, threaded,
                                                           self.body_probes))
        (dparams, grads, dys), dx = pullback((dy, threaded))
        grads = self.sink.add(c.grads if grads is None else grads, LAYERS, dparams)
        wstash = dict(c.wstash)
        for name, d in dys.items():
            wstash[name] = wstash[name]._replace(
                dy=put(wstash[name].dy, d, b % self.table.weight_slots))
        grads = lax.cond(self.is_first,
                         lambda g: self._pre_backward(g, dx, self._batch(b)),
                         lambda g: g, grads)
        return c.replace(grads=grads, wstash=wstash), dx

    def _pre_backward(self, grads: GradState, dx, batch) -> GradState:
        threaded = grads if self.fused else None
        _, vjp = jax.vjp(functools.partial(self._pre_fn, batch=batch), self.params, threaded)
        dparams, out = vjp((dx, threaded))
        return self.sink.add(grads if out is None else out, INPUT, dparams)

    def _threaded(self, c: PipelineCarry) -> GradState | None:
        return c.grads if self.fused else None  # what the fused linears thread

    def weight(self, c: PipelineCarry, w):
        """The fused weight-gradient GEMMs of microbatch ``w``'s stored ``(x, dy)`` pairs."""
        slot = w % self.table.weight_slots
        grads = c.grads
        for e in self.sink.probed(LAYERS):
            grads = self._accumulate_pair(grads, e, c.wstash[e.name], slot)

        def output(grads):
            for e in self.sink.probed(OUTPUT):
                acc = functools.partial(self._accumulate_pair, e=e, pair=c.wstash[e.name],
                                        slot=w % self.out_slots)
                if e.policy == "defer":  # a deferred microbatch is drained later
                    grads = lax.cond(deferred.is_deferred(self.par, w), lambda g: g, acc, grads)
                else:
                    grads = acc(grads)
            return grads

        if self.sink.probed(OUTPUT):
            grads = lax.cond(self.is_last, output, lambda g: g, grads)
        return c.replace(grads=grads)

    def _accumulate_pair(self, grads, e: SinkEntry, pair: WPair, slot):
        x, dy = (lax.dynamic_index_in_dim(a, slot, 0, keepdims=False) for a in pair)
        return self.sink.accumulate(grads, e, x, dy)

    # ------------------------------------------------------------------------ after

    def drain(self, carry: PipelineCarry) -> GradState:
        """The deferred output-layer wgrad drain (GEMMs on the last stage only), before the
        shared buckets are reduced over ``data`` and between the tied stage copies."""
        e = self.defer
        if e is None:
            return carry.grads
        weight = self.sink.leaf(self.params, e)
        recompute = None
        if self.par.defer_mode == "recompute":
            recompute = lambda x, extras: self.program.recompute_output_grad(x, extras, weight)
        with jax.named_scope("deferred_wgrad_drain"):
            bks = list(carry.grads[e.chunk])
            bks[e.bucket] = deferred.drain(self.par, carry.deferred[e.name], bks[e.bucket],
                                           e.offset, recompute, active=self.is_last)
            return carry.grads.replace(**{e.chunk: tuple(bks)})
