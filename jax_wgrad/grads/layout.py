"""Where one device's gradients live: a flat-bucket buffer per chunk, from parameter specs.

:class:`GradLayout` is built from two trees of the same structure -- the per-device
parameter shapes and their :class:`~jax_wgrad.grads.spec.GradSpec` -- given by a model,
one subtree per chunk in :data:`~jax_wgrad.grads.spec.CHUNKS` order (``(stage, experts,
shared)``). Each chunk gets its own :class:`~jax_wgrad.grads.GradBuffer`, Megatron's exact
bucket plan (a forced bucket boundary between chunks, as Megatron keeps one buffer per model
chunk and separate expert-parallel buffers); the expert chunk is planned for the
expert-data-parallel size and synced over :data:`~jax_wgrad.parallel.mesh.EXPERT_DATA_PARALLEL`
(:attr:`GradLayout.bucket_axes`), the others over
:data:`~jax_wgrad.parallel.mesh.DATA_PARALLEL`;
:attr:`GradLayout.buffer` is their concatenation, the optimizer's view. Under the
distributed optimizer a tied word embedding gets a bucket of its own (Megatron's
``shared_embedding`` rule). Nothing here knows the model: every per-parameter decision
reads a spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jax_wgrad.grads.buffer import GradBuffer
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.spec import CHUNKS, EXPERTS, SHARED, STAGE, GradSpec
from jax_wgrad.grads.sync import AxisName
from jax_wgrad.parallel.mesh import DATA_PARALLEL, EXPERT_DATA_PARALLEL

__all__ = ["GradLayout", "SYNC_AXES"]

SYNC_AXES: dict[str, AxisName] = {STAGE: DATA_PARALLEL, EXPERTS: EXPERT_DATA_PARALLEL,
                                  SHARED: DATA_PARALLEL}
"""The mesh axes each chunk's buckets are synced (and sharded) over."""

Buckets = tuple[jax.Array, ...]


def _is_spec(x) -> bool:
    return isinstance(x, GradSpec)


