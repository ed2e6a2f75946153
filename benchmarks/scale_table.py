"""The scale table: the real train step of named production layouts compiled for H100s (or
H200s) without a GPU, one row per layout.

Each layout (:data:`LAYOUTS`: Llama-3-8B on 8 GPUs in several layouts, Llama-3-70B on 64,
Mixtral-8x7B on 16 and 32; ``--bf16``, fused weight-gradient accumulation, distributed
optimizer) is compiled by ``examples/pretrain_gpt.py --compile-only --report-json`` in a
subprocess of its own, one after the other, so one compile's memory is freed before the
next starts and a layout that crashes becomes a row saying so. Each row gives the
per-device memory against what jax may use of the GPU (75% by default), bytes per
parameter by category beside Megatron-LM's formula, the non-GEMM memory traffic and the
kernel launches per microbatch (the busiest pipeline stage), whether the fused calls are
in place, and the compile time::

    .venv/bin/python benchmarks/scale_table.py --list
    .venv/bin/python benchmarks/scale_table.py --only llama3-8b-tp2pp2dp2-s4k-full --target h200
    .venv/bin/python benchmarks/scale_table.py --out runs/scale.md --jsonl runs/scale.jsonl
    .venv/bin/python benchmarks/scale_table.py --from-jsonl runs/scale.jsonl  # the table again

Needs jax's CUDA plugin (``pip install "jax[cuda13]"``) and jax_wgrad built with its CUDA
handler; no GPU (the example starts jax on the CPU itself). Each compile takes 30-90 s and
several GB of host memory. The exit status is 1 when a layout failed to compile or timed
out (the table still printed, those layouts named on stderr in one line), 0 otherwise (a
layout that compiles and does not fit is a result of the table: its row says so).
"""

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
GPUS_PER_HOST = 8
"""GPUs per host of every target topology (an H100/H200 node)."""

COMMON_FLAGS: tuple[str, ...] = (
    "--bf16",
    "--gradient-accumulation-fusion",
    "--use-distributed-optimizer",
    "--sequence-parallel",
    "--micro-batch-size",
    "1",
)
"""Flags every layout gets: Megatron's usual production options."""

FULL_RECOMPUTE: tuple[str, ...] = (
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
)
"""Megatron's full activation recompute, one layer per checkpoint."""

