"""Where a weight's gradient goes: a property of the parameter (its ``wgrad`` metadata).

A fused weight reaches the library's linears as an NNX variable (``nnx.Param``) whose
``wgrad`` metadata is a :class:`Route`: its static destination and the
:class:`WgradRoutes` of the differentiated call that owns the gradient buckets. The layer
hands the *variable* to :func:`~jax_wgrad.functional.linear` (``linear(x, self.weight)``),
so whatever the layer does to the value on the way keeps the destination as long as it is
done to the variable: ``jax.tree.map(lambda w: w.astype(jnp.bfloat16), self.weight)``
(mixed precision), ``jax.tree.map(lambda w: w.reshape(...), self.weight)``, an
``nnx.split``/``nnx.merge`` round trip, a mapped ``nnx.State`` (NNX variables are pytrees
whose metadata rides along). Nothing is looked up by array identity and nothing is
global: the route is on the variable, and the call's traced state is one object,
:class:`WgradRoutes`, created by whoever owns the buckets (the pipeline executor, a test,
:func:`~jax_wgrad.training.accumulate_gradients`) and read back by it.

Destinations (:data:`Destination`, static):

* :class:`ToBucket` -- Megatron's gradient accumulation fusion: the weight's ``[out, in]``
  block at ``offset`` of bucket ``key``. The linear threads the bucket like a token
  (:func:`~jax_wgrad.functional.linear_into_bucket`): its backward adds ``dy^T x`` to the
  block in place; each use of the weight adds once.
* :class:`ToSplit` -- zero bubble's split backward: the linear adds probe ``index`` to its
  output and records its input and output, so that differentiating with respect to the
  probe gives its ``dy`` while no weight-gradient GEMM runs (the ``W`` task later runs
  ``wgrad_accumulate(x, dy, ...)``).
* :class:`ToPieces` -- a weight stacked ``[n, ...]`` whose rows live in several buckets
  (a gradient layout in layer groups); only :func:`~jax_wgrad.functional.scan_layers`
  runs it, each part of its scan threading its piece's bucket.

The traced state of one differentiated call, :class:`WgradRoutes`, holds the bucket
tokens (the flat buckets, threaded through the call), the zero-bubble probes and what the
split linears record. Create it INSIDE the function being differentiated, from that
function's bucket (and probe) arguments; attach the weights (:meth:`WgradRoutes.to_bucket`
and friends return them as routed variables); run the model on those; return
:meth:`WgradRoutes.close` (the buckets) from the function::

    def stage(params, buckets, x):
        routes = WgradRoutes(buckets)
        w1 = routes.to_bucket(params["w1"], 0, offset=128)
        w2 = routes.to_bucket(params["w2"], 0, offset=0)
        y = linear(jax.nn.gelu(linear(x, w1)), w2)
        return y, routes.close()

    y, vjp_fn = jax.vjp(stage, params, buckets, x)
    dparams, buckets, dx = vjp_fn((dy, buckets))   # buckets += both blocks

A layer scan (:func:`~jax_wgrad.functional.scan_layers`) reads the routes of the stacked
variables it is given (:class:`StackRoutes`), carries their buckets' tokens through the
scan and gives each iteration's slices routes of their own (a traced block position per
layer); the tokens come back to the call's :class:`WgradRoutes` after the scan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from jax_wgrad import ops
from jax_wgrad.ops.position import advance

__all__ = [
    "WGRAD",
    "ChunkSync",
    "Destination",
    "Route",
    "RowPiece",
    "StackRoutes",
    "ToBucket",
    "ToPieces",
    "ToSplit",
    "WgradRoutes",
    "route_of",
    "value_of",
]

WGRAD = "wgrad"
"""The NNX variable metadata key of a weight's :class:`Route`."""


@dataclasses.dataclass(frozen=True)
class RowPiece:
    """Rows ``[rows[0], rows[1])`` of a stacked ``[n, ...]`` weight's gradient: one
    contiguous block of bucket ``key`` from element ``offset`` on, row ``rows[0]``'s
    block first (a gradient layout in layer groups,
    :class:`~jax_wgrad.grads.SlotPiece`)."""

    key: Hashable
    offset: int
    rows: tuple[int, int]


