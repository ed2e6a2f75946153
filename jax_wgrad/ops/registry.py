"""Loads the compiled FFI handlers, registers them with XLA, and says whether they work.

Two extension modules are built from ``ffi/``: ``_wgrad_ffi_cpu`` (always) and
``_wgrad_ffi_cuda`` (when CMake found a CUDA compiler). Each exports ``registrations()``,
a ``{target_name: PyCapsule or {stage: PyCapsule}}`` dict, registered here in a loop for
its platform, and ``handler_metadata()``, what each handler declares to XLA.

**Handlers that cannot break jax.** A handler declares the XLA FFI API version of the
headers it was built with, and XLA rejects a handler newer than itself -- when the backend
initializes, so the whole backend (and with the CUDA plugin, jax's own GPU custom calls)
goes down. The build pins the oldest supported jax's headers (``pyproject.toml``,
``ffi/CMakeLists.txt``); here, before anything is registered, each module's declared
version is compared with the running jaxlib's (:func:`runtime_ffi_api`), and a newer one
(or any registration error) becomes that platform's :func:`fusion_status` reason instead.

**Platform names.** XLA keeps a registration made before its platform's plugin is
initialised in a pending list keyed by the name as given, and the CUDA plugin flushes only
the key ``"CUDA"`` (``jaxlib.xla_client`` maps ``"cpu"`` and ``"gpu"``, not ``"cuda"``). So
the CUDA handlers are registered under ``"CUDA"`` -- the spelling of jax's FFI tutorial --
which reaches the handler on jax 0.10, 0.11 and 0.12 alike (measured:
``docs/design/h100_findings.md``, section 3).

**Status that is shown, not assumed.** Registering a handler proves nothing (a CUDA
registration on a CPU-only jaxlib succeeds silently). The status is therefore kept per
*op family* (:data:`OP_FAMILIES`): the kernels one kind of layer needs --

* ``"dense"``: :func:`~jax_wgrad.ops.wgrad_accumulate` on 2-D weights (every dtype pair and
  precision, blocks of a bucket at static, traced and 64-bit positions), what every fused
  linear calls;
* ``"bucket_add"``: :func:`~jax_wgrad.ops.bucket_add`, the in-place add of the unfused
  gradients into their buckets;
* ``"grouped"``: :func:`~jax_wgrad.ops.grouped_wgrad_accumulate` (expert weights
  ``[E, out, in]`` of capacity-buffer MoE layers; the same two primitives as ``"dense"``);
* ``"ragged"``: :func:`~jax_wgrad.ops.ragged_matmul` and
  :func:`~jax_wgrad.ops.ragged_wgrad_accumulate` (dropless MoE layers).

A dense model's fused path needs :data:`DENSE_FAMILIES`; an MoE model adds its experts'
family (a :class:`~jax_wgrad.parallel.pipeline.program.StageProgram` names its own:
``fused_op_families``). So a broken expert kernel marks only its family unusable, and
:func:`require_fusion` still lets a dense model fuse.

A family's status checks that the loaded module holds the targets of its ops, then runs
the family once, on the first query per platform, on a device of *this* process
(multi-process runs: every process checks its own): one jitted program per family calling
every kernel variant of it (:func:`_probe`: the ``self_check`` cases
(:class:`~jax_wgrad.ops.primitive.ProbeCase`) each
:class:`~jax_wgrad.ops.primitive.FfiPrimitive` declares, with their family), each result
checked against numpy. The families are probed in the order of :data:`OP_FAMILIES` (asking
for one first probes those before it): ``"dense"`` first, so that a sticky CUDA error
left by a later family's kernel cannot hide the dense result. The probe runs in a thread
of its own, outside any ``jit``/``eval_shape``/NNX trace of the caller. A success or a
wrong answer is remembered per ``(platform, family)``; a failure that may pass (no device
yet, out of memory, a trace) is not, and the next query tries again.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "TARGET",
    "TARGET_AT",
    "BUCKET_ADD_TARGET",
    "RAGGED_MATMUL_TARGET",
    "RAGGED_WGRAD_TARGET",
    "WGRAD_TARGETS",
    "PLATFORMS",
    "OLDEST_SUPPORTED_FFI_API",
    "load_error",
    "handler_loaded",
    "handler_metadata",
    "runtime_ffi_api",
    "OP_FAMILIES",
    "DENSE_FAMILIES",
    "fusion_status",
    "op_status",
    "fusion_available",
    "require_fusion",
    "fusion_error",
]

TARGET = "jax_wgrad_wgrad_accumulate"
"""FFI target of the fused weight-gradient GEMM (one name for CPU and CUDA)."""
TARGET_AT = "jax_wgrad_wgrad_accumulate_at"
"""The same GEMM with the block at ``base + index * stride`` (int64 attributes, an int32
index operand: traced positions), clamped."""
BUCKET_ADD_TARGET = "jax_wgrad_bucket_add"
"""FFI target of the in-place block add into a flat gradient bucket."""
RAGGED_MATMUL_TARGET = "jax_wgrad_ragged_matmul"
"""FFI target of the ragged grouped GEMM ``y = x @ op(w[g])`` per group of rows (MoE)."""
RAGGED_WGRAD_TARGET = "jax_wgrad_ragged_wgrad_accumulate"
"""FFI target of the ragged grouped weight-gradient GEMM ``main_grad[g] += dy_g^T x_g``."""
WGRAD_TARGETS: tuple[str, ...] = (TARGET, TARGET_AT, RAGGED_WGRAD_TARGET)
"""Every FFI target that accumulates a weight gradient in place (fused wgrad calls)."""

OP_FAMILIES: tuple[str, ...] = ("dense", "bucket_add", "grouped", "ragged")
"""The op families, each checked on its own and in this order (module docstring):
``"dense"`` (:func:`~jax_wgrad.ops.wgrad_accumulate` on 2-D weights), ``"bucket_add"``
(:func:`~jax_wgrad.ops.bucket_add`), ``"grouped"``
(:func:`~jax_wgrad.ops.grouped_wgrad_accumulate`: expert weights of capacity-buffer MoE
layers) and ``"ragged"`` (:func:`~jax_wgrad.ops.ragged_matmul` and
:func:`~jax_wgrad.ops.ragged_wgrad_accumulate`: dropless MoE layers)."""
DENSE_FAMILIES: tuple[str, ...] = ("dense", "bucket_add")
"""The op families the fused path of a dense model needs (the default of
:func:`fusion_status`, :func:`fusion_available` and :func:`require_fusion`)."""

OLDEST_SUPPORTED_FFI_API: tuple[int, int] = (0, 3)
"""XLA FFI API version of the oldest supported jax (0.10.2; 0.11.2 speaks 0.4, 0.12 0.5):
the version the handlers are built against, so that every supported jax accepts them."""

# jax platform -> (extension module, platform name to register under)
_MODULES = {
    "cpu": ("jax_wgrad._wgrad_ffi_cpu", "cpu"),
    "cuda": ("jax_wgrad._wgrad_ffi_cuda", "CUDA"),
}
PLATFORMS: tuple[str, ...] = tuple(_MODULES)

# platform -> None when the module loaded and registered, else why not.
_LOADED: dict[str, str | None] = {}
# platform -> the module's handler_metadata() when it was imported.
_METADATA: dict[str, dict[str, dict[str, Any]]] = {}
# (platform, family) -> None when the family's probe ran and was right, else why not
# (lazy; only outcomes that cannot change within the process are kept).
_VERIFIED: dict[tuple[str, str], str | None] = {}
_PROBE_LOCK = threading.Lock()


def runtime_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib (from the ``c_api.h`` it ships next
    to ``jax.ffi.include_dir()``), or ``None`` if it cannot be read."""
    try:
        text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except (OSError, AttributeError):
        return None
    major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.M)
    minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.M)
    if major is None or minor is None:
        return None
    return int(major.group(1)), int(minor.group(1))


