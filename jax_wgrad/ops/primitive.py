"""One definition of every rule the library's XLA FFI primitives need.

Each op is declared once as an :class:`FfiPrimitive` (in the spirit of
TransformerEngine's ``BasePrimitive`` and of jax's own ``standard_primitive(shape_rule,
dtype_rule, name, sharding_rule=, vma_rule=)``): its name, FFI target, attributes,
in-place operand, batching method and its few op-specific hooks. Constructing the spec
creates and registers the named ``jax.extend.core.Primitive``
(:attr:`FfiPrimitive.primitive`) with the rules below, each written here once for all ops:

* **impl**: an eager call compiles the bound primitive with ``jax.jit``;
* **abstract eval**: the result's shape and dtype are those of the operand aliased to it
  (an in-place op), else what the op's ``abstract`` gives; its type under ``shard_map``
  and under explicit sharding comes from two declared rules, chosen by the op's kind
  unless the spec names its own:

  - ``vma_rule``, the mesh axes the result varies over inside ``jax.shard_map(...,
    check_vma=True)``: an in-place op's result is typed like its aliased operand (the
    result *is* that buffer), and an operand varying over an axis the aliased operand
    does not is a type error naming the ``jax.lax.pcast`` that fixes it
    (:func:`same_vma_as`) -- the op's public function binds through
    :meth:`FfiPrimitive.bind`, which widens the aliased operand first, as jax widens
    the operands of its own ops, so there the result varies over the union; an op with
    ``abstract`` varies over the union of its operands' axes (:func:`union_vma`);
  - ``sharding_rule``, the result's sharding under a mesh with ``Explicit`` axes: an
    in-place op keeps its aliased operand's (:func:`same_sharding_as`); an op with
    ``abstract`` takes replicated operands only and raises a ``ValueError`` naming the
    sharded ones (:func:`replicated_sharding`). Neither op kind has a partitioning rule
    for XLA: under plain ``jit`` with sharded operands XLA gathers the operands of the
    custom call and runs it whole on every device (correct, not efficient); the library
    calls the ops on per-device shards inside ``shard_map``;
* **lowering**, for each platform of :data:`~jax_wgrad.ops.handlers.PLATFORMS`:
  the custom call of ``jax.ffi.ffi_lowering`` (one target name for CPU and CUDA, the
  in-place operand aliased to result 0, each parameter an FFI attribute of its declared
  type -- positions are int64 -- and the extra results a platform's handler writes as
  scratch). Where :meth:`FfiPrimitive.unavailable` gives a reason (the platform's
  handlers not loaded, or built without the target), the op's plain-XLA ``fallback`` is
  lowered instead if it has one, else compiling raises one ``RuntimeError`` naming the
  platform and the reason. Other platforms (TPU, ROCm, ...) get the fallback or no rule;
* **batching**, by a ``vmap_method`` every op must declare (``jax.ffi.ffi_call`` has no
  safe default either): ``"broadcast_all"`` (every operand gets a leading batch dim and
  the handler loops over it), ``"sequential"`` (a ``lax.map`` over the batch) or ``None``
  (``vmap`` is refused);
* **status**: the op's ``family`` (one of :data:`~jax_wgrad.ops.handlers.OP_FAMILIES`),
  :meth:`FfiPrimitive.unavailable`, and the ``self_check`` cases (:class:`ProbeCase`:
  calls of the public functions on small integer data with their exact results, each of
  the op's family unless it names another) that :func:`~jax_wgrad.ops.fusion_status` runs
  on a device, one program per family, before it reports the family as working there
  (:mod:`jax_wgrad.ops.status`, above the op modules, lists the library's ops).

A named primitive (rather than a bare ``jax.ffi.ffi_call``) shows up under its own name in
compiled HLO and in profiler traces. None has side effects (``has_side_effect`` would
break ``jax.checkpoint`` on jax 0.10).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_wgrad.ops.handlers import OP_FAMILIES, PLATFORMS, handler_metadata, load_error

__all__ = [
    "FfiPrimitive",
    "ProbeCase",
    "VmaRule",
    "ShardingRule",
    "varying_axes",
    "same_vma_as",
    "union_vma",
    "same_sharding_as",
    "replicated_sharding",
]


class ProbeCase(NamedTuple):
    """One case of an op's ``self_check``: ``fn(*args)`` must equal ``want`` exactly."""

    name: str
    """What the case checks (named in a wrong-value status)."""
    fn: Callable[..., Any]
    """Calls the public function(s), as a user does."""
    args: tuple[Any, ...]
    """The arguments (numpy arrays; operands of the probe program)."""
    want: np.ndarray
    """The exact result."""
    family: str | None = None
    """The op family (:data:`~jax_wgrad.ops.handlers.OP_FAMILIES`) the case belongs to;
    ``None``: the declaring :class:`FfiPrimitive`'s ``family``."""


