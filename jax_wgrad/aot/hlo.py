"""Structural facts read from compiled HLO text.

Pure text parsing (no jax), so it works on any backend's ``compiled.as_text()``. A
compiled module is *scheduled*: the order of the instructions in each computation is the
order they run in, so "compute between an async collective's start and done" can be read
off the text.

The optimized HLO module (``compiled.as_text()``) gives computations, ``while`` loops,
custom calls and their aliasing, array shapes, async collective pairs and ``op_name``
metadata (the named scopes of the code that emitted each instruction). From those:
whether a collective overlaps compute (:func:`async_collectives`: GEMM-class work between
its start and done, :func:`gemm_class`) and the memory traffic of the non-GEMM kernels of
a loop iteration (:func:`loop_traffic`, :func:`kernel_traffic`). What the GPU executable
launches is in :mod:`jax_wgrad.aot.thunks`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Sequence

from jax_wgrad.parallel.pipeline.executor import END_SCOPES, TASK_SCOPES

__all__ = [
    "computations",
    "reachable",
    "while_bodies",
    "entry_name",
    "Instruction",
    "instructions",
    "custom_calls",
    "aliased",
    "wraps_aliased_custom_call",
    "sized_ops",
    "scatters_16bit",
    "AsyncCollective",
    "async_collectives",
    "sync_collectives",
    "branches",
    "known_trip_count",
    "trip_counts",
    "schedule_loop",
    "TASK_SCOPES",
    "END_SCOPES",
    "task_of",
    "shape_bytes",
    "gemm_class",
    "TRAFFIC_KINDS",
    "Traffic",
    "kernel_traffic",
    "computation_traffic",
    "TickTraffic",
    "loop_traffic",
]

# ------------------------------------------------------------------------- HLO modules


def computations(hlo: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` of a compiled HLO module's text."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line.strip())
    return comps


_CALLEES = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
)


def reachable(comps: dict[str, list[str]], root: str) -> set[str]:
    """Computations called (transitively) from ``root``, ``root`` included."""
    seen, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += _CALLEES.findall(line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [n.strip().lstrip("%") for n in group.split(",")]
    return seen


def while_bodies(comps: dict[str, list[str]], computation: str) -> list[tuple[str, str]]:
    """``(while instruction line, body computation name)`` for the whiles of a computation."""
    out = []
    for line in comps[computation]:
        if " while(" in line:
            out.append((line, re.search(r"body=%([\w.\-]+)", line).group(1)))
    return out


def entry_name(hlo: str) -> str:
    return re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction line: ``name = shape opcode(operands), attributes``."""

    name: str
    shape: str
    """The result type as printed: ``f32[8]{0}`` or a tuple ``(f32[8]{0}, u8[4]{0})``."""
    opcode: str
    line: str

    @property
    def op_name(self) -> str:
        """The ``op_name`` metadata: jax's named scopes of the code that emitted it."""
        m = re.search(r'op_name="([^"]*)"', self.line)
        return m.group(1) if m else ""

    @property
    def allocates_only(self) -> bool:
        """A custom call XLA:GPU launches nothing for: ``AllocateBuffer``, an uninitialised
        buffer (what ``--xla_gpu_enable_dus_accumulator_zero_init_elimination`` puts where
        a loop's stacked output was zero-filled); buffer assignment is all it is."""
        return self.opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in self.line

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(dtype, shape)`` of each array in the result type."""
        return [
            (d, tuple(int(x) for x in s.split(",") if x))
            for d, s in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", self.shape)
        ]


_INSTRUCTION = re.compile(
    r"^(?:ROOT )?%?([\w.\-]+) = ((?:\((?:[^()]|\([^()]*\))*\))|[\w\[\],{}:()*]+?) "
    r"([a-z][\w\-]*)\("
)


def instructions(lines: Iterable[str]) -> list[Instruction]:
    """The instruction lines of ``lines`` (in order), parsed."""
    out = []
    for line in lines:
        m = _INSTRUCTION.match(line.strip())
        if m:
            out.append(Instruction(m.group(1), m.group(2), m.group(3), line.strip()))
    return out


def custom_calls(hlo: str, target: str) -> list[str]:
    """Lines of the custom calls to ``target``."""
    return [line.strip() for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]


def aliased(line: str) -> bool:
    """Whether a custom call's output is aliased with an operand (updated in place)."""
    return "output_to_operand_aliasing=" in line


