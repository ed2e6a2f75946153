"""Layers with stacked parameters as ONE ``lax.scan``, their fused weight gradients still
accumulated in place into their bucket blocks (:func:`scan_layers`), checkpointed per layer
(or group of layers) as Megatron's recompute options say
(:class:`LayerRecompute`).

A stage's ``n`` layers of the same structure hold each parameter stacked, ``[n, ...]``;
in a gradient bucket a stacked weight ``[n, out, in]`` is one contiguous region, layer
``i``'s block at ``offset + i * out * in``. A ``lax.scan`` traces the layer once, so its
compile time does not grow with ``n`` (``unroll`` trades it back for straight-line code);
each iteration reads its layer's parameters from the full stacks (no copy of the stacks),
and the weight-gradient slots handed to the layer are rebuilt per iteration:

* a stacked weight routed to a bucket (an NNX variable whose ``wgrad`` metadata says so,
  :mod:`jax_wgrad.functional.routes`) has layer ``i``'s slice routed to layer ``i``'s
  block, at the TRACED position ``BlockOffset(offset, i, size)`` (the fused op's
  traced-offset form: ``offset + i * size`` computed in 64 bits by the handler, exact in
  buckets past ``2**31`` elements), and the
  buckets it writes ride in the scan's carry -- so the scan's backward carries their
  cotangent and each iteration adds its layer's block in place;
* a stacked weight split for zero bubble takes its probe ``[n, ...]`` as a scan input and
  records the layer inputs as a scan output ``[n, ...]``: the ``W`` task's pair is then
  the stacked ``(x, dy)``, one grouped fused call
  (:func:`jax_wgrad.ops.grouped_wgrad_accumulate`: ``n`` blocks back to back);
* stacked weights whose rows live in several buckets (row pieces, a gradient layout in
  layer groups: :meth:`~jax_wgrad.functional.WgradRoutes.to_pieces`) cut the scan into
  one scan per group, each threading its group's bucket; the bucket of the group above
  rides through the scan of the group below, whose backward iteration ``i`` can sync its
  chunk ``i`` (the routes' ``on_complete``) beside that layer's weight gradients
  (:func:`sync_when_complete`).

The layer function knows none of this: it hands its parameters (variables, routed or not)
to the library's layers.

**Recomputation** (:class:`LayerRecompute`, Megatron's options). The checkpoint sits on
the LAYERS, inside the layer scan (``lax.scan(jax.checkpoint(layer, policy))``), never
around a whole stage: the forward scan then stacks per layer only what
the policy saves, and the backward scan recomputes one layer (or one group of layers) at a
time inside its own iteration. A checkpoint around the stage instead makes the backward
re-run the whole forward scan first, stacking every layer's recomputed activations (and
zero-filling and copying the stacks) before the transposed scan starts.

Per layer, what is saved for the backward:

* ``granularity=None`` (Megatron's default, no recomputation): every GEMM output
  (``dots_saveable``), the outputs of the library's custom-call GEMMs, token exchanges and
  row-parallel reductions (checkpoint name :data:`~jax_wgrad.functional.saved.SAVED`) and
  of the cuDNN attention forward (its output and softmax statistics); only elementwise
  ops, norms and casts are recomputed, inside the layer's backward;
* ``"selective"``: the linear layers' outputs (``dots_with_no_batch_dims_saveable``) and the
  named activations; the attention core (its batched ``QK^T`` and ``PV`` GEMMs, the softmax,
  a cuDNN attention forward) is recomputed -- Megatron's selective recomputation;
* ``"full"`` with Megatron's ``recompute_method`` and ``recompute_num_layers`` ``N``:
  ``"uniform"`` checkpoints the input of every group of ``N`` consecutive layers and
  recomputes the group in its backward (the last group may be shorter); ``"block"``
  checkpoints the input of each of the first ``N`` layers (of the stage, or of the model
  chunk with interleaving) and recomputes it, the remaining layers saving as with ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_wgrad._validation import check_recompute
from jax_wgrad.functional.residual_slots import ResidualSlots, stashed_iteration, stored_residuals
from jax_wgrad.functional.routes import ChunkSync, StackRoutes, value_of
from jax_wgrad.functional.saved import SAVED

__all__ = [
    "ATTENTION_FORWARD_PRIMITIVES",
    "LayerGroup",
    "LayerRecompute",
    "policy",
    "scan_layers",
    "sync_when_complete",
]

PyTree = Any


ATTENTION_FORWARD_PRIMITIVES = frozenset(
    {"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper"}
)
"""Names of jax's cuDNN fused-attention forward primitives
(``jax._src.cudnn.fused_attention_stablehlo``; the wrapper is what
:func:`jax.nn.dot_product_attention` binds): their outputs (the attention output and the
softmax statistics its backward reads) are saved unless the attention is recomputed."""


def _attention_forward(prim, *_, **__) -> bool:
    return prim.name in ATTENTION_FORWARD_PRIMITIVES


_NAMED = jax.checkpoint_policies.save_only_these_names(SAVED)
_both = jax.checkpoint_policies.save_from_both_policies
_POLICIES: dict[str | None, Any] = {
    None: _both(_both(jax.checkpoint_policies.dots_saveable, _NAMED), _attention_forward),
    "selective": _both(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _NAMED),
    "full": jax.checkpoint_policies.nothing_saveable,
}


def policy(granularity: Literal["full", "selective"] | None):
    """The ``jax.checkpoint`` policy of one checkpointed layer (group) at ``granularity``
    (module docstring)."""
    if granularity not in _POLICIES:
        raise ValueError(
            f"recompute granularity must be None, 'full' or 'selective'; got {granularity!r}"
        )
    return _POLICIES[granularity]


LayerFn = Callable[[PyTree, jax.Array], tuple[jax.Array, PyTree]]
"""``(params of one layer, x) -> (x, aux)``."""


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """``count`` consecutive runs of ``size`` layers each, from layer ``first`` on (of the
    layers scanned), each run one ``jax.checkpoint`` with ``policy``; ``layer``: the layer
    function of these layers (``None``: the scan's one)."""

    first: int
    size: int
    count: int
    policy: Any
    layer: LayerFn | None = None


@dataclasses.dataclass(frozen=True)
class LayerRecompute:
    """Megatron's ``recompute_granularity``, ``recompute_method`` and
    ``recompute_num_layers`` for one run of layers (module docstring), checked by
    Megatron's rules (:func:`jax_wgrad._validation.check_recompute`, as ``ParallelConfig``
    checks its fields).

    Attributes:
      granularity: ``None``, ``"selective"`` or ``"full"``.
      method: ``"uniform"`` or ``"block"`` (``"full"`` only, and then required).
      num_layers: ``N`` >= 1 (``"full"`` only, and then required).
    """

    granularity: Literal["full", "selective"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        check_recompute(self.granularity, self.method, self.num_layers)

    def groups(self, count: int) -> tuple[LayerGroup, ...]:
        """How ``count`` layers are checkpointed, in order (:class:`LayerGroup`\\ s that
        cover ``0 .. count - 1``)."""
        if count < 1:
            raise ValueError(f"LayerRecompute.groups: need at least one layer, got {count}")
        if self.granularity != "full":
            return (LayerGroup(0, 1, count, policy(self.granularity)),)
        n, full = self.num_layers, policy("full")
        if self.method == "block":
            k = min(n, count)
            out = [LayerGroup(0, 1, k, full)]
            if count > k:
                out.append(LayerGroup(k, 1, count - k, policy(None)))
            return tuple(out)
        size = min(n, count)
        out = [LayerGroup(0, size, count // size, full)]
        if count % size:
            out.append(LayerGroup(count - count % size, count % size, 1, full))
        return tuple(out)


def scan_layers(
    layer: LayerFn | Sequence[tuple[int, LayerFn]],
    x: jax.Array,
    params: PyTree,
    *,
    unroll: int = 1,
    rows: tuple[Any, int] | None = None,
    recompute: LayerRecompute | None = None,
    slots: ResidualSlots | None = None,
) -> tuple[jax.Array, PyTree]:
    """``for i in range(n): x, aux_i = layer(params[i], x)`` as a scan.

    Args:
      layer: ``(params of one layer, x) -> (x, aux)``; or ``((k_1, layer_1), (k_2,
        layer_2), ...)``: the first ``k_1`` layers run are ``layer_1``, the next ``k_2``
        ``layer_2``, ... (the ``k`` summing to the layers run; e.g. the same layer in
        another precision, FP8's first and last layers in BF16): one scan per run, cut
        where the functions change (a run of layers recomputed together must not straddle
        a cut). Every function must give the same ``aux`` structure.
      x: the first layer's input (the scan carry).
      params: the layers' parameters, every leaf (an array or an NNX variable) stacked
        ``[n, ...]``; a variable's route (:mod:`jax_wgrad.functional.routes`) may send its
        gradient to a bucket (its layer-0 block; a probe ``[k, ...]`` for the ``k`` layers
        run when split); each layer gets its slices as variables routed to its blocks.
      unroll: iterations per step of the loop (``lax.scan``'s ``unroll``; an iteration is
        one layer, or one group of layers recomputed together); ``n`` (or at least a
        layer group's iterations): no loop, each iteration traced on its own
        (straight-line code, the offsets constant, no residual stacked; compile time
        grows with ``n``).
      rows: ``(start, k)``: run only layers ``start .. start + k - 1`` (``start`` may be
        traced: a model chunk of an interleaved stage), read from the full stacks inside
        the loop (no copy of the chunk's weights); default: all ``n``.
      recompute: how the layers are checkpointed
        (:class:`~jax_wgrad.functional.stacked.LayerRecompute`: one ``jax.checkpoint``
        per layer or per group of layers, inside the scan); ``None``: no checkpoint (what
        JAX's autodiff saves by itself).
      slots: a pipeline forward's residual slots
        (:class:`~jax_wgrad.functional.residual_slots.ResidualSlots`): what each
        iteration's backward reads is written there, at the slots' ``slot`` (each scan
        taking its buffers in order), instead of being saved by JAX's autodiff as the
        scan's stacked outputs; under ``jax.vjp`` the caller seeds the cotangent of the
        buffers it gets back with the buffers as they are when the backward runs. Only
        loops write them: a run traced without one (``unroll`` covering it) stacks
        nothing, and its layers' residuals stay JAX's, which the pipeline stores as before
        (the H100 compiles of the unrolled rows peaked lower that way: 45.4 against 61.7
        GiB at Llama-3-8B TP2 DP4 seq 8192).
    Returns:
      ``(x after the layers, aux stacked [k, ...])``. The routes' buckets and split
      records are updated as if each layer had been called.
    """
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda a: isinstance(a, nnx.Variable))
    shapes = [value_of(a).shape for a in leaves]
    n = shapes[0][0]
    if any(s[:1] != (n,) for s in shapes):
        raise ValueError(
            f"scan_layers: every parameter must be stacked [n, ...] with one n; "
            f"got {[tuple(s) for s in shapes]}"
        )
    start, count = (jnp.int32(0), n) if rows is None else (jnp.asarray(rows[0], jnp.int32), rows[1])
    if rows is not None and not 0 < count <= n:
        raise ValueError(f"scan_layers: rows {rows!r} outside the {n} stacked layers")
    groups = (LayerGroup(0, 1, count, None),) if recompute is None else recompute.groups(count)
    groups = _layer_runs(layer, groups, count)

    stack = StackRoutes(leaves)
    probes = stack.probes
    if stack.parts and (rows is not None or stack.parts[-1][1] != n):
        raise ValueError(
            f"scan_layers: weights laid out in row pieces {stack.parts} need all {n} "
            f"stacked layers run at once (rows={rows!r})"
        )

    defs = [jax.tree.structure(a) for a in leaves]  # a variable keeps its metadata

    def layer_slices(stacks, at):
        """Layer ``at``'s (traced, of the FULL stacks) slice of each leaf value."""
        return [lax.dynamic_index_in_dim(a, at, 0, False) for a in stacks]

    def one_layer(fn, h, keys, bks, index, probe, part, first=start, values=None):
        """Layer ``index`` (traced, of the ``count`` run from row ``first``) on ``h`` by
        ``fn``: ``(h, bks, records)``; ``values``: its slices (default: read here)."""
        if values is None:
            values = layer_slices([value_of(a) for a in leaves], first + index)
        sliced = [jax.tree.unflatten(d, [v]) for d, v in zip(defs, values)]
        routes, sliced = stack.layer(keys, bks, sliced, first + index, probe, part)
        h, aux = fn(jax.tree.unflatten(treedef, sliced), h)
        bks, inputs, outputs = StackRoutes.layer_result(routes, keys)
        return h, bks, (aux, inputs, outputs)

    def run_group(g: LayerGroup, keys, part, syncs, first_iteration, slotted):
        # syncs: {position in keys of a completed bucket: its ChunkSync, or None where
        # this backward does not sync it}. The part's own bucket (its row pieces, never a
        # completed one) is what a chunk synced beside its layers waits for.
        own = keys.index(stack.part_keys(part)[0]) if syncs else None

        def iteration(h, bks, it, probe, first=start, values=None):
            # `size` layers from layer first + it * size on; probe leaves [size, ...], or
            # the layer's own for size 1 (None: record only); values: their slices, per
            # layer (default: read inside).
            records = []
            for j in range(g.size):
                index = g.first + it * g.size + j
                mine = [p if p is None or g.size == 1 else p[j] for p in probe]
                h, bks, rec = one_layer(
                    g.layer,
                    h,
                    keys,
                    bks,
                    index,
                    mine,
                    part,
                    first,
                    None if values is None else values[j],
                )
                records.append(rec)
            return h, bks, jax.tree.map(lambda *r: jnp.stack(r), *records)

        if g.policy is not None:
            # The loop keeps XLA from merging the recomputation into the forward; a group
            # run without one (a single iteration, or unrolled whole) needs the barrier,
            # else there is no recompute at all.
            iteration = jax.checkpoint(iteration, policy=g.policy, prevent_cse=g.count <= unroll)

        def run(values, state, index):
            # One iteration on its state (h, buckets, probe) from row index[0] on.
            (h, bks, probe), (first, it) = state, index
            # The buckets of the part above are complete when the backward runs this
            # iteration: its chunk of them is synced beside the layer's weight gradients
            # (sync_when_complete says how), which go to the part's own bucket.
            bks = list(bks)
            for j, sync in syncs.items():
                bks[j], bks[own], h = sync_when_complete(
                    sync, bks[j], bks[own], h, first_iteration + it
                )
            if values is not None:
                n_leaves = len(leaves)
                values = [values[j * n_leaves : (j + 1) * n_leaves] for j in range(g.size)]
            h, bks, rec = iteration(h, tuple(bks), it, probe, first, values)
            return (h, bks), rec

        def reslice(stacks, index):
            # The iteration's layers' slices, layer by layer.
            first, it = index
            row = first + g.first + it * g.size
            return [v for j in range(g.size) for v in layer_slices(stacks, row + j)]

        def step(carry, xs):
            it, probe = xs
            if not slotted:
                h, bks = carry
                return run(None, (h, bks, probe), (start, it))
            h, bks, buffers = carry
            stacks = [value_of(a) for a in leaves]
            index = (start, it)
            values = reslice(stacks, index)
            ((h, bks), rec), buffers = stashed_iteration(
                run, reslice, stacks, values, (h, bks, probe), buffers, index, it, slots.slot
            )
            return (h, bks, buffers), rec

        def stored(carry, xs):
            # What the first iteration's backward reads (traced: the slots' layout).
            it, probe = jax.tree.map(lambda a: a[0], xs)
            index = (start, it)
            values = reslice([value_of(a) for a in leaves], index)
            return stored_residuals(run, values, (*carry, probe), index)

        def group_probes(p):
            # The probes are inputs of the checkpointed iterations, so their scan inputs are
            # residuals: the probe itself (a live input, not stored) when one group of
            # single layers runs them all; a slice or regrouping of it is stored (zeros,
            # one probe per slot: zb-h1 with block or multi-layer uniform recompute).
            if p is None or (g.size == 1 and g.first == 0 and g.count == p.shape[0]):
                return p
            part_ = lax.slice_in_dim(p, g.first, g.first + g.size * g.count, axis=0)
            return part_ if g.size == 1 else part_.reshape(g.count, g.size, *p.shape[1:])

        xs = (jnp.arange(g.count, dtype=jnp.int32), [group_probes(p) for p in probes])
        return step, xs, stored

    runs = [(None, groups)]
    if stack.parts:
        runs = [(p, _cut(groups, a, b)) for p, (a, b) in enumerate(stack.parts)]
    h, records = x, []
    for part, part_groups in runs:
        keys = stack.carried(part)
        iterations = sum(g.count for g in part_groups)
        # The buckets of the part above get a hook in every iteration, a no-op unless
        # the routes sync them (the same residuals either way: a step traces its last
        # backward with syncs and reads the residuals its other forwards stored).
        done = () if part is None else stack.completed(part)
        ask = stack.on_complete or (lambda key, k: None)
        syncs = {j: ask(k, iterations) for j, k in enumerate(keys) if k in done}
        carry, first_iteration = (h, stack.tokens(keys)), 0
        for g in part_groups:
            # A loop writes the slots; a run of layers traced without one (unrolled whole)
            # stacks nothing, its residuals are the stage's own (stored as before).
            slotted = slots is not None and g.count > unroll
            step, xs, stored = run_group(g, keys, part, syncs, first_iteration, slotted)
            if slotted:
                carry = (*carry, slots.take(g.count, functools.partial(stored, carry, xs)))
            if g.count <= unroll:  # no loop: each iteration traced on its own
                recs = []
                for k in range(g.count):
                    carry, rec = step(carry, jax.tree.map(lambda a, k=k: a[k], xs))
                    recs.append(rec)
                rec = jax.tree.map(lambda *r: jnp.stack(r), *recs)
            else:
                carry, rec = lax.scan(step, carry, xs, unroll=min(unroll, g.count))
            if slotted:
                slots.put(carry[2])
                carry = carry[:2]
            records.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), rec))
            first_iteration += g.count
        h, bks = carry
        stack.put(keys, bks)
    aux, inputs, outputs = (
        records[0] if len(records) == 1 else jax.tree.map(lambda *r: jnp.concatenate(r), *records)
    )
    stack.finish(inputs, outputs)
    return h, aux


