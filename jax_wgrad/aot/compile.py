"""Compile the real train step for GPUs that are not there, and report what XLA made of it.

:func:`compile_for_target` builds the :class:`~jax_wgrad.training.TrainPlan` of a layout
on compile-only devices of a GPU topology (jax's CUDA plugin: no driver, no GPU), traces
the jitted, donating train step on abstract inputs (``jax.ShapeDtypeStruct`` with the
plan's shardings: no array is created), compiles it with XLA:GPU and returns an
:class:`AotReport`: per-device memory against the target's, compile time, and the
structural facts this library promises (fused calls aliased, no bucket-sized kernel or
copy in the schedule loop, no 16-bit scatter, launches per tick, collectives overlapped).

Nothing is run, so the fused handler's test call (:func:`~jax_wgrad.ops.require_fusion`)
is skipped (``TrainPlan.create(..., check_fusion=False)``); the lowering only needs the
CUDA handler built and registered. The compile uses the flags a GPU run gets
(:data:`~jax_wgrad.training.gpu.GPU_XLA_FLAGS`) unless ``XLA_FLAGS`` sets them.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.aot import hlo
from jax_wgrad.aot.targets import GpuTarget, gpu_target, target_devices

__all__ = ["AotReport", "Collectives", "abstract_train_state", "compile_for_target",
           "compile_plan", "DEFAULT_MEM_FRACTION"]

DEFAULT_MEM_FRACTION = 0.75
"""The share of GPU memory jax's allocator takes by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""

_GiB = float(1 << 30)

FUSION_SKIPPED = "fused-handler check skipped (compile only: nothing is run)"

# op_name scopes of the library's collectives (jax.named_scope in the executor)
COLLECTIVE_GROUPS: dict[str, str] = {
    "grad_sync_in_cooldown": "cooldown reduce-scatters (data-parallel grad sync)",
    "send_recv": "pipeline permutes",
    "deferred_wgrad_ring": "deferred-wgrad ring",
}


@dataclasses.dataclass(frozen=True)
class Collectives:
    """One group of collectives: how many, how many XLA made async, and how many of those
    have compute scheduled between start and done."""

    group: str
    total: int
    asynchronous: int
    overlapped: int

    def format(self) -> str:
        if not self.total:
            return f"{self.group}: none"
        verdict = ("all overlapped with compute" if self.overlapped == self.total else
                   "none overlapped" if not self.overlapped else "partly overlapped")
        return (f"{self.group}: {self.total} ({self.asynchronous} async, {self.overlapped} "
                f"with compute between start and done): {verdict}")


