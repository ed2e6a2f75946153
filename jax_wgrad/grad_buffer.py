"""Flat, padded gradient buckets (Megatron's ``_ParamAndGradBuffer``) and their sync.

A :class:`GradBuffer` is the static layout; the buffer's *value* is a plain tuple of flat
1-D arrays, one per bucket (``buckets[i].shape == (buffer.bucket_numels[i],)``). Everything
here is meant to run on per-device shards inside ``jax.shard_map``: shapes are the local
(per-device) parameter shapes.

**Why a tuple of per-bucket arrays and not one flat array with bucket offsets.** A bucket is
the unit of communication (one reduce-scatter or all-reduce each) and, in the pipeline
cooldown, the unit whose sync can start once its last gradient is in. With one array per
bucket each collective consumes a whole array (no slice that XLA might copy), each bucket
is its own scan-carry leaf (updated in place, donated independently) and a bucket can be
reduced, freed or kept without touching the others. Megatron's single allocation with
bucket *views* has no JAX counterpart (arrays have no views), so contiguity across buckets
buys nothing here. Inside a bucket the layout is exactly Megatron's
(:func:`jax_wgrad.buckets.plan_buckets`), so ``offset`` values and shard ranges match.

**Parameter order.** Registration (forward) order is the flatten order of the parameter
tree (``jax.tree.leaves``). Note that ``dict`` and ``nnx.State`` flatten by *sorted key*,
not insertion order; pass lists/tuples or ``collections.OrderedDict`` (flattened in
insertion order) if the bucket order matters to you (:func:`jax_wgrad.gpt.forward_order`
does this for the GPT). As in Megatron the walk is reversed: the last leaf lands at
offset 0 of bucket 0.

**Chunks.** Megatron keeps one buffer per model chunk (and dtype); :meth:`concatenate`
joins separately planned buffers into one whose tree is the tuple of their trees and whose
buckets are theirs, in order -- e.g. a pipeline stage's own layers and the embedding/head
parameters that are shared between stages and synced at a different time.

**Dtype groups.** Like Megatron, parameters are grouped by ``(param dtype, grad dtype)``
(groups in order of first appearance); each group gets its own :class:`BucketPlan` and its
buckets follow the previous group's in the tuple. With the default ``grad_dtype=float32``
this means one group per parameter dtype.

Example, inside ``shard_map`` over ``data``::

    buf = GradBuffer.create(params, dp_size=8, bucket_size=40_000_000,
                            use_distributed_optimizer=True)
    buckets = buf.zeros()
    buckets = buf.add_tree(buckets, grads)              # ordinary gradients
    buckets = buf.wgrad_accumulate(buckets, "['w']", x, dy)   # fused GEMM, in place
    shards = sync_buckets(buckets, axis_name="data", use_distributed_optimizer=True)
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
from jax_wgrad.buckets import BucketPlan, plan_buckets

__all__ = ["GradBuffer", "ParamSlot", "BufferGroup", "sync_buckets", "shard_buckets"]

PyTree = Any
Buckets = tuple[jax.Array, ...]
AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives.

    Attributes:
      path: ``jax.tree_util.keystr`` of the leaf's key path (e.g. ``"['layer']['w']"``).
      index: position of the leaf in the tree's flatten order.
      shape, param_dtype: the (per-device) parameter's shape and dtype.
      bucket: index of its bucket in the buffer's tuple.
      offset: start of its elements within that bucket array (row-major flattening).
      size: number of elements.
    """

    path: str
    index: int
    shape: tuple[int, ...]
    param_dtype: np.dtype
    bucket: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class BufferGroup:
    """One ``(param dtype, grad dtype)`` group: Megatron's per-dtype ``_ParamAndGradBuffer``.

    Attributes:
      param_dtype, grad_dtype: the group's dtypes.
      leaf_indices: flatten indices of its parameters, in registration order.
      plan: the bucket layout (``plan.param_ranges[k]`` is for ``leaf_indices[k]``;
        offsets there are relative to the group's buffer, not to a bucket).
      first_bucket: index of the group's bucket 0 in the buffer's tuple.
    """

    param_dtype: np.dtype
    grad_dtype: np.dtype
    leaf_indices: tuple[int, ...]
    plan: BucketPlan
    first_bucket: int


