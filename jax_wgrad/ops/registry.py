"""Loads the compiled FFI handlers, registers them with XLA, and says whether they work.

Two extension modules are built from ``ffi/``: ``_wgrad_ffi_cpu`` (always) and
``_wgrad_ffi_cuda`` (when CMake found a CUDA compiler). Each exports ``registrations()``,
a ``{target_name: PyCapsule}`` dict, registered here in a loop for its platform.

**Platform names.** XLA keeps a registration made before its platform's plugin is
initialised in a pending list keyed by the name as given, and the CUDA plugin flushes only
the key ``"CUDA"`` (``jaxlib.xla_client`` maps ``"cpu"`` and ``"gpu"``, not ``"cuda"``). So
the CUDA handlers are registered under ``"CUDA"`` -- the spelling of jax's FFI tutorial --
which reaches the handler on jax 0.10 and 0.11 alike (``../shared/gpu/FINDINGS.md`` #1).

**Status that is shown, not assumed.** Registering a handler proves nothing (a CUDA
registration on a CPU-only jaxlib succeeds silently). :func:`fusion_status` therefore runs
each loaded handler once, on the first query per platform: a tiny ``wgrad_accumulate`` and
``bucket_add`` on that platform's first device, checked against numpy. A platform is
available only if that call ran and was right; otherwise the status is the reason.
"""

from __future__ import annotations

import importlib
import threading

import jax

__all__ = ["TARGET", "BUCKET_ADD_TARGET", "PLATFORMS", "load_error", "handler_loaded",
           "fusion_status", "fusion_available", "require_fusion"]

TARGET = "jax_wgrad_wgrad_accumulate"
"""FFI target of the fused weight-gradient GEMM (one name for CPU and CUDA)."""
BUCKET_ADD_TARGET = "jax_wgrad_bucket_add"
"""FFI target of the in-place block add into a flat gradient bucket."""

# jax platform -> (extension module, platform name to register under)
_MODULES = {
    "cpu": ("jax_wgrad._wgrad_ffi_cpu", "cpu"),
    "cuda": ("jax_wgrad._wgrad_ffi_cuda", "CUDA"),
}
PLATFORMS: tuple[str, ...] = tuple(_MODULES)

# platform -> None when the module loaded and registered, else why not.
_LOADED: dict[str, str | None] = {}
# platform -> None when the probe call ran and was right, else why not (lazy).
_VERIFIED: dict[str, str | None] = {}
_PROBE_LOCK = threading.Lock()


def _register_all() -> None:
    for platform, (module_name, xla_name) in _MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # not built, or a shared library is missing
            _LOADED[platform] = f"{module_name} could not be imported: {exc}"
            continue
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_name)
        _LOADED[platform] = None


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


def _probe(platform: str) -> str | None:
    """Runs both handlers once on ``platform``'s first device; ``None`` if right."""
    import numpy as np

    from jax_wgrad import ops  # late: the ops import this module

    try:
        device = jax.devices(platform)[0]
    except RuntimeError as exc:
        return f"the handler is built, but jax sees no {platform} device ({exc})"
    try:
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        dy = np.arange(9, dtype=np.float32).reshape(3, 3) - 4.0
        acc = np.ones((3, 2), np.float32)
        bucket = np.zeros(8, np.float32)
        grad = np.array([1.0, 2.0, 3.0], np.float32)
        args = jax.device_put((x, dy, acc, bucket, grad), device)
        got_acc, got_bucket = jax.jit(lambda x, dy, acc, b, g: (
            ops.wgrad_accumulate(x, dy, acc, precision="highest"),
            ops.bucket_add(b, [g], [4])))(*args)
        want_bucket = bucket.copy()
        want_bucket[4:7] += grad
        if not np.allclose(np.asarray(got_acc), acc + dy.T @ x, rtol=1e-6) or not (
                np.array_equal(np.asarray(got_bucket), want_bucket)):
            return f"the {platform} handler ran on {device} but returned wrong values"
    except Exception as exc:  # noqa: BLE001 -- any failure is the reason
        return f"a test call of the {platform} handler on {device} failed: " \
               f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


def _status(platform: str) -> str | None:
    loaded = load_error(platform)
    if loaded is not None:
        return loaded
    with _PROBE_LOCK:
        if platform not in _VERIFIED:
            _VERIFIED[platform] = _probe(platform)
        return _VERIFIED[platform]


def fusion_status() -> dict[str, str | None]:
    """Per platform (``"cpu"``, ``"cuda"``): ``None`` if the fused handlers were shown to
    work by a test call on that platform's first device, else the reason they cannot be
    used (not built, library missing, no device, the call failed).

    The first query of a platform compiles and runs two tiny programs on it.
    """
    return {p: _status(p) for p in PLATFORMS}


def fusion_available(platform: str | None = None) -> bool:
    """Whether the fused handlers work on ``platform`` (see :func:`fusion_status`).

    Args:
      platform: ``"cpu"``, ``"cuda"`` (or ``"gpu"``); default: jax's default backend.
    """
    platform = normalize_platform(platform)
    return platform in _MODULES and _status(platform) is None


def require_fusion(platform: str | None = None, *, who: str = "wgrad_accumulate") -> None:
    """Raises ``RuntimeError`` (Megatron's wording) when fusion is unavailable."""
    platform = normalize_platform(platform)
    if fusion_available(platform):
        return
    reason = _status(platform) if platform in _MODULES else \
        f"jax_wgrad has no handler for platform '{platform}'"
    raise RuntimeError(
        f"{who} was called with gradient_accumulation_fusion set to True but the "
        f"jax_wgrad fused weight-gradient handler for platform '{platform}' is not "
        f"available ({reason}). To use gradient_accumulation_fusion you must build "
        "jax_wgrad with that handler (for CUDA: a CUDA compiler on the PATH when running "
        "`pip install .`). Otherwise, you must turn off gradient accumulation fusion."
    )
