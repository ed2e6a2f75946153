"""An estimated step time from a compiled program: a roofline over its kernels.

Nothing is run. Every kernel of the optimized HLO (``compiled.as_text()``, scheduled: text
order is run order) costs ``max(FLOPs / peak, bytes / HBM bandwidth)`` on the target
(:class:`Peaks`), plus a fixed latency per launch; every collective costs its bytes over
the link its group spans (NVLink inside a host, the network between hosts) plus a fixed
latency, and only the part not hidden behind GEMM-class kernels scheduled between its start
and done is added to the step (:class:`Cost`). Loops count their body times their trip
count; a conditional its heavier branch, except the pipeline schedule's task conditionals,
which the schedule table turns busy or idle per stage and tick (:func:`schedule_time`:
each tick as long as its slowest stage).

What each kernel does, from its shapes:

* a ``dot`` (inside a fusion or alone), cuBLAS custom call: ``2 x result x contracted``
  FLOPs at the tensor-core peak of its operands' type (TF32 for f32; FP8 for cuBLASLt's
  ``__cublas$lt$matmul$f8``, at :attr:`Peaks.f8_gemm_efficiency` of it);
* cuDNN attention (``__cudnn$fmha*``): ``4 b h s_q s_kv d`` forward, 2.5 times that
  backward, half of it under a causal mask;
* the library's fused calls (``jax_wgrad_*``): ``2 x numel(x) x out`` for the weight
  gradient, an accumulator block read and written (the FP8 one besides its transposed
  operand copies and, where it stages the block, the block once more:
  :func:`fp8_wgrad_bytes`); ``bucket_add``: each gradient read and its block read and
  written;
* the ragged grouped GEMMs of dropless experts (``jax_wgrad_ragged_*``): the FLOPs and row
  bytes of the rows they compute, ``ragged_fill`` of their buffer's rows (the routed count
  is not in the program: the caller says it, :func:`jax_wgrad.aot.compile.ragged_fill`),
  the expert weights (and for the weight gradient the fp32 ``[E, out, in]`` blocks read and
  written) in full; their time the GEMM's plus the bytes' (:func:`grouped_gemm_cost`);
* every other kernel: the bytes :func:`jax_wgrad.aot.hlo.kernel_traffic` counts.

**What it is not.** A model, not a measurement: no cache, no tile quantisation or wave
tail, every GEMM at the rate a large square one sustains and every other kernel at the
bandwidth a large copy sustains (:attr:`Peaks.gemm_efficiency`, measured on the GPU; FP8
GEMMs at :attr:`Peaks.f8_gemm_efficiency`, a published figure), no contention between a
collective and the kernels it overlaps. Its error against measured steps is stated where
it is used (``docs/performance.md``). The MFU is model FLOPs over the BF16 dense peak
whatever the GEMMs' types (:attr:`StepEstimate.mfu`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jax_wgrad.aot import hlo
from jax_wgrad.ops.fp8 import staged
from jax_wgrad.ops.handlers import FP8_TARGET, FP8_TARGET_AT

__all__ = [
    "Peaks",
    "PEAKS",
    "Cost",
    "CollectiveCost",
    "ModuleCosts",
    "group_span",
    "grouped_gemm_cost",
    "fp8_wgrad_bytes",
    "schedule_time",
    "PARTS",
    "part_of",
    "StepEstimate",
    "estimate_step",
]


def _is_f8(dtype: str) -> bool:
    """Whether ``dtype`` (an HLO element type: ``f8e4m3fn``, ``f8e5m2``, ...) is an 8-bit
    float, run at the ``f8`` tensor-core rate."""
    return dtype.startswith("f8")


@dataclasses.dataclass(frozen=True)
class Peaks:
    """A GPU's datasheet peaks, the fractions of them that its kernels sustain, and the
    fixed latencies the estimate charges. Kernel times use the sustained rates
    (``peak x efficiency``); the MFU is against the datasheet BF16 peak, as Megatron reports
    it (FP8 runs too)."""

    name: str
    tensor_flops: Mapping[str, float]
    """Dense tensor-core FLOP/s by operand type (``bf16``, ``f16``, ``f8``, ``f32``: TF32,
    XLA:GPU's default precision for fp32 dots, ``f64``)."""
    vector_flops: float
    """FP32 FLOP/s of the CUDA cores (elementwise math; rarely the bound)."""
    hbm_bandwidth: float
    """Device memory bytes/s."""
    nvlink_bandwidth: float
    """Bytes/s one GPU sends to the others of its host (one direction)."""
    network_bandwidth: float
    """Bytes/s one GPU sends to other hosts (one NIC per GPU, one direction)."""
    launch_s: float = 2.5e-6
    """Latency charged per kernel launch outside a CUDA graph (launch gap and ramp)."""
    graph_kernel_s: float = 1.0e-6
    """Latency charged per kernel inside a CUDA graph (XLA:GPU command buffer)."""
    collective_s: float = 1.0e-5
    """Latency charged per collective (NCCL's start-up per call)."""
    host_sync_s: float = 2.0e-5
    """Charged per host synchronisation (a conditional's predicate read back, the queue
    drained and refilled)."""
    gemm_efficiency: float = 1.0
    """The fraction of :attr:`tensor_flops` a large GEMM sustains (measured:
    ``benchmarks/device_peaks.py``)."""
    f8_gemm_efficiency: float | None = None
    """The fraction of the ``f8`` tensor peak a large FP8 GEMM sustains (on Hopper a smaller
    one than BF16's); ``None``: :attr:`gemm_efficiency`."""
    hbm_efficiency: float = 1.0
    """The fraction of :attr:`hbm_bandwidth` a large elementwise kernel sustains."""

    def gemm_peak(self, dtype: str) -> float:
        """The datasheet tensor-core peak for operands of ``dtype`` (an HLO type; bf16's if
        unknown)."""
        key = "f8" if _is_f8(dtype) else dtype
        return self.tensor_flops.get(key, self.tensor_flops["bf16"])

    def sustained_gemm_flops(self, dtype: str) -> float:
        """FLOP/s a GEMM of ``dtype`` operands runs at in the estimate: the peak times
        :attr:`f8_gemm_efficiency` for 8-bit floats, :attr:`gemm_efficiency` otherwise."""
        efficiency = self.gemm_efficiency
        if _is_f8(dtype) and self.f8_gemm_efficiency is not None:
            efficiency = self.f8_gemm_efficiency
        return self.gemm_peak(dtype) * efficiency

    @property
    def sustained_hbm_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves in the estimate."""
        return self.hbm_bandwidth * self.hbm_efficiency


_H100 = dict(
    tensor_flops={"bf16": 989.4e12, "f16": 989.4e12, "f8": 1978.9e12, "f32": 494.7e12},
    vector_flops=66.9e12,
    nvlink_bandwidth=450e9,
    network_bandwidth=50e9,
    # FP8 (E4M3/E5M2, per-tensor scales): PUBLISHED, not measured here (no GPU was lent
    # for it). pytorch/pytorch#143465 (Dec 2024): torch._scaled_mm, cuBLASLt's FP8
    # matmul with per-tensor scales and a bf16 result, on an H100 (the variant is not
    # stated; read as the SXM part, like the figures below): 8192^3 at 1304.5 TFLOP/s,
    # 0.66 of the 1978.9 TFLOP/s peak (16384-row shapes 1239-1347 TFLOP/s) -- against
    # BF16's 0.81 measured below. For the H200 (the same chip and clocks) the same
    # fraction, unmeasured.
    f8_gemm_efficiency=1304.5e12 / 1978.9e12,
)
PEAKS: dict[str, Peaks] = {
    # H100 SXM5 datasheet (dense, no sparsity); NVLink 4: 900 GB/s both directions;
    # one 400 Gb/s NDR NIC per GPU. Sustained on an H100 80GB HBM3 lent to this project:
    # an 8192^3 bf16 GEMM at 798 TFLOP/s, a device-to-device copy at 3.0 TB/s (read +
    # written).
    "h100": Peaks(
        "NVIDIA H100 SXM 80 GB",
        hbm_bandwidth=3.35e12,
        gemm_efficiency=798e12 / 989.4e12,
        hbm_efficiency=3.0e12 / 3.35e12,
        **_H100,
    ),
    # The same chip with HBM3e: 4.8 TB/s. Sustained on an H200 (benchmarks/device_peaks.py,
    # jax 0.11.2): an 8192^3 bf16 GEMM at 777.5 TFLOP/s, a 4 GiB elementwise kernel at
    # 4.18 TB/s (read + written).
    "h200": Peaks(
        "NVIDIA H200 SXM 141 GB",
        hbm_bandwidth=4.8e12,
        gemm_efficiency=777.5e12 / 989.4e12,
        hbm_efficiency=4.18e12 / 4.8e12,
        **_H100,
    ),
}
"""Peaks of the targets :func:`jax_wgrad.aot.gpu_target` knows."""


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds and work of running some HLO once (one device)."""

    compute_s: float = 0.0
    """Kernels whose FLOPs bound them (GEMMs, attention, the fused calls)."""
    memory_s: float = 0.0
    """Kernels whose bytes bound them."""
    launch_s: float = 0.0
    """Launch latency of every kernel."""
    exposed_comm_s: float = 0.0
    """Collective time not hidden behind GEMM-class kernels."""
    hidden_comm_s: float = 0.0
    """Collective time hidden behind them (not part of :attr:`seconds`)."""
    host_sync_s: float = 0.0
    host_syncs: float = 0.0
    """Host synchronisations (conditionals and loops run on the host)."""
    flops: float = 0.0
    """Counted FLOPs (recompute included)."""
    fp8_flops: float = 0.0
    """Of :attr:`flops`, those of GEMMs with 8-bit float operands (at the FP8 rate)."""
    hbm_bytes: float = 0.0
    comm_bytes: float = 0.0
    launches: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()
    """:attr:`seconds` by part of the model (:func:`part_of`): ``(label, seconds)``."""

    @property
    def seconds(self) -> float:
        busy = self.compute_s + self.memory_s + self.launch_s
        return busy + self.exposed_comm_s + self.host_sync_s

    @property
    def gemm_class_s(self) -> float:
        """Time of the kernels that can hide a collective (GEMM-class)."""
        return self.compute_s

    def __add__(self, other: Cost) -> Cost:
        parts = dict(self.parts)
        for label, seconds in other.parts:
            parts[label] = parts.get(label, 0.0) + seconds
        return Cost(
            *(getattr(self, f) + getattr(other, f) for f in _COST_SUMS), parts=tuple(parts.items())
        )

    def __mul__(self, k: float) -> Cost:
        return Cost(
            *(getattr(self, f) * k for f in _COST_SUMS),
            parts=tuple((label, s * k) for label, s in self.parts),
        )

    def as_part(self, label: str) -> Cost:
        """This cost, all of its :attr:`seconds` in the part ``label``."""
        return dataclasses.replace(self, parts=((label, self.seconds),) if self.seconds else ())

    def by_part(self) -> dict[str, float]:
        """:attr:`parts` as ``{label: seconds}``, in :data:`PARTS` order (the largest first
        within it is the caller's to sort)."""
        order = {label: i for i, label in enumerate(PARTS)}
        return dict(sorted(self.parts, key=lambda p: order.get(p[0], len(order))))

    def as_dict(self) -> dict[str, float]:
        d = {f: getattr(self, f) for f in _COST_SUMS}
        return {**d, "seconds": self.seconds}


_COST_SUMS = tuple(f.name for f in dataclasses.fields(Cost) if f.name != "parts")

PARTS: tuple[str, ...] = (
    "attention core",
    "attention GEMMs",
    "attention other",
    "dense MLP",
    "router",
    "permute / unpermute",
    "expert GEMMs",
    "expert activation",
    "shared expert",
    "embedding, output layer, loss",
    "deferred weight gradients",
    "optimizer",
    "tensor-parallel collectives",
    "context-parallel exchanges",
    "expert exchanges",
    "pipeline sends",
    "data-parallel gradient sync",
    "copies",
    "host syncs",
    "other",
)
"""The parts of a step the estimate's breakdown names (:func:`part_of`), in print order."""


def _scoped(op_name: str, scope: str) -> bool:
    """Whether ``op_name`` (jax's name stack: ``jit(step)/.../transpose(jvp(moe))/experts/
    dot_general``) runs under the named scope ``scope``."""
    return re.search(rf"(?:^|[/(]){re.escape(scope)}(?:[/)]|$)", op_name) is not None


def part_of(
    op_name: str, *, collective: bool = False, gemm: bool = False, copy: bool = False
) -> str:
    """The :data:`PARTS` label of a kernel (or, ``collective``, a collective's exposed
    time) from its ``op_name``'s named scopes: the model's (``attention`` with
    ``core_attention``, whose collectives are context parallelism's exchanges, ``mlp``,
    ``moe`` with :mod:`jax_wgrad.functional.moe`'s router, dispatch, experts and combine,
    ``shared_expert``, ``embedding``, ``output_layer``, ``cross_entropy``), the
    optimizer's and the executor's. ``gemm``: a GEMM-class kernel (a dot, a cuBLAS call,
    the library's GEMM calls); ``copy``: a copy, memset or dynamic-update-slice outside
    every named part."""
    from jax_wgrad.functional import moe
    from jax_wgrad.functional.attention import CORE_ATTENTION_SCOPE
    from jax_wgrad.grads.finalize import DATA_PARALLEL_SYNC_SCOPE, SYNC_IN_BACKWARD_SCOPE
    from jax_wgrad.models.gpt import modules as gpt
    from jax_wgrad.parallel.pipeline import scopes
    from jax_wgrad.training.step import OPTIMIZER_SCOPE

    inside = functools.partial(_scoped, op_name)
    if collective:
        if any(
            map(inside, (SYNC_IN_BACKWARD_SCOPE, scopes.COOLDOWN_SYNC, DATA_PARALLEL_SYNC_SCOPE))
        ):
            return "data-parallel gradient sync"
        if inside(scopes.SEND_RECV):
            return "pipeline sends"
        if inside(gpt.MOE_SCOPE) and (inside(moe.DISPATCH_SCOPE) or inside(moe.COMBINE_SCOPE)):
            return "expert exchanges"
        if inside(CORE_ATTENTION_SCOPE):  # the core's only collectives: context parallelism's
            return "context-parallel exchanges"
        return "tensor-parallel collectives"
    if inside(OPTIMIZER_SCOPE):
        return "optimizer"
    if inside(gpt.MOE_SCOPE):
        if inside(moe.EXPERTS_SCOPE):
            return "expert GEMMs" if gemm else "expert activation"
        if inside(moe.DISPATCH_SCOPE) or inside(moe.COMBINE_SCOPE):
            return "permute / unpermute"
        return "router"
    if inside(gpt.SHARED_EXPERT_SCOPE):
        return "shared expert"
    if inside(gpt.ATTENTION_SCOPE):
        if inside(CORE_ATTENTION_SCOPE):
            return "attention core"
        return "attention GEMMs" if gemm else "attention other"
    if inside(gpt.MLP_SCOPE):
        return "dense MLP"
    if any(map(inside, (gpt.EMBEDDING_SCOPE, gpt.OUTPUT_LAYER_SCOPE, gpt.CROSS_ENTROPY_SCOPE))):
        return "embedding, output layer, loss"
    if inside(scopes.DEFERRED_DRAIN) or inside(scopes.DEFERRED_RING):
        return "deferred weight gradients"
    if any(map(inside, (SYNC_IN_BACKWARD_SCOPE, scopes.COOLDOWN_SYNC, DATA_PARALLEL_SYNC_SCOPE))):
        return "data-parallel gradient sync"
    return "copies" if copy else "other"


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of the program, as the estimate saw it."""

    name: str
    kind: str
    op_name: str
    group_size: int
    crosses_hosts: bool
    bytes: float
    """Bytes one device sends (ring algorithms: ``(n - 1) / n`` of the buffer for an
    all-gather or reduce-scatter, twice that for an all-reduce)."""
    seconds: float
    hidden_s: float
    """Of :attr:`seconds`, what GEMM-class kernels between start and done hide."""
    times: float = 1.0
    """How often it runs per execution of its computation's caller chain (loops)."""

    @property
    def exposed_s(self) -> float:
        return self.seconds - self.hidden_s


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def group_span(line: str, hosts: Sequence[int]) -> tuple[int, bool]:
    """``(group size, whether a group spans hosts)`` of a collective instruction line,
    from its ``replica_groups`` (explicit lists, iota ``[a,b]<=[n]T(...)``, or jax's
    ``mesh[...] {axes}``) or a permute's ``source_target_pairs``, whose device numbers are
    logical ids (positions in the program's device assignment: a mesh's
    ``devices.flat``) on host ``hosts[id]``; a line with neither is one group of unknown
    size spanning hosts (``(0, True)``: the conservative side)."""

    def host(d: int) -> int:
        return hosts[d] if 0 <= d < len(hosts) else -1 - d  # unknown: a host of its own

    groups: list[list[int]] = []
    m = _MESH_GROUPS.search(line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        over = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        moved = np.moveaxis(ids, [names.index(a) for a in over], range(len(over)))
        groups = moved.reshape(math.prod(sizes[names.index(a)] for a in over), -1).T.tolist()
    elif (m := _IOTA_GROUPS.search(line)) is not None:
        dims = [int(x) for x in m.group(1).split(",")]
        src = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(src)).reshape(src)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        groups = ids.reshape(dims[0], -1).tolist()
    elif (m := _LIST_GROUPS.search(line)) is not None:
        groups = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    elif (m := _PAIRS.search(line)) is not None:
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        cross = any(host(a) != host(b) for a, b in pairs)
        return 2, cross
    groups = [g for g in groups if g]
    if not groups:
        return 0, True
    cross = any(len({host(d) for d in g}) > 1 for g in groups)
    return len(groups[0]), cross


def _collective_bytes(kind: str, ins: hlo.Instruction, operand_bytes: float, n: int) -> float:
    """Bytes one device sends for a collective of ``kind`` over ``n`` devices."""
    result = hlo.shape_bytes(
        hlo._tuple_elements(ins.shape)[-1] if ins.opcode.endswith("-start") else ins.shape
    )
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if kind == "all-gather":
        return share * result
    if kind == "reduce-scatter":
        return share * operand_bytes
    if kind == "all-reduce":
        return 2 * share * operand_bytes
    if kind == "all-to-all" or kind == "ragged-all-to-all":
        return share * operand_bytes
    return operand_bytes  # collective-permute, broadcast: the buffer once


_CAUSAL = re.compile(r'"mask_type":\s*"(?:PADDING_)?CAUSAL"')
"""A cuDNN attention call's causal mask in its backend config (``"mask_type": "CAUSAL"``;
jax 0.12 writes a space after the colon, older ones none)."""
_COPIES = ("copy", "copy-start", "memset", "dynamic-update-slice")
_COPY_PRIMITIVES = ("copy", "dynamic_slice", "dynamic_update_slice", "concatenate")
"""jax primitives (the last ``op_name`` component) whose kernels only move data."""
_FFI_PREFIX = "jax_wgrad_"
_RAGGED_PREFIX = "jax_wgrad_ragged_"
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_STATIC_OFFSET = re.compile(r"backend_config=\{[^}]*\boffset = (-?\d+) : i64")
"""The FFI attribute ``offset`` of a static-offset wgrad call (``backend_config={offset =
2048 : i64}``)."""


def _target(line: str) -> str:
    """A custom call's ``custom_call_target`` ("" for any other instruction)."""
    m = _TARGET.search(line)
    return m.group(1) if m else ""


def fp8_wgrad_bytes(tokens: int, d_in: int, d_out: int, *, staged: bool) -> float:
    """HBM bytes of one FP8 weight-gradient call on a GPU (:mod:`jax_wgrad.ops.fp8`,
    ``ffi/fp8_wgrad_cuda.cu``): ``main_grad[out, in] += dy[T, out]^T x[T, in]``.

    The fp8 operands (1 byte an element) are read, transposed into scratch (``x^T [in,
    T]``, ``dy^T [out, T]``: written) and read again by the GEMM -- three passes over
    ``T (in + out)`` bytes; the fp32 block ``[out, in]`` is read and written; ``staged``
    (the traced-offset form, or a static offset not 16-byte aligned:
    :func:`~jax_wgrad.ops.fp8.cuda_scratch_bytes`) copies the block into the scratch's
    slot and back besides, a second read and write of it."""
    operands = 3.0 * tokens * (d_in + d_out)
    block = 4.0 * d_out * d_in
    return operands + (4 if staged else 2) * block


def grouped_gemm_cost(flops: float, dtype: str, nbytes: float, launch: float, peaks: Peaks) -> Cost:
    """A grouped GEMM's cost: its GEMM time **plus** its bytes' time, not the larger of the
    two as a dense GEMM's roofline. Each expert's weights are read by the few tiles of its
    rows (and for the weight gradient each fp32 block read and written by the tiles of its
    own), so streaming them does not hide behind the math. Against the CUTLASS sm90 grouped
    GEMMs measured on a lent H200 (``benchmarks/ragged_gemm_gpu.py``, docs/performance.md:
    Mixtral's 8 x 2048-row experts, Qwen3-30B-A3B's 128 x 256, 64 x 256 of 2048 x 1408) the
    sum is within +5% .. -35% of the measured times (forward, input and weight gradient; the
    weight gradient of the smallest experts the worst), the larger of the two -10% .. -63%."""
    t_flops = flops / peaks.sustained_gemm_flops(dtype) if flops else 0.0
    t_bytes = nbytes / peaks.sustained_hbm_bandwidth
    return Cost(
        compute_s=t_flops,
        memory_s=t_bytes,
        launch_s=launch,
        flops=flops,
        fp8_flops=flops if _is_f8(dtype) else 0.0,
        hbm_bytes=nbytes,
        launches=1,
    )


@dataclasses.dataclass
class _InFlight:
    """An asynchronous collective between its start and its done."""

    ins: hlo.Instruction
    kind: str
    seconds: float
    nbytes: float
    group_size: int
    crosses_hosts: bool
    gemm_s: float = 0.0
    """GEMM-class kernel time scheduled since the start."""


class ModuleCosts:
    """The costs of a compiled module's computations on ``peaks``' GPU (module docstring).

    Args:
      text: ``compiled.as_text()``.
      peaks: the target's :class:`Peaks`.
      hosts: the host of each logical device id (the device assignment's order), to tell
        NVLink from network collectives; default: one host.
      graphed: names of HLO instructions XLA:GPU runs inside command buffers (CUDA graphs:
        :attr:`Peaks.graph_kernel_s` per kernel instead of :attr:`Peaks.launch_s`); default
        none.
      host_syncs: ``{conditional or while instruction name: host syncs per run}`` (the
        conditionals and loops of unknown trip count that XLA:GPU runs outside command
        buffers, :func:`jax_wgrad.aot.thunks.host_syncs`); default none.
      ragged_fill: the share of a ragged grouped GEMM's buffer rows it computes (the
        routed rows of a dropless expert buffer, :func:`jax_wgrad.aot.compile.ragged_fill`);
        default every row.
    """

    def __init__(
        self,
        text: str,
        peaks: Peaks,
        *,
        hosts: Sequence[int] = (0,),
        graphed: frozenset[str] = frozenset(),
        host_syncs: Mapping[str, int] | None = None,
        ragged_fill: float = 1.0,
    ):
        if not 0.0 < ragged_fill <= 1.0:
            raise ValueError(f"ragged_fill must be in (0, 1], got {ragged_fill}")
        self.ragged_fill = ragged_fill
        self.comps = hlo.computations(text)
        self.peaks = peaks
        self.hosts = tuple(hosts)
        self.graphed = graphed
        self.host_syncs = dict(host_syncs or {})
        self.trips = hlo.trip_counts(text)
        self.shapes = hlo._Shapes(self.comps)
        self.entry = hlo.entry_name(text)
        self.collectives: list[CollectiveCost] = []
        self.fp8_gemms: dict[str, str] = {}
        """The FP8 GEMM kernels costed so far (:meth:`kernel`): ``{instruction name: its
        custom call target, or its opcode (a fusion or dot of fp8 operands)}``."""

    # ---------------------------------------------------------------- kernels

    def _operand_shapes(self, ins: hlo.Instruction) -> list[str]:
        return [self.shapes.operand(n, k) for n, k in hlo._operands(ins)]

    def _dot_flops(self, ins: hlo.Instruction, shapes: Callable[[str], str]) -> float:
        ops = hlo._operands(ins)
        lhs = hlo._ARRAY.search(shapes(ops[0][0])) if ops else None
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
        if lhs is None or m is None:
            return 0.0
        dims = [int(d) for d in lhs.group(2).split(",") if d]
        contracted = math.prod(dims[int(i)] for i in m.group(1).split(",") if i)
        out = sum(math.prod(s) for _, s in ins.arrays())
        return 2.0 * out * contracted

    def _fused_flops(self, callee: str) -> tuple[float, str]:
        """FLOPs of the dots in a fused computation, and their operands' type."""
        body = hlo.instructions(self.comps.get(callee, ()))
        by_name = {i.name: i.shape for i in body}
        flops, dtype = 0.0, "bf16"
        for i in body:
            if i.opcode in ("dot", "scaled-dot"):
                flops += self._dot_flops(
                    i, lambda n: by_name.get(n, self.shapes.by_name.get(n, ""))
                )
                ops = hlo._operands(i)
                lhs = hlo._ARRAY.search(by_name.get(ops[0][0], "")) if ops else None
                dtype = lhs.group(1) if lhs else dtype
            elif i.opcode in ("fusion", "call") and (c := re.search(r"calls=%([\w.\-]+)", i.line)):
                f, d = self._fused_flops(c.group(1))
                flops, dtype = flops + f, d if f else dtype
        return flops, dtype

    def _custom_call(self, ins: hlo.Instruction) -> tuple[float, str, float]:
        """``(flops, operand type, hbm bytes)`` of a custom call."""
        target = _target(ins.line)
        shapes = self._operand_shapes(ins)
        arrays = [hlo._ARRAY.search(s) for s in shapes]
        dims = [[int(d) for d in a.group(2).split(",") if d] if a else [] for a in arrays]
        dtype = arrays[0].group(1) if arrays and arrays[0] else "bf16"
        io = sum(map(hlo.shape_bytes, shapes)) + hlo.shape_bytes(ins.shape)
        if target.startswith("__cudnn$fmha") and len(dims) >= 2 and len(dims[0]) == 4:
            b, sq, h, d = dims[0]
            skv = dims[1][1]
            flops = 4.0 * b * h * sq * skv * d
            if "Backward" in target:
                flops *= 2.5
            if _CAUSAL.search(ins.line):
                flops *= 0.5
            return flops, dtype, io
        if target.startswith("__cublas") and dims and len(dims) >= 2:
            m = re.search(r'"lhs_contracting_dimensions":\["?([\d"\,]*)"?\]', ins.line)
            k = (
                math.prod(dims[0][int(i)] for i in re.findall(r"\d+", m.group(1)))
                if m
                else dims[0][-1]
            )
            out = hlo._ARRAY.search(hlo._tuple_elements(ins.shape)[0])
            numel = math.prod(int(d) for d in out.group(2).split(",") if d) if out else 0
            return 2.0 * numel * k, dtype, io
        if target.startswith(_FFI_PREFIX):
            item = hlo.shape_bytes(shapes[0]) / max(math.prod(dims[0]), 1) if dims else 2
            if target.endswith("bucket_add"):
                grads = shapes[1:]
                n = sum(math.prod(d) for d in dims[1:])
                return 0.0, dtype, sum(map(hlo.shape_bytes, grads)) + 8.0 * n
            x, second = dims[0], dims[1] if len(dims) > 1 else []
            if target.startswith(_RAGGED_PREFIX) and len(dims) >= 3 and len(x) == 2:
                return self._ragged(target, dims, shapes, dtype, item)
            # a weight gradient: x [*, T, in], dy [*, T, out]; the block [*, out, in] fp32
            flops = 2.0 * math.prod(x) * (second[-1] if second else 0)
            if target in (FP8_TARGET, FP8_TARGET_AT) and len(x) == 2 and second:
                offset = _STATIC_OFFSET.search(ins.line)
                # the handler's rule (ops.fp8.staged): a traced position (no offset) or an
                # unaligned static one
                position = None if target == FP8_TARGET_AT or offset is None else int(offset[1])
                return flops, dtype, fp8_wgrad_bytes(*x, second[-1], staged=staged(position))
            block = math.prod(x[:-2]) * x[-1] * (second[-1] if second else 0) * 4.0
            return flops, dtype, hlo.shape_bytes(shapes[0]) + hlo.shape_bytes(shapes[1]) + 2 * block
        return 0.0, dtype, io

    def _ragged(
        self, target: str, dims: list[list[int]], shapes: list[str], dtype: str, item: float
    ) -> tuple[float, str, float]:
        """``(flops, operand type, hbm bytes)`` of a ragged grouped GEMM over
        :attr:`ragged_fill` of its rows: ``ragged_matmul(x [R, K], w [G, N, K] or [G, K, N],
        sizes [G]) -> [R, N]``; ``ragged_wgrad_accumulate(x [R, in], dy [R, out], sizes
        [G], block)`` into ``G`` blocks ``[out, in]`` of the accumulator's type."""
        rows = dims[0][0] * self.ragged_fill
        k = dims[0][1]
        if "ragged_matmul" in target:
            w = dims[1]
            n = math.prod(w) // max(w[0] * k, 1)
            weights = hlo.shape_bytes(shapes[1])
            return 2.0 * rows * k * n, dtype, rows * (k + n) * item + weights
        out, groups = dims[1][-1], dims[2][0]
        block = hlo.shape_bytes(shapes[3]) / max(math.prod(dims[3]), 1)
        return 2.0 * rows * k * out, dtype, rows * (k + out) * item + 2 * groups * k * out * block

    def kernel(self, ins: hlo.Instruction) -> Cost:
        """The cost of the kernel ``ins`` launches (none for control flow, collectives,
        bitcasts, tuples, ...), in its part of the model (:func:`part_of`); an FP8 GEMM is
        recorded in :attr:`fp8_gemms`."""
        cost, op_name = self._kernel(ins)
        if cost.fp8_flops:
            call = self._call_of(ins)
            self.fp8_gemms[ins.name] = ins.opcode if call is None else _target(call.line)
        if not cost.seconds:
            return cost
        copy = ins.opcode in _COPIES or op_name.rsplit("/", 1)[-1] in _COPY_PRIMITIVES
        return cost.as_part(part_of(op_name, gemm=bool(cost.flops), copy=copy))

    def _call_of(self, ins: hlo.Instruction) -> hlo.Instruction | None:
        """The custom call ``ins`` runs: itself, or the one a dynamic-slice fusion wraps
        (:func:`jax_wgrad.aot.hlo.wraps_aliased_custom_call`); ``None`` for other kernels."""
        if ins.opcode == "custom-call":
            return ins
        if ins.opcode != "fusion" or not hlo.wraps_aliased_custom_call(ins.line, self.comps):
            return None
        callee = re.search(r"calls=%([\w.\-]+)", ins.line).group(1)
        root = [l for l in self.comps[callee] if l.startswith("ROOT ")][0]
        return hlo.instructions([root])[0]

    def _kernel(self, ins: hlo.Instruction) -> tuple[Cost, str]:
        """The kernel's cost and the ``op_name`` it runs under (a dynamic-slice fusion's:
        its custom call's)."""
        if ins.allocates_only:
            return Cost(), ins.op_name
        p = self.peaks
        launch = p.graph_kernel_s if ins.name in self.graphed else p.launch_s
        op = ins.opcode
        call = self._call_of(ins)
        if call is not None:
            flops, dtype, nbytes = self._custom_call(call)
            if _RAGGED_PREFIX in call.line:
                return grouped_gemm_cost(flops, dtype, nbytes, launch, self.peaks), call.op_name
            return self._roofline(flops, dtype, nbytes, launch), call.op_name
        if op in ("fusion", "fusion-start") or op in ("dot", "convolution"):
            flops, dtype = 0.0, "bf16"
            if op in ("dot", "convolution"):
                flops = self._dot_flops(ins, lambda n: self.shapes.by_name.get(n, ""))
                ops = self._operand_shapes(ins)
                a = hlo._ARRAY.search(ops[0]) if ops else None
                dtype = a.group(1) if a else dtype
            elif (c := re.search(r"calls=%([\w.\-]+)", ins.line)) is not None:
                flops, dtype = self._fused_flops(c.group(1))
            if flops:
                io = sum(map(hlo.shape_bytes, self._operand_shapes(ins))) + hlo.shape_bytes(
                    hlo._tuple_elements(ins.shape)[0] if op == "fusion-start" else ins.shape
                )
                return self._roofline(flops, dtype, io, launch), ins.op_name
        traffic = hlo.kernel_traffic(ins, self.comps, self.shapes)
        if traffic is None:
            return Cost(), ins.op_name
        return self._roofline(0.0, "f32", traffic[1], launch), ins.op_name

    def _roofline(self, flops: float, dtype: str, nbytes: float, launch: float) -> Cost:
        t_flops = flops / self.peaks.sustained_gemm_flops(dtype) if flops else 0.0
        t_bytes = nbytes / self.peaks.sustained_hbm_bandwidth
        work = dict(
            launch_s=launch,
            flops=flops,
            fp8_flops=flops if _is_f8(dtype) else 0.0,
            hbm_bytes=nbytes,
            launches=1,
        )
        if t_flops >= t_bytes and flops:
            return Cost(compute_s=t_flops, **work)
        return Cost(memory_s=t_bytes, **work)

    # ------------------------------------------------------------ collectives

    def _collective_seconds(
        self, ins: hlo.Instruction, kind: str
    ) -> tuple[float, float, int, bool]:
        """``(seconds, bytes one device sends, group size, spans hosts)``."""
        line = ins.line
        if ins.opcode == "async-start":  # the wrapped collective's own line
            callee = re.search(r"calls=%([\w.\-]+)", line)
            for c in hlo.instructions(self.comps.get(callee.group(1), ()) if callee else ()):
                if c.opcode == kind:
                    line, ins = c.line, c
                    break
        n, cross = group_span(line, self.hosts)
        operand = sum(map(hlo.shape_bytes, self._operand_shapes(ins)))
        nbytes = _collective_bytes(kind, ins, operand, n or 2)
        bw = self.peaks.network_bandwidth if cross else self.peaks.nvlink_bandwidth
        seconds = nbytes / bw + self.peaks.collective_s if nbytes else 0.0
        return seconds, nbytes, n, cross

    # ------------------------------------------------------------ computations

    def computation(
        self,
        name: str,
        *,
        busy: bool = True,
        replace: Mapping[str, Cost] | None = None,
        record: float = 1.0,
    ) -> Cost:
        """The cost of running computation ``name`` once: its kernels in order; a
        collective's time exposed except what GEMM-class kernels between its start and
        done hide; loops times their trip counts; conditionals their heavier branch
        (``busy``) or lighter one; ``replace``: instructions whose cost is given (the
        schedule loop). ``record``: times this run counts in :attr:`collectives`."""
        replace = replace or {}
        total = Cost()
        pending: dict[str, _InFlight] = {}  # by start instruction name
        for ins in hlo.instructions(self.comps.get(name, ())):
            if ins.name in replace:
                c = replace[ins.name]
            else:
                c = self._instruction(ins, busy=busy, replace=replace, record=record)
            kind = hlo._async_kind(ins, self.comps) if ins.opcode.endswith("start") else None
            if kind is not None:
                pending[ins.name] = _InFlight(ins, kind, *self._collective_seconds(ins, kind))
                continue
            if ins.opcode.endswith("-done"):
                src = hlo._operands(ins)
                start = pending.pop(src[0][0], None) if src else None
                if start is not None:
                    total += self._settle(start, record)
                    continue
            if hlo._collective(ins.opcode) and not ins.opcode.endswith("start"):
                sync = _InFlight(ins, ins.opcode, *self._collective_seconds(ins, ins.opcode))
                total += self._settle(sync, record)
                continue
            for p in pending.values():
                p.gemm_s += c.gemm_class_s
            total += c
        for p in pending.values():  # a start whose done is elsewhere: exposed
            total += self._settle(p, record)
        return total

    def _settle(self, p: _InFlight, record: float) -> Cost:
        """The collective's done: hidden up to the GEMM-class time since its start."""
        hidden = min(p.seconds, p.gemm_s)
        if record:
            self.collectives.append(
                CollectiveCost(
                    p.ins.name,
                    p.kind,
                    p.ins.op_name,
                    p.group_size,
                    p.crosses_hosts,
                    p.nbytes,
                    p.seconds,
                    hidden,
                    record,
                )
            )
        return Cost(
            exposed_comm_s=p.seconds - hidden, hidden_comm_s=hidden, comm_bytes=p.nbytes
        ).as_part(part_of(p.ins.op_name, collective=True))

    def _instruction(self, ins: hlo.Instruction, *, busy: bool, replace, record: float) -> Cost:
        run = functools.partial(self.computation, busy=busy, replace=replace)
        syncs = self.host_syncs.get(ins.name, 0)
        sync = Cost(host_sync_s=self.peaks.host_sync_s * syncs, host_syncs=syncs).as_part(
            "host syncs"
        )
        if ins.opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", ins.line).group(1)
            n = self.trips.get(ins.name)
            if n is not None:
                return run(body, record=record * n) * n
            cond = re.search(r"condition=%([\w.\-]+)", ins.line).group(1)
            return run(body, record=record) + run(cond, record=record) + sync
        if ins.opcode == "conditional":
            options = [run(b, record=0) for b in hlo.branches(ins.line)] or [Cost()]
            pick = (max if busy else min)(range(len(options)), key=lambda i: options[i].seconds)
            if record:
                run(hlo.branches(ins.line)[pick], record=record)
            return options[pick] + sync
        if ins.opcode == "call" or (
            ins.opcode == "async-start" and hlo._async_kind(ins, self.comps) is None
        ):
            total = Cost()
            for callee in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.line):
                total += run(callee, record=record)
            return total
        return self.kernel(ins)

    def branch_costs(self, conditional: hlo.Instruction, record: float = 0) -> list[Cost]:
        """Each branch's cost (in branch order)."""
        return [self.computation(b, record=record) for b in hlo.branches(conditional.line)]


