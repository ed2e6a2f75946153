#!/usr/bin/env python
"""Pretrain a small byte-level GPT with tensor, sequence, pipeline (1F1B) and data parallelism.

Runs on CPU by default with 8 virtual devices and trains on the Python standard
library's own source files (present on every machine), or on your text with
``--data-path``. Flags follow Megatron-LM's ``pretrain_gpt.py``::

    python examples/pretrain_gpt.py                                   # dp=8
    python examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --sequence-parallel \\
        --gradient-accumulation-fusion --metrics-file /tmp/m.jsonl    # dp=2, tp=2, pp=2
    python examples/pretrain_gpt.py --pipeline-model-parallel-size 2 \
        --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 100000

The same ``--seed`` gives the same initial parameters and batches for every layout, so
``--metrics-file`` loss curves of different layouts can be compared directly.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

FIELD_DESTS = {
    "num_moe_experts": "num_experts",
    "bucket_size": "ddp_bucket_size",
    "average_in_collective": "ddp_average_in_collective",
    "load_optim": "no_load_optim",
    "layernorm_epsilon": "norm_epsilon",
    "microbatch_group_size_per_vp_stage": "microbatch_group_size_per_virtual_pipeline_stage",
}
"""Config fields whose flag has another name (the rest are spelled like their flag)."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every flag's default appended (flags absent by default say
    in their help what absence means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            action.option_strings
            and "%(default)" not in text
            and action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def finite_float(text: str) -> float:
    """argparse type: a finite float (``nan``/``inf`` are refused, naming the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(minimum: int, below: int | None = None):
    """argparse type: an integer >= ``minimum`` (and < ``below`` when given); the error
    names the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be < {below}, got {value}")
        return value

    return parse


def float_above(minimum: float, inclusive: bool):
    """argparse type: a finite float >= ``minimum`` (``inclusive``) or > ``minimum``; the
    error names the flag and repeats the value as typed."""

    def parse(text: str) -> float:
        value = finite_float(text)
        if value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {minimum:g}, got {text}"
            )
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
nonnegative_float = float_above(0.0, inclusive=True)
positive_float = float_above(0.0, inclusive=False)


def model_default(field: str):
    """``GPTConfig``'s default of ``field``: the flag shows the one definition (no copy)."""
    import dataclasses

    from jax_wgrad.models.gpt.config import GPTConfig

    return next(f.default for f in dataclasses.fields(GPTConfig) if f.name == field)


