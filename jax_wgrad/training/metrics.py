"""Where a run's metrics go: a JSON-lines file and TensorBoard scalars.

One record per training step (``step, loss, grad_norm, skipped, step_time_s,
tokens_per_s``) and per evaluation (``step, valid_loss, valid_ppl``). TensorBoard scalars
are written with ``tensorboardX`` (a small writer with no framework dependency) under
``train/<name>`` and ``valid/<name>``; ``examples/plot_metrics.py`` draws the JSON lines.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

__all__ = ["MetricsWriter"]


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

        A fresh run truncates the metrics file; a resumed one keeps the file's records of
        steps ``<= step`` and drops the later ones (written by a run that went on past its
        last checkpoint, e.g. killed or interrupted: they are about to be redone), so every
        step appears once. TensorBoard purges its events after ``step`` the same way.
        """
        if self._started:
            return
        self._started = True
        if self.metrics_file:
            path = pathlib.Path(self.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _records_up_to(path, step) if step > 0 and path.exists() else []
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
            self._file = open(path, "a")
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


def _records_up_to(path: pathlib.Path, step: int) -> list[str]:
    """Lines of a JSON-lines metrics file whose ``step`` is ``<= step`` (a torn last line of
    a killed run is dropped)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and int(record.get("step", step + 1)) <= step:
            kept.append(line + "\n")
    return kept
