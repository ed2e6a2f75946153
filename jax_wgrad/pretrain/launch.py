"""What ``python examples/pretrain_gpt.py`` does around the job, before and after jax.

This module imports nothing but the standard library until :func:`run_script` imports the
job: the script loads it by its path (importing it the usual way would import the package,
and with it jax, before jax's platforms are chosen). :func:`jax_wgrad.pretrain.main` uses
its Ctrl-C handling too.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import os
import sys
from typing import NoReturn

__all__ = [
    "CUDA_PLUGINS",
    "cuda_plugin_installed",
    "interrupted",
    "interrupts_redelivered",
    "resume_point",
    "run_script",
    "start_jax_on_cpu_to_compile_only",
    "start_jax_on_cpu_without_gpu",
]


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
        _flush_stdio()
        os._exit(130)
    except SystemExit as exc:
        if exc.code != 130:
            raise
        _flush_stdio()
        os._exit(130)


def interrupted(prog: str, argv: list[str]) -> NoReturn:
    """Ends an interrupted run of ``argv``: one line on stderr saying what to resume from,
    exit status 130."""
    _flush_stdio()
    sys.stderr.write(f"{prog}: interrupted; {resume_point(argv)}\n")
    raise SystemExit(130) from None


def resume_point(argv: list[str]) -> str:
    """What an interrupted run of ``argv`` resumes from: the newest checkpoint step in its
    ``--save`` directory (else its ``--load`` one), read from the directory names alone."""
    bare = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # imports nothing:
    bare.add_argument("--save")  # an interrupted import must not be re-run here
    bare.add_argument("--load")
    try:
        args, _ = bare.parse_known_args(argv)
    except SystemExit:
        return "nothing was saved"
    for flag, directory in (("--save", args.save), ("--load", args.load)):
        if directory and os.path.isdir(directory):
            steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
            if steps:
                return (
                    f"the newest checkpoint is step {max(steps)} in {flag} {directory} "
                    f"(resume with --load {directory})"
                )
    return "no checkpoint was written" + (
        f" to --save {args.save}" if args.save else " (no --save)"
    )


@contextlib.contextmanager
def interrupts_redelivered():
    """A scope whose ``sys.unraisablehook`` re-sends a Ctrl-C Python swallowed: the
    KeyboardInterrupt can be raised inside a callback whose exceptions are only reported
    (jax's garbage-collection callback), and the run would go on as if nothing was
    pressed. Other reports go to the hook there was before, which is back on exit. The
    interrupt is re-sent from a timer thread a moment later: sent from inside the hook it
    would land in the hook itself, where it is swallowed again."""
    import _thread
    import threading

    previous = sys.unraisablehook

    def hook(args) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
            timer = threading.Timer(0.05, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
        else:
            previous(args)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


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