EPILOG = """\
--load DIR resumes from the newest checkpoint in DIR; a DIR that does not exist or holds no
checkpoint is an error, unless DIR is also the --save directory (Megatron's "resume if
there": the run then starts from scratch and says so). A damaged newest checkpoint is an
error naming the step and the damage; --load-fallback-to-intact loads the newest intact one
instead."""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        allow_abbrev=False,  # as Megatron: --hidden is no flag
        usage="%(prog)s [flags] (all flags: --help)",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("launch")
    g.add_argument(
        "--num-cpu-devices",
        type=positive_int,
        default=8,
        help="virtual CPU devices of this process when running on CPU",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (multi-process launch)",
    )
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="host:port of process 0 (with --distributed; or JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes",
        type=positive_int,
        default=None,
        help="processes of a --distributed launch (absent: from the cluster's environment)",
    )
    g.add_argument(
        "--process-id",
        type=nonnegative_int,
        default=None,
        help="this process's rank in a --distributed launch (absent: from the "
        "cluster's environment)",
    )
    g.add_argument(
        "--verbose-collectives",
        action="store_true",
        help="keep the CPU collectives' (gloo) connection messages on stdout "
        "(absent: filtered out)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=positive_int,
        default=1,
        help="devices each layer's weights are split over (Megatron TP)",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=positive_int,
        default=1,
        help="pipeline stages (Megatron PP); data-parallel size = devices / (TP x PP)",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=positive_int,
        default=1,
        help="devices each MoE layer's experts are split over, carved out of the "
        "data-parallel ranks (Megatron EP)",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=positive_int,
        default=None,
        help="tensor ranks each expert's weights are split over: 1 or "
        "--tensor-model-parallel-size (absent: the latter, Megatron's default)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard layer norms and dropout over the sequence on the tensor-parallel "
        "ranks (needs TP > 1 to matter)",
    )
    g.add_argument(
        "--gradient-accumulation-fusion",
        action="store_true",
        help="accumulate weight gradients in fp32 main grads with the fused op",
    )
    g.add_argument(
        "--defer-embedding-wgrad-compute",
        action="store_true",
        help="defer the output layer's weight-gradient GEMMs of the last stage "
        "to after the pipeline schedule (needs pipeline parallelism and "
        "--gradient-accumulation-fusion)",
    )
    g.add_argument(
        "--wgrad-deferral-limit",
        type=int,
        default=0,
        help="microbatches whose output-layer wgrad is deferred (0: all)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "zb-h1"),
        default="1f1b",
        help="1f1b (Megatron's) or zb-h1 (zero bubble: weight-gradient GEMMs fill "
        "the bubbles; needs --gradient-accumulation-fusion)",
    )
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        metavar="V",
        help="model chunks per pipeline stage: Megatron's interleaved "
        "1F1B (with --pipeline-schedule zb-h1: the same order, split backwards)",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        metavar="N",
        help="the same as V = num_layers / pp / N",
    )
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        metavar="G",
        help="microbatches each virtual stage runs back "
        "to back (default: pp, and the microbatch count must be a multiple of it)",
    )
    g.add_argument(
        "--vocab-parallel-over-pipeline",
        action="store_true",
        help="split the word embedding and the output layer over all pipeline "
        "stages (and tensor ranks) instead of keeping a copy on every stage; "
        "their lookup, GEMMs and cross entropy run on every stage",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="recompute activations in the backward, per transformer layer: "
        "selective (the attention core) or full (whole layers, as "
        "--recompute-method says); absent: none (attention kept too)",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="with --recompute-granularity full (required there, as in "
        "Megatron): uniform checkpoints every group of "
        "--recompute-num-layers layers; block the first "
        "--recompute-num-layers layers of each stage (model chunk)",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="layers per recomputed group (uniform) or recomputed layers per "
        "stage (block); required with --recompute-granularity full",
    )
    g.add_argument(
        "--defer-mode",
        choices=("stash", "recompute"),
        default="stash",
        help="stash (x, dy) per deferred microbatch, or (x, logsumexp, labels) "
        "and recompute dy in the drain",
    )
    g = p.add_argument_group("gradient buffers and data-parallel sync")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard fp32 master weights and optimizer state over data ranks "
        "(reduce-scatter gradient buckets, all-gather parameters)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="sync each stage's gradient buckets in the pipeline cooldown",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per gradient bucket (only with --overlap-grad-reduce; "
        "absent: max(40M, 1M x dp), Megatron's rule)",
    )
    g.add_argument(
        "--ddp-average-in-collective",
        action="store_true",
        help="average gradients in the collective instead of pre-scaling by 1/dp",
    )
    g.add_argument(
        "--pad-buckets-for-high-nccl-busbw",
        action="store_true",
        help="pad buckets to a multiple of lcm(dp, 128, 2^16) (distributed optimizer)",
    )
    from jax_wgrad.models.gpt.presets import PRESETS

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help="a preset shape (its architecture and sizes); the flags below override it",
    )
    g.add_argument("--num-layers", type=int, default=2, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="model width")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP width (absent: 4 x --hidden-size)"
    )
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="a separate output layer instead of the word embeddings' transpose",
    )
    g.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default=model_default("normalization"),
        help="the norm layers' kind",
    )
    g.add_argument(
        "--norm-epsilon",
        type=finite_float,
        default=model_default("layernorm_epsilon"),
        help="the norms' epsilon",
    )
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default=model_default("position_embedding_type"),
        help="learned positions or rotary embeddings",
    )
    g.add_argument(
        "--rotary-base",
        type=finite_float,
        default=model_default("rotary_base"),
        help="RoPE's base (theta)",
    )
    g.add_argument(
        "--rotary-percent",
        type=finite_float,
        default=model_default("rotary_percent"),
        help="the share of each head's dims RoPE rotates",
    )
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLPs instead of GELU")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention (with --num-query-groups)",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads with --group-query-attention",
    )
    g.add_argument(
        "--disable-bias-linear", action="store_true", help="no biases in the linear layers"
    )
    g.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="a qkv bias even with --disable-bias-linear (Qwen2)",
    )
    g.add_argument("--qk-layernorm", action="store_true", help="normalize each query and key head")
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="dims per attention head (absent: hidden size / heads)",
    )
    g.add_argument(
        "--init-method-std",
        type=finite_float,
        default=model_default("init_method_std"),
        help="standard deviation of the weights' normal init",
    )
    g.add_argument(
        "--layer-scan-unroll",
        type=int,
        default=model_default("layer_scan_unroll"),
        help="layers per iteration of a stage's loop over its layers: 1 keeps "
        "compile time flat in the depth; the layers per stage unroll it "
        "(fewer GPU kernel launches, compile time grows with depth)",
    )
    g = p.add_argument_group("precision")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp32", action="store_true", help="fp32 compute (the default)")
    prec.add_argument(
        "--bf16",
        action="store_true",
        help="Megatron's --bf16: bf16 parameters, activations and GEMMs; fp32 "
        "gradient buckets and fp32 main parameters in the optimizer (only "
        "this rank's shard of them with --use-distributed-optimizer)",
    )
    g = p.add_argument_group("mixture of experts (Megatron's flags)")
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="experts per MoE layer (absent: a dense model)",
    )
    g.add_argument(
        "--moe-router-topk",
        type=int,
        default=model_default("moe_router_topk"),
        help="experts each token is routed to",
    )
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="each expert's MLP width (absent: --ffn-hidden-size)",
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        choices=("aux_loss", "none"),
        default=model_default("moe_router_load_balancing_type"),
        help="the router's load-balancing loss",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=finite_float,
        default=model_default("moe_aux_loss_coeff"),
        help="weight of the load-balancing loss",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        default=model_default("moe_token_dispatcher_type"),
        help="only alltoall is implemented",
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        type=finite_float,
        default=None,
        help="drop tokens over ceil(T k f / E) per expert (absent: dropless, the "
        "expert GEMMs over the routed tokens only)",
    )
    g.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="pad each expert's input to its capacity (required with a capacity "
        "factor: static shapes)",
    )
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="expert weight gradients by one grouped fused wgrad call per expert "
        "linear (with --gradient-accumulation-fusion)",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=positive_int,
        default=None,
        help="width of the shared experts' MLP beside the routed experts on every "
        "MoE layer (absent: no shared experts)",
    )
    g.add_argument(
        "--moe-shared-expert-overlap",
        action="store_true",
        help="let the shared experts run while the dispatcher's all-to-alls are in "
        "flight (absent: after the routed experts)",
    )
    g.add_argument(
        "--moe-layer-freq",
        type=int,
        default=model_default("moe_layer_freq"),
        help="every N-th layer is an MoE layer (layers 0, N, 2N, ...)",
    )
    g.add_argument(
        "--overlap-dispatch-backward-with-experts-wgrad",
        action="store_true",
        help="expert wgrad after the expert dgrad, independent of the dispatch "
        "all-to-all's backward (needs --moe-grouped-gemm; bitwise equal)",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="samples per microbatch and data-parallel rank",
    )
    g.add_argument("--global-batch-size", type=int, default=32, help="samples per step")
    g.add_argument(
        "--train-iters",
        type=int,
        default=40,
        help="steps to train to (counted from step 0, also when resuming)",
    )
    g.add_argument("--lr", type=nonnegative_float, default=2e-3, help="peak learning rate")
    g.add_argument(
        "--min-lr",
        type=nonnegative_float,
        default=None,
        help="cosine-decay floor (absent: constant lr after warm-up)",
    )
    g.add_argument(
        "--lr-warmup-iters",
        type=nonnegative_int,
        default=0,
        help="steps of linear warm-up from 0 to --lr",
    )
    g.add_argument(
        "--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay"
    )
    g.add_argument(
        "--clip-grad",
        type=finite_float,
        default=1.0,
        help="clip the global gradient norm to this value (0: no clipping)",
    )
    g.add_argument(
        "--seed",
        type=int_at_least(0, below=2**32),
        default=1234,
        help="initial parameters and batches (the same for every layout)",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="a text file or directory, a Megatron PREFIX (PREFIX.bin/.idx), or "
        "weighted prefixes 'w1 PREFIX1 w2 PREFIX2 ...' (absent: the Python "
        "standard library's sources)",
    )
    g.add_argument(
        "--split",
        default="98,2,0",
        help="train,validation,test proportions of every dataset (Megatron's)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="absent: bytes 256; Megatron data: largest id + 1, padded",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="pad a vocabulary sized from the data to a multiple of this",
    )
    g = p.add_argument_group("checkpointing (see below)")
    g.add_argument(
        "--save",
        default=None,
        help="save checkpoints in this directory (checked writable before the first step)",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="steps between checkpoints (a final one is always written)",
    )
    g.add_argument(
        "--load",
        default=None,
        help="resume from the newest checkpoint here; must exist unless it is also --save",
    )
    g.add_argument(
        "--load-hf",
        default=None,
        metavar="DIR",
        help="start from a Hugging Face model directory (Llama, Mistral, Qwen2, "
        "Mixtral): its config gives the model flags' defaults, its weights "
        "the initial parameters (step 0, fresh optimizer)",
    )
    g.add_argument(
        "--load-fallback-to-intact",
        action="store_true",
        help="if the newest checkpoint is damaged, load the newest intact one "
        "(absent: a damaged newest checkpoint is an error)",
    )
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="load only the parameters; the optimizer starts afresh",
    )
    g = p.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate on the validation split every this many steps (absent: never)",
    )
    g.add_argument("--eval-iters", type=int, default=10, help="validation batches per evaluation")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=5, help="steps between log lines")
    g.add_argument(
        "--metrics-file",
        default=None,
        help="JSON lines: step, loss, grad_norm, skipped, step_time_s, tokens_per_s "
        "(and valid_loss, valid_ppl); a resumed run keeps the steps up to "
        "its checkpoint",
    )
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument(
        "--profile-dir",
        default=None,
        help="write a jax.profiler trace of a few steps after compilation",
    )
    g.add_argument("--profile-steps", type=int, default=3, help="steps the profile covers")
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none when stdout is not a terminal)",
    )
    g = p.add_argument_group("compile for a GPU (no GPU needed)")
    g.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the train step of this layout for --target GPUs and run "
        "nothing: print per-device memory against the GPU's with a fits / "
        "DOES NOT FIT verdict (exit status 1 when it does not fit), the "
        "compile time and the step's structure (needs jax's CUDA plugin, "
        "no GPU: jax starts on the CPU, JAX_PLATFORMS=cpu unless set)",
    )
    g.add_argument(
        "--target",
        choices=("h100", "h200"),
        default="h100",
        help="GPU to compile for with --compile-only",
    )
    g.add_argument(
        "--target-gpus-per-host",
        "--target-gpus",
        type=positive_int,
        default=1,
        dest="target_gpus_per_host",
        help="GPUs per host",
    )
    g.add_argument("--target-hosts", type=positive_int, default=1, help="hosts")
    g.add_argument(
        "--report-json",
        default=None,
        metavar="FILE",
        help="with --compile-only: also write the report's figures (bytes per "
        "device, fits, bytes per parameter, launches and non-GEMM traffic "
        "per microbatch, fused calls, compile time) to FILE as JSON",
    )
    return p


