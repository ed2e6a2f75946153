"""Where each weight gradient goes during a pipelined step (:class:`GradSink`).

Built once from the :class:`~jax_wgrad.grads.GradLayout` and the step's options, the sink
holds one named :class:`SinkEntry` per weight whose gradient a fused GEMM writes (its
chunk, the role whose backward produces it, its bucket and offset) with the *policy* for
it:

* ``"accumulate"``: the fused GEMM adds ``dy^T x`` into the weight's bucket block inside
  the backward (:func:`~jax_wgrad.functional.linear_into_bucket`; the buckets thread
  through the differentiated function);
* ``"stash_w"``: split backward (zero bubble): the backward computes the linear's output
  gradient only (split probes, :class:`~jax_wgrad.functional.WgradRoutes`) and the pair
  ``(x, dy)`` waits for the microbatch's ``W`` task;
* ``"defer"``: the output layer's weight under ``defer_embedding_wgrad_compute``
  (Megatron's deferral): its pair is stashed for the drain after the schedule (deferred
  microbatches), else handled as above.

Every other gradient is an ordinary array added to its block by
:meth:`GradLayout.add`. A model's stage programs never see buckets: a :class:`Tape`
routes the role's fused weights to their destinations -- in the device tree it hands the
program, each such leaf is an NNX variable whose ``wgrad`` metadata is its route
(:mod:`jax_wgrad.functional.routes`) -- and the library's linears read the route from the
variable the layer hands them.

Which weights get which policy (nothing here knows a model): a weight fused in the
``OUTPUT`` role is deferred when microbatches are deferred; with a split backward the
weights fused in ``LAYERS`` of the ``STAGE`` chunk and in ``OUTPUT`` are stashed for ``W``;
expert weights (``EXPERTS`` chunk) keep their grouped fused call in the backward (one call
per layer for all experts, which a per-linear ``W`` pair would undo), and so do weights
fused in ``INPUT``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Literal

import jax

from jax_wgrad import ops
from jax_wgrad.functional.routes import ChunkSync, RowPiece, WgradRoutes
from jax_wgrad.grads.chunks import DeviceTree, GradState, Window
from jax_wgrad.grads.layout import GradLayout
from jax_wgrad.grads.spec import LAYERS, OUTPUT, STACKED, STAGE

__all__ = ["Policy", "SinkEntry", "GradSink", "Tape"]

Policy = Literal["accumulate", "stash_w", "defer"]


@dataclasses.dataclass(frozen=True)
class SinkEntry:
    """One fused weight: where its gradient lives and what the step does with it.

    Attributes:
      name: its key path in the device tree (``jax.tree_util.keystr``), e.g.
        ``".shared['head']['output']['weight']"``.
      chunk: the chunk holding it; role: the role whose backward produces its gradient.
      bucket: its bucket among the chunk's buckets; offset: its first element there
        (``None`` for a weight laid out in layer groups).
      shape: the weight's per-device shape; policy: see the module docstring.
      pieces: a stacked weight laid out in layer groups
        (:class:`~jax_wgrad.grads.GradLayout`): its rows' blocks, keyed like the
        :class:`Tape`'s buckets (``(chunk, bucket)``); ``()`` otherwise.
    """

    name: str
    chunk: str
    role: str
    bucket: int | None
    offset: int | None
    shape: tuple[int, ...]
    policy: Policy
    pieces: tuple[RowPiece, ...] = ()

    @property
    def probed(self) -> bool:
        """The backward leaves this weight's GEMM out (its ``(x, dy)`` pair is kept)."""
        return self.policy != "accumulate"

    def offset_in(self, window: Window | None) -> int | ops.BlockOffset:
        """Its block's first element for model chunk ``window`` (a stacked weight's rows
        of that chunk): ``offset + index * chunk size`` -- a Python int for a static window
        index, a :class:`~jax_wgrad.ops.BlockOffset` (exact at any bucket size) for a
        traced one; ``offset`` without a window."""
        if window is None or window.count == 1 or self.chunk not in STACKED:
            return self.offset
        rows = self.shape[0] // window.count
        size = rows * (math.prod(self.shape) // self.shape[0])
        if isinstance(window.index, int):
            return self.offset + window.index * size
        return ops.BlockOffset(self.offset, window.index, size)


@dataclasses.dataclass(frozen=True, eq=False)
class GradSink:
    """The gradient policy of a step (see the module docstring); build with :meth:`create`.

    Attributes:
      layout: the buckets. entries: the fused weights, in device-tree flatten order.
      num_deferred: microbatches whose output-layer wgrad is deferred (Megatron's
        ``min(L, M)``; ``0``: no deferral).
    """

    layout: GradLayout
    entries: tuple[SinkEntry, ...]
    num_deferred: int
    leaf_entries: tuple[SinkEntry | None, ...]
    """Per leaf of the device tree (flatten order): its entry, ``None`` if not fused."""

    @classmethod
    def create(
        cls,
        layout: GradLayout,
        *,
        split_backward: bool,
        num_deferred_microbatches: int,
        split_output: bool = True,
    ) -> GradSink:
        """The policy of every fused weight of ``layout`` (module docstring);
        ``split_output=False`` keeps the ``OUTPUT`` role's weights out of the ``W`` tasks
        (a program whose ``post`` runs on every stage: each accumulates its share at once).

        Raises:
          ValueError: a split backward or deferral without gradient accumulation fusion,
            or deferral with a number of weights fused in ``OUTPUT`` other than one.
        """
        if (split_backward or num_deferred_microbatches) and not layout.fusion:
            raise ValueError(
                "GradSink: a split backward and deferred output-layer wgrad "
                "need gradient accumulation fusion"
            )
        entries: list[SinkEntry | None] = []
        for slot, spec in zip(layout.buffer.slots, layout.specs):
            if not layout.fusion or spec.fused_in is None:
                entries.append(None)
                continue
            policy: Policy = "accumulate"
            if spec.fused_in == OUTPUT and num_deferred_microbatches:
                policy = "defer"
            elif split_backward and (
                (spec.fused_in == OUTPUT and split_output)
                or (spec.fused_in == LAYERS and spec.chunk == STAGE)
            ):
                policy = "stash_w"
            first = _first_bucket(layout, spec.chunk)
            if slot.split:
                if policy != "accumulate":
                    raise ValueError(
                        f"GradSink: {slot.path} is laid out in layer groups, which only "
                        f"a backward that accumulates its gradient can fill (policy {policy!r})"
                    )
                place = dict(
                    bucket=None,
                    offset=None,
                    pieces=tuple(
                        RowPiece((spec.chunk, p.bucket - first), p.offset, p.rows)
                        for p in slot.pieces
                    ),
                )
            else:
                place = dict(bucket=slot.bucket - first, offset=slot.offset)
            entries.append(
                SinkEntry(
                    name=slot.path,
                    chunk=spec.chunk,
                    role=spec.fused_in,
                    shape=tuple(slot.shape),
                    policy=policy,
                    **place,
                )
            )
        fused = tuple(e for e in entries if e is not None)
        deferred = [e for e in fused if e.policy == "defer"]
        if num_deferred_microbatches and len(deferred) != 1:
            raise ValueError(
                f"GradSink: deferral defers the one weight fused in the "
                f"{OUTPUT!r} role; the layout has {len(deferred)}"
            )
        return cls(layout, fused, num_deferred_microbatches, tuple(entries))

    # ------------------------------------------------------------------------ lookups

    def probed(self, role: str) -> tuple[SinkEntry, ...]:
        """The entries of ``role`` whose pair the backward keeps (stash_w or defer)."""
        return tuple(e for e in self.entries if e.role == role and e.probed)

    @property
    def deferred(self) -> SinkEntry | None:
        """The deferred output-layer weight, if any."""
        return next((e for e in self.entries if e.policy == "defer"), None)

    def leaf(self, params: DeviceTree, entry: SinkEntry) -> jax.Array:
        """The parameter ``entry`` names in a device tree shaped like the layout's."""
        leaves = self.layout.buffer.treedef.flatten_up_to(params)
        return leaves[[s.path for s in self.layout.buffer.slots].index(entry.name)]

    # ------------------------------------------------------------------------ gradients

    def open(
        self,
        role: str,
        params: DeviceTree,
        state: GradState | None,
        probes: Mapping[str, jax.Array | None] | None = None,
        on_complete: Callable[[Hashable, int], ChunkSync | None] | None = None,
    ) -> Tape:
        """A :class:`Tape` for one differentiated call of ``role`` (create it INSIDE the
        function being differentiated, from that function's ``params``, ``state`` and
        ``probes``; run the program on :attr:`Tape.params`, then :meth:`Tape.close`).
        ``on_complete``: the routes' hook for a layer group's completed bucket, keyed
        ``(chunk, bucket)`` (:class:`~jax_wgrad.functional.WgradRoutes`)."""
        return Tape(self, role, params, state, probes, on_complete)

    def add(self, state: GradState, role: str, grads: DeviceTree) -> GradState:
        """``role``'s ordinary gradients into their blocks (:meth:`GradLayout.add`)."""
        return self.layout.add(state, role, grads)

    def accumulate(
        self,
        state: GradState,
        entry: SinkEntry,
        x: jax.Array,
        dy: jax.Array,
        window: Window | None = None,
    ) -> GradState:
        """``dy^T x`` into ``entry``'s block, in place (the ``W`` task, the deferral
        drain's non-deferred microbatches). A weight stacked over ``n`` layers
        (``[n, out, in]``, or ``[n, ..., in]`` whose middle dims flatten to ``out``;
        :func:`~jax_wgrad.functional.scan_layers`) takes its pair stacked too
        (``x [n, ..., in]``, ``dy [n, ..., out]``): one grouped call, ``n`` blocks (with a
        ``window``: the model chunk's ``n / V`` layers, at their blocks)."""
        bks = list(state[entry.chunk])
        offset = entry.offset_in(window)
        if len(entry.shape) == 2:
            bks[entry.bucket] = ops.wgrad_accumulate(x, dy, bks[entry.bucket], offset=offset)
        elif len(entry.shape) >= 3:  # [n, ..., in]: n row-major [out, in] blocks
            n = x.shape[0]
            bks[entry.bucket] = ops.grouped_wgrad_accumulate(
                x.reshape(n, -1, x.shape[-1]),
                dy.reshape(n, -1, dy.shape[-1]),
                bks[entry.bucket],
                offset=offset,
            )
        else:
            raise ValueError(
                f"GradSink.accumulate: {entry.name} has shape {entry.shape}; "
                "a W pair is for an [out, in] weight or stacked [n, ..., in] ones"
            )
        return state.replace(**{entry.chunk: tuple(bks)})


def _first_bucket(layout: GradLayout, chunk: str) -> int:
    first = 0
    for name, part in layout.parts.items():
        if name == chunk:
            return first
        first += part.num_buckets
    raise KeyError(chunk)


class Tape:
    """One differentiated call's view of the sink (made by :meth:`GradSink.open`).

    Routes each weight fused in the role to its destination in one
    :class:`~jax_wgrad.functional.WgradRoutes` (the call's bucket tokens, probes and
    records): its bucket block (policy ``accumulate``: the bucket threads through the
    call), its row pieces (a layout in layer groups) or a split probe (``stash_w``,
    ``defer``: the call adds probe ``probes[name]`` to the linear's output and records its
    input). :attr:`params` is the device tree with those leaves as routed variables: run
    the program on it, then :meth:`close`. With ``state`` ``None`` (no fusion: a
    forward-only call) nothing is routed and :attr:`params` is the device tree given.

    Attributes:
      params: the device tree the program runs on.
    """

    def __init__(
        self,
        sink: GradSink,
        role: str,
        params: DeviceTree,
        state: GradState | None,
        probes: Mapping[str, jax.Array | None] | None,
        on_complete: Callable[[Hashable, int], ChunkSync | None] | None = None,
    ):
        self._state = state
        self._probed = sink.probed(role)
        self._routes: WgradRoutes | None = None
        self.params = params
        if state is None:
            return
        routes = WgradRoutes(
            {(chunk, i): bk for chunk, bks in state.items() for i, bk in enumerate(bks)},
            [None if probes is None else probes[e.name] for e in self._probed],
            on_complete=on_complete,
        )
        index = {e.name: i for i, e in enumerate(self._probed)}
        treedef = sink.layout.buffer.treedef
        leaves = treedef.flatten_up_to(params)
        for k, (leaf, entry) in enumerate(zip(leaves, sink.leaf_entries)):
            if entry is None or entry.role != role:
                continue
            if entry.probed:
                leaves[k] = routes.to_split(leaf, index[entry.name], name=entry.name)
            elif entry.pieces:
                leaves[k] = routes.to_pieces(leaf, entry.pieces, name=entry.name)
            else:
                leaves[k] = routes.to_bucket(
                    leaf, (entry.chunk, entry.bucket), entry.offset, name=entry.name
                )
        self._routes = routes
        self.params = treedef.unflatten(leaves)

    def close(self) -> tuple[GradState | None, dict[str, jax.Array], dict[str, jax.Array]]:
        """``(buckets after the call's fused linears, inputs, outputs)``: the records are
        by entry name, for the probed entries of the role.

        Raises:
          ValueError: a fused weight of the role whose variable no library linear received
            (its gradient would be lost; :meth:`~jax_wgrad.functional.WgradRoutes.close`).
        """
        if self._routes is None:
            return None, {}, {}
        tokens = self._routes.close()
        state = self._state.map(lambda chunk, bks: tuple(tokens[chunk, i] for i in range(len(bks))))
        names = [e.name for e in self._probed]
        inputs, outputs = self._routes.inputs, self._routes.outputs
        return state, dict(zip(names, inputs)), dict(zip(names, outputs))