def _register_module(platform: str, module_name: str, xla_name: str) -> str | None:
    """Imports one handler module and registers its targets; ``None`` or why not."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # not built, or a shared library is missing
        return f"{module_name} could not be imported: {exc}"
    try:
        metadata = dict(module.handler_metadata())
        _METADATA[platform] = metadata
        runtime = runtime_ffi_api()
        for name, meta in metadata.items():
            version = tuple(meta["api_version"])
            if runtime is not None and version > runtime:
                return (
                    f"{module_name} was built against XLA FFI API "
                    f"{version[0]}.{version[1]}, newer than this jaxlib's "
                    f"{runtime[0]}.{runtime[1]} (jax {jax.__version__}), which would "
                    f"reject {name} and fail to initialize its {platform} backend; it "
                    "was not registered. Rebuild jax_wgrad in pip's isolated build "
                    "environment (it uses the headers of jax 0.10.2, the oldest "
                    "supported: FFI API "
                    f"{OLDEST_SUPPORTED_FFI_API[0]}.{OLDEST_SUPPORTED_FFI_API[1]})."
                )
        for name, handler in module.registrations().items():
            jax.ffi.register_ffi_target(name, handler, platform=xla_name)
    except Exception as exc:
        return f"registering the handlers of {module_name} failed: {type(exc).__name__}: {exc}"
    return None


def _register_all() -> None:
    for platform, (module_name, xla_name) in _MODULES.items():
        _LOADED[platform] = _register_module(platform, module_name, xla_name)


_register_all()


def normalize_platform(platform: str | None) -> str:
    """``"gpu"`` -> ``"cuda"``; ``None`` -> jax's default backend."""
    platform = (platform or jax.default_backend()).lower()
    return "cuda" if platform == "gpu" else platform