_NOT_KERNELS = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "conditional",
    "while",
    "call",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
}


def wraps_aliased_custom_call(line: str, comps: dict[str, list[str]]) -> bool:
    """Whether a fusion instruction is XLA:GPU's dynamic-slice fusion around ONE custom
    call whose output aliases an operand: the custom call reads its operands through
    dynamic slices in place (e.g. a scan's stacked residuals at the loop index) and
    updates the aliased buffer in place, so the fusion is no kernel of that size."""
    callee = re.search(r"calls=%([\w.\-]+)", line)
    if " fusion(" not in line or "kind=kCustom" not in line or callee is None:
        return False
    body = comps.get(callee.group(1), [])
    root = [l for l in body if l.startswith("ROOT ")]
    return (
        callee.group(1).startswith("dynamic-slice-fusion")
        and len(root) == 1
        and " custom-call(" in root[0]
        and aliased(root[0])
    )


def sized_ops(
    comps: dict[str, list[str]], names: Iterable[str], sizes: Iterable[int], dtype: str = "f32"
) -> list[Instruction]:
    """Instructions of computations ``names`` that produce a 1-D ``dtype`` array of one of
    ``sizes`` elements and run as a kernel or copy of their own: copies, fusions,
    non-aliased custom calls, ... (control flow, tuples, bitcasts, custom calls whose
    output aliases an operand and XLA:GPU's dynamic-slice fusions around such a call
    (:func:`wraps_aliased_custom_call`) are not counted). Fused computations are skipped:
    their fusion instruction is what runs."""
    want = {f"{dtype}[{n}]" for n in sizes}
    out = []
    for c in names:
        if c.startswith(("fused_", "wrapped_")) or "fused_computation" in c:
            continue
        for ins in instructions(comps.get(c, ())):
            if (
                ins.opcode in _NOT_KERNELS
                or ins.opcode.endswith("-done")
                or _collective(ins.opcode)
            ):
                continue
            if ins.opcode == "custom-call" and aliased(ins.line):
                continue
            if ins.opcode == "fusion" and wraps_aliased_custom_call(ins.line, comps):
                continue
            if any(f"{d}[{','.join(map(str, s))}]" in want for d, s in ins.arrays()):
                out.append(ins)
    return out


def scatters_16bit(hlo: str) -> list[Instruction]:
    """``scatter`` instructions (fused or not) whose result is bf16 or f16."""
    return [
        ins
        for ins in instructions(hlo.splitlines())
        if ins.opcode == "scatter" and any(d in ("bf16", "f16") for d, _ in ins.arrays())
    ]


def _collective(opcode: str) -> bool:
    return (
        opcode in _COLLECTIVES
        or opcode.removesuffix("-start") in _COLLECTIVES
        or opcode == "async-start"
    )


_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
_COMPUTE = {
    "fusion",
    "fusion-start",
    "custom-call",
    "dot",
    "convolution",
    "conditional",
    "while",
    "call",
    "sort",
    "scatter",
    "gather",
    "reduce",
    "copy",
    "copy-start",
}


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """An asynchronous collective: its start, its done, and what runs in between."""

    kind: str
    """``all-reduce``, ``reduce-scatter``, ``collective-permute``, ..."""
    start: Instruction
    computation: str
    compute_between: tuple[str, ...]
    """Names of the kernels and control flow (fusions, copies, custom calls, GEMMs,
    loops, conditionals) scheduled between the start and the done."""
    gemms_between: tuple[str, ...] = ()
    """Those of :attr:`compute_between` that are GEMM-class (:func:`gemm_class`: a GEMM,
    a custom call, or a fusion, loop or conditional holding one)."""

    @property
    def overlapped(self) -> bool:
        """Whether compute runs while the collective is in flight: a GEMM-class
        instruction between start and done. Memory-bound kernels alone (an elementwise
        fusion, a copy, a dynamic-update-slice) do not count: they compete with the
        collective for memory bandwidth, and when they are all that sits between start and
        done inside a conditional's branch (the cooldown's grad sync) the collective ends
        before anything after the conditional can run."""
        return bool(self.gemms_between)

    @property
    def memory_bound_only(self) -> bool:
        """Kernels run between start and done, but none of them GEMM-class."""
        return bool(self.compute_between) and not self.gemms_between

    @property
    def op_name(self) -> str:
        return self.start.op_name