@dataclasses.dataclass(frozen=True)
class AotReport:
    """What compiling the train step for a GPU target showed (per device)."""

    target: str
    """The GPU's name (``NVIDIA H100 80GB HBM3``)."""
    gpus_per_host: int
    hosts: int
    mesh_shape: tuple[int, int, int, int]
    """``(data, expert, tensor, pipeline)``."""
    num_params: int
    """The model's parameters (all devices together)."""
    device_memory: int
    """The target's memory (bytes, as CUDA reports it)."""
    mem_fraction: float
    """The share of it jax's allocator may use (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
    param_bytes: int
    """Parameters held by one device (its shards of the canonical parameters)."""
    optimizer_bytes: int
    """One device's optimizer state (fp32 master + optax state of its shard)."""
    bucket_bytes: int
    """One device's flat gradient buckets (pipeline stage 0's layout), inside temporaries."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    trace_lower_s: float
    compile_s: float
    fusion: str
    """The fused path's status: the check skipped, or fusion off."""
    wgrad_calls: int
    wgrad_aliased: int
    bucket_add_calls: int
    bucket_add_aliased: int
    loop: str | None
    """The schedule loop's while instruction (the loop that carries the buckets)."""
    bucket_sizes: tuple[int, ...]
    """Bucket lengths checked for copies/kernels inside the loop."""
    loop_bucket_ops: tuple[str, ...]
    """Instructions run every tick (the loop body and what it calls, the cooldown sync
    excepted) that write a bucket-sized array themselves (a copy or a kernel over the
    bucket, not an aliased custom call, not a collective): should be empty."""
    cooldown_bucket_ops: tuple[str, ...]
    """The same inside the cooldown sync's branch (run once per stage per step)."""
    scatters_16bit: tuple[str, ...]
    collectives: tuple[Collectives, ...]
    launches: hlo.LaunchCount | None
    """Launches per tick, from the thunk sequence (``None`` if it was not dumped)."""
    launches_per_microbatch: float | None
    """The busiest stage's launches over the schedule's ticks, per microbatch (each
    tick's tasks busy or idle as the schedule table says)."""
    num_microbatches: int
    num_ticks: int
    xla_flags: tuple[str, ...]
    """XLA options the compile was given (besides the dump)."""

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased with them + temporaries + code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.generated_code_bytes)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory * self.mem_fraction)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    def verdict(self) -> str:
        need, have = _size(self.peak_bytes), _size(self.usable_bytes)
        frac = (f"{self.mem_fraction:.0%} of {_size(self.device_memory)}, "
                "XLA_PYTHON_CLIENT_MEM_FRACTION")
        if self.fits:
            return f"fits ({need} of the {have} jax may use: {frac})"
        return (f"DOES NOT FIT: needs {need} per device, the {self.target} gives jax "
                f"{have} ({frac})")

    def format(self) -> str:
        """The report as printed by ``examples/pretrain_gpt.py --compile-only``."""
        g = _size
        other_temp = max(self.temp_bytes - self.bucket_bytes, 0)
        lines = [
            f"compiled for {self.hosts} host(s) x {self.gpus_per_host} {self.target} "
            f"(mesh data, expert, tensor, pipeline = {self.mesh_shape}), "
            f"{self.num_params / 1e6:.1f} M parameters; nothing was run",
            f"  {self.fusion}",
            f"  compile: {self.compile_s:.1f} s (trace + lower {self.trace_lower_s:.1f} s); "
            f"XLA options: {' '.join(self.xla_flags) or '(none)'}",
            "memory per device:",
            f"  parameters {g(self.param_bytes)} | optimizer state {g(self.optimizer_bytes)}"
            f" | gradient buckets {g(self.bucket_bytes)} | other temporaries "
            f"{g(other_temp)}",
            f"  XLA: arguments {g(self.argument_bytes)}, outputs {g(self.output_bytes)} "
            f"({g(self.alias_bytes)} aliased with arguments), temporaries "
            f"{g(self.temp_bytes)}; peak {g(self.peak_bytes)}",
            f"  verdict: {self.verdict()}",
            "structure:",
            f"  fused wgrad calls: {self.wgrad_calls}, aliased (in place): "
            f"{self.wgrad_aliased}; bucket_add calls: {self.bucket_add_calls}, aliased: "
            f"{self.bucket_add_aliased}",
            f"  schedule loop: {self.loop or 'not found'} ({self.num_ticks} ticks, "
            f"{self.num_microbatches} microbatches); bucket-sized kernels or copies every "
            f"tick: {_listed(self.loop_bucket_ops)}"
            + ("" if not self.cooldown_bucket_ops else
               f"; in the cooldown sync (once per step): {_listed(self.cooldown_bucket_ops)}"),
            f"  16-bit scatters: {_listed(self.scatters_16bit)}",
        ]
        lc = self.launches
        if lc is None:
            lines.append("  launches per tick: unknown (no thunk sequence)")
        else:
            busy = [k for k in lc.tasks if not k.startswith("grad_sync")]
            parts = ", ".join(f"{k} {b}" for k, (_, b) in lc.tasks.items() if k in busy)
            sync = [b for k, (_, b) in lc.tasks.items() if k not in busy]
            lines.append(
                f"  launches per tick (a tick running every task): {lc.tick(*busy)} "
                f"(loop {lc.overhead}, {parts})"
                + (f", the cooldown sync's tick +{sum(sync)}" if sync else "")
                + f"; {lc.command_buffers} command buffers holding "
                f"{lc.kernels_in_command_buffers} kernels, {lc.custom_calls_outside} custom "
                f"calls outside command buffers, {lc.conditionals} conditionals on the host"
                + (f" ({', '.join(lc.tasks_in_command_buffers)} captured as a whole in a "
                   "command buffer)" if lc.tasks_in_command_buffers else ""))
            lines.append(f"  launches per microbatch (the busiest stage's ticks / "
                         f"microbatches): {self.launches_per_microbatch:.1f}")
        lines.append("  collectives:")
        lines += [f"    {c.format()}" for c in self.collectives]
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / _GiB:.2f} GiB" if n >= _GiB else f"{n / (1 << 20):.1f} MiB"


def _listed(items) -> str:
    if not items:
        return "none"
    return f"{len(items)}: " + "; ".join(items[:4]) + (" ..." if len(items) > 4 else "")


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def abstract_train_state(plan) -> Any:
    """A :class:`~jax_wgrad.training.TrainState` of ``jax.ShapeDtypeStruct`` with the
    plan's shardings (what :func:`~jax_wgrad.training.init_train_state` would create),
    traced only: no array is made, no device is used."""
    from jax_wgrad.parallel.mesh import AXES
    from jax_wgrad.training.step import TrainState, _stack

    stages, opt, mesh = plan.stages, plan.optimizer, plan.mesh
    params = _with_shardings(jax.eval_shape(lambda: stages.init_params(0)),
                             plan.param_shardings)
    init = jax.shard_map(lambda p: _stack(opt.init(stages.device_tree(p))), mesh=mesh,
                         in_specs=(stages.param_specs(),), out_specs=P(AXES),
                         check_vma=False)
    per_device = NamedSharding(mesh, P(AXES))
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=per_device),
        jax.eval_shape(init, params))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return TrainState(step, params, opt_state)