def _cut(
    groups: tuple[LayerGroup, ...],
    a: int,
    b: int,
    what: str = "the gradient layout's layer group",
    layer: LayerFn | None = None,
) -> tuple[LayerGroup, ...]:
    """The checkpointed runs of ``groups`` within layers ``[a, b)`` (a part of a scan cut
    at the row pieces of a layout in layer groups, or where the layer function changes:
    then ``layer``); a run of several layers must not straddle a cut."""
    out = []
    for g in groups:
        lo, hi = max(a, g.first), min(b, g.first + g.size * g.count)
        if lo >= hi:
            continue
        if (lo - g.first) % g.size or (hi - g.first) % g.size:
            raise ValueError(
                f"scan_layers: {what} {a}..{b} cuts through a run of {g.size} layers "
                f"recomputed together (from layer {g.first} on); it must be made of whole "
                "recompute groups"
            )
        g = dataclasses.replace(g, first=lo, count=(hi - lo) // g.size)
        out.append(g if layer is None else dataclasses.replace(g, layer=layer))
    return tuple(out)


def _layer_runs(
    layer: LayerFn | Sequence[tuple[int, LayerFn]], groups: tuple[LayerGroup, ...], count: int
) -> tuple[LayerGroup, ...]:
    """``groups`` with their layer functions (``scan_layers``' ``layer``), cut where the
    function changes."""
    if callable(layer):
        return tuple(dataclasses.replace(g, layer=layer) for g in groups)
    runs = [(int(k), fn) for k, fn in layer if k]
    if sum(k for k, _ in runs) != count or any(k < 0 for k, _ in runs):
        raise ValueError(
            f"scan_layers: the layer runs {[k for k, _ in layer]} must cover the {count} layers run"
        )
    out, a = [], 0
    for k, fn in runs:
        out.extend(_cut(groups, a, a + k, "a run of layers of one function", fn))
        a += k
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sync_when_complete(
    sync: ChunkSync | None, token: jax.Array, own: jax.Array, h: jax.Array, i: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(token, own, h)`` unchanged, applied to the inputs of a layer (or of a group of
    layers run as one iteration); the backward reaches it when their backward is done,
    and syncs chunk ``i`` (traced int32) of ``token``'s cotangent -- a completed bucket
    -- in place by ``sync(ct, i)``, beside the layers' weight gradients:

    * the chunk is cut after the data gradient (``h``'s cotangent; the two are joined by
      an optimization barrier first), so its collective is issued once the layers'
      tensor-parallel collectives are;
    * the synced bucket is joined with ``own``'s cotangent (the bucket the layers'
      weight gradients are added to, complete for them) and with the data gradient, so
      the chunk's write-back waits for those GEMMs and the layers below wait for the
      write-back: XLA:GPU's scheduler keeps the collective in flight over the weight
      gradients' GEMMs (without the data gradient in that join it put the last layer's
      GEMMs after the write-back, beside nothing but memory-bound kernels). A chunk
      slower than the weight gradients beside it delays the layers below.

    Why there: XLA:GPU runs every asynchronous collective on one communication stream
    and its scheduler keeps one in flight at a time
    (``--xla_gpu_experimental_parallel_collective_overlap_limit``, default 1), and the
    data gradient's GEMMs already hide the tensor-parallel collectives; the weight
    gradients' GEMMs are what a data-parallel collective can run beside. Issued before
    the layers' backward instead, straight-line code (an unrolled layer loop) left half
    of the chunks with only memory-bound kernels between start and done.

    ``sync`` ``None``: a backward that does not sync (the residuals are the same), the
    cotangents pass unchanged.
    """
    return token, own, h


def _sync_fwd(sync, token, own, h, i):
    return (token, own, h), i


def _sync_bwd(sync, i, cts):
    ct, ct_own, ct_h = cts
    if sync is None:
        return ct, ct_own, ct_h, None
    ct, ct_h = jax.lax.optimization_barrier((ct, ct_h))
    ct, ct_own, ct_h = jax.lax.optimization_barrier((sync(ct, i), ct_own, ct_h))
    return ct, ct_own, ct_h, None


sync_when_complete.defvjp(_sync_fwd, _sync_bwd)
