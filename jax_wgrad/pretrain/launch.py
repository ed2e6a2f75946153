"""What the pretraining program does around the job, before and after jax:
``python examples/pretrain_gpt.py`` and the ``jax-wgrad-pretrain`` console script both run
:func:`script`.

This module imports nothing but the standard library until :func:`run_script` imports the
job (the package and :mod:`jax_wgrad.pretrain` resolve their names lazily), so jax's
platforms are chosen before jax is imported. The Ctrl-C handling it shares with
:func:`jax_wgrad.pretrain.main` is :mod:`jax_wgrad.pretrain._interrupts`'.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from jax_wgrad.pretrain._interrupts import flush_stdio, interrupted, interrupts_redelivered

__all__ = [
    "CUDA_PLUGINS",
    "cuda_plugin_installed",
    "run_script",
    "script",
    "start_jax_on_cpu_to_compile_only",
    "start_jax_on_cpu_without_gpu",
]


def script(argv: list[str] | None = None) -> None:
    """The pretraining program (``examples/pretrain_gpt.py``, the ``jax-wgrad-pretrain``
    console script): :func:`run_script` of ``argv`` (default ``sys.argv[1:]``). Returns
    when the run is done (exit status 0); ends the process as the job does otherwise
    (``SystemExit``: 2 for a bad flag, 130 after a Ctrl-C)."""
    run_script(sys.argv[1:] if argv is None else list(argv))


def run_script(argv: list[str], prog: str | None = None) -> None:
    """The script's run of the job of ``argv``: jax's platforms chosen before jax is
    imported, a Ctrl-C at any moment (the imports included) ending it with exit status 130
    and one line saying what to resume from, and, after a Ctrl-C, an exit without the
    interpreter's finalization (which races jax's and XLA's own threads: a compilation or
    transfer under way crashed with SIGSEGV; the loop has waited for its checkpoint writes)."""
    prog = prog or os.path.basename(sys.argv[0])
    start_jax_on_cpu_to_compile_only(argv)
    start_jax_on_cpu_without_gpu()
    try:
        try:
            with interrupts_redelivered():
                from jax_wgrad.pretrain.job import main  # jax and the library: seconds
        except KeyboardInterrupt:
            interrupted(prog, argv)
        main(argv, prog=prog)
    except KeyboardInterrupt:  # a Ctrl-C re-sent (see interrupts_redelivered) after main
        flush_stdio()
        os._exit(130)
    except SystemExit as exc:
        if exc.code != 130:
            raise
        flush_stdio()
        os._exit(130)


def start_jax_on_cpu_to_compile_only(argv: list[str]) -> None:
    """With ``--compile-only`` (or an abbreviation argparse accepts) nothing runs on a GPU:
    ``JAX_PLATFORMS=cpu`` unless the user set it, before jax is imported. jax's CUDA
    plugin still describes and compiles for the target GPUs; without a GPU it starts only
    when jax's platforms exclude CUDA. A caller that imported jax already chose its
    platforms (``jax_wgrad.aot.target_devices`` then says what to do)."""
    if "jax" not in sys.modules and any(
        a.startswith("--com") and "--compile-only".startswith(a) for a in argv
    ):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


CUDA_PLUGINS = (
    "jax_plugins.xla_cuda13",
    "jax_plugins.xla_cuda12",
    "jax_cuda13_plugin",
    "jax_cuda12_plugin",
)
"""The modules of jax's CUDA plugin (``jax[cuda12]``, ``jax[cuda13]``)."""


def start_jax_on_cpu_without_gpu() -> None:
    """``JAX_PLATFORMS=cpu`` (unless the user set it, before jax is imported) when jax's
    CUDA plugin is installed (as the README suggests for ``--compile-only``) but this
    machine has no NVIDIA device (no ``/dev/nvidia0``..., no WSL ``/dev/dxg``): jax would
    otherwise open every CPU run with the plugin's failed-initialisation traceback."""
    if "jax" in sys.modules or "JAX_PLATFORMS" in os.environ:
        return
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"):
        return
    if cuda_plugin_installed():
        os.environ["JAX_PLATFORMS"] = "cpu"


def cuda_plugin_installed() -> bool:
    """Whether one of :data:`CUDA_PLUGINS` is importable (found, not imported)."""

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return any(installed(name) for name in CUDA_PLUGINS)
