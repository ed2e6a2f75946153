"""The training loop of a run: resume, steps, evaluation, checkpoints, metrics, profile.

:func:`run` is what ``examples/pretrain_gpt.py`` calls once it has built the plan and the
data; everything a pretraining user expects from Megatron's ``pretrain``: ``--load`` resumes
from the latest checkpoint (also onto another layout), ``--save`` writes asynchronous
checkpoints every ``--save-interval`` steps and at the end, ``--eval-interval`` runs
``--eval-iters`` held-out batches through the forward-only pipeline, metrics go to a
JSON-lines file and TensorBoard, a ``jax.profiler`` trace of a few steps to
``--profile-dir``, and the progress bar appears only on a terminal.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from jax_wgrad.training.checkpoint import Checkpointer
from jax_wgrad.training.metrics import MetricsWriter
from jax_wgrad.training.plan import TrainPlan
from jax_wgrad.training.step import TrainState, build_eval_step, build_train_step, shard_batch

__all__ = ["LoopOptions", "run", "evaluate"]


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """What :func:`run` does besides stepping (Megatron's flag names)."""

    train_iters: int
    seed: int = 1234
    log_interval: int = 5
    eval_interval: int | None = None
    """Evaluate every this many steps (and after the last); ``None``: never."""
    eval_iters: int = 10
    save: str | None = None
    save_interval: int | None = None
    """Save every this many steps; a final save happens at the end whenever ``save``."""
    load: str | None = None
    load_optim: bool = True
    profile_dir: str | None = None
    profile_steps: int = 3
    progress: bool = True
    """Show a progress bar (only when stdout is a terminal)."""

    def __post_init__(self) -> None:
        for name in ("train_iters",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in ("log_interval", "eval_iters", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("eval_interval", "save_interval"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v!r}")


def evaluate(plan: TrainPlan, eval_step, params, valid, opts: LoopOptions) -> float:
    """Mean token loss of ``opts.eval_iters`` held-out global batches (the same batches at
    every evaluation: ``valid.batch(k, ...)`` for ``k < eval_iters``)."""
    gb, seq = plan.parallel.global_batch_size, plan.model.seq_length
    losses = [float(eval_step(params, shard_batch(plan.mesh, valid.batch(k, gb, seq,
                                                                          opts.seed))))
              for k in range(opts.eval_iters)]
    return float(np.mean(losses))


def _resume(plan: TrainPlan, state: TrainState, opts: LoopOptions, log) -> tuple[TrainState, int]:
    if not opts.load:
        return state, 0
    ckpt = Checkpointer(opts.load)
    if ckpt.latest_step() is None:
        log(f"no checkpoint in {opts.load}: starting from scratch")
        return state, 0
    state, meta = ckpt.restore(plan, state, load_optim=opts.load_optim)
    log(f"resumed from {opts.load} at step {meta['step']} (saved on mesh (data, expert, "
        f"tensor, pipeline) = {_mesh(meta)}; optimizer "
        f"{'loaded' if opts.load_optim else 'fresh'})")
    return state, int(meta["data_step"])


def _mesh(meta) -> tuple[int, int, int, int]:
    from jax_wgrad.parallel.config import ParallelConfig

    par = meta["parallel"]
    return ParallelConfig(  # checkpoints from before EP: 1
        world_size=par["world_size"], tensor_model_parallel_size=par["tensor_model_parallel_size"],
        pipeline_model_parallel_size=par["pipeline_model_parallel_size"],
        expert_model_parallel_size=par.get("expert_model_parallel_size", 1)).mesh_shape


def run(plan: TrainPlan, state: TrainState, train_data, valid_data, opts: LoopOptions, *,
        metrics: MetricsWriter | None = None, log: Callable[[str], None] = print) -> dict:
    """Trains from ``state`` (or the checkpoint in ``opts.load``) to ``opts.train_iters``
    steps; returns a summary (losses, step times, compile time, validation losses)."""
    metrics = metrics or MetricsWriter()
    state, start = _resume(plan, state, opts, log)
    gb, seq = plan.parallel.global_batch_size, plan.model.seq_length
    batch = lambda i: shard_batch(plan.mesh, train_data.batch(i, gb, seq, opts.seed))
    compiled, compile_s = None, 0.0
    eval_step = build_eval_step(plan) if opts.eval_interval else None
    ckpt = Checkpointer(opts.save) if opts.save else None
    summary = {"losses": [], "times": [], "skipped_steps": 0, "valid": [], "start_step": start}
    if start < opts.train_iters:
        t0 = time.perf_counter()
        compiled = build_train_step(plan, state).lower(state, batch(start)).compile()
        compile_s = time.perf_counter() - t0
        log(f"compile time: {compile_s:.2f} s")
    summary["compile_time_s"] = compile_s
    is_main = jax.process_index() == 0
    bar = tqdm(range(start, opts.train_iters), desc="train", dynamic_ncols=True,
               disable=not (opts.progress and is_main and sys.stdout.isatty()))
    profile = (start + min(1, opts.train_iters - start - 1), opts.profile_steps)
    for i in bar:
        state = _one_step(compiled, state, batch, i, profile, opts, summary, metrics, bar, log)
        done = i + 1
        if eval_step and (done % opts.eval_interval == 0 or done == opts.train_iters):
            _evaluate_and_log(plan, eval_step, state, valid_data, opts, done, summary, metrics,
                              log)
        if ckpt and opts.save_interval and done % opts.save_interval == 0:
            ckpt.save(plan, state, step=done, data_step=done, seed=opts.seed)
    if ckpt:
        end = max(start, opts.train_iters)
        if ckpt.latest_step() != end and opts.train_iters > start:
            ckpt.save(plan, state, step=end, data_step=end, seed=opts.seed)
        ckpt.close()
        log(f"checkpoint of step {end} in {opts.save}")
    metrics.close()
    summary["state"] = state
    return summary


def _one_step(compiled, state, batch, i, profile, opts, summary, metrics, bar, log):
    if opts.profile_dir and i == profile[0]:
        jax.profiler.start_trace(opts.profile_dir)
    tokens = batch(i)
    gb_tokens = int(np.prod(tokens.shape)) - tokens.shape[0]
    t0 = time.perf_counter()
    with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
        state, m = compiled(state, tokens)
        loss = float(m["loss"])  # waits for the step
        grad_norm, skipped = float(m["grad_norm"]), bool(m["skipped"])
    dt = time.perf_counter() - t0
    if opts.profile_dir and i + 1 == min(profile[0] + profile[1], opts.train_iters):
        jax.profiler.stop_trace()
        log(f"profile of steps {profile[0]}..{i} written to {opts.profile_dir}")
    summary["losses"].append(loss)
    summary["times"].append(dt)
    summary["skipped_steps"] += skipped
    moe = {k: np.asarray(v).tolist() for k, v in m.items() if k.startswith("moe_")}
    metrics.write({"step": i + 1, "loss": loss, "grad_norm": grad_norm, "skipped": skipped,
                   "step_time_s": dt, "tokens_per_s": gb_tokens / dt, **moe})
    bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{dt:.3f}")
    if (i + 1) % opts.log_interval == 0 or i == summary["start_step"] or i + 1 == opts.train_iters:
        log(f"iteration {i + 1:5d}/{opts.train_iters} | loss {loss:.4f} | grad norm "
            f"{grad_norm:.3f} | skipped {summary['skipped_steps']} | step {dt * 1e3:.1f} ms | "
            f"{gb_tokens / dt:,.0f} tokens/s" + (
                f" | MoE aux loss {moe['moe_aux_loss']:.4f} | max expert load "
                f"{moe['moe_max_load']:.2f} x mean | dropped "
                f"{100 * moe['moe_dropped_fraction']:.1f}%" if moe else ""))
    return state


def _evaluate_and_log(plan, eval_step, state, valid, opts, step, summary, metrics, log):
    loss = evaluate(plan, eval_step, state.params, valid, opts)
    ppl = math.exp(min(loss, 700.0))
    summary["valid"].append((step, loss))
    metrics.write({"step": step, "valid_loss": loss, "valid_ppl": ppl})
    log(f"validation at step {step:5d} | loss {loss:.4f} | perplexity {ppl:.3f} "
        f"({opts.eval_iters} batches)")