def flag_names(parser: argparse.ArgumentParser, message: str) -> str:
    """``message`` with the config fields it names (``hidden_size``) spelled as the flags
    the user typed (``--hidden-size``); the table comes from the parser's own actions."""
    flags = {
        a.dest: a.option_strings[-1]
        for a in parser._actions
        if a.option_strings and a.option_strings[-1].startswith("--")
    }
    flags |= {field: flags[dest] for field, dest in FIELD_DESTS.items() if dest in flags}
    names = sorted((n for n in flags if "_" in n), key=len, reverse=True)  # not "lr", "load"
    if not names:
        return message
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")(?![\w])")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def usage_error(parser: argparse.ArgumentParser, exc: Exception):
    """Ends the program like argparse does (exit 2), naming flags rather than fields."""
    parser.error(flag_names(parser, str(exc)))


def virtual_stages(args: argparse.Namespace) -> int | None:
    """``V`` from ``--virtual-pipeline-model-parallel-size`` or Megatron's
    ``--num-layers-per-virtual-pipeline-stage`` (its checks and wording)."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    v = args.virtual_pipeline_model_parallel_size
    if per_chunk is None:
        return v
    if v is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage and "
            "--virtual-pipeline-model-parallel-size cannot be set at the same time"
        )
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    if per_chunk < 1 or per_stage % per_chunk:
        raise ValueError(
            f"number of layers per pipeline stage ({per_stage}) must be divisible "
            f"by number of layers per virtual pipeline stage ({per_chunk})"
        )
    return per_stage // per_chunk


def build_configs(args: argparse.Namespace, vocab_size: int, parser):
    """``(GPTConfig, ParallelConfig, DDPConfig)`` from the flags; a bad combination ends
    the program with an argparse-style error naming it."""
    from jax_wgrad import DDPConfig, GPTConfig, ParallelConfig

    try:
        model = GPTConfig(
            vocab_size=vocab_size,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            compute_dtype="bfloat16" if args.bf16 else "float32",
            params_dtype="bfloat16" if args.bf16 else "float32",
            normalization=args.normalization,
            layernorm_epsilon=args.norm_epsilon,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            swiglu=args.swiglu,
            group_query_attention=args.group_query_attention,
            num_query_groups=args.num_query_groups,
            add_bias_linear=not args.disable_bias_linear,
            add_qkv_bias=args.add_qkv_bias,
            qk_layernorm=args.qk_layernorm,
            kv_channels=args.kv_channels,
            init_method_std=args.init_method_std,
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_layer_freq=args.moe_layer_freq,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_shared_expert_overlap=args.moe_shared_expert_overlap,
            layer_scan_unroll=args.layer_scan_unroll,
            overlap_dispatch_backward_with_experts_wgrad=(
                args.overlap_dispatch_backward_with_experts_wgrad
            ),
        )
        parallel = ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            sequence_parallel=args.sequence_parallel,
            gradient_accumulation_fusion=args.gradient_accumulation_fusion,
            defer_embedding_wgrad_compute=args.defer_embedding_wgrad_compute,
            wgrad_deferral_limit=args.wgrad_deferral_limit,
            defer_mode=args.defer_mode,
            pipeline_schedule=args.pipeline_schedule,
            virtual_pipeline_model_parallel_size=virtual_stages(args),
            microbatch_group_size_per_vp_stage=(
                args.microbatch_group_size_per_virtual_pipeline_stage
            ),
            vocab_parallel_over_pipeline=args.vocab_parallel_over_pipeline,
            recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
        )
        ddp = DDPConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce,
            bucket_size=args.ddp_bucket_size,
            average_in_collective=args.ddp_average_in_collective,
            pad_buckets_for_high_nccl_busbw=args.pad_buckets_for_high_nccl_busbw,
            clip_grad=args.clip_grad,
        )
    except ValueError as exc:
        usage_error(parser, exc)
    return model, parallel, ddp


def load_data(args, parser):
    """``(train, valid, vocab size)``; a bad ``--data-path``/``--split`` is an
    argparse-style error."""
    from jax_wgrad.training.data import load_data as load
    from jax_wgrad.training.data import padded_vocab_size

    try:
        train, valid, _ = load(args.data_path, args.split)
        vocab = (
            train.vocab_size
            if getattr(train, "vocab_size", None)
            else padded_vocab_size(train.max_token_id, args.make_vocab_size_divisible_by)
        )
    except ValueError as exc:
        usage_error(parser, exc)
    if args.vocab_size is not None:
        if args.vocab_size <= train.max_token_id:
            source = (
                f"--vocab-size {args.vocab_size}"
                if "vocab_size" in getattr(args, "given_flags", {"vocab_size"})
                else f"the vocabulary of --load-hf {args.load_hf} ({args.vocab_size})"
                if args.load_hf
                else f"the --model preset's vocabulary ({args.vocab_size})"
            )
            parser.error(
                f"{source} must exceed the data's largest token id "
                f"{train.max_token_id} ({train.name})"
            )
        vocab = args.vocab_size
    if args.eval_interval and len(valid) <= args.seq_length + 1:
        parser.error(
            f"--eval-interval needs a validation split: --split {args.split!r} "
            f"leaves {len(valid)} tokens ({valid.name})"
        )
    return train, valid, vocab


def learning_rate(args: argparse.Namespace):
    """Constant, linear warm-up then constant, or warm-up + cosine decay to --min-lr."""
    import optax

    if args.min_lr is not None:
        return optax.warmup_cosine_decay_schedule(
            0.0, args.lr, max(args.lr_warmup_iters, 1), max(args.train_iters, 1), args.min_lr
        )
    if args.lr_warmup_iters:
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, args.lr, args.lr_warmup_iters),
                optax.constant_schedule(args.lr),
            ],
            [args.lr_warmup_iters],
        )
    return args.lr


def describe(plan, data, state) -> list[str]:
    """The run's log lines: devices and layout, data, buffers, model."""
    import jax
    import numpy as np

    par, model, ddp = plan.parallel, plan.model, plan.ddp
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return [
        f"devices: {jax.device_count()} x {jax.devices()[0].platform} in "
        f"{jax.process_count()} process(es) | mesh (data, expert, tensor, pipeline) = "
        f"{par.mesh_shape} | microbatches per step: {par.num_microbatches} | sequence "
        f"parallel: {par.sequence_parallel} | gradient accumulation fusion: "
        f"{par.gradient_accumulation_fusion} | schedule: {plan.table.name}"
        + (
            f" ({plan.table.num_chunks} model chunks per stage)"
            if plan.table.num_chunks > 1
            else ""
        )
        + f" | recompute: {par.recompute_granularity}"
        + (
            f" ({par.recompute_method}, {par.recompute_num_layers} layers)"
            if par.recompute_method
            else ""
        )
        + (" | vocabulary over the pipeline" if par.vocab_parallel_over_pipeline else ""),
        f"data: {data.name}, {len(data) / 1e6:.1f} M tokens for training",
        f"ddp: distributed optimizer {ddp.use_distributed_optimizer} | overlap grad reduce "
        f"{ddp.overlap_grad_reduce} | bucket size "
        f"{ddp.effective_bucket_size(par.data_parallel_size)} | average in collective "
        f"{ddp.average_in_collective} | clip grad {ddp.clip_grad}",
        plan.buffer_summary(),
        f"model: {n_params / 1e6:.2f} M parameters, {model.num_layers} layers, hidden "
        f"{model.hidden_size}, heads {model.num_attention_heads} (kv {model.query_groups}), "
        f"seq {model.seq_length}, vocab {model.vocab_size}, {model.compute_dtype}, "
        f"{model.normalization}, {model.position_embedding_type}, "
        f"{'swiglu' if model.swiglu else 'gelu'}, "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'}"
        + (
            ""
            if model.num_moe_experts is None
            else f" | MoE: {model.num_moe_experts} experts (EP {par.expert_model_parallel_size}, "
            f"ETP {par.expert_tensor_parallel_size}), top-{model.moe_router_topk}, "
            f"{sum(model.moe_layer_pattern)} MoE layers, "
            + (
                "dropless"
                if model.moe_expert_capacity_factor is None
                else f"capacity factor {model.moe_expert_capacity_factor}"
            )
            + (
                ""
                if model.moe_shared_expert_intermediate_size is None
                else f", shared experts {model.moe_shared_expert_intermediate_size}"
                + (" (overlapped)" if model.moe_shared_expert_overlap else "")
            )
            + ", overlap dispatch backward with experts wgrad "
            f"{model.overlap_dispatch_backward_with_experts_wgrad}"
        ),
    ]


