"""Where a device's gradients live (flat padded buckets) and how they are finalized.

Megatron's ``DistributedDataParallel`` + ``finalize_model_grads`` for the pipelined GPT of
:mod:`jax_wgrad.pipeline`. Everything runs per device inside ``shard_map`` over the
``(data, tensor, pipeline)`` mesh.

**Layout** (:class:`GradLayout`). A device's gradients are two chunks of flat fp32 buckets
(:class:`jax_wgrad.grad_buffer.GradBuffer`, Megatron's exact bucket plan within each):

* ``stage``: this pipeline stage's own transformer layers, registered layer by layer in
  forward order (``ln1, qkv, proj, ln2, fc1, fc2``; weight before bias). With
  ``overlap_grad_reduce`` these buckets are synced over ``data`` in the cooldown, as soon
  as the stage's last backward is done.
* ``shared``: the parameters every stage holds a replica of (embedding: word, position;
  head: final norm, output layer), in forward order. Only the first / last stage produces
  their gradients; they are synced after the schedule (after the output layer's deferred
  weight-gradient drain, issue #4), then summed over ``pipeline`` (Megatron's tied
  word-embedding all-reduce between the first and last stage; the other stages add zeros,
  and all replicas stay identical). Under the distributed optimizer the tied word
  embedding gets a bucket of its own (Megatron's ``shared_embedding`` rule).

Megatron keeps one buffer per model chunk too; the split here is a forced bucket boundary
between the stage's layers and the replicated embedding/head (which Megatron holds only on
the first / last stage), so each chunk's layout is exactly :func:`plan_buckets`'s.

**Finalization** (:func:`finalize_grads`), in Megatron's order:

1. data-parallel sync of each bucket: scale by ``1/dp`` (or 1 with
   ``average_in_collective``, which divides after the sum) and reduce-scatter (distributed
   optimizer) or all-reduce -- one collective per bucket;
2. all-reduce over ``tensor`` of the gradients of parameters replicated over tensor ranks
   under sequence parallelism (LayerNorms, row-parallel biases, positions);
3. the tied word-embedding all-reduce over ``pipeline`` (the whole ``shared`` chunk);
4. scaling by the number of tokens: the backward is seeded with the token-loss SUM, so
   gradients are multiplied by ``dp / num_tokens`` (the data-parallel average of step 1
   times ``dp`` gives the global sum; divided by the global token count: the gradient of
   the global mean token loss).

The norm / clipping / skip / update that follow are
:class:`jax_wgrad.dist_optimizer.DistributedOptimizer`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_wgrad.config import DDPConfig, GPTConfig
from jax_wgrad.gpt import (
    LINEAR_LAYERS,
    forward_order,
    from_forward_order,
    init_params,
    param_specs,
    unstack_layers,
)
from jax_wgrad.grad_buffer import GradBuffer, shard_buckets, sync_buckets

__all__ = ["GradLayout", "sync_stage_buckets", "finalize_grads"]

Params = dict[str, Any]
Buckets = tuple[jax.Array, ...]


def _local_shape(shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> tuple[int, ...]:
    dims = list(shape)
    for d, axis in enumerate(tuple(spec)):
        if axis is not None:
            dims[d] //= sizes[axis]
    return tuple(dims)


def device_tree(params: Params) -> tuple[list[Params], Params]:
    """Canonical per-device params -> ``(stage layers, shared)`` in forward order: the tree
    the buckets are laid out over (``GradLayout.buffer.treedef``)."""
    layers = [forward_order(p) for p in unstack_layers(params["layers"])]
    return layers, forward_order({"embedding": params["embedding"], "head": params["head"]})


def canonical_tree(tree: tuple[list[Params], Params]) -> Params:
    """Inverse of :func:`device_tree` (layers stacked again)."""
    layers, shared = tree
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[from_forward_order(p) for p in layers])
    shared = from_forward_order(shared)
    return {"embedding": shared["embedding"], "layers": stacked, "head": shared["head"]}


@dataclasses.dataclass(frozen=True)
class GradLayout:
    """Static layout of one device's gradient buckets (see the module docstring).

    Attributes:
      stage, shared: the two chunks; ``buffer`` is their concatenation (the optimizer's
        view): its buckets are ``stage``'s followed by ``shared``'s.
      tied: the output layer uses the word embedding table.
      stage_slots: per local layer ``{linear name: (bucket, offset)}`` of its weight in
        ``stage``'s buckets (the fused op's target).
      output_slot: ``(bucket, offset)`` of the output-layer weight (the word embedding when
        tied) in ``shared``'s buckets.
      tensor_replicated_flags: per leaf of ``buffer`` (flatten order), see
        :meth:`tensor_replicated`.
    """

    stage: GradBuffer
    shared: GradBuffer
    buffer: GradBuffer
    tied: bool
    stage_slots: tuple[dict[str, tuple[int, int]], ...]
    output_slot: tuple[int, int]
    tensor_replicated_flags: tuple[bool, ...]

    @classmethod
    def create(cls, model: GPTConfig, mesh_shape: tuple[int, int, int], ddp: DDPConfig
               ) -> GradLayout:
        """Layout for ``model`` on a ``(data, tensor, pipeline)`` mesh of ``mesh_shape``."""
        dp, tp, pp = mesh_shape
        sizes = {"data": dp, "tensor": tp, "pipeline": pp}
        full = jax.eval_shape(lambda: init_params(model, 0))
        local = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(_local_shape(a.shape, s, sizes), a.dtype),
            full, param_specs(model), is_leaf=lambda x: isinstance(x, P))
        layers, shared = device_tree(local)
        tied = not model.untie_embeddings_and_output_weights
        kw = dict(dp_size=dp, bucket_size=ddp.effective_bucket_size(dp),
                  use_distributed_optimizer=ddp.use_distributed_optimizer,
                  pad_buckets_for_high_nccl_busbw=ddp.pad_buckets_for_high_nccl_busbw)
        stage = GradBuffer.create(layers, **kw)
        shared_embedding = jax.tree_util.tree_map_with_path(
            lambda path, _: tied and jax.tree_util.keystr(path) == "['embedding']['word']"
            "['embedding']", shared)
        shared_buf = GradBuffer.create(shared, shared_embedding=shared_embedding, **kw)
        stage_slots = tuple(
            {n: stage.offset_of(f"[{i}]['{n}']['weight']") for n in LINEAR_LAYERS}
            for i in range(len(layers)))
        out_path = "['embedding']['word']['embedding']" if tied else "['head']['output']['weight']"
        rep = jax.tree.map(lambda s: "tensor" not in tuple(s), param_specs(model),
                           is_leaf=lambda x: isinstance(x, P))
        rep_tree = ([forward_order(rep["layers"])] * len(layers),
                    forward_order({"embedding": rep["embedding"], "head": rep["head"]}))
        return cls(stage=stage, shared=shared_buf,
                   buffer=GradBuffer.concatenate([stage, shared_buf]), tied=tied,
                   stage_slots=stage_slots, output_slot=shared_buf.offset_of(out_path),
                   tensor_replicated_flags=tuple(jax.tree.leaves(rep_tree)))

    @property
    def num_stage_buckets(self) -> int:
        return self.stage.num_buckets

    def split(self, buckets: Buckets) -> tuple[Buckets, Buckets]:
        """``(stage buckets, shared buckets)`` of the concatenated tuple."""
        n = self.num_stage_buckets
        return tuple(buckets[:n]), tuple(buckets[n:])

    def flags(self, fn) -> Any:
        """A bool tree over ``buffer``'s tree: ``fn(keystr path) -> bool`` per leaf."""
        abstract = jax.tree.unflatten(self.buffer.treedef, [0] * len(self.buffer.slots))
        return jax.tree_util.tree_map_with_path(
            lambda path, _: bool(fn(jax.tree_util.keystr(path))), abstract)

    def tensor_replicated(self) -> Any:
        """Per leaf: replicated over ``tensor`` (LayerNorms, row-parallel biases,
        positions) -- counted once in the norm; all-reduced under sequence parallelism."""
        return jax.tree.unflatten(self.buffer.treedef, self.tensor_replicated_flags)

    def shared_flags(self) -> Any:
        """Per leaf: held by every pipeline stage (embedding, head)."""
        return self.flags(lambda path: path.startswith("[1]"))

    def weight_decay_flags(self) -> Any:
        """Per leaf: weight decay applies (``weight`` / ``embedding`` tables only)."""
        return self.flags(lambda path: path.endswith("['weight']")
                          or path.endswith("['embedding']['word']['embedding']"))


