"""Whether the fused handlers work: shown by running them, per op family.

The top of the ops tier: it imports every op module (:data:`OPS` names the library's ops)
and the handlers' registry below them (:mod:`jax_wgrad.ops.handlers`).

**Status that is shown, not assumed.** Registering a handler proves nothing (a CUDA
registration on a CPU-only jaxlib succeeds silently). The status is therefore kept per
*op family* (:data:`~jax_wgrad.ops.handlers.OP_FAMILIES`): the kernels one kind of layer
needs --

* ``"dense"``: :func:`~jax_wgrad.ops.wgrad_accumulate` on 2-D weights (every dtype pair and
  precision, blocks of a bucket at static, traced and 64-bit positions), what every fused
  linear calls;
* ``"bucket_add"``: :func:`~jax_wgrad.ops.bucket_add`, the in-place add of the unfused
  gradients into their buckets;
* ``"grouped"``: :func:`~jax_wgrad.ops.grouped_wgrad_accumulate` (expert weights
  ``[E, out, in]`` of capacity-buffer MoE layers; the same two primitives as ``"dense"``);
* ``"ragged"``: :func:`~jax_wgrad.ops.ragged_matmul` and
  :func:`~jax_wgrad.ops.ragged_wgrad_accumulate` (dropless MoE layers).

A dense model's fused path needs :data:`~jax_wgrad.ops.handlers.DENSE_FAMILIES`; an MoE
model adds its experts' family (a
:class:`~jax_wgrad.parallel.pipeline.program.StageProgram` names its own:
``fused_op_families``). So a broken expert kernel marks only its family unusable, and
:func:`require_fusion` still lets a dense model fuse.

A family's status checks that the loaded module holds the targets of its ops, then runs
the family once, on the first query per platform, on a device of *this* process
(multi-process runs: every process checks its own): one jitted program per family calling
every kernel variant of it (:func:`_probe`: the ``self_check`` cases
(:class:`~jax_wgrad.ops.primitive.ProbeCase`) each op of :data:`OPS` declares, with their
family), each result checked against numpy. The families are probed in the order of
``OP_FAMILIES`` (asking for one first probes those before it): ``"dense"`` first, so that
a sticky CUDA error left by a later family's kernel cannot hide the dense result. The
probe runs in a thread of its own, outside any ``jit``/``eval_shape``/NNX trace of the
caller. A success or a wrong answer is remembered per ``(platform, family)``; a failure
that may pass (no device yet, out of memory, a trace) is not, and the next query tries
again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

import jax
import numpy as np

from jax_wgrad.ops.bucket_add import BUCKET_ADD
from jax_wgrad.ops.handlers import (
    DENSE_FAMILIES,
    OP_FAMILIES,
    PLATFORMS,
    fusion_error,
    load_error,
    normalize_platform,
)
from jax_wgrad.ops.primitive import FfiPrimitive, ProbeCase
from jax_wgrad.ops.ragged import RAGGED_MATMUL, RAGGED_WGRAD_ACCUMULATE
from jax_wgrad.ops.wgrad import WGRAD_ACCUMULATE, WGRAD_ACCUMULATE_AT

__all__ = ["OPS", "fusion_status", "op_status", "fusion_available", "require_fusion"]

OPS: tuple[FfiPrimitive, ...] = (
    WGRAD_ACCUMULATE,
    WGRAD_ACCUMULATE_AT,
    BUCKET_ADD,
    RAGGED_MATMUL,
    RAGGED_WGRAD_ACCUMULATE,
)
"""Every op of the library, in the order their ``self_check`` cases are probed."""

# (platform, family) -> None when the family's probe ran and was right, else why not
# (lazy; only outcomes that cannot change within the process are kept).
_VERIFIED: dict[tuple[str, str], str | None] = {}
_PROBE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Outcome:
    reason: str | None
    """``None``: every kernel variant of the family ran and was right; else why not."""
    final: bool
    """Whether the outcome holds for the rest of the process (kept by the cache)."""
    whole_platform: bool = False
    """The reason is the platform's, not the family's (handlers not loaded, no device)."""


# Status codes of a failure that another attempt may not repeat.
_TRANSIENT = (
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "ABORTED",
    "CANCELLED",
    "Out of memory",
)


def _families(families: str | Iterable[str]) -> tuple[str, ...]:
    """``families`` (one name or several) checked against ``OP_FAMILIES``, in that order
    (the order they are probed in)."""
    names = (families,) if isinstance(families, str) else tuple(families)
    unknown = [f for f in names if f not in OP_FAMILIES]
    if unknown:
        raise ValueError(f"unknown op families {unknown}; the op families are {OP_FAMILIES}")
    return tuple(f for f in OP_FAMILIES if f in names)


def _declared() -> list[tuple[FfiPrimitive, ProbeCase]]:
    """``[(op, case)]``: every op's ``self_check`` case, its family resolved (``None``: the
    op's), in the order of :data:`OPS`; small integer data that every precision (TF32
    included) and dtype represents exactly."""
    rng = np.random.default_rng(0)
    return [
        (op, case._replace(family=case.family or op.family))
        for op in OPS
        if op.self_check
        for case in map(ProbeCase._make, op.self_check(rng))
    ]


def _probe_cases(family: str | None = None) -> list[ProbeCase]:
    """Every kernel variant the library calls (of ``family``; ``None``: of every family):
    the :class:`~jax_wgrad.ops.primitive.ProbeCase` s ``(name, fn, args, want, family)``
    of every op's ``self_check``, each with its family."""
    return [case for _, case in _declared() if family in (None, case.family)]


