"""Megatron's MMap indexed dataset: ``PREFIX.bin`` (tokens) and ``PREFIX.idx`` (index).

The format written by Megatron-LM's ``tools/preprocess_data.py``
(``megatron/core/datasets/indexed_dataset.py``), little-endian:

``.idx``::

    9 bytes   b"MMIDIDX\\x00\\x00"          magic
    uint64    1                             version
    uint8     dtype code                    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                            6 float64, 7 float32, 8 uint16
    uint64    S                             number of sequences
    uint64    D                             number of document-index entries
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offsets into .bin)
    int64[D]  document index: sequence index where each document starts, then S

``.bin``: the sequences' tokens back to back in the dtype.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "INDEX_HEADER",
    "DTYPE_CODES",
    "IndexedDataset",
    "write_indexed_dataset",
    "optimal_dtype",
]

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron's ``DType`` enum: code -> numpy dtype."""
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
"""magic, version, dtype code, number of sequences, of document-index entries."""


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 below 65500 token ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDataset:
    """A memory-mapped Megatron indexed dataset (see the module docstring).

    Attributes:
      prefix: the path prefix; dtype: token dtype; sequence_lengths, sequence_pointers,
      document_index: the index arrays.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"Megatron indexed dataset {self.prefix!r}: {path} is missing")
        idx_size = os.path.getsize(idx)
        if idx_size < _HEADER_BYTES:
            raise ValueError(
                f"{idx}: {idx_size} bytes, shorter than the {_HEADER_BYTES}-byte "
                "header of a Megatron MMap index (truncated?)"
            )
        with open(idx, "rb") as f:
            header = f.read(9)
            if header != INDEX_HEADER:
                raise ValueError(
                    f"{idx}: bad header {header!r}, expected {INDEX_HEADER!r} "
                    "(not a Megatron MMap index)"
                )
            (version,) = struct.unpack("<Q", f.read(8))
            if version != 1:
                raise ValueError(f"{idx}: index version {version}, only 1 is known")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPE_CODES:
                raise ValueError(f"{idx}: unknown dtype code {code}")
            num_seq, num_doc = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        want = offset + 12 * num_seq + 8 * num_doc  # int32 lengths, int64 pointers, int64 docs
        if idx_size != want:
            raise ValueError(
                f"{idx}: {idx_size} bytes, but its header announces {num_seq} "
                f"sequences and {num_doc} document-index entries, which take "
                f"{want} bytes ({'truncated' if idx_size < want else 'trailing bytes'})"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        buf = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(buf, np.int32, num_seq, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buf, np.int64, num_seq, offset)
        offset += self.sequence_pointers.nbytes
        self.document_index = np.frombuffer(buf, np.int64, num_doc, offset)
        self._check_index(idx, num_seq)
        self._check_bin(bin_path)
        self.tokens = (
            np.memmap(bin_path, mode="r", dtype=self.dtype)
            if os.path.getsize(bin_path)
            else np.zeros(0, self.dtype)
        )

    def _check_index(self, idx: str, num_seq: int) -> None:
        """The index is self-consistent: sequences back to back from byte 0, documents in
        order and ending with the number of sequences."""
        doc = self.document_index
        if doc.size == 0 or doc[-1] != num_seq or doc[0] != 0 or (np.diff(doc) < 0).any():
            raise ValueError(
                f"{idx}: the document index must rise from 0 to the number of sequences ({num_seq})"
            )
        if (self.sequence_lengths < 0).any():
            raise ValueError(f"{idx}: negative sequence lengths")
        nbytes = self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        expected = np.concatenate([[0], np.cumsum(nbytes)[:-1]]) if num_seq else nbytes
        bad = np.flatnonzero(self.sequence_pointers != expected)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{idx}: sequence {i} starts at byte {int(self.sequence_pointers[i])} "
                f"of the .bin, expected {int(expected[i])} (sequences back to back)"
            )

    def _check_bin(self, bin_path: str) -> None:
        """The ``.bin`` holds exactly the tokens the index describes (Megatron's layout fixes
        its size): a truncated file would otherwise train on part of the data."""
        tokens = int(self.sequence_lengths.astype(np.int64).sum())
        want, have = tokens * self.dtype.itemsize, os.path.getsize(bin_path)
        if have != want:
            what = (
                f"truncated: it holds {have // self.dtype.itemsize} of them"
                if have < want
                else f"{have - want} bytes more than that"
            )
            raise ValueError(
                f"{bin_path}: {have} bytes, but {self.prefix}.idx describes "
                f"{tokens} {self.dtype} tokens ({want} bytes); {what}"
            )

    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_index.size - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sequence ``i``."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def document_tokens(self, first_doc: int, last_doc: int) -> np.ndarray:
        """All tokens of documents ``[first_doc, last_doc)``, back to back (a view)."""
        s0, s1 = int(self.document_index[first_doc]), int(self.document_index[last_doc])
        if s0 == s1:
            return self.tokens[:0]
        start = int(self.sequence_pointers[s0]) // self.dtype.itemsize
        end = int(self.sequence_pointers[s1 - 1]) // self.dtype.itemsize + int(
            self.sequence_lengths[s1 - 1]
        )
        return self.tokens[start:end]


def write_indexed_dataset(
    prefix: str | os.PathLike, documents: Iterable[Sequence[int]], dtype: type
) -> tuple[int, int]:
    """Writes documents (one sequence each) in Megatron's format; returns
    ``(sequences, tokens)``."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF:
        raise ValueError(
            f"write_indexed_dataset: dtype {dtype} is not one of Megatron's "
            f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}"
        )
    lengths, pointers, pos = [], [], 0
    with open(str(prefix) + ".bin", "wb") as out:
        for doc in documents:
            arr = np.asarray(doc, dtype)
            out.write(arr.tobytes(order="C"))
            lengths.append(arr.size)
            pointers.append(pos)
            pos += arr.nbytes
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<QQ", len(lengths), len(lengths) + 1))
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(np.asarray(pointers, np.int64).tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return len(lengths), int(sum(lengths))