VMAP_METHODS = ("broadcast_all", "sequential", None)

VmaRule = Callable[..., frozenset]
"""``vma_rule(*avals, **params)``: the mesh axes the result varies over inside
``jax.shard_map(..., check_vma=True)`` (jax's ``vma_rule``)."""
ShardingRule = Callable[..., NamedSharding]
"""``sharding_rule(*avals, **params)``: the result's sharding (jax's ``sharding_rule``)."""


def varying_axes(aval: jax.core.ShapedArray) -> frozenset:
    """The mesh axes ``aval`` varies over inside ``shard_map`` (empty outside, and with
    ``check_vma=False``)."""
    return aval.manual_axis_type.varying


def same_vma_as(operand: int, name: str) -> VmaRule:
    """The vma rule of an op whose result is operand ``operand``'s buffer (``name``: the
    op's, for the error): the result varies over exactly that operand's axes, and an
    operand varying over an axis it does not raises ``ValueError`` -- the result would
    hold values that differ along an axis its type says they do not."""

    def rule(*avals, **params) -> frozenset:
        own = varying_axes(avals[operand])
        for i, aval in enumerate(avals):
            extra = varying_axes(aval) - own
            if extra:
                axes = tuple(sorted(extra))
                raise ValueError(
                    f"{name}: operand {i} varies over the mesh axes {axes} and operand "
                    f"{operand}, which the result updates in place, does not; make it vary "
                    f"over them first: jax.lax.pcast(operand, {axes}, to='varying')"
                )
        return own

    return rule


def union_vma(*avals, **params) -> frozenset:
    """The vma rule of an op with a new result: it varies over every axis an operand
    varies over."""
    return frozenset().union(*map(varying_axes, avals))


def same_sharding_as(operand: int) -> ShardingRule:
    """The sharding rule of an op whose result is operand ``operand``'s buffer: that
    operand's sharding."""

    def rule(*avals, **params) -> NamedSharding:
        return avals[operand].sharding

    return rule


def replicated_sharding(name: str) -> ShardingRule:
    """The sharding rule of an op with no partitioning rule and a new result: replicated
    over the operands' mesh; an operand sharded over ``Explicit`` mesh axes raises
    ``ValueError`` (``name``: the op's, for the error)."""

    def rule(*avals, **params) -> NamedSharding:
        meshes = [a.sharding.mesh for a in avals if not a.sharding.mesh.empty]
        mesh = meshes[0] if meshes else jax.sharding.get_abstract_mesh()
        sharded = [
            f"operand {i}: {aval.str_short()}"
            for i, aval in enumerate(avals)
            if set(aval.sharding.mesh.explicit_axes) & set(_spec_axes(aval.sharding.spec))
        ]
        if sharded:
            raise ValueError(
                f"{name} has no partitioning rule: its operands must be replicated over the "
                f"mesh's Explicit axes, got {', '.join(sharded)}; call it on per-device "
                "shards inside jax.shard_map, or replicate them first (jax.sharding.reshard)"
            )
        return NamedSharding(mesh, PartitionSpec())

    return rule