def _probe(platform: str, family: str) -> _Outcome:
    """Runs every kernel variant of ``family`` once, in one program, on a device of this
    process; checks each result."""
    try:
        device = jax.local_devices(backend=platform)[0]
    except RuntimeError as exc:
        return _Outcome(
            f"the handler is built, but jax sees no {platform} device of this process ({exc})",
            final=False,
            whole_platform=True,
        )
    cases = _probe_cases(family)
    if not cases:
        return _Outcome(None, final=True)
    try:
        args = jax.device_put([c.args for c in cases], device)
        got = jax.jit(lambda args: [c.fn(*a) for c, a in zip(cases, args)])(args)
        got = [np.asarray(g, np.float64) for g in got]
    except Exception as exc:
        message = str(exc).splitlines()[0][:300] if str(exc) else ""
        return _Outcome(
            f"a test call of the {platform} handler on {device} failed: "
            f"{type(exc).__name__}: {message}",
            final=not any(code in str(exc) for code in _TRANSIENT),
        )
    for case, value in zip(cases, got):
        if not np.array_equal(value, case.want):
            return _Outcome(
                f"the {platform} handler ran on {device} but returned wrong values ({case.name})",
                final=True,
            )
    return _Outcome(None, final=True)


def _probe_outside_traces(platform: str, family: str) -> _Outcome:
    """:func:`_probe` in a thread of its own: jax's trace state is per thread, so a query
    made while the caller traces (``jit``, ``eval_shape``, NNX transforms) runs concrete."""
    box: list[_Outcome] = []

    def run() -> None:
        try:
            box.append(_probe(platform, family))
        except Exception as exc:
            box.append(
                _Outcome(
                    f"the {platform} handler check failed: {type(exc).__name__}: {exc}", final=False
                )
            )

    thread = threading.Thread(target=run, name=f"jax_wgrad-fusion-probe-{platform}-{family}")
    thread.start()
    thread.join()
    return box[0]


def _unbuilt(platform: str, family: str) -> str | None:
    """Why some op of ``family`` (declared in it, or declaring one of its cases) cannot be
    lowered to ``platform``'s handlers (a target missing from the built module), or
    ``None``."""
    used = {op for op, case in _declared() if case.family == family}
    members = [op for op in OPS if op.family == family or op in used]
    return next(filter(None, (op.unavailable(platform) for op in members)), None)


def _family_outcome(platform: str, family: str) -> _Outcome:
    """``family``'s outcome on ``platform``: the families before it are probed first (in
    the order of ``OP_FAMILIES``); final outcomes are remembered."""
    loaded = load_error(platform)
    if loaded is not None:
        return _Outcome(loaded, final=True, whole_platform=True)
    with _PROBE_LOCK:
        outcome = _Outcome(None, final=True)
        for name in OP_FAMILIES[: OP_FAMILIES.index(family) + 1]:
            if (platform, name) in _VERIFIED:
                outcome = _Outcome(_VERIFIED[platform, name], final=True)
                continue
            unbuilt = _unbuilt(platform, name)
            outcome = (
                _Outcome(unbuilt, final=True) if unbuilt else _probe_outside_traces(platform, name)
            )
            if outcome.final:
                _VERIFIED[platform, name] = outcome.reason
        return outcome


