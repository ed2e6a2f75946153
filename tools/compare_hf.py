#!/usr/bin/env python
"""Live parity check against ``transformers``: for each HF directory (with the
``reference.npz`` tools/make_hf_fixtures.py writes), this library's logits and losses vs
the Hugging Face model's, and the exported directory loaded back by ``transformers``.

Runs in this library's environment; ``--torch-python`` is an interpreter with torch and
transformers (it computes the exported model's logits)::

    TORCH_PY=/path/to/venv-torch/bin/python   # an environment with torch and transformers
    $TORCH_PY tools/make_hf_fixtures.py --fresh --seed 7 --out runs/fresh
    python tools/compare_hf.py runs/fresh/* tests/fixtures/hf/* --torch-python $TORCH_PY

Per directory (one JSON line): fp32 max relative logit difference of the reference model,
max per-token KL(HF fp32 || ours bf16) (and HF's own bf16 KL for scale), the pipeline's
mean cross entropy on (2,2,2)+SP and (1,2,4) vs HF's, and the exported model's logits in
``transformers`` vs ours.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl(p_logits, q_logits) -> float:
    p, q = _log_softmax(p_logits), _log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(-1).max())


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def compare(directory: Path, torch_python: str | None) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jax_wgrad.interop import export_hf, import_hf
    from jax_wgrad.testing import reference_logits

    sys.path.insert(0, str(ROOT / "tests"))
    from test_hf import _pipeline_loss

    ref = np.load(directory / "reference.npz")
    tokens = ref["tokens"]
    cfg, params = import_hf(directory, seq_length=tokens.shape[1] - 1)
    jparams = jax.tree.map(jnp.asarray, params)
    ids = jnp.asarray(tokens[:, :-1])
    fp32 = np.asarray(reference_logits(jparams, ids, cfg))
    bf16 = np.asarray(
        reference_logits(jparams, ids, dataclasses.replace(cfg, compute_dtype="bfloat16"))
    )
    hf_ce = float(
        -np.mean(np.take_along_axis(_log_softmax(ref["logits_fp32"]), tokens[:, 1:, None], -1))
    )
    out = {
        "dir": str(directory),
        "family": json.loads((directory / "config.json").read_text())["model_type"],
        "shape": f"H{cfg.hidden_size} heads {cfg.num_attention_heads}:"
        f"{cfg.num_query_groups or cfg.num_attention_heads} d "
        f"{cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads} "
        f"V{cfg.vocab_size} F{cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size}",
        "fp32_max_rel": _rel(fp32, ref["logits_fp32"]),
        "bf16_kl_max": _kl(ref["logits_fp32"], bf16),
        "hf_bf16_kl_max": _kl(ref["logits_fp32"], ref["logits_bf16"]),
        "hf_ce": hf_ce,
    }
    for dp, tp, pp, sp in ((2, 2, 2, True), (1, 2, 4, cfg.num_moe_experts is not None)):
        ce = _pipeline_loss(cfg, params, jnp.asarray(tokens), dp, tp, pp, sp)
        out[f"ce_rel_{dp}{tp}{pp}"] = abs(ce - hf_ce) / hf_ce
    if torch_python:
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(cfg, params, Path(tmp) / "hf", max_shard_bytes=200_000)
            subprocess.run(
                [
                    torch_python,
                    str(ROOT / "tools/make_hf_fixtures.py"),
                    "--logits-of",
                    str(Path(tmp) / "hf"),
                    str(directory / "reference.npz"),
                    str(Path(tmp) / "out.npz"),
                ],
                check=True,
                capture_output=True,
            )
            back = np.load(Path(tmp) / "out.npz")
            out["exported_fp32_max_rel_vs_ours"] = _rel(back["logits_fp32"], fp32)
            out["exported_equals_original_hf"] = bool(
                np.array_equal(back["logits_fp32"], ref["logits_fp32"])
            )
    return out


def missing_inputs(directory: Path) -> str | None:
    """What ``directory`` lacks to be compared (``None``: nothing): a model directory
    with the ``reference.npz`` of ``tools/make_hf_fixtures.py``."""
    if not directory.is_dir():
        return "no such directory"
    if not (directory / "config.json").is_file():
        return "no config.json (not a Hugging Face model directory)"
    if not (directory / "reference.npz").is_file():
        return (
            "no reference.npz: the comparison needs the reference logits of "
            "tools/make_hf_fixtures.py (an exported directory has none; write them with "
            "make_hf_fixtures.py --logits-of DIR REFERENCE OUT in the torch environment)"
        )
    return None


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--torch-python", default=None)
    args = p.parse_args(argv)
    for d in args.dirs:  # all checked before the first (slow) comparison
        problem = missing_inputs(d)
        if problem:
            p.error(f"{d}: {problem}")
    import jax_wgrad

    jax_wgrad.use_virtual_cpu_devices(8)
    rows = []
    for d in args.dirs:
        rows.append(compare(d, args.torch_python))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
