"""A Ctrl-C during the pretraining job: the line saying what to resume from, the exit status
130, and the scope that re-sends an interrupt Python swallowed. Standard library only: the
job (:mod:`jax_wgrad.pretrain.job`) and the script around it
(:mod:`jax_wgrad.pretrain.launch`, which runs before jax is imported) both use it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["flush_stdio", "interrupted", "interrupts_redelivered", "resume_point"]


def interrupted(prog: str, argv: list[str]) -> NoReturn:
    """Ends an interrupted run of ``argv``: one line on stderr saying what to resume from,
    exit status 130."""
    flush_stdio()
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


def flush_stdio() -> None:
    """Flushes stdout and stderr (a closed or broken stream is left alone): before a line
    on stderr, and before an exit that skips the interpreter's finalization."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
