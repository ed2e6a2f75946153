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
import json
import pathlib
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--gradient-accumulation-fusion", action="store_true",
                   help="accumulate weight gradients in fp32 main grads with the fused op")
    g.add_argument("--num-cpu-devices", type=int, default=8,
                   help="virtual CPU devices when running on CPU (default 8)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (multi-process launch)")
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                   help="defer the output layer's weight-gradient GEMMs of the last stage "
                        "to after the pipeline schedule (needs pipeline parallelism and "
                        "--gradient-accumulation-fusion)")
    g.add_argument("--wgrad-deferral-limit", type=int, default=0,
                   help="microbatches whose output-layer wgrad is deferred (0: all)")
    g.add_argument("--pipeline-schedule", choices=("1f1b", "zb-h1"), default="1f1b",
                   help="1f1b (Megatron's) or zb-h1 (zero bubble: weight-gradient GEMMs fill "
                        "the bubbles; needs --gradient-accumulation-fusion)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="recompute activations in the backward: full (the whole stage "
                        "forward) or selective (the attention core); absent: none")
    g.add_argument("--defer-mode", choices=("stash", "recompute"), default="stash",
                   help="stash (x, dy) per deferred microbatch, or (x, logsumexp, labels) "
                        "and recompute dy in the drain")
    g = p.add_argument_group("gradient buffers and data-parallel sync")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 master weights and optimizer state over data ranks "
                        "(reduce-scatter gradient buckets, all-gather parameters)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="sync each stage's gradient buckets in the pipeline cooldown")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (only with --overlap-grad-reduce; "
                        "default max(40M, 1M x dp), Megatron's rule)")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average gradients in the collective instead of pre-scaling by 1/dp")
    g.add_argument("--pad-buckets-for-high-nccl-busbw", action="store_true",
                   help="pad buckets to a multiple of lcm(dp, 128, 2^16) (distributed optimizer)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp32", action="store_true", help="fp32 compute (default)")
    prec.add_argument("--bf16", action="store_true",
                      help="bf16 activations/GEMMs; fp32 params, grads, optimizer")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=32)
    g.add_argument("--train-iters", type=int, default=40)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=None,
                   help="cosine-decay floor (default: constant lr after warm-up)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this value (0: no clipping)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-path", default=None,
                   help="a text file or directory (default: the Python stdlib sources)")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=5)
    g.add_argument("--metrics-file", default=None,
                   help="JSON lines: step, loss, grad_norm, skipped, step_time_s, tokens_per_s")
    g.add_argument("--profile-dir", default=None,
                   help="write a jax.profiler trace of a few steps after compilation")
    g.add_argument("--profile-steps", type=int, default=3)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def build_configs(args: argparse.Namespace):
    """``(GPTConfig, ParallelConfig, DDPConfig)`` from the flags; a bad combination ends
    the program with an argparse-style error naming it."""
    from jax_wgrad import DDPConfig, GPTConfig, ParallelConfig
    from jax_wgrad.models.gpt import validate
    from jax_wgrad.training import VOCAB_SIZE

    try:
        model = GPTConfig(
            vocab_size=VOCAB_SIZE, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            compute_dtype="bfloat16" if args.bf16 else "float32")
        parallel = ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            sequence_parallel=args.sequence_parallel,
            gradient_accumulation_fusion=args.gradient_accumulation_fusion,
            defer_embedding_wgrad_compute=args.defer_embedding_wgrad_compute,
            wgrad_deferral_limit=args.wgrad_deferral_limit, defer_mode=args.defer_mode,
            pipeline_schedule=args.pipeline_schedule,
            recompute_granularity=args.recompute_granularity)
        validate(parallel, model)
        ddp = DDPConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce, bucket_size=args.ddp_bucket_size,
            average_in_collective=args.ddp_average_in_collective,
            pad_buckets_for_high_nccl_busbw=args.pad_buckets_for_high_nccl_busbw,
            clip_grad=args.clip_grad)
    except ValueError as exc:
        raise SystemExit(f"pretrain_gpt.py: error: {exc}") from None
    return model, parallel, ddp


def learning_rate(args: argparse.Namespace):
    """Constant, linear warm-up then constant, or warm-up + cosine decay to --min-lr."""
    import optax

    if args.min_lr is not None:
        return optax.warmup_cosine_decay_schedule(
            0.0, args.lr, max(args.lr_warmup_iters, 1), args.train_iters, args.min_lr)
    if args.lr_warmup_iters:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, args.lr, args.lr_warmup_iters),
             optax.constant_schedule(args.lr)], [args.lr_warmup_iters])
    return args.lr


