"""The pipeline's two ends as a strategy of the executor (:class:`PipelineEnds`): ``pre``
(the first virtual stage's input) and ``post`` (the last virtual stage's loss), their
backward, the output layer's ``(x, dy)`` pairs and the deferred output-layer wgrad drain.

**Where they run** is the one thing the two strategies differ in; :func:`pipeline_ends`
picks one per program:

* :class:`StageEnds` (the default): on one stage, inside that stage's task: ``pre`` in the
  first stage's ``F`` of chunk 0 (and its backward in its ``B``), ``post`` with its
  backward in the last stage's ``F`` of chunk ``V - 1``; with a split backward the output
  layer's pairs wait for the last stage's ``W`` tasks.
* :class:`SpreadEnds`: a program whose ends are collectives over the pipeline axis
  (``StageProgram.ends_over_pipeline``: the vocabulary split over the stages) has them run
  by EVERY stage, at the tick level, in the ticks where the first / last virtual stage
  needs them (the table's rows say which microbatch; the predicate is the same on every
  device, so the collectives inside meet): ``pre`` before the tick's tasks (the first
  stage consumes it), ``post`` after the ``F`` task on the last stage's output (every stage
  its share of the head; the loss counted on the last stage, its gradient for the layers
  kept there), ``pre``'s backward after the ``B`` task with the first stage's input
  gradient (zeros elsewhere). The output layer's weight-gradient pairs then live on every
  stage: accumulated at once or deferred (every stage drains its own shard), never split
  into ``W`` tasks.

The executor calls every hook of :class:`PipelineEnds` at its fixed place in the tick
(:meth:`~.executor.ScheduleRun.tick`); each strategy implements the hooks of its place and
leaves the others as the identity. An end receives what it needs explicitly: the program,
the gradient sink and the run's :class:`~.context.StageContext`.

**The model's part** (:class:`~.program.StageProgram`): under recompute-mode deferral
``post`` is asked for its output-gradient extras (``output_grad_extras=True``), and the
program's :attr:`~.program.StageProgram.output_grad_recompute`
(:class:`~jax_wgrad.layout.program.OutputGradRecompute`) turns them into what the stash
keeps and rebuilds the output layer's gradient in the drain.
"""

from __future__ import annotations

import abc
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import GradState
from jax_wgrad.grads.sink import GradSink, SinkEntry
from jax_wgrad.grads.spec import INPUT, OUTPUT
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.pipeline.carry import PipelineCarry, WeightPairs, zeros_of
from jax_wgrad.parallel.pipeline.context import Predicate, StageContext, TickRows, cond
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.pipeline.scopes import DEFERRED_DRAIN, POST, PRE_BACKWARD

__all__ = ["EndsTick", "PipelineEnds", "SpreadEnds", "StageEnds", "pipeline_ends"]


def pipeline_ends(
    program: StageProgram, sink: GradSink, context: StageContext, *, output_pair_slots: int
) -> PipelineEnds:
    """The ends' strategy for ``program``: :class:`SpreadEnds` if its ends are collectives
    over the pipeline (``program.ends_over_pipeline``), else :class:`StageEnds`.
    ``output_pair_slots``: with a split backward, the output layer's ``W`` pair slots on
    the last stage (the table's most microbatches between its ``F`` and ``W``)."""
    if program.ends_over_pipeline:
        return SpreadEnds(program, sink, context)
    return StageEnds(program, sink, context, output_pair_slots=output_pair_slots)


class EndsTick(NamedTuple):
    """What :class:`SpreadEnds` runs in one tick, the same on every device: the
    microbatch (``-1``: none) of ``pre`` (the first stage's ``F`` on chunk 0), of ``post``
    (the last stage's ``F`` on chunk ``V - 1``) and of ``pre``'s backward (the first
    stage's ``B`` on chunk 0), and ``pre``'s output (zeros if none)."""

    pre: jax.Array
    post: jax.Array
    pre_backward: jax.Array
    first_stage_input: jax.Array


