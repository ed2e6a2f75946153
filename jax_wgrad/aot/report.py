"""The report of a compile for a GPU target (:class:`AotReport`) and its printed form."""

from __future__ import annotations

import dataclasses

from jax_wgrad.aot import hlo, thunks

__all__ = ["AotReport", "Collectives", "COLLECTIVE_GROUPS", "DEFAULT_MEM_FRACTION",
           "FUSION_SKIPPED", "collectives"]

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
    launches: thunks.LaunchCount | None
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
            nested = ""
            if lc.nested_loops:
                nested = (f", of which {lc.nested_launches} in {lc.nested_loops} nested "
                          + ("loop" if lc.nested_loops == 1 else "loops"))
            if lc.unknown_trip_loops:
                n = lc.unknown_trip_loops
                nested += (f" ({'a loop' if n == 1 else f'{n} loops'} of unknown trip count "
                           "counted once)")
            lines.append(
                f"  launches per tick (a tick running every task): {lc.tick(*busy)} "
                f"(loop {lc.overhead}, {parts}{nested})"
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
        out.append(Collectives(name, len(a) + len(s), len(a), sum(c.overlapped for c in a)))
    return tuple(out)
