"""Where a run's metrics go: a JSON-lines file and TensorBoard scalars.

One record per training step (``step, loss, grad_norm, skipped, step_time_s,
tokens_per_s``) and per evaluation (``step, valid_loss, valid_ppl``). TensorBoard scalars
are written with ``tensorboardX`` (a small writer with no framework dependency) under
``train/<name>`` and ``valid/<name>``; ``examples/plot_metrics.py`` draws the JSON lines.
"""

from __future__ import annotations

import json
import math
import pathlib

__all__ = ["MetricsWriter"]


class MetricsWriter:
    """Writes records to a JSON-lines file and/or a TensorBoard log directory.

    Args:
      metrics_file: path of the JSON-lines file, or ``None``.
      tensorboard_dir: TensorBoard log directory, or ``None``.
      append: keep the file's earlier lines (a resumed run) instead of truncating it.
    """

    def __init__(self, metrics_file: str | None = None, tensorboard_dir: str | None = None,
                 *, append: bool = False):
        self._file = None
        if metrics_file:
            pathlib.Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(metrics_file, "a" if append else "w")
        self._tb = None
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=tensorboard_dir)

    def write(self, record: dict) -> None:
        """One record; numeric fields other than ``step`` become TensorBoard scalars
        (``valid_*`` under ``valid/``, the rest under ``train/``)."""
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
        if self._tb:
            self._tb.close()
