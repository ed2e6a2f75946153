"""Compile the train step for GPUs without one (deviceless XLA:GPU compilation).

* :func:`compile_for_target` (configs) / :func:`compile_plan` (a plan on target devices)
  -> :class:`AotReport`: per-device memory against the target's with a fits / DOES NOT
  FIT verdict, compile time, and structural facts of the compiled step
  (``report.format()`` prints them).
* :func:`gpu_target` / :data:`TARGETS` (``"h100"``, ``"h200"``), :func:`target_devices`,
  :func:`cuda_plugin` (which CUDA plugin is installed, if any).
* :mod:`jax_wgrad.aot.hlo` (compiled HLO text, e.g. :func:`~jax_wgrad.aot.hlo.loop_traffic`:
  non-GEMM memory traffic per loop iteration) and :mod:`jax_wgrad.aot.thunks` (XLA:GPU's
  thunk sequence, e.g. :func:`~jax_wgrad.aot.thunks.loop_launches`: launches per loop
  iteration, a command buffer counting as one): the analyses, reusable on any module.
* :mod:`jax_wgrad.aot.estimate`: an estimated step time and MFU from the compiled
  program (a roofline per kernel; collectives exposed or hidden), in every report;
  :func:`compile_program` compiles and estimates any other program the same way.

Needs jax's CUDA plugin (e.g. ``pip install 'jax[cuda13]'``); on a machine without a GPU
jax must start with ``JAX_PLATFORMS=cpu`` (``examples/pretrain_gpt.py --compile-only``
sets it itself). The CUDA handler must be built for the fused path to lower.
"""

from jax_wgrad.aot import estimate, hlo, thunks
from jax_wgrad.aot.compile import (
    FIGURES_JAX_VERSION,
    CompiledProgram,
    GemmTilingError,
    abstract_train_state,
    compile_for_target,
    compile_plan,
    compile_program,
    estimate_compiled,
    gemm_tiling_error,
    older_jax_note,
)
from jax_wgrad.aot.report import AotReport, Collectives
from jax_wgrad.aot.targets import TARGETS, GpuTarget, cuda_plugin, gpu_target, target_devices

__all__ = [
    "FIGURES_JAX_VERSION",
    "AotReport",
    "Collectives",
    "CompiledProgram",
    "GemmTilingError",
    "GpuTarget",
    "TARGETS",
    "abstract_train_state",
    "compile_for_target",
    "compile_plan",
    "compile_program",
    "cuda_plugin",
    "estimate",
    "estimate_compiled",
    "gemm_tiling_error",
    "gpu_target",
    "hlo",
    "older_jax_note",
    "target_devices",
    "thunks",
]
