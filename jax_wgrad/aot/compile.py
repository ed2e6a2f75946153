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
import functools
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.aot import estimate, hlo, thunks
from jax_wgrad.aot.report import DEFAULT_MEM_FRACTION, FUSION_SKIPPED, AotReport, collectives
from jax_wgrad.aot.targets import GpuTarget, gpu_target, target_devices
from jax_wgrad.parallel.mesh import mesh_shape
from jax_wgrad.parallel.pipeline import scopes

__all__ = [
    "FIGURES_JAX_VERSION",
    "CompiledProgram",
    "GemmTilingError",
    "abstract_train_state",
    "compile_for_target",
    "compile_plan",
    "compile_program",
    "estimate_compiled",
    "gemm_tiling_error",
    "older_jax_note",
    "ragged_fill",
]

T = TypeVar("T")

FIGURES_JAX_VERSION = "0.12.0.1"
"""The jax (and CUDA plugin) version the compiled-step figures of the docs were made with
(docs/performance.md, docs/design/aot.md): older supported versions compile the same
step differently (more memory, bucket-sized ops in the loop, more host syncs)."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0].split("rc")[0])[:4])


def older_jax_note(version: str | None = None) -> str | None:
    """The warning a ``--compile-only`` run logs when the running jax (``version``,
    default ``jax.__version__``) is older than :data:`FIGURES_JAX_VERSION`; ``None``
    otherwise."""
    version = version or jax.__version__
    if _version(version) >= _version(FIGURES_JAX_VERSION):
        return None
    return (
        f"warning: jax {version} compiles the step differently from jax "
        f"{FIGURES_JAX_VERSION}, which the documented figures were made with (more memory "
        "and host syncs, bucket-sized ops in the schedule loop: docs/performance.md, 'jax "
        f"versions'); install jax[cuda13]>={FIGURES_JAX_VERSION} (Python >= 3.12) for them"
    )


class GemmTilingError(RuntimeError):
    """XLA:GPU found no Triton tiling for a matrix multiply it compiles without a GPU to
    autotune on (:func:`gemm_tiling_error`); the message says what to change."""


_NO_TILING = "Couldn't find output tile sizes"


def gemm_tiling_error(exc: BaseException) -> GemmTilingError | None:
    """``exc`` (XLA's ``INTERNAL: Couldn't find output tile sizes that satisfy hlo: ...``,
    dozens of lines) as one line naming the matrix multiply and what to change; ``None``
    for any other error. XLA:GPU of jax before 0.12 meets it compiling small GEMMs (a
    --hidden-size of 16 to 48, or 80) without a GPU: the default Triton tiles do not fit
    them, and there is no device to autotune other tiles or cuBLAS on."""
    text = str(exc)
    if _NO_TILING not in text:
        return None
    dot = re.search(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? dot\(", text)
    op = re.search(r'op_name="([^"]+)"', text)
    where = "/".join(op.group(1).split("/")[-3:]) if op else None
    what = " ".join(x for x in (dot.group(1) if dot else None, where and f"({where})") if x)
    older = _version(jax.__version__) < _version(FIGURES_JAX_VERSION)
    return GemmTilingError(
        f"XLA:GPU of jax {jax.__version__} found no Triton tiling for the matrix multiply "
        f"{what or '(unnamed)'} without a GPU to autotune on; set "
        "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (GEMMs through cuBLAS), "
        + (f"install jax[cuda13]>={FIGURES_JAX_VERSION}, " if older else "")
        + "or give the model larger dimensions (e.g. --hidden-size 64 or more, a "
        "multiple of 32)"
    )


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def abstract_train_state(plan) -> Any:
    """A :class:`~jax_wgrad.training.TrainState` of ``jax.ShapeDtypeStruct`` with the
    plan's shardings (what :func:`~jax_wgrad.training.init_train_state` would create),
    traced only: no array is made, no device is used."""
    from jax_wgrad.parallel.mesh import AXES
    from jax_wgrad.training.step import TrainState, _stack

    program, opt, mesh = plan.program, plan.optimizer, plan.mesh
    params = _with_shardings(jax.eval_shape(lambda: program.init_params(0)), plan.param_shardings)
    init = jax.shard_map(
        lambda p: _stack(opt.init(program.device_tree(p))),
        mesh=mesh,
        in_specs=(program.param_specs(),),
        out_specs=P(AXES),
        check_vma=True,
    )
    per_device = NamedSharding(mesh, P(AXES))
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=per_device),
        jax.eval_shape(init, params),
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return TrainState(step, params, opt_state)


def _device_bytes(tree) -> int:
    """Bytes one device holds of the abstract arrays of ``tree`` (their shard shapes)."""
    return sum(_device_numel(a) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _device_numel(a) -> int:
    """Elements one device holds of the abstract array ``a``."""
    return int(np.prod(a.sharding.shard_shape(a.shape), dtype=np.int64))


def _param_facts(params) -> tuple[int, int, int]:
    """``(elements one device holds, of which experts', bytes per element of most of
    them)`` of the abstract parameters ``params``: an expert parameter is sharded over
    the expert axis."""
    from jax_wgrad.parallel.mesh import EXPERT

    total, experts, by_size = 0, 0, {}
    for a in jax.tree.leaves(params):
        n = _device_numel(a)
        total += n
        spec = jax.tree.leaves(tuple(a.sharding.spec))
        experts += n if EXPERT in spec else 0
        size = np.dtype(a.dtype).itemsize
        by_size[size] = by_size.get(size, 0) + n
    return total, experts, max(by_size, key=by_size.get) if by_size else 4


def _xla_options(extra: dict[str, Any] | None, cuda_graph_scope: str = "kernels") -> dict[str, Any]:
    """The GPU run's flags (:func:`~jax_wgrad.training.gpu.gpu_xla_flags`) not set in
    ``XLA_FLAGS``, then ``extra``, as compile options."""
    from jax_wgrad.training.gpu import gpu_xla_flags

    env = os.environ.get("XLA_FLAGS", "")
    opts = {
        k.lstrip("-"): (v == "true" if v in ("true", "false") else v)
        for k, v in gpu_xla_flags(cuda_graph_scope).items()
        if k not in env
    }
    opts.update(extra or {})
    return opts


def read_largest_dump(dump: str, *patterns: str) -> str | None:
    """The text of the largest file of an XLA dump directory matching the first of
    ``patterns`` that matches any (the step's module, not a small helper's); ``None``."""
    for pattern in patterns:
        files = glob.glob(os.path.join(dump, pattern))
        if files:
            with open(max(files, key=os.path.getsize)) as f:
                return f.read()
    return None


def _compile_dumped(lowered, opts: dict[str, Any]):
    """``(compiled, thunk sequence text, thunk metadata text)``: compiled with ``opts``
    and a dump into a temporary directory (removed) for XLA:GPU's thunk sequence.

    Raises:
      GemmTilingError: XLA found no Triton tiling for a GEMM (:func:`gemm_tiling_error`).
    """
    with tempfile.TemporaryDirectory(prefix="jax_wgrad_aot_") as dump:
        try:
            compiled = lowered.compile({**opts, "xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        except Exception as exc:  # jax's XlaRuntimeError; one kind said in one line
            tiling = gemm_tiling_error(exc)
            if tiling is None:
                raise
            raise tiling from None
        return (
            compiled,
            read_largest_dump(
                dump, "*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"
            ),
            read_largest_dump(dump, "*thunk_metadata.txt"),
        )


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """Any program compiled for a GPU target by :func:`compile_program`, with its
    estimated run time (:mod:`jax_wgrad.aot.estimate`) and launch count."""

    compiled: Any
    """jax's ``Compiled``."""
    estimate: estimate.StepEstimate
    launches: int | None
    """Kernel launches of one run (a command buffer one launch; loops times their known
    trip counts; conditionals their busier branch); ``None`` without a thunk sequence."""
    loop_launches: int | None
    """Launches of one iteration of the outermost loop of ``loop_trips`` iterations (a
    microbatch loop), ``None`` when there is none."""
    host_syncs: float
    """Host synchronisations of one run (:func:`jax_wgrad.aot.thunks.host_syncs`)."""