def describe(plan, data, state) -> list[str]:
    """The run's log lines: devices and layout, data, buffers, model."""
    import jax
    import numpy as np

    par, model, ddp = plan.parallel, plan.model, plan.ddp
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return [
        f"devices: {jax.device_count()} x {jax.devices()[0].platform} | mesh (data, tensor, "
        f"pipeline) = {par.mesh_shape} | microbatches per step: {par.num_microbatches} | "
        f"sequence parallel: {par.sequence_parallel} | gradient accumulation fusion: "
        f"{par.gradient_accumulation_fusion} | schedule: {plan.table.name} | recompute: "
        f"{par.recompute_granularity}",
        f"data: {data.name}, {len(data) / 1e6:.1f} MB",
        f"ddp: distributed optimizer {ddp.use_distributed_optimizer} | overlap grad reduce "
        f"{ddp.overlap_grad_reduce} | bucket size "
        f"{ddp.effective_bucket_size(par.data_parallel_size)} | average in collective "
        f"{ddp.average_in_collective} | clip grad {ddp.clip_grad}",
        plan.buffer_summary(),
        f"model: {n_params / 1e6:.2f} M parameters, {model.num_layers} layers, hidden "
        f"{model.hidden_size}, heads {model.num_attention_heads}, seq {model.seq_length}, "
        f"{model.compute_dtype}",
    ]


def train(args, plan, state, data, log) -> tuple[list[float], list[float], int, float]:
    """The step loop: compile once (timed), then ``--train-iters`` steps with metrics,
    progress bar and the optional profile. Returns losses, step times, skipped steps and
    the compile time."""
    import jax
    from tqdm import tqdm

    from jax_wgrad import build_train_step, shard_batch

    gb, seq = plan.parallel.global_batch_size, plan.model.seq_length
    batch = lambda i: shard_batch(plan.mesh, data.batch(i, gb, seq, args.seed))
    t0 = time.perf_counter()
    compiled = build_train_step(plan, state).lower(state, batch(0)).compile()
    compile_s = time.perf_counter() - t0
    log(f"compile time: {compile_s:.2f} s")
    is_main = jax.process_index() == 0
    metrics_file = None
    if args.metrics_file and is_main:
        pathlib.Path(args.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(args.metrics_file, "w")
    profile_start = min(1, args.train_iters - 1)
    profile_stop = min(profile_start + args.profile_steps, args.train_iters)
    losses, times, skipped_steps = [], [], 0
    bar = tqdm(range(args.train_iters), desc="train", disable=args.no_progress or not is_main,
               dynamic_ncols=True)
    for i in bar:
        if args.profile_dir and i == profile_start:
            jax.profiler.start_trace(args.profile_dir)
        tokens = batch(i)
        t0 = time.perf_counter()
        with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
            state, metrics = compiled(state, tokens)
            loss = float(metrics["loss"])  # waits for the step
            grad_norm, skipped = float(metrics["grad_norm"]), bool(metrics["skipped"])
        dt = time.perf_counter() - t0
        if args.profile_dir and i + 1 == profile_stop:
            jax.profiler.stop_trace()
            log(f"profile of steps {profile_start}..{profile_stop - 1} written to "
                f"{args.profile_dir}")
        losses.append(loss)
        times.append(dt)
        skipped_steps += skipped
        record = {"step": i + 1, "loss": loss, "grad_norm": grad_norm, "skipped": skipped,
                  "step_time_s": dt, "tokens_per_s": gb * seq / dt}
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{dt:.3f}")
        if (i + 1) % args.log_interval == 0 or i == 0 or i + 1 == args.train_iters:
            log(f"iteration {i + 1:5d}/{args.train_iters} | loss {loss:.4f} | grad norm "
                f"{grad_norm:.3f} | skipped {skipped_steps} | step {dt * 1e3:.1f} ms | "
                f"{gb * seq / dt:,.0f} tokens/s")
    if metrics_file:
        metrics_file.close()
    return losses, times, skipped_steps, compile_s


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import jax

    import jax_wgrad

    from jax_wgrad.training.gpu import apply_gpu_xla_flags

    gpu_flags = apply_gpu_xla_flags()  # before jax initialises its backends
    jax_wgrad.use_virtual_cpu_devices(args.num_cpu_devices)
    import numpy as np
    from tqdm import tqdm

    if args.distributed:
        jax_wgrad.initialize_distributed()
    log = (lambda msg: tqdm.write(msg)) if jax.process_index() == 0 else (lambda msg: None)
    model, parallel, ddp = build_configs(args)
    data = (jax_wgrad.ByteDataset.from_path(args.data_path) if args.data_path
            else jax_wgrad.ByteDataset.from_stdlib())
    optimizer = jax_wgrad.default_optimizer(learning_rate(args), weight_decay=args.weight_decay)
    plan = jax_wgrad.TrainPlan.create(model, parallel, jax_wgrad.make_mesh(parallel), optimizer,
                                      ddp=ddp)
    state = jax_wgrad.init_train_state(plan, args.seed)
    for line in describe(plan, data, state):
        log(line)
    if gpu_flags:
        log(f"XLA flags for the GPU: {' '.join(gpu_flags)}")
    losses, times, skipped_steps, compile_s = train(args, plan, state, data, log)
    buf = plan.layout.buffer
    steady = times[1:] or times
    summary = {
        "compile_time_s": compile_s, "mean_step_time_s": float(np.mean(steady)),
        "first_loss": losses[0], "last_loss": losses[-1], "skipped_steps": skipped_steps,
        "num_buckets": buf.num_buckets, "buffer_numel": buf.numel, "grad_numel": buf.param_numel,
        "padding_fraction": (buf.numel - buf.param_numel) / buf.numel,
    }
    log(f"done: compile {compile_s:.2f} s | mean step {summary['mean_step_time_s'] * 1e3:.1f} ms "
        f"(steps 2..{len(times)}) | loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
