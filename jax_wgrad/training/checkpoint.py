"""Checkpoints of a train state in a layout-independent form, written by orbax.

A :class:`Checkpointer` saves, per step, three items with an ``orbax``
``CheckpointManager``:

* ``params``: the canonical parameters (:mod:`jax_wgrad.models.gpt.params`) in their
  dtype, the same arrays whatever the ``(dp, tp, pp)`` layout or optimizer mode;
* ``opt``: the optimizer state in the same canonical form -- the fp32 main parameters
  (``master``: the optimizer's fp32 copy of bf16 parameters, the parameters themselves when
  they are fp32; Megatron saves its fp32 main parameters in the optimizer state too) and
  every optax moment as a canonical parameter tree (bucket shards of the distributed
  optimizer are gathered, :meth:`DistributedOptimizer.state_to_tree`), counts as scalars;
* ``meta`` (JSON): step, data position, seed and the three configs.

So a checkpoint loads onto ANY layout, with or without the distributed optimizer
(restored straight into the new mesh's shardings, then re-sharded into the new plan's
buckets) -- what Megatron needs offline conversion tools for -- and with either parameter
dtype: with the optimizer state, the parameters are the saved fp32 main parameters cast to
the run's ``params_dtype`` (so a bf16 run continues exactly, and a run with the other dtype
starts from the fp32 values); without it (``load_optim=False``, a parameters-only
checkpoint) the saved parameters are cast. Saves are asynchronous (the
step loop goes on while orbax writes) and atomic (orbax writes into a temporary directory
and renames it when complete, so a save killed half-way never becomes the latest
checkpoint). A checkpoint of a differently shaped model fails to load with a message
naming the mismatch.

A directory is written by one run at a time: a saving checkpointer holds an exclusive
``flock`` on it (:meth:`Checkpointer.lock`) until it is closed or its process ends, and a
second one is refused in one line (:class:`CheckpointWriteError`). Each save first checks
that the checkpoint fits in the free space; a write the file system refuses all the same
(full, a quota) is one :class:`CheckpointWriteError` too, its half-written step removed and
the complete steps before it intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import inspect
import json
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.optim.distributed import OptimizerState
from jax_wgrad.parallel.mesh import AXES
from jax_wgrad.training.plan import TrainPlan
from jax_wgrad.training.step import TrainState, init_optimizer_state

try:
    import fcntl
except ImportError:  # no flock (Windows): directories are not locked
    fcntl = None

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "CheckpointWriteError",
    "canonical_state",
    "state_from_canonical",
    "model_differences",
    "quiet_failed_restores",
    "save_params_checkpoint",
]


class CheckpointError(ValueError):
    """A checkpoint step that cannot be read: ``step`` and the damage, in one line."""

    def __init__(self, directory: str, step: int, damage: str):
        self.directory, self.step, self.damage = directory, step, damage
        super().__init__(f"checkpoint {directory} step {step} is damaged: {damage}")


class CheckpointWriteError(RuntimeError):
    """A checkpoint that cannot be written: the directory is another run's, or the file
    system refused the write (full, a quota); ``reason`` says which, in one line. The
    complete steps written before are intact."""

    def __init__(self, directory: str, reason: str):
        self.directory, self.reason = directory, reason
        super().__init__(f"checkpoint directory {directory}: {reason}")


def _opt_specs(plan: TrainPlan, per_device_state, specs=None) -> OptimizerState:
    """Partition specs of the optimizer state as parameter trees: the parameter specs
    (default: the layout's; ``specs``: others, e.g. the canonical ones) for every
    parameter-shaped part, replicated for the rest (counts)."""
    specs = plan.program.param_specs() if specs is None else specs
    inner = optax.tree_map_params(
        plan.optimizer.tx,
        lambda _: specs,
        per_device_state.inner,
        transform_non_params=lambda _: P(),
        is_leaf=plan.optimizer.is_main_params,
    )
    return OptimizerState(specs, inner)


def _unstacked_abstract(plan: TrainPlan, state: TrainState):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.opt_state)


def canonical_state(plan: TrainPlan, state: TrainState) -> dict[str, Any]:
    """``{"params", "opt"}`` of ``state`` in the canonical (layout-independent) form."""
    program, opt = plan.program, plan.optimizer
    out_opt = _opt_specs(plan, _unstacked_abstract(plan, state))
    canon = lambda tree: program.canonical_tree(tree)

    def body(params, opt_state):
        tree_state = opt.state_to_tree(
            jax.tree.map(lambda x: x[0], opt_state), program.device_tree(params)
        )
        return opt.map_param_parts(canon, tree_state)

    fn = jax.shard_map(
        body,
        mesh=plan.mesh,
        in_specs=(program.param_specs(), P(AXES)),
        out_specs=out_opt,
        # Off: each device's optimizer state comes in stacked under P(AXES), so the tensor
        # ranks' copies of a replicated parameter are typed as varying, which only a
        # collective could disprove (pinned by tests/test_check_vma.py).
        check_vma=False,
    )
    opt_tree = jax.jit(fn)(state.params, state.opt_state)
    # The layout's trees -> canonical ones (a reshape of interleaved layer stacks).
    return {
        "params": program.to_canonical(state.params),
        "opt": opt.map_param_parts(program.to_canonical, opt_tree),
    }


def state_from_canonical(plan: TrainPlan, template: TrainState, opt, step: int) -> TrainState:
    """The plan's :class:`TrainState` from the canonical optimizer state ``opt`` (as
    :func:`canonical_state` gives it): the parameters are its fp32 main parameters cast to
    the plan's parameter dtypes (Megatron's model parameters are always the cast of its
    main parameters; :meth:`~jax_wgrad.optim.DistributedOptimizer.to_param_dtype`), the
    optimizer state its re-sharded form. ``template``: a state of the plan (shapes and
    dtypes)."""
    program, optimizer = plan.program, plan.optimizer
    in_opt = _opt_specs(plan, _unstacked_abstract(plan, template))
    opt = optimizer.map_param_parts(program.from_canonical, opt)
    params = jax.tree.map(
        lambda m, t: optimizer.to_param_dtype(m, t.dtype), opt.master, template.params
    )

    def body(opt_state):
        state = optimizer.map_param_parts(program.device_tree, opt_state)
        return jax.tree.map(lambda x: x[None], optimizer.state_from_tree(state))

    fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(in_opt,), out_specs=P(AXES), check_vma=True)
    shardings = jax.tree.map(
        lambda s: NamedSharding(plan.mesh, s), in_opt, is_leaf=lambda x: isinstance(x, P)
    )
    opt_state = jax.jit(fn)(jax.device_put(opt, shardings))
    return TrainState(
        _step_array(plan, step), jax.device_put(params, plan.param_shardings), opt_state
    )


def _step_array(plan: TrainPlan, step: int) -> jax.Array:
    return jax.device_put(jnp.asarray(step, jnp.int32), NamedSharding(plan.mesh, P()))


class Checkpointer:
    """Asynchronous, atomic orbax checkpoints of canonical train states (module docstring).

    Args:
      directory: where the steps' checkpoints live.
      create: create ``directory`` if it is missing (for saving); a reading checkpointer
        (``create=False``) leaves the file system as it is.
    """

    def __init__(self, directory: str | os.PathLike, *, create: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self._create = create
        self._lock: _DirectoryLock | None = None
        self._locked = False  # lock() succeeded (on process 0: self._lock is held)
        self._saving: int | None = None  # the step of the save under way
        self._last_need = 0  # bytes the last space check asked for
        self._closed = False
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=self._create)
        return ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt", "meta")
        )

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        return self.manager.latest_step()

    def lock(self) -> None:
        """Makes this checkpointer the directory's only writer until :meth:`close` (or the
        end of the process: the OS drops the lock of a process that dies): an exclusive
        ``flock`` on the directory (on a file system that cannot lock a directory, on a
        ``.jax_wgrad-save.lock`` file in it), taken by process 0 of a multi-process run.
        :meth:`save` takes it too.

        Raises:
          CheckpointWriteError: another checkpointer (of this or another process) holds it.
        """
        if self._locked:
            return
        refused = None
        if jax.process_index() == 0:
            try:
                self._lock = _DirectoryLock(self.directory)
            except CheckpointWriteError as exc:
                refused = exc
        if _process_0s(int(refused is not None)):  # every process stops, or none
            raise refused or CheckpointWriteError(
                self.directory, "another run is saving checkpoints there (process 0 says)"
            )
        self._locked = True

    def space_needed(self, arrays) -> int:
        """Bytes a checkpoint of ``arrays`` (arrays or ``ShapeDtypeStruct`` s) may take
        here: their bytes plus 10% and 1 MiB for orbax's metadata (orbax compresses, so
        this bounds the arrays' share), or the newest complete step's size on disk when
        that is more."""
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays))
        latest = self.manager.latest_step()
        on_disk = 0 if latest is None else _disk_bytes(os.path.join(self.directory, str(latest)))
        return max(int(nbytes * 1.1) + (1 << 20), on_disk)

    def check_space(self, arrays, step: int) -> None:
        """Raises :class:`CheckpointWriteError` when the checkpoint of ``arrays`` at
        ``step`` may not fit in the directory's free space (:meth:`space_needed`)."""
        need = self._last_need = self.space_needed(arrays)
        free = _process_0s(shutil.disk_usage(self.directory).free)  # one verdict for all
        if free < need:
            raise CheckpointWriteError(
                self.directory,
                f"{_size(free)} free, the checkpoint of step {step} needs up to {_size(need)} "
                f"({need:,} bytes); {self._intact()}",
            )

    def save(
        self, plan: TrainPlan, state: TrainState, *, step: int, data_step: int, seed: int
    ) -> None:
        """Starts an asynchronous save of ``state`` at ``step`` (returns when the arrays
        are copied; :meth:`wait` for completion), after the save under way is complete and
        the space is checked (:meth:`check_space`).

        Raises:
          CheckpointWriteError: the directory is another run's (:meth:`lock`), too full
            for this step, or the file system refused a write of this save or the one
            before it.
        """
        self.lock()
        self.wait()
        canon = canonical_state(plan, state)
        self.check_space(canon, step)
        meta = {
            "step": step,
            "data_step": data_step,
            "seed": seed,
            "model_type": type(plan.model).__name__,
            "model": dataclasses.asdict(plan.model),
            "parallel": dataclasses.asdict(plan.parallel),
            "ddp": dataclasses.asdict(plan.ddp),
        }
        _ORBAX_QUIET.enter()  # until the save is complete (wait)
        self._saving = step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(canon["params"]),
                    opt=ocp.args.StandardSave(canon["opt"]),
                    meta=ocp.args.JsonSave(json.loads(json.dumps(meta, default=str))),
                ),
            )
        except Exception as exc:
            raise self._write_failed(exc) from None

    def restore(
        self,
        plan: TrainPlan,
        state: TrainState,
        *,
        step: int | None = None,
        load_optim: bool = True,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Loads ``step`` (default: the latest) into ``plan``'s layout.

        Args:
          state: a fresh state of the plan (gives the shapes; its optimizer state is kept
            when ``load_optim`` is False -- Megatron's ``--no-load-optim``, the optimizer
            then starts from the loaded parameters).
        Returns:
          ``(state, meta)``.
        Raises:
          ValueError: no checkpoint, or one of a model with other shapes (named).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint in {self.directory}")
        meta = self._read(
            step,
            lambda: self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"],
        )
        if not isinstance(meta, dict) or "step" not in meta or "model" not in meta:
            raise CheckpointError(self.directory, step, "its meta item holds no step and model")
        _check_model(meta, plan, self.directory, step)
        load_optim = load_optim and not meta.get("params_only", False)
        abstract = canonical_abstract(plan, state)
        # The parameters are read either way (a damaged item is reported, whatever is used);
        # orbax casts them to the run's dtype.
        items = {"params": ocp.args.StandardRestore(abstract["params"])}
        if load_optim:
            items["opt"] = ocp.args.StandardRestore(abstract["opt"])
        restored = self._read(
            step, lambda: self.manager.restore(step, args=ocp.args.Composite(**items))
        )
        if load_optim:  # the parameters: the fp32 main parameters in opt, cast
            new = state_from_canonical(plan, state, restored["opt"], int(meta["step"]))
        else:  # the optimizer starts afresh from the loaded parameters
            params = jax.device_put(
                plan.program.from_canonical(restored["params"]), plan.param_shardings
            )
            new = TrainState(
                _step_array(plan, int(meta["step"])), params, init_optimizer_state(plan, params)
            )
        return new, meta

    def restore_latest(
        self,
        plan: TrainPlan,
        state: TrainState,
        *,
        load_optim: bool = True,
        fallback: bool = False,
        log=print,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Loads the newest step; a damaged one is a :class:`CheckpointError`, or, with
        ``fallback``, is reported through ``log`` and the next older step is tried.

        Raises:
          ValueError: no checkpoint; another model (named field by field);
          CheckpointError: the newest step is damaged (without ``fallback``) or every step is.
        """
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"no checkpoint in {self.directory}")
        for k, step in enumerate(steps):
            try:
                return self.restore(plan, state, step=step, load_optim=load_optim)
            except CheckpointError as exc:
                if not fallback:
                    raise CheckpointError(
                        exc.directory,
                        exc.step,
                        exc.damage
                        + (
                            f" (--load-fallback-to-intact would try step {steps[k + 1]})"
                            if k + 1 < len(steps)
                            else ""
                        ),
                    ) from None
                log(f"{exc}; trying the previous step" if k + 1 < len(steps) else str(exc))
                self.manager.close()  # a failed restore may leave orbax's manager unusable
                self.manager = self._manager()
        raise CheckpointError(
            self.directory, steps[-1], f"no intact step among {sorted(steps)}"
        ) from None

    def _read(self, step: int, read):
        """``read()``, with any failure of the files (orbax, tensorstore, the OS) turned into
        a one-line :class:`CheckpointError` naming the step."""
        try:
            with _ORBAX_QUIET:
                return read()
        except Exception as exc:
            if _QUIET_SCOPES:  # the reports that come later, until the scope ends
                _QUIET_SCOPES[-1].arm()
            with quiet_failed_restores() as now:
                now.arm()
                gc.collect()  # the failed reads' coroutines report now, quietly
            raise CheckpointError(self.directory, step, _damage(exc)) from exc

    def wait(self) -> None:
        """Blocks until every started save is complete.

        Raises:
          CheckpointWriteError: the file system refused a write of the save (its
            half-written step is removed).
        """
        if self._saving is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as exc:
            raise self._write_failed(exc) from None
        finally:
            if self._saving is not None:
                self._saving = None
                _ORBAX_QUIET.exit()

    def close(self) -> None:
        """Waits for the save under way, then lets go of the directory (also when the
        save failed: its :class:`CheckpointWriteError` is raised after). Closing again does
        nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self.manager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            self._locked = False

    def _write_failed(self, exc: BaseException) -> CheckpointWriteError:
        """The one-line error of a save that failed with ``exc``; the step's half-written
        files are removed (by process 0), so only complete steps remain."""
        step = self._saving
        if jax.process_index() == 0 and step is not None:
            with contextlib.suppress(Exception):
                self.manager.wait_until_finished()  # nothing may still write in there
            for tmp in _unfinished(self.directory, step):
                shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(Exception):
            self.manager.reload()  # the steps on disk now
        code = _os_error_code(exc)
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        if code in (errno.ENOSPC, errno.EDQUOT):
            need = self._last_need
            reason = (
                ("the disk quota is exceeded" if code == errno.EDQUOT else "no space left")
                + f" for {what} ({_size(shutil.disk_usage(self.directory).free)} free now"
                + (f", it needs up to {_size(need)} ({need:,} bytes)" if need else "")
                + f"); {self._intact()}"
            )
        else:
            reason = f"writing {what} failed: {_damage(exc)}; {self._intact()}"
        return CheckpointWriteError(self.directory, reason)

    def _intact(self) -> str:
        latest = self.manager.latest_step()
        return (
            f"the newest complete checkpoint, step {latest}, is intact"
            if latest is not None
            else "no complete checkpoint is there"
        )


class _OrbaxQuiet:
    """While a checkpointer reads or writes (entered per restore, and from the start of a
    save to its end): orbax's event loops finish every task before they close, and orbax's
    own error log lines are dropped (each failure reaches the caller as one exception,
    which the checkpointer turns into one line).

    orbax runs a save's or restore's tensorstore operations in an event loop it closes as
    soon as the work returns or raises (``asyncio_utils._run_sync_via_new_loop``): when one
    operation fails, the others, still under way in tensorstore's threads, finish later and
    report into the closed loop ("Event loop is closed", one traceback each, often after
    the run's refusal). Counted: nested and concurrent users share one installation, and
    the last one out puts orbax back as it was. An orbax without that function keeps its
    own loops."""

    def __init__(self) -> None:
        self._users = 0
        self._guard = threading.Lock()
        self._undo: list = []

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc) -> None:
        self.exit()

    def enter(self) -> None:
        with self._guard:
            self._users += 1
            if self._users == 1:
                self._install()

    def exit(self) -> None:
        with self._guard:
            self._users -= 1
            if self._users == 0:
                while self._undo:
                    self._undo.pop()()

    def _install(self) -> None:
        try:
            from orbax.checkpoint._src import asyncio_utils
        except ImportError:  # another orbax layout: its loops as they are
            asyncio_utils = None
        original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
        if original is not None:
            asyncio_utils._run_sync_via_new_loop = _run_to_the_end
            self._undo.append(lambda: setattr(asyncio_utils, "_run_sync_via_new_loop", original))
        logger = logging.getLogger("absl")  # orbax logs through absl's logger
        logger.addFilter(_not_an_orbax_error)
        self._undo.append(lambda: logger.removeFilter(_not_an_orbax_error))


def _not_an_orbax_error(record: logging.LogRecord) -> bool:
    return not (
        record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in (record.pathname or "")
    )


_ORBAX_QUIET = _OrbaxQuiet()


def _run_to_the_end(coro):
    """``coro`` in a new event loop, closed only when no task of it is left (a failure
    waits, up to a minute, for the tasks still running, and reads their errors)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(coro)
        except Exception:
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=60))
            for task in pending:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" report at exit
            raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


class _DirectoryLock:
    """An exclusive, non-blocking ``flock`` on ``directory`` (see :meth:`Checkpointer.lock`),
    held until :meth:`release` or the end of the process."""

    FILE = ".jax_wgrad-save.lock"
    """The lock file of a file system that cannot lock a directory (NFS)."""

    def __init__(self, directory: str):
        self.fd = None
        if fcntl is None:
            return
        try:
            self.fd = _flock(directory, os.open(directory, os.O_RDONLY), "the directory's lock")
        except OSError:  # a directory this file system cannot lock: a lock file in it
            fd = os.open(os.path.join(directory, self.FILE), os.O_RDWR | os.O_CREAT, 0o644)
            self.fd = _flock(directory, fd, self.FILE + " there")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None

    def __del__(self) -> None:
        self.release()


def _flock(directory: str, fd: int, what: str) -> int:
    """``fd`` with an exclusive, non-blocking ``flock`` taken on it (closed on failure).

    Raises:
      CheckpointWriteError: another holder has it (``what`` names the lock held).
      OSError: the file system cannot lock ``fd``.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointWriteError(
            directory,
            f"another run is saving checkpoints there (it holds {what} until it ends); "
            "wait for it to end, or save to another directory",
        ) from None
    except OSError:
        os.close(fd)
        raise
    return fd


def _process_0s(value: int) -> int:
    """``value`` as process 0 has it (the same on every process of a multi-process run, so
    a decision taken on it is the same everywhere)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    halves = np.array([value >> 31, value & (2**31 - 1)], np.int32)  # int32 without x64
    high, low = (int(v) for v in multihost_utils.broadcast_one_to_all(halves))
    return (high << 31) | low


def _disk_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _size(n: int) -> str:
    """``n`` bytes in KiB, MiB or GiB, one decimal."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _unfinished(directory: str, step: int) -> list[str]:
    """The temporary directories orbax writes ``step`` into before renaming it."""
    prefix = f"{step}.orbax-checkpoint-tmp"
    with contextlib.suppress(OSError):
        return [
            os.path.join(directory, name)
            for name in os.listdir(directory)
            if name.startswith(prefix)
        ]
    return []


def _os_error_code(exc: BaseException) -> int | None:
    """The ``errno`` of the OS error behind ``exc``: an ``OSError`` in its chain, or the
    ``os_error_code`` tensorstore puts in its messages."""
    e, seen = exc, 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        found = re.search(r"os_error_code='?(\d+)", str(e))  # [os_error_code='28']
        if found:
            return int(found.group(1))
        if re.search(r"No space left on device", str(e)):
            return errno.ENOSPC
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def canonical_abstract(plan: TrainPlan, state: TrainState) -> dict[str, Any]:
    """Shapes, dtypes and target shardings of :func:`canonical_state` on ``plan``."""
    shapes = jax.eval_shape(lambda s: canonical_state(plan, s), state)
    opt_specs = _opt_specs(plan, _unstacked_abstract(plan, state), plan.program.canonical_specs())
    shard = lambda spec: NamedSharding(plan.mesh, spec)
    with_sharding = lambda tree, specs: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard(s)),
        tree,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return {
        "params": with_sharding(shapes["params"], plan.program.canonical_specs()),
        "opt": jax.tree.map(
            lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard(s)),
            opt_specs,
            shapes["opt"],
            is_leaf=lambda x: isinstance(x, P),
        ),
    }