def schedule_time(
    overhead: Cost,
    tasks: Mapping[str, tuple[Cost, ...]],
    busy: Callable[[str, int, int], bool | int],
    num_ticks: int,
    num_stages: int,
) -> tuple[float, Cost]:
    """The schedule loop's time: each tick as long as its slowest stage (the ticks are
    chained by the pipeline's sends and receives), a stage's tick ``overhead`` plus each
    task's ``(idle, busy)`` cost as ``busy(task, tick, stage)`` says (a task of more
    branches, a switch: the branch of the index ``busy`` returns, e.g. the stage's last
    backward with the layer groups' syncs). Returns ``(seconds, the busiest stage's
    summed cost)``."""
    seconds, per_stage = 0.0, [Cost() for _ in range(num_stages)]
    for t in range(num_ticks):
        costs = []
        for s in range(num_stages):
            c = overhead
            for key, options in tasks.items():
                which = busy(key.rstrip("'"), t, s)
                if len(options) > 2:
                    c = c + options[min(int(which), len(options) - 1)]
                else:
                    c = c + (options[1] if which else options[0])
            costs.append(c)
            per_stage[s] = per_stage[s] + c
        seconds += max(c.seconds for c in costs)
    return seconds, max(per_stage, key=lambda c: c.seconds)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The estimated time of one step of a compiled program on one device (the busiest)."""

    seconds: float
    cost: Cost
    """The busiest pipeline stage's costs summed (the loop's ticks and everything outside
    it); :attr:`seconds` is larger when stages are busy in different ticks."""
    peaks: Peaks
    devices: int
    model_flops: float | None = None
    """Model FLOPs of a step, all devices (Megatron's formula), if known."""
    collectives: tuple[CollectiveCost, ...] = ()
    ragged_fill: float = 1.0
    """The share of the ragged expert GEMMs' buffer rows charged (:class:`ModuleCosts`)."""
    fp8_gemms: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The program's FP8 GEMM kernels (:attr:`ModuleCosts.fp8_gemms`): ``{instruction
    name: custom call target or opcode}``."""

    @property
    def mfu(self) -> float | None:
        """Model FLOPs / (step time x devices x bf16 dense peak): against the BF16 peak
        also when GEMMs run in FP8 (Megatron-Bridge's convention), so FP8 and BF16 runs
        compare."""
        if not self.model_flops or not self.seconds:
            return None
        return self.model_flops / (self.seconds * self.devices * self.peaks.gemm_peak("bf16"))

    @property
    def fp8_gemm_share(self) -> float:
        """The share of the busiest stage's counted FLOPs (every GEMM, attention's too) run
        at the FP8 rate; 0 without FP8 GEMMs."""
        return self.cost.fp8_flops / self.cost.flops if self.cost.flops else 0.0

    def fp8_gemm_calls(self) -> dict[str, int]:
        """The program's FP8 GEMM kernels by custom call target (cuBLASLt's
        ``__cublas$lt$matmul$f8`` for forward and input-gradient GEMMs, the library's
        ``jax_wgrad_fp8_wgrad_accumulate[_at]`` for weight gradients) or opcode, the most
        first (ties by name)."""
        counts = collections.Counter(self.fp8_gemms.values())
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def time_by_part(self) -> dict[str, float]:
        """Seconds of the busiest stage by part of the model (:data:`PARTS`, in that
        order), and ``"pipeline wait"``: the step's seconds beyond that stage's own (the
        ticks in which another stage is slower: the bubble and imbalance)."""
        parts = self.cost.by_part()
        wait = self.seconds - self.cost.seconds
        return {**parts, "pipeline wait": wait} if wait > 1e-9 else parts

    def exposed(self, op_scope: str) -> list[CollectiveCost]:
        """Collectives under the ``op_scope`` named scope with time not hidden."""
        return [c for c in self.collectives if op_scope in c.op_name and c.exposed_s > 1e-9]

    def figures(self) -> dict[str, object]:
        return {
            "estimated_step_ms": self.seconds * 1e3,
            "estimated_mfu": self.mfu,
            "estimated_breakdown_ms": {
                k: v * 1e3
                for k, v in self.cost.as_dict().items()
                if k.endswith("_s") or k == "seconds"
            },
            "estimated_model_flops": self.model_flops,
            "estimated_counted_flops": self.cost.flops,
            "estimated_ragged_fill": self.ragged_fill,
            "estimated_time_by_part_ms": {k: v * 1e3 for k, v in self.time_by_part().items()},
            "estimated_mfu_peak_flops": self.peaks.gemm_peak("bf16"),
            "fp8_gemm_calls": len(self.fp8_gemms),
            "fp8_gemm_calls_by_target": self.fp8_gemm_calls(),
            "estimated_fp8_gemm_share": self.fp8_gemm_share,
            "peaks": self.peaks.name,
        }


def estimate_step(
    text: str,
    peaks: Peaks,
    *,
    hosts: Sequence[int] = (0,),
    graphed: frozenset[str] = frozenset(),
    host_syncs: Mapping[str, int] | None = None,
    loop: tuple[str, str] | None = None,
    busy: Callable[[str, int, int], bool] | None = None,
    num_ticks: int = 0,
    num_stages: int = 1,
    model_flops: float | None = None,
    scopes=hlo.TASK_SCOPES,
    ragged_fill: float = 1.0,
) -> StepEstimate:
    """The estimated step of a compiled module (module docstring).

    Args:
      text: ``compiled.as_text()``.
      graphed, host_syncs: from the thunk sequence (:class:`ModuleCosts`).
      loop: ``(while instruction, body)`` of the pipeline schedule loop
        (:func:`jax_wgrad.aot.hlo.schedule_loop`), whose task conditionals (named by
        ``scopes``) are busy in tick ``t`` on stage ``s`` when ``busy(task, t, s)``; the
        loop runs ``num_ticks`` ticks over ``num_stages`` stages (:func:`schedule_time`).
        ``None``: the module has no such loop (its loops count their trip counts).
      hosts: the host of each device of the program, in its device assignment's order
        (:class:`ModuleCosts`); their number is the devices the MFU divides by.
      ragged_fill: the share of the ragged expert GEMMs' buffer rows they compute
        (:class:`ModuleCosts`).
    """
    mc = ModuleCosts(
        text, peaks, hosts=hosts, graphed=graphed, host_syncs=host_syncs, ragged_fill=ragged_fill
    )
    if loop is None or busy is None:
        cost = mc.computation(mc.entry)
        return StepEstimate(
            cost.seconds,
            cost,
            peaks,
            len(mc.hosts),
            model_flops,
            tuple(mc.collectives),
            ragged_fill,
            dict(mc.fp8_gemms),
        )
    name, body = loop
    conds = [i for i in hlo.instructions(mc.comps.get(body, ())) if i.opcode == "conditional"]
    tasks: dict[str, tuple[Cost, ...]] = {}

    def sync_of(ins: hlo.Instruction) -> Cost:
        syncs = mc.host_syncs.get(ins.name, 0)
        return Cost(host_sync_s=peaks.host_sync_s * syncs, host_syncs=syncs).as_part("host syncs")

    # The ends nested in the tasks (hlo.END_SCOPES): a task is charged with their idle
    # branch, and each end is a task of its own, busy (its heavier branch besides) where
    # the table runs it.
    ends: dict[str, Cost] = {}
    for ins in conds:
        inside = set().union(*(hlo.reachable(mc.comps, b) for b in hlo.branches(ins.line)))
        for c in sorted(inside):
            for nested in hlo.instructions(mc.comps.get(c, ())):
                key = hlo.task_of(nested.op_name, hlo.END_SCOPES)
                if nested.opcode != "conditional" or key not in hlo.END_SCOPES:
                    continue
                options = sorted(mc.branch_costs(nested, record=1), key=lambda c: c.seconds)
                ends[nested.name] = options[0] + sync_of(nested)
                tasks[key] = (Cost(), tasks.get(key, (Cost(), Cost()))[1] + options[-1])
    for ins in conds:
        key = hlo.task_of(ins.op_name, scopes)
        while key in tasks:
            key += "'"
        branches = [mc.computation(b, record=1, replace=ends) for b in hlo.branches(ins.line)] or [
            Cost()
        ]
        if len(branches) > 2:  # a switch: its branches in index order (``busy``'s index)
            tasks[key] = tuple(b + sync_of(ins) for b in branches)
            continue
        options = sorted(branches, key=lambda c: c.seconds)
        tasks[key] = (options[0] + sync_of(ins), options[-1] + sync_of(ins))
    overhead = mc.computation(body, replace={i.name: Cost() for i in conds})
    loop_s, loop_cost = schedule_time(overhead, tasks, busy, num_ticks, num_stages)
    outside = mc.computation(mc.entry, replace={name: Cost()})
    return StepEstimate(
        outside.seconds + loop_s,
        outside + loop_cost,
        peaks,
        len(mc.hosts),
        model_flops,
        tuple(mc.collectives),
        ragged_fill,
        dict(mc.fp8_gemms),
    )