class PipelineEnds(abc.ABC):
    """The ends of one device's schedule run (module docstring).

    The concrete part -- the taped ``pre``/``post``, ``post`` with its backward, ``pre``'s
    backward, the output layer's pairs, the deferral stash and its drain -- is shared; the
    hooks say where it runs.

    Attributes:
      program, sink, context: what the ends run, where gradients go, the run's facts.
      wants_output_grad_extras: recompute-mode deferral: ``post`` returns the extras the
        drain rebuilds the output layer's gradient from.
      post_probes: zero probes of ``post``'s split linears (none unless split).
      post_records: shapes of what ``post`` records: ``(inputs, outputs, aux)``.
    """

    def __init__(self, program: StageProgram, sink: GradSink, context: StageContext):
        self.program, self.sink, self.context = program, sink, context
        self.wants_output_grad_extras = (
            sink.deferred is not None and program.parallel.defer_mode == "recompute"
        )
        buckets = jax.eval_shape(sink.layout.zeros) if context.fused else None
        self.post_records = jax.eval_shape(
            self._taped_post,
            context.params,
            buckets,
            None,
            context.zero_activation,
            context.microbatches[0],
        )[1]
        self.post_probes = zeros_of(self.post_records[1])

    # ------------------------------------------------------------------ carried state

    @abc.abstractmethod
    def output_weight_pairs(self) -> dict[str, WeightPairs]:
        """The carry's ``W`` pair slots of the output layer's split weights (by name)."""

    def deferred_stash(self) -> dict[str, tuple[jax.Array, ...]]:
        """The carry's deferral stash of the deferred output-layer weight (by name)."""
        entry = self.sink.deferred
        if entry is None:
            return {}
        inputs, outputs, aux = self.post_records
        shapes = jax.eval_shape(
            self._defer_items,
            inputs[entry.name],
            outputs[entry.name],
            aux,
            self.context.microbatches[0],
        )
        slots = self.sink.num_deferred
        return {entry.name: tuple(jnp.zeros((slots, *s.shape), s.dtype) for s in shapes)}

    # ------------------------------------------------------------------ hooks of the tick

    @abc.abstractmethod
    def begin_tick(self, rows: TickRows) -> EndsTick | None:
        """Tick level, before the tasks: what the ends run in this tick."""

    @abc.abstractmethod
    def first_stage_input(self, tick: EndsTick | None, batch: jax.Array) -> jax.Array:
        """In an ``F`` task of the first virtual stage: its input."""

    @abc.abstractmethod
    def after_forward_task(
        self, carry: PipelineCarry, microbatch, chunk, y: jax.Array, batch: jax.Array
    ) -> PipelineCarry:
        """In every ``F`` task, after the layers (``y``: their output)."""

    @abc.abstractmethod
    def after_forward_tick(
        self, carry: PipelineCarry, tick: EndsTick | None, y: jax.Array
    ) -> PipelineCarry:
        """Tick level, after the ``F`` task (``y``: its output, zeros if idle)."""

    @abc.abstractmethod
    def after_backward_task(self, grads: GradState, microbatch, chunk, dx: jax.Array) -> GradState:
        """In every ``B`` task, after the layers (``dx``: their input gradient)."""

    @abc.abstractmethod
    def after_backward_tick(
        self, carry: PipelineCarry, tick: EndsTick | None, dx: jax.Array
    ) -> PipelineCarry:
        """Tick level, after the ``B`` task (``dx``: its input gradient, zeros if idle)."""

    @abc.abstractmethod
    def weight_task(
        self, grads: GradState, microbatch, chunk, pairs: dict[str, WeightPairs]
    ) -> GradState:
        """In every ``W`` task, after the layers' pairs: the output layer's."""

    # ------------------------------------------------------------------ after the schedule

    def drain(self, carry: PipelineCarry) -> GradState:
        """The deferred output-layer wgrad drain, before the shared buckets are reduced
        over ``data`` and between the tied stage copies."""
        entry = self.sink.deferred
        if entry is None:
            return carry.grads
        par = self.program.parallel
        recompute = None
        if par.defer_mode == "recompute":
            weight = self.sink.leaf(self.context.params, entry)
            model = self.program.output_grad_recompute
            recompute = lambda x, extras: model.recompute_output_grad(x, extras, weight)
        with jax.named_scope(DEFERRED_DRAIN):
            buckets = list(carry.grads[entry.chunk])
            buckets[entry.bucket] = deferred.drain(
                par,
                carry.deferred[entry.name],
                buckets[entry.bucket],
                entry.offset,
                recompute,
                active=self._drain_active(),
            )
            return carry.grads.replace(**{entry.chunk: tuple(buckets)})

    @abc.abstractmethod
    def _drain_active(self) -> Predicate | None:
        """Where the drain's GEMMs run (``None``: every stage)."""

    # ------------------------------------------------------------------ the programs

    def _taped_pre(self, params, grads, batch):
        """``pre`` under the sink's ``INPUT`` tape: ``(x, grads)``."""
        tape = self.sink.open(INPUT, params, grads)
        x, _ = self.program.pre(tape.params, batch)
        grads, _, _ = tape.close()
        return x, grads

    def _taped_post(self, params, grads, probes, y, batch):
        """``post`` under the sink's ``OUTPUT`` tape: ``((loss, grads), (recorded inputs,
        outputs, aux))``."""
        tape = self.sink.open(OUTPUT, params, grads, probes)
        loss, aux = self.program.post(
            tape.params, y, batch, output_grad_extras=self.wants_output_grad_extras
        )
        grads, inputs, outputs = tape.close()
        return (loss, grads), (inputs, outputs, aux)

    def _pre(self, batch) -> jax.Array:
        return self._taped_pre(self.context.params, None, batch)[0]

    def _pre_backward(self, grads: GradState, dx, batch) -> GradState:
        threaded = self.context.threaded(grads)
        _, vjp = jax.vjp(
            functools.partial(self._taped_pre, batch=batch), self.context.params, threaded
        )
        dparams, out = vjp((dx, threaded))
        return self.sink.add(grads if out is None else out, INPUT, dparams)

    def _post_and_backward(self, carry: PipelineCarry, *, y, batch, microbatch) -> PipelineCarry:
        """``post`` and its backward for ``microbatch``: its loss counted, the gradient
        for the layers' output kept in the gradient inbox for the last stage's ``B``."""
        threaded = self.context.threaded(carry.grads)
        (loss, _), vjp, (inputs, _, aux) = jax.vjp(
            functools.partial(self._taped_post, batch=batch),
            self.context.params,
            threaded,
            self.post_probes,
            y,
            has_aux=True,
        )
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dparams, grads, dys, dh = vjp((jnp.float32(1.0), threaded))
        grads = carry.grads if grads is None else grads
        loss, slot = self._counted(
            loss, self.context.gradient_slot(self.context.num_chunks - 1, microbatch)
        )
        inbox = carry.gradient_inbox
        carry = carry.replace(
            grads=self.sink.add(grads, OUTPUT, dparams),
            loss_sum=carry.loss_sum + loss,
            gradient_inbox=lax.dynamic_update_index_in_dim(inbox, dh.astype(inbox.dtype), slot, 0),
        )
        for entry in self.sink.probed(OUTPUT):
            carry = self._output_pair(
                carry, entry, inputs[entry.name], dys[entry.name], aux, batch, microbatch
            )
        return carry

    def _counted(self, loss, gradient_slot):
        """``(loss, slot)``: the loss this device counts and where ``post``'s gradient
        for the layers goes."""
        return loss, gradient_slot

    def _output_pair(self, carry: PipelineCarry, entry: SinkEntry, x, dy, aux, batch, microbatch):
        """The output layer's ``(x, dy)`` of ``microbatch``: deferred to the drain, or
        handled now (:meth:`_output_pair_now`), by Megatron's deferral predicate."""

        def later(carry):
            items = self._defer_items(x, dy, aux, batch)
            index = jnp.clip(microbatch, 0, self.sink.num_deferred - 1)
            stash = deferred.stash_put(carry.deferred[entry.name], index, items)
            return carry.replace(deferred={**carry.deferred, entry.name: stash})

        now = lambda carry: self._output_pair_now(carry, entry, x, dy, microbatch)
        if entry.policy != "defer":
            return now(carry)
        if self.sink.num_deferred == self.context.num_microbatches:
            return later(carry)
        return lax.cond(deferred.is_deferred(self.program.parallel, microbatch), later, now, carry)

    def _output_pair_now(self, carry: PipelineCarry, entry: SinkEntry, x, dy, microbatch):
        """A pair not deferred: accumulated at once."""
        return carry.replace(grads=self.sink.accumulate(carry.grads, entry, x, dy))

    def _defer_items(self, x, dy, aux, batch) -> tuple[jax.Array, ...]:
        return deferred.stash_items(
            self.program.parallel,
            x,
            dy,
            lambda: self.program.output_grad_recompute.defer_extras(aux, batch),
        )


