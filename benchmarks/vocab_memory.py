#!/usr/bin/env python
"""Per-device memory of a 128K-vocabulary model on (data 1, tensor 1, pipeline 4), with and
without the vocabulary over the pipeline.

Builds the train plan on 4 CPU devices, traces the train state (no arrays are made) and
compiles the real train step; prints one JSON line per mode: per-device bytes of the
parameters, the optimizer state (fp32 master + Adam moments; bucket shards with the
distributed optimizer), the gradient buckets, the embedding + output layer's share of the
parameters, and the compiled step's ``memory_analysis()`` (arguments, outputs, temporaries)::

    python benchmarks/vocab_memory.py                # CPU (4 virtual devices)

The GPU figures come from the example's deviceless compile for 4 H100s
(``--compile-only --target h100 --target-gpus 4``, see ``docs/compile_only.md``) with the
same model flags.
"""

from __future__ import annotations

import argparse
import json
import os

MODEL = dict(
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=8,
    seq_length=256,
    vocab_size=131072,
    untie_embeddings_and_output_weights=True,
)


def measure(vocab_over_pipeline: bool, dist: bool) -> dict:
    import jax
    import numpy as np

    from jax_wgrad import (
        DDPConfig,
        GPTConfig,
        ParallelConfig,
        TrainPlan,
        default_optimizer,
        make_mesh,
    )
    from jax_wgrad.aot.compile import abstract_train_state
    from jax_wgrad.parallel.mesh import DATA_PARALLEL
    from jax_wgrad.training.step import build_train_step

    par = ParallelConfig(
        pipeline_model_parallel_size=4,
        micro_batch_size=1,
        global_batch_size=4,
        world_size=4,
        vocab_parallel_over_pipeline=vocab_over_pipeline,
    )
    plan = TrainPlan.create(
        GPTConfig(**MODEL),
        par,
        make_mesh(par),
        default_optimizer(1e-4),
        ddp=DDPConfig(use_distributed_optimizer=dist),
    )
    state = abstract_train_state(plan)

    def per_device(tree, leading_device_axis=False) -> int:
        total = 0
        for a in jax.tree.leaves(tree):
            shape = a.sharding.shard_shape(a.shape)
            total += int(np.prod(shape[1:] if leading_device_axis else shape)) * a.dtype.itemsize
        return total

    ends = {k: v for k, v in state.params.items() if k in ("embedding", "head")}
    step = build_train_step(plan, state)
    tokens = jax.ShapeDtypeStruct(
        (4, MODEL["seq_length"] + 1),
        np.int32,
        sharding=jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(DATA_PARALLEL)),
    )
    mem = step.lower(state, tokens).compile().memory_analysis()
    grads = sum(n * 4 for n in plan.sink.layout.buffer.bucket_numels)
    return {
        "vocab_parallel_over_pipeline": vocab_over_pipeline,
        "distributed_optimizer": dist,
        "params_bytes": per_device(state.params),
        "embedding_and_head_bytes": per_device(ends),
        "optimizer_bytes": per_device(state.opt_state, leading_device_axis=True),
        "grad_bucket_bytes": grads,
        "compiled": {
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--distributed-optimizer", action="store_true")
    args = p.parse_args()
    for on in (False, True):
        print(json.dumps(measure(on, args.distributed_optimizer)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
