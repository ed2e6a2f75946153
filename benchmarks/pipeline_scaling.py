#!/usr/bin/env python
"""How the one-program 1F1B train step scales with the number of microbatches M.

Measures, for the jitted train step of :func:`jax_wgrad.build_train_step`:

* ``memory``: ``compile().memory_analysis().temp_size_in_bytes`` at M = 4 and 32 (pp = 4),
  for ``--pipeline-schedule`` and ``--recompute-granularity``.
* ``compile``: lower + compile time at several M (pp = 4).
* ``step``: CPU step time of two layouts at the same global batch.

Run (8 virtual CPU devices are set up here; no argument runs all three)::

    python benchmarks/pipeline_scaling.py memory compile step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

import jax_wgrad
from jax_wgrad import (
    ByteDataset,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    init_train_state,
    make_mesh,
    shard_batch,
)

# Before the first jax computation: jax reads it when it initialises its backends.
jax_wgrad.use_virtual_cpu_devices(8)

SCHEDULE = {
    "pipeline_schedule": "1f1b",
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
}
"""Set from --pipeline-schedule and the --recompute-* flags."""


def _setup(model, dp_tp_pp, mbs, m, fusion=False, sp=False):
    dp, tp, pp = dp_tp_pp
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=mbs,
        global_batch_size=mbs * dp * m,
        sequence_parallel=sp,
        gradient_accumulation_fusion=fusion,
        **SCHEDULE,
    )
    mesh = make_mesh(par)
    opt = default_optimizer(1e-3)
    plan = TrainPlan.create(model, par, mesh, opt)
    state = init_train_state(plan, seed=0)
    step = build_train_step(plan, state)
    tokens = np.zeros((par.global_batch_size, model.seq_length + 1), np.int32)
    return par, mesh, state, step, shard_batch(mesh, tokens)


def memory(model, layout, ms, mbs, fusion):
    out = {}
    for m in ms:
        _, _, state, step, batch = _setup(model, layout, mbs, m, fusion)
        mem = step.lower(state, batch).compile().memory_analysis()
        out[m] = {
            "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
        }
        print(
            f"memory  M={m:3d}: temp {mem.temp_size_in_bytes / 2**20:8.2f} MiB, "
            f"arguments {mem.argument_size_in_bytes / 2**20:8.2f} MiB",
            flush=True,
        )
    return out


def compile_time(model, layout, ms, mbs, fusion, repeats=5):
    """Lower + compile, interleaving the M values so machine drift hits them alike."""
    setups = {m: _setup(model, layout, mbs, m, fusion) for m in ms}
    times = {m: [] for m in ms}
    for _ in range(repeats):
        for m in ms:
            _, _, state, step, batch = setups[m]
            jax.clear_caches()
            t0 = time.perf_counter()
            step.lower(state, batch).compile()
            times[m].append(time.perf_counter() - t0)
    out = {}
    for m in ms:
        out[m] = {
            "median_s": statistics.median(times[m]),
            "min_s": min(times[m]),
            "all_s": times[m],
        }
        print(
            f"compile M={m:3d}: median {statistics.median(times[m]):.2f} s, "
            f"min {min(times[m]):.2f} s of {[round(t, 2) for t in times[m]]}",
            flush=True,
        )
    return out


def step_time(model, layouts, global_batch, mbs, fusion, sp, iters):
    """Median step time per layout; steps of the layouts alternate, so background load
    on a shared machine hits them alike."""
    data = ByteDataset.from_stdlib()
    runs = {}
    for layout in layouts:
        m = global_batch // (mbs * layout[0])
        _, mesh, state, step, _ = _setup(model, layout, mbs, m, fusion, sp and layout[1] > 1)
        compiled = step.lower(
            state, shard_batch(mesh, data.batch(0, global_batch, model.seq_length, 0))
        ).compile()
        runs[layout] = {"M": m, "mesh": mesh, "state": state, "fn": compiled, "times": []}
    for i in range(iters + 2):
        for r in runs.values():
            batch = shard_batch(r["mesh"], data.batch(i, global_batch, model.seq_length, 0))
            t0 = time.perf_counter()
            r["state"], metrics = r["fn"](r["state"], batch)
            jax.block_until_ready(metrics)
            if i >= 2:
                r["times"].append(time.perf_counter() - t0)
    out = {}
    for layout, r in runs.items():
        times = r["times"]
        out["x".join(map(str, layout))] = {
            "M": r["M"],
            "median_step_s": statistics.median(times),
            "min_step_s": min(times),
            "mean_step_s": statistics.fmean(times),
        }
        print(
            f"step    (dp,tp,pp)={layout} M={r['M']}: median "
            f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms",
            flush=True,
        )
    return out


WHAT = ("memory", "compile", "step")


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "what",
        nargs="*",
        metavar="{memory,compile,step}",
        help="what to measure (absent: all three)",
    )
    p.add_argument("--layout", default="2,1,4", help="(dp,tp,pp) for memory/compile")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=64, help="for step")
    p.add_argument("--gradient-accumulation-fusion", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--pipeline-schedule", choices=("1f1b", "zb-h1"), default="1f1b")
    p.add_argument("--recompute-granularity", choices=("none", "full", "selective"), default="none")
    p.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="Megatron's, required with --recompute-granularity full",
    )
    p.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="Megatron's, required with --recompute-granularity full",
    )
    p.add_argument(
        "--step-layouts",
        default="8,1,1;2,2,2",
        help="(dp,tp,pp) layouts for step, ';'-separated; the first is the baseline",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    unknown = [w for w in args.what if w not in WHAT]
    if unknown:  # not choices=: argparse rejects an empty list for nargs="*" with choices
        p.error(f"argument what: invalid choice: {unknown[0]!r} (choose from {', '.join(WHAT)})")
    args.what = args.what or list(WHAT)
    SCHEDULE.update(
        pipeline_schedule=args.pipeline_schedule,
        recompute_granularity=None
        if args.recompute_granularity == "none"
        else args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    model = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
    )
    layout = tuple(int(x) for x in args.layout.split(","))
    fusion = args.gradient_accumulation_fusion
    results = {
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu_cores": os.cpu_count(),
        "model": vars(model) | {},
        "layout": layout,
        **SCHEDULE,
    }
    if "memory" in args.what:
        results["memory"] = memory(model, layout, [4, 32], args.micro_batch_size, fusion)
        r = results["memory"]
        print(f"temp ratio M=32 / M=4: {r[32]['temp_bytes'] / r[4]['temp_bytes']:.3f}")
    if "compile" in args.what:
        results["compile"] = compile_time(model, layout, [4, 32], args.micro_batch_size, fusion)
        r = results["compile"]
        print(f"compile ratio M=32 / M=4: {r[32]['median_s'] / r[4]['median_s']:.3f}")
    if "step" in args.what:
        layouts = [tuple(int(x) for x in lay.split(",")) for lay in args.step_layouts.split(";")]
        results["step"] = step_time(
            model,
            layouts,
            args.global_batch_size,
            args.micro_batch_size,
            fusion,
            args.sequence_parallel,
            args.iters,
        )
        r = list(results["step"].items())
        for key, v in r[1:]:
            print(
                f"step ratio {key} / {r[0][0]}: {v['median_step_s'] / r[0][1]['median_step_s']:.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
