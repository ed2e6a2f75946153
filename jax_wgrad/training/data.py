"""Byte-level text data with batches that depend only on ``(seed, step)``.

The default corpus is the Python standard library's own ``.py`` sources, present on every
machine that runs this code, so the example trains without downloading anything. Tokens
are raw bytes (vocabulary 256). A step's global batch is drawn from a generator seeded
with ``(seed, step)``, so it is identical for every parallel layout and process.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["ByteDataset", "VOCAB_SIZE"]

VOCAB_SIZE = 256


class ByteDataset:
    """A ``uint8`` token stream and a deterministic batch sampler."""

    def __init__(self, data: np.ndarray, name: str = "bytes"):
        data = np.asarray(data, np.uint8).reshape(-1)
        if data.size < 2:
            raise ValueError(f"ByteDataset: need at least 2 bytes of text, got {data.size}")
        self.data = data
        self.name = name

    def __len__(self) -> int:
        return int(self.data.size)

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, max_bytes: int | None = None) -> ByteDataset:
        """A file, or every file (sorted, recursively) of a directory, concatenated."""
        path = Path(path)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(f"--data-path {str(path)!r} is neither a file nor a directory")
        return cls(_read(files, max_bytes), name=str(path))

    @classmethod
    def from_stdlib(cls, *, max_bytes: int = 8 << 20) -> ByteDataset:
        """The ``.py`` sources of this interpreter's standard library (sorted order,
        up to ``max_bytes``; no ``site-packages``)."""
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
        )
        if not files:
            raise ValueError(f"no .py files found under the standard library {root}")
        return cls(_read(files, max_bytes), name=f"python stdlib ({root})")

    def batch(self, step: int, global_batch_size: int, seq_length: int, seed: int) -> np.ndarray:
        """int32 ``[global_batch_size, seq_length + 1]`` random windows of the text.

        Depends only on ``(seed, step)`` and the sizes: the same for every layout.
        """
        if len(self) < seq_length + 2:
            raise ValueError(
                f"dataset {self.name!r} has {len(self)} bytes; need > seq_length + 1 "
                f"({seq_length + 1})"
            )
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self) - seq_length - 1, size=global_batch_size)
        idx = starts[:, None] + np.arange(seq_length + 1)[None, :]
        return self.data[idx].astype(np.int32)


def _read(files: list[Path], max_bytes: int | None) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        if max_bytes is not None and total + len(b) > max_bytes:
            b = b[: max_bytes - total]
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), np.uint8)
