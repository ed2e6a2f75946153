"""Where one device's gradients live: a flat-bucket buffer per chunk, from parameter specs.

:class:`GradLayout` is built from two trees of the same structure -- the per-device
parameter shapes and their :class:`~jax_wgrad.grads.spec.GradSpec` -- given by a model,
as :class:`~jax_wgrad.grads.chunks.DeviceTree` trees (a subtree per chunk, by name).
Each chunk gets its own :class:`~jax_wgrad.grads.GradBuffer`, Megatron's exact bucket
plan (a forced bucket boundary between chunks, as Megatron keeps one buffer per model
chunk and separate expert-parallel buffers); the expert chunk is planned for the
expert-data-parallel size and synced over
:data:`~jax_wgrad.parallel.mesh.EXPERT_DATA_PARALLEL`
(:attr:`GradLayout.bucket_axes`), the others over
:data:`~jax_wgrad.parallel.mesh.DATA_PARALLEL`;
:attr:`GradLayout.buffer` is their concatenation, the optimizer's view. Under the
distributed optimizer a tied word embedding gets a bucket of its own (Megatron's
``shared_embedding`` rule). Nothing here knows the model: every per-parameter decision
reads a spec.

**Layer groups** (``layer_groups``: Megatron's overlap of the data-parallel sync with the
backward): the stage chunk's weights fused in :data:`LAYERS` (stacked ``[n, ...]``) are
laid out in groups of consecutive layers, each group one bucket of its own, the last
layers' first (:meth:`GradBuffer.create`'s row groups; :func:`layer_group_bounds`). The
backward completes a group's bucket when it has passed the group's layers, so its sync
can run while the layers below are differentiated; a bucket holding a whole stacked
weight is complete only at the end of the backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_wgrad.grads.buffer import GradBuffer
from jax_wgrad.grads.chunks import Chunks, DeviceTree, GradState
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.grads.spec import CHUNKS, EXPERTS, LAYERS, SHARED, STAGE, GradSpec
from jax_wgrad.grads.sync import AxisName
from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL, EXPERT_DATA_PARALLEL

__all__ = ["GradLayout", "SYNC_AXES", "layer_group_bounds"]

SYNC_AXES: dict[str, AxisName] = {
    STAGE: DATA_CONTEXT_PARALLEL,
    EXPERTS: EXPERT_DATA_PARALLEL,
    SHARED: DATA_CONTEXT_PARALLEL,
}
"""The mesh axes each chunk's buckets are synced (and sharded) over."""

Buckets = tuple[jax.Array, ...]


def _is_spec(x) -> bool:
    return isinstance(x, GradSpec)