def compile_program(
    lowered,
    target: GpuTarget | str = "h100",
    *,
    hosts: Sequence[int] = (0,),
    model_flops: float | None = None,
    xla_options: dict[str, Any] | None = None,
    loop_trips: int | None = None,
    cuda_graph_scope: str = "kernels",
) -> CompiledProgram:
    """Compiles a lowered program (``jax.jit(f).trace(*abstract).lower()`` on compile-only
    devices of ``target``: :func:`~jax_wgrad.aot.target_devices`) with the GPU run's XLA
    flags and estimates one run of it: any program, e.g. a plain-JAX train step beside
    the library's (``benchmarks/step_vs_plain_jax.py --compile-only``). ``hosts``: the
    host of each device of its device assignment (:class:`~jax_wgrad.aot.estimate.ModuleCosts`);
    ``loop_trips``: count one iteration of the outermost loop of that many iterations;
    ``cuda_graph_scope``: as :func:`compile_plan`'s."""
    target = gpu_target(target) if isinstance(target, str) else target
    compiled, thunk_text, meta_text = _compile_dumped(
        lowered, _xla_options(xla_options, cuda_graph_scope)
    )
    text = compiled.as_text()
    trips = hlo.trip_counts(text)
    n, loop_n = None, None
    if thunk_text and meta_text:
        parsed, names = thunks.parse_thunks(thunk_text), thunks.thunk_names(meta_text)
        by_id = {i: trips[nm] for i, nm in names.items() if trips.get(nm) is not None}
        n = thunks.launches(parsed, trips=by_id)
        loops = [
            t
            for top in parsed
            for t in top.walk()
            if t.kind == "kWhile" and loop_trips is not None and by_id.get(t.id) == loop_trips
        ]
        if loops and thunks.in_command_buffer(parsed, loops[0].id):
            loop_n = 0  # a CUDA graph's while node: launched with its graph
        elif loops:
            per = thunks.launches([loops[0]], trips=by_id)
            loop_n = per // loop_trips
    est = estimate_compiled(
        text,
        estimate.PEAKS[target.name],
        thunk_text=thunk_text,
        meta_text=meta_text,
        hosts=hosts,
        model_flops=model_flops,
    )
    return CompiledProgram(compiled, est, n, loop_n, est.cost.host_syncs)


