#!/usr/bin/env python
"""Write Megatron's MMap indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) from text.

Like Megatron-LM's ``tools/preprocess_data.py``: one document per line of a JSON-lines
file (its ``--json-key`` field, ``text`` by default) or per plain-text file; tokens are
the UTF-8 bytes (vocabulary 256) or, with ``--tokenizer-json``, the ids of a Hugging Face
``tokenizers`` tokenizer (``--tokenizer-hf-dir DIR``: a model directory's ``tokenizer.json``,
its vocabulary checked against the model's); ``--append-eod`` ends every document with
``--eod-id`` (default: 0 for bytes, the tokenizer's ``<|endoftext|>``/``</s>`` token
otherwise). The token dtype is Megatron's choice for the vocabulary (uint16 below 65500
ids, else int32)::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus
    python examples/pretrain_gpt.py --data-path data/corpus --split 98,2,0

Both files are written next to the prefix under temporary names and take their place only
when the whole dataset is written: a refused or failed run leaves what was there before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

from jax_wgrad.training.indexed import optimal_dtype, write_indexed_dataset


def documents(paths: list[str], json_key: str):
    """Text of every document: a line of a ``.jsonl``/``.json`` file, or a whole file.

    Raises:
      ValueError: a file that cannot be read, a line that is not a JSON object with a string
        ``json_key`` (``file:line`` named).
    """
    for path in paths:
        p = Path(path)
        try:
            if p.suffix not in (".jsonl", ".json"):
                yield p.read_text(encoding="utf-8", errors="replace")
                continue
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--input {path}: cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--input {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a JSON {_json_type(row)}, not an object")
            if json_key not in row:
                raise ValueError(f"{path}:{n}: no {json_key!r} field")
            if not isinstance(row[json_key], str):
                raise ValueError(
                    f"{path}:{n}: the {json_key!r} field is a JSON "
                    f"{_json_type(row[json_key])}, not a string"
                )
            yield row[json_key]


def _json_type(value) -> str:
    """JSON's name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


