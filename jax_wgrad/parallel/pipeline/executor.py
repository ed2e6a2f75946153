"""Runs a pipeline schedule table as ONE ``lax.scan`` over ticks inside ``shard_map``.

The executor reads the :class:`~jax_wgrad.parallel.schedules.ScheduleTable` (as
arrays indexed by the scan's tick and this device's stage) and knows no schedule formula
and no model: it runs a :class:`~jax_wgrad.parallel.pipeline.program.StageProgram`
(``pre`` on the first stage, ``body`` everywhere, ``post`` on the last) and asks a
:class:`~jax_wgrad.grads.sink.GradSink` where every weight gradient goes. Per tick a
stage runs the ``F``, ``B`` and ``W`` task the table names for it (``lax.cond`` skips an
idle one; a task the table never leaves idle, :meth:`~.schedules.ScheduleTable.always_busy`,
runs without one), optionally syncs its gradient buckets in the cooldown, and exchanges
activations and gradients with its neighbours (:mod:`.transfer`).

* **F** of microbatch ``f``: the stage input (``pre`` of its batch on the first stage,
  else the activation received for ``f``) goes through ``body`` under ``jax.vjp``; the
  pullback's residuals are stored at its slot of the table's ``slot_map``
  (:class:`~jax_wgrad.parallel.pipeline.residuals.ResidualStore`: what
  ``recompute_granularity`` keeps, never a weight or a bucket); with more than one slot,
  a program whose layers write them (:class:`~jax_wgrad.layout.WritesResidualSlots`) has
  its layer loops write their saved activations straight into the carry's slot buffers
  (:class:`~jax_wgrad.functional.residual_slots.ResidualSlots`), which ``B`` hands back to
  the pullback as their own cotangent: no copy in or out. On the last stage ``post``
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
* **Layer groups** (a layout whose fused layer weights are in layer groups,
  :class:`~jax_wgrad.grads.GradLayout`): the stage's last ``B`` syncs each group's
  bucket while it differentiates the group below (chunk by chunk, inside that group's
  loop: :func:`~jax_wgrad.grads.finalize.sync_bucket_chunk`), Megatron's overlap of
  the data-parallel sync with the backward. That backward is traced apart, with the
  syncs (:attr:`ScheduleRun.last_store`: the pullback of the same residuals), and run by
  a third branch of the backward task (with one stage too, where the backward is
  otherwise unconditional: one host synchronisation per tick).

**Interleaved** (``table.num_chunks = V > 1``): a task runs on the model chunk the table
names: ``body`` gets its :class:`~jax_wgrad.grads.chunks.Window` of the stacked layers and
the sink writes its blocks; ``pre``/``post`` run on the first/last virtual stage; the ring
edge is in :mod:`.transfer`. Slots: the table's ``slot_map`` (Megatron's in-flight bound).

The carried state (:class:`~.carry.PipelineCarry`) is bounded by the table, not by ``M``.

**Parts.** :class:`ScheduleRun` is one device's run: the tick, the layers' tasks, the
cooldown sync and the exchange. It builds the run's :class:`~.context.StageContext` (the
numbers of stages, microbatches and chunks, this stage, the step's parameters and
microbatches) once and hands it to the pipeline's ends, a strategy chosen once per program
(:func:`~.ends.pipeline_ends`: :class:`~.ends.StageEnds`, or :class:`~.ends.SpreadEnds`
when the ends are collectives over the pipeline), whose hooks the tick calls at fixed
places; ``pre``, ``post``, their backward, the output layer's pairs and the deferral drain
live there (:mod:`.ends`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.functional.residual_slots import ResidualSlots
from jax_wgrad.grads.chunks import DeviceTree, GradState
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.finalize import chunk_syncable, sync_bucket_chunk, sync_stage_buckets
from jax_wgrad.grads.sink import GradSink
from jax_wgrad.grads.spec import EXPERTS, LAYERS, STAGE
from jax_wgrad.parallel.pipeline.carry import PipelineCarry, WeightPairs, zeros_of
from jax_wgrad.parallel.pipeline.context import StageContext, TickRows, cond
from jax_wgrad.parallel.pipeline.ends import EndsTick, PipelineEnds, pipeline_ends
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.pipeline.residuals import ResidualStore
from jax_wgrad.parallel.pipeline.scopes import (
    BACKWARD,
    COOLDOWN_SYNC,
    END_SCOPES,
    FORWARD,
    TASK_SCOPES,
    WEIGHT,
)
from jax_wgrad.parallel.pipeline.transfer import exchange
from jax_wgrad.parallel.schedules import ScheduleTable

__all__ = [
    "END_SCOPES",
    "TASK_SCOPES",
    "ScheduleRun",
    "cooldown_sync",
    "initial_carry",
    "stage_gradients",
]


def cooldown_sync(ddp: DDPConfig, num_stages: int) -> bool:
    """Whether stage buckets are synced inside the schedule (``overlap_grad_reduce``):
    only with ``P > 1`` (with one stage the last backward IS the last tick; inside, XLA:CPU
    ran the stage and embedding/head all-reduces concurrently and crashed:
    docs/design/buckets.md)."""
    return ddp.overlap_grad_reduce and num_stages > 1


def stage_gradients(
    program: StageProgram,
    sink: GradSink,
    ddp: DDPConfig,
    table: ScheduleTable,
    params: DeviceTree,
    batch: jax.Array,
) -> tuple[tuple[jax.Array, ...], jax.Array, Any, tuple[bool, ...]]:
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
      ``(buckets, loss_sum, aux_sum, synced_in_place)``: this device's buckets
      (``sink.layout.buffer``'s) of token-loss-SUM gradients, its sum of token losses,
      its sums of ``body``'s aux, and per bucket whether it is synced already, in place
      (the stage and expert chunks in the cooldown, layer groups' buckets in the last
      backward: :attr:`ScheduleRun.synced_in_place`).
      :func:`jax_wgrad.grads.finalize_grads` does the rest.
    """
    run = ScheduleRun(program, sink, ddp, table, params, batch)
    carry, _ = lax.scan(run.tick, run.init_carry(), run.tick_rows())
    grads = run.ends.drain(carry)
    return sink.layout.concatenated(grads), carry.loss_sum, carry.aux_sum, run.synced_in_place