def ragged_fill(plan, routing_skew: float = 1.0) -> float:
    """The share of a dropless expert buffer's rows its ragged grouped GEMMs compute in
    ``plan``'s train step: the routed rows of the busiest expert rank, ``routing_skew``
    times the balanced ``T k`` (``T`` = one microbatch's tokens per rank at the
    dispatcher, ``b s / tp`` under sequence parallelism), over the receive buffer's
    :func:`~jax_wgrad.functional.moe_dispatch.receive_rows` (``ep T k`` rows, or
    ``ceil(f T k)`` with ``--moe-dropless-buffer-factor f``); at most 1. 1 for a model
    without dropless experts or one expert rank (its buffer is the ``T k`` routed rows).

    Raises:
      ValueError: ``routing_skew`` is not a finite number >= 1.
    """
    from jax_wgrad.functional.moe_dispatch import receive_rows

    if not (isinstance(routing_skew, (int, float)) and 1.0 <= routing_skew < float("inf")):
        raise ValueError(
            f"routing_skew must be a finite number >= 1 (the busiest expert rank's routed rows "
            f"over the balanced T k), got {routing_skew}"
        )
    moe_config = getattr(plan.model, "moe_config", None)
    moe = moe_config() if moe_config is not None else None
    par = plan.parallel
    if moe is None or moe.capacity_factor is not None or par.expert_model_parallel_size == 1:
        return 1.0
    seq = plan.model.seq_length
    split = par.tensor_model_parallel_size if par.sequence_parallel else 1
    tokens_k = par.micro_batch_size * seq // split * moe.topk
    rows = receive_rows(tokens_k, par.expert_model_parallel_size, moe.dropless_buffer_factor)
    return min(1.0, routing_skew * tokens_k / rows)