def _device_bytes(tree) -> int:
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
    return total


def _xla_options(extra: dict[str, Any] | None) -> dict[str, Any]:
    from jax_wgrad.training.gpu import GPU_XLA_FLAGS

    env = os.environ.get("XLA_FLAGS", "")
    opts = {k.lstrip("-"): (v == "true" if v in ("true", "false") else v)
            for k, v in GPU_XLA_FLAGS.items() if k not in env}
    opts.update(extra or {})
    return opts


def compile_plan(plan, target: GpuTarget | str = "h100", *, gpus_per_host: int | None = None,
                 hosts: int = 1, xla_options: dict[str, Any] | None = None,
                 fusion: str | None = None) -> AotReport:
    """Compiles ``plan``'s train step (the plan's mesh must be of compile-only devices of
    ``target``, :func:`~jax_wgrad.aot.target_devices`) and reports on it.

    Args:
      xla_options: more XLA debug options for this compile (e.g.
        ``{"xla_gpu_enable_command_buffer": ""}``), on top of the GPU run's flags.
      fusion: the line that says how the fused path was checked (default: skipped when
        fusion is on).
    """
    from jax_wgrad.ops.registry import BUCKET_ADD_TARGET, TARGET
    from jax_wgrad.parallel.mesh import DATA_PARALLEL
    from jax_wgrad.training.step import build_train_step

    target = gpu_target(target) if isinstance(target, str) else target
    devices = plan.mesh.devices.size
    gpus_per_host = gpus_per_host or devices // hosts
    par = plan.parallel
    t0 = time.perf_counter()
    state = abstract_train_state(plan)
    tokens = jax.ShapeDtypeStruct(
        (par.global_batch_size, plan.model.seq_length + 1), jnp.int32,
        sharding=NamedSharding(plan.mesh, P(DATA_PARALLEL)))
    step = build_train_step(plan, state)
    lowered = step.trace(state, tokens).lower()
    t1 = time.perf_counter()
    opts = _xla_options(xla_options)
    with tempfile.TemporaryDirectory(prefix="jax_wgrad_aot_") as dump:
        compiled = lowered.compile({**opts, "xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        t2 = time.perf_counter()
        seq_files = (glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
                     or glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
        meta_files = glob.glob(os.path.join(dump, "*thunk_metadata.txt"))
        thunk_text = open(max(seq_files, key=os.path.getsize)).read() if seq_files else None
        meta_text = open(max(meta_files, key=os.path.getsize)).read() if meta_files else None
    text = compiled.as_text()
    mem = compiled.memory_analysis()

    buf = plan.layout.buffer
    bucket_bytes = sum(int(n) * np.dtype(d).itemsize
                       for n, d in zip(buf.bucket_numels, buf.bucket_dtypes))
    sizes = sorted({int(n) for n in buf.bucket_numels if n >= 1 << 16}
                   | {int(max(buf.bucket_numels))}, reverse=True)
    comps = hlo.computations(text)
    loop = hlo.schedule_loop(text, sizes)
    loop_ops: list[str] = []
    cooldown_ops: list[str] = []
    if loop is not None:
        cooldown: set[str] = set()
        for ins in hlo.instructions(comps[loop[1]]):
            if ins.opcode == "conditional" and "/grad_sync_in_cooldown" in ins.op_name:
                for b in hlo.branches(ins.line):
                    cooldown |= hlo.reachable(comps, b)
        every_tick = hlo.reachable(comps, loop[1]) - cooldown
        name = lambda i: f"{i.opcode} {i.name} {i.shape}"  # noqa: E731
        loop_ops = [name(i) for i in hlo.sized_ops(comps, every_tick, sizes)]
        cooldown_ops = [name(i) for i in hlo.sized_ops(comps, cooldown, sizes)]
    wgrad = hlo.custom_calls(text, TARGET)
    badd = hlo.custom_calls(text, BUCKET_ADD_TARGET)

    launches = None
    if loop is not None and thunk_text and meta_text:
        op_names = {i.name: i.op_name for i in hlo.instructions(text.splitlines())}
        launches = hlo.loop_launches(hlo.parse_thunks(thunk_text), hlo.thunk_names(meta_text),
                                     loop[0], op_names)

    # jax's GPU allocator is capped at this share whether it preallocates or not.
    frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return AotReport(
        target=target.description, gpus_per_host=gpus_per_host, hosts=hosts,
        mesh_shape=tuple(int(plan.mesh.shape[a]) for a in plan.mesh.axis_names),
        num_params=sum(int(np.prod(a.shape, dtype=np.int64))
                       for a in jax.tree.leaves(state.params)),
        device_memory=target.memory_bytes, mem_fraction=frac,
        param_bytes=_device_bytes(state.params), optimizer_bytes=_device_bytes(state.opt_state),
        bucket_bytes=bucket_bytes, argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        generated_code_bytes=mem.generated_code_size_in_bytes,
        trace_lower_s=t1 - t0, compile_s=t2 - t1,
        fusion=fusion or (FUSION_SKIPPED if par.gradient_accumulation_fusion
                          else "gradient accumulation fusion off"),
        wgrad_calls=len(wgrad), wgrad_aliased=sum(map(hlo.aliased, wgrad)),
        bucket_add_calls=len(badd), bucket_add_aliased=sum(map(hlo.aliased, badd)),
        loop=None if loop is None else loop[0], bucket_sizes=tuple(sizes),
        loop_bucket_ops=tuple(loop_ops), cooldown_bucket_ops=tuple(cooldown_ops),
        scatters_16bit=tuple(f"{i.name} {i.shape}" for i in hlo.scatters_16bit(text)),
        collectives=_collectives(comps),
        launches=launches,
        launches_per_microbatch=None if launches is None else _per_microbatch(launches,
                                                                              plan.table),
        num_microbatches=par.num_microbatches,
        num_ticks=plan.table.num_ticks,
        xla_flags=tuple(f"--{k}={v}".replace("=True", "=true").replace("=False", "=false")
                        for k, v in opts.items()))


def _per_microbatch(lc: hlo.LaunchCount, table) -> float:
    rows = {"forward": np.asarray(table.forward), "backward": np.asarray(table.backward),
            "weight_gradients": np.asarray(table.weight)}
    most = 0
    for s in range(table.num_stages):
        n = 0
        for t in range(table.num_ticks):
            n += lc.overhead
            for key, (idle, busy) in lc.tasks.items():
                key = key.rstrip("'")
                on = (rows[key][t, s] >= 0 if key in rows else
                      t == table.last_grad_tick(s) if key == "grad_sync_in_cooldown" else True)
                n += busy if on else idle
        most = max(most, n)
    return most / table.num_microbatches


def _collectives(comps) -> tuple[Collectives, ...]:
    asyncs = hlo.async_collectives(comps)
    syncs = hlo.sync_collectives(comps)

    def group(op_name: str) -> str:
        for scope, name in COLLECTIVE_GROUPS.items():
            if f"/{scope}" in op_name:
                return name
        return "other"

    out = []
    for name in [*COLLECTIVE_GROUPS.values(), "other"]:
        a = [c for c in asyncs if group(c.op_name) == name]
        s = [i for i in syncs if group(i.op_name) == name]
        out.append(Collectives(name, len(a) + len(s), len(a), sum(c.overlapped for c in a)))
    return tuple(out)


def compile_for_target(model, parallel, ddp=None, *, target: GpuTarget | str = "h100",
                       gpus_per_host: int = 1, hosts: int = 1, tx=None,
                       xla_options: dict[str, Any] | None = None) -> AotReport:
    """Compiles the train step of ``model`` laid out as ``parallel`` for ``hosts`` hosts
    of ``gpus_per_host`` GPUs ``target`` each, without a GPU, and reports on it.

    Args:
      model, parallel, ddp: the run's configs (``parallel.world_size`` is set to the
        target's GPU count).
      target: ``"h100"``, ``"h200"`` or a :class:`~jax_wgrad.aot.GpuTarget`.
      tx: the optax transformation (default: Megatron's AdamW, lr 1e-4).
      xla_options: see :func:`compile_plan`.
    Raises:
      RuntimeError: jax's CUDA plugin is missing, or the fused path cannot be lowered
        (the CUDA handler was not built or could not be imported; the message says why).
      ValueError: a layout that does not fit the GPU count or the model.
    """
    from jax_wgrad.grads.config import DDPConfig
    from jax_wgrad.parallel.mesh import make_mesh
    from jax_wgrad.training.plan import TrainPlan
    from jax_wgrad.training.step import default_optimizer

    target = gpu_target(target) if isinstance(target, str) else target
    devices = target_devices(target, gpus_per_host, hosts)
    parallel = dataclasses.replace(parallel, world_size=len(devices))
    plan = TrainPlan.create(model, parallel, make_mesh(parallel, devices),
                            tx if tx is not None else default_optimizer(1e-4),
                            ddp=ddp or DDPConfig(), check_fusion=False)
    return compile_plan(plan, target, gpus_per_host=gpus_per_host, hosts=hosts,
                        xla_options=xla_options)