@dataclasses.dataclass(frozen=True)
class GradLayout:
    """Static layout of one device's gradient buckets (see the module docstring).

    Attributes:
      parts: one buffer per chunk, in :data:`CHUNKS` order.
      buffer: their concatenation: its buckets are the parts' buckets in order, its tree
        the tuple of the chunk trees.
      specs: the :class:`GradSpec` of every leaf of ``buffer``, in flatten order.
      fusion: gradient accumulation fusion is on (fused weights' gradients are written by
        the fused GEMM, not added as arrays).
    """

    parts: tuple[GradBuffer, ...]
    buffer: GradBuffer
    specs: tuple[GradSpec, ...]
    fusion: bool

    @classmethod
    def create(cls, shapes, specs, *, dp_size: int, ddp: DDPConfig, fusion: bool,
               expert_dp_size: int | None = None) -> GradLayout:
        """Lays out the buckets of a device tree.

        Args:
          shapes: tuple of one tree per chunk (``jax.ShapeDtypeStruct`` or array leaves:
            per-device shapes, flatten order = registration order).
          specs: the same structure with a :class:`GradSpec` per leaf; each leaf's
            ``chunk`` must be the chunk of its subtree.
          dp_size: data-parallel size; ddp: bucket options; fusion: as the attribute.
          expert_dp_size: the expert-data-parallel size the expert chunk is planned for
            (default ``dp_size``).
        """
        if len(shapes) != len(CHUNKS) or len(specs) != len(CHUNKS):
            raise ValueError(f"GradLayout.create: expected one tree per chunk {CHUNKS}, got "
                             f"{len(shapes)} shape trees and {len(specs)} spec trees")
        parts, flat_specs = [], []
        for name, shape_tree, spec_tree in zip(CHUNKS, shapes, specs):
            dp = (expert_dp_size or dp_size) if name == EXPERTS else dp_size
            chunk_specs = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
            wrong = [s.chunk for s in chunk_specs if s.chunk != name]
            if wrong:
                raise ValueError(f"GradLayout.create: the {name!r} subtree holds specs of "
                                 f"chunks {sorted(set(wrong))}")
            if not chunk_specs:
                parts.append(GradBuffer.empty(
                    jax.tree.structure(shape_tree), dp_size=dp,
                    use_distributed_optimizer=ddp.use_distributed_optimizer))
                continue
            tied = jax.tree.map(lambda s: s.tied_embedding, spec_tree, is_leaf=_is_spec)
            parts.append(GradBuffer.create(
                shape_tree, shared_embedding=tied, dp_size=dp,
                bucket_size=ddp.effective_bucket_size(dp),
                use_distributed_optimizer=ddp.use_distributed_optimizer,
                pad_buckets_for_high_nccl_busbw=ddp.pad_buckets_for_high_nccl_busbw))
            flat_specs += chunk_specs
        buffer = GradBuffer.concatenate(parts)
        if len(flat_specs) != len(buffer.slots):
            raise ValueError(f"GradLayout.create: {len(flat_specs)} specs for "
                             f"{len(buffer.slots)} parameters")
        return cls(parts=tuple(parts), buffer=buffer, specs=tuple(flat_specs), fusion=fusion)

    # ---------------------------------------------------------------------------- chunks

    def chunk(self, name: str) -> GradBuffer:
        """The buffer of chunk ``name``."""
        return self.parts[CHUNKS.index(name)]

    @property
    def stage(self) -> GradBuffer:
        """The :data:`STAGE` chunk: this pipeline stage's own layers."""
        return self.chunk(STAGE)

    @property
    def shared(self) -> GradBuffer:
        """The :data:`SHARED` chunk: parameters every pipeline stage holds."""
        return self.chunk(SHARED)

    @property
    def experts(self) -> GradBuffer:
        """The :data:`EXPERTS` chunk: this stage's expert weights (no buckets if dense)."""
        return self.chunk(EXPERTS)

    @property
    def num_stage_buckets(self) -> int:
        return self.stage.num_buckets

    @property
    def num_own_buckets(self) -> int:
        """Buckets of the stage's own parameters: the stage and expert chunks."""
        return self.stage.num_buckets + self.experts.num_buckets

    @property
    def bucket_axes(self) -> tuple[AxisName, ...]:
        """Per bucket of :attr:`buffer`: the mesh axes it is synced and sharded over."""
        return sum(((SYNC_AXES[n],) * p.num_buckets for n, p in zip(CHUNKS, self.parts)), ())

    def split(self, buckets: Buckets) -> tuple[Buckets, ...]:
        """The concatenated bucket tuple -> one tuple per chunk (``(stage, experts,
        shared)``)."""
        out, first = [], 0
        for part in self.parts:
            out.append(tuple(buckets[first:first + part.num_buckets]))
            first += part.num_buckets
        return tuple(out)

    def split_own(self, buckets: Buckets) -> tuple[Buckets, Buckets]:
        """The bucket tuple -> ``(own, shared)``: the stage's own buckets (stage chunk
        then expert chunk, what its layers thread) and the shared chunk's."""
        n = self.num_own_buckets
        return tuple(buckets[:n]), tuple(buckets[n:])

    def own_fused_slots(self, role: str) -> Any:
        """``(stage tree, experts tree)`` of :meth:`fused_slots` with bucket indices into
        the ``own`` tuple of :meth:`split_own`."""
        n = self.num_stage_buckets
        shift = lambda s: None if s is None else (s[0] + n, s[1])
        experts = jax.tree.map(shift, self.fused_slots(EXPERTS, role),
                               is_leaf=lambda s: s is None or isinstance(s, tuple))
        return self.fused_slots(STAGE, role), experts

    def _chunk_specs(self, name: str) -> tuple[GradSpec, ...]:
        first = sum(len(p.slots) for p in self.parts[:CHUNKS.index(name)])
        return self.specs[first:first + len(self.chunk(name).slots)]

    # ---------------------------------------------------------------------------- roles

    def added_by(self, name: str, role: str) -> tuple[bool, ...]:
        """Per leaf of chunk ``name``: ``role``'s backward adds an ordinary gradient for
        it (``where=`` of :meth:`GradBuffer.add_tree`)."""
        return tuple(s.added_by(role, self.fusion) for s in self._chunk_specs(name))

    def fused_slots(self, name: str, role: str) -> Any:
        """A tree shaped like chunk ``name``'s parameters: ``(bucket, offset)`` within the
        chunk's buckets at each weight whose gradient ``role``'s fused GEMM writes, else
        ``None`` (all ``None`` without fusion)."""
        part = self.chunk(name)
        leaves = [(s.bucket, s.offset)
                  if self.fusion and spec.fused_in == role else None
                  for s, spec in zip(part.slots, self._chunk_specs(name))]
        return jax.tree.unflatten(part.treedef, leaves)

    def fused_slot(self, name: str, role: str) -> tuple[int, int]:
        """The ``(bucket, offset)`` of the one weight ``role``'s fused GEMM writes in chunk
        ``name`` (e.g. the output layer's weight); an error unless there is exactly one."""
        part = self.chunk(name)
        slots = [(s.bucket, s.offset) for s, spec in zip(part.slots, self._chunk_specs(name))
                 if self.fusion and spec.fused_in == role]
        if len(slots) != 1:
            raise ValueError(f"GradLayout.fused_slot: {len(slots)} weights fused in role "
                             f"{role!r} in chunk {name!r}, expected exactly one")
        return slots[0]

    # ---------------------------------------------------------------------------- flags

    def flags(self, predicate: Callable[[GradSpec], bool]) -> Any:
        """A bool tree over ``buffer``'s tree: ``predicate(spec)`` per leaf."""
        return jax.tree.unflatten(self.buffer.treedef, [bool(predicate(s)) for s in self.specs])

    @property
    def tensor_replicated_flags(self) -> tuple[bool, ...]:
        """Per leaf of ``buffer``: replicated over ``tensor``."""
        return tuple(s.tensor_replicated for s in self.specs)

    def tensor_replicated(self) -> Any:
        """Per leaf: replicated over ``tensor`` (LayerNorms, row-parallel biases,
        positions) -- counted once in the norm; all-reduced under sequence parallelism."""
        return self.flags(lambda s: s.tensor_replicated)

    def shared_flags(self) -> Any:
        """Per leaf: held by every pipeline stage (counted once in the norm)."""
        return self.flags(lambda s: s.pipeline_shared)

    def weight_decay_flags(self) -> Any:
        """Per leaf: weight decay applies."""
        return self.flags(lambda s: s.weight_decay)