def _bucket_sizes(plan) -> list[int]:
    """The bucket lengths that identify the schedule loop and bucket-sized kernels."""
    numels = plan.layout.buffer.bucket_numels
    return sorted({int(n) for n in numels if n >= 1 << 16} | {int(max(numels))}, reverse=True)


def estimate_compiled(
    text: str,
    peaks: estimate.Peaks,
    *,
    plan=None,
    thunk_text: str | None = None,
    meta_text: str | None = None,
    hosts: Sequence[int] | None = None,
    model_flops: float | None = None,
    fill: float = 1.0,
) -> estimate.StepEstimate:
    """The estimated step of a compiled module on ``peaks``' device
    (:func:`jax_wgrad.aot.estimate.estimate_step`): with ``plan`` (the train step of a
    :class:`~jax_wgrad.training.TrainPlan`) its schedule loop's ticks busy or idle as the
    plan's table says and the model's FLOPs (``flops_per_step``, if the model config has
    it) for the MFU; with XLA:GPU's thunk sequence and metadata (``*thunk_sequence*.txt``,
    ``*thunk_metadata.txt``) the kernels in CUDA graphs and the host syncs. ``hosts``: the
    host of each device of the program (default: the plan's mesh devices'
    ``process_index`` in mesh order -- the logical ids collectives name -- else one
    device). ``fill``: the share of the ragged expert GEMMs' buffer rows charged
    (:func:`ragged_fill`). Works on any backend's compiled text (``compiled.as_text()``)."""
    graphed, syncs = frozenset(), None
    if thunk_text and meta_text:
        parsed, names = thunks.parse_thunks(thunk_text), thunks.thunk_names(meta_text)
        graphed = thunks.graphed_instructions(parsed, names)
        syncs = thunks.host_syncs(parsed, names, hlo.trip_counts(text))
    schedule: dict[str, Any] = {}
    if plan is not None:
        flops_of = getattr(plan.model, "flops_per_step", None)
        if model_flops is None and flops_of is not None:
            model_flops = flops_of(plan.parallel.global_batch_size)
        schedule = dict(
            loop=hlo.schedule_loop(text, _bucket_sizes(plan)),
            busy=table_busy(plan.table),
            num_ticks=plan.table.num_ticks,
            num_stages=plan.table.num_stages,
        )
    if hosts is None:
        hosts = (0,) if plan is None else [d.process_index for d in plan.mesh.devices.flat]
    return estimate.estimate_step(
        text,
        peaks,
        hosts=hosts,
        graphed=graphed,
        host_syncs=syncs,
        model_flops=model_flops,
        ragged_fill=fill,
        **schedule,
    )


def _loop_facts(text: str, comps, sizes) -> tuple[tuple[str, str] | None, list[str], list[str]]:
    """The schedule loop, and the bucket-sized kernels or copies run every tick and in the
    cooldown sync's branch (once per step)."""
    loop = hlo.schedule_loop(text, sizes)
    if loop is None:
        return None, [], []
    cooldown: set[str] = set()
    for ins in hlo.instructions(comps[loop[1]]):
        if ins.opcode == "conditional" and f"/{scopes.COOLDOWN_SYNC}" in ins.op_name:
            for b in hlo.branches(ins.line):
                cooldown |= hlo.reachable(comps, b)
    every_tick = hlo.reachable(comps, loop[1]) - cooldown
    name = lambda i: f"{i.opcode} {i.name} {i.shape}"
    return (
        loop,
        [name(i) for i in hlo.sized_ops(comps, every_tick, sizes)],
        [name(i) for i in hlo.sized_ops(comps, cooldown, sizes)],
    )


