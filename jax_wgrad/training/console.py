"""What a run prints on its console besides its own log lines.

The CPU collectives of a multi-process run (gloo) print one ``[Gloo] Rank N is connected to
K peer ranks...`` line to the process's C++ ``std::cout`` for every communicator they open:
44 lines for a small 2-process run, interleaved with the log. This build of gloo has no
switch for it (no log-level environment variable), so :class:`LineFilter` routes file
descriptor 1 through a pipe and a copying thread that drops those lines and passes
everything else on unchanged, Python's and C++'s output alike.
"""

from __future__ import annotations

import os
import re
import sys
import threading

__all__ = ["GLOO_CONNECTED", "LineFilter"]

GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank|connected peer ranks|is connected to +\d* *peer")
"""gloo's connection chatter (``gloo/rendezvous/context.cc``). Its threads write to
``std::cout`` without a lock, so two messages can come out interleaved
(``[Gloo] Rank [Gloo] Rank 01 is connected to  is connected to 11 peer ranks. ...``): any
line holding a piece of one is dropped."""


class LineFilter:
    """Drops the lines of file descriptor ``fd`` in which ``pattern`` is found, until
    :meth:`close`.

    Output reaches the original destination line by line, after a short delay (the copying
    thread); a partial last line is passed on at :meth:`close`. While it is active ``fd`` is a
    pipe, so ``isatty()`` is False (no progress bar).

    Args:
      pattern: a compiled bytes regex, searched in each line.
      fd: the file descriptor to filter (1: stdout).
    """

    def __init__(self, pattern: re.Pattern[bytes] = GLOO_CONNECTED, fd: int = 1):
        self.pattern, self.fd = pattern, fd
        self.dropped = 0
        _flush_python_streams()
        self._original = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._thread = threading.Thread(
            target=self._copy, args=(read,), daemon=True, name="jax_wgrad-line-filter"
        )
        self._thread.start()

    def _copy(self, read: int) -> None:
        pending = b""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self._write(b"".join(line + b"\n" for line in lines if not self._drop(line)))
        if pending and not self._drop(pending):
            self._write(pending)

    def _drop(self, line: bytes) -> bool:
        if self.pattern.search(line):
            self.dropped += 1
            return True
        return False

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._original, data) :]

    def close(self) -> None:
        """Restores ``fd`` and waits until everything written before is passed on."""
        if self._original is None:
            return
        _flush_python_streams()
        os.dup2(self._original, self.fd)  # closes the pipe's last write end: the thread ends
        self._thread.join(timeout=10)
        os.close(self._original)
        self._original = None

    def __enter__(self) -> LineFilter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
