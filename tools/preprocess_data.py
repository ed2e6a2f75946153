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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jax_wgrad.training.indexed import optimal_dtype, write_indexed_dataset


def documents(paths: list[str], json_key: str):
    """Text of every document: a line of a ``.jsonl``/``.json`` file, or a whole file."""
    for path in paths:
        p = Path(path)
        if p.suffix in (".jsonl", ".json"):
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if json_key not in row:
                        raise ValueError(f"{path}:{n}: no {json_key!r} field")
                    yield row[json_key]
        else:
            yield p.read_text(encoding="utf-8", errors="replace")


def make_encoder(tokenizer_json: str | None):
    """``(encode(text) -> ids, vocab size, default eod id)``."""
    if tokenizer_json is None:
        return (lambda text: list(text.encode("utf-8"))), 256, 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
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
      ValueError: no tokenizer.json, or more token ids than the model has rows.
    """
    d = Path(hf_dir)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer-hf-dir {hf_dir}: no tokenizer.json there")
    encode, vocab, eod = make_encoder(str(d / "tokenizer.json"))
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    model_vocab = config.get("vocab_size")
    if model_vocab is not None and vocab > model_vocab:
        raise ValueError(
            f"--tokenizer-hf-dir {hf_dir}: the tokenizer has {vocab} tokens, the "
            f"model's vocab_size is {model_vocab}"
        )
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return encode, model_vocab or vocab, eos if isinstance(eos, int) else eod


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="text or JSON-lines files")
    p.add_argument("--output-prefix", required=True)
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
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--eod-id", type=int, default=None)
    args = p.parse_args(argv)
    missing = [f for f in args.input if not Path(f).is_file()]
    if missing:
        p.error(f"no such input file: {', '.join(missing)}")
    try:
        encode, vocab, eod = (
            hf_encoder(args.tokenizer_hf_dir)
            if args.tokenizer_hf_dir
            else make_encoder(args.tokenizer_json)
        )
    except ValueError as exc:
        p.error(str(exc))
    eod = args.eod_id if args.eod_id is not None else eod
    if args.append_eod and eod is None:
        p.error("--append-eod: the tokenizer has no end-of-document token; pass --eod-id")
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)

    def encoded():
        for text in documents(args.input, args.json_key):
            ids = encode(text)
            yield ids + [eod] if args.append_eod else ids

    try:
        n_docs, n_tokens = write_indexed_dataset(
            args.output_prefix, encoded(), optimal_dtype(vocab)
        )
    except (ValueError, json.JSONDecodeError) as exc:
        p.error(str(exc))
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
