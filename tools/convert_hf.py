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
token ids of the original directory)::

    python tools/convert_hf.py --export --load ckpt/run --hf-dir out/llama3-continued
"""

from __future__ import annotations

import argparse
import json
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


def import_to_checkpoint(
    hf_dir: str, out: str, seq_length: int | None, make_vocab_size_divisible_by: int = 128
) -> dict:
    from jax_wgrad.interop import import_hf
    from jax_wgrad.pretrain.cli import model_flags
    from jax_wgrad.training.checkpoint import save_params_checkpoint

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


def export_from_checkpoint(
    load: str, hf_dir: str, template: str | None, dtype: str, max_shard_bytes: int
) -> dict:
    import jax
    import orbax.checkpoint as ocp

    from jax_wgrad import GPTConfig
    from jax_wgrad.interop import canonical_arrays, export_hf

    manager = ocp.CheckpointManager(
        str(Path(load).absolute()), options=ocp.CheckpointManagerOptions(create=False)
    )
    step = manager.latest_step()
    if step is None:
        raise ValueError(f"--load {load}: no checkpoint in this directory")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("model_type", "GPTConfig") != "GPTConfig":
        raise ValueError(f"--load {load}: a {meta['model_type']} checkpoint, not a GPT")
    cfg = GPTConfig(**meta["model"])
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])  # whatever the saved mesh
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), canonical_arrays(cfg)
    )
    params = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
    )["params"]
    manager.close()
    extra = {}
    if template:
        hf = json.loads((Path(template) / "config.json").read_text())
        # The model's context (max_position_embeddings) is the template's, not the
        # training sequence length, which may be shorter.
        extra = {
            k: hf[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
            if k in hf
        }
    files = export_hf(
        cfg, params, hf_dir, dtype=dtype, max_shard_bytes=max_shard_bytes, extra_config=extra
    )
    for name in TOKENIZER_FILES if template else ():
        if (Path(template) / name).is_file() and not (Path(hf_dir) / name).exists():
            shutil.copy(Path(template) / name, Path(hf_dir) / name)
    return {"hf_dir": hf_dir, "step": step, "files": len(files)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--hf-dir",
        required=True,
        help="the Hugging Face model directory (read, or written with --export)",
    )
    p.add_argument("--out", help="the checkpoint directory to write (import)")
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="import: training sequence length (absent: max_position_embeddings)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="import: pad the vocabulary to a multiple of this, as the training run does "
        "(its flag of the same name, default 128); export drops the padding rows",
    )
    p.add_argument("--export", action="store_true", help="checkpoint -> HF directory")
    p.add_argument("--load", help="export: the checkpoint directory (newest step)")
    p.add_argument(
        "--hf-template",
        default=None,
        help="export: copy tokenizer files, token ids and max_position_embeddings "
        "from this HF directory (absent: max_position_embeddings is the "
        "training --seq-length)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="export: the safetensors dtype",
    )
    p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30)
    args = p.parse_args(argv)
    try:
        if args.export:
            if not args.load:
                p.error("--export needs --load CKPT")
            out = export_from_checkpoint(
                args.load, args.hf_dir, args.hf_template, args.dtype, args.max_shard_bytes
            )
        else:
            if not args.out:
                p.error("import needs --out CKPT (or pass --export)")
            out = import_to_checkpoint(
                args.hf_dir, args.out, args.seq_length, args.make_vocab_size_divisible_by
            )
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