def initial_carry(
    program: StageProgram,
    sink: GradSink,
    ddp: DDPConfig,
    table: ScheduleTable,
    params: DeviceTree,
    batch: jax.Array,
) -> PipelineCarry:
    """The carry :func:`stage_gradients` starts from (inside ``shard_map``)."""
    return ScheduleRun(program, sink, ddp, table, params, batch).init_carry()


class ScheduleRun:
    """One device's run of a schedule table: the stage's layers in ``F``/``B``/``W`` tasks,
    the cooldown sync and the exchange with the neighbours, tick by tick; the pipeline's
    ends are its strategy :attr:`ends` (:mod:`.ends`).

    Attributes:
      program, sink, table: what runs, where its gradients go, in which order.
      context: the run's facts and this step's inputs, shared with the ends.
      ends: the pipeline's ends (:func:`~.ends.pipeline_ends`).
      syncs_in_cooldown: each stage syncs its buckets after its last gradient task
        (:func:`cooldown_sync`).
      sync_tick: ``int32 [P]``, per stage the tick of its cooldown sync
        (:meth:`~.schedules.ScheduleTable.sync_tick`).
      residual_slot: ``int32 [P, V, M]``, where a microbatch's residuals wait from its
        ``F`` to its ``B``; weight_pair_slot: likewise from its ``F`` to its ``W`` (split
        backward only, else ``None``).
      body_probes: zero probes of the layers' split linears (none unless split).
      body_records: shapes of what ``body`` records: ``(inputs, outputs, aux)``.
      store: how the layers' residuals are kept in slots (:class:`~.residuals.ResidualStore`).
      last_store: the layers' pullback as the stage's last ``B`` runs it, syncing the
        layer groups' buckets as it completes them (the same residuals as ``store``);
        ``None`` without layer groups.
      synced_in_backward: the stage chunk's buckets that ``last_store`` syncs.
      last_backward_tick: ``int32 [P]``, per stage the tick of its last ``B``.
    """

    def __init__(
        self,
        program: StageProgram,
        sink: GradSink,
        ddp: DDPConfig,
        table: ScheduleTable,
        params: DeviceTree,
        batch: jax.Array,
    ):
        setup = program.setup
        shape = (setup.num_stages, setup.num_microbatches, program.parallel.num_model_chunks)
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
        self.program, self.sink, self.ddp, self.table = program, sink, ddp, table
        stage = setup.stage_index()
        self.context = ctx = StageContext(
            num_stages=setup.num_stages,
            num_microbatches=setup.num_microbatches,
            num_chunks=table.num_chunks,
            split_backward=table.split_backward,
            fused=sink.layout.fusion,
            activation_inbox_depth=table.inbox_depth("F"),
            gradient_inbox_depth=table.inbox_depth("B"),
            stage=stage,
            is_first_stage=True if setup.num_stages == 1 else stage == 0,
            is_last_stage=True if setup.num_stages == 1 else stage == setup.num_stages - 1,
            params=params,
            microbatches=setup.microbatches(batch, "stage_gradients"),
            zero_activation=setup.zero_activation(),
        )
        # What the layers read of the parameters within a step (e.g. FP8 weight copies):
        # computed once, before the schedule loop (PreparedWeights), and read live like
        # the parameters (never stored per microbatch).
        prepare = getattr(program, "prepare", None)
        self.prepared = None if prepare is None else prepare(params)
        self.syncs_in_cooldown = cooldown_sync(ddp, ctx.num_stages)
        self.sync_tick = jnp.asarray([table.sync_tick(s) for s in range(ctx.num_stages)])
        self.residual_slot = jnp.asarray(table.slot_map("F", "B"))
        self.weight_pair_slot = (
            jnp.asarray(table.slot_map("F", "W")) if ctx.split_backward else None
        )
        # The layers' residual layout, probed inputs/outputs and aux: shapes learned by
        # tracing them once (with a split backward the probes' shapes first, from a trace
        # that records only: they are inputs of the traced function).
        buckets = sink.layout.zeros() if ctx.fused else None
        chunk0 = (params, buckets)
        self.body_probes = {}
        self.slot_layouts = None
        if sink.probed(LAYERS):
            recorded = jax.eval_shape(
                self._taped_body,
                (*chunk0, None, jnp.int32(0), self.prepared, (), jnp.int32(0)),
                ctx.zero_activation,
            )[1]
            self.body_probes = zeros_of(recorded[1])
        if getattr(program, "writes_residual_slots", False) and table.num_slots > 1:
            # The layers' saved activations go straight into the residual slots
            # (ResidualSlots): their layout, from one trace. With one slot (no microbatch
            # waits for its backward beside another) the layer scan's stacked outputs
            # become the slot buffer without a copy; on the H100 compile of Qwen3-30B-A3B
            # on 16 GPUs (one stage) writing the slots instead added 27 GB of copies and
            # updates a microbatch (4870 -> 5003 ms estimated).
            recorder = ResidualSlots.recorder()
            jax.eval_shape(
                functools.partial(self._taped_body, slots=recorder),
                (*chunk0, self.body_probes, jnp.int32(0), self.prepared, (), jnp.int32(0)),
                ctx.zero_activation,
            )
            self.slot_layouts = tuple(recorder.layouts)
        slot_buffers = jax.eval_shape(functools.partial(self.slot_buffers, self.table.num_slots))
        self.store = ResidualStore.create(
            self._taped_body,
            (*chunk0, self.body_probes, jnp.int32(0), self.prepared, slot_buffers, jnp.int32(0)),
            ctx.zero_activation,
            has_aux=True,
        )
        self.body_records = self.store.aux
        self.last_store, self.synced_in_backward = None, ()
        if ctx.fused and sink.layout.layer_group_buckets and ddp.overlap_grad_reduce_in_backward:
            if ctx.split_backward or ctx.num_chunks > 1:
                raise ValueError(
                    f"stage_gradients: schedule {table.name!r} "
                    + ("splits the backward" if ctx.split_backward else "is interleaved")
                    + "; a layout in layer groups needs one backward per microbatch and "
                    "model chunk"
                )
            synced: list[int] = []
            self.last_store = ResidualStore.create(
                functools.partial(self._taped_body, on_complete=self._chunk_sync(synced)),
                (
                    *chunk0,
                    self.body_probes,
                    jnp.int32(0),
                    self.prepared,
                    slot_buffers,
                    jnp.int32(0),
                ),
                ctx.zero_activation,
                has_aux=True,
            )
            if (self.last_store.live_index, self.last_store.shapes) != (
                self.store.live_index,
                self.store.shapes,
            ):
                raise AssertionError("the last backward's residuals differ from the others'")
            self.synced_in_backward = tuple(sorted(set(synced)))
        self.last_backward_tick = jnp.asarray(
            [table.last_grad_tick(s) for s in range(ctx.num_stages)]
        )
        output_pair_slots = (
            table.live_count(ctx.num_stages - 1, "F", "W", ctx.num_chunks - 1)
            if ctx.split_backward
            else 0
        )
        self.ends: PipelineEnds = pipeline_ends(
            program, sink, ctx, output_pair_slots=output_pair_slots
        )

    @property
    def synced_in_place(self) -> tuple[bool, ...]:
        """Per bucket of ``sink.layout.buffer``: synced in the schedule, in place (the
        stage and expert chunks in the cooldown; the layer groups' buckets in the last
        backward)."""
        flags = self.sink.layout.parts.map(
            lambda name, part: tuple(
                (self.syncs_in_cooldown and name in (STAGE, EXPERTS))
                or (name == STAGE and i in self.synced_in_backward)
                for i in range(part.num_buckets)
            )
        )
        return self.sink.layout.concatenated(flags)

    def _chunk_sync(self, synced: list[int]):
        """The routes' ``on_complete`` of the last backward: a layer group's bucket
        (``(STAGE, i)``) is synced in ``k`` chunks when they divide it (recorded in
        ``synced``); anything else is left to the cooldown or the finalization."""
        stage, groups = self.sink.layout.stage, set(self.sink.layout.layer_group_buckets)

        def on_complete(key, k: int):
            chunk, i = key
            if chunk != STAGE or i not in groups:
                return None
            if not chunk_syncable(stage.bucket_numels[i], stage.bucket_dp_sizes[i], k, self.ddp):
                return None
            synced.append(i)
            return lambda ct, j: sync_bucket_chunk(ct, j, k, self.ddp, STAGE)

        return on_complete

    @property
    def stored_per_microbatch(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """What one in-flight microbatch keeps for its backward: the stage forward's
        stored residuals and, when the layers write residual slots, one slot of each
        (``[iterations, ...]`` per array, :class:`ResidualSlots`)."""
        layers = () if self.slot_layouts is None else self.slot_layouts
        return (*self.store.shapes, *(s for scan in layers for s in scan))

    def slot_buffers(self, num_slots: int) -> tuple[tuple[jax.Array, ...], ...]:
        """Fresh residual-slot buffers of the layers (:class:`ResidualSlots`; ``()`` when
        the program's layers do not write them)."""
        if self.slot_layouts is None:
            return ()
        return ResidualSlots.allocate(self.slot_layouts, num_slots)

    def _taped_body(self, live, x, on_complete=None, slots=None):
        """``((params, grads, probes, chunk, prepared, slot buffers, slot), x) -> ((y,
        grads, slot buffers), (recorded inputs, outputs, aux))`` of model chunk
        ``chunk``'s layers under the sink's ``LAYERS`` tape (probes ``None``: records
        only, traced once for the shapes; ``prepared``: the program's :attr:`prepared`,
        or ``None``; the layers write what their backward reads at ``slot`` of the slot
        buffers, :class:`ResidualSlots`, when the program does); ``on_complete``: the
        layer groups' syncs of the last backward (:meth:`_chunk_sync`); ``slots``: a
        recorder (:meth:`ResidualSlots.recorder`), traced once for the layout."""
        params, grads, probes, chunk, prepared, buffers, slot = live
        tape = self.sink.open(LAYERS, params, grads, probes, on_complete=on_complete)
        extra = {} if prepared is None else {"prepared": prepared}
        if slots is None and self.slot_layouts is not None:
            slots = ResidualSlots(buffers, slot)
        if slots is not None:
            extra["slots"] = slots
        y, aux = self.program.body(tape.params, x, layers=self.context.window(chunk), **extra)
        grads, inputs, outputs = tape.close()
        buffers = () if slots is None else tuple(slots.buffers)
        return (y, grads, buffers), (inputs, outputs, aux)

    def _live(self, carry: PipelineCarry, chunk, slot):
        """What the differentiated body reads that is not stored: the parameters, the
        threaded buckets, the probes, the model chunk, what the program prepared of the
        parameters for the step, the residual-slot buffers and the slot (their cotangent
        is dropped)."""
        ctx = self.context
        return (
            ctx.params,
            ctx.threaded(carry.grads),
            self.body_probes,
            chunk,
            self.prepared,
            carry.slots,
            slot,
        )

    # ------------------------------------------------------------------------ the scan

    def init_carry(self) -> PipelineCarry:
        ctx = self.context
        body_inputs, body_outputs, body_aux = self.body_records
        inbox = lambda depth: jnp.zeros(
            (ctx.num_chunks * depth + 1, *ctx.zero_activation.shape), ctx.zero_activation.dtype
        )
        weight_pairs = {}
        if ctx.split_backward:
            weight_pairs = {
                name: WeightPairs.zeros(
                    self.table.weight_slots, body_inputs[name], body_outputs[name]
                )
                for name in body_inputs
            }
        return PipelineCarry(
            grads=self.sink.layout.zeros(),
            residuals=self.store.buffers(self.table.num_slots),
            slots=self.slot_buffers(self.table.num_slots),
            activation_inbox=inbox(ctx.activation_inbox_depth),
            gradient_inbox=inbox(ctx.gradient_inbox_depth),
            loss_sum=jnp.float32(0.0),
            aux_sum=zeros_of(body_aux),
            weight_pairs={**weight_pairs, **self.ends.output_weight_pairs()},
            deferred=self.ends.deferred_stash(),
        )

    def tick_rows(self) -> TickRows:
        """The scan's xs: the table by tick (:class:`~.context.TickRows`)."""
        t = self.table
        rows = (t.forward, t.backward, t.weight, t.forward_chunk, t.backward_chunk, t.weight_chunk)
        return TickRows(jnp.arange(t.num_ticks), *(jnp.asarray(a) for a in rows))

    def tick(self, carry: PipelineCarry, rows: TickRows) -> tuple[PipelineCarry, None]:
        """One tick: this stage's ``F``, ``B`` and ``W`` tasks (each skipped when idle)
        with the ends' hooks around them, the cooldown sync, the exchange."""
        ctx = self.context
        here = lambda row: row[ctx.stage]
        f, b, w = here(rows.forward), here(rows.backward), here(rows.weight)
        f_chunk, b_chunk = here(rows.forward_chunk), here(rows.backward_chunk)
        w_chunk = here(rows.weight_chunk)
        ends = self.ends.begin_tick(rows)
        runs = lambda task, microbatch: self.table.always_busy(task) or microbatch >= 0
        with jax.named_scope(FORWARD):
            carry, y = cond(runs("F", f), self.forward, self._no_forward, carry, f, f_chunk, ends)
        carry = self.ends.after_forward_tick(carry, ends, y)
        with jax.named_scope(BACKWARD):
            if self.last_store is not None:
                # idle, a backward, or the stage's last one (with the layer groups' syncs):
                # a conditional even with one stage (a last tick traced after the loop
                # instead kept its temporaries beside the loop's: 7.3 GiB more peak at
                # Llama-3-8B TP4 DP2)
                which = jnp.where(
                    b < 0, 0, jnp.where(rows.tick == self.last_backward_tick[ctx.stage], 2, 1)
                )
                carry, dx = lax.switch(
                    which,
                    [self._no_backward, self.backward, self._last_backward],
                    carry,
                    b,
                    b_chunk,
                )
            else:
                carry, dx = cond(runs("B", b), self.backward, self._no_backward, carry, b, b_chunk)
        carry = self.ends.after_backward_tick(carry, ends, dx)
        if ctx.split_backward:
            with jax.named_scope(WEIGHT):
                carry = cond(runs("W", w), self.weight, lambda c, w, v: c, carry, w, w_chunk)
        if self.syncs_in_cooldown:
            carry = carry.replace(grads=self.cooldown(carry.grads, rows.tick))
        return self.exchange(carry, y, dx, rows), None

    def exchange(self, carry: PipelineCarry, y, dx, rows: TickRows) -> PipelineCarry:
        """Sends and receives of the tick (:func:`~.transfer.exchange`)."""
        ctx = self.context
        if ctx.num_stages == 1:
            return carry
        activation_inbox, gradient_inbox = exchange(
            (carry.activation_inbox, carry.gradient_inbox),
            y,
            dx,
            rows.forward_tasks,
            rows.backward_tasks,
            stage=ctx.stage,
            num_stages=ctx.num_stages,
            num_chunks=ctx.num_chunks,
            depth=(ctx.activation_inbox_depth, ctx.gradient_inbox_depth),
        )
        return carry.replace(activation_inbox=activation_inbox, gradient_inbox=gradient_inbox)

    def cooldown(self, grads: GradState, tick) -> GradState:
        """This stage's gradients are complete: sync its buckets in its sync tick (in the
        loop; the tick after its last gradient task,
        :meth:`~.schedules.ScheduleTable.sync_tick`)."""
        with jax.named_scope(COOLDOWN_SYNC):

            def sync(own):
                done = self.synced_in_backward  # layer groups' buckets: synced already
                stage = list(own[0])
                rest = [i for i in range(len(stage)) if i not in done]
                for i, b in zip(rest, sync_stage_buckets(tuple(stage[i] for i in rest), self.ddp)):
                    stage[i] = b
                return tuple(stage), sync_stage_buckets(own[1], self.ddp, EXPERTS)

            stage, experts = lax.cond(
                tick == self.sync_tick[self.context.stage],
                sync,
                lambda own: own,
                (grads.stage, grads.experts),
            )
            return grads.replace(stage=stage, experts=experts)

    # ------------------------------------------------------------------------ tasks

    def forward(self, carry: PipelineCarry, microbatch, chunk, ends: EndsTick | None):
        """``F``: the stage input (``pre``'s on the first virtual stage, else the
        activation received) through the layers, their residuals stored; then the ends'
        part (``post`` on the last virtual stage). Returns the carry and the output."""
        ctx = self.context
        batch = ctx.batch(microbatch)
        received = lax.dynamic_index_in_dim(
            carry.activation_inbox, ctx.activation_slot(chunk, microbatch), 0, keepdims=False
        )
        x = cond(
            ctx.is_first_virtual_stage(chunk),
            lambda: self.ends.first_stage_input(ends, batch),
            lambda: received,
        )
        slot = self.residual_slot[ctx.stage, chunk, microbatch]
        (y, _, slots), (inputs, _, aux), residuals = self.store.forward(
            carry.residuals, slot, self._live(carry, chunk, slot), x
        )
        pairs = dict(carry.weight_pairs)
        for name, x_in in inputs.items():
            pairs[name] = pairs[name].put_x(
                self.weight_pair_slot[ctx.stage, chunk, microbatch], x_in
            )
        carry = carry.replace(
            residuals=residuals,
            slots=slots,
            weight_pairs=pairs,
            aux_sum=jax.tree.map(jnp.add, carry.aux_sum, aux),
        )
        return self.ends.after_forward_task(carry, microbatch, chunk, y, batch), y

    def _no_forward(self, carry: PipelineCarry, microbatch, chunk, ends):
        return carry, self.context.zero_activation

    def backward(self, carry: PipelineCarry, microbatch, chunk, store=None):
        """``B``: the stored pullback seeded with the gradient received; the layers'
        gradients into their blocks (or, split, their output gradients kept for ``W``);
        then the ends' part (``pre``'s backward on the first virtual stage). Returns the
        carry and the input gradient. ``store``: whose pullback (default :attr:`store`)."""
        ctx = self.context
        dy = lax.dynamic_index_in_dim(
            carry.gradient_inbox, ctx.gradient_slot(chunk, microbatch), 0, keepdims=False
        )
        slot = self.residual_slot[ctx.stage, chunk, microbatch]
        live = self._live(carry, chunk, slot)
        pullback = (store or self.store).pullback(carry.residuals, slot, live)
        # The slot buffers ride the backward as their own cotangent (ResidualSlots).
        (dparams, grads, dys, *_), dx = pullback((dy, live[1], carry.slots))
        grads = self.sink.add(carry.grads if grads is None else grads, LAYERS, dparams)
        pairs = dict(carry.weight_pairs)
        for name, d in dys.items():
            pairs[name] = pairs[name].put_dy(self.weight_pair_slot[ctx.stage, chunk, microbatch], d)
        grads = self.ends.after_backward_task(grads, microbatch, chunk, dx)
        return carry.replace(grads=grads, weight_pairs=pairs), dx

    def _last_backward(self, carry: PipelineCarry, microbatch, chunk):
        """The stage's last ``B``: :meth:`backward` with the layer groups' syncs."""
        return self.backward(carry, microbatch, chunk, store=self.last_store)

    def _no_backward(self, carry: PipelineCarry, microbatch, chunk):
        return carry, self.context.zero_activation

    def weight(self, carry: PipelineCarry, microbatch, chunk):
        """``W`` (split backward): the fused weight-gradient GEMMs of the microbatch's
        stored ``(x, dy)`` pairs on ``chunk``, the layers' then the ends' (the output
        layer's on the last virtual stage)."""
        ctx = self.context
        slot = self.weight_pair_slot[ctx.stage, chunk, microbatch]
        grads = carry.grads
        for e in self.sink.probed(LAYERS):
            x, dy = carry.weight_pairs[e.name].at(slot)
            grads = self.sink.accumulate(grads, e, x, dy, ctx.window(chunk))
        grads = self.ends.weight_task(grads, microbatch, chunk, carry.weight_pairs)
        return carry.replace(grads=grads)