def loop_options(args: argparse.Namespace):
    """The loop's :class:`LoopOptions` from the flags (raises ValueError)."""
    from jax_wgrad.training.loop import LoopOptions

    return LoopOptions(
        train_iters=args.train_iters,
        seed=args.seed,
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        save=args.save,
        save_interval=args.save_interval,
        load=args.load,
        load_optim=not args.no_load_optim,
        load_fallback=args.load_fallback_to_intact,
        profile_dir=args.profile_dir,
        profile_steps=args.profile_steps,
        progress=not args.no_progress,
    )


def apply_preset(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """``--model NAME`` or ``--load-hf DIR``: the preset's (the directory's config's)
    values become the flags' defaults, so flags given on the command line still win.
    Returns the ``dest`` of every flag the preset sets (empty without one)."""
    from jax_wgrad.models.gpt.presets import PRESETS

    known, _ = parser.parse_known_args(argv)
    if known.model is not None and known.load_hf is not None:
        parser.error("--model and --load-hf both give the model; choose one")
    if known.load_hf is not None:
        fields = hf_model_fields(parser, known.load_hf, known.seq_length)
    elif known.model is not None:
        fields = PRESETS[known.model]
    else:
        return set()
    from jax_wgrad.models.gpt.config import FLAG_NAMES, NEGATED_FLAGS

    defaults = {
        FLAG_NAMES.get(field, field): (not value) if field in NEGATED_FLAGS else value
        for field, value in fields.items()
    }
    parser.set_defaults(**defaults)
    return set(defaults)


def preset_line(
    parser: argparse.ArgumentParser, args: argparse.Namespace, preset: set[str]
) -> str | None:
    """The log line naming the model preset in use and the flags that override it
    (``None`` without ``--model``/``--load-hf``)."""
    if args.model is None and args.load_hf is None:
        return None
    source = (
        f"--model {args.model}"
        if args.model is not None
        else f"the config.json of --load-hf {args.load_hf}"
    )
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    overrides = sorted(flags[d] for d in preset & args.given_flags)
    return f"model preset: {source}" + (
        f"; overridden by {', '.join(overrides)}" if overrides else "; no flag overrides it"
    )


def hf_model_fields(parser: argparse.ArgumentParser, directory: str, seq_length: int) -> dict:
    """The ``GPTConfig`` fields of a Hugging Face directory's ``config.json`` that flags
    exist for; an unreadable or unsupported config is a usage error naming it."""
    import dataclasses

    from jax_wgrad.interop.hf import check_shards, config_from_hf, read_hf_config
    from jax_wgrad.models.gpt.config import FLAG_NAMES, RUN_OPTIONS

    try:  # the run's --seq-length (not max_position_embeddings) meets the sliding window
        cfg = config_from_hf(read_hf_config(directory), seq_length=seq_length)
        check_shards(directory)  # missing, truncated: refused before anything is built
    except ValueError as exc:
        parser.error(f"--load-hf {directory}: {exc}")
    dests = vars(parser.parse_args([]))
    # seq_length: the training sequence length is this run's choice (RoPE takes any).
    return {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in RUN_OPTIONS | {"seq_length"} and FLAG_NAMES.get(k, k) in dests
    }


def start_jax_on_cpu_to_compile_only(argv: list[str]) -> None:
    """With ``--compile-only`` (or an abbreviation argparse accepts) nothing runs on a GPU:
    ``JAX_PLATFORMS=cpu`` unless the user set it, before jax is imported. jax's CUDA
    plugin still describes and compiles for the target GPUs; without a GPU it starts only
    when jax's platforms exclude CUDA. A caller that imported jax already chose its
    platforms (``jax_wgrad.aot.target_devices`` then says what to do)."""
    import os

    if "jax" not in sys.modules and any(
        a.startswith("--com") and "--compile-only".startswith(a) for a in argv
    ):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


CUDA_PLUGINS = (
    "jax_plugins.xla_cuda13",
    "jax_plugins.xla_cuda12",
    "jax_cuda13_plugin",
    "jax_cuda12_plugin",
)
"""The modules of jax's CUDA plugin (``jax[cuda12]``, ``jax[cuda13]``)."""


def start_jax_on_cpu_without_gpu() -> None:
    """``JAX_PLATFORMS=cpu`` (unless the user set it, before jax is imported) when jax's
    CUDA plugin is installed (as the README suggests for ``--compile-only``) but this
    machine has no NVIDIA device (no ``/dev/nvidia0``..., no WSL ``/dev/dxg``): jax would
    otherwise open every CPU run with the plugin's failed-initialisation traceback."""
    import glob
    import importlib.util

    if "jax" in sys.modules or "JAX_PLATFORMS" in os.environ:
        return
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"):
        return

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    if any(installed(name) for name in CUDA_PLUGINS):
        os.environ["JAX_PLATFORMS"] = "cpu"


def check_report_json(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--report-json FILE`` needs ``--compile-only`` and a FILE that can be written, its
    directory created if missing (checked before anything is compiled, as ``--save``
    is); a one-line usage error naming the flag and the path otherwise."""

    path = args.report_json
    if path is None:
        return
    if not args.compile_only:
        parser.error(
            f"--report-json {path}: needs --compile-only (the report is of a "
            "compile for --target GPUs)"
        )
    problem = unwritable(path, directory=False)
    if problem is not None:
        parser.error(f"--report-json {path}: {problem}")


def given_flags(argv: list[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` gives explicitly (a preset's or the parser's
    default is not "given"): a parser whose defaults are all suppressed parses it."""
    bare = make_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    known, _ = bare.parse_known_args(argv)
    return set(vars(known))


CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
"""Environment variables by which ``jax.distributed.initialize`` finds its coordinator
(``jax_wgrad.initialize_distributed`` counts the same ones as a multi-process launch)."""


def partner_rules(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """``(dest, partner present, what the flag needs)`` for every flag that does nothing
    without another: given alone it would be silently ignored."""
    rope = args.position_embedding_type == "rope"
    return [
        (
            "save_interval",
            args.save is not None,
            "--save (the directory checkpoints are written to)",
        ),
        ("eval_iters", args.eval_interval is not None, "--eval-interval (absent: no evaluation)"),
        ("target", args.compile_only, "--compile-only (without it the run trains here)"),
        ("target_gpus_per_host", args.compile_only, "--compile-only"),
        ("target_hosts", args.compile_only, "--compile-only"),
        ("load_fallback_to_intact", args.load is not None, "--load"),
        ("no_load_optim", args.load is not None, "--load"),
        ("defer_mode", args.defer_embedding_wgrad_compute, "--defer-embedding-wgrad-compute"),
        ("rotary_base", rope, "--position-embedding-type rope"),
        ("rotary_percent", rope, "--position-embedding-type rope"),
        ("profile_steps", args.profile_dir is not None, "--profile-dir"),
        ("coordinator_address", args.distributed, "--distributed"),
        ("num_processes", args.distributed, "--distributed"),
        ("process_id", args.distributed, "--distributed"),
        ("verbose_collectives", args.distributed, "--distributed"),
    ]


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """The rules between flags (ranges of single flags are their argparse types; rules of
    a config are its dataclass's): a flag without the partner it needs, ``--min-lr`` above
    ``--lr``, a warm-up as long as the decay, a rank outside the launch, a ``--distributed``
    launch with no coordinator. One argparse-style line each, before anything is built."""
    import os

    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for dest, present, needs in partner_rules(args):
        if dest in given and not present:
            value = getattr(args, dest)
            shown = "" if isinstance(value, bool) else f" {value}"
            parser.error(f"{flags[dest]}{shown} needs {needs}")
    if args.min_lr is not None and args.min_lr > args.lr:  # Megatron: min_lr <= max_lr
        parser.error(f"--min-lr ({args.min_lr:g}) must be <= --lr ({args.lr:g})")
    if args.min_lr is not None and 0 < args.train_iters <= args.lr_warmup_iters:
        parser.error(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < --train-iters "
            f"({args.train_iters}), the steps of the --min-lr decay"
        )
    if args.distributed:
        if args.coordinator_address is None and not any(v in os.environ for v in CLUSTER_ENV):
            parser.error(
                "--distributed needs --coordinator-address (or "
                "JAX_COORDINATOR_ADDRESS, or a SLURM / Open MPI launch)"
            )
        if (
            args.process_id is not None
            and args.num_processes is not None
            and args.process_id >= args.num_processes
        ):
            parser.error(
                f"--process-id ({args.process_id}) must be < --num-processes ({args.num_processes})"
            )


def unwritable(path: str, directory: bool) -> str | None:
    """Why ``path`` cannot be written (a file, or a ``directory`` to write files in), its
    missing parent directories created; ``None`` when it can."""
    import os

    folder = path if directory else os.path.dirname(os.path.abspath(path))
    if not directory and os.path.isdir(path):
        return "is a directory"
    if directory and os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    if not directory and os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} is not a directory"
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
        if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(13, "the file is not writable")
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--metrics-file``, ``--tensorboard-dir`` and ``--profile-dir`` can be written,
    checked before anything is compiled or trained (as ``--save`` is)."""
    for flag, path, directory in (
        ("--metrics-file", args.metrics_file, False),
        ("--tensorboard-dir", args.tensorboard_dir, True),
        ("--profile-dir", args.profile_dir, True),
    ):
        problem = None if path is None else unwritable(path, directory)
        if problem:
            parser.error(f"{flag} {path}: {problem}")


def resume_point(argv: list[str]) -> str:
    """What an interrupted run of ``argv`` resumes from: the newest checkpoint step in its
    ``--save`` directory (else its ``--load`` one), read from the directory names alone."""
    import os

    bare = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # imports nothing:
    bare.add_argument("--save")  # an interrupted import must not be re-run here
    bare.add_argument("--load")
    try:
        args, _ = bare.parse_known_args(argv)
    except SystemExit:
        return "nothing was saved"
    for flag, directory in (("--save", args.save), ("--load", args.load)):
        if directory and os.path.isdir(directory):
            steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
            if steps:
                return (
                    f"the newest checkpoint is step {max(steps)} in {flag} {directory} "
                    f"(resume with --load {directory})"
                )
    return "no checkpoint was written" + (
        f" to --save {args.save}" if args.save else " (no --save)"
    )


def main(argv: list[str] | None = None) -> dict:
    """Runs the job of ``argv`` (default ``sys.argv[1:]``). Ctrl-C at any moment, start-up
    included, ends it with exit status 130 and one line saying what to resume from."""
    argv = sys.argv[1:] if argv is None else argv
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_interrupt(previous_hook)
    try:
        return run_job(argv)
    except KeyboardInterrupt:
        _flush_stdio()
        sys.stderr.write(f"pretrain_gpt.py: interrupted; {resume_point(argv)}\n")
        raise SystemExit(130) from None
    finally:
        sys.unraisablehook = previous_hook


def _redeliver_interrupt(previous):
    """An ``sys.unraisablehook`` that re-sends a Ctrl-C Python swallowed: the
    KeyboardInterrupt can be raised inside a callback whose exceptions are only reported
    (jax's garbage-collection callback), and the run would go on as if nothing was
    pressed. Other reports go to ``previous``. The interrupt is re-sent from a timer
    thread a moment later: sent from inside the hook it would land in the hook itself,
    where it is swallowed again."""
    import _thread
    import threading

    def hook(args) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
            timer = threading.Timer(0.05, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
        else:
            previous(args)

    return hook


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run_job(argv: list[str]) -> dict:
    """:func:`main` without its Ctrl-C handling."""
    start_jax_on_cpu_to_compile_only(argv)
    start_jax_on_cpu_without_gpu()
    parser = make_parser()
    preset = apply_preset(parser, argv)
    args = parser.parse_args(argv)
    args.given_flags = given_flags(argv)  # the flags typed (not a preset's defaults)
    args.preset_line = preset_line(parser, args, preset)
    check_flags(parser, args, args.given_flags)
    check_output_paths(parser, args)
    check_report_json(parser, args)
    from jax_wgrad.training.console import LineFilter
    from jax_wgrad.training.loop import OutOfMemoryError, check_paths

    try:
        opts = loop_options(args)
        check_paths(opts)  # before anything is built: a typo in --load, a read-only --save
    except ValueError as exc:
        usage_error(parser, exc)
    quiet = LineFilter() if args.distributed and not args.verbose_collectives else None
    try:
        return train(parser, args, opts)
    except OutOfMemoryError as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    finally:
        if quiet is not None:
            quiet.close()


def start_from_hf(parser, directory: str, plan, state):
    """``state`` with the parameters of the Hugging Face model in ``directory`` (streamed
    shard by shard) and an optimizer state for them; a run whose model differs from the
    directory's is refused with the field named."""
    import jax

    import jax_wgrad
    from jax_wgrad.interop import import_hf

    try:
        cfg, params = import_hf(directory, seq_length=plan.model.seq_length)
    except ValueError as exc:
        parser.error(f"--load-hf {directory}: {exc}")
    import dataclasses

    diff = plan.model.shape_differences(dataclasses.asdict(cfg))
    if diff:
        parser.error(
            f"--load-hf {directory}: the flags give another model: "
            + "; ".join(f"{k}={a!r} in the directory, {b!r} in this run" for k, a, b in diff)
        )
    params = jax.tree.map(
        lambda a, like: a.astype(like.dtype),  # the run's params dtype
        plan.program.from_canonical(params),
        state.params,
    )
    params = jax.device_put(params, plan.param_shardings)
    return state._replace(
        params=params, opt_state=jax_wgrad.training.init_optimizer_state(plan, params)
    )


def train(parser: argparse.ArgumentParser, args: argparse.Namespace, opts) -> dict:
    """The run of :func:`main` once the flags are checked."""
    import jax

    import jax_wgrad
    from jax_wgrad.training.gpu import apply_gpu_xla_flags
    from jax_wgrad.training.loop import (
        OutOfMemoryError,
        is_out_of_memory,
        out_of_memory_message,
        run,
    )
    from jax_wgrad.training.metrics import MetricsWriter

    if args.compile_only:  # compile for GPUs that are not here; nothing is run
        from jax_wgrad import aot

        try:  # the configs are checked against the target's GPU count
            jax_wgrad.use_virtual_cpu_devices(args.target_gpus_per_host * args.target_hosts)
        except ValueError:  # jax already started (in-process callers): checked below
            pass
        model, parallel, ddp = build_configs(args, load_data(args, parser)[2], parser)
        try:
            report = aot.compile_for_target(
                model,
                parallel,
                ddp,
                target=args.target,
                hosts=args.target_hosts,
                gpus_per_host=args.target_gpus_per_host,
                tx=jax_wgrad.default_optimizer(learning_rate(args), weight_decay=args.weight_decay),
            )
        except (RuntimeError, ValueError) as exc:  # no plugin or handler; a bad layout
            usage_error(parser, exc)
        print(report.format(), flush=True)
        if args.report_json is not None:
            import json

            with open(args.report_json, "w") as f:
                json.dump(report.figures(), f, indent=1)
                f.write("\n")
        if not report.fits:
            raise SystemExit(1)
        return {"aot": report}
    gpu_flags = apply_gpu_xla_flags()  # before jax initialises its backends
    jax_wgrad.use_virtual_cpu_devices(args.num_cpu_devices)
    if args.distributed:
        jax_wgrad.initialize_distributed(
            **{
                k: v
                for k, v in dict(
                    coordinator_address=args.coordinator_address,
                    num_processes=args.num_processes,
                    process_id=args.process_id,
                ).items()
                if v is not None
            }
        )
    is_main = jax.process_index() == 0
    log = (lambda msg: print(msg, flush=True)) if is_main else (lambda msg: None)
    train_data, valid, vocab = load_data(args, parser)
    model, parallel, ddp = build_configs(args, vocab, parser)
    optimizer = jax_wgrad.default_optimizer(learning_rate(args), weight_decay=args.weight_decay)
    try:  # the plan checks the model against the layout (the one place it is checked)
        plan = jax_wgrad.TrainPlan.create(
            model, parallel, jax_wgrad.make_mesh(parallel), optimizer, ddp=ddp
        )
    except ValueError as exc:
        usage_error(parser, exc)
    try:
        state = jax_wgrad.init_train_state(plan, args.seed)
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemoryError(out_of_memory_message(plan, None, "initialization", exc)) from None
    if args.load_hf is not None:
        state = start_from_hf(parser, args.load_hf, plan, state)
        log(f"starting from the Hugging Face model in {args.load_hf} (step 0, fresh optimizer)")
    for line in ([args.preset_line] if args.preset_line else []) + describe(
        plan, train_data, state
    ):
        log(line)
    if gpu_flags:
        log(f"XLA flags for the GPU: {' '.join(gpu_flags)}")
    metrics = MetricsWriter(
        args.metrics_file if is_main else None, args.tensorboard_dir if is_main else None
    )
    try:
        out = run(plan, state, train_data, valid, opts, metrics=metrics, log=log)
    except ValueError as exc:  # a checkpoint that is missing, damaged or of another model
        usage_error(parser, exc)
    return summarize(plan, out, log, args.train_iters)


def summarize(plan, out: dict, log, train_iters: int | None = None) -> dict:
    """The run's summary (returned by :func:`main`) and its last log line; a run with no
    step to train (a resumed checkpoint already at ``--train-iters``) says why."""
    import numpy as np

    buf, losses, times = plan.layout.buffer, out["losses"], out["times"]
    steady = times[1:] or times
    summary = {
        "compile_time_s": out["compile_time_s"],
        "steps": len(losses),
        "mean_step_time_s": float(np.mean(steady)) if steady else 0.0,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "skipped_steps": out["skipped_steps"],
        "valid": out["valid"],
        "num_buckets": buf.num_buckets,
        "buffer_numel": buf.numel,
        "grad_numel": buf.param_numel,
        "padding_fraction": (buf.numel - buf.param_numel) / buf.numel,
    }
    if losses:
        log(
            f"done: compile {summary['compile_time_s']:.2f} s | mean step "
            f"{summary['mean_step_time_s'] * 1e3:.1f} ms | loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}"
        )
    else:
        start = out.get("start_step", 0)
        log(
            "done: no training step to run"
            + (
                f": the run resumed at step {start} and --train-iters is {train_iters}; "
                f"pass a --train-iters above {start} to train on"
                if train_iters is not None and start >= train_iters and start > 0
                else f": --train-iters is {train_iters}"
                if train_iters is not None
                else ""
            )
        )
    return summary


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # a Ctrl-C re-sent (see _redeliver_interrupt) after main
        _flush_stdio()
        os._exit(130)
    except SystemExit as exc:
        if exc.code != 130:
            raise
        # Interrupted: the loop has waited for its checkpoint writes already. Leave without
        # the interpreter's finalization, which races jax's and XLA's own threads (a
        # compilation or transfer under way) and crashed with SIGSEGV.
        _flush_stdio()
        os._exit(130)
