"""One value per gradient chunk, by name (:class:`Chunks`).

A pipeline device holds its parameters in three chunks (:data:`~jax_wgrad.grads.spec.CHUNKS`:
the stage's own layers, the stage's expert weights, the parameters every stage holds), and
so do its gradient buckets. :class:`Chunks` is the one named container for both: the
*device tree* (``Chunks`` of parameter trees, what a model's stage programs read) and the
*gradient state* (``Chunks`` of bucket tuples, what the pipeline carries). Nothing indexes
it by position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import jax

from jax_wgrad.grads.spec import CHUNKS

__all__ = ["Chunks", "DeviceTree", "GradState", "Window"]

T = TypeVar("T")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunks(Generic[T]):
    """A value per chunk: ``stage`` (this pipeline stage's own layers), ``experts`` (the
    expert weights of its MoE layers; empty for a dense model) and ``shared`` (what every
    stage holds: embedding and head). A pytree whose leaves flatten in that order."""

    stage: T
    experts: T
    shared: T

    def __getitem__(self, name: str) -> T:
        if name not in CHUNKS:
            raise KeyError(f"Chunks: no chunk {name!r}; the chunks are {CHUNKS}")
        return getattr(self, name)

    def items(self) -> list[tuple[str, T]]:
        """``(name, value)`` per chunk in :data:`CHUNKS` order."""
        return [(name, getattr(self, name)) for name in CHUNKS]

    def map(self, fn: Callable[[str, T], Any]) -> Chunks:
        """``Chunks`` of ``fn(name, value)``."""
        return Chunks(**{name: fn(name, value) for name, value in self.items()})

    def replace(self, **values: T) -> Chunks:
        return dataclasses.replace(self, **values)


assert tuple(f.name for f in dataclasses.fields(Chunks)) == CHUNKS

DeviceTree = Chunks
"""One device's parameters: a parameter tree per chunk."""

GradState = Chunks
"""One device's gradient buckets: a tuple of flat fp32 buckets per chunk."""


class Window(NamedTuple):
    """Model chunk ``index`` (an int or a traced int32 scalar) of ``count`` equal model
    chunks of a pipeline stage (interleaved schedules): rows ``[index n / count, (index +
    1) n / count)`` of every leaf of the :data:`~jax_wgrad.grads.spec.STACKED` chunks of a
    device tree (its layers stacked ``[n, ...]``)."""

    index: Any
    count: int
