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

Example, inside ``shard_map`` over ``data``::

    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    buckets = buf.wgrad_accumulate(buf.add_tree(buf.zeros(), grads), "['w']", x, dy)
    shards = sync_buckets(buckets, axis_name=DATA, use_distributed_optimizer=True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad import ops
from jax_wgrad.grads.plan import plan_buckets
from jax_wgrad.grads.slots import BufferGroup, ParamSlot, flag_tree, leaf_shape_dtype

__all__ = ["GradBuffer", "ParamSlot", "BufferGroup"]

PyTree = Any
Buckets = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class GradBuffer:
    """Static layout of the flat gradient buckets of one parameter tree.

    Built by :meth:`create`; hashable (a static argument), no arrays. Attributes:

      treedef: structure of the parameter tree.
      slots: one :class:`ParamSlot` per leaf, in flatten order.
      groups: the ``(param dtype, grad dtype)`` groups, each with its Megatron plan.
      bucket_numels: padded length of each bucket array.
      bucket_dtypes: gradient dtype of each bucket.
      bucket_param_dtypes: parameter dtype of each bucket (the all-gather dtype).
      bucket_leaves: flatten indices of each bucket's leaves, in buffer (offset) order.
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
        Returns:
          The layout.
        Raises:
          ValueError: on an empty tree, a non-float or empty leaf, a mismatched
            ``shared_embedding`` tree, or invalid plan arguments.
        """
        with_path, treedef = jax.tree_util.tree_flatten_with_path(param_tree)
        if not with_path:
            raise ValueError("GradBuffer.create: param_tree has no leaves")
        paths = [jax.tree_util.keystr(p) for p, _ in with_path]
        shapes_dtypes = [leaf_shape_dtype(p, leaf) for p, (_, leaf) in zip(paths, with_path)]
        shared = flag_tree("shared_embedding", shared_embedding, treedef, len(paths))

        # Group by (param dtype, grad dtype), in order of first appearance (Megatron's dict).
        keyed: dict[tuple[np.dtype, np.dtype], list[int]] = {}
        for k, (_, dt) in enumerate(shapes_dtypes):
            gdt = dt if grad_dtype is None else np.dtype(grad_dtype)
            keyed.setdefault((dt, gdt), []).append(k)

        slots: list[ParamSlot | None] = [None] * len(paths)
        groups, numels, dtypes, pdtypes, leaves_of = [], [], [], [], []
        for (pdt, gdt), idx in keyed.items():
            plan = plan_buckets(
                [int(np.prod(shapes_dtypes[k][0])) for k in idx],
                dp_size=dp_size,
                bucket_size=bucket_size,
                use_distributed_optimizer=use_distributed_optimizer,
                pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
                shared_embedding=[shared[k] for k in idx],
            )
            first = len(numels)
            groups.append(BufferGroup(pdt, gdt, tuple(idx), plan, first))
            for b in plan.buckets:
                numels.append(b.numel)
                dtypes.append(gdt)
                pdtypes.append(pdt)
                leaves_of.append(tuple(idx[j] for j in b.param_indices))
            for j, (start, end, bid) in enumerate(plan.param_ranges):
                k = idx[j]
                slots[k] = ParamSlot(
                    path=paths[k],
                    index=k,
                    shape=shapes_dtypes[k][0],
                    param_dtype=pdt,
                    bucket=first + bid,
                    offset=start - plan.buckets[bid].offset,
                    size=end - start,
                )
        return cls(
            treedef=treedef,
            slots=tuple(slots),  # type: ignore[arg-type]
            groups=tuple(groups),
            bucket_numels=tuple(numels),
            bucket_dtypes=tuple(dtypes),
            bucket_param_dtypes=tuple(pdtypes),
            bucket_leaves=tuple(leaves_of),
            dp_size=groups[0].plan.dp_size,
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
                        bucket=s.bucket + bucket0,
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
        """
        s = self.slot(path)
        return s.bucket, s.offset

    @property
    def numel(self) -> int:
        """Elements of all buckets together (padding included)."""
        return sum(self.bucket_numels)

    @property
    def param_numel(self) -> int:
        """Elements that hold parameter gradients."""
        return sum(s.size for s in self.slots)

    def summary(self) -> str:
        """A total line, then one line per dtype group (or chunk) and bucket."""
        pad = self.numel - self.param_numel
        lines = [
            f"{self.num_buckets} bucket(s), {len(self.slots)} params: "
            f"{self.param_numel} param elements, {self.numel} buffer elements, padding "
            f"{pad} ({100.0 * pad / max(self.numel, 1):.2f}%)"
        ]
        for g in self.groups:
            lines.append(
                f"group {g.param_dtype}->{g.grad_dtype}, buckets from "
                f"{g.first_bucket}: " + g.plan.summary()
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
        """The gradient tree: each leaf a static slice of its bucket, reshaped.

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
            v = lax.slice(buckets[s.bucket], (s.offset,), (s.offset + s.size,)).reshape(s.shape)
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
        for i, (n, members) in enumerate(zip(self.bucket_numels, self.bucket_leaves)):
            dt = self.bucket_dtypes[i] if dtype is None else np.dtype(dtype)
            pieces, pos = [], 0
            for k in members:
                s = self.slots[k]
                if s.offset > pos:
                    pieces.append(jnp.zeros((s.offset - pos,), dt))
                pieces.append(jnp.ravel(leaves[k]).astype(dt))
                pos = s.offset + s.size
            if n > pos:
                pieces.append(jnp.zeros((n - pos,), dt))
            out.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
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
        bucket dtype. Padding is left untouched.

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
            if u:
                per_bucket.setdefault(s.bucket, ([], []))[0].append(leaf)
                per_bucket[s.bucket][1].append(s.offset)
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
        """
        s = self.slot(path)
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
