"""The report of a compile for a GPU target (:class:`AotReport`) and its printed form."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_wgrad.aot import estimate as estimates
from jax_wgrad.aot import hlo, thunks
from jax_wgrad.functional.attention import CORE_ATTENTION_SCOPE
from jax_wgrad.grads.finalize import DATA_PARALLEL_SYNC_SCOPE, SYNC_IN_BACKWARD_SCOPE
from jax_wgrad.parallel.pipeline import scopes

__all__ = [
    "AotReport",
    "Collectives",
    "COLLECTIVE_GROUPS",
    "DP_SYNC_SCOPES",
    "DEFAULT_MEM_FRACTION",
    "FUSION_SKIPPED",
    "collectives",
    "measured_bytes_per_parameter",
    "megatron_figures",
]

DEFAULT_MEM_FRACTION = 0.75
"""The share of GPU memory jax's allocator takes by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""

_GiB = float(1 << 30)

FUSION_SKIPPED = "fused-handler check skipped (compile only: nothing is run)"

# op_name scopes of the library's collectives (jax.named_scope in the executor)
COLLECTIVE_GROUPS: dict[str, str] = {
    SYNC_IN_BACKWARD_SCOPE: "layer groups' syncs in the last backward (data-parallel)",
    scopes.COOLDOWN_SYNC: (
        "cooldown data-parallel grad sync (reduce-scatters; all-reduces without the "
        "distributed optimizer)"
    ),
    scopes.SEND_RECV: "pipeline permutes",
    scopes.DEFERRED_RING: "deferred-wgrad ring",
    CORE_ATTENTION_SCOPE: "context-parallel exchanges (the attention core's)",
}


DP_SYNC_SCOPES: tuple[str, ...] = (
    SYNC_IN_BACKWARD_SCOPE,
    scopes.COOLDOWN_SYNC,
    DATA_PARALLEL_SYNC_SCOPE,
)
"""``op_name`` scopes of the data-parallel gradient collectives (in the stage's last
backward: the layer groups' buckets; in the schedule's cooldown; after the schedule)."""


