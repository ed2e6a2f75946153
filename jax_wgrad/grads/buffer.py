"""Flat, padded gradient buckets (Megatron's ``_ParamAndGradBuffer``).

A :class:`GradBuffer` is the static layout; the buffer's *value* is a plain tuple of flat
1-D arrays, one per bucket (``buckets[i].shape == (buffer.bucket_numels[i],)``). Everything
here is meant to run on per-device shards inside ``jax.shard_map``: shapes are the local
(per-device) parameter shapes.

**Parameter order.** Registration (forward) order is the flatten order of the parameter
tree (``jax.tree.leaves``; ``dict`` and ``nnx.State`` flatten by *sorted key*: use an
``OrderedDict`` as the GPT's ``forward_order`` does). As in Megatron the walk is reversed:
the last leaf lands at offset 0 of bucket 0.

**Dtype groups.** Like Megatron, parameters are grouped by ``(param dtype, grad dtype)``
(in order of first appearance); each group gets its own :class:`BucketPlan`, its buckets
after the previous group's (with ``grad_dtype=float32``: one group per parameter dtype).

**Row groups.** A stacked weight ``[n, ...]`` (the ``n`` layers of a pipeline stage on axis
0) is normally one block of one bucket, so its bucket can only be reduced once the backward
has gone through *all* ``n`` layers. With ``row_groups=(0, b_1, ..., n)`` and
``split_rows`` flagging such leaves, :meth:`GradBuffer.create` lays the flagged leaves out
by layer groups instead: rows ``[b_g, b_{g+1})`` of every flagged leaf together in one
bucket of their own, so the data-parallel reduce-scatter of a group can start as soon as
the backward has finished its layers (Megatron's buckets, which follow the reverse layer
order). The row-group buckets come first in their dtype group and in **reverse** order
(bucket 0 holds the last rows ``[b_{G-1}, n)``: the backward finishes the last layers
first); each is planned by :func:`plan_buckets` as if the flagged leaves' row blocks were
parameters (``(stop - start) * prod(shape[1:])`` elements each, ``bucket_size=None``: one
bucket, the last flagged leaf at offset 0, the same 64-element starts and bucket-end
padding). The group's other leaves follow, planned exactly as without row groups. A
flagged leaf's :class:`ParamSlot` has one :class:`SlotPiece` per row group (in row order);
:meth:`GradBuffer.bucket_pieces` lists the pieces of a bucket. For example, three flagged
``[4, ...]`` leaves with ``row_groups=(0, 1, 3, 4)``::

    bucket 0: w3[3:4] w2[3:4] w1[3:4]   bucket 1: w3[1:3] w2[1:3] w1[1:3]
    bucket 2: w3[0:1] w2[0:1] w1[0:1]   bucket 3...: the unflagged leaves of the group

Example, inside ``shard_map`` over ``data``::

    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    buckets = buf.wgrad_accumulate(buf.add_tree(buf.zeros(), grads), "['w']", x, dy)
    shards = sync_buckets(buckets, axis_name=DATA, use_distributed_optimizer=True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad import ops
from jax_wgrad.grads.plan import BucketPlan, plan_buckets
from jax_wgrad.grads.slots import BufferGroup, ParamSlot, SlotPiece, flag_tree, leaf_shape_dtype

__all__ = ["GradBuffer", "ParamSlot", "SlotPiece", "BufferGroup"]

PyTree = Any
Buckets = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class GradBuffer:
    """Static layout of the flat gradient buckets of one parameter tree.

    Built by :meth:`create`; hashable (a static argument), no arrays. Attributes:

      treedef: structure of the parameter tree.
      slots: one :class:`ParamSlot` per leaf, in flatten order.
      groups: the ``(param dtype, grad dtype)`` groups, each with its Megatron plan(s).
      bucket_numels: padded length of each bucket array.
      bucket_dtypes: gradient dtype of each bucket.
      bucket_param_dtypes: parameter dtype of each bucket (the all-gather dtype).
      bucket_leaves: flatten indices of the leaves with a piece in each bucket, in buffer
        (offset) order; a leaf laid out in row groups appears in each of its buckets
        (:meth:`bucket_pieces` gives the pieces).
      dp_size, use_distributed_optimizer: as passed to :meth:`create`.
      bucket_dp_sizes: the data-parallel size each bucket is sharded over (default
        ``dp_size``; a concatenated buffer's expert part has the expert-data-parallel size).
    """

    treedef: Any
    slots: tuple[ParamSlot, ...]
    groups: tuple[BufferGroup, ...]
    bucket_numels: tuple[int, ...]
    bucket_dtypes: tuple[np.dtype, ...]
    bucket_param_dtypes: tuple[np.dtype, ...]
    bucket_leaves: tuple[tuple[int, ...], ...]
    dp_size: int
    use_distributed_optimizer: bool
    bucket_dp_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.bucket_dp_sizes:
            object.__setattr__(self, "bucket_dp_sizes", (self.dp_size,) * len(self.bucket_numels))

    @classmethod
    def empty(cls, treedef, *, dp_size: int, use_distributed_optimizer: bool) -> GradBuffer:
        """The layout of a tree without leaves (e.g. a dense model's expert chunk): no
        slots, no buckets."""
        if treedef.num_leaves:
            raise ValueError(f"GradBuffer.empty: the tree has {treedef.num_leaves} leaves")
        return cls(
            treedef=treedef,
            slots=(),
            groups=(),
            bucket_numels=(),
            bucket_dtypes=(),
            bucket_param_dtypes=(),
            bucket_leaves=(),
            dp_size=dp_size,
            use_distributed_optimizer=bool(use_distributed_optimizer),
        )

    @classmethod
    def create(
        cls,
        param_tree: PyTree,
        *,
        dp_size: int,
        bucket_size: int | None,
        use_distributed_optimizer: bool,
        pad_buckets_for_high_nccl_busbw: bool = False,
        shared_embedding: PyTree | None = None,
        grad_dtype: Any = jnp.float32,
        row_groups: Sequence[int] | None = None,
        split_rows: PyTree | None = None,
    ) -> GradBuffer:
        """Lays out the gradient buckets of ``param_tree`` with :func:`plan_buckets`.

        Args:
          param_tree: pytree of per-device parameters (arrays or ``jax.ShapeDtypeStruct``);
            only shapes and dtypes are read. Flatten order is registration order.
          dp_size, bucket_size, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw:
            as in :func:`jax_wgrad.grads.plan_buckets` (Megatron's names).
          shared_embedding: optional tree of bools shaped like ``param_tree`` flagging the
            word embedding tied between first and last pipeline stage (own bucket under
            the distributed optimizer).
          grad_dtype: dtype of the buckets; ``None`` means each parameter's own dtype
            (Megatron without ``accumulate_allreduce_grads_in_fp32``). Default float32.
          row_groups: group boundaries ``(0, b_1, ..., n)`` over axis 0 of the
            ``split_rows`` leaves (strictly increasing, at least two entries): one bucket
            per group ``[b_g, b_{g+1})``, the last group first (module docstring, "Row
            groups"). ``None``: no row groups.
          split_rows: tree of bools shaped like ``param_tree`` flagging the stacked
            ``[n, ...]`` leaves (``n = row_groups[-1]``) laid out in row groups; all in one
            ``(param dtype, grad dtype)`` group, none a ``shared_embedding``. Given
            together with ``row_groups``.
        Returns:
          The layout.
        Raises:
          ValueError: on an empty tree, a non-float or empty leaf, a mismatched
            ``shared_embedding`` or ``split_rows`` tree, invalid plan arguments, or invalid
            row groups (bad boundaries, only one of ``row_groups`` and ``split_rows``, no
            flagged leaf, a flagged leaf with another axis-0 size, a flagged shared
            embedding, flagged leaves in two dtype groups).
        """
        with_path, treedef = jax.tree_util.tree_flatten_with_path(param_tree)
        if not with_path:
            raise ValueError("GradBuffer.create: param_tree has no leaves")
        paths = [jax.tree_util.keystr(p) for p, _ in with_path]
        shapes_dtypes = [leaf_shape_dtype(p, leaf) for p, (_, leaf) in zip(paths, with_path)]
        shapes = [shape for shape, _ in shapes_dtypes]
        shared = flag_tree("shared_embedding", shared_embedding, treedef, len(paths))

        # Group by (param dtype, grad dtype), in order of first appearance (Megatron's dict).
        keyed: dict[tuple[np.dtype, np.dtype], list[int]] = {}
        for k, (_, dt) in enumerate(shapes_dtypes):
            gdt = dt if grad_dtype is None else np.dtype(grad_dtype)
            keyed.setdefault((dt, gdt), []).append(k)
        key_of = {k: key for key, idx in keyed.items() for k in idx}
        bounds, split = _row_layout(row_groups, split_rows, treedef, paths, shapes, shared, key_of)
        # Bucket order: the last rows first (the backward finishes the last layers first).
        row_ranges = list(zip(bounds[:-1], bounds[1:]))[::-1]

        plan_kw = dict(
            dp_size=dp_size,
            use_distributed_optimizer=use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
        )
        pieces: list[list[SlotPiece]] = [[] for _ in paths]
        groups, numels, dtypes, pdtypes, leaves_of = [], [], [], [], []

        def place(plan: BucketPlan, members: list[int], rows: tuple[int, int] | None) -> None:
            """Appends ``plan``'s buckets (``members[j]`` is its parameter ``j``) and their
            leaves' pieces."""
            first = len(numels)
            for b in plan.buckets:
                numels.append(b.numel)
                dtypes.append(gdt)
                pdtypes.append(pdt)
                leaves_of.append(tuple(members[j] for j in b.param_indices))
            for j, (start, end, bid) in enumerate(plan.param_ranges):
                offset = start - plan.buckets[bid].offset
                pieces[members[j]].append(SlotPiece(first + bid, offset, end - start, rows))

        for (pdt, gdt), idx in keyed.items():
            first = len(numels)
            flagged = [k for k in idx if split[k]]
            rest = [k for k in idx if not split[k]]
            row_plans = []
            for rows in row_ranges if flagged else ():
                start, stop = rows
                row_plan = plan_buckets(
                    [(stop - start) * math.prod(shapes[k][1:]) for k in flagged],
                    bucket_size=None,
                    **plan_kw,
                )
                place(row_plan, flagged, rows)
                row_plans.append(row_plan)
            plan = None
            if rest:
                plan = plan_buckets(
                    [math.prod(shapes[k]) for k in rest],
                    bucket_size=bucket_size,
                    shared_embedding=[shared[k] for k in rest],
                    **plan_kw,
                )
                place(plan, rest, None)
            groups.append(BufferGroup(pdt, gdt, tuple(idx), plan, first, tuple(row_plans)))
        slots = tuple(
            ParamSlot(
                path=paths[k],
                index=k,
                shape=shapes[k],
                param_dtype=key_of[k][0],
                size=math.prod(shapes[k]),
                pieces=tuple(pieces[k][::-1]),  # row order (they were placed last rows first)
            )
            for k in range(len(paths))
        )
        return cls(
            treedef=treedef,
            slots=slots,
            groups=tuple(groups),
            bucket_numels=tuple(numels),
            bucket_dtypes=tuple(dtypes),
            bucket_param_dtypes=tuple(pdtypes),
            bucket_leaves=tuple(leaves_of),
            dp_size=(groups[0].plan or groups[0].row_plans[0]).dp_size,
            use_distributed_optimizer=bool(use_distributed_optimizer),
        )

    @classmethod
    def concatenate(cls, buffers: Sequence[GradBuffer], treedef: Any = None) -> GradBuffer:
        """One buffer over the tuple of the buffers' trees (Megatron: a buffer per chunk),
        or over ``treedef`` (e.g. a named container of them, the parts' leaves in order).

        Each part keeps its own plan (bucket boundaries never span two parts); bucket ``i``
        of part ``k`` becomes bucket ``sum(num_buckets of parts < k) + i``. All parts share
        ``use_distributed_optimizer``; each bucket keeps its part's dp size."""
        if not buffers:
            raise ValueError("GradBuffer.concatenate: no buffers")
        if len({b.use_distributed_optimizer for b in buffers}) != 1:
            raise ValueError("GradBuffer.concatenate: parts must share use_distributed_optimizer")
        n = sum(len(b.slots) for b in buffers)
        if treedef is None:
            treedef = jax.tree_util.treedef_tuple([b.treedef for b in buffers])
        if treedef.num_leaves != n:
            raise ValueError(f"GradBuffer.concatenate: {treedef.num_leaves} leaves, parts {n}")
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, range(n)))[
                0
            ]
        ]
        slots, groups, numels, dtypes, pdtypes, leaves_of = [], [], [], [], [], []
        leaf0 = bucket0 = 0
        for b in buffers:
            for s in b.slots:
                slots.append(
                    dataclasses.replace(
                        s,
                        path=paths[s.index + leaf0],
                        index=s.index + leaf0,
                        pieces=tuple(
                            dataclasses.replace(p, bucket=p.bucket + bucket0) for p in s.pieces
                        ),
                    )
                )
            for g in b.groups:
                groups.append(
                    dataclasses.replace(
                        g,
                        leaf_indices=tuple(i + leaf0 for i in g.leaf_indices),
                        first_bucket=g.first_bucket + bucket0,
                    )
                )
            numels += b.bucket_numels
            dtypes += b.bucket_dtypes
            pdtypes += b.bucket_param_dtypes
            leaves_of += [tuple(i + leaf0 for i in m) for m in b.bucket_leaves]
            leaf0 += len(b.slots)
            bucket0 += b.num_buckets
        return cls(
            treedef=treedef,
            slots=tuple(slots),
            groups=tuple(groups),
            bucket_numels=tuple(numels),
            bucket_dtypes=tuple(dtypes),
            bucket_param_dtypes=tuple(pdtypes),
            bucket_leaves=tuple(leaves_of),
            dp_size=buffers[0].dp_size,
            use_distributed_optimizer=buffers[0].use_distributed_optimizer,
            bucket_dp_sizes=sum((b.bucket_dp_sizes for b in buffers), ()),
        )

    # ----------------------------------------------------------------------------- layout

    @property
    def num_buckets(self) -> int:
        """Number of bucket arrays (over all dtype groups)."""
        return len(self.bucket_numels)

    @property
    def shard_numels(self) -> tuple[int, ...]:
        """Length of one data-parallel rank's shard of each bucket
        (``numel // bucket_dp_sizes[i]``)."""
        return tuple(n // d for n, d in zip(self.bucket_numels, self.bucket_dp_sizes))

    def slot(self, path: str | Sequence[Any]) -> ParamSlot:
        """The :class:`ParamSlot` of a leaf, by ``keystr`` string or key-path tuple."""
        key = path if isinstance(path, str) else jax.tree_util.keystr(tuple(path))
        for s in self.slots:
            if s.path == key:
                return s
        known = ", ".join(s.path for s in self.slots[:8])
        raise ValueError(f"GradBuffer: no parameter at path {key!r}; known: {known}, ...")

    def offset_of(self, path: str | Sequence[Any]) -> tuple[int, int]:
        """``(bucket index, element offset in that bucket)`` of a parameter's gradient.

        This is what the fused op needs: ``wgrad_accumulate(x, dy, buckets[b], offset=o)``.

        Raises:
          ValueError: no such parameter, or it is laid out in row groups (read
            ``slot(path).pieces``).
        """
        s = self.slot(path)
        return s.bucket, s.offset

    def bucket_pieces(self, i: int) -> tuple[tuple[int, SlotPiece], ...]:
        """``(leaf index, piece)`` of every parameter block in bucket ``i``, in offset order
        (a leaf has at most one piece per bucket).

        Raises:
          ValueError: ``i`` is not in ``[0, num_buckets)``.
        """
        if not 0 <= i < self.num_buckets:
            raise ValueError(f"GradBuffer.bucket_pieces: bucket {i} not in [0, {self.num_buckets})")
        return tuple(
            (k, next(p for p in self.slots[k].pieces if p.bucket == i))
            for k in self.bucket_leaves[i]
        )

    @property
    def numel(self) -> int:
        """Elements of all buckets together (padding included)."""
        return sum(self.bucket_numels)

    @property
    def param_numel(self) -> int:
        """Elements that hold parameter gradients."""
        return sum(s.size for s in self.slots)

    def summary(self) -> str:
        """A total line, then per dtype group (or chunk) one plan per row-group bucket
        ("row group rows a..b") and the plan of its other leaves, a line per bucket."""
        pad = self.numel - self.param_numel
        lines = [
            f"{self.num_buckets} bucket(s), {len(self.slots)} params: "
            f"{self.param_numel} param elements, {self.numel} buffer elements, padding "
            f"{pad} ({100.0 * pad / max(self.numel, 1):.2f}%)"
        ]
        for g in self.groups:
            for j, row_plan in enumerate(g.row_plans):
                b = g.first_bucket + j
                start, stop = self.bucket_pieces(b)[0][1].rows
                lines.append(
                    f"group {g.param_dtype}->{g.grad_dtype}, bucket {b}: row group rows "
                    f"{start}..{stop}: " + row_plan.summary()
                )
            if g.plan is not None:
                lines.append(
                    f"group {g.param_dtype}->{g.grad_dtype}, buckets from "
                    f"{g.first_bucket + len(g.row_plans)}: " + g.plan.summary()
                )
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- values

    def zeros(self, *, varying_axes: Sequence[str] = ()) -> Buckets:
        """Fresh zero buckets: a tuple of ``[bucket_numels[i]]`` arrays in the grad dtype.

        Args:
          varying_axes: inside ``shard_map`` (with its default ``check_vma``), mark the
            zeros as varying over these mesh axes (``jax.lax.pcast(..., to="varying")``).
            Needed when the buckets start a ``lax.scan`` carry that accumulates per-device
            gradients: the carry's type must already vary over e.g. ``(DATA,)``.
        """
        out = tuple(jnp.zeros((n,), d) for n, d in zip(self.bucket_numels, self.bucket_dtypes))
        if varying_axes:
            out = tuple(lax.pcast(b, tuple(varying_axes), to="varying") for b in out)
        return out

    def _check_buckets(
        self, buckets: Sequence[jax.Array], what: str, numels: Sequence[int] | None = None
    ) -> None:
        numels = self.bucket_numels if numels is None else numels
        got = [tuple(b.shape) for b in buckets]
        want = [(n,) for n in numels]
        if got != want:
            raise ValueError(
                f"GradBuffer.{what}: expected {len(want)} bucket(s) of shapes {want}, got {got}"
            )

    def _check_tree(self, tree: PyTree, what: str) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"GradBuffer.{what}: tree structure {treedef} differs from the "
                f"buffer's {self.treedef}"
            )
        for s, leaf in zip(self.slots, leaves):
            if tuple(leaf.shape) != s.shape:
                raise ValueError(
                    f"GradBuffer.{what}: leaf {s.path} has shape "
                    f"{tuple(leaf.shape)}, expected {s.shape}"
                )
        return leaves

    def to_tree(self, buckets: Sequence[jax.Array], *, dtype: Any = None) -> PyTree:
        """The gradient tree: each leaf a static slice of its bucket, reshaped (a leaf
        laid out in row groups: its pieces' slices concatenated along axis 0).

        Args:
          buckets: ``len == num_buckets``, ``buckets[i].shape == (bucket_numels[i],)``, any
            dtype (e.g. all-gathered parameters in their compute dtype).
          dtype: optional dtype to cast each leaf to.
        Returns:
          A tree with the parameter tree's structure and (per-device) shapes.
        """
        self._check_buckets(buckets, "to_tree")
        leaves = []
        for s in self.slots:
            blocks = [
                lax.slice(buckets[p.bucket], (p.offset,), (p.offset + p.size,)).reshape(
                    s.piece_shape(p)
                )
                for p in s.pieces
            ]
            v = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0)
            leaves.append(v if dtype is None else v.astype(dtype))
        return jax.tree.unflatten(self.treedef, leaves)

    def from_tree(self, tree: PyTree, *, dtype: Any = None) -> Buckets:
        """Packs a tree shaped like the parameters into buckets; padding is zero.

        Args:
          tree: same structure and leaf shapes as the parameter tree.
          dtype: dtype of all buckets; default each bucket's grad dtype.
        Returns:
          ``num_buckets`` flat arrays.
        """
        leaves = self._check_tree(tree, "from_tree")
        out = []
        for i, n in enumerate(self.bucket_numels):
            dt = self.bucket_dtypes[i] if dtype is None else np.dtype(dtype)
            parts, pos = [], 0
            for k, p in self.bucket_pieces(i):
                if p.offset > pos:
                    parts.append(jnp.zeros((p.offset - pos,), dt))
                parts.append(jnp.ravel(self.slots[k].piece_of(leaves[k], p)).astype(dt))
                pos = p.offset + p.size
            if n > pos:
                parts.append(jnp.zeros((n - pos,), dt))
            out.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
        return tuple(out)

    def add_tree(
        self,
        buckets: Sequence[jax.Array],
        tree: PyTree,
        *,
        where: PyTree | Sequence[bool] | None = None,
    ) -> Buckets:
        """Adds ordinary gradients into their slices: ``bucket[slot] += leaf``; one
        :func:`jax_wgrad.ops.bucket_add` per bucket touched (an in-place custom call
        aliasing the bucket): each leaf reads and writes only its own block, so on a
        donated argument or a scan carry no bucket is copied on CPU or GPU. (A plain
        ``dynamic_update_slice`` at a constant offset copies the whole bucket per leaf on
        XLA:GPU, docs/design/h100_findings.md.) The add is done in fp32 and stored in the
        bucket dtype. Padding is left untouched. A leaf laid out in row groups adds each
        piece's rows ``leaf[start:stop]`` into that piece's bucket.

        Args:
          where: optional static per-leaf flags (tree of bools or a sequence in flatten
            order); leaves flagged False are skipped (e.g. weights whose gradient the fused
            op already accumulated, or parts of the tree that are known to be zero).
        """
        self._check_buckets(buckets, "add_tree")
        leaves = self._check_tree(tree, "add_tree")
        use = (True,) * len(leaves) if where is None else self.flag_values(where)
        per_bucket: dict[int, tuple[list[jax.Array], list[int]]] = {}
        for s, leaf, u in zip(self.slots, leaves, use):
            for p in s.pieces if u else ():
                grads, offsets = per_bucket.setdefault(p.bucket, ([], []))
                grads.append(s.piece_of(leaf, p))
                offsets.append(p.offset)
        out = list(buckets)
        for i, (grads, offsets) in per_bucket.items():
            out[i] = ops.bucket_add(out[i], grads, offsets)
        return tuple(out)

    def wgrad_accumulate(
        self, buckets: Sequence[jax.Array], path: str | Sequence[Any], x: jax.Array, dy: jax.Array
    ) -> Buckets:
        """Fused ``bucket[slot] += (dy^T @ x).ravel()`` for a ``[out, in]`` weight, in place.

        Args:
          buckets: the bucket tuple.
          path: the weight's path (see :meth:`slot`); its shape must be ``[out, in]``.
          x: ``[..., T, in]`` layer input; dy: ``[..., T, out]`` output gradient.
        Returns:
          The bucket tuple with only the weight's bucket replaced.
        Raises:
          ValueError: a shape mismatch, or the weight is laid out in row groups (its
            gradient is not one block).
        """
        s = self.slot(path)
        if s.split:
            raise ValueError(
                f"GradBuffer.wgrad_accumulate: parameter {s.path} is laid out in "
                f"{len(s.pieces)} row groups, not one block; accumulate it with add_tree"
            )
        want = (dy.shape[-1], x.shape[-1])
        if s.shape != want:
            raise ValueError(
                f"GradBuffer.wgrad_accumulate: parameter {s.path} has shape "
                f"{s.shape}, but dy^T @ x is {want}"
            )
        self._check_buckets(buckets, "wgrad_accumulate")
        out = list(buckets)
        out[s.bucket] = ops.wgrad_accumulate(x, dy, out[s.bucket], offset=s.offset)
        return tuple(out)

    def flag_values(self, flags: PyTree | Sequence[bool]) -> tuple[bool, ...]:
        """Per-leaf flags in flatten order, from a tree of bools shaped like the parameters
        or a sequence of bools in flatten order."""
        if (
            isinstance(flags, (list, tuple))
            and len(flags) == len(self.slots)
            and all(isinstance(f, (bool, np.bool_)) for f in flags)
        ):
            return tuple(bool(f) for f in flags)
        return flag_tree("mask flags", flags, self.treedef, len(self.slots))


