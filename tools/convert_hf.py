#!/usr/bin/env python
"""Hugging Face model directory <-> this library's checkpoint (Llama, Mistral, Qwen2/3,
Mixtral, Qwen3-MoE).

Import: the HF directory's config and safetensors (streamed shard by shard) become a
PARAMETERS-ONLY checkpoint; ``examples/pretrain_gpt.py --load CKPT`` with the printed model
flags starts from it at step 0 with a fresh optimizer, on any (dp, ep, tp, pp); a run
whose model differs is refused with the field named::

    python tools/convert_hf.py --hf-dir Llama-3-8B --out ckpt/llama3 [--seq-length 4096]

Export: the newest step of a checkpoint (any layout it was trained on) becomes an HF
directory ``transformers`` loads (``--hf-template DIR`` copies the tokenizer files and
token ids of the original directory, which must be of the checkpoint's model family and
vocabulary)::

    python tools/convert_hf.py --export --load ckpt/run --hf-dir out/llama3-continued

Neither direction overwrites: an ``--out`` that already holds a checkpoint, an
``--hf-dir`` that already holds a model, is refused with what is there named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REQUIRED = ("rotary_base", "rotary_percent", "layernorm_epsilon", "moe_router_topk", "window_size")
"""Fields a converted checkpoint requires of the run beyond the shape fields."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
"""Files of an HF model directory an export writes (with its ``*.safetensors``)."""
IMPORT_ONLY = {"out": "--out", "seq_length": "--seq-length"}
IMPORT_ONLY["make_vocab_size_divisible_by"] = "--make-vocab-size-divisible-by"
EXPORT_ONLY = {
    "load": "--load",
    "hf_template": "--hf-template",
    "dtype": "--dtype",
    "max_shard_bytes": "--max-shard-bytes",
}


def output_directory(flag: str, path: str) -> Path:
    """``path`` as a directory to write into: absent (its nearest existing ancestor a
    directory) or a directory.

    Raises:
      ValueError: it is a file, or a file is where one of its ancestors would be.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: a file, not a directory; nothing written")
    above = next((a for a in p.absolute().parents if a.exists()), None)
    if not p.exists() and above is not None and not above.is_dir():
        raise ValueError(f"{flag} {path}: cannot create it, {above} is a file; nothing written")
    return p


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the (complete) checkpoints in ``directory``: orbax's step
    directories."""
    if not directory.is_dir():
        return []
    return sorted(int(d.name) for d in directory.iterdir() if d.name.isdigit() and d.is_dir())