class StageEnds(PipelineEnds):
    """The ends on their own stage, inside its tasks (module docstring).

    ``output_pair_slots``: with a split backward, the output layer's ``W`` pair slots
    (by microbatch modulo their number)."""

    def __init__(
        self,
        program: StageProgram,
        sink: GradSink,
        context: StageContext,
        *,
        output_pair_slots: int,
    ):
        super().__init__(program, sink, context)
        self.output_pair_slots = output_pair_slots

    def output_weight_pairs(self) -> dict[str, WeightPairs]:
        if not self.context.split_backward:
            return {}
        inputs, outputs, _ = self.post_records
        return {
            e.name: WeightPairs.zeros(self.output_pair_slots, inputs[e.name], outputs[e.name])
            for e in self.sink.probed(OUTPUT)
        }

    def begin_tick(self, rows: TickRows) -> None:
        return None

    def first_stage_input(self, tick: EndsTick | None, batch: jax.Array) -> jax.Array:
        return self._pre(batch)

    def after_forward_task(self, carry, microbatch, chunk, y, batch) -> PipelineCarry:
        """The last virtual stage: the loss and the head's backward now; its gradient for
        the layers' output waits in the gradient inbox for this stage's ``B``."""
        with jax.named_scope(POST):
            return cond(
                self.context.is_last_virtual_stage(chunk),
                functools.partial(self._post_and_backward, y=y, batch=batch, microbatch=microbatch),
                lambda carry: carry,
                carry,
            )

    def after_forward_tick(self, carry, tick, y) -> PipelineCarry:
        return carry

    def after_backward_task(self, grads, microbatch, chunk, dx) -> GradState:
        """The first virtual stage: ``pre``'s backward."""
        with jax.named_scope(PRE_BACKWARD):
            return cond(
                self.context.is_first_virtual_stage(chunk),
                lambda g: self._pre_backward(g, dx, self.context.batch(microbatch)),
                lambda g: g,
                grads,
            )

    def after_backward_tick(self, carry, tick, dx) -> PipelineCarry:
        return carry

    def weight_task(self, grads, microbatch, chunk, pairs) -> GradState:
        """The last virtual stage: the output layer's stored pair (a deferred
        microbatch's is drained later)."""
        entries = self.sink.probed(OUTPUT)
        if not entries:
            return grads

        def output(grads):
            slot = microbatch % self.output_pair_slots
            for e in entries:
                accumulate = lambda g, e=e: self.sink.accumulate(g, e, *pairs[e.name].at(slot))
                if e.policy == "defer":
                    deferred_now = deferred.is_deferred(self.program.parallel, microbatch)
                    grads = lax.cond(deferred_now, lambda g: g, accumulate, grads)
                else:
                    grads = accumulate(grads)
            return grads

        return cond(self.context.is_last_virtual_stage(chunk), output, lambda g: g, grads)

    def _drain_active(self) -> Predicate:
        return self.context.is_last_stage

    def _output_pair_now(self, carry, entry, x, dy, microbatch):
        """With a split backward the pair waits for the microbatch's ``W`` task."""
        if not self.context.split_backward:
            return super()._output_pair_now(carry, entry, x, dy, microbatch)
        slot = microbatch % self.output_pair_slots
        pairs = carry.weight_pairs[entry.name].put_x(slot, x).put_dy(slot, dy)
        return carry.replace(weight_pairs={**carry.weight_pairs, entry.name: pairs})