def layer_group_bounds(
    num_layers: int, fused_numel: int, bucket_size: int | None, *, align: int = 1
) -> tuple[int, ...] | None:
    """Where a stage's ``num_layers`` stacked layers are cut into layer groups, a bucket
    each (the module docstring): ``(0, b_1, ..., num_layers)``, or ``None`` when fewer
    than two groups result (nothing could be synced before the backward ends).

    As many groups as Megatron's ``bucket_size`` asks for the ``fused_numel`` elements of
    the stage's fused layer weights (``ceil(fused_numel / bucket_size)``), at most one per
    two layers (each group is a loop of its own in the backward, and its bucket is synced
    in the next group's iterations), the cuts at multiples of ``align`` (layers
    recomputed together, Megatron's uniform ``recompute_num_layers``) and as even as
    that allows.
    """
    if bucket_size is None or num_layers < 4:
        return None
    units = math.ceil(num_layers / align)
    count = min(math.ceil(fused_numel / bucket_size), num_layers // 2, units)
    if count < 2:
        return None
    return tuple(min(num_layers, (k * units // count) * align) for k in range(count + 1))


@dataclasses.dataclass(frozen=True)
class GradLayout:
    """Static layout of one device's gradient buckets (see the module docstring).

    Attributes:
      parts: one buffer per chunk (``Chunks`` of :class:`GradBuffer`).
      buffer: their concatenation, the optimizer's view: its buckets are the parts'
        buckets in :data:`CHUNKS` order, its tree the :class:`DeviceTree`.
      specs: the :class:`GradSpec` of every leaf of ``buffer``, in flatten order.
      fusion: gradient accumulation fusion is on (fused weights' gradients are written by
        the fused GEMM, not added as arrays).
    """

    parts: Chunks
    buffer: GradBuffer
    specs: tuple[GradSpec, ...]
    fusion: bool

    @classmethod
    def create(
        cls,
        shapes: DeviceTree,
        specs: DeviceTree,
        *,
        dp_size: int,
        ddp: DDPConfig,
        fusion: bool,
        expert_dp_size: int | None = None,
        layer_groups: Sequence[int] | None = None,
    ) -> GradLayout:
        """Lays out the buckets of a device tree.

        Args:
          shapes: the per-device parameter shapes (``jax.ShapeDtypeStruct`` or array
            leaves; flatten order = registration order), a :class:`DeviceTree`.
          specs: the same structure with a :class:`GradSpec` per leaf; each leaf's
            ``chunk`` must be the chunk of its subtree.
          dp_size: data-parallel size; ddp: bucket options; fusion: as the attribute.
          expert_dp_size: the expert-data-parallel size the expert chunk is planned for
            (default ``dp_size``).
          layer_groups: ``(0, b_1, ..., n)``: the stage chunk's weights fused in
            :data:`LAYERS` (stacked ``[n, ...]``) laid out in these groups of layers, a
            bucket each (the module docstring; :func:`layer_group_bounds`); needs
            ``fusion``.
        """
        if layer_groups is not None and not fusion:
            raise ValueError(
                "GradLayout.create: layer_groups lay out the fused layer weights; "
                "gradient accumulation fusion is off"
            )
        if not isinstance(shapes, Chunks) or not isinstance(specs, Chunks):
            raise ValueError(
                f"GradLayout.create: shapes and specs must be DeviceTrees (one "
                f"tree per chunk {CHUNKS}), got {type(shapes).__name__} and "
                f"{type(specs).__name__}"
            )
        parts, flat_specs = {}, []
        for name, shape_tree in shapes.items():
            spec_tree = specs[name]
            dp = (expert_dp_size or dp_size) if name == EXPERTS else dp_size
            chunk_specs = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
            wrong = [s.chunk for s in chunk_specs if s.chunk != name]
            if wrong:
                raise ValueError(
                    f"GradLayout.create: the {name!r} subtree holds specs of "
                    f"chunks {sorted(set(wrong))}"
                )
            if not chunk_specs:
                parts[name] = GradBuffer.empty(
                    jax.tree.structure(shape_tree),
                    dp_size=dp,
                    use_distributed_optimizer=ddp.use_distributed_optimizer,
                )
                continue
            tied = jax.tree.map(lambda s: s.tied_embedding, spec_tree, is_leaf=_is_spec)
            rows = {}
            if name == STAGE and layer_groups is not None:
                rows = dict(
                    row_groups=tuple(layer_groups),
                    split_rows=jax.tree.map(
                        lambda s: s.fused_in == LAYERS, spec_tree, is_leaf=_is_spec
                    ),
                )
            parts[name] = GradBuffer.create(
                shape_tree,
                shared_embedding=tied,
                dp_size=dp,
                bucket_size=ddp.effective_bucket_size(dp),
                use_distributed_optimizer=ddp.use_distributed_optimizer,
                pad_buckets_for_high_nccl_busbw=ddp.pad_buckets_for_high_nccl_busbw,
                **rows,
            )
            flat_specs += chunk_specs
        parts = Chunks(**parts)
        buffer = GradBuffer.concatenate(
            [p for _, p in parts.items()], treedef=jax.tree.structure(shapes)
        )
        if len(flat_specs) != len(buffer.slots):
            raise ValueError(
                f"GradLayout.create: {len(flat_specs)} specs for {len(buffer.slots)} parameters"
            )
        return cls(parts=parts, buffer=buffer, specs=tuple(flat_specs), fusion=fusion)

    # ---------------------------------------------------------------------------- chunks

    @property
    def stage(self) -> GradBuffer:
        """The :data:`STAGE` chunk: this pipeline stage's own layers."""
        return self.parts.stage

    @property
    def shared(self) -> GradBuffer:
        """The :data:`SHARED` chunk: parameters every pipeline stage holds."""
        return self.parts.shared

    @property
    def experts(self) -> GradBuffer:
        """The :data:`EXPERTS` chunk: this stage's expert weights (no buckets if dense)."""
        return self.parts.experts

    @property
    def layer_group_buckets(self) -> tuple[int, ...]:
        """The stage chunk's layer-group buckets (indices among its buckets), the last
        layers' first; ``()`` without layer groups."""
        return tuple(
            i
            for i in range(self.stage.num_buckets)
            if any(p.rows is not None for _, p in self.stage.bucket_pieces(i))
        )

    @property
    def bucket_axes(self) -> tuple[AxisName, ...]:
        """Per bucket of :attr:`buffer`: the mesh axes it is synced and sharded over."""
        return sum(((SYNC_AXES[n],) * p.num_buckets for n, p in self.parts.items()), ())

    def zeros(self) -> GradState:
        """Zero buckets, by chunk."""
        return self.parts.map(lambda _, p: p.zeros())

    def state(self, buckets: Buckets) -> GradState:
        """The concatenated buckets of :attr:`buffer` -> the same buckets by chunk."""
        out, first = {}, 0
        for name, part in self.parts.items():
            out[name] = tuple(buckets[first : first + part.num_buckets])
            first += part.num_buckets
        if first != len(buckets):
            raise ValueError(f"GradLayout.state: {len(buckets)} buckets, the layout has {first}")
        return Chunks(**out)

    @staticmethod
    def concatenated(state: GradState) -> Buckets:
        """Inverse of :meth:`state`: the buckets of :attr:`buffer`, in order."""
        return sum((tuple(bks) for _, bks in state.items()), ())

    def chunk_specs(self, name: str) -> tuple[GradSpec, ...]:
        """The specs of chunk ``name``'s leaves, in its flatten order."""
        first = 0
        for n, part in self.parts.items():
            if n == name:
                return self.specs[first : first + len(part.slots)]
            first += len(part.slots)
        raise KeyError(f"GradLayout: no chunk {name!r}; the chunks are {CHUNKS}")

    # ---------------------------------------------------------------------------- roles

    def added_by(self, name: str, role: str) -> tuple[bool, ...]:
        """Per leaf of chunk ``name``: ``role``'s backward adds an ordinary gradient for
        it (``where=`` of :meth:`GradBuffer.add_tree`)."""
        return tuple(s.added_by(role, self.fusion) for s in self.chunk_specs(name))

    def add(self, state: GradState, role: str, grads: DeviceTree) -> GradState:
        """Adds ``role``'s ordinary gradients (a :class:`DeviceTree` shaped like the
        parameters) to their blocks, in place: the leaves :meth:`added_by` names."""

        def add(name, bks):
            where = self.added_by(name, role)
            if not any(where):
                return bks
            return self.parts[name].add_tree(bks, grads[name], where=where)

        return state.map(add)

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