def mem_fraction() -> float:
    """``XLA_PYTHON_CLIENT_MEM_FRACTION``: the share of a GPU's memory jax's allocator may
    take (default :data:`~jax_wgrad.aot.report.DEFAULT_MEM_FRACTION`).

    Raises:
      ValueError: the variable is set to something other than a number in (0, 1].
    """
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if text is None:
        return DEFAULT_MEM_FRACTION
    try:
        frac = float(text)
    except ValueError:
        frac = float("nan")
    if not 0 < frac <= 1:  # NaN too
        raise ValueError(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={text}: must be a number in (0, 1], the share "
            f"of the GPU's memory jax may use (unset: {DEFAULT_MEM_FRACTION})"
        )
    return frac


def compile_plan(
    plan,
    target: GpuTarget | str = "h100",
    *,
    gpus_per_host: int | None = None,
    hosts: int = 1,
    xla_options: dict[str, Any] | None = None,
    fusion: str | None = None,
    cuda_graph_scope: str = "kernels",
    routing_skew: float = 1.0,
) -> AotReport:
    """Compiles ``plan``'s train step (the plan's mesh must be of compile-only devices of
    ``target``, :func:`~jax_wgrad.aot.target_devices`) and reports on it.

    Args:
      xla_options: more XLA debug options for this compile (e.g.
        ``{"xla_gpu_enable_command_buffer": ""}``), on top of the GPU run's flags.
      fusion: the line that says how the fused path was checked (default: skipped when
        fusion is on).
      cuda_graph_scope: ``"kernels"`` or ``"full_iteration"`` (every command-buffer
        type: :func:`~jax_wgrad.training.gpu.gpu_xla_flags`).
      routing_skew: the busiest expert rank's routed rows over the balanced ``T k``
        (:func:`ragged_fill`): the estimate charges the dropless experts' ragged GEMMs for
        those rows, and with a buffer larger than them reports the step charged for every
        buffer row beside it (:attr:`AotReport.buffer_estimate`).
    """
    from jax_wgrad.ops import handlers
    from jax_wgrad.parallel.mesh import DATA_PARALLEL
    from jax_wgrad.training.step import build_train_step

    # jax's GPU allocator is capped at this share whether it preallocates or not.
    frac = mem_fraction()  # before the compile: a value outside (0, 1] is refused
    fill = ragged_fill(plan, routing_skew)
    target = gpu_target(target) if isinstance(target, str) else target
    devices = plan.mesh.devices.size
    gpus_per_host = gpus_per_host or devices // hosts
    par = plan.parallel
    t0 = time.perf_counter()
    state = abstract_train_state(plan)
    tokens = jax.ShapeDtypeStruct(
        (par.global_batch_size, *plan.program.setup.sample_shape),
        plan.program.setup.sample_dtype,
        sharding=NamedSharding(plan.mesh, P(DATA_PARALLEL)),
    )
    step = build_train_step(plan, state)
    lowered = step.trace(state, tokens).lower()
    t1 = time.perf_counter()
    opts = _xla_options(xla_options, cuda_graph_scope)
    compiled, thunk_text, meta_text = _compile_dumped(lowered, opts)
    t2 = time.perf_counter()
    text = compiled.as_text()
    mem = compiled.memory_analysis()

    buf = plan.layout.buffer
    bucket_bytes = sum(
        int(n) * np.dtype(d).itemsize for n, d in zip(buf.bucket_numels, buf.bucket_dtypes)
    )
    sizes = _bucket_sizes(plan)
    comps = hlo.computations(text)
    loop, loop_ops, cooldown_ops = _loop_facts(text, comps, sizes)
    wgrad = [c for t in handlers.WGRAD_TARGETS for c in hlo.custom_calls(text, t)]
    badd = hlo.custom_calls(text, handlers.BUCKET_ADD_TARGET)

    launches = None
    if loop is not None and thunk_text and meta_text:
        op_names = {i.name: i.op_name for i in hlo.instructions(text.splitlines())}
        launches = thunks.loop_launches(
            thunks.parse_thunks(thunk_text),
            thunks.thunk_names(meta_text),
            loop[0],
            op_names,
            trips=hlo.trip_counts(text),
        )
    estimate_at = functools.partial(
        estimate_compiled,
        text,
        estimate.PEAKS[target.name],
        plan=plan,
        thunk_text=thunk_text,
        meta_text=meta_text,
    )
    step_estimate = estimate_at(fill=fill)
    buffer_estimate = estimate_at(fill=1.0) if fill < 1.0 else None
    syncs = step_estimate.cost.host_syncs if thunk_text and meta_text else None
    traffic = None if loop is None else hlo.loop_traffic(text, loop[1])
    params_per_device, expert_params, itemsize = _param_facts(state.params)

    return AotReport(
        target=target.description,
        gpus_per_host=gpus_per_host,
        hosts=hosts,
        mesh_shape=mesh_shape(plan.mesh),
        num_params=sum(
            int(np.prod(a.shape, dtype=np.int64)) for a in jax.tree.leaves(state.params)
        ),
        device_memory=target.memory_bytes,
        mem_fraction=frac,
        param_bytes=_device_bytes(state.params),
        optimizer_bytes=_device_bytes(state.opt_state),
        bucket_bytes=bucket_bytes,
        argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        generated_code_bytes=mem.generated_code_size_in_bytes,
        trace_lower_s=t1 - t0,
        compile_s=t2 - t1,
        fusion=fusion
        or (
            FUSION_SKIPPED
            if par.gradient_accumulation_fusion
            else "gradient accumulation fusion off"
        ),
        wgrad_calls=len(wgrad),
        wgrad_aliased=sum(map(hlo.aliased, wgrad)),
        bucket_add_calls=len(badd),
        bucket_add_aliased=sum(map(hlo.aliased, badd)),
        loop=None if loop is None else loop[0],
        bucket_sizes=tuple(sizes),
        loop_bucket_ops=tuple(loop_ops),
        cooldown_bucket_ops=tuple(cooldown_ops),
        scatters_16bit=tuple(f"{i.name} {i.shape}" for i in hlo.scatters_16bit(text)),
        collectives=collectives(comps),
        launches=launches,
        launches_per_microbatch=None
        if launches is None
        else _per_microbatch(launches.overhead, launches.tasks, plan.table, float),
        num_microbatches=par.num_microbatches,
        num_ticks=plan.table.num_ticks,
        xla_flags=tuple(
            f"--{k}={v}".replace("=True", "=true").replace("=False", "=false")
            for k, v in opts.items()
        ),
        params_per_device=params_per_device,
        expert_params_per_device=expert_params,
        param_itemsize=itemsize,
        distributed_optimizer=plan.ddp.use_distributed_optimizer,
        # Megatron's distributed optimizer shards over the data-parallel group with
        # context parallelism
        data_parallel_size=par.data_context_parallel_size,
        expert_data_parallel_size=par.expert_data_parallel_size,
        memory_bandwidth=target.memory_bandwidth,
        traffic=traffic,
        traffic_per_microbatch=None
        if traffic is None
        else _per_microbatch(traffic.overhead, traffic.tasks, plan.table, lambda t: t.total),
        estimate=step_estimate,
        buffer_estimate=buffer_estimate,
        routing_skew=routing_skew,
        host_syncs_per_step=syncs,
    )


