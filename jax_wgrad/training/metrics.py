"""Where a run's metrics go: a JSON-lines file and TensorBoard scalars.

One record per training step (``step, loss, grad_norm, skipped, step_time_s,
tokens_per_s``) and per evaluation (``step, valid_loss, valid_ppl``). TensorBoard scalars
are written with ``tensorboardX`` (a small writer with no framework dependency) under
``train/<name>`` and ``valid/<name>``; ``examples/plot_metrics.py`` draws the JSON lines.

The metrics file is opened and appended to, as Megatron's loggers do, never replaced: a
path that is not a regular file (``/dev/null``, a FIFO, a directory) or a file holding
lines that are not metrics records is refused (:func:`metrics_file_problem`), so nothing
that was there is lost.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat

__all__ = ["MetricsWriter", "check_metrics_file", "metrics_file_problem", "not_a_regular_file"]


class MetricsWriter:
    """Writes records to a JSON-lines file and/or a TensorBoard log directory.

    Nothing is opened before :meth:`start` (called by the training loop with the step it
    starts from, so a resumed run's records follow the ones it resumed from, each step once).

    Args:
      metrics_file: path of the JSON-lines file, or ``None``.
      tensorboard_dir: TensorBoard log directory, or ``None``.
    """

    def __init__(self, metrics_file: str | None = None, tensorboard_dir: str | None = None):
        self.metrics_file, self.tensorboard_dir = metrics_file, tensorboard_dir
        self._file = None
        self._tb = None
        self._started = False

    def start(self, step: int = 0) -> None:
        """Opens the outputs for a run that continues after ``step`` (0: a fresh run).

        The metrics file is appended to (created if missing), never replaced: a fresh
        run's records follow the ones already there (an earlier run's). A resumed run first
        cuts the file's last records of steps after ``step`` (written by a run that went on
        past its last checkpoint, e.g. killed or interrupted: they are about to be redone),
        so every step of the resumed run appears once; a last line cut short by a killed
        run is dropped either way. TensorBoard purges its events after ``step`` the same way.

        Raises:
          ValueError: the metrics file is not a regular file or holds lines that are not
            metrics records (:func:`metrics_file_problem`; one line, nothing written).
        """
        if self._started:
            return
        if self.metrics_file:
            problem = metrics_file_problem(self.metrics_file)
            if problem:
                raise ValueError(f"metrics file {self.metrics_file}: {problem}")
            path = pathlib.Path(self.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            # created if missing; appended to, never replaced (the same file, inode and all)
            self._file = open(path, "a", encoding="utf-8")
            _keep_records_up_to(path, step if step > 0 else None)
        self._started = True
        if self.tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(
                logdir=self.tensorboard_dir, purge_step=step + 1 if step > 0 else None
            )

    def write(self, record: dict) -> None:
        """One record; numeric fields other than ``step`` become TensorBoard scalars
        (``valid_*`` under ``valid/``, the rest under ``train/``)."""
        self.start()
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb:
            step = int(record["step"])
            for key, value in record.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if not math.isfinite(value):
                    continue
                tag = f"valid/{key[6:]}" if key.startswith("valid_") else f"train/{key}"
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._tb:
            self._tb.close()
            self._tb = None


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_regular_file(path: str | os.PathLike) -> str | None:
    """Why an output file cannot be ``path`` because of what is there: ``None`` when
    nothing is there or a regular file (a symbolic link to one is followed), else e.g.
    ``"is a FIFO, not a regular file"`` (``/dev/null`` is a character device)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def metrics_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot take a run's metrics records (``None``: it can). It must be
    missing, or a regular file (a symbolic link to one is followed) whose lines are all
    metrics records -- JSON objects with a ``step`` -- but for a last line cut short."""
    problem = not_a_regular_file(path)
    if problem:
        return f"{problem}: the records are appended to a regular file (name a new one)"
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    for n, line in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
        if line.strip() and _step(line) is None:
            shown = line[:60].decode("utf-8", "replace")
            return (
                f"line {n} ({shown!r}) is not a metrics record (a JSON object with a step): "
                "the records are appended to a metrics file of an earlier run or a new file "
                "(name another)"
            )
    return None


def check_metrics_file(path: str | None, flag: str = "--metrics-file") -> None:
    """Raises ``ValueError`` naming ``flag`` when ``path`` cannot take the metrics records
    (:func:`metrics_file_problem`); checked before anything is built."""
    problem = None if path is None else metrics_file_problem(path)
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")


def _step(line: bytes) -> int | None:
    """The ``step`` of a metrics record, ``None`` for any other line."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _keep_records_up_to(path: pathlib.Path, step: int | None) -> None:
    """Cuts the metrics file ``path`` short, in place (the same file), of a last line cut
    short (no newline) and, when ``step`` is given, of the records of steps after ``step``
    at its end (the steps a resumed run redoes; records of an earlier run before them are
    kept whatever their steps)."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")[:-1]  # complete lines: after the last one is torn
    end = len(lines)
    while step is not None and end and (_step(lines[end - 1]) or 0) > step:
        end -= 1
    size = sum(len(ln) + 1 for ln in lines[:end])
    if size != path.stat().st_size:
        os.truncate(path, size)