def load_error(platform: str) -> str | None:
    """``None`` when the handlers for ``platform`` were built, imported and registered
    (what the lowering needs; says nothing about whether a call works), else why not."""
    platform = normalize_platform(platform)
    return _LOADED.get(platform, f"jax_wgrad has no handler for platform '{platform}'")


def handler_loaded(platform: str) -> bool:
    """Whether :func:`load_error` is ``None`` for ``platform``."""
    return load_error(platform) is None


def handler_metadata(platform: str) -> dict[str, dict[str, Any]]:
    """What each of ``platform``'s handlers declares to XLA, per target:
    ``{"api_version": (major, minor), "traits": int, "command_buffer_compatible": bool}``
    (empty when the module could not be imported)."""
    return dict(_METADATA.get(normalize_platform(platform), {}))


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
    """``families`` (one name or several) checked against :data:`OP_FAMILIES`, in that
    order (the order they are probed in)."""
    names = (families,) if isinstance(families, str) else tuple(families)
    unknown = [f for f in names if f not in OP_FAMILIES]
    if unknown:
        raise ValueError(f"unknown op families {unknown}; the op families are {OP_FAMILIES}")
    return tuple(f for f in OP_FAMILIES if f in names)


def _declared():
    """``[(op, case)]``: every op's ``self_check`` case, its family resolved (``None``: the
    op's), in the order of declaration; small integer data that every precision (TF32
    included) and dtype represents exactly."""
    import numpy as np

    from jax_wgrad import ops  # noqa: F401  late: the ops import this module; declares them all
    from jax_wgrad.ops.primitive import ProbeCase, defined

    rng = np.random.default_rng(0)
    return [
        (op, case._replace(family=case.family or op.family))
        for op in defined()
        if op.self_check
        for case in map(ProbeCase._make, op.self_check(rng))
    ]


def _probe_cases(family: str | None = None) -> list:
    """Every kernel variant the library calls (of ``family``; ``None``: of every family):
    the :class:`~jax_wgrad.ops.primitive.ProbeCase` s ``(name, fn, args, want, family)``
    of every :class:`~jax_wgrad.ops.primitive.FfiPrimitive`'s ``self_check``, each with
    its family."""
    return [case for _, case in _declared() if family in (None, case.family)]