def _row_layout(
    row_groups: Sequence[int] | None,
    split_rows: PyTree | None,
    treedef: Any,
    paths: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    shared: Sequence[bool],
    key_of: dict[int, tuple[np.dtype, np.dtype]],
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Checked ``(row_groups, per-leaf split flags)`` of :meth:`GradBuffer.create`
    (``((), all False)`` without row groups)."""
    if row_groups is None and split_rows is None:
        return (), (False,) * len(paths)
    if row_groups is None or split_rows is None:
        raise ValueError(
            "GradBuffer.create: row_groups and split_rows go together (both or neither), got "
            f"row_groups={row_groups!r} and split_rows={'None' if split_rows is None else '...'}"
        )
    want = "boundaries (0, b_1, ..., n) over axis 0, strictly increasing from 0, >= 2 entries"
    items = list(row_groups) if isinstance(row_groups, (Sequence, np.ndarray)) else [row_groups]
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in items):
        raise ValueError(
            f"GradBuffer.create: row_groups must be integer {want}, got {row_groups!r}"
        )
    bounds = tuple(int(b) for b in items)
    if len(bounds) < 2 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"GradBuffer.create: row_groups must be {want}, got {bounds}")
    split = flag_tree("split_rows", split_rows, treedef, len(paths))
    flagged = [k for k, f in enumerate(split) if f]
    if not flagged:
        raise ValueError(
            "GradBuffer.create: split_rows flags no leaf; flag the stacked [n, ...] leaves to "
            "lay out in row groups, or pass neither row_groups nor split_rows"
        )
    n, first = bounds[-1], flagged[0]
    for k in flagged:
        if not shapes[k] or shapes[k][0] != n:
            raise ValueError(
                f"GradBuffer.create: leaf {paths[k]} (split_rows) has shape {shapes[k]}; its "
                f"axis 0 must have row_groups[-1] = {n} rows"
            )
        if shared[k]:
            raise ValueError(
                f"GradBuffer.create: leaf {paths[k]} is flagged both split_rows and "
                "shared_embedding; a shared embedding keeps a bucket of its own, flag it in "
                "only one of them"
            )
        if key_of[k] != key_of[first]:
            (p, g), (p0, g0) = key_of[k], key_of[first]
            raise ValueError(
                f"GradBuffer.create: leaf {paths[k]} (split_rows) is in the dtype group "
                f"(param {p}, grad {g}), but the split_rows leaves must all be in one group: "
                f"(param {p0}, grad {g0}), that of {paths[first]}"
            )
    return bounds, split