def model_differences(meta: dict, model) -> list[tuple[str, Any, Any]]:
    """``(field, in the checkpoint, in this run)`` on which a checkpoint's model (its
    ``meta``) and ``model`` disagree: the config's type, then the fields that fix the
    parameters' shapes (``model.shape_differences``), then the fields the checkpoint
    names in ``meta["required_fields"]`` (e.g. a converted model's RoPE base)."""
    saved_type = meta.get("model_type", type(model).__name__)  # older checkpoints: the GPT
    if saved_type != type(model).__name__:
        return [("model type", saved_type, type(model).__name__)]
    out = model.shape_differences(meta.get("model", {}))
    named = {k for k, _, _ in out}
    now = json.loads(json.dumps(dataclasses.asdict(model), default=str))
    return out + [
        (k, meta["model"].get(k), now.get(k))
        for k in meta.get("required_fields", ())
        if k not in named and meta["model"].get(k) != now.get(k)
    ]


def save_params_checkpoint(
    directory: str | os.PathLike,
    model,
    params,
    *,
    source: str,
    required_fields: tuple[str, ...] = (),
    seed: int = 0,
) -> None:
    """Writes canonical ``params`` (numpy or jax arrays) of ``model`` as a PARAMETERS-ONLY
    checkpoint (step 0, no optimizer state) in ``directory``: a run loading it (``--load``)
    starts at step 0 from these parameters with a fresh optimizer (any layout), after the
    model checks of a full checkpoint plus ``required_fields`` (fields that must equal the
    run's although they fix no shape). ``source``: where the parameters came from (logged).
    """
    meta = {
        "step": 0,
        "data_step": 0,
        "seed": seed,
        "params_only": True,
        "source": source,
        "model_type": type(model).__name__,
        "model": dataclasses.asdict(model),
        "required_fields": list(required_fields),
    }
    manager = ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)),
        options=ocp.CheckpointManagerOptions(create=True),
        item_names=("params", "meta"),
    )
    manager.save(
        0,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            meta=ocp.args.JsonSave(json.loads(json.dumps(meta, default=str))),
        ),
    )
    manager.wait_until_finished()
    manager.close()