def _leaf_shape_dtype(path: str, leaf) -> tuple[tuple[int, ...], np.dtype]:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise ValueError(
            f"GradBuffer: leaf {path} must be an array or jax.ShapeDtypeStruct, got "
            f"{type(leaf).__name__}")
    shape = tuple(int(d) for d in leaf.shape)
    dtype = np.dtype(leaf.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"GradBuffer: leaf {path} has non-float dtype {dtype}")
    if int(np.prod(shape, dtype=np.int64)) == 0:
        raise ValueError(f"GradBuffer: leaf {path} has no elements (shape {shape})")
    return shape, dtype


def _flags(name: str, tree: PyTree, treedef, n: int) -> tuple[bool, ...]:
    """Per-leaf booleans from a tree shaped like the parameters (or ``None``: all False)."""
    if tree is None:
        return (False,) * n
    leaves, got = jax.tree.flatten(tree)
    if got != treedef:
        raise ValueError(
            f"GradBuffer: {name} must have the parameter tree's structure {treedef}, got {got}")
    return tuple(bool(v) for v in leaves)


@dataclasses.dataclass(frozen=True)
class GradBuffer:
    """Static layout of the flat gradient buckets of one parameter tree.

    Build it with :meth:`create`. It is hashable (usable as a static argument) and holds no
    arrays. Attributes:

      treedef: structure of the parameter tree.
      slots: one :class:`ParamSlot` per leaf, in flatten order.
      groups: the ``(param dtype, grad dtype)`` groups, each with its Megatron plan.
      bucket_numels: padded length of each bucket array.
      bucket_dtypes: gradient dtype of each bucket.
      bucket_param_dtypes: parameter dtype of each bucket (the all-gather dtype).
      bucket_leaves: flatten indices of each bucket's leaves, in buffer (offset) order.
      dp_size, use_distributed_optimizer: as passed to :meth:`create`.
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
            as in :func:`jax_wgrad.buckets.plan_buckets` (Megatron's names).
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
        shapes_dtypes = [_leaf_shape_dtype(p, leaf) for p, (_, leaf) in zip(paths, with_path)]
        shared = _flags("shared_embedding", shared_embedding, treedef, len(paths))

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
                    path=paths[k], index=k, shape=shapes_dtypes[k][0], param_dtype=pdt,
                    bucket=first + bid, offset=start - plan.buckets[bid].offset,
                    size=end - start)
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
    def concatenate(cls, buffers: Sequence[GradBuffer]) -> GradBuffer:
        """One buffer over the tuple of the buffers' trees (Megatron: a buffer per chunk).

        Each part keeps its own plan (bucket boundaries never span two parts); bucket ``i``
        of part ``k`` becomes bucket ``sum(num_buckets of parts < k) + i``; paths get the
        ``[k]`` prefix of the tuple. All parts must share ``dp_size`` and
        ``use_distributed_optimizer``.
        """
        if not buffers:
            raise ValueError("GradBuffer.concatenate: no buffers")
        if len({(b.dp_size, b.use_distributed_optimizer) for b in buffers}) != 1:
            raise ValueError("GradBuffer.concatenate: parts must share dp_size and "
                             "use_distributed_optimizer")
        slots, groups, numels, dtypes, pdtypes, leaves_of = [], [], [], [], [], []
        leaf0 = bucket0 = 0
        for k, b in enumerate(buffers):
            for s in b.slots:
                slots.append(dataclasses.replace(
                    s, path=f"[{k}]{s.path}", index=s.index + leaf0, bucket=s.bucket + bucket0))
            for g in b.groups:
                groups.append(dataclasses.replace(
                    g, leaf_indices=tuple(i + leaf0 for i in g.leaf_indices),
                    first_bucket=g.first_bucket + bucket0))
            numels += b.bucket_numels
            dtypes += b.bucket_dtypes
            pdtypes += b.bucket_param_dtypes
            leaves_of += [tuple(i + leaf0 for i in m) for m in b.bucket_leaves]
            leaf0 += len(b.slots)
            bucket0 += b.num_buckets
        return cls(
            treedef=jax.tree_util.treedef_tuple([b.treedef for b in buffers]),
            slots=tuple(slots), groups=tuple(groups), bucket_numels=tuple(numels),
            bucket_dtypes=tuple(dtypes), bucket_param_dtypes=tuple(pdtypes),
            bucket_leaves=tuple(leaves_of), dp_size=buffers[0].dp_size,
            use_distributed_optimizer=buffers[0].use_distributed_optimizer)

    # ----------------------------------------------------------------------------- layout

    @property
    def num_buckets(self) -> int:
        """Number of bucket arrays (over all dtype groups)."""
        return len(self.bucket_numels)

    @property
    def shard_numels(self) -> tuple[int, ...]:
        """Length of one data-parallel rank's shard of each bucket (``numel // dp_size``)."""
        return tuple(n // self.dp_size for n in self.bucket_numels)

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
        lines = [f"{self.num_buckets} bucket(s), {len(self.slots)} params: "
                 f"{self.param_numel} param elements, {self.numel} buffer elements, padding "
                 f"{pad} ({100.0 * pad / max(self.numel, 1):.2f}%)"]
        for g in self.groups:
            lines.append(f"group {g.param_dtype}->{g.grad_dtype}, buckets from "
                         f"{g.first_bucket}: " + g.plan.summary())
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- values

    def zeros(self, *, varying_axes: Sequence[str] = ()) -> Buckets:
        """Fresh zero buckets: a tuple of ``[bucket_numels[i]]`` arrays in the grad dtype.

        Args:
          varying_axes: inside ``shard_map`` (with its default ``check_vma``), mark the
            zeros as varying over these mesh axes (``jax.lax.pcast(..., to="varying")``).
            Needed when the buckets start a ``lax.scan`` carry that accumulates per-device
            gradients: the carry's type must already vary over e.g. ``("data",)``.
        """
        out = tuple(jnp.zeros((n,), d) for n, d in zip(self.bucket_numels, self.bucket_dtypes))
        if varying_axes:
            out = tuple(lax.pcast(b, tuple(varying_axes), to="varying") for b in out)
        return out

    def _check_buckets(self, buckets: Sequence[jax.Array], what: str,
                       numels: Sequence[int] | None = None) -> None:
        numels = self.bucket_numels if numels is None else numels
        got = [tuple(b.shape) for b in buckets]
        want = [(n,) for n in numels]
        if got != want:
            raise ValueError(f"GradBuffer.{what}: expected {len(want)} bucket(s) of shapes "
                             f"{want}, got {got}")

    def _check_tree(self, tree: PyTree, what: str) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"GradBuffer.{what}: tree structure {treedef} differs from the "
                             f"buffer's {self.treedef}")
        for s, leaf in zip(self.slots, leaves):
            if tuple(leaf.shape) != s.shape:
                raise ValueError(f"GradBuffer.{what}: leaf {s.path} has shape "
                                 f"{tuple(leaf.shape)}, expected {s.shape}")
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

    def add_tree(self, buckets: Sequence[jax.Array], tree: PyTree, *,
                 where: PyTree | Sequence[bool] | None = None) -> Buckets:
        """Adds ordinary gradients into their slices: ``bucket[slot] += leaf``.

        One :func:`jax_wgrad.ops.bucket_add` per bucket touched (an in-place custom call
        aliasing the bucket): each leaf reads and writes only its own block, so on a
        donated argument or a scan carry no bucket is copied on CPU or GPU. (A plain
        ``dynamic_update_slice`` at a constant offset copies the whole bucket per leaf on
        XLA:GPU, ../shared/gpu/FINDINGS.md.) The add is done in fp32 and stored in the
        bucket dtype. Padding is left untouched.

        Args:
          where: optional static per-leaf flags (tree of bools or a sequence in flatten
            order); leaves flagged False are skipped (e.g. weights whose gradient the fused
            op already accumulated, or parts of the tree that are known to be zero).
        """
        self._check_buckets(buckets, "add_tree")
        leaves = self._check_tree(tree, "add_tree")
        use = (True,) * len(leaves) if where is None else self._flag_values(where)
        per_bucket: dict[int, tuple[list[jax.Array], list[int]]] = {}
        for s, leaf, u in zip(self.slots, leaves, use):
            if u:
                grads, offsets = per_bucket.setdefault(s.bucket, ([], []))
                grads.append(leaf)
                offsets.append(s.offset)
        out = list(buckets)
        for i, (grads, offsets) in per_bucket.items():
            out[i] = ops.bucket_add(out[i], grads, offsets)
        return tuple(out)

    def wgrad_accumulate(self, buckets: Sequence[jax.Array], path: str | Sequence[Any],
                         x: jax.Array, dy: jax.Array) -> Buckets:
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
            raise ValueError(f"GradBuffer.wgrad_accumulate: parameter {s.path} has shape "
                             f"{s.shape}, but dy^T @ x is {want}")
        self._check_buckets(buckets, "wgrad_accumulate")
        out = list(buckets)
        out[s.bucket] = ops.wgrad_accumulate(x, dy, out[s.bucket], offset=s.offset)
        return tuple(out)

    def flat_mask(self, flags: PyTree | Sequence[bool], *, dtype: Any = np.float32
                  ) -> tuple[np.ndarray, ...]:
        """Per-element version of a per-parameter flag: one numpy array per bucket.

        Args:
          flags: tree of bools shaped like the parameters, or a sequence of bools in
            flatten order (e.g. ``True`` where weight decay applies).
          dtype: dtype of the result (float32: 1.0 / 0.0).
        Returns:
          Static numpy arrays, ``[bucket_numels[i]]`` each; padding is 0.
        """
        values = self._flag_values(flags)
        out = [np.zeros((n,), dtype) for n in self.bucket_numels]
        for s, v in zip(self.slots, values):
            if v:
                out[s.bucket][s.offset:s.offset + s.size] = 1
        return tuple(out)

    def _flag_values(self, flags: PyTree | Sequence[bool]) -> tuple[bool, ...]:
        if isinstance(flags, (list, tuple)) and len(flags) == len(self.slots) and all(
                isinstance(f, (bool, np.bool_)) for f in flags):
            return tuple(bool(f) for f in flags)
        return _flags("mask flags", flags, self.treedef, len(self.slots))

    def local_mask(self, flags: PyTree | Sequence[bool], *, axis_name: AxisName | None
                   ) -> Buckets:
        """Per-element bool mask of this rank's shard of each bucket (or whole buckets).

        The traced counterpart of :meth:`flat_mask` for use inside ``shard_map``: built from
        the flagged parameters' ``[start, end)`` runs with ``searchsorted`` over the rank's
        global element indices, so no bucket-sized constant enters the program.

        Args:
          flags: as in :meth:`flat_mask`.
          axis_name: the data axis whose rank selects the shard (``shard_buckets``'s
            slicing); ``None`` for the whole buckets.
        Returns:
          One bool array per bucket, ``[shard_numels[i]]`` or ``[bucket_numels[i]]``.
        """
        values = self._flag_values(flags)
        if axis_name is None:
            dp, rank = 1, 0
        else:
            dp, rank = _axis_size(axis_name), _axis_index(axis_name)
        out = []
        for i, n in enumerate(self.bucket_numels):
            if n % dp:
                raise ValueError(f"GradBuffer.local_mask: bucket {i} ({n} elements) is not "
                                 f"divisible by the {dp} ranks of {axis_name!r}")
            size = n // dp
            runs: list[list[int]] = []  # merged [start, end) of flagged slots, in order
            for k in self.bucket_leaves[i]:
                s = self.slots[k]
                if not values[k]:
                    continue
                if runs and runs[-1][1] == s.offset:
                    runs[-1][1] = s.offset + s.size
                else:
                    runs.append([s.offset, s.offset + s.size])
            if not runs:
                out.append(jnp.zeros((size,), bool))
                continue
            if runs == [[0, n]]:
                out.append(jnp.ones((size,), bool))
                continue
            starts = jnp.asarray([r[0] for r in runs], jnp.int32)
            ends = jnp.asarray([r[1] for r in runs], jnp.int32)
            idx = rank * size + lax.iota(jnp.int32, size)
            pos = jnp.searchsorted(starts, idx, side="right") - 1
            out.append((pos >= 0) & (idx < ends[jnp.maximum(pos, 0)]))
        return tuple(out)


