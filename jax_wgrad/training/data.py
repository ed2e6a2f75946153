"""Token data with batches that depend only on ``(seed, step)``: bytes of text, or
Megatron's preprocessed indexed datasets, split and blended like Megatron.

The default corpus is the Python standard library's own ``.py`` sources, present on every
machine that runs this code, so the example trains without downloading anything (tokens
are raw bytes, vocabulary 256). ``--data-path`` may instead name text files, or Megatron
``PREFIX``\\ es of ``.bin``/``.idx`` pairs, optionally weighted (``0.3 A 0.7 B``).

A step's global batch is drawn from a generator seeded with ``(seed, step)``: random
``seq_length + 1``-token windows of the (split's) token stream, the same for every
parallel layout and process. A blend draws each sample's dataset by the weights from the
same generator. ``--split 98,2,0`` cuts every dataset into train / validation / test
parts: a token stream by tokens, an indexed dataset by documents (Megatron's rule).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jax_wgrad.models.gpt.config import vocab_size_with_padding
from jax_wgrad.training.indexed import IndexedDataset

__all__ = [
    "VOCAB_SIZE",
    "TokenDataset",
    "ByteDataset",
    "BlendedDataset",
    "parse_split",
    "load_data",
    "padded_vocab_size",
]

VOCAB_SIZE = 256
"""Vocabulary of byte-level text."""


class TokenDataset:
    """A 1-D token stream and a deterministic batch sampler.

    Attributes:
      tokens: ``[N]`` integer token ids (may be a memory map); name: for the log;
      vocab_size: the tokenizer's vocabulary if known (bytes: 256), else ``None``.
    """

    def __init__(self, tokens: np.ndarray, name: str = "tokens", vocab_size: int | None = None):
        tokens = np.asarray(tokens).reshape(-1)
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{name}: token ids must be integers, got {tokens.dtype}")
        self.tokens, self.name, self.vocab_size = tokens, name, vocab_size

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def data(self) -> np.ndarray:
        return self.tokens

    @property
    def max_token_id(self) -> int:
        return int(self.tokens.max()) if len(self) else -1

    def split(self, fractions: Sequence[float]) -> list[TokenDataset]:
        """Contiguous train / validation / test parts by token count."""
        bounds = _split_bounds(len(self), fractions)
        return [
            type(self)._part(self, self.tokens[a:b], f"{self.name}[{part}]")
            for (a, b), part in zip(bounds, ("train", "valid", "test"))
        ]

    def _part(self, tokens: np.ndarray, name: str) -> TokenDataset:
        return TokenDataset(tokens, name, self.vocab_size)

    def batch(self, step: int, global_batch_size: int, seq_length: int, seed: int) -> np.ndarray:
        """int32 ``[global_batch_size, seq_length + 1]`` random windows of the stream;
        depends only on ``(seed, step)`` and the sizes: the same for every layout."""
        rng = np.random.default_rng([seed, step])
        return self._windows(rng, global_batch_size, seq_length)

    def _windows(self, rng, n: int, seq_length: int) -> np.ndarray:
        if len(self) < seq_length + 2:
            raise ValueError(
                f"dataset {self.name!r} has {len(self)} tokens; need more than "
                f"seq_length + 1 ({seq_length + 1})"
            )
        starts = rng.integers(0, len(self) - seq_length - 1, size=n)
        idx = starts[:, None] + np.arange(seq_length + 1)[None, :]
        return self.tokens[idx].astype(np.int32)


class ByteDataset(TokenDataset):
    """Bytes of text as tokens (vocabulary 256)."""

    def __init__(self, data: np.ndarray, name: str = "bytes"):
        data = np.asarray(data, np.uint8).reshape(-1)
        if data.size < 2:
            raise ValueError(f"ByteDataset: need at least 2 bytes of text, got {data.size}")
        super().__init__(data, name, VOCAB_SIZE)

    def _part(self, tokens, name):
        return (
            ByteDataset(tokens, name)
            if tokens.size >= 2
            else TokenDataset(tokens, name, VOCAB_SIZE)
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, max_bytes: int | None = None) -> ByteDataset:
        """A file, or every file (sorted, recursively) of a directory, concatenated."""
        path = Path(path)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(
                f"--data-path {str(path)!r} is neither a file, a directory nor "
                "a Megatron PREFIX with PREFIX.bin and PREFIX.idx"
            )
        data = _read(files, max_bytes)
        if data.size < 2:
            what = f"a directory with {len(files)} file(s)" if path.is_dir() else "a file"
            raise ValueError(
                f"--data-path {str(path)!r}: {what} holding {data.size} byte(s) "
                "of text; at least 2 are needed (more than --seq-length + 1 to "
                "make a sample)"
            )
        return cls(data, name=str(path))

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


class BlendedDataset:
    """Datasets drawn by weights (Megatron's blend of ``--data-path`` prefixes): each
    sample of a batch picks its dataset from the ``(seed, step)`` generator."""

    def __init__(self, datasets: Sequence[TokenDataset], weights: Sequence[float]):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets for {len(weights)} weights")
        w = np.asarray(weights, np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(
                f"BlendedDataset: weights must be >= 0 with a positive sum, got {list(weights)}"
            )
        self.datasets, self.weights = list(datasets), w / w.sum()
        self.name = " + ".join(f"{wi:.3g} x {d.name}" for wi, d in zip(self.weights, datasets))

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    @property
    def max_token_id(self) -> int:
        return max(d.max_token_id for d in self.datasets)

    def batch(self, step: int, global_batch_size: int, seq_length: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed, step])
        which = rng.choice(len(self.datasets), size=global_batch_size, p=self.weights)
        out = np.empty((global_batch_size, seq_length + 1), np.int32)
        for k, d in enumerate(self.datasets):
            rows = np.flatnonzero(which == k)
            if rows.size:
                out[rows] = d._windows(rng, rows.size, seq_length)
        return out


def parse_split(text: str) -> tuple[float, float, float]:
    """Megatron's ``--split``: ``"98,2,0"`` (or ``"98/2/0"``) -> normalised fractions."""
    parts = [p for p in text.replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {text!r} must be comma-separated numbers, e.g. 98,2,0") from None
    values = (values + [0.0, 0.0, 0.0])[:3]
    if len(parts) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(
            f"--split {text!r} must be up to three numbers >= 0 with a positive sum, e.g. 98,2,0"
        )
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def _split_bounds(n: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    # Megatron's get_split_indices: round the cumulative fractions of n.
    cuts = [0]
    for f in fractions:
        cuts.append(cuts[-1] + int(round(f * float(n))))
    diff = cuts[-1] - n
    cuts = [cuts[0]] + [c - diff for c in cuts[1:]]
    return list(zip(cuts[:-1], cuts[1:]))


def _indexed_parts(prefix: str, fractions) -> list[TokenDataset]:
    ds = IndexedDataset(prefix)
    if not ds.tokens.size:  # else its vocabulary (largest id + 1) would be 0
        raise ValueError(
            f"--data-path {prefix!r}: the Megatron dataset is empty ({ds.num_documents} "
            "document(s), 0 tokens)"
        )
    return [
        TokenDataset(ds.document_tokens(a, b), f"{prefix}[{part}]")
        for (a, b), part in zip(
            _split_bounds(ds.num_documents, fractions), ("train", "valid", "test")
        )
    ]


def load_data(data_path: Sequence[str] | None, split: str = "98,2,0"):
    """``(train, valid, test)`` datasets from ``--data-path`` (``None``: the standard
    library's sources): text files/directories, a Megatron prefix, or ``w1 p1 w2 p2 ...``
    weighted Megatron prefixes. Parts may be empty (a ``0`` in ``split``).

    Raises:
      ValueError: on a missing path, a bad weight list or split.
    """
    fractions = parse_split(split)
    if not data_path:
        return ByteDataset.from_stdlib().split(fractions)
    items = list(data_path)
    if len(items) == 1:
        weights, paths = [1.0], items
    else:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            raise ValueError(
                f"--data-path {' '.join(items)!r}: several entries must be "
                "weight/prefix pairs, e.g. 0.3 A 0.7 B"
            ) from None
        paths = items[1::2]
        if len(weights) != len(paths):
            raise ValueError(f"--data-path {' '.join(items)!r}: a weight without a prefix")
    parts = []
    for path in paths:
        stem, suffix = os.path.splitext(path)
        if suffix in (".bin", ".idx") and os.path.isfile(stem + ".idx"):
            raise ValueError(
                f"--data-path {path!r} names a file of the Megatron dataset "
                f"{stem!r}: pass the prefix, --data-path {stem}"
            )
        if os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin"):
            parts.append(_indexed_parts(path, fractions))
        elif len(paths) == 1:
            parts.append(ByteDataset.from_path(path).split(fractions))
        else:
            raise ValueError(f"--data-path prefix {path!r}: {path}.bin / {path}.idx not found")
    if len(parts) == 1:
        return parts[0]
    return [
        BlendedDataset([p[k] for p in parts], weights)
        if all(len(p[k]) for p in parts)
        else _empty(", ".join(p[k].name for p in parts if not len(p[k])) + " empty")
        for k in range(3)
    ]


def _empty(name: str) -> TokenDataset:
    """An empty part (a ``0`` in ``--split``, or a blend with an empty member)."""
    return TokenDataset(np.zeros(0, np.int32), name)


def padded_vocab_size(max_token_id: int, divisible_by: int = 128) -> int:
    """The vocabulary of data with no tokenizer's size: ``max_token_id + 1`` padded by the
    one rule (:func:`~jax_wgrad.models.gpt.config.vocab_size_with_padding`, Megatron's
    ``--make-vocab-size-divisible-by`` without its tensor-parallel factor). These rows are
    all real tokens to the model (the tokenizer may know ids the data lacks), as
    Megatron's padding rows are; a vocabulary given by a tokenizer or ``--vocab-size`` is
    padded by the model instead, its padding rows masked out of the loss."""
    return vocab_size_with_padding(max_token_id + 1, divisible_by)


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