def _async_kind(ins: Instruction, comps: dict[str, list[str]]) -> str | None:
    if ins.opcode.endswith("-start") and ins.opcode[:-6] in _COLLECTIVES:
        return ins.opcode[:-6]
    if ins.opcode == "async-start":  # a wrapped collective: look into the callee
        m = re.search(r"calls=%([\w.\-]+)", ins.line)
        for callee in instructions(comps.get(m.group(1), ()) if m else ()):
            if callee.opcode in _COLLECTIVES:
                return callee.opcode
    return None


_GEMM_OPCODES = {"dot", "convolution", "custom-call"}


def gemm_class(ins: Instruction, comps: dict[str, list[str]]) -> bool:
    """Whether ``ins`` is compute-bound work: a ``dot``, ``convolution`` or custom call
    (cuBLAS, cuDNN attention, the library's fused GEMMs), or a fusion (XLA:GPU's Triton
    GEMM fusions, a dynamic-slice fusion around a custom call; ``fusion-start``, the
    same run asynchronously), loop, conditional or call whose computations hold one.
    Custom calls all count, memory-bound ones too (the library's ``bucket_add``): the
    text does not say what a custom call computes."""
    if ins.opcode in _GEMM_OPCODES:
        return not ins.allocates_only
    callees = _CALLEES.findall(ins.line)
    if ins.opcode == "conditional":
        callees += branches(ins.line)
    if ins.opcode not in ("fusion", "fusion-start", "while", "conditional", "call") or not callees:
        return False
    return any(
        i.opcode in _GEMM_OPCODES and not i.allocates_only
        for c in callees
        for r in reachable(comps, c)
        for i in instructions(comps.get(r, ()))
    )


def async_collectives(
    comps: dict[str, list[str]], names: Iterable[str] | None = None
) -> list[AsyncCollective]:
    """Every asynchronous collective (``*-start``/``*-done`` pair, or an ``async-start``
    wrapping one) in computations ``names`` (default: all), with the compute scheduled
    between its start and its done (:attr:`AsyncCollective.overlapped`: GEMM-class
    compute among it)."""
    out = []
    for c in comps if names is None else names:
        body = instructions(comps.get(c, ()))
        for i, ins in enumerate(body):
            kind = _async_kind(ins, comps)
            if kind is None:
                continue
            between = []
            for later in body[i + 1 :]:
                if later.opcode.endswith("-done") and re.search(
                    rf"%{re.escape(ins.name)}\b", later.line
                ):
                    break
                if later.opcode in _COMPUTE and not later.allocates_only:
                    between.append(later)
            out.append(
                AsyncCollective(
                    kind,
                    ins,
                    c,
                    tuple(b.name for b in between),
                    tuple(b.name for b in between if gemm_class(b, comps)),
                )
            )
    return out


def sync_collectives(
    comps: dict[str, list[str]], names: Iterable[str] | None = None
) -> list[Instruction]:
    """Collectives that XLA left synchronous (no start/done pair) in ``names``."""
    out = []
    for c in comps if names is None else names:
        if c.startswith(("fused_", "wrapped_")):
            continue
        out += [ins for ins in instructions(comps.get(c, ())) if ins.opcode in _COLLECTIVES]
    return out


def branches(line: str) -> list[str]:
    """The branch computations a ``conditional`` instruction line calls."""
    out = re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        out += [n.strip().lstrip("%") for n in group.split(",")]
    return out


