#!/usr/bin/env python
"""Regenerate ``tests/fixtures/hf/<family>/``: small random-weight Hugging Face models of the
Llama (also Llama 3.1's RoPE scaling), Mistral (also with a sliding window shorter than the
sequence), Qwen2, Mixtral, Qwen3 and Qwen3-MoE families (built from configs with
``transformers``, no download) and their reference logits, for ``tests/test_hf.py``,
``tests/test_qwen3.py`` and ``tests/test_sliding_window.py``.

Needs ``torch`` and ``transformers`` (not dependencies of this library; e.g. a separate
venv: ``pip install torch==2.13.0 transformers safetensors numpy``)::

    /path/to/venv-torch/bin/python tools/make_hf_fixtures.py [--out tests/fixtures/hf]

Per family: the HF directory (``config.json``, bf16 safetensors -- Llama's split into
shards with an index -- and whatever ``save_pretrained`` adds) and ``reference.npz``:
``tokens`` int32 ``[4, 17]``, ``logits_fp32`` (the fp32 model on ``tokens[:, :-1]``),
``logits_bf16`` (the same model in bf16, as fp32). The weights are drawn, then rounded to
bf16, so the fp32 reference model and the stored bf16 files hold the same values.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)

FAMILIES = {
    # untied, GQA 4:2
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, rope_theta=10000.0)),
    # head_dim 32 != hidden / heads (kv_channels), a sliding window longer than the sequence
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(intermediate_size=96, head_dim=32, sliding_window=4096, rope_theta=1e6),
    ),
    # q/k/v biases, tied embeddings (as Qwen2.5-0.5B)
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(intermediate_size=128, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # 4 experts, top-2
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    ),
    # Mistral 7B v0.1's sliding-window attention: a window of 5 tokens, shorter than the
    # 16 input tokens of reference.npz (Megatron's --window-size 4,0)
    "mistral_window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(intermediate_size=96, sliding_window=5, rope_theta=1e6),
    ),
    # Qwen3: q/k RMSNorm per head, head_dim 32 != hidden / heads, tied (as Qwen3-0.6B)
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            intermediate_size=96,
            head_dim=32,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        ),
    ),
    # Qwen3-MoE: 8 experts top-3, renormalised (norm_topk_prob, as Qwen3-30B-A3B), MoE on
    # layers 0 and 2 (mlp_only_layers 1, 3: Megatron's --moe-layer-freq 2), untied
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1, 3],
            head_dim=32,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        ),
    ),
    # Qwen3-MoE's default routing: norm_topk_prob false (Megatron's --moe-router-pre-softmax),
    # experts on every layer
    "qwen3_moe_unnormed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rope_theta=1e6,
        ),
    ),
    # Llama 3.1's rope_type "llama3" over an original 64 positions: head_dim 16 at base 5e5
    # has frequencies in all three bands (kept, interpolated, divided by 8), and the
    # 16-token sequences turn the lowest ones far enough for the logits to differ
    "llama31": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            intermediate_size=128,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            max_position_embeddings=512,
        ),
    ),
}
SHARD = {"llama": "200KB"}
"""Families saved as several shards with an index (the others: one file)."""


def randomize(model, seed: int) -> None:
    """Weights with some spread (HF's init gives near-uniform logits): matrices N(0, 0.08),
    the router N(0, 0.5), norms 1 + N(0, 0.1), biases N(0, 0.1); then rounded to bf16."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif ".gate.weight" in name:
                value = 0.5 * noise
            else:
                value = 0.08 * noise
            p.copy_(value.to(torch.bfloat16).to(torch.float32))


def random_shapes(family: str, seed: int) -> dict:
    """A fresh small config of ``family`` drawn from ``seed`` (GQA with at least 2 groups,
    so tensor parallelism 2 splits them; 4 layers, for 4 pipeline stages)."""
    rng = np.random.default_rng(seed)
    heads = int(rng.choice([4, 8]))
    kv = int(rng.choice([k for k in (2, 4, heads) if heads % k == 0]))
    d = int(rng.choice([8, 16, 32]))
    shapes = dict(
        COMMON,
        vocab_size=int(rng.choice([128, 160, 256])),
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
    )
    extra = dict(
        FAMILIES[family][2],
        intermediate_size=16 * int(rng.integers(2, 9)),
        rope_theta=float(rng.choice([1e4, 5e5, 1e6])),
    )
    if family.startswith("mistral"):
        extra["head_dim"] = int(rng.choice([d, 2 * d]))
    if "rope_parameters" in extra:  # Llama 3.1: the base goes inside
        extra["rope_parameters"] = {
            **extra["rope_parameters"],
            "rope_theta": extra.pop("rope_theta"),
        }
    return {**shapes, **extra}


def build(family: str, out: Path, seed: int, fresh: bool = False) -> dict:
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = random_shapes(family, seed) if fresh else {**COMMON, **extra}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    randomize(model, seed)
    tokens = torch.randint(
        0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed + 1)
    )
    fp32, bf16 = logits(model, tokens[:, :-1])
    d = out / family
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        f.unlink()
    model.save_pretrained(d, max_shard_size=SHARD.get(family, "10MB"))
    for f in d.glob("*.safetensors"):
        f.chmod(0o644)  # safetensors creates its files private
    np.savez_compressed(
        d / "reference.npz",
        tokens=tokens.numpy().astype(np.int32),
        logits_fp32=fp32,
        logits_bf16=bf16,
    )
    return {
        "family": family,
        "files": sorted(f.name for f in d.iterdir()),
        "bytes": sum(f.stat().st_size for f in d.iterdir()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def logits(model, ids):
    """``(fp32 logits, bf16 model's logits as fp32)`` of ``model`` (left in bf16)."""
    import torch

    with torch.no_grad():
        fp32 = model.float()(ids).logits.float().numpy()
        bf16 = model.to(torch.bfloat16)(ids).logits.float().numpy()
    return fp32, bf16


def logits_of(directory: str, tokens_npz: str, to: str) -> None:
    """Loads ``directory`` with ``transformers`` and writes its logits on the ``tokens`` of
    ``tokens_npz`` (inputs ``tokens[:, :-1]``) to ``to`` (used by tools/compare_hf.py)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.tensor(np.load(tokens_npz)["tokens"]).long()
    fp32, bf16 = logits(model, tokens[:, :-1])
    np.savez(to, logits_fp32=fp32, logits_bf16=bf16)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent.parent / "tests/fixtures/hf"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fresh",
        action="store_true",
        help="random shapes drawn from --seed (for tools/compare_hf.py), not the fixtures' shapes",
    )
    p.add_argument(
        "--logits-of",
        nargs=3,
        metavar=("HF_DIR", "TOKENS_NPZ", "OUT_NPZ"),
        help="only write transformers' logits of HF_DIR on TOKENS_NPZ's tokens",
    )
    p.add_argument(
        "--families",
        nargs="+",
        choices=list(FAMILIES),
        default=list(FAMILIES),
        help="only these families (each keeps its seed: --seed + 10 x its place in the list)",
    )
    args = p.parse_args(argv)
    if args.logits_of:
        logits_of(*args.logits_of)
        return
    for k, family in enumerate(FAMILIES):
        if family in args.families:
            print(json.dumps(build(family, Path(args.out), args.seed + 10 * k, args.fresh)))


if __name__ == "__main__":
    main()