def _probe(platform: str, family: str) -> _Outcome:
    """Runs every kernel variant of ``family`` once, in one program, on a device of this
    process; checks each result."""
    import numpy as np

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
    from jax_wgrad import ops  # noqa: F401  late: declares every op
    from jax_wgrad.ops.primitive import defined

    used = {op for op, case in _declared() if case.family == family}
    members = [op for op in defined() if op.family == family or op in used]
    return next(filter(None, (op.unavailable(platform) for op in members)), None)


def _family_outcome(platform: str, family: str) -> _Outcome:
    """``family``'s outcome on ``platform``: the families before it are probed first (in
    the order of :data:`OP_FAMILIES`); final outcomes are remembered."""
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
    family of ``families`` (:data:`OP_FAMILIES`; default :data:`DENSE_FAMILIES`, what a
    dense model's fused path needs) were shown to work by a test call on a device of this
    process, else the reason they cannot be used, naming the first failing family (not
    built, built for a newer jax, library missing, no device, a call failed or was wrong).

    Each family is its own test program, running every kernel variant of it: for
    ``"dense"`` float32 at default (TF32 on GPUs) and highest precision, bf16/fp16 into
    fp32 and into 16-bit, an offset block, a block at a traced offset and at a 64-bit
    position ``base + index * stride``; for ``"bucket_add"`` several blocks; for
    ``"grouped"`` grouped experts at a static, a traced and a 64-bit position; for
    ``"ragged"`` the ragged grouped GEMMs of :mod:`jax_wgrad.ops.ragged`. Per family:
    :func:`op_status`.

    The first query of a family on a platform compiles and runs its program there (and
    those of the families before it in :data:`OP_FAMILIES`); it may be made anywhere,
    also while tracing.

    Args:
      families: op family names (or one name).
    Raises:
      ValueError: an unknown family.
    """
    families = _families(families)
    return {p: _status(p, families) for p in PLATFORMS}


def op_status(platform: str | None = None) -> dict[str, str | None]:
    """Per op family of :data:`OP_FAMILIES`: ``None`` if its handlers were shown to work
    on ``platform`` (see :func:`fusion_status`), else why not (for a wrong value: the
    failing case).

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
      families: op family names (default :data:`DENSE_FAMILIES`, a dense model's).
    """
    platform = normalize_platform(platform)
    families = _families(families)
    return platform in _MODULES and _status(platform, families) is None


def require_fusion(
    platform: str | None = None,
    *,
    who: str = "wgrad_accumulate",
    families: str | Iterable[str] = DENSE_FAMILIES,
) -> None:
    """Raises ``RuntimeError`` (Megatron's wording, naming the failing op family) when
    fusion is unavailable for any family of ``families`` (default
    :data:`DENSE_FAMILIES`; an MoE model adds its experts' family) on ``platform``."""
    platform = normalize_platform(platform)
    families = _families(families)
    if fusion_available(platform, families):
        return
    reason = (
        _status(platform, families)
        if platform in _MODULES
        else f"jax_wgrad has no handler for platform '{platform}'"
    )
    raise RuntimeError(fusion_error(platform, reason, who=who))


def fusion_error(platform: str, reason: str, *, who: str = "wgrad_accumulate") -> str:
    """Megatron's wording of "fusion is unavailable on ``platform``, because ``reason``"."""
    return (
        f"{who} was called with gradient_accumulation_fusion set to True but the "
        f"jax_wgrad fused weight-gradient handler for platform '{platform}' is not "
        f"available ({reason}). To use gradient_accumulation_fusion you must build "
        "jax_wgrad with that handler (for CUDA: a CUDA compiler on the PATH when running "
        "`pip install .`). Otherwise, you must turn off gradient accumulation fusion."
    )
