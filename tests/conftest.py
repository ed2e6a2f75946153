"""Test setup: 8 virtual CPU devices as jax's default backend, and the markers.

Mesh and model tests run on the 8 virtual CPU devices (``jax.devices()``), also on a
machine with a GPU: there the CPU platform is put first in ``JAX_PLATFORMS`` (before jax is
imported), so it is jax's default backend, while tests marked ``gpu`` place their arrays
on ``jax.devices("gpu")`` explicitly.
"""

import os


def _cuda_gpu_usable() -> bool:
    # The package resolves its names lazily: importing the probe does not import jax,
    # whose platform order must be chosen first.
    from jax_wgrad._cuda_probe import cuda_gpu_usable

    return cuda_gpu_usable()


CPU_FIRST_MARK = "JAX_WGRAD_TESTS_PUT_CPU_FIRST"
"""Set (to "1") beside ``JAX_PLATFORMS`` when this file put the CPU first, so that a test
running a GPU command in a subprocess can give it the platforms the user had
(``tests/test_readme.py``): inherited, ``cpu,cuda`` would run it on the CPU."""

if "JAX_PLATFORMS" not in os.environ and _cuda_gpu_usable():
    os.environ["JAX_PLATFORMS"] = "cpu,cuda"
    os.environ[CPU_FIRST_MARK] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_wgrad  # noqa: E402
from jax_wgrad.ops import handlers  # noqa: E402

jax_wgrad.use_virtual_cpu_devices(8)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to jax here")
    cuda_handler = handlers.load_error("cuda")  # None: built, imported and registered
    skip_handler = pytest.mark.skip(
        reason=f"needs the CUDA handler importable (no GPU needed): {cuda_handler}"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "cuda_handler" in item.keywords and cuda_handler is not None:
            item.add_marker(skip_handler)


@pytest.fixture(scope="module")
def pretrain():
    """The pretraining job that ``examples/pretrain_gpt.py`` runs (:mod:`jax_wgrad.pretrain.job`):
    ``pretrain.main(argv)`` runs it in this process and returns its summary."""
    from jax_wgrad.pretrain import job

    return job