def _axis_size(axis_name: AxisName) -> int:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    size = 1
    for n in names:
        size *= lax.axis_size(n)
    return size


def _axis_index(axis_name: AxisName) -> jax.Array:
    return lax.axis_index(axis_name if isinstance(axis_name, str) else tuple(axis_name))


def sync_buckets(
    buckets: Sequence[jax.Array],
    *,
    axis_name: AxisName,
    use_distributed_optimizer: bool,
    gradient_scaling_factor: float | jax.Array | None = None,
    average_in_collective: bool = False,
) -> Buckets:
    """Data-parallel gradient sync, one collective per bucket (Megatron's ``start_grad_sync``).

    Call inside ``shard_map``. Each bucket is first multiplied by
    ``gradient_scaling_factor`` (skipped when it is the constant 1), then

    * ``use_distributed_optimizer``: ``psum_scatter(tiled=True)`` over ``axis_name``; rank
      ``r`` keeps the ``r``-th contiguous ``numel / dp`` slice (= ``buckets.shard_range``);
    * otherwise: ``psum`` (all-reduce), every rank keeps the whole bucket.

    With ``average_in_collective`` the factor defaults to 1 and the reduced result is divided
    by the axis size after the collective (the JAX spelling of NCCL's ``ReduceOp.AVG``:
    XLA has no averaging reduce-scatter; dividing the shard costs ``numel / dp`` flops).
    Without it the factor defaults to ``1 / dp`` (pre-scaling, Megatron's default).

    Args:
      buckets: flat per-bucket arrays ``[numel_i]`` (this device's accumulated grads).
      axis_name: the data-parallel mesh axis (or a tuple of axes, e.g. data and context).
      use_distributed_optimizer: reduce-scatter instead of all-reduce.
      gradient_scaling_factor: pre-collective scale; default as above (MoE expert grads
        pass ``expert_dp / dp`` here, as Megatron does).
      average_in_collective: Megatron's ``average_in_collective``.
    Returns:
      Tuple of ``[numel_i / dp]`` shards (distributed optimizer) or ``[numel_i]`` buckets.
    Raises:
      ValueError: under the distributed optimizer, if a bucket is not divisible by dp.
    """
    dp = _axis_size(axis_name)
    if gradient_scaling_factor is None:
        gradient_scaling_factor = 1.0 if average_in_collective else 1.0 / dp
    out = []
    for i, b in enumerate(buckets):
        if b.ndim != 1:
            raise ValueError(f"sync_buckets: bucket {i} must be flat, got shape {b.shape}")
        if not (isinstance(gradient_scaling_factor, (int, float))
                and gradient_scaling_factor == 1.0):
            b = b * jnp.asarray(gradient_scaling_factor, b.dtype)
        if use_distributed_optimizer:
            if b.shape[0] % dp:
                raise ValueError(
                    f"sync_buckets: bucket {i} has {b.shape[0]} elements, not divisible by the "
                    f"{dp} ranks of {axis_name!r}; plan the buffer with "
                    f"use_distributed_optimizer=True and dp_size={dp}")
            r = lax.psum_scatter(b, axis_name, scatter_dimension=0, tiled=True)
        else:
            r = lax.psum(b, axis_name)
        if average_in_collective:
            r = r / jnp.asarray(dp, r.dtype)
        out.append(r)
    return tuple(out)


def shard_buckets(buckets: Sequence[jax.Array | np.ndarray], *, axis_name: AxisName
                  ) -> Buckets:
    """This rank's contiguous ``numel / dp`` slice of each (replicated) bucket.

    The slice a tiled reduce-scatter leaves on the rank (``buckets.shard_range``). Used for
    master weights and per-element masks. Call inside ``shard_map``.
    """
    dp = _axis_size(axis_name)
    rank = _axis_index(axis_name)
    out = []
    for i, b in enumerate(buckets):
        if b.ndim != 1 or b.shape[0] % dp:
            raise ValueError(f"shard_buckets: bucket {i} of shape {b.shape} is not a flat "
                             f"array divisible by the {dp} ranks of {axis_name!r}")
        size = b.shape[0] // dp
        out.append(lax.dynamic_slice(jnp.asarray(b), (rank * size,), (size,)))
    return tuple(out)
