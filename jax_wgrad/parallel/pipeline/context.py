"""What the parts of one device's schedule run share: its :class:`StageContext` (the static
facts of the run and this step's inputs), one tick of the table (:class:`TickRows`), and
:func:`cond`, how they branch on a fact of the layout.

The executor (:mod:`.executor`) builds the context once per traced step and hands it to
the pipeline's ends (:mod:`.ends`); neither reads the other's attributes.

**Branches on facts that are static in some layouts and traced in others** (:func:`cond`).
Inside ``shard_map`` a device's pipeline stage is ``lax.axis_index`` (traced) when there
are several stages, and a Python constant when there is one; "this is the last stage" is
then ``True``. :func:`cond` runs the branch itself for a Python ``bool``: no conditional
in the program, so nothing for XLA:GPU to read back on the host (a ``ConditionalThunk``
outside a CUDA graph copies its predicate to the host and waits, ``docs/design/aot.md``),
and a traced predicate gets ``lax.cond`` as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import DeviceTree, GradState, Window
from jax_wgrad.parallel.pipeline.transfer import inbox_index

__all__ = ["Predicate", "StageContext", "TickRows", "cond"]


Predicate = bool | jax.Array
"""A Python ``bool`` (static: known when the program is traced) or a traced ``bool``."""


def cond(pred: Predicate, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond(pred, true_fn, false_fn, *operands)``, or the branch ``pred`` names when
    it is a Python ``bool`` (the other branch is never traced)."""
    if isinstance(pred, bool):
        return (true_fn if pred else false_fn)(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)


class TickRows(NamedTuple):
    """One tick of a :class:`~.schedules.ScheduleTable` (the scan's ``xs``): the tick's
    index and, per task, its row of every stage's microbatch (``IDLE``: none) and model
    chunk, ``int32 [P]`` each."""

    tick: jax.Array
    forward: jax.Array
    backward: jax.Array
    weight: jax.Array
    forward_chunk: jax.Array
    backward_chunk: jax.Array
    weight_chunk: jax.Array

    @property
    def forward_tasks(self) -> tuple[jax.Array, jax.Array]:
        """``(microbatch row, chunk row)`` of the tick's ``F`` tasks."""
        return self.forward, self.forward_chunk

    @property
    def backward_tasks(self) -> tuple[jax.Array, jax.Array]:
        """``(microbatch row, chunk row)`` of the tick's ``B`` tasks."""
        return self.backward, self.backward_chunk


@dataclasses.dataclass(frozen=True, eq=False)
class StageContext:
    """One device's run of a schedule (inside ``shard_map``): static facts, then traced
    values of this step.

    Attributes:
      num_stages: ``P``. num_microbatches: ``M`` per data rank. num_chunks: ``V`` model
        chunks per stage (interleaved schedules; 1 otherwise).
      split_backward: the table splits the backward into ``B`` (input gradients) and ``W``
        (weight gradients) tasks (zero bubble).
      fused: gradient accumulation fusion: the gradient buckets thread through the
        differentiated programs (the fused linears add their blocks in place).
      activation_inbox_depth, gradient_inbox_depth: slots per model chunk of the two
        inboxes (:meth:`~.schedules.ScheduleTable.inbox_depth` of ``F`` and ``B``).
      stage: this device's pipeline stage (traced ``int32``; ``0`` when ``P == 1``);
        is_first_stage, is_last_stage: whether it is stage ``0`` / ``P - 1`` (traced
        ``bool``; Python ``True`` when ``P == 1``: branches on them are then no
        conditionals, :func:`jax_wgrad.parallel.pipeline.context.cond`).
      params: this device's parameters (the device tree).
      microbatches: ``[M, mb, ...]`` this data rank's batch by microbatch.
      zero_activation: ``[mb, s(/tp), H]`` zeros (what an idle task sends).
    """

    num_stages: int
    num_microbatches: int
    num_chunks: int
    split_backward: bool
    fused: bool
    activation_inbox_depth: int
    gradient_inbox_depth: int
    stage: jax.Array
    is_first_stage: Predicate
    is_last_stage: Predicate
    params: DeviceTree
    microbatches: jax.Array
    zero_activation: jax.Array

    def batch(self, microbatch) -> jax.Array:
        """Microbatch ``microbatch`` (traced; clipped into range: an idle task's ``-1``
        reads microbatch 0)."""
        index = jnp.clip(microbatch, 0, self.num_microbatches - 1)
        return lax.dynamic_index_in_dim(self.microbatches, index, 0, keepdims=False)

    def threaded(self, grads: GradState) -> GradState | None:
        """What the differentiated programs thread: the buckets with fusion, else nothing."""
        return grads if self.fused else None

    def window(self, chunk) -> Window | None:
        """The layers of model chunk ``chunk`` (``None``: one chunk, all of them)."""
        return Window(chunk, self.num_chunks) if self.num_chunks > 1 else None

    def is_first_virtual_stage(self, chunk) -> Predicate:
        """This device runs the first virtual stage on ``chunk`` (``pre``'s consumer);
        static (a Python bool) with one stage and one chunk."""
        if self.num_chunks == 1:
            return self.is_first_stage
        return self.is_first_stage & (chunk == 0)

    def is_last_virtual_stage(self, chunk) -> Predicate:
        """This device runs the last virtual stage on ``chunk`` (``post``'s producer);
        static (a Python bool) with one stage and one chunk."""
        if self.num_chunks == 1:
            return self.is_last_stage
        return self.is_last_stage & (chunk == self.num_chunks - 1)

    def activation_slot(self, chunk, microbatch):
        """Slot of (``chunk``, ``microbatch``) in the activation inbox."""
        return inbox_index(self.activation_inbox_depth, chunk, microbatch)

    def gradient_slot(self, chunk, microbatch):
        """Slot of (``chunk``, ``microbatch``) in the gradient inbox."""
        return inbox_index(self.gradient_inbox_depth, chunk, microbatch)

    @property
    def spare_gradient_slot(self) -> int:
        """The gradient inbox's last slot, never read (what nobody consumes goes there)."""
        return self.num_chunks * self.gradient_inbox_depth
