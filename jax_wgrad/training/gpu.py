"""XLA flags for training on GPUs, applied by the example when it runs on one.

XLA:GPU overlaps collectives (the pipeline's ``ppermute``\\ s, the cooldown reduce-scatters,
the tensor-parallel all-gathers) with compute only when its latency-hiding scheduler
reorders them; by default it keeps program order. :data:`GPU_XLA_FLAGS` turns it on (the
flag NVIDIA's JAX containers set; JAX's GPU performance tips list it). It also lets XLA
leave uninitialised the stacked outputs of a loop that writes every row before anything
reads them (``xla_gpu_enable_dus_accumulator_zero_init_elimination``, off by default; in
jaxlib 0.10.2, 0.11.2 and 0.12): the layer scan's saved activations, which were
zero-filled every microbatch (Llama-3-8B TP4 DP2: 62 GB of memsets a step, about 19 ms
estimated on H100s; ``docs/design/aot.md``). XLA's pass proves the rows are all written
first, so results do not change. Flags are read when
jax initialises its backends, so :func:`apply_gpu_xla_flags` must run before the first jax
computation; flags already present in ``XLA_FLAGS`` are left as the user set them.
"""

from __future__ import annotations

import os

from jax_wgrad._cuda_probe import cuda_gpu_usable

__all__ = ["GPU_XLA_FLAGS", "apply_gpu_xla_flags", "cuda_gpu_usable"]

GPU_XLA_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    "--xla_gpu_enable_dus_accumulator_zero_init_elimination": "true",
}
"""Flag -> value added to ``XLA_FLAGS`` on a GPU."""


def apply_gpu_xla_flags() -> list[str]:
    """Adds :data:`GPU_XLA_FLAGS` to ``XLA_FLAGS`` when a CUDA GPU is usable (and the user
    did not set the flag); returns the flags added."""
    if not cuda_gpu_usable():
        return []
    current = os.environ.get("XLA_FLAGS", "")
    added = [f"{k}={v}" for k, v in GPU_XLA_FLAGS.items() if k not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