def _status(platform: str, families: str | Iterable[str] = DENSE_FAMILIES) -> str | None:
    """``None`` when every family of ``families`` works on ``platform``, else the first
    failing family's reason, naming the family (unless the reason is the platform's)."""
    platform = normalize_platform(platform)
    for family in _families(families):
        outcome = _family_outcome(platform, family)
        if outcome.reason is not None:
            if outcome.whole_platform:
                return outcome.reason
            return f"op family '{family}': {outcome.reason}"
    return None


def fusion_status(families: str | Iterable[str] = DENSE_FAMILIES) -> dict[str, str | None]:
    """Per platform (``"cpu"``, ``"cuda"``): ``None`` if the fused handlers of every op
    family of ``families`` (:data:`~jax_wgrad.ops.handlers.OP_FAMILIES`; default
    :data:`~jax_wgrad.ops.handlers.DENSE_FAMILIES`, what a dense model's fused path needs)
    were shown to work by a test call on a device of this process, else the reason they
    cannot be used, naming the first failing family (not built, built for a newer jax,
    library missing, no device, a call failed or was wrong).

    Each family is its own test program, running every kernel variant of it: for
    ``"dense"`` float32 at default (TF32 on GPUs) and highest precision, bf16/fp16 into
    fp32 and into 16-bit, an offset block, a block at a traced offset and at a 64-bit
    position ``base + index * stride``; for ``"bucket_add"`` several blocks; for
    ``"grouped"`` grouped experts at a static, a traced and a 64-bit position; for
    ``"ragged"`` the ragged grouped GEMMs of :mod:`jax_wgrad.ops.ragged`. Per family:
    :func:`op_status`.

    The first query of a family on a platform compiles and runs its program there (and
    those of the families before it in ``OP_FAMILIES``); it may be made anywhere, also
    while tracing.

    Args:
      families: op family names (or one name).
    Raises:
      ValueError: an unknown family.
    """
    families = _families(families)
    return {p: _status(p, families) for p in PLATFORMS}


def op_status(platform: str | None = None) -> dict[str, str | None]:
    """Per op family of :data:`~jax_wgrad.ops.handlers.OP_FAMILIES`: ``None`` if its
    handlers were shown to work on ``platform`` (see :func:`fusion_status`), else why not
    (for a wrong value: the failing case).

    Args:
      platform: ``"cpu"``, ``"cuda"`` (or ``"gpu"``); default: jax's default backend.
    """
    platform = normalize_platform(platform)
    return {f: _family_outcome(platform, f).reason for f in OP_FAMILIES}


def fusion_available(
    platform: str | None = None, families: str | Iterable[str] = DENSE_FAMILIES
) -> bool:
    """Whether the fused handlers of every family of ``families`` work on ``platform``
    (see :func:`fusion_status`).

    Args:
      platform: ``"cpu"``, ``"cuda"`` (or ``"gpu"``); default: jax's default backend.
      families: op family names (default ``DENSE_FAMILIES``, a dense model's).
    """
    platform = normalize_platform(platform)
    families = _families(families)
    return platform in PLATFORMS and _status(platform, families) is None


def require_fusion(
    platform: str | None = None,
    *,
    who: str = "wgrad_accumulate",
    families: str | Iterable[str] = DENSE_FAMILIES,
) -> None:
    """Raises ``RuntimeError`` (Megatron's wording,
    :func:`~jax_wgrad.ops.handlers.fusion_error`, naming the failing op family) when fusion
    is unavailable for any family of ``families`` (default ``DENSE_FAMILIES``; an MoE
    model adds its experts' family) on ``platform``."""
    platform = normalize_platform(platform)
    families = _families(families)
    if fusion_available(platform, families):
        return
    reason = (
        _status(platform, families)
        if platform in PLATFORMS
        else f"jax_wgrad has no handler for platform '{platform}'"
    )
    raise RuntimeError(fusion_error(platform, reason, who=who))