def sync_stage_buckets(buckets: Buckets, ddp: DDPConfig, *, axis_name: str = "data"
                       ) -> Buckets:
    """The data-parallel sync of a stage's buckets, in place (for the cooldown).

    Returns buckets of the same shapes: all-reduced buckets, or (distributed optimizer)
    each bucket with its reduce-scattered shard written into the rank's own range -- where
    Megatron's reduce-scatter leaves it in the grad buffer. :func:`finalize_grads` takes
    the shards out again with ``overlapped=True``.
    """
    synced = sync_buckets(buckets, axis_name=axis_name,
                          use_distributed_optimizer=ddp.use_distributed_optimizer,
                          average_in_collective=ddp.average_in_collective)
    if not ddp.use_distributed_optimizer:
        return synced
    rank = lax.axis_index(axis_name)
    return tuple(lax.dynamic_update_slice(b, s, (rank * s.shape[0],))
                 for b, s in zip(buckets, synced))


def finalize_grads(
    layout: GradLayout,
    ddp: DDPConfig,
    buckets: Buckets,
    *,
    stage_synced: bool,
    num_tokens: jax.Array,
    sequence_parallel: bool,
    pipeline_parallel: bool,
) -> Buckets:
    """Megatron's gradient finalization (module docstring, steps 1-4).

    Args:
      buckets: this device's buckets (``layout.buffer``): local sums of token-loss
        gradients; the stage chunk already synced in place if ``stage_synced``.
      num_tokens: fp32 scalar, tokens of this data rank's batch (summed over ``data``
        here, like Megatron's all-reduce of ``num_tokens``).
    Returns:
      Synced gradients of the mean token loss: ``[numel_i / dp]`` shards (distributed
      optimizer) or full ``[numel_i]`` buckets, one per bucket of ``layout.buffer``.
    """
    dist = ddp.use_distributed_optimizer
    stage_bk, shared_bk = layout.split(buckets)
    with jax.named_scope("data_parallel_sync"):
        if stage_synced:
            stage_out = shard_buckets(stage_bk, axis_name="data") if dist else stage_bk
        else:
            stage_out = sync_buckets(stage_bk, axis_name="data", use_distributed_optimizer=dist,
                                     average_in_collective=ddp.average_in_collective)
        shared_out = sync_buckets(shared_bk, axis_name="data", use_distributed_optimizer=dist,
                                  average_in_collective=ddp.average_in_collective)
    synced = stage_out + shared_out
    if sequence_parallel:
        with jax.named_scope("sequence_parallel_grads_all_reduce"):
            rep = layout.tensor_replicated_flags
            masks = layout.buffer.local_mask(rep, axis_name="data" if dist else None)
            has = layout.buffer.flat_mask(rep)
            synced = tuple(
                jnp.where(m, lax.psum(jnp.where(m, g, 0.0), "tensor"), g) if h.any() else g
                for g, m, h in zip(synced, masks, has))
    if pipeline_parallel:
        with jax.named_scope("embedding_grads_all_reduce"):
            n = layout.num_stage_buckets
            synced = synced[:n] + tuple(lax.psum(synced[n:], "pipeline"))
    with jax.named_scope("token_scaling"):
        dp = lax.axis_size("data")
        total = lax.psum(num_tokens, "data")
        scale = (jnp.float32(dp) / total).astype(jnp.float32)
        synced = tuple(g * scale for g in synced)
    return synced