FULL_ITERATION_GRAPHS: tuple[str, ...] = ("--cuda-graph-scope", "full_iteration")
"""The whole step as CUDA graphs (needs the layer loop unrolled: ``--layer-scan-unroll``)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One named production layout: a model preset on ``gpus`` GPUs with these flags."""

    name: str
    model: str
    """An ``examples/pretrain_gpt.py --model`` preset."""
    gpus: int
    """GPUs in all (hosts of :data:`GPUS_PER_HOST`)."""
    flags: tuple[str, ...]
    """The example's flags besides :data:`COMMON_FLAGS` (layout, sequence, batch, ...)."""
    about: str
    """What the layout is, in words."""

    def __post_init__(self) -> None:
        if self.gpus > GPUS_PER_HOST and self.gpus % GPUS_PER_HOST:
            raise ValueError(
                f"layout {self.name}: {self.gpus} GPUs are not whole hosts of {GPUS_PER_HOST}"
            )

    def argv(self, target: str) -> list[str]:
        """The example's arguments that compile this layout for ``target`` GPUs."""
        per_host = min(self.gpus, GPUS_PER_HOST)
        return [
            "--compile-only",
            "--target",
            target,
            "--target-gpus",
            str(per_host),
            "--target-hosts",
            str(self.gpus // per_host),
            "--model",
            self.model,
            *COMMON_FLAGS,
            *self.flags,
        ]


PRECISION_AWARE: tuple[str, ...] = (
    "--use-precision-aware-optimizer",
    "--exp-avg-dtype",
    "bf16",
    "--exp-avg-sq-dtype",
    "bf16",
)
"""Megatron's precision-aware optimizer with bf16 moments (and, with --bf16, parameter
remainders): 6 bytes of optimizer state a parameter instead of 12 over the expert-DP size."""


QWEN2_57B_A14B: tuple[str, ...] = (
    *("--num-layers", "28", "--hidden-size", "3584", "--num-attention-heads", "28"),
    *("--num-query-groups", "4", "--kv-channels", "128", "--ffn-hidden-size", "18944"),
    *("--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2560"),
    *("--moe-shared-expert-intermediate-size", "20480", "--vocab-size", "151936"),
    *("--add-qkv-bias", "--rotary-base", "1000000"),
)
"""Qwen2-57B-A14B's shapes (Hugging Face ``Qwen/Qwen2-57B-A14B``'s config) over the Mixtral
preset's architecture (RMSNorm, SwiGLU, RoPE, untied): the model Megatron-Core's MoE
parallel-folding paper reports 39.0% MFU for on H100s. Its shared expert's sigmoid gate is
not built here (a ``[H] -> 1`` projection: negligible FLOPs)."""

FP8: tuple[str, ...] = ("--fp8-format", "hybrid")
"""Megatron's FP8 training (hybrid: E4M3 inputs and weights, E5M2 output gradients) with
per-tensor current scaling: the forward, data- and weight-gradient GEMMs of the layers'
linears in FP8, the weight gradients fused into the fp32 buckets."""

MOE_BEST: tuple[str, ...] = ("--moe-dropless-buffer-factor", "1.25", "--moe-permute-fusion")
"""Dropless receive buffers of 1.25 T k rows, permutations that gather both ways."""


def _tp_pp(tp: int, pp: int = 1, ep: int = 1) -> tuple[str, ...]:
    out = ("--tensor-model-parallel-size", str(tp))
    if pp > 1:
        out += ("--pipeline-model-parallel-size", str(pp))
    if ep > 1:
        out += ("--expert-model-parallel-size", str(ep), "--moe-grouped-gemm")
    return out


def _cp(cp: int) -> tuple[str, ...]:
    return ("--context-parallel-size", str(cp))


def _seq(seq: int, global_batch: int) -> tuple[str, ...]:
    return ("--seq-length", str(seq), "--global-batch-size", str(global_batch))


MIXTRAL_BEST: tuple[str, ...] = (
    _tp_pp(2, 4, 8)
    + _seq(4096, 256)
    + ("--overlap-grad-reduce",)
    + MOE_BEST
    + ("--num-layers-per-virtual-pipeline-stage", "4", "--pipeline-schedule", "1f1b-paired")
)
"""The best Mixtral-8x7B layout found on 64 H100s (docs/moe.md, where the time goes)."""

LAYOUTS: tuple[Layout, ...] = (
    Layout(
        "llama3-8b-tp2pp2dp2-s4k",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute"),
        "TP2 PP2 DP2, seq 4096, no recompute, output-layer wgrad deferred",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-paired",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute")
        + ("--pipeline-schedule", "1f1b-paired"),
        "the first row with paired 1F1B ticks (a backward and a forward per tick)",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-paired-groups",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute")
        + ("--pipeline-schedule", "1f1b-paired", "--overlap-grad-reduce-in-backward"),
        "the paired row with the layer groups' sync in the last backward",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-paired-graphs",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute")
        + ("--pipeline-schedule", "1f1b-paired")
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "16"),
        "the paired row as CUDA graphs with conditional and while nodes (layers unrolled)",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-paired-groups-graphs",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute")
        + ("--pipeline-schedule", "1f1b-paired", "--overlap-grad-reduce-in-backward")
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "16"),
        "the paired row with layer groups and as CUDA graphs (sync overlapped, no host sync)",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-vp2-paired",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 16)
        + ("--overlap-grad-reduce", "--defer-embedding-wgrad-compute")
        + ("--num-layers-per-virtual-pipeline-stage", "8", "--pipeline-schedule", "1f1b-paired"),
        "the first row interleaved (2 model chunks of 8 layers per stage) with paired ticks",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-gb64-paired",
        "llama3-8b",
        8,
        _tp_pp(2, 2)
        + _seq(4096, 64)
        + ("--overlap-grad-reduce", "--pipeline-schedule", "1f1b-paired"),
        "TP2 PP2 DP2, seq 4096, global batch 64, no recompute, paired 1F1B ticks",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s4k-full",
        "llama3-8b",
        8,
        _tp_pp(2, 2) + _seq(4096, 16) + ("--overlap-grad-reduce",) + FULL_RECOMPUTE,
        "TP2 PP2 DP2, seq 4096, full recompute",
    ),
    Layout(
        "llama3-8b-tp2pp2dp2-s8k-full",
        "llama3-8b",
        8,
        _tp_pp(2, 2) + _seq(8192, 16) + ("--overlap-grad-reduce",) + FULL_RECOMPUTE,
        "TP2 PP2 DP2, seq 8192, full recompute",
    ),
    Layout(
        "llama3-8b-tp4dp2-s8k",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective"),
        "TP4 DP2, seq 8192, selective recompute, grad reduce per bucket",
    ),
    Layout(
        "llama3-8b-tp4dp2-s8k-groups",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + ("--overlap-grad-reduce-in-backward",),
        "the TP4 DP2 row with the layer groups' sync in the last backward",
    ),
    Layout(
        "llama3-8b-tp4dp2-s8k-graphs",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32"),
        "the TP4 DP2 row as CUDA graphs with conditional and while nodes (layers unrolled)",
    ),
    Layout(
        "llama3-8b-tp4dp2-s8k-groups-graphs",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + ("--overlap-grad-reduce-in-backward",)
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32"),
        "the TP4 DP2 row with layer groups and as CUDA graphs",
    ),
    Layout(
        "llama3-8b-tp2dp4-s4k",
        "llama3-8b",
        8,
        _tp_pp(2) + _seq(4096, 16) + ("--overlap-grad-reduce",),
        "TP2 DP4, seq 4096, no recompute, grad reduce per bucket",
    ),
    Layout(
        "llama3-8b-tp2dp4-s8k-graphs",
        "llama3-8b",
        8,
        _tp_pp(2)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32"),
        "TP2 DP4, seq 8192, selective recompute, as CUDA graphs (layers unrolled)",
    ),
    Layout(
        "llama3-8b-fp8",
        "llama3-8b",
        8,
        _tp_pp(2)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32")
        + FP8,
        "the best FP8 layout found: llama3-8b-tp2dp4-s8k-graphs with FP8 (hybrid, "
        "per-tensor current scaling) in the layers' linears",
    ),
    Layout(
        "llama3-8b-tp4dp2-s8k-fp8",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _seq(8192, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + FP8,
        "llama3-8b-tp4dp2-s8k with FP8 (hybrid) in the layers' linears",
    ),
    Layout(
        "llama3-8b-s8k-cp2",
        "llama3-8b",
        8,
        _tp_pp(1)
        + _cp(2)
        + _seq(8192, 128)
        + ("--overlap-grad-reduce",)
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32"),
        "NeMo's Llama-3-8B recipe: TP1 PP1 CP2 DP4, seq 8192, global batch 128, no "
        "recompute; ring attention with cuDNN blocks, as CUDA graphs",
    ),
    Layout(
        "llama3-8b-tp2cp2-s8k",
        "llama3-8b",
        8,
        _tp_pp(2)
        + _cp(2)
        + _seq(8192, 128)
        + ("--overlap-grad-reduce",)
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "32"),
        "the CP2 row with TP2 (DP2): what fits jax's 75% of the GPU",
    ),
    Layout(
        "llama3-8b-s32k-cp",
        "llama3-8b",
        8,
        _tp_pp(4)
        + _cp(2)
        + _seq(32768, 16)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective"),
        "seq 32768: TP4 CP2 (ring attention, cuDNN blocks), selective recompute",
    ),
    Layout(
        "llama3-8b-s128k-cp",
        "llama3-8b",
        16,
        _tp_pp(2)
        + _cp(8)
        + _seq(131072, 8)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective"),
        "seq 131072 on 2 hosts: TP2 CP8 (ring attention, cuDNN blocks), selective recompute",
    ),
    Layout(
        "llama3-70b-tp8pp4dp2-s4k-full",
        "llama3-70b",
        64,
        _tp_pp(8, 4) + _seq(4096, 32) + ("--overlap-grad-reduce",) + FULL_RECOMPUTE,
        "TP8 PP4 DP2 on 8 hosts, seq 4096, full recompute",
    ),
    Layout(
        "llama3-70b-tp8pp4dp2-s4k-full-groups",
        "llama3-70b",
        64,
        _tp_pp(8, 4)
        + _seq(4096, 32)
        + ("--overlap-grad-reduce", "--overlap-grad-reduce-in-backward")
        + FULL_RECOMPUTE,
        "the 70B row with the layer groups' sync (over the network) in the last backward",
    ),
    Layout(
        "llama3-70b-tp8pp4dp2-s4k-full-graphs",
        "llama3-70b",
        64,
        _tp_pp(8, 4)
        + _seq(4096, 32)
        + ("--overlap-grad-reduce",)
        + FULL_RECOMPUTE
        + FULL_ITERATION_GRAPHS
        + ("--layer-scan-unroll", "20"),
        "the 70B row as CUDA graphs with conditional and while nodes (layers unrolled)",
    ),
    Layout(
        "llama3-70b-nemo",
        "llama3-70b",
        64,
        _tp_pp(4, 4)
        + _cp(2)
        + ("--num-layers-per-virtual-pipeline-stage", "4")
        + _seq(8192, 128)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + ("--pipeline-schedule", "1f1b-paired"),
        "NeMo's Llama-3-70B layout on 64 H100s (its recommended H100 config): TP4 PP4 CP2 "
        "VP5 DP2, seq 8192, global batch 128, with selective recompute (NeMo's has none: "
        "without, the step needs 61.2 GiB, over jax's 75%) and paired ticks",
    ),
    Layout(
        "llama3-70b-tp8pp4vp5-s8k-paired",
        "llama3-70b",
        64,
        _tp_pp(8, 4)
        + ("--num-layers-per-virtual-pipeline-stage", "4")
        + _seq(8192, 128)
        + ("--overlap-grad-reduce", "--pipeline-schedule", "1f1b-paired"),
        "the best 70B layout found at NeMo's sizes: llama3-70b-nemo with TP8 in place of "
        "TP4 x CP2 (the 8 GPUs of a host split each sequence either way) and paired ticks: "
        "TP8 PP4 VP5 DP2, no recompute",
    ),
    Layout(
        "llama3-70b-fp8",
        "llama3-70b",
        64,
        _tp_pp(8, 4)
        + ("--num-layers-per-virtual-pipeline-stage", "4")
        + _seq(8192, 128)
        + ("--overlap-grad-reduce", "--pipeline-schedule", "1f1b-paired")
        + FP8,
        "llama3-70b-tp8pp4vp5-s8k-paired with FP8 (hybrid) in the layers' linears",
    ),
    Layout(
        "mixtral-8x7b-tp2pp2ep4-s4k-full",
        "mixtral-8x7b",
        16,
        _tp_pp(2, 2, 4) + _seq(4096, 32) + ("--overlap-grad-reduce",) + FULL_RECOMPUTE,
        "TP2 PP2 EP4 (DP4) on 2 hosts, seq 4096, dropless, full recompute",
    ),
    Layout(
        "mixtral-8x7b-tp2pp4ep4-s4k-full",
        "mixtral-8x7b",
        32,
        _tp_pp(2, 4, 4) + _seq(4096, 32) + ("--overlap-grad-reduce",) + FULL_RECOMPUTE,
        "TP2 PP4 EP4 (DP4) on 4 hosts, seq 4096, dropless, full recompute",
    ),
    Layout(
        "mixtral-8x7b-best",
        "mixtral-8x7b",
        64,
        MIXTRAL_BEST,
        "the best layout found on 64 GPUs: TP2 PP4 EP8 (DP8, expert-DP 1), two model chunks "
        "a stage, paired 1F1B ticks, seq 4096, global batch 256, receive buffers 1.25 T k, "
        "fused permutations, no recompute",
    ),
    Layout(
        "mixtral-8x7b-best-graphs",
        "mixtral-8x7b",
        64,
        MIXTRAL_BEST + FULL_ITERATION_GRAPHS + ("--layer-scan-unroll", "4"),
        "the mixtral-8x7b-best row as CUDA graphs (layers unrolled): no host sync",
    ),
    Layout(
        "qwen2-57b-a14b-shapes",
        "mixtral-8x7b",
        64,
        QWEN2_57B_A14B
        + _tp_pp(2, 4, 16)
        + ("--expert-tensor-parallel-size", "1")
        + _seq(4096, 256)
        + ("--overlap-grad-reduce", "--pipeline-schedule", "1f1b-paired")
        + MOE_BEST
        + FULL_RECOMPUTE,
        "fine-grained experts with a shared one: Qwen2-57B-A14B's shapes (64 experts of 2560, "
        "top-8, a shared expert of 20480; no shared-expert gate) on 64 GPUs, TP2 attention, "
        "PP4, DP8; experts ETP1 EP16 folded over (expert 8, tensor 2) (Megatron's parallel "
        "folding), paired 1F1B ticks, seq 4096, global batch 256, receive buffers 1.25 T k, "
        "fused permutations, full recompute",
    ),
    Layout(
        "qwen3-30b-a3b-8gpu",
        "qwen3-30b-a3b",
        8,
        _tp_pp(1, 1, 8)
        + _seq(4096, 32)
        + ("--overlap-grad-reduce",)
        + MOE_BEST
        + FULL_RECOMPUTE
        + PRECISION_AWARE,
        "EP8 (DP8) on one host, seq 4096, receive buffers 1.25 T k, fused permutations, full "
        "recompute, precision-aware optimizer (bf16 moments, parameter remainders)",
    ),
    Layout(
        "qwen3-30b-a3b-best",
        "qwen3-30b-a3b",
        16,
        _tp_pp(1, 1, 16)
        + _seq(4096, 256)
        + ("--overlap-grad-reduce", "--recompute-granularity", "selective")
        + MOE_BEST
        + PRECISION_AWARE,
        "the best layout found on at most 16 GPUs: EP16 (DP16, expert-DP 1) on 2 hosts, seq "
        "4096, global batch 256, receive buffers 1.25 T k, fused permutations, selective "
        "recompute, precision-aware optimizer",
    ),
)
"""The layouts of the table, by name."""