def _check_model(meta: dict, plan: TrainPlan, directory: str, step: int) -> None:
    diff = model_differences(meta, plan.model)
    if diff:
        raise ValueError(
            f"checkpoint {directory} (step {step}) was saved for a different "
            "model: "
            + "; ".join(f"{k}={a!r} in the checkpoint, {b!r} in this run" for k, a, b in diff)
        )


def _damage(exc: BaseException) -> str:
    """One line saying what is wrong with a checkpoint's files, from the (often very long,
    chained) error orbax or tensorstore raised."""
    chain, e = [], exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        text = str(e)
        if isinstance(e, KeyError) and "was not found" in text:
            found = re.search(r'Item \\?"?(\w+)\\?"? was not found', text)
            return f"item {found.group(1)!r} is missing" if found else text.strip("'\"")
        missing = re.search(r"File (\S+) not found", text)
        if isinstance(e, FileNotFoundError):
            return f"missing file {e.filename or (missing.group(1) if missing else text)}"
    # tensorstore reports an absl status ("NOT_FOUND: ...", "DATA_LOSS: ..."): the most
    # specific line of the chain.
    status = [e for e in chain if re.match(r"[A-Z_]{5,}: ", str(e))]
    e = status[-1] if status else exc
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    line = re.sub(r"\s*\[(tensorstore_spec|source locations)\b.*$", "", line)
    line = re.sub(r'Error opening "\w+" driver: ', "", line)
    line = re.sub(r"\s*See full TensorStore details:.*$", "", line)
    out = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return out if len(out) <= 300 else out[:297] + "..."