@dataclasses.dataclass(frozen=True)
class Collectives:
    """One group of collectives: how many, how many XLA made async, how many of those
    have GEMM-class compute scheduled between start and done (overlapped), and how many
    only memory-bound kernels (:attr:`jax_wgrad.aot.hlo.AsyncCollective.overlapped`)."""

    group: str
    total: int
    asynchronous: int
    overlapped: int
    memory_bound_only: int = 0

    def format(self) -> str:
        if not self.total:
            return f"{self.group}: none"
        if self.overlapped == self.total:
            verdict = "all overlapped with compute"
        elif self.overlapped:
            verdict = "partly overlapped with compute"
        elif self.memory_bound_only:
            verdict = (
                "not overlapped with compute: only memory-bound kernels run while "
                "they are in flight"
            )
        else:
            verdict = "none overlapped"
        return (
            f"{self.group}: {self.total} ({self.asynchronous} async; "
            f"{self.overlapped} with GEMMs or custom calls between start and done, "
            f"{self.memory_bound_only} with only memory-bound kernels): {verdict}"
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measured_bytes_per_parameter(
    params_bytes: int, grad_bytes: int, optimizer_bytes: int, params_per_device: int
) -> dict[str, float]:
    """Bytes per parameter by category on one device: ``{"params", "grads", "optimizer",
    "total"}``, each category's bytes (parameters, the flat gradient buckets, the
    optimizer state) over the parameters the device holds.

    The one place the compile report computes them, from its own byte counts: the swap
    point for the library's ``jax_wgrad.optim.bytes_per_parameter(plan.optimizer)``
    (being written beside this), which derives them from the bucket layout."""
    n = max(params_per_device, 1)
    out = {"params": params_bytes / n, "grads": grad_bytes / n, "optimizer": optimizer_bytes / n}
    out["total"] = sum(out.values())
    return out


def megatron_figures(
    param_itemsize: int,
    distributed_optimizer: bool,
    data_parallel_size: int,
    expert_fraction: float = 0.0,
    expert_data_parallel_size: int | None = None,
) -> tuple[dict[str, float], str]:
    """Megatron-LM's memory per parameter (its distributed-optimizer docs): ``({"params",
    "grads", "optimizer", "total"}, the formula as text)``. (A stand-in, with
    :func:`measured_bytes_per_parameter`, for the library's
    ``jax_wgrad.optim.megatron_bytes_per_parameter`` once that has landed.)

    Parameters take ``param_itemsize`` bytes (2 with ``--bf16``, 4 in fp32), gradients 4
    (fp32 main grads); Adam's two moments 8, plus 4 for the fp32 main parameters when the
    parameters are 16-bit (fp32 parameters are their own main copy): ``2 + 4 + 12`` (bf16)
    or ``4 + 4 + 8`` (fp32). The distributed optimizer divides the optimizer's share by
    the data-parallel size, ``2 + 4 + 12/DP`` or ``4 + 4 + 8/DP``; the ``expert_fraction``
    of a device's parameters that are experts shard over the expert-data-parallel size
    instead."""
    opt = 12 if param_itemsize < 4 else 8
    div = 1.0
    formula = f"{param_itemsize} + 4 + {opt}"
    if distributed_optimizer:
        edp = expert_data_parallel_size or data_parallel_size
        div = (1 - expert_fraction) / data_parallel_size + expert_fraction / edp
        formula += f"/DP (DP {data_parallel_size}"
        if expert_fraction and edp != data_parallel_size:
            formula += (
                f"; expert parameters, {expert_fraction:.0%} here, over the expert-DP size {edp}"
            )
        formula += ")"
    out = {"params": float(param_itemsize), "grads": 4.0, "optimizer": opt * div}
    out["total"] = sum(out.values())
    return out, formula


@dataclasses.dataclass(frozen=True)
class AotReport:
    """What compiling the train step for a GPU target showed (per device)."""

    target: str
    """The GPU's name (``NVIDIA H100 80GB HBM3``)."""
    gpus_per_host: int
    hosts: int
    mesh_shape: tuple[int, int, int, int, int]
    """``(data, expert, context, tensor, pipeline)``."""
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
    launches: thunks.LaunchCount | None
    """Launches per tick, from the thunk sequence (``None`` if it was not dumped)."""
    launches_per_microbatch: float | None
    """The busiest stage's launches over the schedule's ticks, per microbatch (each
    tick's tasks busy or idle as the schedule table says)."""
    num_microbatches: int
    num_ticks: int
    xla_flags: tuple[str, ...]
    """XLA options the compile was given (besides the dump)."""
    params_per_device: int = 0
    """Parameter elements one device holds (the shards behind :attr:`param_bytes`)."""
    expert_params_per_device: int = 0
    """Of those, the experts' (sharded over the expert axis)."""
    param_itemsize: int = 4
    """Bytes per element of most of the parameters (2: bf16, 4: fp32)."""
    distributed_optimizer: bool = False
    data_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    memory_bandwidth: float = 0.0
    """The target's memory bandwidth (bytes/s), to put the traffic in time."""
    traffic: hlo.TickTraffic | None = None
    """Non-GEMM memory traffic of one tick of the schedule loop (``None``: no loop)."""
    traffic_per_microbatch: hlo.Traffic | None = None
    """The busiest stage's non-GEMM traffic over the schedule's ticks, per microbatch."""
    estimate: estimates.StepEstimate | None = None
    """The estimated step time (:mod:`jax_wgrad.aot.estimate`); its dropless experts'
    ragged GEMMs charged for the routed rows (:attr:`routing_skew`)."""
    buffer_estimate: estimates.StepEstimate | None = None
    """The same with the ragged GEMMs charged for every row of their receive buffers
    (``None``: the buffers hold just the routed rows, or no estimate)."""
    routing_skew: float = 1.0
    """The busiest expert rank's routed rows over the balanced ``T k`` the estimate
    assumes (:func:`jax_wgrad.aot.compile.ragged_fill`)."""
    host_syncs_per_step: float | None = None
    """Host synchronisations per step (conditionals and loops of unknown trip count run
    outside command buffers; ``None``: no thunk sequence)."""

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased with them + temporaries + code."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory * self.mem_fraction)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    def bytes_per_parameter(self) -> dict[str, float]:
        """Measured bytes per parameter by category (:func:`measured_bytes_per_parameter`)."""
        return measured_bytes_per_parameter(
            self.param_bytes, self.bucket_bytes, self.optimizer_bytes, self.params_per_device
        )

    def megatron_figures(self) -> tuple[dict[str, float], str]:
        """Megatron-LM's figures for this layout (:func:`megatron_figures`)."""
        return megatron_figures(
            self.param_itemsize,
            self.distributed_optimizer,
            self.data_parallel_size,
            self.expert_params_per_device / max(self.params_per_device, 1),
            self.expert_data_parallel_size,
        )

    def figures(self) -> dict[str, Any]:
        """The report's figures as plain JSON values (``--report-json``): bytes are
        per device, ``budget_bytes`` is what jax may use of the GPU's memory,
        ``non_gemm_bytes_per_microbatch`` the busiest stage's (``None`` without a
        schedule loop), ``fused_calls``/``fused_aliased`` count the fused wgrad and
        ``bucket_add`` calls together; ``fp8_gemm_calls`` (``..._by_target``) the FP8 GEMM
        kernels of the program, ``estimated_fp8_gemm_share`` their share of the counted
        FLOPs, and ``estimated_mfu`` is over ``estimated_mfu_peak_flops``, the BF16 dense
        peak, FP8 GEMMs or not (:meth:`jax_wgrad.aot.estimate.StepEstimate.figures`)."""
        lc, tpm = self.launches, self.traffic_per_microbatch
        megatron, formula = self.megatron_figures()
        return {
            "target": self.target,
            "gpus_per_host": self.gpus_per_host,
            "hosts": self.hosts,
            "mesh_shape": list(self.mesh_shape),
            "num_params": self.num_params,
            "params_per_device": self.params_per_device,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.usable_bytes,
            "device_memory_bytes": self.device_memory,
            "mem_fraction": self.mem_fraction,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth,
            "fits": self.fits,
            "params_bytes": self.param_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "grad_bytes": self.bucket_bytes,
            "temp_bytes": self.temp_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "generated_code_bytes": self.generated_code_bytes,
            "bytes_per_param": self.bytes_per_parameter(),
            "megatron_bytes_per_param": megatron,
            "megatron_formula": formula,
            "launches_per_microbatch": self.launches_per_microbatch,
            "launches_per_tick": None if lc is None else lc.tick(*_every_tick(lc.tasks)),
            "non_gemm_bytes_per_microbatch": None if tpm is None else tpm.total,
            "non_gemm_bytes_per_microbatch_by_kind": None if tpm is None else tpm.as_dict(),
            "fused_calls": self.wgrad_calls + self.bucket_add_calls,
            "fused_aliased": self.wgrad_aliased + self.bucket_add_aliased,
            "wgrad_calls": self.wgrad_calls,
            "wgrad_aliased": self.wgrad_aliased,
            "bucket_add_calls": self.bucket_add_calls,
            "bucket_add_aliased": self.bucket_add_aliased,
            "schedule_loop": self.loop,
            "loop_bucket_ops": list(self.loop_bucket_ops),
            "cooldown_bucket_ops": list(self.cooldown_bucket_ops),
            "scatters_16bit": list(self.scatters_16bit),
            "collectives": [c.as_dict() for c in self.collectives],
            "num_microbatches": self.num_microbatches,
            "num_ticks": self.num_ticks,
            "compile_s": self.compile_s,
            "trace_lower_s": self.trace_lower_s,
            "fusion": self.fusion,
            "xla_flags": list(self.xla_flags),
            "host_syncs_per_step": self.host_syncs_per_step,
            "dp_sync_overlapped": self.dp_sync_overlapped(),
            **(
                {"estimated_step_ms": None, "estimated_mfu": None}
                if self.estimate is None
                else self.estimate.figures()
            ),
            "estimated_routing_skew": self.routing_skew,
            "estimated_buffer_step_ms": None
            if self.buffer_estimate is None
            else self.buffer_estimate.seconds * 1e3,
            "estimated_buffer_mfu": None
            if self.buffer_estimate is None
            else self.buffer_estimate.mfu,
        }

    def verdict(self) -> str:
        need, have = _size(self.peak_bytes), _size(self.usable_bytes)
        frac = (
            f"{self.mem_fraction:.0%} of {_size(self.device_memory)}, "
            "XLA_PYTHON_CLIENT_MEM_FRACTION"
        )
        if self.fits:
            return f"fits ({need} of the {have} jax may use: {frac})"
        return f"DOES NOT FIT: needs {need} per device, the {self.target} gives jax {have} ({frac})"

    def _bytes_per_parameter_line(self) -> str:
        got = self.bytes_per_parameter()
        megatron, formula = self.megatron_figures()
        kind = {2: "16-bit", 4: "fp32"}.get(self.param_itemsize, f"{self.param_itemsize}-byte")
        opt = "distributed optimizer" if self.distributed_optimizer else "optimizer not sharded"
        return (
            f"bytes per parameter (the {self.params_per_device / 1e6:.1f} M parameters one "
            f"device holds): params {got['params']:.2f} | grads {got['grads']:.2f} | "
            f"optimizer {got['optimizer']:.2f} | total {got['total']:.2f}; Megatron-LM "
            f"({kind} params, fp32 grads, {opt}): {formula} = params {megatron['params']:.0f}"
            f" | grads {megatron['grads']:.0f} | optimizer {megatron['optimizer']:.2f} | "
            f"total {megatron['total']:.2f}"
        )

    def _traffic_line(self) -> str:
        tt, tpm = self.traffic, self.traffic_per_microbatch
        if tt is None or tpm is None:
            return "non-GEMM memory traffic per microbatch: unknown (no schedule loop)"
        gb = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
        kinds = ", ".join(f"{_TRAFFIC_LABELS[k]} {gb(v)}" for k, v in tpm.as_dict().items())
        time = (
            f", {tpm.total / self.memory_bandwidth * 1e3:.2f} ms at "
            f"{self.memory_bandwidth / 1e12:.2f} TB/s"
            if self.memory_bandwidth
            else ""
        )
        every = _every_tick(tt.tasks)
        per_tick = ", ".join(f"{k} {gb(b.total)}" for k, (_, b) in tt.tasks.items() if k in every)
        sync = [b.total for k, (_, b) in tt.tasks.items() if k not in every]
        return (
            f"non-GEMM memory traffic per microbatch (the busiest stage's kernels in the "
            f"schedule loop other than GEMMs and custom calls, bytes read + written): "
            f"{gb(tpm.total)}{time} ({kinds}); a busy tick: loop {gb(tt.overhead.total)}, "
            f"{per_tick}"
            + (f", the cooldown sync once per step +{gb(sum(sync))}" if sync else "")
            + (
                f" ({tt.unknown_trip_loops} loops of unknown trip count counted once)"
                if tt.unknown_trip_loops
                else ""
            )
        )

    def format(self) -> str:
        """The report as printed by ``examples/pretrain_gpt.py --compile-only``."""
        g = _size
        other_temp = max(self.temp_bytes - self.bucket_bytes, 0)
        lines = [
            f"compiled for {self.hosts} host(s) x {self.gpus_per_host} {self.target} "
            f"(mesh data, expert, context, tensor, pipeline = {self.mesh_shape}), "
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
            f"  {self._bytes_per_parameter_line()}",
            "structure:",
            f"  fused wgrad calls: {self.wgrad_calls}, aliased (in place): "
            f"{self.wgrad_aliased}; bucket_add calls: {self.bucket_add_calls}, aliased: "
            f"{self.bucket_add_aliased}",
            f"  schedule loop: {self.loop or 'not found'} ({self.num_ticks} ticks, "
            f"{self.num_microbatches} microbatches); bucket-sized kernels or copies every "
            f"tick: {_listed(self.loop_bucket_ops)}"
            + (
                ""
                if not self.cooldown_bucket_ops
                else f"; in the cooldown sync (once per step): {_listed(self.cooldown_bucket_ops)}"
            ),
            f"  16-bit scatters: {_listed(self.scatters_16bit)}",
        ]
        lc = self.launches
        if lc is None:
            lines.append("  launches per tick: unknown (no thunk sequence)")
        elif lc.in_command_buffer:
            lines.append(
                "  launches per tick: 0, the schedule loop runs inside a command buffer (a "
                "CUDA graph's while node, launched with its graph once a step); a tick "
                f"running every task holds {lc.kernels_in_command_buffers} kernels"
            )
            lines.append("  launches per microbatch: 0 (the schedule loop is in a CUDA graph)")
        else:
            busy = _every_tick(lc.tasks)
            parts = "".join(f", {k} {b}" for k, (_, b) in lc.tasks.items() if k in busy)
            sync = [b for k, (_, b) in lc.tasks.items() if k not in busy]
            nested = ""
            if lc.nested_loops:
                nested = f", of which {lc.nested_launches} in {lc.nested_loops} nested " + (
                    "loop" if lc.nested_loops == 1 else "loops"
                )
            if lc.unknown_trip_loops:
                n = lc.unknown_trip_loops
                nested += (
                    f" ({'a loop' if n == 1 else f'{n} loops'} of unknown trip count counted once)"
                )
            lines.append(
                f"  launches per tick (a tick running every task): {lc.tick(*busy)} "
                f"(loop {lc.overhead}{parts}{nested})"
                + (f", the cooldown sync's tick +{sum(sync)}" if sync else "")
                + f"; {lc.command_buffers} command buffers holding "
                f"{lc.kernels_in_command_buffers} kernels, {lc.custom_calls_outside} custom "
                f"calls outside command buffers, {lc.conditionals} conditionals on the host"
                + (
                    f" ({', '.join(lc.tasks_in_command_buffers)} captured as a whole in a "
                    "command buffer)"
                    if lc.tasks_in_command_buffers
                    else ""
                )
            )
            lines.append(
                f"  launches per microbatch (the busiest stage's ticks / "
                f"microbatches): {self.launches_per_microbatch:.1f}"
            )
        lines.append(f"  {self._traffic_line()}")
        lines.append("  collectives:")
        lines += [f"    {c.format()}" for c in self.collectives]
        lines += self._estimate_lines()
        return "\n".join(lines)

    def _dp_collectives(self) -> tuple[list, list]:
        """``(in the last backward, the others)``: the estimate's data-parallel gradient
        collectives (:data:`DP_SYNC_SCOPES`)."""
        dp = [c for c in self.estimate.collectives if any(s in c.op_name for s in DP_SYNC_SCOPES)]
        inside = [c for c in dp if SYNC_IN_BACKWARD_SCOPE in c.op_name]
        return inside, [c for c in dp if SYNC_IN_BACKWARD_SCOPE not in c.op_name]

    def dp_sync_overlapped(self) -> bool | None:
        """Whether the data-parallel gradient sync overlaps the backward in the estimate
        (Megatron's ``overlap_grad_reduce``): with layer groups, every collective synced
        in the stage's last backward is hidden behind GEMM-class work -- what the
        backward completes last (the lowest group's bucket, the parameters outside the
        groups) is synced after it, as in Megatron, and reported as exposed; without
        them, every data-parallel collective is hidden. ``None`` without an estimate or
        with no such collective."""
        if self.estimate is None:
            return None
        inside, after = self._dp_collectives()
        if not inside + after:
            return None
        return all(c.exposed_s <= 1e-9 for c in (inside or after))

    def _estimate_lines(self) -> list[str]:
        e = self.estimate
        if e is None:
            return []
        b = e.cost
        mfu = "unknown (no model FLOPs)" if e.mfu is None else f"{e.mfu:.1%}"
        exposed = [c for s in DP_SYNC_SCOPES for c in e.exposed(s)]
        lines = [
            f"estimated step on {e.peaks.name} (roofline per kernel, not a measurement: "
            "jax_wgrad.aot.estimate): "
            f"{e.seconds * 1e3:.1f} ms, MFU {mfu}",
            f"  the busiest stage: GEMM-bound kernels {b.compute_s * 1e3:.1f} ms, "
            f"memory-bound {b.memory_s * 1e3:.1f} ms, launches {b.launch_s * 1e3:.1f} ms, "
            f"exposed collectives {b.exposed_comm_s * 1e3:.1f} ms (hidden "
            f"{b.hidden_comm_s * 1e3:.1f} ms), host syncs {b.host_syncs:.0f} "
            f"({b.host_sync_s * 1e3:.2f} ms)",
        ]
        parts = sorted(e.time_by_part().items(), key=lambda kv: -kv[1])
        lines.append(
            "  where the time goes (the busiest stage, ms): "
            + ", ".join(f"{label} {t * 1e3:.1f}" for label, t in parts if t * 1e3 >= 0.05)
        )
        if e.fp8_gemms:
            lines.append(f"  {_fp8_line(e)}")
        if self.buffer_estimate is not None:
            u = self.buffer_estimate
            lines.append(
                f"  dropless experts: the ragged GEMMs charged for the routed rows, "
                f"{e.ragged_fill:.0%} of their receive buffers (routing skew "
                f"{self.routing_skew:g}: --estimate-routing-skew); for every buffer row "
                f"{u.seconds * 1e3:.1f} ms"
                + ("" if u.mfu is None else f", MFU {u.mfu:.1%}")
                + " (XLA's elementwise kernels over the buffers run over every row in both)"
            )
        if self.host_syncs_per_step is not None:
            lines.append(f"  host synchronisations per step: {self.host_syncs_per_step:.0f}")
        dp = self.dp_sync_overlapped()
        if dp is not None:
            inside, after = self._dp_collectives()
            ms = lambda cs, f: sum(f(c) * c.times for c in cs) * 1e3
            lines.append(
                "  data-parallel gradient sync: "
                + (
                    (
                        "overlapped (every collective hidden behind GEMM-class work)"
                        if not inside
                        else f"overlapped with the last backward: {len(inside)} collectives, "
                        f"{ms(inside, lambda c: c.hidden_s):.2f} of "
                        f"{ms(inside, lambda c: c.seconds):.2f} ms hidden; after it (the "
                        "buckets the backward completes last, as in Megatron): "
                        f"{ms(after, lambda c: c.exposed_s):.2f} ms exposed"
                    )
                    if dp
                    else "exposed: "
                    + "; ".join(
                        f"{c.kind} {c.name} {c.exposed_s * 1e3:.2f} ms" for c in exposed[:4]
                    )
                    + (" ..." if len(exposed) > 4 else "")
                )
            )
        return lines


_TRAFFIC_LABELS = {
    "fusion": "fusions",
    "copy": "copies",
    "memset": "memsets",
    "dynamic_update_slice": "dynamic-update-slices",
}


def _fp8_line(e: estimates.StepEstimate) -> str:
    """The estimate's FP8 GEMMs (kernels by target, their share of the FLOPs, the rate they
    are charged at) and the MFU's convention for them."""
    calls = ", ".join(f"{target} {n}" for target, n in e.fp8_gemm_calls().items())
    p = e.peaks
    return (
        f"FP8 GEMMs: {len(e.fp8_gemms)} kernels in the program ({calls}), "
        f"{e.fp8_gemm_share:.1%} of the busiest stage's counted FLOPs (GEMMs, attention), "
        f"charged at {p.sustained_gemm_flops('f8') / 1e12:.0f} TFLOP/s sustained (FP8 peak "
        f"{p.gemm_peak('f8') / 1e12:.1f}); the MFU is model FLOPs over the BF16 dense peak "
        f"({p.gemm_peak('bf16') / 1e12:.1f} TFLOP/s), as Megatron-Bridge reports FP8 runs"
    )


def _every_tick(tasks) -> list[str]:
    """The tasks that can be busy in any tick (all but the once-per-step cooldown sync)."""
    return [k for k in tasks if not k.startswith("grad_sync")]


def _size(n: int) -> str:
    return f"{n / _GiB:.2f} GiB" if n >= _GiB else f"{n / (1 << 20):.1f} MiB"


def _listed(items) -> str:
    if not items:
        return "none"
    return f"{len(items)}: " + "; ".join(items[:4]) + (" ..." if len(items) > 4 else "")


def collectives(comps) -> tuple[Collectives, ...]:
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
        out.append(
            Collectives(
                name,
                len(a) + len(s),
                len(a),
                sum(c.overlapped for c in a),
                sum(c.memory_bound_only for c in a),
            )
        )
    return tuple(out)
