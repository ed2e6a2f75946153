"""Distributed optimizer (Megatron's ``use_distributed_optimizer``) and gradient finalization.

Runs inside ``shard_map``, after :func:`jax_wgrad.grads.sync_buckets`:

* **distributed** (the buffer was planned with ``use_distributed_optimizer=True``): each
  data-parallel rank keeps fp32 master weights and optax state only for its contiguous
  ``numel / dp`` shard of every bucket. optax runs on the tuple of flat shards; the updated
  shards are cast to the parameter dtype and all-gathered (``all_gather(tiled=True)``, one
  per bucket) and unpacked into the parameter tree.
* **replicated** (``use_distributed_optimizer=False``): the all-reduced buckets are unpacked
  into a gradient tree and optax updates fp32 master weights of the whole tree on every rank.

Step order follows Megatron's ``MixedPrecisionOptimizer.step``: global gradient norm in fp32
(:func:`global_grad_norm`) -> skip the step if it is not finite -> clip by the total norm
(:func:`clip_by_total_norm`, ``clip_grad_norm_fp32``'s coefficient) -> optax update ->
parameters.

**Per-parameter options on flat shards.** A shard cuts through parameters, so per-leaf optax
masks (``optax.adamw(mask=...)``) cannot be used in distributed mode. Per-parameter flags
are turned into per-element masks of the rank's shard
(:func:`jax_wgrad.grads.local_mask`, from the parameters' ranges) and handed to the optax
chain as the extra argument ``weight_decay_mask``; :func:`jax_wgrad.optim.adamw` consumes
it. Only element-wise optimizers are correct on flat shards (Adam, SGD, ... as in
Megatron; not LAMB/LARS trust ratios or Adafactor's factored moments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jax_wgrad.grads.buffer import GradBuffer
from jax_wgrad.grads.masks import local_mask
from jax_wgrad.grads.sync import AxisName, axis_size, shard_buckets
from jax_wgrad.optim.transforms import clip_by_total_norm, global_grad_norm
from jax_wgrad.parallel.mesh import DATA

__all__ = ["DistributedOptimizer", "OptimizerState", "StepInfo"]

PyTree = Any


class OptimizerState(NamedTuple):
    """Per-device optimizer state.

    Attributes:
      master: fp32 master weights: a tuple of ``[shard_numels[i]]`` shards (distributed) or
        a tree shaped like the parameters (replicated).
      inner: the optax state for ``master``.
    """

    master: PyTree
    inner: optax.OptState


class StepInfo(NamedTuple):
    """What a step did.

    Attributes:
      grad_norm: fp32 global norm of the (synced, unclipped) gradients.
      clip_coeff: the factor gradients were multiplied by (1 without clipping).
      skipped: True when the norm was not finite; parameters and state are unchanged.
    """

    grad_norm: jax.Array
    clip_coeff: jax.Array
    skipped: jax.Array


def _all_gather_params(shard: jax.Array, axis_name: AxisName) -> jax.Array:
    """Tiled all-gather whose result is typed invariant over ``axis_name`` where jax allows.

    Every rank gathers the same full bucket, so the parameters are replicated over the data
    axis; ``to="invarying"`` (jax >= 0.10) tells ``shard_map``'s type check so, letting
    callers return them with ``out_specs`` that do not mention ``data``. Older/newer jax
    without that option get the plain (``varying``) all-gather.
    """
    try:
        return lax.all_gather(shard, axis_name, axis=0, tiled=True, to="invarying")
    except (TypeError, ValueError, NotImplementedError):
        return lax.all_gather(shard, axis_name, axis=0, tiled=True)


def _names(axis: AxisName) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _normalize_flags(buffer: GradBuffer, name: str, tree: PyTree | None
                     ) -> tuple[bool, ...] | None:
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != buffer.treedef:
        raise ValueError(f"DistributedOptimizer: {name} must be a tree of bools shaped like "
                         f"the parameters {buffer.treedef}, got {treedef}")
    return tuple(bool(v) for v in leaves)


@dataclasses.dataclass(frozen=True)
class DistributedOptimizer:
    """optax on this rank's shard of the gradient buckets, or on the replicated tree.

    Build with :meth:`create`; call :meth:`init` and :meth:`step` inside ``shard_map``.
    Attributes (all static):

      buffer: the bucket layout; its ``use_distributed_optimizer`` selects the mode.
      tx: the optax transformation (extra-args capable; see :func:`adamw`).
      data_axis: the data-parallel mesh axis (or axes; size must equal ``buffer.dp_size``).
      bucket_axes: per bucket, the axes it is synced and sharded over (default
        ``data_axis`` for all); their sizes must equal ``buffer.bucket_dp_sizes``. Expert
        buckets use a subset of ``data_axis`` (the expert-data-parallel ranks): the
        experts differ along the rest, so there they are summed in the norm.
      model_axes: other mesh axes the model is split over (``tensor``, ``pipeline``,
        ...): partial norms are summed over them.
      clip_grad: Megatron's ``clip_grad``; ``None`` or 0 disables clipping.
      weight_decay_flags: per-leaf weight-decay flags in flatten order (``None``: all).
      duplicated: ``(axis, per-leaf flags)`` pairs: a flagged leaf holds the *same*
        gradient on every device along ``axis`` (a layernorm scale replicated over
        ``tensor``; a tied embedding present on two pipeline stages); it is counted in the
        norm only where ``axis_index(axis) == 0`` (Megatron's
        ``param_is_not_tensor_parallel_duplicate`` / ``is_not_shared``).
    """

    buffer: GradBuffer
    tx: optax.GradientTransformationExtraArgs
    data_axis: AxisName = DATA
    bucket_axes: tuple[AxisName, ...] | None = None
    model_axes: tuple[str, ...] = ()
    clip_grad: float | None = None
    weight_decay_flags: tuple[bool, ...] | None = None
    duplicated: tuple[tuple[str, tuple[bool, ...]], ...] = ()

    @classmethod
    def create(
        cls,
        buffer: GradBuffer,
        tx: optax.GradientTransformation,
        *,
        data_axis: AxisName = DATA,
        bucket_axes: Sequence[AxisName] | None = None,
        model_axes: Sequence[str] = (),
        clip_grad: float | None = None,
        weight_decay_mask: PyTree | None = None,
        duplicated: Mapping[str, PyTree] | None = None,
    ) -> DistributedOptimizer:
        """Validates and freezes the options.

        Args:
          buffer: layout of the gradient buckets (per-device parameter shapes).
          tx: any optax transformation of element-wise type; plain ones are wrapped with
            :func:`optax.with_extra_args_support`. Use :func:`adamw` for a masked decay.
          data_axis: data-parallel axis name (or a tuple of axes).
          bucket_axes: see the class docstring; each must be ``data_axis`` or a subset
            of its axes.
          model_axes: axes over which devices hold different parameters; must not
            contain ``data_axis``.
          clip_grad: clip the global norm to this value (> 0); ``None``/0: no clipping.
          weight_decay_mask: tree of bools shaped like the parameters (True: decay), passed
            to ``tx`` as the ``weight_decay_mask`` extra argument. ``None``: decay all.
          duplicated: ``{axis: tree of bools}``, see the class docstring; each axis must
            be in ``model_axes``.
        Raises:
          ValueError: on a negative ``clip_grad``, mismatched trees or unknown axes.
        """
        model_axes = tuple(model_axes)
        data_names = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
        if set(data_names) & set(model_axes):
            raise ValueError(f"DistributedOptimizer: model_axes {model_axes} must not contain "
                             f"the data axis {data_axis!r}")
        if clip_grad is not None and (not np.isfinite(clip_grad) or clip_grad < 0):
            raise ValueError(f"DistributedOptimizer: clip_grad must be >= 0, got {clip_grad}")
        dup = []
        for axis, tree in (duplicated or {}).items():
            if axis not in model_axes:
                raise ValueError(f"DistributedOptimizer: duplicated axis {axis!r} is not one "
                                 f"of model_axes {model_axes}")
            dup.append((axis, _normalize_flags(buffer, f"duplicated[{axis!r}]", tree)))
        if bucket_axes is not None:
            bucket_axes = tuple(bucket_axes)
            if len(bucket_axes) != buffer.num_buckets:
                raise ValueError(f"DistributedOptimizer: {len(bucket_axes)} bucket_axes for "
                                 f"{buffer.num_buckets} buckets")
            wrong = [a for a in bucket_axes if not set(_names(a)) <= set(data_names)]
            if wrong:
                raise ValueError(f"DistributedOptimizer: bucket axes {wrong} are not within "
                                 f"the data axis {data_axis!r}")
        if not isinstance(tx, optax.GradientTransformationExtraArgs):
            tx = optax.with_extra_args_support(tx)
        return cls(
            buffer=buffer,
            tx=tx,
            data_axis=data_axis,
            bucket_axes=bucket_axes,
            model_axes=model_axes,
            clip_grad=float(clip_grad) if clip_grad else None,
            weight_decay_flags=_normalize_flags(buffer, "weight_decay_mask", weight_decay_mask),
            duplicated=tuple(dup),
        )

    @property
    def distributed(self) -> bool:
        """Whether master weights and optax state are sharded over ``data_axis``."""
        return self.buffer.use_distributed_optimizer

    def _axes(self) -> tuple[AxisName, ...]:
        """Per bucket: the axes it is sharded over."""
        return self.bucket_axes or (self.data_axis,) * self.buffer.num_buckets

    def _shard(self, buckets: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(shard_buckets((b,), axis_name=a)[0] for b, a in zip(buckets, self._axes()))

    def _spread_axes(self) -> tuple[tuple[str, tuple[bool, ...]], ...]:
        """Replicated mode: ``(axis, per-leaf flags)`` for each data axis that some
        buckets are NOT synced over (their parameters differ along it, e.g. experts over
        ``expert``): the norm sums over it, counting the flagged leaves (replicated along
        it) once."""
        axes = self._axes()
        out = []
        for name in _names(self.data_axis):
            over = [name in _names(a) for a in axes]
            if not all(over):
                out.append((name, tuple(over[s.bucket] for s in self.buffer.slots)))
        return tuple(out)

    def _check_axis(self) -> None:
        dp = axis_size(self.data_axis)
        if dp != self.buffer.dp_size:
            raise ValueError(f"DistributedOptimizer: axis {self.data_axis!r} has {dp} devices "
                             f"but the buffer was planned for dp_size={self.buffer.dp_size}")
        for i, (a, n) in enumerate(zip(self._axes(), self.buffer.bucket_dp_sizes)):
            if axis_size(a) != n:
                raise ValueError(f"DistributedOptimizer: bucket {i} is sharded over {a!r} "
                                 f"({axis_size(a)} devices) but was planned for {n}")

    # -- init

    def init(self, params: PyTree) -> OptimizerState:
        """fp32 master weights (this rank's shards, or the tree) and the optax state.

        Args:
          params: the per-device parameter tree (any float dtypes), equal on all data ranks.
        """
        self._check_axis()
        if self.distributed:
            master = self._shard(self.buffer.from_tree(params, dtype=jnp.float32))
        else:
            self.buffer._check_tree(params, "init")
            master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return OptimizerState(master, self.tx.init(master))

    # -- layout-independent form (checkpoints)

    def map_param_parts(self, fn, state: OptimizerState) -> OptimizerState:
        """Applies ``fn`` to ``master`` and to every parameter-shaped part of the optax
        state (located with :func:`optax.tree_map_params`: the subtrees shaped like
        ``master``), leaving counts and the like as they are."""
        structure = jax.tree.structure(state.master)
        is_part = lambda v: jax.tree.structure(v) == structure
        inner = optax.tree_map_params(self.tx, fn, state.inner, is_leaf=is_part)
        return OptimizerState(fn(state.master), inner)

    def state_to_tree(self, state: OptimizerState) -> OptimizerState:
        """The per-device state with every parameter-shaped part (master weights, Adam
        moments) as this device's parameter tree: bucket shards are all-gathered over the
        data axis and unpacked. Call inside ``shard_map``; the inverse of
        :meth:`state_from_tree`."""
        if not self.distributed:
            return state
        self._check_axis()

        def gather(shards):
            full = tuple(lax.all_gather(s, a, axis=0, tiled=True)
                         for s, a in zip(shards, self._axes()))
            return self.buffer.to_tree(full)

        return self.map_param_parts(gather, state)

    def state_from_tree(self, state: OptimizerState) -> OptimizerState:
        """Inverse of :meth:`state_to_tree`: parameter trees back to this rank's fp32
        bucket shards (distributed) or as they are (replicated)."""
        if not self.distributed:
            return state
        self._check_axis()

        def shard(tree):
            return self._shard(self.buffer.from_tree(tree, dtype=jnp.float32))

        return self.map_param_parts(shard, state)

    # -- masks

    def _leaf_mask_tree(self, flags: tuple[bool, ...]) -> PyTree:
        return jax.tree.unflatten(self.buffer.treedef,
                                  [jnp.float32(1.0 if f else 0.0) for f in flags])

    def _decay_mask(self) -> PyTree | None:
        if self.weight_decay_flags is None:
            return None
        if self.distributed:
            return local_mask(self.buffer, self.weight_decay_flags, axis_name=None,
                              bucket_axes=self._axes())
        return self._leaf_mask_tree(self.weight_decay_flags)

    def _norm_weights(self) -> PyTree | None:
        weights = None
        spread = () if self.distributed else self._spread_axes()
        for axis, flags in self.duplicated + spread:
            not_first = lax.axis_index(axis) != 0
            if self.distributed:
                dup = local_mask(self.buffer, flags, axis_name=None, bucket_axes=self._axes())
                w = tuple(jnp.where(d & not_first, 0.0, 1.0).astype(jnp.float32) for d in dup)
            else:
                w = jax.tree.unflatten(self.buffer.treedef, [
                    jnp.where(not_first, 0.0, 1.0).astype(jnp.float32) if f
                    else jnp.float32(1.0) for f in flags])
            weights = w if weights is None else jax.tree.map(jnp.multiply, weights, w)
        return weights

    # -- step

    def grad_norm(self, grads: PyTree) -> jax.Array:
        """Global fp32 norm of synced gradients (shards or tree), each element counted once."""
        axes = self.model_axes
        if self.distributed:  # ranks hold disjoint shards (or other experts): sum over data
            axes = _names(self.data_axis) + axes
        else:
            axes = tuple(a for a, _ in self._spread_axes()) + axes
        return global_grad_norm(grads, axis_names=axes, weights=self._norm_weights())

    def step(self, params: PyTree, synced: Sequence[jax.Array], state: OptimizerState
             ) -> tuple[PyTree, OptimizerState, StepInfo]:
        """One optimizer step from the output of :func:`sync_buckets`.

        Args:
          params: current per-device parameter tree (returned as is when skipped).
          synced: reduce-scattered shards (distributed) or all-reduced buckets (replicated).
          state: from :meth:`init` or the previous step.
        Returns:
          ``(new params in their dtypes, new state, StepInfo)``.
        """
        self._check_axis()
        if self.distributed:
            self.buffer._check_buckets(synced, "step (synced shards)", self.buffer.shard_numels)
            grads = tuple(g.astype(jnp.float32) for g in synced)
        else:
            grads = self.buffer.to_tree(synced, dtype=jnp.float32)

        norm = self.grad_norm(grads)
        skipped = jnp.logical_not(jnp.isfinite(norm))
        coeff = jnp.float32(1.0)
        if self.clip_grad:
            grads, coeff = clip_by_total_norm(grads, self.clip_grad, norm)

        updates, inner = self.tx.update(grads, state.inner, state.master,
                                        weight_decay_mask=self._decay_mask())
        master = optax.apply_updates(state.master, updates)

        if self.distributed:
            gathered = tuple(_all_gather_params(m.astype(dt), a) for m, dt, a in
                             zip(master, self.buffer.bucket_param_dtypes, self._axes()))
            new_params = self.buffer.to_tree(gathered)
        else:
            new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)

        keep = lambda old, new: jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)
        new_state = OptimizerState(keep(state.master, master), keep(state.inner, inner))
        return keep(params, new_params), new_state, StepInfo(norm, coeff, skipped)