def known_trip_count(line: str) -> int | None:
    """A ``while`` instruction's trip count when XLA knows it (its backend config)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m.group(1)) if m else None


def trip_counts(hlo: str) -> dict[str, int | None]:
    """``{while instruction name: its known trip count, or None}`` for every ``while`` of
    a compiled module (XLA's optimized HLO puts ``known_trip_count`` in the backend config
    of loops it can count, e.g. every ``lax.scan``)."""
    return {
        ins.name: known_trip_count(ins.line)
        for ins in instructions(hlo.splitlines())
        if ins.opcode == "while"
    }


def schedule_loop(hlo: str, carried_sizes: Sequence[int]) -> tuple[str, str] | None:
    """``(while instruction name, body computation)`` of the loop that carries the largest
    of the flat fp32 arrays of ``carried_sizes`` elements (the gradient buckets: the
    pipeline schedule's ``lax.scan``), searched in every computation reachable from the
    entry; ``None`` if no loop carries one.

    Loops nested in it (a ``lax.scan`` over layers inside a tick) may carry the same
    bucket: of the loops that carry the largest one, the outermost is taken (the one no
    other's body reaches; then the one whose body reaches the most computations)."""
    comps = computations(hlo)
    found = []  # (largest carried, name, body, computation holding the while)
    for c in sorted(reachable(comps, entry_name(hlo))):
        for line, body in while_bodies(comps, c):
            head = line.split(" while(")[0]
            carried = [n for n in carried_sizes if f"f32[{n}]" in head]
            if carried:
                found.append(
                    (max(carried), re.match(r"(?:ROOT )?%?([\w.\-]+) =", line).group(1), body, c)
                )
    if not found:
        return None
    largest = max(f[0] for f in found)
    found = [f for f in found if f[0] == largest]
    inside = {f[1]: reachable(comps, f[2]) for f in found}
    outer = [
        f for f in found if not any(f[3] in inside[g[1]] for g in found if g[1] != f[1])
    ] or found
    best = max(outer, key=lambda f: len(inside[f[1]]))
    return best[1], best[2]


# ------------------------------------------------------- tasks of the schedule loop

# TASK_SCOPES, END_SCOPES: the executor's scope names (imported above), what the analyses
# below look for in op_name.


def task_of(op_name: str, scopes: Sequence[str] = TASK_SCOPES) -> str:
    """The first of ``scopes`` that ``op_name`` lies in, else its last component."""
    for s in scopes:
        if f"/{s}/" in op_name or op_name.endswith(f"/{s}"):
            return s
    return op_name.rsplit("/", 1)[-1] or "?"


# ----------------------------------------------------------- non-GEMM memory traffic

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of the arrays of an HLO shape (``f32[8,4]{1,0}``, or a tuple of them).
    8-bit floats (``f8e4m3fn``) count 1 byte, 4-bit types half a byte."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            size = 0.5 if dtype[1:2] == "4" else 1 if dtype.startswith("f8") else 4
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * size
    return int(total)


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, b, ...)``; ``[shape]`` for an array."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            if shape[start:i].strip():
                out.append(shape[start:i].strip())
            start = i + 1
    return out


def _operands(ins: Instruction) -> list[tuple[str, int | None]]:
    """``(name, tuple index or None)`` of each operand (``%x`` or ``%x#1``, XLA's short
    form of element 1 of a tuple-shaped ``x``)."""
    head = ins.line.find(f" {ins.opcode}(")
    text, depth = ins.line[head + len(ins.opcode) + 2 :], 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            text = text[:i]
            break
    return [
        (n, None if k == "" else int(k)) for n, k in re.findall(r"%([\w.\-]+)(?:#(\d+))?", text)
    ]


TRAFFIC_KINDS: tuple[str, ...] = ("fusion", "copy", "memset", "dynamic_update_slice")
"""The kinds of non-GEMM kernels :class:`Traffic` counts (see :func:`kernel_traffic`)."""


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes read plus written by non-GEMM kernels (:func:`kernel_traffic`), by kind."""

    fusion: float = 0
    """Other fusions: elementwise work, casts, norms, reductions, transposes with math."""
    copy: float = 0
    """Copies and pure data-movement fusions (slices, dynamic slices, transposes,
    concatenations)."""
    memset: float = 0
    """Fusions that only broadcast constants (zero-fills)."""
    dynamic_update_slice: float = 0
    """Fusions rooted in an in-place dynamic-update-slice (the update written, what it is
    computed from read)."""

    @property
    def total(self) -> float:
        return self.fusion + self.copy + self.memset + self.dynamic_update_slice

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, k) + getattr(other, k) for k in TRAFFIC_KINDS))

    def __mul__(self, factor: float) -> Traffic:
        return Traffic(*(getattr(self, k) * factor for k in TRAFFIC_KINDS))

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in TRAFFIC_KINDS}


_NO_TRAFFIC = _NOT_KERNELS | {
    "partition-id",
    "replica-id",
    "add-dependency",
    "domain",
    "copy-done",
    "send-done",
    "recv-done",
    "send",
    "recv",
}
_SLICING = {"dynamic-slice", "slice", "gather"}
_DATA_MOVEMENT = {
    "parameter",
    "constant",
    "bitcast",
    "copy",
    "transpose",
    "slice",
    "dynamic-slice",
    "reshape",
    "concatenate",
    "pad",
    "tuple",
    "get-tuple-element",
    "broadcast",
    "reverse",
}


class _Shapes:
    """Result shapes of every instruction of a module, by name (names are module-unique)."""

    def __init__(self, comps: dict[str, list[str]]):
        self.by_name = {i.name: i.shape for lines in comps.values() for i in instructions(lines)}

    def operand(self, name: str, index: int | None) -> str:
        shape = self.by_name.get(name, "")
        if index is None:
            return shape
        elements = _tuple_elements(shape)
        return elements[index] if index < len(elements) else ""


def _fusion_traffic(fused: list[Instruction]) -> tuple[str, float]:
    """``(kind, bytes)`` of one fusion's kernel from its fused computation."""
    by_name = {i.name: i for i in fused}
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for ins in fused:
        for pos, (name, _) in enumerate(_operands(ins)):
            users.setdefault(name, []).append((ins, pos))

    def uses(name: str) -> list[tuple[Instruction, int]]:
        """Users of ``name``, looking through bitcasts (a bitcast moves nothing)."""
        out = []
        for ins, pos in users.get(name, []):
            out += uses(ins.name) if ins.opcode == "bitcast" else [(ins, pos)]
        return out

    def source(name: str) -> Instruction | None:
        ins = by_name.get(name)
        while ins is not None and ins.opcode == "bitcast":
            ops = _operands(ins)
            ins = by_name.get(ops[0][0]) if ops else None
        return ins

    root = next((i for i in fused if i.line.startswith("ROOT ")), fused[-1])
    outputs = (
        [source(n) for n, _ in _operands(root)] if root.opcode == "tuple" else [source(root.name)]
    )
    written, dus = 0.0, False
    for out in outputs:
        if out is None:
            continue
        ops = _operands(out)
        buffer = source(ops[0][0]) if ops else None
        if (
            out.opcode == "dynamic-update-slice"
            and buffer is not None
            and buffer.opcode == "parameter"
        ):  # in place: the update is written
            dus = True
            update = by_name.get(ops[1][0]) if len(ops) > 1 else None
            written += shape_bytes(update.shape) if update is not None else 0
        else:
            written += shape_bytes(out.shape)
    read = 0.0
    for p in (i for i in fused if i.opcode == "parameter"):
        full, part = shape_bytes(p.shape), 0.0
        for user, pos in uses(p.name):
            if user.opcode == "dynamic-update-slice" and pos == 0:
                continue  # the buffer updated in place: only the update is written
            if user.opcode in _SLICING and pos == 0:
                part += shape_bytes(user.shape)
            else:
                part = full
                break
        read += min(part, full)
    # non-scalar instructions (scalars compute offsets and constants)
    arrays = [i for i in fused if "[]" not in i.shape or i.shape.startswith("(")]
    if dus:
        kind = "dynamic_update_slice"
    elif not arrays:
        kind = "fusion"
    elif read == 0 and all(
        i.opcode in ("constant", "broadcast", "tuple", "bitcast")
        for i in arrays
        if i.opcode != "parameter"
    ):
        kind = "memset"
    elif all(i.opcode in _DATA_MOVEMENT for i in arrays):
        kind = "copy"
    else:
        kind = "fusion"
    return kind, read + written


def kernel_traffic(
    ins: Instruction, comps: dict[str, list[str]], shapes: _Shapes | None = None
) -> tuple[str, float] | None:
    """``(kind, bytes read + written)`` of the kernel ``ins`` launches, or ``None`` when it
    launches no non-GEMM kernel: GEMM-class work (:func:`gemm_class`: GEMMs, custom
    calls, Triton GEMM fusions, cuDNN calls), collectives and their start/done, control
    flow (counted by :func:`computation_traffic`), parameters, tuples, bitcasts,
    constants.

    What is counted, for a fusion (from its fused computation):
      * written: each output's bytes; an output computed by a dynamic-update-slice of a
        parameter writes its update only (XLA:GPU updates the buffer in place; a copy it
        needs first is a ``copy`` of its own);
      * read: each parameter once, except a parameter read only through (dynamic) slices
        or gathers (their results' bytes) and the buffer a dynamic-update-slice updates
        in place (nothing);
      * a ``fusion-start`` (XLA:GPU's asynchronous fusion) counts as the fusion it starts;
      * kind (:data:`TRAFFIC_KINDS`): ``dynamic_update_slice`` when an output is one,
        ``memset`` when it only broadcasts constants, ``copy`` when every non-scalar
        instruction only moves data, else ``fusion``.
    An unfused ``copy``/``copy-start``/slice reads and writes its result's bytes
    (``copy``); an unfused dynamic-update-slice reads and writes its update; an unfused
    broadcast is a ``memset``; any other unfused instruction reads its operands and
    writes its result (``fusion``).

    Limits: bytes are what the instructions address, not what DRAM moves (caches, a
    kernel reading an operand twice, an operand broadcast inside the kernel read once);
    a gather counts its result's bytes, a scatter its operands'.
    """
    op = ins.opcode
    if (
        op in _NO_TRAFFIC
        or ins.allocates_only
        or op in ("while", "conditional", "call")
        or _collective(op)
        or op.endswith("-done")
        or op == "async-start"
        or gemm_class(ins, comps)
    ):
        return None
    if op in ("fusion", "fusion-start"):  # an async fusion (another stream) as a fusion
        callee = re.search(r"calls=%([\w.\-]+)", ins.line)
        fused = instructions(comps.get(callee.group(1), ())) if callee else []
        if fused:
            return _fusion_traffic(fused)
    shapes = shapes or _Shapes(comps)
    operands = [shapes.operand(n, k) for n, k in _operands(ins)]
    out = shape_bytes(ins.shape if op != "copy-start" else _tuple_elements(ins.shape)[0])
    if op in ("copy", "copy-start", "slice", "dynamic-slice"):
        return "copy", 2.0 * out
    if op == "dynamic-update-slice":
        return "dynamic_update_slice", 2.0 * shape_bytes(operands[1] if len(operands) > 1 else "")
    if op == "broadcast":
        return "memset", out + sum(map(shape_bytes, operands))
    return "fusion", out + sum(map(shape_bytes, operands))


def computation_traffic(
    comps: dict[str, list[str]],
    name: str,
    *,
    busy: bool = True,
    trips: dict[str, int | None] | None = None,
    shapes: _Shapes | None = None,
) -> tuple[Traffic, int]:
    """``(traffic, loops of unknown trip count)`` of running computation ``name`` once:
    the sum of :func:`_instruction_traffic` over its instructions."""
    shapes = shapes or _Shapes(comps)
    total, unknown = Traffic(), 0
    for ins in instructions(comps.get(name, ())):
        t, u = _instruction_traffic(ins, comps, busy=busy, trips=trips or {}, shapes=shapes)
        total, unknown = total + t, unknown + u
    return total, unknown


def _instruction_traffic(
    ins: Instruction,
    comps: dict[str, list[str]],
    *,
    busy: bool,
    trips: dict[str, int | None],
    shapes: _Shapes,
) -> tuple[Traffic, int]:
    """``(traffic, loops of unknown trip count)`` of running ``ins`` once: its
    :func:`kernel_traffic`; a ``while``'s body times its known trip count (``trips``:
    :func:`trip_counts`; an unknown one counts once, condition included); a conditional's
    heavier branch (``busy``) or its lighter one; a ``call``'s or a non-collective
    ``async-start``'s callee once."""
    run = functools.partial(computation_traffic, comps, busy=busy, trips=trips, shapes=shapes)
    if ins.opcode == "while":
        body, n = re.search(r"body=%([\w.\-]+)", ins.line).group(1), trips.get(ins.name)
        n = n if n is not None else known_trip_count(ins.line)
        t, u = run(body)
        if n is not None:
            return t * n, u
        c, cu = run(re.search(r"condition=%([\w.\-]+)", ins.line).group(1))
        return t + c, u + cu + 1
    if ins.opcode == "conditional":
        options = [run(b) for b in branches(ins.line)] or [(Traffic(), 0)]
        return (max if busy else min)(options, key=lambda o: o[0].total)
    if ins.opcode == "call" or (ins.opcode == "async-start" and _async_kind(ins, comps) is None):
        total, unknown = Traffic(), 0
        for callee in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.line):
            t, u = run(callee)
            total, unknown = total + t, unknown + u
        return total, unknown
    k = kernel_traffic(ins, comps, shapes)
    return (Traffic(**{k[0]: k[1]}) if k is not None else Traffic()), 0


