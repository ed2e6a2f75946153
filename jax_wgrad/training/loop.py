"""The training loop of a run: resume, steps, evaluation, checkpoints, metrics, profile.

:func:`run` is what ``examples/pretrain_gpt.py`` calls once it has built the plan and the
data; everything a pretraining user expects from Megatron's ``pretrain``: ``--load`` resumes
from the latest checkpoint (also onto another layout), ``--save`` writes asynchronous
checkpoints every ``--save-interval`` steps and at the end, ``--eval-interval`` runs
``--eval-iters`` held-out batches through the forward-only pipeline, metrics go to a
JSON-lines file and TensorBoard, a ``jax.profiler`` trace of a few steps to
``--profile-dir``, and the progress bar appears only on a terminal (log lines are written
above it, never onto it).

Nothing is lost quietly: a ``--load`` directory that does not exist is an error (unless it is
also the ``--save`` directory: Megatron's "resume if there"), a damaged newest checkpoint
is an error naming the step and the damage (``load_fallback``: the newest intact step is
loaded instead, and the skipped ones are reported), a ``--save`` target that cannot be
written or is too small fails before the first step, a resumed run's metrics file holds
every step once, out of memory at the first step is one line with the sizes, and an
interrupted run waits for its checkpoint writes before it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from jax_wgrad.training.checkpoint import Checkpointer, CheckpointWriteError, canonical_abstract
from jax_wgrad.training.metrics import MetricsWriter
from jax_wgrad.training.plan import TrainPlan
from jax_wgrad.training.step import TrainState, build_eval_step, build_train_step, shard_batch

__all__ = [
    "LoopOptions",
    "DispatchOverflowError",
    "Fp8NonFiniteError",
    "OutOfMemoryError",
    "SaveError",
    "check_paths",
    "evaluate",
    "is_out_of_memory",
    "out_of_memory_message",
    "run",
]

COMPILE_ONLY_HINT = "run with --compile-only to see the per-device memory report"
"""Where an out-of-memory message points."""


class OutOfMemoryError(RuntimeError):
    """The device memory did not hold the first step (one line: what did not fit)."""


class DispatchOverflowError(RuntimeError):
    """A step routed more tokens to an expert rank than its dropless receive buffer holds
    (``--moe-dropless-buffer-factor``): its numbers are wrong, so the run stops before the
    step is logged or checkpointed (one line)."""


class Fp8NonFiniteError(RuntimeError):
    """An FP8 run's step had non-finite gradients: a NaN or Inf reached a tensor the
    layers quantize (its amax), which no FP8 scale represents. The step was not applied;
    the run stops before it is logged or checkpointed (one line)."""


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """What :func:`run` does besides stepping (Megatron's flag names)."""

    train_iters: int
    """Steps to train to (counted from step 0, also when resuming)."""
    seed: int = 1234
    """Initial parameters and batches (the same for every layout)."""
    log_interval: int = 5
    """Steps between log lines."""
    eval_interval: int | None = None
    """Evaluate every this many steps (and after the last); ``None``: never."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
    save: str | None = None
    """Save checkpoints in this directory (checked writable before the first step)."""
    save_interval: int | None = None
    """Save every this many steps; a final save happens at the end whenever ``save`` is set."""
    load: str | None = None
    """Resume from the newest checkpoint here. A missing or empty directory is an error,
    unless it is also ``save`` (then the run starts from scratch and says so)."""
    load_optim: bool = True
    """Load the optimizer state with the parameters (``False``: it starts afresh)."""
    load_fallback: bool = False
    """A damaged newest checkpoint: load the newest intact one (``True``) or stop with an
    error naming the step and the damage (``False``, the default)."""
    profile_dir: str | None = None
    """Write a ``jax.profiler`` trace of a few steps after compilation here."""
    profile_steps: int = 3
    """Steps the profile covers."""
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
    gb, seq = plan.parallel.global_batch_size, plan.program.setup.seq_length
    losses = [
        float(eval_step(params, shard_batch(plan.mesh, valid.batch(k, gb, seq, opts.seed))))
        for k in range(opts.eval_iters)
    ]
    return float(np.mean(losses))


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.abspath(a) == os.path.abspath(b)


def check_paths(opts: LoopOptions) -> None:
    """Fails fast (before anything is built) on a ``load`` that is not there and a
    ``save`` directory that cannot be created or written.

    Raises:
      ValueError: one line naming the flag, the path and what is wrong.
    """
    if opts.load and not _same_dir(opts.load, opts.save):
        if not os.path.exists(opts.load):
            raise ValueError(
                f"--load {opts.load}: no such directory (to start from scratch "
                "when it holds no checkpoint yet, pass the same directory to "
                "--save as well)"
            )
        if not os.path.isdir(opts.load):
            raise ValueError(f"--load {opts.load}: not a directory")
    if opts.save:
        probe = os.path.join(opts.save, f".write-probe-{socket.gethostname()}-{os.getpid()}")
        try:
            os.makedirs(opts.save, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"jax_wgrad")
            os.remove(probe)
        except OSError as exc:
            raise ValueError(
                f"--save {opts.save}: cannot write there ({exc.strerror or exc})"
            ) from None


def _check_free_space(
    ckpt: Checkpointer, plan: TrainPlan, state: TrainState, opts: LoopOptions
) -> None:
    """A checkpoint must fit in ``opts.save``'s file system before the first step
    (:meth:`Checkpointer.space_needed`; one step is written at a time, and each save checks
    again)."""
    need = ckpt.space_needed(canonical_abstract(plan, state))
    free = shutil.disk_usage(opts.save).free
    if free < need:
        raise ValueError(
            f"--save {opts.save}: {free / 2**20:.1f} MiB free, a checkpoint of "
            f"this model takes up to {need / 2**20:.1f} MiB"
        )


def _resume(
    plan: TrainPlan, state: TrainState, opts: LoopOptions, log, saving: Checkpointer | None
) -> tuple[TrainState, int]:
    """The state and data position to start from: ``opts.load``'s newest checkpoint, read
    through ``saving`` (the run's own, locked checkpointer) when it is the save directory."""
    if not opts.load:
        return state, 0
    if saving is not None and _same_dir(opts.load, opts.save):
        reader = contextlib.nullcontext(saving)
    elif os.path.isdir(opts.load):
        reader = contextlib.closing(Checkpointer(opts.load, create=False))
    else:
        reader = contextlib.nullcontext(None)
    with reader as ckpt:
        if ckpt is None or not ckpt.all_steps():
            if _same_dir(opts.load, opts.save):
                log(
                    f"no checkpoint in {opts.load} yet: starting from scratch (--load is the "
                    "--save directory)"
                )
                return state, 0
            raise ValueError(f"--load {opts.load}: no checkpoint in this directory")
        state, meta = ckpt.restore_latest(
            plan, state, load_optim=opts.load_optim, fallback=opts.load_fallback, log=log
        )
    if meta.get("params_only"):
        source = meta.get("source", "a parameters-only checkpoint")
        log(f"starting from the parameters in {opts.load} ({source}): step 0, fresh optimizer")
        return state, 0
    log(
        f"resumed from {opts.load} at step {meta['step']} (saved on mesh (data, expert, "
        f"tensor, pipeline) = {_mesh(meta)}; optimizer "
        f"{'loaded' if opts.load_optim else 'fresh'})"
    )
    return state, int(meta["data_step"])


def _mesh(meta) -> tuple[int, int, int, int, int]:
    from jax_wgrad.parallel.config import ParallelConfig

    par = meta["parallel"]
    return ParallelConfig(  # checkpoints from before EP or CP: 1
        world_size=par["world_size"],
        tensor_model_parallel_size=par["tensor_model_parallel_size"],
        pipeline_model_parallel_size=par["pipeline_model_parallel_size"],
        expert_model_parallel_size=par.get("expert_model_parallel_size", 1),
        context_parallel_size=par.get("context_parallel_size", 1),
    ).mesh_shape


def run(
    plan: TrainPlan,
    state: TrainState,
    train_data,
    valid_data,
    opts: LoopOptions,
    *,
    metrics: MetricsWriter | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Trains from ``state`` (or the checkpoint in ``opts.load``) to ``opts.train_iters``
    steps; returns a summary (losses, step times, compile time, validation losses).

    Raises:
      ValueError: a path of ``opts`` (see :func:`check_paths`), a missing or damaged
        checkpoint, a checkpoint of another model (one line each).
      OutOfMemoryError: the first step does not fit in device memory.
      DispatchOverflowError: a step overflowed the dropless MoE receive buffers.
      Fp8NonFiniteError: an FP8 run's step had non-finite gradients.
      SaveError: another run saves checkpoints in ``opts.save`` (refused before anything
        is read or written), or a save did not fit or was refused by the file system.
      KeyboardInterrupt: after the checkpoint writes under way are complete.

    Whatever ends it, the checkpoint saves under way are complete, the save directory is
    let go of and the metrics outputs are closed before it returns or raises.
    """
    metrics = metrics or MetricsWriter()
    check_paths(opts)
    with _as_save_error(opts), contextlib.ExitStack() as scope:
        ckpt = None
        if opts.save:  # this run's directory until it ends (a second run is refused)
            ckpt = Checkpointer(opts.save)
            scope.push(_closing(ckpt))
            ckpt.lock()
        state, start = _resume(plan, state, opts, log, ckpt)
        if ckpt:
            _check_free_space(ckpt, plan, state, opts)
        metrics.start(start)
        scope.callback(metrics.close)
        summary = _train(plan, state, train_data, valid_data, opts, start, ckpt, metrics, log)
    steps = len(summary["losses"])
    if steps and summary["skipped_steps"] == steps:
        log(
            f"warning: all {steps} steps were skipped (non-finite gradients): the parameters "
            "did not change"
        )
    return summary


def _train(plan, state, train_data, valid_data, opts, start, ckpt, metrics, log) -> dict:
    """:func:`run` from its resume point ``start``: compile, steps, evaluations, saves."""
    gb, seq = plan.parallel.global_batch_size, plan.program.setup.seq_length
    batch = lambda i: shard_batch(plan.mesh, train_data.batch(i, gb, seq, opts.seed))
    compiled, compile_s = None, 0.0
    eval_step = build_eval_step(plan) if opts.eval_interval else None
    summary = {"losses": [], "times": [], "skipped_steps": 0, "valid": [], "start_step": start}
    if start < opts.train_iters:
        t0 = time.perf_counter()
        with _first_step_memory(plan, state, "compilation"):
            compiled = build_train_step(plan, state).lower(state, batch(start)).compile()
        compile_s = time.perf_counter() - t0
        log(f"compile time: {compile_s:.2f} s")
    summary["compile_time_s"] = compile_s
    is_main = jax.process_index() == 0
    show_bar = opts.progress and is_main and sys.stdout.isatty()
    bar = tqdm(
        range(start, opts.train_iters), desc="train", dynamic_ncols=True, disable=not show_bar
    )
    step_log = _above_the_bar(log) if show_bar else log
    profile = (start + min(1, opts.train_iters - start - 1), opts.profile_steps)
    # A model config with FP8 (GPTConfig's fp8_format) stops on a non-finite step.
    fp8 = getattr(plan.model, "fp8_format", None)
    done = start
    try:
        for i in bar:
            if i == start:
                with _first_step_memory(plan, state, "first step"):
                    state = _one_step(
                        compiled,
                        state,
                        batch,
                        i,
                        profile,
                        opts,
                        summary,
                        metrics,
                        bar,
                        step_log,
                        fp8,
                    )
            else:
                state = _one_step(
                    compiled, state, batch, i, profile, opts, summary, metrics, bar, step_log, fp8
                )
            done = i + 1
            if eval_step and (done % opts.eval_interval == 0 or done == opts.train_iters):
                _evaluate_and_log(
                    plan, eval_step, state, valid_data, opts, done, summary, metrics, step_log
                )
            if ckpt and opts.save_interval and done % opts.save_interval == 0:
                ckpt.save(plan, state, step=done, data_step=done, seed=opts.seed)
    except KeyboardInterrupt:
        bar.close()
        _stop_an_unfinished_profile(opts, profile, done)
        if ckpt:
            try:
                ckpt.close()  # let the saves under way finish: they are the resume point
            except CheckpointWriteError as exc:
                log(f"--save {opts.save}: {exc.reason}")
        metrics.close()
        latest = ckpt.latest_step() if ckpt else None
        log(
            f"interrupted after step {done}"
            + (
                f"; the newest checkpoint is step {latest} in {opts.save} (resume with --load "
                f"{opts.save})"
                if latest is not None
                else "; no checkpoint was written"
            )
        )
        raise
    except BaseException:
        bar.close()
        _stop_an_unfinished_profile(opts, profile, done)
        raise
    if ckpt:
        end = max(start, opts.train_iters)
        if ckpt.latest_step() != end and opts.train_iters > start:
            ckpt.save(plan, state, step=end, data_step=end, seed=opts.seed)
        ckpt.close()
        log(f"checkpoint of step {end} in {opts.save}")
    summary["state"] = state
    return summary


class SaveError(RuntimeError):
    """A checkpoint of ``--save`` could not be written: another run saves there, or the
    file system is full or refused a write (one line; the checkpoints before are intact)."""


@contextlib.contextmanager
def _as_save_error(opts: LoopOptions):
    """:class:`CheckpointWriteError` inside, raised as a :class:`SaveError` naming the flag."""
    try:
        yield
    except CheckpointWriteError as exc:
        raise SaveError(f"--save {opts.save}: {exc.reason}") from None


def _closing(ckpt: Checkpointer):
    """An exit callback closing ``ckpt`` (the saves under way finish first: they are the
    resume point); when the block already ends by an exception, a failure of the close
    does not replace it."""

    def close(kind, exc, tb) -> bool:
        if exc is None:
            ckpt.close()
        else:
            with contextlib.suppress(CheckpointWriteError):
                ckpt.close()
        return False

    return close


def _stop_an_unfinished_profile(opts: LoopOptions, profile: tuple[int, int], done: int) -> None:
    """Writes the trace of a run that stops (an error, Ctrl-C) while its profile of steps
    ``profile[0]..`` is recording, and ends the recording."""
    end = min(profile[0] + profile[1], opts.train_iters)
    if opts.profile_dir and profile[0] <= done < end:
        with contextlib.suppress(Exception):
            jax.profiler.stop_trace()


def _above_the_bar(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` that clears the progress bar, writes the line, then redraws the bar (so a
    log line never lands on the bar's line)."""

    def write(msg: str) -> None:
        with tqdm.external_write_mode(file=sys.stdout):
            log(msg)

    return write


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is XLA's out-of-memory error (``RESOURCE_EXHAUSTED``)."""
    return isinstance(exc, RuntimeError) and bool(
        re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", str(exc))
    )


@contextlib.contextmanager
def _first_step_memory(plan: TrainPlan, state: TrainState, where: str):
    """Turns XLA's out-of-memory error inside the block into a one-line
    :class:`OutOfMemoryError` with the sizes that did not fit."""
    try:
        yield
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemoryError(out_of_memory_message(plan, state, where, exc)) from None


def out_of_memory_message(
    plan: TrainPlan, state: TrainState | None, where: str, exc: BaseException
) -> str:
    """One line: the model, the train state's bytes per device, what XLA tried to
    allocate, and where to look next."""
    model, par, setup = plan.model, plan.parallel, plan.program.setup
    parts = [
        f"out of memory in the {where}: {model.num_layers} layers, hidden "
        f"{setup.hidden_size}, seq {setup.seq_length}, micro batch "
        f"{par.micro_batch_size}, mesh (data, expert, context, tensor, pipeline) = {par.mesh_shape}"
    ]
    if state is not None:
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
        per_device = sum(
            int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
            for x in jax.tree.leaves(state)
        )  # shapes only: state may be donated
        parts.append(
            f"{n_params / 1e6:.2f} M parameters, train state {per_device / 2**20:.1f} "
            f"MiB per device"
        )
    text = str(exc)
    tried = re.search(r"allocat\w*\s+(\d+)\s*bytes", text)
    if tried:
        parts.append(f"XLA tried to allocate {int(tried.group(1)) / 2**20:.1f} MiB")
    else:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        parts.append(f"XLA: {first[:200]}")
    return "; ".join(parts) + f" ({COMPILE_ONLY_HINT})"


def _one_step(compiled, state, batch, i, profile, opts, summary, metrics, bar, log, fp8=None):
    if opts.profile_dir and i == profile[0]:
        jax.profiler.start_trace(opts.profile_dir)
    tokens = batch(i)
    gb_tokens = int(np.prod(tokens.shape)) - tokens.shape[0]
    t0 = time.perf_counter()
    with jax.profiler.StepTraceAnnotation("train_step", step_num=i + 1):  # 1-based, as logged
        state, m = compiled(state, tokens)
        loss = float(m["loss"])  # waits for the step
        grad_norm, skipped = float(m["grad_norm"]), bool(m["skipped"])
    dt = time.perf_counter() - t0
    if opts.profile_dir and i + 1 == min(profile[0] + profile[1], opts.train_iters):
        jax.profiler.stop_trace()
        log(
            f"profile of steps {profile[0] + 1}..{i + 1} (as the log counts them) written "
            f"to {opts.profile_dir}"
        )
    summary["losses"].append(loss)
    summary["times"].append(dt)
    summary["skipped_steps"] += skipped
    if skipped and fp8 is not None:
        raise Fp8NonFiniteError(
            f"iteration {i + 1}: the gradients are not finite (loss {loss:g}, grad norm "
            f"{grad_norm:g}): a NaN or Inf reached the amax of a tensor the layers quantize "
            f"under --fp8-format {fp8}, which no FP8 scale represents; the step was not "
            "applied and the run stops (lower --lr, or find the NaN: rerun without "
            "--fp8-format)"
        )
    moe = {k: np.asarray(v).tolist() for k, v in m.items() if k.startswith("moe_")}
    if moe.get("moe_dispatch_overflow", 0) > 0:
        raise DispatchOverflowError(
            f"iteration {i + 1}: the dropless MoE dispatch routed "
            f"{moe['moe_dispatch_overflow']:.0f} token choices past the expert ranks' receive "
            f"buffers (--moe-dropless-buffer-factor: ceil(factor x T x topk) rows per rank); "
            f"this step's numbers are wrong and were not saved: resume from the last "
            f"checkpoint with a larger factor, or without the flag (buffers for the worst case)"
        )
    metrics.write(
        {
            "step": i + 1,
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "step_time_s": dt,
            "tokens_per_s": gb_tokens / dt,
            **moe,
        }
    )
    bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{dt:.3f}")
    if (i + 1) % opts.log_interval == 0 or i == summary["start_step"] or i + 1 == opts.train_iters:
        log(
            f"iteration {i + 1:5d}/{opts.train_iters} | loss {loss:.4f} | grad norm "
            f"{grad_norm:.3f} | skipped {summary['skipped_steps']} | step {dt * 1e3:.1f} ms | "
            f"{gb_tokens / dt:,.0f} tokens/s"
            + (
                f" | MoE aux loss {moe['moe_aux_loss']:.4f} | max expert load "
                f"{moe['moe_max_load']:.2f} x mean | dropped "
                f"{100 * moe['moe_dropped_fraction']:.1f}%"
                if moe
                else ""
            )
        )
    return state


def _evaluate_and_log(plan, eval_step, state, valid, opts, step, summary, metrics, log):
    loss = evaluate(plan, eval_step, state.params, valid, opts)
    ppl = math.exp(min(loss, 700.0))
    summary["valid"].append((step, loss))
    metrics.write({"step": step, "valid_loss": loss, "valid_ppl": ppl})
    log(
        f"validation at step {step:5d} | loss {loss:.4f} | perplexity {ppl:.3f} "
        f"({opts.eval_iters} batches)"
    )