class SpreadEnds(PipelineEnds):
    """The ends on every stage, at the tick level (module docstring)."""

    def output_weight_pairs(self) -> dict[str, WeightPairs]:
        return {}  # never split: every stage accumulates (or defers) its share at once

    def begin_tick(self, rows: TickRows) -> EndsTick:
        """The tick's ends from the table's rows; ``pre`` runs now, on every stage."""
        last_stage, last_chunk = self.context.num_stages - 1, self.context.num_chunks - 1

        def at(tasks, stage, chunk):
            microbatches, chunks = tasks
            here = (microbatches[stage] >= 0) & (chunks[stage] == chunk)
            return jnp.where(here, microbatches[stage], -1)

        pre = at(rows.forward_tasks, 0, 0)
        post = at(rows.forward_tasks, last_stage, last_chunk)
        pre_backward = at(rows.backward_tasks, 0, 0)
        x = lax.cond(
            pre >= 0,
            lambda: self._pre(self.context.batch(pre)),
            lambda: self.context.zero_activation,
        )
        return EndsTick(pre, post, pre_backward, first_stage_input=x)

    def first_stage_input(self, tick: EndsTick, batch: jax.Array) -> jax.Array:
        return tick.first_stage_input

    def after_forward_task(self, carry, microbatch, chunk, y, batch) -> PipelineCarry:
        return carry

    def after_forward_tick(self, carry, tick: EndsTick, y) -> PipelineCarry:
        """``post`` and its backward on every stage, on the last stage's output."""
        m = tick.post
        return lax.cond(
            m >= 0,
            lambda carry: self._post_and_backward(
                carry, y=y, batch=self.context.batch(m), microbatch=m
            ),
            lambda carry: carry,
            carry,
        )

    def after_backward_task(self, grads, microbatch, chunk, dx) -> GradState:
        return grads

    def after_backward_tick(self, carry, tick: EndsTick, dx) -> PipelineCarry:
        """``pre``'s backward on every stage, seeded with the first stage's input
        gradient."""
        m = tick.pre_backward
        dx = jnp.where(self.context.is_first_stage, dx, jnp.zeros((), dx.dtype))
        grads = lax.cond(
            m >= 0,
            lambda g: self._pre_backward(g, dx, self.context.batch(m)),
            lambda g: g,
            carry.grads,
        )
        return carry.replace(grads=grads)

    def weight_task(self, grads, microbatch, chunk, pairs) -> GradState:
        return grads  # the output layer's pairs are never split

    def _drain_active(self) -> None:
        return None  # every stage drains its own shard

    def _counted(self, loss, gradient_slot):
        """The loss counted on the last stage only; elsewhere the gradient goes to the
        spare slot."""
        is_last = self.context.is_last_stage
        return (
            jnp.where(is_last, loss, 0.0),
            jnp.where(is_last, gradient_slot, self.context.spare_gradient_slot),
        )