def import_to_checkpoint(
    hf_dir: str, out: str, seq_length: int | None, make_vocab_size_divisible_by: int = 128
) -> dict:
    from jax_wgrad.interop import import_hf
    from jax_wgrad.pretrain.cli import model_flags
    from jax_wgrad.training.checkpoint import save_params_checkpoint

    if not Path(hf_dir).is_dir():
        what = "a file, not a model directory" if Path(hf_dir).exists() else "no such directory"
        raise ValueError(f"--hf-dir {hf_dir}: {what}")
    steps = checkpoint_steps(output_directory("--out", out))
    if steps:
        raise ValueError(
            f"--out {out}: already holds a checkpoint (step {', '.join(map(str, steps))}); "
            "nothing is overwritten: choose another --out or remove that one"
        )
    if model_files(Path(out)):
        raise ValueError(
            f"--out {out}: holds a Hugging Face model ({', '.join(model_files(Path(out)))}); "
            "a checkpoint goes into a directory of its own"
        )
    t0 = time.perf_counter()
    overrides = {} if seq_length is None else {"seq_length": seq_length}
    # padded as the run will pad it (the padding rows zero): any layout that divides it
    overrides["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    cfg, params = import_hf(hf_dir, **overrides)
    save_params_checkpoint(
        out, cfg, params, source=f"converted from Hugging Face {hf_dir}", required_fields=REQUIRED
    )
    return {
        "checkpoint": out,
        "seconds": round(time.perf_counter() - t0, 2),
        "flags": " ".join(model_flags(cfg)),
    }


def template_config(template: str) -> tuple[dict, str]:
    """The ``config.json`` of ``--hf-template`` and its model family.

    Raises:
      ValueError: no such directory, a broken config, or a family this tool does not write.
    """
    from jax_wgrad.interop import read_hf_config
    from jax_wgrad.interop.hf_config import FAMILIES, HF_CONFIG_CLASSES

    if not Path(template).is_dir():
        raise ValueError(f"--hf-template {template}: no such directory")
    try:
        hf = read_hf_config(template)
    except ValueError as exc:
        raise ValueError(f"--hf-template {exc}") from None
    arch = hf.get("architectures")
    if isinstance(arch, list) and len(arch) == 1 and arch[0] in FAMILIES:
        return hf, FAMILIES[arch[0]]
    if not arch and hf.get("model_type") in HF_CONFIG_CLASSES:
        return hf, hf["model_type"]
    raise ValueError(
        f"--hf-template {template}: architectures {arch!r} (model_type "
        f"{hf.get('model_type')!r}) is no family this tool exports ({sorted(FAMILIES)})"
    )


def check_template(cfg, template: str, hf: dict, family: str, load: str) -> None:
    """The template's tokenizer and token ids fit the checkpoint's model: the same family
    (Mistral for a Llama model without biases too: the same architecture) and vocabulary.

    Raises:
      ValueError: naming both families or both vocabulary sizes.
    """
    from jax_wgrad.interop.hf_config import HF_DEFAULTS, hf_config_from

    model = hf_config_from(cfg)["model_type"]
    try:
        hf_config_from(cfg, family=family)
    except ValueError:
        raise ValueError(
            f"--hf-template {template}: a {family} model, the checkpoint {load} holds a "
            f"{model} model; a template of another family would give it another model's "
            f"tokenizer and token ids: pass a {model} directory (or no --hf-template)"
        ) from None
    vocab = hf.get("vocab_size", HF_DEFAULTS.get(family, {}).get("vocab_size"))
    if vocab != cfg.vocab_size:
        raise ValueError(
            f"--hf-template {template}: vocab_size {vocab!r}, the checkpoint "
            f"{load} has a vocabulary of {cfg.vocab_size}: its tokenizer does not fit the model"
        )


def check_export_directory(hf_dir: str) -> None:
    """``--hf-dir`` of an export: a directory to be, or one holding no model files.

    Raises:
      ValueError: a file, or a directory holding model files (named).
    """
    d = output_directory("--hf-dir", hf_dir)
    there = model_files(d)
    if there:
        raise ValueError(
            f"--hf-dir {hf_dir}: already holds a model ({', '.join(there)}); nothing is "
            "overwritten: choose another --hf-dir or remove them"
        )
    steps = checkpoint_steps(d)
    if steps:
        raise ValueError(
            f"--hf-dir {hf_dir}: holds a checkpoint (step {', '.join(map(str, steps))}); "
            "a Hugging Face model goes into a directory of its own"
        )


def model_files(directory: Path) -> list[str]:
    """The files of an HF model an export would write that ``directory`` holds."""
    if not directory.is_dir():
        return []
    return sorted(
        f.name for f in directory.iterdir() if f.name in MODEL_FILES or f.suffix == ".safetensors"
    )


def export_from_checkpoint(
    load: str, hf_dir: str, template: str | None, dtype: str, max_shard_bytes: int
) -> dict:
    import jax
    import orbax.checkpoint as ocp

    from jax_wgrad import GPTConfig
    from jax_wgrad.interop import canonical_arrays, export_hf
    from jax_wgrad.training.checkpoint import Checkpointer, quiet_failed_restores

    check_export_directory(hf_dir)
    hf, family = template_config(template) if template else ({}, None)
    if not Path(load).is_dir():
        what = "a file, not a checkpoint directory" if Path(load).exists() else "no such directory"
        raise ValueError(f"--load {load}: {what}")
    with quiet_failed_restores():
        checkpoint = Checkpointer(load, create=False)
        step = checkpoint.latest_step()
        if step is None:
            raise ValueError(f"--load {load}: no checkpoint in this directory")
        # Checkpointer._read: a damaged step is a one-line CheckpointError naming it
        meta = checkpoint._read(
            step,
            lambda: checkpoint.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"],
        )
        if meta.get("model_type", "GPTConfig") != "GPTConfig":
            raise ValueError(f"--load {load}: a {meta['model_type']} checkpoint, not a GPT")
        cfg = GPTConfig(**meta["model"])
        if template:
            check_template(cfg, template, hf, family, load)
        one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])  # whatever the mesh
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), canonical_arrays(cfg)
        )
        params = checkpoint._read(
            step,
            lambda: checkpoint.manager.restore(
                step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
            )["params"],
        )
        checkpoint.close()
    # The model's context (max_position_embeddings) is the template's, not the training
    # sequence length, which may be shorter.
    extra = {
        k: hf[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
        if k in hf
    }
    files = export_hf(
        cfg,
        params,
        hf_dir,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        family=family,
        extra_config=extra,
    )
    for name in TOKENIZER_FILES if template else ():
        if (Path(template) / name).is_file() and not os.path.lexists(Path(hf_dir) / name):
            shutil.copy(Path(template) / name, Path(hf_dir) / name)
    return {"hf_dir": hf_dir, "step": step, "files": len(files)}


def positive(what: str):
    """An argparse ``type``: a positive integer (``what`` it counts, in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of {what}")
        return value

    return parse


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--hf-dir",
        required=True,
        help="the Hugging Face model directory (read, or written with --export)",
    )
    p.add_argument("--out", help="import: the checkpoint directory to write (not one holding one)")
    p.add_argument(
        "--seq-length",
        type=positive("tokens"),
        default=None,
        help="import: training sequence length (absent: max_position_embeddings)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive("rows"),
        default=None,
        help="import: pad the vocabulary to a multiple of this, as the training run does "
        "(its flag of the same name, default 128); export drops the padding rows",
    )
    p.add_argument("--export", action="store_true", help="checkpoint -> HF directory")
    p.add_argument("--load", help="export: the checkpoint directory (newest step)")
    p.add_argument(
        "--hf-template",
        default=None,
        help="export: copy tokenizer files, token ids and max_position_embeddings "
        "from this HF directory of the checkpoint's model family and vocabulary (absent: "
        "max_position_embeddings is the training --seq-length)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="export: the safetensors dtype (default float32)",
    )
    p.add_argument(
        "--max-shard-bytes",
        type=positive("bytes"),
        default=None,
        help="export: the most bytes of one safetensors shard (default 5 GiB; a bigger "
        "tensor gets a shard of its own)",
    )
    args = p.parse_args(argv)
    other = IMPORT_ONLY if args.export else EXPORT_ONLY
    given = [flag for key, flag in other.items() if getattr(args, key) is not None]
    if given:
        p.error(
            f"{', '.join(given)}: only for "
            + ("an import (without --export)" if args.export else "an export (with --export)")
        )
    try:
        if args.export:
            if not args.load:
                p.error("--export needs --load CKPT")
            out = export_from_checkpoint(
                args.load,
                args.hf_dir,
                args.hf_template,
                args.dtype or "float32",
                args.max_shard_bytes or 5 * 2**30,
            )
        else:
            if not args.out:
                p.error("import needs --out CKPT (or pass --export)")
            out = import_to_checkpoint(
                args.hf_dir, args.out, args.seq_length, args.make_vocab_size_divisible_by or 128
            )
    except ValueError as exc:  # CheckpointError too
        p.error(str(exc))
    except OSError as exc:
        p.error(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
