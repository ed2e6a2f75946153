"""One definition of every rule the library's XLA FFI primitives need.

Each op is declared once as an :class:`FfiPrimitive` (in the spirit of
TransformerEngine's ``BasePrimitive``): its name, FFI target, attributes, in-place
operand, batching method and its few op-specific hooks. Constructing the spec creates and
registers the named ``jax.extend.core.Primitive`` (:attr:`FfiPrimitive.primitive`) with
the rules below, each written here once for all ops:

* **impl**: an eager call compiles the bound primitive with ``jax.jit``;
* **abstract eval**: an in-place op's result is typed exactly like the operand aliased to
  it (shape, dtype and, under ``shard_map``, its varying mesh axes, as
  ``jax.ffi.ffi_call`` types a result like the given aval); other ops give ``abstract``;
* **lowering**, for each platform of :data:`~jax_wgrad.ops.registry.PLATFORMS`:
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
* **status**: the op's ``family`` (one of :data:`~jax_wgrad.ops.registry.OP_FAMILIES`),
  :meth:`FfiPrimitive.unavailable`, and the ``self_check`` cases (:class:`ProbeCase`:
  calls of the public functions on small integer data with their exact results, each of
  the op's family unless it names another) that :func:`~jax_wgrad.ops.fusion_status` runs
  on a device, one program per family, before it reports the family as working there.

A named primitive (rather than a bare ``jax.ffi.ffi_call``) shows up under its own name in
compiled HLO and in profiler traces. None has side effects (``has_side_effect`` would
break ``jax.checkpoint`` on jax 0.10), and none has a partitioning rule: the kernels see
per-device shards inside ``shard_map``.
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

from jax_wgrad.ops import registry

__all__ = ["FfiPrimitive", "ProbeCase", "defined"]


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
    """The op family (:data:`~jax_wgrad.ops.registry.OP_FAMILIES`) the case belongs to;
    ``None``: the declaring :class:`FfiPrimitive`'s ``family``."""


VMAP_METHODS = ("broadcast_all", "sequential", None)

_DEFINED: dict[str, FfiPrimitive] = {}


def defined() -> tuple[FfiPrimitive, ...]:
    """Every op declared so far, in the order of declaration."""
    return tuple(_DEFINED.values())


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
    """The op family (one of :data:`~jax_wgrad.ops.registry.OP_FAMILIES`) whose status
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
    primitive: Primitive = dataclasses.field(init=False)
    """The registered jax primitive."""

    def __post_init__(self) -> None:
        if self.vmap_method not in VMAP_METHODS:
            raise ValueError(
                f"{self.name}: vmap_method must be one of {VMAP_METHODS}, got {self.vmap_method!r}"
            )
        if self.family not in registry.OP_FAMILIES:
            raise ValueError(
                f"{self.name}: family must be one of {registry.OP_FAMILIES}, got {self.family!r}"
            )
        if self.per_example and self.vmap_method != "sequential":
            raise ValueError(f"{self.name}: per_example is for vmap_method='sequential'")
        if self.abstract is None and 0 not in self.aliases.values():
            raise ValueError(
                f"{self.name}: an op with no operand aliased to its result needs abstract"
            )
        primitive = Primitive(self.name)
        object.__setattr__(self, "primitive", primitive)

        def impl(*args, **params):
            return primitive.bind(*args, **params)

        impl.__name__ = self.name
        primitive.def_impl(jax.jit(impl, static_argnames=tuple(self.attributes)))
        primitive.def_abstract_eval(self._abstract_eval)
        if self.vmap_method is not None:
            batching.primitive_batchers[primitive] = self._batch
        for platform in registry.PLATFORMS:
            mlir.register_lowering(
                primitive, functools.partial(self._lower, platform), platform=platform
            )
        if self.fallback is not None:
            mlir.register_lowering(primitive, mlir.lower_fun(self.fallback, multiple_results=False))
        _DEFINED[self.name] = self

    def unavailable(self, platform: str) -> str | None:
        """Why the op cannot be lowered to its handler on ``platform``, or ``None``
        (whether a call works is the probe's business: :func:`~jax_wgrad.ops.fusion_status`)."""
        reason = registry.load_error(platform)
        if reason is None and self.target not in registry.handler_metadata(platform):
            reason = (
                f"its {platform} handler module was built without {self.target}; rebuild "
                "jax_wgrad (pip install .)"
            )
        return reason

    # ---- the rules ---------------------------------------------------------------------

    def _abstract_eval(self, *avals, **params):
        if self.abstract is not None:
            return self.abstract(*avals, **params)
        return avals[next(i for i, r in self.aliases.items() if r == 0)]

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
