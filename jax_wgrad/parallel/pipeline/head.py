"""The last pipeline stage's head inside the executor: loss, head backward, and where the
output layer's weight gradient goes.

The last stage runs its head in the ``F`` task of a microbatch, right after the layers
(Megatron's last stage computes the loss in its forward step): the loss, the head's
backward (final norm, output layer, vocab-parallel cross entropy), and the gradient for
the layers' output, kept in the stage's gradient inbox for its own ``B`` task. So no ``B``
task ever runs a forward GEMM of the head. The output layer's weight gradient is

* accumulated now by the fused GEMM threaded through the head's ``jax.vjp`` (the default);
* stashed for the drain after the schedule (``defer_embedding_wgrad_compute``, Megatron's
  deferral; :mod:`jax_wgrad.parallel.deferred`), for the microbatches it defers;
* with a split backward (zero bubble), stashed as ``(x, dy)`` and accumulated by the
  microbatch's ``W`` task (:meth:`LastStage.weight`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad import ops
from jax_wgrad.functional.linear import WgradBuckets
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.grads.spec import OUTPUT, SHARED
from jax_wgrad.parallel import deferred
from jax_wgrad.parallel.pipeline.schedules import ScheduleTable

__all__ = ["LastStage"]


class LastStage:
    """The head's part of one device's schedule run (static context; see the module)."""

    def __init__(self, stages, layout: GradLayout, table: ScheduleTable, act: jax.Array,
                 seq_length: int):
        par, cfg = stages.parallel, stages.model
        self.stages, self.layout, self.par = stages, layout, par
        self.fusion, self.split = par.gradient_accumulation_fusion, table.split_backward
        self.defer = par.num_deferred_microbatches > 0
        self.explicit = self.defer or self.split  # the output wgrad leaves the head's vjp
        self.out_slot = layout.fused_slot(SHARED, OUTPUT) if self.fusion else None
        self.depth = table.inbox_depth("B")
        last = table.num_stages - 1
        self.out_slots = table.live_count(last, "F", "W") if self.split else 0
        self.stash_shapes = deferred.stash_shapes(par, seq_length, cfg.hidden_size,
                                                  cfg.vocab_size, act.dtype)
        mb, tp = par.micro_batch_size, par.tensor_model_parallel_size
        self.out_shapes = ((self.out_slots, mb, seq_length, cfg.hidden_size),
                           (self.out_slots, mb, seq_length, cfg.vocab_size // tp))
        self.dtype = act.dtype

    # ------------------------------------------------------------------------ state

    def init_stash(self) -> tuple[jax.Array, ...]:
        """The deferral stash (``()`` without deferral)."""
        return deferred.init_stash(self.stash_shapes)

    def init_output_stash(self) -> tuple[jax.Array, ...]:
        """Split backward: ``(x, dy)`` buffers of the output layer for its ``W`` tasks."""
        if not self.split:
            return ()
        return tuple(jnp.zeros(s, self.dtype) for s in self.out_shapes)

    # ------------------------------------------------------------------------ F task

    def run(self, shared, shared_bk, g_inbox, stash, wstash, h, labels, f):
        """Loss and head backward of microbatch ``f`` (last stage): ``(shared buckets,
        gradient inbox with the layers' output gradient at ``f``, loss, stash, wstash)``."""
        if self.explicit:
            dh, shared_bk, loss, stash, wstash = self._explicit(shared, shared_bk, stash,
                                                                wstash, h, labels, f)
        else:
            dh, shared_bk, loss = self._vjp(shared, shared_bk, h, labels)
        g_inbox = lax.dynamic_update_index_in_dim(g_inbox, dh.astype(g_inbox.dtype),
                                                  f % self.depth, 0)
        return shared_bk, g_inbox, loss, stash, wstash

    def skip(self, shared, shared_bk, g_inbox, stash, wstash, h, labels, f):
        """Not the last stage: nothing to do."""
        return shared_bk, g_inbox, jnp.float32(0.0), stash, wstash

    def _vjp(self, shared, shared_bk, h, labels):
        def fn(sh, bks, x):
            wb = WgradBuckets(bks)
            mg = wb.slot(*self.out_slot) if self.fusion else None
            return self.stages.head_loss(sh, mg, x, labels), wb.buckets

        (loss, _), vjp = jax.vjp(fn, shared, shared_bk, h)
        # Seeded with 1: gradients of the token-loss SUM (token scaling in finalize_grads).
        dshared, shared_bk, dh = vjp((jnp.float32(1.0), shared_bk))
        shared_bk = self.layout.shared.add_tree(shared_bk, dshared,
                                                where=self.layout.added_by(SHARED, OUTPUT))
        return dh, shared_bk, loss

    def _explicit(self, shared, shared_bk, stash, wstash, h, labels, f):
        # Explicit head backward: the output weight's gradient inputs are stashed (deferral,
        # or the W task's pair) or accumulated now by Megatron's deferral predicate.
        hb = deferred.head_backward(self.stages, shared, h, labels)
        shared_bk = self.layout.shared.add_tree(shared_bk, hb["dshared"],
                                                where=self.layout.added_by(SHARED, OUTPUT))
        n_stash = max(self.par.num_deferred_microbatches, 1)

        def later(bk, st, ws):
            items = deferred.stash_items(self.par, hb, labels)
            return bk, deferred.stash_put(st, jnp.clip(f, 0, n_stash - 1), items), ws

        def now(bk, st, ws):
            if self.split:  # the microbatch's W task accumulates it
                pair = (hb["x_full"], hb["dy"])
                slot = f % self.out_slots
                ws = ws[:-2] + tuple(lax.dynamic_update_index_in_dim(b, v.astype(b.dtype),
                                                                      slot, 0)
                                     for b, v in zip(ws[-2:], pair))
                return bk, st, ws
            bi, off = self.out_slot
            bk = list(bk)
            bk[bi] = ops.wgrad_accumulate(hb["x_full"], hb["dy"], bk[bi], offset=off)
            return tuple(bk), st, ws

        if not self.defer:
            shared_bk, stash, wstash = now(shared_bk, stash, wstash)
        elif self.par.num_deferred_microbatches == self.par.num_microbatches:
            shared_bk, stash, wstash = later(shared_bk, stash, wstash)
        else:
            shared_bk, stash, wstash = lax.cond(deferred.is_deferred(self.par, f), later, now,
                                                shared_bk, stash, wstash)
        return hb["dx"], shared_bk, hb["loss"], stash, wstash

    # ------------------------------------------------------------------------ W task

    def weight(self, shared_bk, out_stash, w):
        """The output layer's weight-gradient GEMM of microbatch ``w`` (split backward),
        unless deferral stashed it for the drain."""
        def accumulate(bk):
            slot = w % self.out_slots
            x, dy = (lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in out_stash)
            bi, off = self.out_slot
            bk = list(bk)
            bk[bi] = ops.wgrad_accumulate(x, dy, bk[bi], offset=off)
            return tuple(bk)

        if not self.defer:
            return accumulate(shared_bk)
        return lax.cond(deferred.is_deferred(self.par, w), lambda bk: bk, accumulate, shared_bk)

    # ------------------------------------------------------------------------ after

    def drain(self, shared_bk, stash, shared, is_last):
        """The deferred output-layer wgrad drain, GEMMs on the last stage only (the ring's
        permutes run everywhere, see :func:`deferred.drain`)."""
        if not self.defer:
            return shared_bk
        with jax.named_scope("deferred_wgrad_drain"):
            bi, off = self.out_slot
            shared_bk = list(shared_bk)
            shared_bk[bi] = deferred.drain(self.par, stash, shared_bk[bi], off,
                                           self.stages.output_weight(shared), active=is_last)
            return tuple(shared_bk)