@contextlib.contextmanager
def quiet_failed_restores():
    """A scope in which a failed restore keeps its leftovers off the console.

    After an orbax restore fails, its reads still under way fail too, each reporting itself
    (asyncio's "exception was never retrieved", coroutines never awaited, tensorstore calling
    back into the closed event loop: hundreds of lines). The :class:`CheckpointError`
    already says what is wrong, once. Once a restore has failed inside the scope, those
    reports (and only those) are dropped until the scope ends: ``sys.excepthook``,
    ``sys.unraisablehook``, ``threading.excepthook``, the warning filters and the
    ``asyncio`` logger's filters are then what they were before it. Outside any scope a
    failed restore quiets only the reports it makes at once. :func:`jax_wgrad.pretrain.main`
    runs its job in one."""
    scope = _QuietScope()
    _QUIET_SCOPES.append(scope)
    try:
        yield scope
    finally:
        _QUIET_SCOPES.remove(scope)
        scope.close()


class _QuietScope:
    """One :func:`quiet_failed_restores` scope: :meth:`arm` installs the filters,
    :meth:`close` takes them off again."""

    def __init__(self) -> None:
        self._undo: list = []

    @property
    def armed(self) -> bool:
        return bool(self._undo)

    def arm(self) -> None:
        if self.armed:
            return
        closed = lambda v: isinstance(v, RuntimeError) and str(v) == "Event loop is closed"
        previous = sys.excepthook, sys.unraisablehook, threading.excepthook

        def excepthook(kind, value, tb):
            if not closed(value):
                previous[0](kind, value, tb)

        def unraisablehook(args):
            if not (closed(args.exc_value) or inspect.iscoroutine(args.object)):
                previous[1](args)

        def thread_excepthook(args):
            if not closed(args.exc_value):
                previous[2](args)

        sys.excepthook, sys.unraisablehook, threading.excepthook = (
            excepthook,
            unraisablehook,
            thread_excepthook,
        )
        self._undo.append(lambda: _set_hooks(previous))
        logger = logging.getLogger("asyncio")
        never_retrieved = lambda record: "exception was never retrieved" not in record.getMessage()
        logger.addFilter(never_retrieved)
        self._undo.append(lambda: logger.removeFilter(never_retrieved))
        filters = warnings.catch_warnings()  # restores the filters as they are now
        filters.__enter__()
        self._undo.append(lambda: filters.__exit__(None, None, None))
        warnings.filterwarnings(
            "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
        )

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()


def _set_hooks(hooks) -> None:
    sys.excepthook, sys.unraisablehook, threading.excepthook = hooks


_QUIET_SCOPES: list[_QuietScope] = []
"""The :func:`quiet_failed_restores` scopes now active, innermost last."""