@dataclasses.dataclass(frozen=True)
class TickTraffic:
    """Non-GEMM memory traffic of one tick of the schedule loop (:func:`loop_traffic`)."""

    overhead: Traffic
    """The loop body's kernels outside the task conditionals (every tick)."""
    tasks: dict[str, tuple[Traffic, Traffic]]
    """Per conditional of the body, named by its ``op_name`` scope (:func:`task_of`):
    traffic of its ``(idle, busy)`` branch (the lighter and the heavier one)."""
    unknown_trip_loops: int
    """Loops in the tick with no known trip count (counted as one iteration)."""


def loop_traffic(hlo: str, body: str, scopes: Sequence[str] = TASK_SCOPES) -> TickTraffic:
    """The non-GEMM memory traffic of one iteration of the loop whose body computation is
    ``body`` (e.g. :func:`schedule_loop`'s), split like
    :func:`jax_wgrad.aot.thunks.loop_launches`: the instructions outside conditionals, and
    per conditional (a task, named by :func:`task_of`) its lighter (idle) and heavier
    (busy) branch (a switch of more branches, the executor's backward with layer
    groups: its first two, idle and busy; the third runs once a step). A conditional
    nested inside a task counts its heavier branch; a loop
    nested in the tick counts its body times its known trip count; the loop's own
    condition (a scalar compare, skipped by XLA:GPU for a loop of known trip count) is
    not counted. :func:`kernel_traffic` says what is counted, and its limits."""
    comps = computations(hlo)
    shapes, trips = _Shapes(comps), trip_counts(hlo)
    overhead, tasks, unknown = Traffic(), {}, 0
    for ins in instructions(comps.get(body, ())):
        if ins.opcode == "conditional":
            key = task_of(ins.op_name, scopes)
            while key in tasks:
                key += "'"
            options = [
                computation_traffic(comps, b, trips=trips, shapes=shapes)
                for b in branches(ins.line)
            ]
            if len(options) > 2:  # a switch (idle, busy, once a step): its idle and busy
                options = options[:2]
            options = sorted(options, key=lambda o: o[0].total) or [(Traffic(), 0)]
            tasks[key] = (options[0][0], options[-1][0])
            unknown += options[-1][1]
        else:
            t, u = _instruction_traffic(ins, comps, busy=True, trips=trips, shapes=shapes)
            overhead, unknown = overhead + t, unknown + u
    return TickTraffic(overhead, tasks, unknown)