def _per_microbatch(
    overhead: T, tasks: Mapping[str, tuple[T, T]], table, size: Callable[[T], float]
) -> T:
    """The busiest stage's cost of the schedule's ticks, per microbatch: each tick costs
    ``overhead`` plus each task's ``(idle, busy)`` cost as the schedule ``table`` says
    (a tick count of launches, or a :class:`~jax_wgrad.aot.hlo.Traffic`); the stage with
    the largest ``size`` of its sum is the busiest."""
    on = table_busy(table)
    stages = []
    for s in range(table.num_stages):
        n = overhead * table.num_ticks
        for t in range(table.num_ticks):
            for key, (idle, busy) in tasks.items():
                n = n + (busy if on(key.rstrip("'"), t, s) else idle)
        stages.append(n)
    return max(stages, key=size) * (1 / table.num_microbatches)


def table_busy(table) -> Callable[[str, int, int], bool | int]:
    """``busy(task, tick, stage)``: whether the schedule ``table`` runs the task named by
    its scope (:data:`~jax_wgrad.aot.hlo.TASK_SCOPES`) in that tick on that stage (the
    cooldown sync: in the stage's ``table.sync_tick``; a conditional of no task: always),
    or the end named by its scope (:data:`~jax_wgrad.aot.hlo.END_SCOPES`: ``post`` with
    the last stage's ``F`` of chunk ``V - 1``, ``pre_backward`` with the first stage's
    ``B`` of chunk 0). The backward is a branch index: 0 idle, 1 busy, 2 the stage's
    last (with layer groups it is a switch of these three branches,
    :class:`~jax_wgrad.parallel.pipeline.executor.ScheduleRun`)."""
    rows = {
        scopes.FORWARD: np.asarray(table.forward),
        scopes.BACKWARD: np.asarray(table.backward),
        scopes.WEIGHT: np.asarray(table.weight),
    }
    ends = {
        scopes.POST: (
            rows[scopes.FORWARD],
            np.asarray(table.forward_chunk),
            table.num_stages - 1,
            -1,
        ),
        scopes.PRE_BACKWARD: (rows[scopes.BACKWARD], np.asarray(table.backward_chunk), 0, 0),
    }
    sync = [table.sync_tick(s) for s in range(table.num_stages)]
    last_backward = [table.last_grad_tick(s) for s in range(table.num_stages)]

    def busy(key: str, t: int, s: int) -> bool | int:
        if key == scopes.BACKWARD and rows[key][t, s] >= 0:
            return 2 if t == last_backward[s] else 1
        if key in rows:
            return bool(rows[key][t, s] >= 0)
        if key in ends:
            task, chunk, stage, which = ends[key]
            return s == stage and task[t, s] >= 0 and chunk[t, s] == which % table.num_chunks
        if key == scopes.COOLDOWN_SYNC:
            return t == sync[s]
        return True

    return busy