def make_encoder(tokenizer_json: str | None, flag: str = "--tokenizer-json"):
    """``(encode(text) -> ids, vocab size, default eod id)``; ``flag``: what named the file
    (in errors).

    Raises:
      ValueError: the file is missing or not a ``tokenizers`` tokenizer, or the library is
        not installed.
    """
    if tokenizer_json is None:
        return (lambda text: list(text.encode("utf-8"))), 256, 0
    if not Path(tokenizer_json).is_file():
        raise ValueError(f"{flag} {tokenizer_json}: no such file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            f"{flag} {tokenizer_json}: reading it needs the tokenizers library "
            "(pip install tokenizers)"
        ) from None
    try:
        tok = Tokenizer.from_file(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ValueError(
            f"{flag} {tokenizer_json}: not a tokenizers tokenizer.json ({exc})"
        ) from None
    eod = next(
        (
            tok.token_to_id(t)
            for t in ("<|endoftext|>", "</s>", "<eos>")
            if tok.token_to_id(t) is not None
        ),
        None,
    )
    return (lambda text: tok.encode(text).ids), tok.get_vocab_size(), eod


def hf_encoder(hf_dir: str):
    """``make_encoder``'s triple for a Hugging Face model directory: its ``tokenizer.json``;
    the end-of-document id is the model's ``eos_token_id``. The tokenizer's vocabulary
    (added tokens included) must fit the model's ``vocab_size``.

    Raises:
      ValueError: no tokenizer.json, a broken config.json, or more token ids than the
        model has rows.
    """
    from jax_wgrad.interop.hf import read_json

    d = Path(hf_dir)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer-hf-dir {hf_dir}: no tokenizer.json there")
    encode, vocab, eod = make_encoder(
        str(d / "tokenizer.json"), flag=f"--tokenizer-hf-dir {hf_dir}:"
    )
    config = read_json(d / "config.json") if (d / "config.json").exists() else {}
    model_vocab = config.get("vocab_size")
    if model_vocab is not None and (
        not isinstance(model_vocab, int) or isinstance(model_vocab, bool) or model_vocab < 1
    ):
        raise ValueError(
            f"--tokenizer-hf-dir {hf_dir}: config.json's vocab_size is {model_vocab!r}, "
            "not a positive integer"
        )
    if model_vocab is not None and vocab > model_vocab:
        raise ValueError(
            f"--tokenizer-hf-dir {hf_dir}: the tokenizer has {vocab} tokens, the "
            f"model's vocab_size is {model_vocab}"
        )
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return encode, model_vocab or vocab, eos if isinstance(eos, int) else eod


def check_prefix(prefix: str) -> list[Path]:
    """The two files ``prefix`` names (``.bin``, ``.idx``).

    Raises:
      ValueError: a prefix that names a directory (``runs/``, an existing directory) or a
        file of a dataset (``x.bin``), or a file there that is a directory.
    """
    p = Path(prefix)
    if not prefix or prefix.endswith(("/", os.sep)) or p.is_dir():
        raise ValueError(
            f"--output-prefix {prefix!r}: names a directory; give the datasets' name in it "
            f"(e.g. {os.path.join(prefix or '.', 'corpus')}: the tool writes PREFIX.bin and "
            "PREFIX.idx)"
        )
    if p.suffix in (".bin", ".idx"):
        raise ValueError(
            f"--output-prefix {prefix}: names a file of a dataset; the tool adds .bin and "
            f".idx itself (this would write {prefix}.bin): pass {p.with_suffix('')}"
        )
    files = [Path(prefix + ".bin"), Path(prefix + ".idx")]
    for f in files:
        if f.is_dir():
            raise ValueError(f"--output-prefix {prefix}: {f} is a directory, not a file")
    return files


def make_parent(prefix: str) -> list[Path]:
    """Creates the directory of ``prefix``; returns the directories created (outermost
    first).

    Raises:
      ValueError: it cannot be created (a file in the way, no permission).
    """
    parent = Path(prefix).parent
    created = [d for d in (parent, *parent.parents) if not d.exists()][::-1]
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        in_way = next((d for d in (parent, *parent.parents) if d.exists()), parent)
        why = f"{in_way} is not a directory" if not in_way.is_dir() else exc.strerror or exc
        raise ValueError(
            f"--output-prefix {prefix}: cannot create its directory {parent} ({why})"
        ) from None
    return created


def put_in_place(written: Path, target: Path) -> None:
    """``written`` (a temporary file next to ``target``) becomes ``target``: renamed over a
    regular file or onto no file; written into anything else (a symbolic link, a device),
    which is kept."""
    try:
        kind = os.lstat(target).st_mode
    except FileNotFoundError:
        kind = None
    if kind is None or stat.S_ISREG(kind):
        os.replace(written, target)
    else:
        with open(written, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="text or JSON-lines files")
    p.add_argument(
        "--output-prefix",
        required=True,
        help="PREFIX of the two files written, PREFIX.bin and PREFIX.idx (e.g. data/corpus)",
    )
    p.add_argument("--json-key", default="text")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer-json", default=None, help="a tokenizers tokenizer.json (default: UTF-8 bytes)"
    )
    tok.add_argument(
        "--tokenizer-hf-dir",
        default=None,
        help="a Hugging Face model directory: its tokenizer.json, checked "
        "against its config.json's vocab_size; eod = its eos_token_id",
    )
    p.add_argument("--append-eod", action="store_true", help="end every document with --eod-id")
    p.add_argument(
        "--eod-id",
        type=int,
        default=None,
        help="with --append-eod: the end-of-document token id (default: the tokenizer's)",
    )
    args = p.parse_args(argv)
    if args.eod_id is not None and not args.append_eod:
        p.error(
            f"--eod-id {args.eod_id}: only used with --append-eod (Megatron appends the "
            "end-of-document token only then); pass both or neither"
        )
    missing = [f for f in args.input if not Path(f).is_file()]
    if missing:
        p.error(f"no such input file: {', '.join(missing)}")
    try:
        targets = check_prefix(args.output_prefix)
        encode, vocab, eod = (
            hf_encoder(args.tokenizer_hf_dir)
            if args.tokenizer_hf_dir
            else make_encoder(args.tokenizer_json)
        )
    except ValueError as exc:
        p.error(str(exc))
    dtype = optimal_dtype(vocab)
    eod = args.eod_id if args.eod_id is not None else eod
    if args.append_eod and eod is None:
        p.error("--append-eod: the tokenizer has no end-of-document token; pass --eod-id")
    if args.append_eod and not 0 <= eod < vocab:
        what = f"--eod-id {eod}" if args.eod_id is not None else f"the end-of-document id {eod}"
        p.error(
            f"{what}: not a token id of this vocabulary (0..{vocab - 1}; the dataset "
            f"stores {np.dtype(dtype)})"
        )

    def encoded():
        for text in documents(args.input, args.json_key):
            ids = encode(text)
            yield ids + [eod] if args.append_eod else ids

    try:
        created = make_parent(args.output_prefix)
    except ValueError as exc:
        p.error(str(exc))
    work = None
    try:
        try:
            work = tempfile.mkdtemp(
                prefix=f".{Path(args.output_prefix).name}.", dir=Path(args.output_prefix).parent
            )
        except OSError as exc:
            p.error(f"--output-prefix {args.output_prefix}: cannot write there ({exc})")
        try:
            n_docs, n_tokens = write_indexed_dataset(Path(work) / "dataset", encoded(), dtype)
        except (ValueError, OverflowError) as exc:
            p.error(str(exc))
        except OSError as exc:
            p.error(f"--output-prefix {args.output_prefix}: cannot write it ({exc})")
        if n_tokens == 0:
            p.error(
                f"--input {' '.join(args.input)}: no tokens in them ({n_docs} document(s), all "
                "empty): an empty dataset trains on nothing; nothing written"
            )
        try:
            for suffix, target in zip((".bin", ".idx"), targets):
                put_in_place(Path(work) / ("dataset" + suffix), target)
        except OSError as exc:
            p.error(f"--output-prefix {args.output_prefix}: cannot write it ({exc})")
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if not all(f.exists() for f in targets):  # refused: the directories made for it go
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    break
    out = {
        "documents": n_docs,
        "tokens": n_tokens,
        "vocab_size": vocab,
        "prefix": args.output_prefix,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