BY_NAME: dict[str, Layout] = {layout.name: layout for layout in LAYOUTS}


def command(layout: Layout, target: str, python: str = ".venv/bin/python") -> str:
    """The shell command that compiles ``layout`` (what a row reports)."""
    return shlex.join([python, "examples/pretrain_gpt.py", *layout.argv(target)])


def run_layout(
    layout: Layout,
    target: str = "h100",
    *,
    timeout: float = 1800.0,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Compiles ``layout`` in a subprocess of the example and returns its row: ``name``,
    ``about``, ``gpus``, ``command``, ``wall_s``, ``status`` (``"fits"``, ``"does not
    fit"``, ``"failed"`` or ``"timed out"``) and, when the compile finished, the report's
    figures (``--report-json``); otherwise ``error``, the last line the example printed
    to stderr (or stdout)."""
    row: dict[str, Any] = {
        "name": layout.name,
        "about": layout.about,
        "gpus": layout.gpus,
        "target": target,
        "command": command(layout, target),
    }
    with tempfile.TemporaryDirectory(prefix="scale_table_") as tmp:
        report = os.path.join(tmp, "report.json")
        argv = [python, str(EXAMPLE), *layout.argv(target), "--report-json", report]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired:
            row.update(
                status="timed out",
                wall_s=time.perf_counter() - start,
                error=f"no report after {timeout:.0f} s",
            )
            return row
        row["wall_s"] = time.perf_counter() - start
        if os.path.exists(report):
            with open(report) as f:
                figures = json.load(f)
            row.update(figures, status="fits" if figures["fits"] else "does not fit")
            return row
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    row.update(
        status="failed",
        returncode=proc.returncode,
        error=lines[-1].strip() if lines else f"exit status {proc.returncode}",
    )
    return row


# ---------------------------------------------------------------------------- the table

_GiB = float(1 << 30)

COLUMNS: tuple[str, ...] = (
    "layout",
    "GPUs",
    "mesh (DP/EP, EP, CP, TP, PP)",
    "peak / budget per GPU",
    "fits",
    "bytes/param: params + grads + optimizer (Megatron)",
    "non-GEMM traffic / µbatch",
    "launches / µbatch",
    "host syncs / step",
    "estimated step (MFU)",
    "DP sync",
    "fused calls in place",
    "compile",
)
"""The Markdown table's columns."""


def _cells(row: dict[str, Any]) -> list[str]:
    """One row's cells (:data:`COLUMNS`)."""
    head = [f"`{row['name']}`", str(row["gpus"])]
    if row["status"] in ("failed", "timed out"):
        error = str(row.get("error", "")).replace("|", "\\|")
        return head + ["—"] * 3 + [f"**{row['status']}**: {error}"] + [""] * (len(COLUMNS) - 6)
    peak, budget = row["peak_bytes"] / _GiB, row["budget_bytes"] / _GiB
    fits = (
        f"yes ({budget - peak:.1f} GiB spare)"
        if row["fits"]
        else f"**no** (over by {peak - budget:.1f} GiB)"
    )
    got, megatron = row["bytes_per_param"], row["megatron_bytes_per_param"]
    bpp = (
        f"{got['params']:.2f} + {got['grads']:.2f} + {got['optimizer']:.2f} = "
        f"{got['total']:.1f} ({megatron['params']:.0f} + {megatron['grads']:.0f} + "
        f"{megatron['optimizer']:.2f} = {megatron['total']:.1f})"
    )
    traffic = row.get("non_gemm_bytes_per_microbatch")
    bandwidth = row.get("memory_bandwidth_bytes_per_s") or 0
    traffic_cell = (
        "—"
        if traffic is None
        else (
            f"{traffic / 1e9:.1f} GB"
            + (f" ({traffic / bandwidth * 1e3:.1f} ms)" if bandwidth else "")
        )
    )
    launches = row.get("launches_per_microbatch")
    copies = len(row.get("loop_bucket_ops", []))
    in_place = f"{row['fused_aliased']}/{row['fused_calls']}" + (
        "" if not copies else f"; **{copies} bucket-sized ops per tick**"
    )
    syncs, ms, mfu = (
        row.get(k) for k in ("host_syncs_per_step", "estimated_step_ms", "estimated_mfu")
    )
    overlap = row.get("dp_sync_overlapped")
    return head + [
        ", ".join(map(str, row["mesh_shape"])),
        f"{peak:.1f} / {budget:.1f} GiB",
        fits,
        bpp,
        traffic_cell,
        "—" if launches is None else f"{launches:.0f}",
        "—" if syncs is None else f"{syncs:.0f}",
        "—" if ms is None else f"{ms:.0f} ms" + ("" if mfu is None else f" ({mfu:.1%})"),
        "—" if overlap is None else "overlapped" if overlap else "exposed",
        in_place,
        f"{row['compile_s']:.0f} s",
    ]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows (from :func:`run_layout`) as a Markdown table, one line per layout."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def provenance(target: str) -> str:
    """One line: the target, the date, and the commit the table was made at (and whether
    the working tree had changes)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = (
        " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    )
    return (
        f"Compiled for {target.upper()} with `benchmarks/scale_table.py` on "
        f"{time.strftime('%Y-%m-%d')} at commit {commit}{dirty}; common flags: "
        f"`{' '.join(COMMON_FLAGS)}`."
    )


def legend() -> str:
    """What the columns mean (printed under the table)."""
    return (
        "Peak: XLA's per-device peak (arguments + temporaries + outputs not aliased); budget:"
        " the share of the GPU's memory jax's allocator may use "
        "(`XLA_PYTHON_CLIENT_MEM_FRACTION`, default 75%); a real GPU adds the CUDA context, "
        "cuBLAS/cuDNN workspaces and NCCL buffers (roughly 1-3 GiB). Bytes per parameter: "
        "one device's parameter, gradient-bucket and optimizer-state bytes over the "
        "parameters it holds; Megatron-LM's figures in parentheses (bf16 params: 2 + 4 + "
        "12/DP with the distributed optimizer). Non-GEMM traffic: bytes read + written per "
        "microbatch by the busiest pipeline stage's kernels in the schedule loop other than "
        "GEMMs and custom calls (fusions, copies, zero-fills, dynamic-update-slices), and "
        "the time that takes at the GPU's memory bandwidth. Launches: kernel launches per "
        "microbatch (a CUDA graph counts as one). Host syncs: conditionals and loops of "
        "unknown trip count XLA:GPU runs on the host, per step. Estimated step: "
        "`jax_wgrad.aot.estimate`'s roofline of the compiled step (per kernel max(FLOPs / "
        "peak, bytes / bandwidth), collectives over NVLink or the network, exposed unless "
        "GEMM-class work runs between start and done; not a measurement: it ran 7-17% below "
        "steps measured on an H100 and an H200, docs/performance.md) and the MFU it implies "
        "(Megatron's model FLOPs). DP sync: whether the data-parallel gradient collectives "
        "are hidden behind GEMM-class work in that estimate. Fused calls in place: the fused "
        "wgrad and bucket-add custom calls whose output aliases the bucket, of all of them. "
        "Compile: "
        "XLA's compile time on the machine that made the table (no GEMM autotuning without "
        "a GPU)."
    )


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the layouts and exit")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        default=None,
        help="compile only these layouts (names from --list)",
    )
    p.add_argument("--target", choices=("h100", "h200"), default="h100", help="GPU to compile for")
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds one layout's compile may take before its row says so",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="also write the table here")
    p.add_argument(
        "--jsonl",
        default=None,
        metavar="FILE",
        help="write each layout's row (the report's figures) as a JSON line here",
    )
    p.add_argument(
        "--from-jsonl",
        default=None,
        metavar="FILE",
        help="compile nothing: the table of the rows a --jsonl run wrote",
    )
    return p


def main(
    argv: list[str] | None = None, *, run: Callable[..., dict[str, Any]] = run_layout
) -> list[dict[str, Any]]:
    """The command line (see the module docstring); returns the rows."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.list:
        for layout in LAYOUTS:
            print(
                f"{layout.name:34} {layout.gpus:3} GPUs  {layout.about}\n"
                f"{'':34} {command(layout, args.target)}"
            )
        return []
    unknown = sorted(set(args.only or ()) - set(BY_NAME))
    if unknown:
        parser.error(f"--only: unknown layout {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    for flag, path in (("--out", args.out), ("--jsonl", args.jsonl)):
        if path:  # before any compile: the folder made, a file that cannot be is an error
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "a"):
                    pass
            except OSError as exc:
                parser.error(f"{flag} {path}: cannot write there ({exc.strerror or exc})")
    if args.from_jsonl is not None:
        try:
            with open(args.from_jsonl) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as exc:
            parser.error(f"--from-jsonl {args.from_jsonl}: {exc}")
        if args.only:
            rows = [r for r in rows if r["name"] in args.only]
        made = rows[0].get("provenance", "") if rows else ""
    else:
        made = provenance(args.target)
        layouts = [layout for layout in LAYOUTS if not args.only or layout.name in args.only]
        rows = []
        for i, layout in enumerate(layouts, 1):
            print(
                f"[{i}/{len(layouts)}] {layout.name}: {command(layout, args.target)}",
                file=sys.stderr,
                flush=True,
            )
            row = {**run(layout, args.target, timeout=args.timeout), "provenance": made}
            print(
                f"    {row['status']} ({row['wall_s']:.0f} s)"
                + (f": {row['error']}" if "error" in row else ""),
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
            if args.jsonl:  # written as it goes: a long run keeps what it has
                _write(args.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
    text = "\n\n".join([made, markdown_table(rows), legend()]) + "\n"
    print(text, end="")
    _write(args.out, text)
    bad = failed_rows(rows)
    if bad:
        print(
            f"{parser.prog}: {len(bad)} of {len(rows)} layouts failed: "
            + "; ".join(
                f"{r['name']} ({r['status']}" + (f": {r['error']})" if r.get("error") else ")")
                for r in bad
            ),
            file=sys.stderr,
            flush=True,
        )
    return rows


def failed_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose layout did not compile (``"failed"``, ``"timed out"``): the command
    line's exit status is 1 when there is one (``"does not fit"`` is a compiled layout's
    verdict, a result)."""
    return [r for r in rows if r.get("status") in ("failed", "timed out")]


if __name__ == "__main__":
    sys.exit(1 if failed_rows(main()) else 0)