@dataclasses.dataclass(frozen=True, eq=False)
class ToBucket:
    """The weight's ``[out, in]`` block at ``offset`` of bucket ``key``: a Python int, or
    inside a layer scan a :class:`~jax_wgrad.ops.BlockOffset` with the layer's traced
    index (exact at any bucket size)."""

    key: Hashable
    offset: ops.Offset
    name: str


@dataclasses.dataclass(frozen=True)
class ToSplit:
    """Zero-bubble split backward: probe ``index`` (its gradient is the linear's ``dy``)."""

    index: int
    name: str


@dataclasses.dataclass(frozen=True)
class ToPieces:
    """A stacked weight whose rows live in several buckets (only
    :func:`~jax_wgrad.functional.scan_layers` runs it: each part of its scan adds its
    rows to its piece)."""

    pieces: tuple[RowPiece, ...]
    name: str

    def piece(self, rows: tuple[int, int]) -> RowPiece:
        for p in self.pieces:
            if p.rows[0] <= rows[0] and rows[1] <= p.rows[1]:
                return p
        raise AssertionError(f"{self.name}: no piece holds rows {rows}")


Destination = ToBucket | ToSplit | ToPieces
"""Where a weight's gradient goes in one differentiated call (module docstring)."""

ChunkSync = Callable[[jax.Array, jax.Array], jax.Array]
"""``sync(bucket_cotangent, i) -> bucket_cotangent``: the data-parallel sync of chunk
``i`` (traced int32) of a completed bucket, in place (see :class:`WgradRoutes`'s
``on_complete``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Route:
    """A weight's ``wgrad`` metadata: its destination ``dest`` in the differentiated call
    whose traced state is ``routes``. Compared and hashed by identity (it is static
    metadata of the variable's pytree; copies of the variable share it)."""

    routes: WgradRoutes
    dest: Destination

    @property
    def name(self) -> str:
        return self.dest.name

    def into_bucket(self, fn: Callable[[jax.Array, ops.Offset], tuple[Any, jax.Array]]) -> Any:
        """``fn(bucket, offset) -> (out, new bucket)`` on this weight's bucket token (a
        fused op that adds the weight's blocks in its backward, threaded: the new token
        replaces the old in :attr:`routes`); returns ``out``.

        Raises:
          ValueError: the destination is not a bucket block (a zero-bubble split, which only
            :func:`~jax_wgrad.functional.linear` makes, or row pieces, which only
            :func:`~jax_wgrad.functional.scan_layers` runs).
        """
        dest = self.dest
        if isinstance(dest, ToSplit):
            raise ValueError(f"WgradRoutes: {dest.name} cannot be split for zero bubble here")
        if isinstance(dest, ToPieces):
            raise ValueError(
                f"WgradRoutes: {dest.name} has its gradient in {len(dest.pieces)} row pieces "
                "(a layout in layer groups); only scan_layers can run a weight stacked that "
                "way, each layer's slice in its own iteration"
            )
        routes = self.routes
        routes._used.add(self)
        out, routes._tokens[dest.key] = fn(routes._tokens[dest.key], dest.offset)
        return out


def value_of(weight: Any) -> Any:
    """The array of ``weight`` (an NNX variable or an array; ``None`` stays ``None``)."""
    return weight[...] if isinstance(weight, nnx.Variable) else weight


def route_of(weight: Any) -> Route | None:
    """The :class:`Route` an NNX variable carries (its ``wgrad`` metadata), or ``None``
    (an array, or a variable without one: an ordinary gradient)."""
    if not isinstance(weight, nnx.Variable):
        return None
    route = weight.get_metadata().get(WGRAD)
    if route is not None and not isinstance(route, Route):
        raise ValueError(f"the '{WGRAD}' metadata of a variable must be a Route, got {route!r}")
    return route


class WgradRoutes:
    """The traced state of one differentiated call's routed weight gradients (module
    docstring): the bucket tokens, the zero-bubble probes and the split linears' records.

    Args:
      buckets: the flat fp32 buckets, a sequence (keys ``0, 1, ...``) or a mapping by key.
      probes: zero probes shaped like the split linears' outputs (``None``: only record,
        e.g. under ``jax.eval_shape``).
      on_complete: ``on_complete(key, k)`` (optional; the last backward of a step) asks,
        for the bucket ``key`` of a layer group that
        :func:`~jax_wgrad.functional.scan_layers` has just completed in the backward, for a
        :data:`ChunkSync` that syncs it in ``k`` chunks while the backward runs the ``k``
        iterations of the group below (``None``: leave it): Megatron's reduce-scatter of a
        bucket as soon as its gradients are complete, overlapped with the rest of the
        backward.
      async_tp: a sequence-parallel column-parallel linear into a bucket runs Megatron's
        asynchronous backward (:func:`~jax_wgrad.functional.linear`'s ``gather_axis``),
        its collectives beside its GEMMs. Default: without ``on_complete``. A backward
        that syncs layer groups' chunks leaves them composed: XLA:GPU keeps one collective
        in flight, and the chunk runs beside the layer's weight-gradient GEMMs once the
        layer's data gradient is done, which the asynchronous backward would hold back
        until the last weight gradient (the H100 compiles of the ``-groups-graphs`` rows
        lost their overlapped sync).

    Attributes:
      inputs, outputs: per probe, the input and output its split linear recorded.
    """

    def __init__(
        self,
        buckets: Mapping[Hashable, jax.Array] | Sequence[jax.Array] = (),
        probes: Sequence[jax.Array | None] = (),
        *,
        on_complete: Callable[[Hashable, int], ChunkSync | None] | None = None,
        async_tp: bool | None = None,
    ):
        self.on_complete = on_complete
        self.async_tp = on_complete is None if async_tp is None else async_tp
        self._keyed = isinstance(buckets, Mapping)
        self._tokens: dict[Hashable, jax.Array] = (
            dict(buckets) if self._keyed else dict(enumerate(buckets))
        )
        self._probes = list(probes)
        self.inputs: list[jax.Array | None] = [None] * len(self._probes)
        self.outputs: list[jax.Array | None] = [None] * len(self._probes)
        self._attached: list[Route] = []
        self._used: set[Route] = set()

    # -- attaching weights: each returns the weight as a variable carrying its route

    def to_bucket(
        self, weight: Any, bucket: Hashable, offset: ops.Offset, *, name: str = ""
    ) -> nnx.Variable:
        """``weight`` (an array or an NNX variable), routed: its gradient is added to
        bucket ``bucket`` from element ``offset`` on (a Python int, or a traced
        :class:`~jax_wgrad.ops.BlockOffset` / int32 scalar, see
        :func:`~jax_wgrad.functional.linear_into_bucket`); ``name`` is for error
        messages."""
        if bucket not in self._tokens:
            raise ValueError(
                f"WgradRoutes.to_bucket: bucket {bucket!r} out of range (have {list(self._tokens)})"
            )
        return self._route(weight, ToBucket(bucket, offset, name or _default_name(weight)))

    def to_split(self, weight: Any, index: int, *, name: str = "") -> nnx.Variable:
        """``weight``, routed: its linear is split for zero bubble with probe
        ``probes[index]``."""
        if not 0 <= index < len(self._probes):
            raise ValueError(
                f"WgradRoutes.to_split: probe {index} out of range "
                f"(have {len(self._probes)} probes)"
            )
        return self._route(weight, ToSplit(index, name or _default_name(weight)))

    def to_pieces(self, weight: Any, pieces: Sequence[RowPiece], *, name: str = "") -> nnx.Variable:
        """``weight`` (stacked ``[n, ...]``), routed: its rows' gradients are in several
        buckets; ``pieces`` cover rows ``0 .. n`` in order (each piece's rows one block of
        its bucket). Only :func:`~jax_wgrad.functional.scan_layers` can run it."""
        name = name or _default_name(weight)
        pieces = tuple(pieces)
        bounds = [p.rows for p in pieces]
        shape = value_of(weight).shape
        n = shape[0] if shape else 0
        if (
            not pieces
            or bounds[0][0] != 0
            or bounds[-1][1] != n
            or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:]))
            or any(r[0] >= r[1] for r in bounds)
        ):
            raise ValueError(
                f"WgradRoutes.to_pieces: the pieces of {name} must cover its rows 0..{n} "
                f"in order, got rows {bounds}"
            )
        for p in pieces:
            if p.key not in self._tokens:
                raise ValueError(
                    f"WgradRoutes.to_pieces: bucket {p.key!r} out of range "
                    f"(have {list(self._tokens)})"
                )
        return self._route(weight, ToPieces(pieces, name))

    def _route(self, weight: Any, dest: Destination) -> nnx.Variable:
        old = route_of(weight)
        if old is not None:
            raise ValueError(
                f"WgradRoutes: {dest.name} is already routed (as {old.name}); one "
                "destination per weight"
            )
        route = Route(self, dest)
        self._attached.append(route)
        if isinstance(weight, nnx.Variable):
            return weight.replace(**{WGRAD: route})
        return nnx.Param(weight, **{WGRAD: route})

    # -- results

    @property
    def buckets(self) -> tuple[jax.Array, ...] | dict[Hashable, jax.Array]:
        """The current bucket tokens, in the form given (a tuple, or a dict by key)."""
        return dict(self._tokens) if self._keyed else tuple(self._tokens.values())

    def close(self) -> tuple[jax.Array, ...] | dict[Hashable, jax.Array]:
        """The buckets after the call (:attr:`buckets`), once every attached weight has
        reached a library linear.

        Raises:
          ValueError: naming every attached weight whose variable no library linear (or
            layer scan) received -- its gradient would be lost: the model used its value
            (``self.weight[...]``) in a GEMM of its own instead of handing the variable to
            :func:`~jax_wgrad.functional.linear`.
        """
        unused = [r.name for r in self._attached if r not in self._used]
        if unused:
            raise ValueError(
                f"WgradRoutes: {', '.join(unused)} had a gradient destination but no "
                "jax_wgrad linear received its variable; its gradient would be lost (hand "
                "the variable to the linear -- linear(x, self.weight), or a "
                "jax.tree.map of it to cast or reshape -- not its value self.weight[...])"
            )
        return self.buckets

    # -- what the split linears call

    def probe(self, route: Route) -> jax.Array | None:
        """The probe of a split weight (``None``: only record)."""
        self._used.add(route)
        return self._probes[route.dest.index]

    def record(self, route: Route, x: jax.Array, y: jax.Array) -> None:
        """A split linear's input and output (its ``W`` pair's ``x``; ``y`` for shapes)."""
        index = route.dest.index
        if self.inputs[index] is not None:
            raise ValueError(
                f"WgradRoutes: {route.name} is split for zero bubble and used twice in one "
                "call (its W task keeps one (x, dy) pair)"
            )
        self.inputs[index], self.outputs[index] = x, y


