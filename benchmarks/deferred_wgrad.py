#!/usr/bin/env python
"""Deferred output-layer wgrad: stash bytes, compiled memory and CPU step time.

For the jitted train step of :func:`jax_wgrad.build_train_step` on a (2, 2, 2)
mesh with sequence parallelism and gradient accumulation fusion, with deferral off,
``stash`` mode and ``recompute`` mode (all microbatches deferred), prints one JSON line
per (vocabulary, mode)::

    stash_bytes      per-device stash, from the schedule's traced carry
                     (jax_wgrad.parallel.pipeline.gradients.carry_shapes)
    temp_bytes       compile().memory_analysis().temp_size_in_bytes
    peak_bytes       memory_analysis().peak_memory_in_bytes where this jaxlib reports it
    step_ms          median CPU step time (8 virtual devices on this host's cores)

Run::

    python benchmarks/deferred_wgrad.py --vocab 256 8192 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

import jax_wgrad
from jax_wgrad import (
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    init_train_state,
    make_mesh,
    shard_batch,
)
from jax_wgrad.parallel.deferred import stash_bytes
from jax_wgrad.parallel.pipeline.gradients import carry_shapes

# Before the first jax computation: jax reads it when it initialises its backends.
jax_wgrad.use_virtual_cpu_devices(8)


def run(vocab: int, mode: str | None, steps: int, args) -> dict:
    model = GPTConfig(
        vocab_size=vocab,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=4,
        seq_length=args.seq_length,
    )
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        sequence_parallel=True,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=mode is not None,
        defer_mode=mode or "stash",
    )
    mesh = make_mesh(par)
    opt = default_optimizer(1e-3)
    plan = TrainPlan.create(model, par, mesh, opt)
    state = init_train_state(plan, seed=0)
    step = build_train_step(plan, state)
    rng = np.random.default_rng(0)
    batch = shard_batch(
        mesh, rng.integers(0, vocab, (par.global_batch_size, model.seq_length + 1), dtype=np.int32)
    )
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    carry = carry_shapes(plan.program, plan.sink, plan.ddp, plan.table, mesh)
    shapes = [s for stash in carry.deferred.values() for s in stash]
    return {
        "vocab": vocab,
        "mode": mode or "off",
        "M": par.num_microbatches,
        "stash_shapes": [list(s.shape) for s in shapes],
        "stash_bytes": stash_bytes(shapes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "peak_bytes": int(getattr(mem, "peak_memory_in_bytes", -1) or -1),
        "compile_s": round(compile_s, 2),
        "step_ms": round(1e3 * statistics.median(times[1:]), 1),
        "loss": float(metrics["loss"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[256, 8192])
    p.add_argument("--modes", nargs="+", default=["off", "stash", "recompute"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    args = p.parse_args()
    for vocab in args.vocab:
        for mode in args.modes:
            print(
                json.dumps(run(vocab, None if mode == "off" else mode, args.steps, args)),
                flush=True,
            )


if __name__ == "__main__":
    main()
