"""What the pipeline executor carries across the ticks of a schedule (:class:`PipelineCarry`),
all of it named: the gradient buckets by chunk, the residual slots, the inboxes, the split
backward's ``(x, dy)`` pairs and the deferred output layer's stash by weight name."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.grads.chunks import GradState

__all__ = ["PipelineCarry", "WeightPairs", "put", "zeros_of"]


class WeightPairs(NamedTuple):
    """A fused linear's weight-gradient inputs waiting for ``W`` tasks: ``x [k, ...]``
    (its input) and ``dy [k, ...]`` (its output gradient), ``k`` slots by microbatch."""

    x: jax.Array
    dy: jax.Array

    @classmethod
    def zeros(cls, slots: int, x: jax.ShapeDtypeStruct, dy: jax.ShapeDtypeStruct) -> WeightPairs:
        """``slots`` empty pairs of one microbatch's ``x`` and ``dy`` shapes."""
        return cls(*(jnp.zeros((slots, *s.shape), s.dtype) for s in (x, dy)))

    def at(self, slot) -> tuple[jax.Array, jax.Array]:
        """The pair ``(x, dy)`` kept at ``slot``."""
        return tuple(lax.dynamic_index_in_dim(a, slot, 0, keepdims=False) for a in self)

    def put_x(self, slot, x: jax.Array) -> WeightPairs:
        return self._replace(x=put(self.x, x, slot))

    def put_dy(self, slot, dy: jax.Array) -> WeightPairs:
        return self._replace(dy=put(self.dy, dy, slot))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineCarry:
    """Per-device state carried across ticks (bounded by the schedule, not by ``M``)."""

    grads: GradState
    """The gradient buckets by chunk (:class:`~jax_wgrad.grads.GradLayout`)."""
    residuals: tuple[jax.Array, ...]
    """``[num_slots, ...]`` per stored residual of the stage forward (slots by the table's
    ``slot_map``)."""
    slots: tuple[tuple[jax.Array, ...], ...]
    """The layers' residual slots (:class:`~jax_wgrad.functional.residual_slots.ResidualSlots`):
    per layer scan, ``[num_slots, iterations, ...]`` per array its backward reads; ``()``
    when the program's layers do not write them (then they are in :attr:`residuals`)."""
    activation_inbox: jax.Array
    """``[V depth + 1, mb, s(/tp), H]`` activations received, by (model chunk,
    microbatch); the last slot takes what arrives in a tick where the sender ran no
    forward."""
    gradient_inbox: jax.Array
    """``[V depth + 1, mb, s(/tp), H]`` gradients received (the last stage: its head's)."""
    loss_sum: jax.Array
    """fp32 scalar: sum of token losses computed on this device (last stage)."""
    aux_sum: Any
    """Sums of ``body``'s aux over this device's forwards."""
    weight_pairs: dict[str, WeightPairs]
    """Split backward: per probed weight (by sink entry name) its pairs for ``W``."""
    deferred: dict[str, tuple[jax.Array, ...]]
    """The deferred output layer's stash by entry name (:mod:`jax_wgrad.parallel.deferred`),
    indexed by microbatch."""

    def replace(self, **kw) -> PipelineCarry:
        return dataclasses.replace(self, **kw)


def zeros_of(tree):
    """Zeros of a tree of shapes."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def put(buffer: jax.Array, value: jax.Array, slot) -> jax.Array:
    """``value`` written at ``slot`` of ``buffer``'s first dim (in its dtype)."""
    return lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), slot, 0)