def _default_name(weight: Any) -> str:
    return f"weight {tuple(value_of(weight).shape)}"


class StackRoutes:
    """The routes of one ``lax.scan`` over stacked layers
    (:func:`~jax_wgrad.functional.scan_layers`), read from the stacked leaves it is given.

    ``keys``: the bucket tokens every part of the scan carries; ``probes``: the stacked
    probes ``[n, ...]`` of the split leaves (scan inputs). ``parts``: the row ranges at
    which the scan is cut when some leaves' gradients live in row pieces (a layout in
    layer groups; ``()``: one scan): part ``p`` carries :meth:`carried` ``(p)`` -- the
    keys above, its pieces' buckets and the buckets of the part above it, which the
    backward completes before it runs part ``p`` (:meth:`completed`). Per layer,
    :meth:`layer` routes that layer's slices; after the scan, :meth:`put` and
    :meth:`finish` hand the tokens and the stacked records back to the call's routes.

    Args:
      leaves: the stacked leaves (arrays or NNX variables); the routed ones must all
        belong to one :class:`WgradRoutes`.
    """

    def __init__(self, leaves: Sequence[Any]):
        routes = [route_of(a) for a in leaves]
        owners: list[WgradRoutes] = []
        for r in routes:
            if r is not None and not any(r.routes is o for o in owners):
                owners.append(r.routes)
        if len(owners) > 1:
            raise ValueError(
                "scan_layers: the stacked weights are routed by different differentiated "
                "calls (WgradRoutes); one call's routes per scan"
            )
        self._outer: WgradRoutes | None = owners[0] if owners else None
        self._routes = routes
        dests = [None if r is None else r.dest for r in routes]
        self._dests = dests
        self.keys: tuple[Hashable, ...] = tuple(
            dict.fromkeys(d.key for d in dests if isinstance(d, ToBucket))
        )
        self._split = [(k, d) for k, d in enumerate(dests) if isinstance(d, ToSplit)]
        pieces = [d for d in dests if isinstance(d, ToPieces)]
        cuts = {tuple(p.rows for p in d.pieces) for d in pieces}
        if len(cuts) > 1:
            raise ValueError(
                "scan_layers: the stacked weights laid out in row pieces must share one "
                f"cut into groups of layers, got {sorted(cuts)}"
            )
        self.parts: tuple[tuple[int, int], ...] = cuts.pop() if cuts else ()
        self._pieces = pieces

    @property
    def on_complete(self) -> Callable[[Hashable, int], ChunkSync | None] | None:
        """The call's ``on_complete`` (:class:`WgradRoutes`)."""
        return None if self._outer is None else self._outer.on_complete

    def part_keys(self, part: int) -> tuple[Hashable, ...]:
        """The buckets of the row pieces of part ``part`` (``()`` past the last part)."""
        if not 0 <= part < len(self.parts):
            return ()
        return tuple(dict.fromkeys(d.piece(self.parts[part]).key for d in self._pieces))

    def completed(self, part: int) -> tuple[Hashable, ...]:
        """The buckets complete in the backward when it reaches part ``part``: those of
        the part above that no part from ``part`` down and no other weight of the scan
        writes."""
        below = set(self.keys).union(*(self.part_keys(q) for q in range(part + 1)))
        return tuple(k for k in self.part_keys(part + 1) if k not in below)

    def carried(self, part: int | None) -> tuple[Hashable, ...]:
        """The tokens part ``part`` of the scan carries (``None``: the uncut scan)."""
        if part is None:
            return self.keys
        return tuple(dict.fromkeys(self.keys + self.part_keys(part) + self.part_keys(part + 1)))

    def tokens(self, keys: Sequence[Hashable]) -> tuple[jax.Array, ...]:
        """The call's current tokens of ``keys``."""
        return tuple(self._outer._tokens[k] for k in keys)

    @property
    def probes(self) -> list[jax.Array | None]:
        """The stacked probes of the split leaves (scan inputs)."""
        return [self._outer._probes[d.index] for _, d in self._split]

    def layer(
        self,
        keys: Sequence[Hashable],
        tokens: Sequence[jax.Array],
        layer_leaves: Sequence[Any],
        index: jax.Array,
        probes: Sequence[jax.Array | None],
        part: int | None = None,
    ) -> tuple[WgradRoutes, list[Any]]:
        """The routes of layer ``index`` (traced int32, of the FULL stacks) in part
        ``part`` and its leaves routed there: ``layer_leaves[k]`` is leaf ``k``'s slice
        ``[...]``; a bucket leaf's block at ``BlockOffset(offset, index, size)`` (exact at
        any bucket size; a row piece's offset counted from its first row); ``tokens``: the
        part's carried ``keys``; ``probes``: this layer's probes of the split leaves."""
        inner = WgradRoutes(
            dict(zip(keys, tokens)),
            probes,
            async_tp=True if self._outer is None else self._outer.async_tp,
        )
        routed, j = [], 0
        for leaf, dest in zip(layer_leaves, self._dests):
            size = math.prod(value_of(leaf).shape)
            bare = leaf.replace(**{WGRAD: None}) if isinstance(leaf, nnx.Variable) else leaf
            if isinstance(dest, ToBucket):
                leaf = inner.to_bucket(
                    bare, dest.key, advance(dest.offset, index, size), name=dest.name
                )
            elif isinstance(dest, ToPieces):
                piece = dest.piece(self.parts[part])
                base = piece.offset - piece.rows[0] * size
                leaf = inner.to_bucket(bare, piece.key, advance(base, index, size), name=dest.name)
            elif isinstance(dest, ToSplit):
                leaf = inner.to_split(bare, j, name=dest.name)
                j += 1
            routed.append(leaf)
        return inner, routed

    @staticmethod
    def layer_result(routes: WgradRoutes, keys: Sequence[Hashable]):
        """``(tokens, inputs, outputs)`` of a layer's routes after the layer ran."""
        tokens = routes.close()
        return tuple(tokens[k] for k in keys), routes.inputs, routes.outputs

    def put(self, keys: Sequence[Hashable], tokens: Sequence[jax.Array]) -> None:
        """A part's carried tokens after its scan, back into the call's routes."""
        for key, token in zip(keys, tokens):
            self._outer._tokens[key] = token
        for r in self._routes:
            if r is not None:
                self._outer._used.add(r)

    def finish(self, inputs, outputs) -> None:
        """The stacked records ``[k, ...]`` into the call's routes."""
        for j, (_, dest) in enumerate(self._split):
            self._outer.inputs[dest.index] = inputs[j]
            self._outer.outputs[dest.index] = outputs[j]
