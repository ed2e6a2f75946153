"""Careless inputs to ``tools/convert_hf.py`` and ``tools/preprocess_data.py``: each is
refused in one line naming the flag, file or field and what is allowed (exit 2, no
traceback), and nothing that existed before is lost or replaced."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from script_util import ROOT, load_script

from jax_wgrad.training.indexed import IndexedDataset

FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def refused(tool, capsys, argv: list[str], message: str) -> str:
    """``argv`` ends the tool with an argparse-style error: exit code 2, usage and
    ``<tool>: error: <...message...>`` on stderr, one error line, no traceback."""
    with pytest.raises(SystemExit) as exc:
        tool.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    last = err.strip().splitlines()[-1]
    assert "error: " in last and message in last and "Traceback" not in err, err
    return last


def tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` and its bytes (``None``: a directory)."""
    return {
        str(p.relative_to(path)): None if p.is_dir() else p.read_bytes()
        for p in sorted(path.rglob("*"))
    }


# --------------------------------------------------------------------------- convert_hf


@pytest.fixture(scope="module")
def convert():
    return load_script("tools/convert_hf.py")


@pytest.fixture(scope="module")
def checkpoint(convert, tmp_path_factory):
    """The Llama fixture converted at --seq-length 16 (a parameters-only checkpoint)."""
    out = tmp_path_factory.mktemp("convert") / "ckpt"
    convert.main(["--hf-dir", str(FIXTURES / "llama"), "--out", str(out), "--seq-length", "16"])
    return out


def test_export_into_a_file_is_refused(convert, checkpoint, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", target],
        f"--hf-dir {target}: a file, not a directory; nothing written",
    )
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", target / "hf"],
        f"--hf-dir {target / 'hf'}: cannot create it, {target} is a file",
    )
    assert target.read_text() == "mine"


def test_import_into_a_file_is_refused_at_once(convert, tmp_path, capsys):
    """It used to wait for orbax's timeout."""
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    hf = FIXTURES / "llama"
    refused(convert, capsys, ["--hf-dir", hf, "--out", target], f"--out {target}: a file")
    refused(
        convert,
        capsys,
        ["--hf-dir", hf, "--out", target / "ckpt"],
        f"cannot create it, {target} is a file",
    )
    assert target.read_text() == "mine"


def test_import_never_writes_over_a_checkpoint(convert, checkpoint, capsys):
    """It used to report success and write nothing."""
    before = tree(checkpoint)
    refused(
        convert,
        capsys,
        ["--hf-dir", FIXTURES / "llama", "--out", checkpoint],
        f"--out {checkpoint}: already holds a checkpoint (step 0); nothing is overwritten",
    )
    assert tree(checkpoint) == before
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", checkpoint],
        f"--hf-dir {checkpoint}: holds a checkpoint (step 0); a Hugging Face model goes into "
        "a directory of its own",
    )
    assert tree(checkpoint) == before


def test_import_never_writes_into_a_model(convert, tmp_path, capsys):
    hf = tmp_path / "llama"  # a copy: the fixture stays safe if this ever regresses
    shutil.copytree(FIXTURES / "llama", hf)
    before = tree(hf)
    refused(
        convert,
        capsys,
        ["--hf-dir", hf, "--out", hf],
        f"--out {hf}: holds a Hugging Face model (config.json,",
    )
    assert tree(hf) == before


def test_a_template_of_another_family_is_refused(convert, checkpoint, tmp_path, capsys):
    """A Qwen2 template for a Llama model would give it Qwen2's tokenizer and (null) token
    ids: refused, both families named, nothing written. A Mistral template of the same
    architecture exports a Mistral directory with the template's ids."""
    out = tmp_path / "hf"
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", out, "--hf-template", FIXTURES / "qwen2"],
        f"--hf-template {FIXTURES / 'qwen2'}: a qwen2 model, the checkpoint {checkpoint} "
        "holds a llama model",
    )
    assert not out.exists()
    argv = ["--export", "--load", checkpoint, "--hf-dir", out, "--hf-template"]
    convert.main([str(a) for a in argv + [FIXTURES / "mistral"]])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mistral"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_a_template_of_another_vocabulary_is_refused(convert, checkpoint, tmp_path, capsys):
    template = tmp_path / "template"
    shutil.copytree(FIXTURES / "llama", template)
    config = json.loads((template / "config.json").read_text())
    (template / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", tmp_path / "hf", "--hf-template", template],
        f"--hf-template {template}: vocab_size 256, the checkpoint {checkpoint} has a "
        "vocabulary of 128",
    )
    (template / "config.json").write_text("{")
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", tmp_path / "hf", "--hf-template", template],
        f"--hf-template {template / 'config.json'}: not valid JSON",
    )


