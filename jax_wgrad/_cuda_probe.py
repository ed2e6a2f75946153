"""Is a CUDA GPU usable by jax here? Answered WITHOUT importing jax (this module imports
nothing of jax_wgrad either), so callers can still choose jax's platforms and XLA flags."""

from __future__ import annotations

import ctypes
import importlib.metadata

__all__ = ["cuda_gpu_usable"]


def cuda_gpu_usable() -> bool:
    """A jax CUDA plugin is installed and the NVIDIA driver reports at least one device."""
    names = {
        (d.metadata["Name"] or "").lower().replace("_", "-")
        for d in importlib.metadata.distributions()
    }
    if not any(n.startswith("jax-cuda") for n in names):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return (
        libcuda.cuInit(0) == 0
        and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0
        and count.value > 0
    )
