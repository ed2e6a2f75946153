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

**CUDA graphs** (``cuda_graph_scope``, Megatron's ``--cuda-graph-scope``): XLA:GPU runs
runs of kernels, cuBLAS/cuDNN calls and command-buffer-compatible FFI handlers as CUDA
graphs by default (``kernels``); control flow and collectives run from the host, and
every conditional outside a graph copies its predicate to the host and waits
(``docs/design/aot.md``: 65 per Llama-3-8B TP2 PP2 step). ``full_iteration`` adds
every other command-buffer type XLA has (:data:`FULL_ITERATION_COMMAND_BUFFERS`:
conditionals, loops and collectives become graph nodes), so that a step whose layer
loops are unrolled (:func:`check_cuda_graph_scope`) runs as a few CUDA graphs with no
host synchronisation.
"""

from __future__ import annotations

import os

from jax_wgrad._cuda_probe import cuda_gpu_usable

__all__ = [
    "COMMAND_BUFFER_FLAG",
    "CUDA_GRAPH_SCOPES",
    "FULL_ITERATION_COMMAND_BUFFERS",
    "GPU_XLA_FLAGS",
    "apply_gpu_xla_flags",
    "check_cuda_graph_scope",
    "cuda_gpu_usable",
    "gpu_xla_flags",
]

GPU_XLA_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    "--xla_gpu_enable_dus_accumulator_zero_init_elimination": "true",
}
"""Flag -> value added to ``XLA_FLAGS`` on a GPU."""

CUDA_GRAPH_SCOPES = ("kernels", "full_iteration")
"""``--cuda-graph-scope`` values: XLA's default command buffers, or every type."""

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
"""The XLA flag naming what XLA:GPU captures in command buffers (CUDA graphs)."""

FULL_ITERATION_COMMAND_BUFFERS = (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION"
)
"""``xla_gpu_enable_command_buffer`` for ``full_iteration``: every type the flag takes
(jaxlib 0.10.2, 0.11.2 and 0.12 accept the list as a compile option, and
refuse the enum's one other name, ``DYNAMIC_SLICE_COPY_FUSION``)."""


def gpu_xla_flags(cuda_graph_scope: str = "kernels") -> dict[str, str]:
    """Flag -> value of a GPU run: :data:`GPU_XLA_FLAGS`, and for ``cuda_graph_scope``
    ``"full_iteration"`` every command-buffer type."""
    if cuda_graph_scope not in CUDA_GRAPH_SCOPES:
        raise ValueError(
            f"cuda_graph_scope {cuda_graph_scope!r}: expected one of {CUDA_GRAPH_SCOPES}"
        )
    flags = dict(GPU_XLA_FLAGS)
    if cuda_graph_scope == "full_iteration":
        flags[COMMAND_BUFFER_FLAG] = FULL_ITERATION_COMMAND_BUFFERS
    return flags


def check_cuda_graph_scope(cuda_graph_scope: str, layer_scan_unroll: int, loop_length: int) -> None:
    """``full_iteration`` needs a stage's layers unrolled: XLA:GPU makes every copy at a
    traced position in a loop (a layer's weights sliced from the stacked ones, the saved
    activations written back) asynchronous, and captures no asynchronous copy, so a task
    whose layers are a loop stays a conditional on the host. ``loop_length``: the
    iterations of a model chunk's layer loop (its periods of layers).

    Raises:
      ValueError: naming both flags, when ``layer_scan_unroll < loop_length``.
    """
    if cuda_graph_scope == "full_iteration" and layer_scan_unroll < loop_length:
        raise ValueError(
            f"--cuda-graph-scope full_iteration needs a model chunk's {loop_length} "
            f"iterations of its layer loop unrolled (--layer-scan-unroll {loop_length}), "
            f"got --layer-scan-unroll {layer_scan_unroll}: XLA:GPU captures no "
            "asynchronous copy of a loop in a CUDA graph, and the tasks holding the loop "
            "would stay conditionals on the host"
        )


def apply_gpu_xla_flags(cuda_graph_scope: str = "kernels") -> list[str]:
    """Adds :func:`gpu_xla_flags` to ``XLA_FLAGS`` when a CUDA GPU is usable (and the user
    did not set the flag); returns the flags added."""
    if not cuda_gpu_usable():
        return []
    current = os.environ.get("XLA_FLAGS", "")
    flags = gpu_xla_flags(cuda_graph_scope)
    added = [f"{k}={v}" for k, v in flags.items() if k not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
