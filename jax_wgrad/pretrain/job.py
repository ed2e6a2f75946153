"""The pretraining job: flags in, a trained (or compiled) model and its summary out."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import jax
import numpy as np
import optax

from jax_wgrad import aot
from jax_wgrad.interop.train_state import train_state_from_hf
from jax_wgrad.parallel import initialize_distributed, make_mesh, use_virtual_cpu_devices
from jax_wgrad.pretrain import cli
from jax_wgrad.pretrain._interrupts import interrupted, interrupts_redelivered
from jax_wgrad.training import TrainPlan, TrainState, default_optimizer, init_train_state
from jax_wgrad.training.checkpoint import quiet_failed_restores
from jax_wgrad.training.console import LineFilter
from jax_wgrad.training.data import load_data as load_datasets
from jax_wgrad.training.data import padded_vocab_size
from jax_wgrad.training.gpu import apply_gpu_xla_flags
from jax_wgrad.training.loop import (
    DispatchOverflowError,
    Fp8NonFiniteError,
    OutOfMemoryError,
    SaveError,
    check_paths,
    is_out_of_memory,
    out_of_memory_message,
    run,
)
from jax_wgrad.training.metrics import MetricsWriter

__all__ = ["describe", "learning_rate", "load_data", "main", "start_from_hf", "summarize"]


def main(argv: list[str] | None = None, *, prog: str | None = None) -> dict:
    """Runs the job of ``argv`` (default ``sys.argv[1:]``; ``--help`` lists the flags) and
    returns its summary (:func:`summarize`; ``{"aot": report}`` with ``--compile-only``).

    A bad flag ends it like argparse (``SystemExit(2)``, one line naming the flag); Ctrl-C
    at any moment ends it with ``SystemExit(130)`` and one line saying what to resume from.
    What it changes in the process while it runs -- ``sys.unraisablehook`` (a swallowed
    Ctrl-C is re-sent), the hooks and warning filters that keep a failed restore's
    leftovers quiet, file descriptor 1 routed through a filter of the CPU collectives'
    chatter (``--distributed``) -- is back as it was when it returns or raises.
    ``prog``: the program name in its messages (default: ``sys.argv[0]``'s file name).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or os.path.basename(sys.argv[0])
    try:
        with interrupts_redelivered(), quiet_failed_restores():
            return run_job(argv, prog)
    except KeyboardInterrupt:
        interrupted(prog, argv)


def run_job(argv: list[str], prog: str | None = None) -> dict:
    """:func:`main` without its Ctrl-C handling and process-wide scopes."""
    parser = cli.make_parser(prog)
    preset = cli.apply_preset(parser, argv)
    args = parser.parse_args(argv)
    args.given_flags = cli.given_flags(argv)  # the flags typed (not a preset's defaults)
    args.preset_line = cli.preset_line(parser, args, preset)
    cli.check_flags(parser, args, args.given_flags)
    cli.check_output_paths(parser, args)
    cli.check_report_json(parser, args)
    try:
        opts = cli.loop_options(args)
        check_paths(opts)  # before anything is built: a typo in --load, a read-only --save
        opts = _pretrained_and_load(args, opts)
    except ValueError as exc:
        cli.usage_error(parser, exc)
    with contextlib.ExitStack() as scope:
        if args.distributed and not args.verbose_collectives:
            scope.enter_context(LineFilter())  # fd 1 through a filter until the job ends
        try:
            return train(parser, args, opts)
        except (OutOfMemoryError, DispatchOverflowError, Fp8NonFiniteError, SaveError) as exc:
            parser.exit(1, f"{parser.prog}: error: {exc}\n")


def _pretrained_and_load(args: argparse.Namespace, opts):
    """``--load-hf X --load Y`` is Megatron's ``--pretrained-checkpoint X --load Y``: the
    run resumes the newest checkpoint in Y when Y holds one (X's weights are not read; its
    config.json still gives the model flags' defaults), else it starts from X's weights
    at step 0 and the options returned load nothing (a rerun of the same command with
    ``--save Y`` resumes what it saved). Decided by Y's files, before jax starts."""
    if args.load_hf is None or opts.load is None or cli.directory_kind(opts.load) == "jax_wgrad":
        return opts
    return dataclasses.replace(opts, load=None)


def optimizer_of(args: argparse.Namespace):
    """The run's optax transformation: Megatron's AdamW (:func:`default_optimizer`) at the
    flags' learning-rate schedule and weight decay, its moments stored in the dtypes of
    ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``."""
    return default_optimizer(
        learning_rate(args),
        weight_decay=args.weight_decay,
        exp_avg_dtype=cli.MOMENT_DTYPE_BY_NAME[args.exp_avg_dtype],
        exp_avg_sq_dtype=cli.MOMENT_DTYPE_BY_NAME[args.exp_avg_sq_dtype],
    )


def start_from_hf(parser: argparse.ArgumentParser, directory: str, plan: TrainPlan) -> TrainState:
    """``--load-hf``: :func:`jax_wgrad.interop.train_state_from_hf`, its refusals (an
    unsupported config, damaged shards, a model the flags change) as usage errors."""
    try:
        return train_state_from_hf(plan, directory)
    except ValueError as exc:
        parser.error(f"--load-hf {directory}: {exc}")


def compile_only(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """``--compile-only``: the train step compiled for ``--target`` GPUs, nothing run."""
    try:  # the configs are checked against the target's GPU count
        use_virtual_cpu_devices(args.target_gpus_per_host * args.target_hosts)
    except ValueError:  # jax already started (in-process callers): checked below
        pass
    model, parallel, ddp = cli.build_configs(args, load_data(args, parser)[2], parser)
    note = aot.older_jax_note()  # the documented figures are of a newer jax's compile
    if note is not None:
        print(note, flush=True)
    try:
        report = aot.compile_for_target(
            model,
            parallel,
            ddp,
            target=args.target,
            hosts=args.target_hosts,
            gpus_per_host=args.target_gpus_per_host,
            tx=optimizer_of(args),
            cuda_graph_scope=args.cuda_graph_scope,
            routing_skew=args.estimate_routing_skew,
        )
    except aot.GemmTilingError as exc:  # XLA's, of these model sizes: not a usage error
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    except (RuntimeError, ValueError) as exc:  # no plugin or handler; a bad layout
        cli.usage_error(parser, exc)
    print(report.format(), flush=True)
    if args.report_json is not None:
        with open(args.report_json, "w") as f:
            json.dump(report.figures(), f, indent=1)
            f.write("\n")
    if not report.fits:
        raise SystemExit(1)
    return {"aot": report}


def train(parser: argparse.ArgumentParser, args: argparse.Namespace, opts) -> dict:
    """The run of :func:`main` once the flags are checked."""
    if args.compile_only:  # compile for GPUs that are not here; nothing is run
        return compile_only(parser, args)
    gpu_flags = apply_gpu_xla_flags(args.cuda_graph_scope)  # before jax initialises its backends
    use_virtual_cpu_devices(args.num_cpu_devices)
    if args.distributed:
        initialize_distributed(
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
    model, parallel, ddp = cli.build_configs(args, vocab, parser)
    optimizer = optimizer_of(args)
    try:  # the plan checks the model against the layout (the one place it is checked)
        plan = TrainPlan.create(model, parallel, make_mesh(parallel), optimizer, ddp=ddp)
    except ValueError as exc:
        cli.usage_error(parser, exc)
    try:
        if args.load_hf is None or opts.load is not None:
            state = init_train_state(plan, args.seed)
            if args.load_hf is not None:  # _pretrained_and_load: --load holds a checkpoint
                log(
                    f"--load {opts.load} holds a checkpoint: the run resumes it, the weights "
                    f"in --load-hf {args.load_hf} are not read (its config.json gives the "
                    "model flags' defaults; Megatron's --pretrained-checkpoint with --load)"
                )
        else:
            state = start_from_hf(parser, args.load_hf, plan)
            log(
                f"starting from the Hugging Face model in {args.load_hf} (step 0, fresh "
                "optimizer)"
                + (f": --load {args.load} holds no checkpoint yet" if args.load else "")
            )
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemoryError(out_of_memory_message(plan, None, "initialization", exc)) from None
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
        cli.usage_error(parser, exc)
    return summarize(plan, out, log, args.train_iters)


def load_data(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """``(train, valid, vocab size)``; a bad ``--data-path``/``--split`` is an
    argparse-style error."""
    try:
        train_data, valid, _ = load_datasets(args.data_path, args.split)
        if not len(train_data):  # a 0 in --split (an empty dataset is refused by its loader)
            raise ValueError(
                f"--split {args.split!r} leaves the training part empty ({train_data.name}: "
                "0 tokens)"
            )
        vocab = (
            train_data.vocab_size
            if getattr(train_data, "vocab_size", None)
            else padded_vocab_size(train_data.max_token_id, args.make_vocab_size_divisible_by)
        )
    except ValueError as exc:
        cli.usage_error(parser, exc)
    if args.vocab_size is not None:
        if args.vocab_size <= train_data.max_token_id:
            source = (
                f"--vocab-size {args.vocab_size}"
                if "vocab_size" in getattr(args, "given_flags", {"vocab_size"})
                else f"the vocabulary of --load-hf {args.load_hf} ({args.vocab_size})"
                if args.load_hf
                else f"the --model preset's vocabulary ({args.vocab_size})"
            )
            parser.error(
                f"{source} must exceed the data's largest token id "
                f"{train_data.max_token_id} ({train_data.name})"
            )
        vocab = args.vocab_size
    if args.eval_interval and len(valid) <= args.seq_length + 1:
        parser.error(
            f"--eval-interval needs a validation split: --split {args.split!r} "
            f"leaves {len(valid)} tokens ({valid.name})"
        )
    return train_data, valid, vocab


def learning_rate(args: argparse.Namespace):
    """Constant, linear warm-up then constant, or warm-up + cosine decay to --min-lr."""
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


def _bf16_layers(model) -> str:
    """What ``first_last_layers_bf16`` keeps out of FP8 (a ``GPTConfig``), for the model
    line."""
    first, last = model.layers_in_bf16()
    if (first, last) == (0, 0):
        return ""
    fp8 = max(0, model.num_layers - first - last)
    return f" but the first {first} and last {last} ({fp8} of {model.num_layers} in FP8)"


def _context(par) -> str:
    """The context-parallel split of the job line (empty without it)."""
    if par.context_parallel_size == 1:
        return ""
    return f" (context parallel {par.context_parallel_size}, {par.cp_comm_type})"


def describe(plan, data, state) -> list[str]:
    """The run's log lines: devices and layout, data, buffers, model."""

    par, model, ddp = plan.parallel, plan.model, plan.ddp
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return [
        f"devices: {jax.device_count()} x {jax.devices()[0].platform} in "
        f"{jax.process_count()} process(es) | mesh (data, expert, context, tensor, "
        f"pipeline) = {par.mesh_shape}{_context(par)} | microbatches per step: "
        f"{par.num_microbatches} | sequence parallel: {par.sequence_parallel} | "
        "gradient accumulation fusion: "
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
        f"{ddp.effective_bucket_size(par.data_context_parallel_size)} | average in collective "
        f"{ddp.average_in_collective} | clip grad {ddp.clip_grad}",
        plan.buffer_summary(),
        f"model: {n_params / 1e6:.2f} M parameters, {model.num_layers} layers, hidden "
        f"{model.hidden_size}, heads {model.num_attention_heads} (kv {model.query_groups}), "
        f"seq {model.seq_length}, vocab {model.vocab_size}"
        + (
            f" (padded to {model.padded_vocab_size})"
            if model.padded_vocab_size != model.vocab_size
            else ""
        )
        + f", {model.compute_dtype}"
        + (
            ""
            if model.fp8_format is None
            else f" with FP8 {model.fp8_format} ({model.fp8_recipe} scaling, margin "
            f"{model.fp8_margin}) in the layers' linears{_bf16_layers(model)}"
        )
        + f", {model.normalization}, {model.position_embedding_type}, "
        f"{'swiglu' if model.swiglu else 'gelu'}, "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'}"
        + (
            ""
            if model.num_moe_experts is None
            else f" | MoE: {model.num_moe_experts} experts (EP {par.expert_model_parallel_size}"
            f"{' folded over the tensor ranks' if par.folds_experts else ''}, "
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


def summarize(plan, out: dict, log, train_iters: int | None = None) -> dict:
    """The run's summary (returned by :func:`main`) and its last log line; a run with no
    step to train (a resumed checkpoint already at ``--train-iters``) says why."""

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
