"""The pipeline's two ends in the executor: ``pre`` (the first virtual stage's input) and
``post`` (the last virtual stage's loss), their backward, the output layer's ``(x, dy)``
pairs and the deferred output-layer wgrad drain (:class:`EndsMixin` of the executor's
per-device run).

**Where they run.** Normally on one stage, inside that stage's task: ``pre`` in the first
stage's ``F`` of chunk 0 (and its backward in its ``B``), ``post`` with its backward in the
last stage's ``F`` of chunk ``V - 1``. A program whose ends are collectives over
``pipeline`` (``StageProgram.ends_over_pipeline``: the vocabulary split over the stages)
has them run by EVERY stage, at the tick level, in the ticks where the first / last
virtual stage needs them (the table's rows say which microbatch; the predicate is the same
on every device, so the collectives inside meet): ``pre`` before the tick's tasks (the
first stage consumes it), ``post`` after the ``F`` task on the last stage's output (every
stage its share of the head; the loss counted on the last stage, its gradient for the
layers kept there), ``pre``'s backward after the ``B`` task with the first stage's input
gradient (zeros elsewhere). The output layer's weight-gradient pairs then live on every
stage: accumulated at once or deferred (every stage drains its own shard), never split
into ``W`` tasks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import GradState
from jax_wgrad.grads.sink import SinkEntry
from jax_wgrad.grads.spec import INPUT, OUTPUT
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.pipeline.carry import PipelineCarry, WPair, put

__all__ = ["EndsMixin"]


class EndsMixin:
    """The ends' methods of the executor's run (module docstring); the run provides its
    context (``program``, ``sink``, ``params``, ``stage``, the tables, ...)."""

    # ------------------------------------------------------------------ tick level (spread)

    def end_rows(self, fwd, bwd):
        """``(pre, post, pre backward)`` microbatch of this tick (-1: none): the first
        stage's ``F`` on chunk 0, the last stage's ``F`` on chunk ``V - 1``, the first
        stage's ``B`` on chunk 0 (``fwd``, ``bwd``: the rows' microbatches and chunks)."""
        at = lambda row, stage, chunk: jnp.where(
            (row[0][stage] >= 0) & (row[1][stage] == chunk), row[0][stage], -1
        )
        return at(fwd, 0, 0), at(fwd, self.pp - 1, self.v - 1), at(bwd, 0, 0)

    def spread_pre(self, m):
        """``pre`` of microbatch ``m`` on every stage (the first stage's input)."""
        return lax.cond(
            m >= 0, lambda: self._pre_fn(self.params, None, self._batch(m))[0], lambda: self.act
        )

    def spread_post(self, c: PipelineCarry, m, y) -> PipelineCarry:
        """``post`` and its backward of microbatch ``m`` on every stage."""
        return lax.cond(
            m >= 0, lambda c: self._post(c, y=y, batch=self._batch(m), f=m), lambda c: c, c
        )

    def spread_pre_backward(self, c: PipelineCarry, m, dx) -> PipelineCarry:
        """``pre``'s backward of microbatch ``m`` on every stage, seeded with the first
        stage's input gradient."""
        dx = jnp.where(self.is_first, dx, jnp.zeros((), dx.dtype))
        return c.replace(
            grads=lax.cond(
                m >= 0, lambda g: self._pre_backward(g, dx, self._batch(m)), lambda g: g, c.grads
            )
        )

    # ------------------------------------------------------------------ the ends

    def _post(self, c: PipelineCarry, *, y, batch, f) -> PipelineCarry:
        """``post`` and its backward for microbatch ``f`` (the last stage, or with spread
        ends every stage: its loss counted and its gradient kept on the last stage)."""
        threaded = self._threaded(c)
        (loss, _), vjp, (inputs, _, aux) = jax.vjp(
            functools.partial(self._post_fn, batch=batch),
            self.params,
            threaded,
            self.post_probes,
            y,
            has_aux=True,
        )
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dparams, grads, dys, dh = vjp((jnp.float32(1.0), threaded))
        grads = c.grads if grads is None else grads
        slot = self._inbox(1, self.v - 1, f)
        if self.spread:
            loss = jnp.where(self.is_last, loss, 0.0)
            slot = jnp.where(self.is_last, slot, self.v * self.depth[1])  # the spare slot
        c = c.replace(
            grads=self.sink.add(grads, OUTPUT, dparams),
            loss_sum=c.loss_sum + loss,
            g_inbox=lax.dynamic_update_index_in_dim(c.g_inbox, dh.astype(c.g_inbox.dtype), slot, 0),
        )
        for e in self.sink.probed(OUTPUT):
            c = self._output_pair(c, e, inputs[e.name], dys[e.name], aux, batch, f)
        return c

    def _output_pair(self, c: PipelineCarry, e: SinkEntry, x, dy, aux, batch, f):
        """The output layer's ``(x, dy)`` of microbatch ``f``: deferred to the drain,
        kept for its ``W`` task, or accumulated now (Megatron's deferral predicate)."""

        def now(c):
            if self.split and not self.spread:
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
        return deferred.stash_items(self.par, x, dy, lambda: self.program.defer_extras(aux, batch))

    def _pre_backward(self, grads: GradState, dx, batch) -> GradState:
        threaded = grads if self.fused else None
        _, vjp = jax.vjp(functools.partial(self._pre_fn, batch=batch), self.params, threaded)
        dparams, out = vjp((dx, threaded))
        return self.sink.add(grads if out is None else out, INPUT, dparams)

    def drain(self, carry: PipelineCarry) -> GradState:
        """The deferred output-layer wgrad drain (GEMMs on the last stage, or every stage's
        own shard with spread ends), before the shared buckets are reduced over ``data``
        and between the tied stage copies."""
        e = self.defer
        if e is None:
            return carry.grads
        weight = self.sink.leaf(self.params, e)
        recompute = None
        if self.par.defer_mode == "recompute":
            recompute = lambda x, extras: self.program.recompute_output_grad(x, extras, weight)
        with jax.named_scope("deferred_wgrad_drain"):
            bks = list(carry.grads[e.chunk])
            bks[e.bucket] = deferred.drain(
                self.par,
                carry.deferred[e.name],
                bks[e.bucket],
                e.offset,
                recompute,
                active=self.is_last | self.spread,
            )
            return carry.grads.replace(**{e.chunk: tuple(bks)})