def compile_for_target(
    model,
    parallel,
    ddp=None,
    *,
    target: GpuTarget | str = "h100",
    gpus_per_host: int = 1,
    hosts: int = 1,
    tx=None,
    xla_options: dict[str, Any] | None = None,
    cuda_graph_scope: str = "kernels",
    routing_skew: float = 1.0,
) -> AotReport:
    """Compiles the train step of ``model`` laid out as ``parallel`` for ``hosts`` hosts
    of ``gpus_per_host`` GPUs ``target`` each, without a GPU, and reports on it.

    Args:
      model, parallel, ddp: the run's configs (``parallel.world_size`` is set to the
        target's GPU count).
      target: ``"h100"``, ``"h200"`` or a :class:`~jax_wgrad.aot.GpuTarget`.
      tx: the optax transformation (default: Megatron's AdamW, lr 1e-4).
      xla_options, cuda_graph_scope, routing_skew: see :func:`compile_plan`.
    Raises:
      RuntimeError: jax's CUDA plugin is missing, or the fused path cannot be lowered
        (the CUDA handler was not built or could not be imported; the message says why).
      ValueError: a layout that does not fit the GPU count or the model, or
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` not in (0, 1] (:func:`mem_fraction`).
    """
    from jax_wgrad.grads.config import DDPConfig
    from jax_wgrad.parallel.mesh import make_mesh
    from jax_wgrad.training.plan import TrainPlan
    from jax_wgrad.training.step import default_optimizer

    mem_fraction()  # checked before anything is built
    target = gpu_target(target) if isinstance(target, str) else target
    devices = target_devices(target, gpus_per_host, hosts)
    parallel = dataclasses.replace(parallel, world_size=len(devices))
    plan = TrainPlan.create(
        model,
        parallel,
        make_mesh(parallel, devices),
        tx if tx is not None else default_optimizer(1e-4),
        ddp=ddp or DDPConfig(),
        check_fusion=False,
    )
    return compile_plan(
        plan,
        target,
        gpus_per_host=gpus_per_host,
        hosts=hosts,
        xla_options=xla_options,
        cuda_graph_scope=cuda_graph_scope,
        routing_skew=routing_skew,
    )