def test_export_never_writes_over_a_model(convert, checkpoint, tmp_path, capsys):
    """The template's own directory (or any holding a model) keeps its files."""
    template = tmp_path / "llama"  # a copy: the fixture stays safe if this ever regresses
    shutil.copytree(FIXTURES / "llama", template)
    before = tree(template)
    refused(
        convert,
        capsys,
        ["--export", "--load", checkpoint, "--hf-dir", template, "--hf-template", template],
        f"--hf-dir {template}: already holds a model (config.json, generation_config.json, "
        "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
        "model.safetensors.index.json); nothing is overwritten",
    )
    assert tree(template) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-shard-bytes", "0"], "argument --max-shard-bytes: '0': must be a positive"),
        (["--max-shard-bytes", "-5"], "argument --max-shard-bytes: '-5': must be a positive"),
        (["--out", "ckpt"], "--out: only for an import (without --export)"),
        (["--seq-length", "8"], "--seq-length: only for an import"),
    ],
)
def test_export_flags(convert, checkpoint, tmp_path, capsys, argv, message):
    refused(
        convert, capsys, ["--export", "--load", checkpoint, "--hf-dir", tmp_path] + argv, message
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-length", "0"], "argument --seq-length: '0': must be a positive number"),
        (["--make-vocab-size-divisible-by", "-4"], "'-4': must be a positive number"),
        (["--dtype", "bfloat16"], "--dtype: only for an export (with --export)"),
        (["--max-shard-bytes", "100"], "--max-shard-bytes: only for an export"),
        (["--load", "x", "--hf-template", "y"], "--load, --hf-template: only for an export"),
    ],
)
def test_import_flags(convert, tmp_path, capsys, argv, message):
    refused(convert, capsys, ["--hf-dir", FIXTURES / "llama", "--out", tmp_path] + argv, message)
    assert not any(tmp_path.iterdir())


def test_missing_directories_are_named(convert, tmp_path, capsys):
    nope, afile = tmp_path / "nope", tmp_path / "afile"
    afile.write_text("")
    out = ["--hf-dir", tmp_path / "hf"]
    refused(
        convert, capsys, ["--export", "--load", nope] + out, f"--load {nope}: no such directory"
    )
    refused(convert, capsys, ["--export", "--load", afile] + out, f"--load {afile}: a file, not")
    refused(convert, capsys, ["--export", "--load", tmp_path] + out, "no checkpoint in this")
    refused(convert, capsys, ["--hf-dir", nope, "--out", tmp_path / "c"], "no such directory")
    refused(convert, capsys, ["--hf-dir", afile, "--out", tmp_path / "c"], "a file, not a model")


