"""The compiled FFI handlers: loaded, checked and registered with XLA at import.

The bottom of the ops tier: it names the FFI targets and the op families, and knows
nothing of the ops (:mod:`jax_wgrad.ops.primitive` and the op modules build on it;
:mod:`jax_wgrad.ops.status` shows, on top of both, that the handlers work).

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
(or any registration error) becomes that platform's :func:`load_error` (and so its
:func:`~jax_wgrad.ops.fusion_status` reason) instead.

**Platform names.** XLA keeps a registration made before its platform's plugin is
initialised in a pending list keyed by the name as given, and the CUDA plugin flushes only
the key ``"CUDA"`` (``jaxlib.xla_client`` maps ``"cpu"`` and ``"gpu"``, not ``"cuda"``). So
the CUDA handlers are registered under ``"CUDA"`` -- the spelling of jax's FFI tutorial --
which reaches the handler on jax 0.10, 0.11 and 0.12 alike (measured:
``docs/design/h100_findings.md``, section 3).

Registering a handler proves nothing (a CUDA registration on a CPU-only jaxlib succeeds
silently): :func:`load_error` says only whether the lowering can name the handler.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "TARGET",
    "TARGET_AT",
    "BUCKET_ADD_TARGET",
    "RAGGED_MATMUL_TARGET",
    "RAGGED_WGRAD_TARGET",
    "FP8_TARGET",
    "FP8_TARGET_AT",
    "WGRAD_TARGETS",
    "OP_FAMILIES",
    "DENSE_FAMILIES",
    "PLATFORMS",
    "OLDEST_SUPPORTED_FFI_API",
    "normalize_platform",
    "load_error",
    "handler_loaded",
    "handler_metadata",
    "runtime_ffi_api",
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
FP8_TARGET = "jax_wgrad_fp8_wgrad_accumulate"
"""FFI target of the FP8 fused weight-gradient GEMM ``main_grad += (sg dy)^T (sx x)``."""
FP8_TARGET_AT = "jax_wgrad_fp8_wgrad_accumulate_at"
"""The same FP8 GEMM with the block at ``base + index * stride``, clamped."""
WGRAD_TARGETS: tuple[str, ...] = (
    TARGET,
    TARGET_AT,
    RAGGED_WGRAD_TARGET,
    FP8_TARGET,
    FP8_TARGET_AT,
)
"""Every FFI target that accumulates a weight gradient in place (fused wgrad calls)."""

OP_FAMILIES: tuple[str, ...] = ("dense", "bucket_add", "grouped", "ragged")
"""The op families: the kernels one kind of layer needs, each shown to work on its own
and in this order (:mod:`jax_wgrad.ops.status`): ``"dense"``
(:func:`~jax_wgrad.ops.wgrad_accumulate` on 2-D weights, what every fused linear calls),
``"bucket_add"`` (:func:`~jax_wgrad.ops.bucket_add`, the in-place add of the unfused
gradients into their buckets), ``"grouped"`` (:func:`~jax_wgrad.ops.grouped_wgrad_accumulate`:
expert weights of capacity-buffer MoE layers) and ``"ragged"``
(:func:`~jax_wgrad.ops.ragged_matmul` and :func:`~jax_wgrad.ops.ragged_wgrad_accumulate`:
dropless MoE layers)."""
DENSE_FAMILIES: tuple[str, ...] = ("dense", "bucket_add")
"""The op families the fused path of a dense model needs (the default of
:func:`~jax_wgrad.ops.fusion_status`, :func:`~jax_wgrad.ops.fusion_available` and
:func:`~jax_wgrad.ops.require_fusion`); an MoE model adds its experts' family (a
:class:`~jax_wgrad.parallel.pipeline.program.StageProgram` names its own:
``fused_op_families``)."""

OLDEST_SUPPORTED_FFI_API: tuple[int, int] = (0, 3)
"""XLA FFI API version of the oldest supported jax (0.10.2; 0.11.2 speaks 0.4, 0.12 0.5):
the version the handlers are built against, so that every supported jax accepts them."""

# jax platform -> (extension module, platform name to register under)
_MODULES = {
    "cpu": ("jax_wgrad._wgrad_ffi_cpu", "cpu"),
    "cuda": ("jax_wgrad._wgrad_ffi_cuda", "CUDA"),
}
PLATFORMS: tuple[str, ...] = tuple(_MODULES)
"""The platforms jax_wgrad builds handlers for (jax's names)."""

# platform -> None when the module loaded and registered, else why not.
_LOADED: dict[str, str | None] = {}
# platform -> the module's handler_metadata() when it was imported.
_METADATA: dict[str, dict[str, dict[str, Any]]] = {}


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


def fusion_error(platform: str, reason: str, *, who: str = "wgrad_accumulate") -> str:
    """Megatron's wording of "the fused handler is unavailable on ``platform``, because
    ``reason``": the error of :func:`~jax_wgrad.ops.require_fusion` and of compiling a
    fused wgrad op where its handler is not loaded."""
    return (
        f"{who} was called with gradient_accumulation_fusion set to True but the "
        f"jax_wgrad fused weight-gradient handler for platform '{platform}' is not "
        f"available ({reason}). To use gradient_accumulation_fusion you must build "
        "jax_wgrad with that handler (for CUDA: a CUDA compiler on the PATH when running "
        "`pip install .`). Otherwise, you must turn off gradient accumulation fusion."
    )