def _spec_axes(spec: PartitionSpec) -> list[str]:
    """Every mesh axis a partition spec names."""
    return [
        a
        for entry in spec
        if entry is not None
        for a in (entry if isinstance(entry, tuple) else (entry,))
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class FfiPrimitive:
    """An XLA FFI op: a named primitive with its rules (module docstring), registered
    when the spec is constructed."""

    name: str
    """The primitive's name, shown in jaxprs, compiled HLO and profiles."""
    target: str
    """The FFI target, one name for the CPU and the CUDA handler."""
    attributes: Mapping[str, type[np.generic]]
    """Each parameter of the primitive and the type of the FFI attribute it becomes (a
    tuple becomes an array of that type); a ``bind`` must give exactly these."""
    vmap_method: str | None
    """How ``vmap`` batches the op: one of :data:`VMAP_METHODS` (module docstring)."""
    family: str
    """The op family (one of :data:`~jax_wgrad.ops.handlers.OP_FAMILIES`) whose status
    covers the op: its ``self_check`` cases are probed in that family's program unless a
    case names another, and a target missing from the built module fails that family."""
    aliases: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """``{operand: result}`` updated in place (the result's buffer is the operand's)."""
    per_example: tuple[int, ...] = ()
    """``"sequential"`` batching: operands (accumulators) copied per batch element when
    unbatched; other unbatched operands are shared by every element."""
    abstract: Callable[..., jax.core.ShapedArray] | None = None
    """``abstract(*avals, **params)``: the result's aval; by default the aliased operand's."""
    scratch: Callable[..., list[jax.core.ShapedArray]] | None = None
    """``scratch(platform, *avals_in, **params)``: extra results the platform's handler
    writes as scratch memory (allocated by XLA with the temporaries), dropped after the
    call; by default none."""
    fallback: Callable[..., jax.Array] | None = None
    """``fallback(*args, **params)``: the same update in plain XLA, lowered where the
    handler is unavailable; by default none (compiling there raises)."""
    unavailable_message: Callable[[str, str], str] | None = None
    """``(platform, reason) -> message`` of the ``RuntimeError`` raised by compiling the
    op where its handler is unavailable; by default ``"<name>: the jax_wgrad handler for
    platform '<platform>' is not available (<reason>)"``."""
    self_check: Callable[[np.random.Generator], list[ProbeCase]] | None = None
    """The op's cases of the probe behind :func:`~jax_wgrad.ops.fusion_status` (each
    in its family's program)."""
    vma_rule: VmaRule | None = None
    """The mesh axes the result varies over inside ``shard_map`` (module docstring); by
    default :func:`same_vma_as` the aliased operand for an in-place op, else
    :func:`union_vma`."""
    sharding_rule: ShardingRule | None = None
    """The result's sharding under a mesh with ``Explicit`` axes (module docstring); by
    default :func:`same_sharding_as` the aliased operand for an in-place op, else
    :func:`replicated_sharding`."""
    primitive: Primitive = dataclasses.field(init=False)
    """The registered jax primitive."""

    def __post_init__(self) -> None:
        if self.vmap_method not in VMAP_METHODS:
            raise ValueError(
                f"{self.name}: vmap_method must be one of {VMAP_METHODS}, got {self.vmap_method!r}"
            )
        if self.family not in OP_FAMILIES:
            raise ValueError(
                f"{self.name}: family must be one of {OP_FAMILIES}, got {self.family!r}"
            )
        if self.per_example and self.vmap_method != "sequential":
            raise ValueError(f"{self.name}: per_example is for vmap_method='sequential'")
        if self.abstract is None and 0 not in self.aliases.values():
            raise ValueError(
                f"{self.name}: an op with no operand aliased to its result needs abstract"
            )
        aliased = self._aliased()
        if self.vma_rule is None:
            rule = union_vma if aliased is None else same_vma_as(aliased, self.name)
            object.__setattr__(self, "vma_rule", rule)
        if self.sharding_rule is None:
            rule = replicated_sharding(self.name) if aliased is None else same_sharding_as(aliased)
            object.__setattr__(self, "sharding_rule", rule)
        primitive = Primitive(self.name)
        object.__setattr__(self, "primitive", primitive)

        def impl(*args, **params):
            return primitive.bind(*args, **params)

        impl.__name__ = self.name
        primitive.def_impl(jax.jit(impl, static_argnames=tuple(self.attributes)))
        primitive.def_abstract_eval(self._abstract_eval)
        if self.vmap_method is not None:
            batching.primitive_batchers[primitive] = self._batch
        for platform in PLATFORMS:
            mlir.register_lowering(
                primitive, functools.partial(self._lower, platform), platform=platform
            )
        if self.fallback is not None:
            mlir.register_lowering(primitive, mlir.lower_fun(self.fallback, multiple_results=False))

    def bind(self, *args, **params) -> jax.Array:
        """Binds the primitive, as the op's public function does: an in-place op's aliased
        operand is first widened (``jax.lax.pcast(..., to="varying")``, no operation in
        the compiled program) to vary over every mesh axis an operand varies over, as
        jax's own ops widen their operands, so that its result -- that buffer -- is
        typed by :attr:`vma_rule` like a plain ``acc + update`` would be."""
        k = self._aliased()
        if k is not None:
            wider = frozenset().union(*(varying_axes(jax.typeof(a)) for a in args))
            missing = tuple(sorted(wider - varying_axes(jax.typeof(args[k]))))
            if missing:
                args = (*args[:k], jax.lax.pcast(args[k], missing, to="varying"), *args[k + 1 :])
        return self.primitive.bind(*args, **params)

    def unavailable(self, platform: str) -> str | None:
        """Why the op cannot be lowered to its handler on ``platform``, or ``None``
        (whether a call works is the probe's business: :func:`~jax_wgrad.ops.fusion_status`)."""
        reason = load_error(platform)
        if reason is None and self.target not in handler_metadata(platform):
            reason = (
                f"its {platform} handler module was built without {self.target}; rebuild "
                "jax_wgrad (pip install .)"
            )
        return reason

    # ---- the rules ---------------------------------------------------------------------

    def _aliased(self) -> int | None:
        """The operand updated in place into the result, if any."""
        return next((i for i, r in self.aliases.items() if r == 0), None)

    def _abstract_eval(self, *avals, **params):
        out = avals[self._aliased()] if self.abstract is None else self.abstract(*avals, **params)
        varying = self.vma_rule(*avals, **params)
        return out.update(
            sharding=self.sharding_rule(*avals, **params),
            manual_axis_type=out.manual_axis_type.update(varying=varying),
        )

    def _attributes(self, params: dict[str, Any]) -> dict[str, Any]:
        if set(params) != set(self.attributes):
            raise TypeError(
                f"{self.name}: parameters {sorted(params)}, expected {sorted(self.attributes)}"
            )
        return {
            k: np.asarray(v, t) if isinstance(v, tuple) else t(v)
            for k, t in self.attributes.items()
            for v in (params[k],)
        }

    def _unavailable_message(self, platform: str, reason: str) -> str:
        if self.unavailable_message is not None:
            return self.unavailable_message(platform, reason)
        return (
            f"{self.name}: the jax_wgrad handler for platform '{platform}' is not available "
            f"({reason})"
        )

    def _lower(self, platform: str, ctx, *args, **params):
        reason = self.unavailable(platform)
        if reason is not None:
            if self.fallback is not None:
                return mlir.lower_fun(self.fallback, multiple_results=False)(ctx, *args, **params)
            raise RuntimeError(self._unavailable_message(platform, reason))
        rule = jax.ffi.ffi_lowering(self.target, operand_output_aliases=dict(self.aliases))
        attributes = self._attributes(params)
        extra = list(self.scratch(platform, *ctx.avals_in, **params)) if self.scratch else []
        if not extra:
            return rule(ctx, *args, **attributes)
        results = len(ctx.avals_out)
        ctx = ctx.replace(avals_out=[*ctx.avals_out, *extra])
        return rule(ctx, *args, **attributes)[:results]

    def _batch(self, args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        if self.vmap_method == "broadcast_all":
            # The handlers take leading batch dims: an unbatched accumulator becomes one
            # copy per batch element, each accumulating its own update.
            moved = [
                jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
                for a, d in zip(args, dims)
            ]
            return self.primitive.bind(*moved, **params), 0
        mapped = [d is not None or i in self.per_example for i, d in enumerate(dims)]
        moved = [
            jnp.moveaxis(a, d, 0)
            if d is not None
            else jnp.broadcast_to(a, (size,) + a.shape)
            if m
            else a
            for a, d, m in zip(args, dims, mapped)
        ]

        def one(xs):
            it = iter(xs)
            operands = (next(it) if m else a for a, m in zip(moved, mapped))
            return self.primitive.bind(*operands, **params)

        return jax.lax.map(one, [a for a, m in zip(moved, mapped) if m]), 0