def test_a_damaged_checkpoint_is_one_line(checkpoint, tmp_path):
    """A truncated tensor file: one line naming the step, no traceback of orbax's reads."""
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    for f in (damaged / "0" / "params").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:100])
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_hf.py"), "--export", "--load", str(damaged)]
        + ["--hf-dir", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert last.startswith(f"convert_hf.py: error: checkpoint {damaged} step 0 is damaged: ")
    assert not (tmp_path / "hf").exists()


def test_export_hf_refuses_a_file_and_a_non_positive_shard_size(tmp_path):
    from jax_wgrad.interop import export_hf, import_hf

    cfg, params = import_hf(FIXTURES / "llama")
    with pytest.raises(ValueError, match="max_shard_bytes must be positive, got 0"):
        export_hf(cfg, params, tmp_path / "hf", max_shard_bytes=0)
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        export_hf(cfg, params, tmp_path / "f")
    assert (tmp_path / "f").read_text() == "mine" and not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- preprocess_data


@pytest.fixture(scope="module")
def preprocess():
    return load_script("tools/preprocess_data.py")


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello world")
    return path


@pytest.mark.parametrize("eod", ["70000", "-1", "256"])
def test_an_eod_id_outside_the_vocabulary_is_refused(preprocess, text, capsys, eod):
    """70000 and -1 do not fit uint16 (an OverflowError before); 256 would fit it but is no
    byte token."""
    out = ["--input", text, "--output-prefix", text.parent / "o", "--append-eod"]
    refused(
        preprocess,
        capsys,
        out + ["--eod-id", eod],
        f"--eod-id {eod}: not a token id of this vocabulary (0..255; the dataset stores uint16)",
    )
    refused(
        preprocess,
        capsys,
        out[:-1] + ["--eod", eod],
        f"--eod-id {eod}: only used with --append-eod",
    )
    assert sorted(p.name for p in text.parent.iterdir()) == ["a.txt"]


def test_an_output_directory_that_cannot_be_made_is_named(preprocess, text, capsys):
    blocker = text.parent / "afile"
    blocker.write_text("mine")
    refused(
        preprocess,
        capsys,
        ["--input", text, "--output-prefix", blocker / "x" / "o"],
        f"--output-prefix {blocker / 'x' / 'o'}: cannot create its directory {blocker / 'x'} "
        f"({blocker} is not a directory)",
    )
    assert blocker.read_text() == "mine"


def test_tokenizer_files_are_named(preprocess, text, capsys):
    pytest.importorskip("tokenizers", reason="the optional tokenizers library")
    nope = text.parent / "nope.json"
    argv = ["--input", text, "--output-prefix", text.parent / "o"]
    refused(preprocess, capsys, argv + ["--tokenizer-json", nope], f"{nope}: no such file")
    refused(
        preprocess,
        capsys,
        argv + ["--tokenizer-json", text],
        f"--tokenizer-json {text}: not a tokenizers tokenizer.json (",
    )
    hf = text.parent / "hf"
    hf.mkdir()
    shutil.copy(text, hf / "tokenizer.json")
    refused(
        preprocess,
        capsys,
        argv + ["--tokenizer-hf-dir", hf],
        f"--tokenizer-hf-dir {hf}: {hf / 'tokenizer.json'}: not a tokenizers tokenizer.json",
    )


def test_an_empty_dataset_is_refused_and_the_old_one_kept(preprocess, text, capsys):
    prefix = text.parent / "o"
    preprocess.main(["--input", str(text), "--output-prefix", str(prefix)])
    before = tree(text.parent)
    empty, blank = text.parent / "empty.txt", text.parent / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n\n")
    refused(
        preprocess,
        capsys,
        ["--input", empty, blank, "--output-prefix", prefix],
        f"--input {empty} {blank}: no tokens in them (1 document(s), all empty)",
    )
    assert tree(text.parent) == {**before, "blank.jsonl": b"\n\n", "empty.txt": b""}
    assert bytes(IndexedDataset(prefix)[0].astype(np.uint8)) == b"hello world"


@pytest.mark.parametrize(
    "prefix, message",
    [
        ("runs/", "--output-prefix 'runs/': names a directory"),
        (".", "--output-prefix '.': names a directory"),
        ("corpus.bin", "--output-prefix corpus.bin: names a file of a dataset"),
    ],
)
def test_a_prefix_must_name_the_dataset(preprocess, text, capsys, monkeypatch, prefix, message):
    monkeypatch.chdir(text.parent)
    refused(preprocess, capsys, ["--input", text, "--output-prefix", prefix], message)
    assert sorted(p.name for p in text.parent.iterdir()) == ["a.txt"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "c.jsonl:2: a JSON array, not an object"),
        ("5", "c.jsonl:2: a JSON number, not an object"),
        ('{"text": null}', "c.jsonl:2: the 'text' field is a JSON null, not a string"),
        ('{"body": "x"}', "c.jsonl:2: no 'text' field"),
        ('{"text": "x"', "c.jsonl:2: not valid JSON (Expecting"),
    ],
)
def test_json_lines_are_named(preprocess, tmp_path, capsys, line, message):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "fine"}\n' + line + "\n")
    refused(preprocess, capsys, ["--input", data, "--output-prefix", tmp_path / "o"], message)
    data.write_bytes(b"\xff\xfe")
    refused(
        preprocess,
        capsys,
        ["--input", data, "--output-prefix", tmp_path / "o"],
        f"--input {data}: not UTF-8 text",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_outputs_never_replace_what_is_not_a_regular_file(preprocess, text, capsys):
    """A symbolic link (to /dev/null) is written through and stays a link; a directory in
    the way is refused; a regular file is replaced."""
    d = text.parent
    (d / "o.bin").symlink_to(os.devnull)
    (d / "o.idx").write_text("old")
    out = preprocess.main(["--input", str(text), "--output-prefix", str(d / "o")])
    assert out["tokens"] == 11 and (d / "o.bin").is_symlink()
    assert os.readlink(d / "o.bin") == os.devnull and (d / "o.idx").read_bytes()[:7] == b"MMIDIDX"
    (d / "p.idx").mkdir()
    refused(
        preprocess,
        capsys,
        ["--input", text, "--output-prefix", d / "p"],
        f"--output-prefix {d / 'p'}: {d / 'p.idx'} is a directory, not a file",
    )
    assert sorted(p.name for p in d.iterdir()) == ["a.txt", "o.bin", "o.idx", "p.idx"]


def test_a_refusal_is_one_line_without_a_traceback(text):
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(text)]
        + ["--output-prefix", str(text.parent / "o"), "--append-eod", "--eod-id", "70000"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "preprocess_data.py: error: --eod-id 70000: not a token id of this vocabulary "
        "(0..255; the dataset stores uint16)"
    )
