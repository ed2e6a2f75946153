"""Megatron's indexed dataset format, the preprocess tool, splits and blends."""

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from jax_wgrad.training.data import (
    BlendedDataset,
    ByteDataset,
    TokenDataset,
    load_data,
    padded_vocab_size,
    parse_split,
)
from jax_wgrad.training.indexed import IndexedDataset, write_indexed_dataset

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "preprocess_data", ROOT / "tools" / "preprocess_data.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reads_a_fixture_built_byte_for_byte_to_megatrons_layout(tmp_path):
    # Three documents of uint16 tokens, written field by field as Megatron documents it:
    # magic, version, dtype code (8 = uint16), #sequences, #document-index entries,
    # int32 lengths, int64 byte pointers, int64 document index.
    docs = [[5, 6, 7], [1000, 2], [65000, 0, 1, 9]]
    prefix = tmp_path / "fixture"
    (tmp_path / "fixture.bin").write_bytes(b"".join(struct.pack("<H", t) for d in docs for t in d))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<Q", 3) + struct.pack("<Q", 4)
    idx += (
        struct.pack("<3i", 3, 2, 4) + struct.pack("<3q", 0, 6, 10) + struct.pack("<4q", 0, 1, 2, 3)
    )
    (tmp_path / "fixture.idx").write_bytes(idx)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3
    assert [list(ds[i]) for i in range(3)] == docs
    assert list(ds.document_tokens(1, 3)) == docs[1] + docs[2]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_write_read_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=n) for n in (5, 0, 17, 1)]
    assert write_indexed_dataset(tmp_path / "d", docs, dtype) == (4, 23)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    assert (tmp_path / "d.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="is missing"):
        IndexedDataset(tmp_path / "nothing")
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX!" + bytes(40))
    with pytest.raises(ValueError, match="bad header"):
        IndexedDataset(tmp_path / "x")


def test_preprocess_tool_bytes(tmp_path, capsys):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["héllo", "", "world!"]) + "\n")
    txt = tmp_path / "d.txt"
    txt.write_text("plain file")
    out = _tool().main(
        [
            "--input",
            str(jsonl),
            str(txt),
            "--output-prefix",
            str(tmp_path / "out" / "c"),
            "--append-eod",
        ]
    )
    assert out["documents"] == 4 and out["vocab_size"] == 256
    ds = IndexedDataset(tmp_path / "out" / "c")
    assert ds.dtype == np.uint16
    assert bytes(ds[0][:-1].astype(np.uint8)) == "héllo".encode() and ds[0][-1] == 0
    assert list(ds[1]) == [0] and bytes(ds[3][:-1].astype(np.uint8)) == b"plain file"


def test_preprocess_tool_with_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the optional tokenizers library")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(
            {"<|endoftext|>": 0, "[UNK]": 1, "a": 2, "b": 3}, unk_token="[UNK]"
        )
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("a b a zz")
    _tool().main(
        [
            "--input",
            str(tmp_path / "t.txt"),
            "--output-prefix",
            str(tmp_path / "t"),
            "--tokenizer-json",
            str(tmp_path / "tokenizer.json"),
            "--append-eod",
        ]
    )
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "t")[0], [2, 3, 2, 1, 0])


def test_split_by_documents_and_blend(tmp_path):
    write_indexed_dataset(tmp_path / "a", [[1] * 40] * 50, np.uint16)
    write_indexed_dataset(tmp_path / "b", [[2] * 40] * 50, np.uint16)
    train, valid, test = load_data([str(tmp_path / "a")], "90,10,0")
    assert (len(train), len(valid), len(test)) == (45 * 40, 5 * 40, 0)
    train, valid, _ = load_data(
        ["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")], "90,10,0"
    )
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    batch = train.batch(0, 400, 8, seed=3)
    share_b = float((batch[:, 0] == 2).mean())
    assert 0.65 < share_b < 0.85  # drawn by the weights
    np.testing.assert_array_equal(batch, train.batch(0, 400, 8, seed=3))  # deterministic
    assert train.max_token_id == 2 and padded_vocab_size(train.max_token_id) == 128


def test_byte_split_keeps_windows_inside_the_part():
    data = ByteDataset(np.arange(1000, dtype=np.uint8) % 251)
    train, valid, test = data.split(parse_split("8,2,0"))
    assert (len(train), len(valid), len(test)) == (800, 200, 0)
    np.testing.assert_array_equal(valid.tokens, data.tokens[800:])
    assert valid.batch(0, 4, 10, 0).shape == (4, 11)


@pytest.mark.parametrize("text", ["98,x,0", "1,2,3,4", "-1,2", "0,0,0"])
def test_bad_split(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


def test_bad_data_path(tmp_path):
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        load_data(["x", str(tmp_path / "a"), "y", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="not found"):
        load_data(["0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b")])
    assert padded_vocab_size(300, 128) == 384 and padded_vocab_size(255, 128) == 256
    with pytest.raises(ValueError, match="token ids must be integers"):
        TokenDataset(np.zeros(4, np.float32))


def _dataset(tmp_path, name="d"):
    write_indexed_dataset(tmp_path / name, [np.arange(100) % 200] * 30, np.uint16)
    return tmp_path / name


def test_truncated_or_padded_bin_is_an_error_naming_the_file(tmp_path):
    """A .bin cut short would train on part of the data (and size the vocabulary from it):
    Megatron's index fixes the .bin's size, so the reader refuses it, naming the file."""
    prefix = _dataset(tmp_path)
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[: len(data) // 3])
    with pytest.raises(
        ValueError,
        match=r"d\.bin: 2000 bytes, but .*d\.idx describes 3000 "
        r"uint16 tokens \(6000 bytes\); truncated",
    ):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match=r"d\.bin: .*truncated"):
        load_data([str(prefix)])
    (tmp_path / "d.bin").write_bytes(data + b"\0\0")
    with pytest.raises(ValueError, match="2 bytes more than that"):
        IndexedDataset(prefix)


def test_truncated_idx_is_an_error_naming_the_file(tmp_path):
    prefix = _dataset(tmp_path)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(idx[:-40])
    with pytest.raises(
        ValueError,
        match=r"d\.idx: .* bytes, but its header announces 30 "
        r"sequences .*\(truncated\)",
    ):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(idx[:20])
    with pytest.raises(ValueError, match=r"d\.idx: 20 bytes, shorter than the 34-byte header"):
        IndexedDataset(prefix)


def test_a_file_of_the_dataset_instead_of_its_prefix_is_named(tmp_path):
    prefix = _dataset(tmp_path)
    with pytest.raises(ValueError, match=r"names a file of the Megatron dataset .*pass the prefix"):
        load_data([str(prefix) + ".bin"])
    (tmp_path / "d.idx").unlink()
    with pytest.raises(ValueError, match=r"d\.idx is missing"):
        load_data([str(prefix)])
