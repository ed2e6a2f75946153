"""Structural facts read from compiled HLO text.

Pure text parsing (no jax), so it works on any backend's ``compiled.as_text()``. A
compiled module is *scheduled*: the order of the instructions in each computation is the
order they run in, so "compute between an async collective's start and done" can be read
off the text.

The optimized HLO module (``compiled.as_text()``) gives computations, ``while`` loops,
custom calls and their aliasing, array shapes, async collective pairs and ``op_name``
metadata (the named scopes of the code that emitted each instruction). What the GPU
executable launches is in :mod:`jax_wgrad.aot.thunks`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "computations", "reachable", "while_bodies", "entry_name", "Instruction", "instructions",
    "custom_calls", "aliased", "wraps_aliased_custom_call", "sized_ops", "scatters_16bit",
    "AsyncCollective", "async_collectives", "sync_collectives", "branches", "known_trip_count",
    "trip_counts", "schedule_loop",
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
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")


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

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(dtype, shape)`` of each array in the result type."""
        return [(d, tuple(int(x) for x in s.split(",") if x))
                for d, s in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", self.shape)]


_INSTRUCTION = re.compile(
    r"^(?:ROOT )?%?([\w.\-]+) = ((?:\((?:[^()]|\([^()]*\))*\))|[\w\[\],{}:()*]+?) "
    r"([a-z][\w\-]*)\(")


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
    return [line.strip() for line in hlo.splitlines()
            if f'custom_call_target="{target}"' in line]


def aliased(line: str) -> bool:
    """Whether a custom call's output is aliased with an operand (updated in place)."""
    return "output_to_operand_aliasing=" in line


_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                "conditional", "while", "call", "after-all", "opt-barrier",
                "partition-id", "replica-id"}


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
    return (callee.group(1).startswith("dynamic-slice-fusion") and len(root) == 1
            and " custom-call(" in root[0] and aliased(root[0]))


def sized_ops(comps: dict[str, list[str]], names: Iterable[str], sizes: Iterable[int],
              dtype: str = "f32") -> list[Instruction]:
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
            if (ins.opcode in _NOT_KERNELS or ins.opcode.endswith("-done")
                    or _collective(ins.opcode)):
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
    return [ins for ins in instructions(hlo.splitlines())
            if ins.opcode == "scatter" and any(d in ("bf16", "f16") for d, _ in ins.arrays())]


def _collective(opcode: str) -> bool:
    return opcode in _COLLECTIVES or opcode.removesuffix("-start") in _COLLECTIVES \
        or opcode == "async-start"


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all", "ragged-all-to-all", "collective-broadcast")
_COMPUTE = {"fusion", "custom-call", "dot", "convolution", "conditional", "while", "call",
            "sort", "scatter", "gather", "reduce", "copy"}


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """An asynchronous collective: its start, its done, and what runs in between."""

    kind: str
    """``all-reduce``, ``reduce-scatter``, ``collective-permute``, ..."""
    start: Instruction
    computation: str
    compute_between: tuple[str, ...]
    """Names of the compute instructions (fusions, custom calls, GEMMs, control flow)
    scheduled between the start and the done."""

    @property
    def overlapped(self) -> bool:
        return bool(self.compute_between)

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


def async_collectives(comps: dict[str, list[str]],
                      names: Iterable[str] | None = None) -> list[AsyncCollective]:
    """Every asynchronous collective (``*-start``/``*-done`` pair, or an ``async-start``
    wrapping one) in computations ``names`` (default: all), with the compute scheduled
    between its start and its done."""
    out = []
    for c in (comps if names is None else names):
        body = instructions(comps.get(c, ()))
        for i, ins in enumerate(body):
            kind = _async_kind(ins, comps)
            if kind is None:
                continue
            between = []
            for later in body[i + 1:]:
                if later.opcode.endswith("-done") and re.search(
                        rf"%{re.escape(ins.name)}\b", later.line):
                    break
                if later.opcode in _COMPUTE:
                    between.append(later.name)
            out.append(AsyncCollective(kind, ins, c, tuple(between)))
    return out


def sync_collectives(comps: dict[str, list[str]],
                     names: Iterable[str] | None = None) -> list[Instruction]:
    """Collectives that XLA left synchronous (no start/done pair) in ``names``."""
    out = []
    for c in (comps if names is None else names):
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
    return {ins.name: known_trip_count(ins.line) for ins in instructions(hlo.splitlines())
            if ins.opcode == "while"}


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
                found.append((max(carried),
                              re.match(r"(?:ROOT )?%?([\w.\-]+) =", line).group(1), body, c))
    if not found:
        return None
    largest = max(f[0] for f in found)
    found = [f for f in found if f[0] == largest]
    inside = {f[1]: reachable(comps, f[2]) for f in found}
    outer = [f for f in found
             if not any(f[3] in inside[g[1]] for g in found if g[1] != f[1])] or found
    best = max(outer, key=lambda f: len(inside[f[1]]))
    return best[1], best[2]
