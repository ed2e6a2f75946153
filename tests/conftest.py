"""Test setup: 8 virtual CPU devices as jax's default backend, and the markers.

Mesh and model tests run on the 8 virtual CPU devices (``jax.devices()``), also on a
machine with a GPU: there the CPU platform is put first in ``JAX_PLATFORMS`` (before jax is
imported), so it is jax's default backend, while tests marked ``gpu`` place their arrays
on ``jax.devices("gpu")`` explicitly.
"""

import ctypes
import importlib.metadata
import os


def _cuda_gpu_usable() -> bool:
    """A jax CUDA plugin is installed and the driver reports a device (checked without
    importing jax, whose platform order must be set first)."""
    names = {(d.metadata["Name"] or "").lower().replace("_", "-")
             for d in importlib.metadata.distributions()}
    if not any(n.startswith("jax-cuda") for n in names):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuInit(0) == 0 and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0 \
        and count.value > 0


if "JAX_PLATFORMS" not in os.environ and _cuda_gpu_usable():
    os.environ["JAX_PLATFORMS"] = "cpu,cuda"

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_wgrad  # noqa: E402

jax_wgrad.use_virtual_cpu_devices(8)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to jax here")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
