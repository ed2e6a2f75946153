"""Loads the compiled FFI handlers and registers them with XLA (one target name).

Two extension modules are built from ``ffi/``: ``_wgrad_ffi_cpu`` (always) and
``_wgrad_ffi_cuda`` (when CMake found a CUDA compiler). Each exports ``registrations()``,
a ``{target_name: PyCapsule}`` dict, registered here in a loop for its platform. A
module that failed to build or load is recorded with the reason, so that
:func:`fusion_available` and :func:`require_fusion` can explain it.
"""

from __future__ import annotations

import importlib

import jax

__all__ = ["TARGET", "fusion_available", "fusion_status", "require_fusion"]

TARGET = "jax_wgrad_wgrad_accumulate"

# XLA platform name -> extension module providing its handlers.
_MODULES = {"cpu": "jax_wgrad._wgrad_ffi_cpu", "cuda": "jax_wgrad._wgrad_ffi_cuda"}
# platform -> None when registered, else the reason it is unavailable.
_STATUS: dict[str, str | None] = {}


def _register_all() -> None:
    for platform, module_name in _MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # not built, or a shared library is missing
            _STATUS[platform] = f"{module_name} could not be imported: {exc}"
            continue
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _STATUS[platform] = None


_register_all()


def _normalize(platform: str) -> str:
    platform = platform.lower()
    return "cuda" if platform == "gpu" else platform


def fusion_status() -> dict[str, str | None]:
    """Per XLA platform: ``None`` if the fused handler is registered, else why not."""
    return dict(_STATUS)


def fusion_available(platform: str | None = None) -> bool:
    """Whether the fused wgrad-accumulation handler is built for ``platform``.

    Args:
      platform: ``"cpu"``, ``"cuda"`` (or ``"gpu"``); default: jax's default backend.
    """
    platform = _normalize(platform or jax.default_backend())
    return platform in _STATUS and _STATUS[platform] is None


def require_fusion(platform: str | None = None, *, who: str = "wgrad_accumulate") -> None:
    """Raises ``RuntimeError`` (Megatron's wording) when fusion is unavailable."""
    platform = _normalize(platform or jax.default_backend())
    if fusion_available(platform):
        return
    reason = _STATUS.get(platform, f"jax_wgrad has no handler for platform '{platform}'")
    raise RuntimeError(
        f"{who} was called with gradient_accumulation_fusion set to True but the "
        f"jax_wgrad fused weight-gradient handler for platform '{platform}' is not "
        f"available ({reason}). To use gradient_accumulation_fusion you must build "
        "jax_wgrad with that handler (for CUDA: a CUDA compiler on the PATH when running "
        "`pip install .`). Otherwise, you must turn off gradient accumulation fusion."
    )
