"""Structural facts read from compiled HLO text and from XLA:GPU's thunk sequence.

Pure text parsing (no jax), so it works on any backend's ``compiled.as_text()``. A
compiled module is *scheduled*: the order of the instructions in each computation is the
order they run in, so "compute between an async collective's start and done" can be read
off the text.

Two inputs:

* the optimized HLO module (``compiled.as_text()``): computations, ``while`` loops, custom
  calls and their aliasing, array shapes, async collective pairs, ``op_name`` metadata
  (the named scopes of the code that emitted each instruction);
* XLA:GPU's thunk sequence (``*thunk_sequence_after_thunk_passes.txt`` of an
  ``--xla_dump_to`` dump, with ``*thunk_metadata.txt`` naming each thunk's instruction):
  what the GPU executable launches, command buffers (CUDA graphs) included.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "computations", "reachable", "while_bodies", "entry_name", "Instruction", "instructions",
    "custom_calls", "aliased", "sized_ops", "scatters_16bit", "AsyncCollective",
    "async_collectives", "sync_collectives", "branches", "known_trip_count", "schedule_loop",
    "Thunk", "parse_thunks", "thunk_names", "find_thunk", "launches",
    "LaunchCount", "loop_launches",
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


def sized_ops(comps: dict[str, list[str]], names: Iterable[str], sizes: Iterable[int],
              dtype: str = "f32") -> list[Instruction]:
    """Instructions of computations ``names`` that produce a 1-D ``dtype`` array of one of
    ``sizes`` elements and run as a kernel or copy of their own: copies, fusions,
    non-aliased custom calls, ... (control flow, tuples, bitcasts and custom calls whose
    output aliases an operand are not counted). Fused computations are skipped: their
    fusion instruction is what runs."""
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


def schedule_loop(hlo: str, carried_sizes: Sequence[int]) -> tuple[str, str] | None:
    """``(while instruction name, body computation)`` of the loop that carries the largest
    of the flat fp32 arrays of ``carried_sizes`` elements (the gradient buckets: the
    pipeline schedule's ``lax.scan``), searched in every computation reachable from the
    entry; ``None`` if no loop carries one."""
    comps = computations(hlo)
    best = None
    for c in reachable(comps, entry_name(hlo)):
        for line, body in while_bodies(comps, c):
            head = line.split(" while(")[0]
            carried = [n for n in carried_sizes if f"f32[{n}]" in head]
            if carried and (best is None or max(carried) > best[0]):
                best = (max(carried), re.match(r"(?:ROOT )?%?([\w.\-]+) =", line).group(1),
                        body)
    return None if best is None else best[1:]


# ------------------------------------------------------------------------- thunks


@dataclasses.dataclass
class Thunk:
    """One thunk of XLA:GPU's executable: its id, kind (``kCustomKernel``, ``kCopy``,
    ``kCommandBuffer``, ``kWhile``, ``kConditional``, ...) and nested thunks, grouped
    by label (``body``/``condition`` of a while, ``*_branch`` of a conditional, ``""`` for
    the thunks a command buffer or an async start wraps)."""

    id: int
    kind: str
    text: str
    nested: dict[str, list[Thunk]] = dataclasses.field(default_factory=dict)

    def walk(self):
        yield self
        for seq in self.nested.values():
            for t in seq:
                yield from t.walk()


_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\b(.*)$")
_LABEL = re.compile(r"^(\s*)([A-Za-z_][\w ]*):\s*$")


def parse_thunks(text: str) -> list[Thunk]:
    """The top-level thunk sequence of a ``*thunk_sequence*.txt`` dump."""
    root = Thunk(-1, "root", "")
    root.nested[""] = []
    # stack of (indent, thunk, label): where a line of larger indent goes
    stack: list[tuple[int, Thunk, str]] = [(-1, root, "")]
    for line in text.splitlines():
        t, lab = _THUNK.match(line), _LABEL.match(line)
        if not t and not lab:
            continue
        indent = len((t or lab).group(1))
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        _, parent, label = stack[-1]
        if lab:
            # A while's "condition:" is printed at the indent of the while itself; any
            # other label belongs to the thunk (or the label's owner) a level up.
            last = parent.nested.get(label, [])[-1:]
            if lab.group(2) == "condition" and last and last[0].kind == "kWhile":
                owner = last[0]
            else:
                owner = parent
            owner.nested.setdefault(lab.group(2), [])
            stack.append((indent, owner, lab.group(2)))
            continue
        thunk = Thunk(int(t.group(2)), t.group(3), t.group(4).strip())
        parent.nested.setdefault(label, []).append(thunk)
        stack.append((indent, thunk, ""))
    return root.nested[""]


def thunk_names(metadata: str) -> dict[int, str]:
    """``{thunk id: HLO instruction name}`` from a ``*thunk_metadata.txt`` dump."""
    out = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        name = re.search(r'profile_annotation: "([^"]*)"', block)
        tid = re.search(r"thunk_id: (\d+)", block)
        if name and tid:
            out[int(tid.group(1))] = name.group(1)
    return out


def find_thunk(thunks: Sequence[Thunk], id_: int) -> Thunk | None:
    for top in thunks:
        for t in top.walk():
            if t.id == id_ and t.kind != "kCommandBuffer":
                return t
    return None


_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams", "kPartitionId", "kReplicaId"}
_CONTAINERS = {"kAsyncStart", "kSequential", "kDynamicSliceFusion"}


def launches(thunks: Sequence[Thunk], *, busy: bool = True) -> int:
    """Device launches of a thunk sequence run once.

    A command buffer (a CUDA graph) counts as ONE launch however many kernels it holds;
    every other leaf thunk that puts work on a stream (a kernel, a copy, a custom call, a
    cuDNN or cuBLAS call, a collective) as one; a ``*Done`` or stream wait as none. A
    conditional counts its busier branch (``busy``) or its lighter one; a nested while
    counts its condition and body once (one iteration).
    """
    n = 0
    for t in thunks:
        if t.kind == "kCommandBuffer":
            n += 1
        elif t.kind == "kConditional":
            per = [launches(seq, busy=busy) for seq in t.nested.values()] or [0]
            n += max(per) if busy else min(per)
        elif t.kind == "kWhile" or t.kind in _CONTAINERS:
            inner = sum(launches(seq, busy=busy) for seq in t.nested.values())
            n += inner if (inner or t.kind == "kWhile") else 1
        elif t.kind in _NO_LAUNCH or t.kind.endswith("Done"):
            continue
        else:
            n += 1
    return n


@dataclasses.dataclass(frozen=True)
class LaunchCount:
    """Launches of one tick of the schedule loop (its body and condition run once)."""

    overhead: int
    """The loop's condition and the body's thunks outside any conditional."""
    tasks: dict[str, tuple[int, int]]
    """Per conditional of the body, named by its ``op_name`` scope (``forward``,
    ``backward``, ``weight_gradients``, ``grad_sync_in_cooldown``, ...): launches of its
    ``(idle, busy)`` branch."""
    command_buffers: int
    """Command buffers launched by a tick with every conditional busy."""
    kernels_in_command_buffers: int
    custom_calls_outside: int
    """Custom-call thunks (FFI handlers) run on their own, outside command buffers."""
    conditionals: int
    """Conditional thunks in a tick outside command buffers (each reads its predicate
    back to the host)."""
    tasks_in_command_buffers: tuple[str, ...] = ()
    """Tasks whose conditional XLA captured in a command buffer (one launch either way)."""

    def tick(self, *busy_tasks: str) -> int:
        """Launches of a tick running ``busy_tasks`` (the others idle)."""
        return self.overhead + sum(b if k in busy_tasks else i
                                   for k, (i, b) in self.tasks.items())


def _task_of(op_name: str, scopes: Sequence[str]) -> str:
    for s in scopes:
        if f"/{s}/" in op_name or op_name.endswith(f"/{s}"):
            return s
    return op_name.rsplit("/", 1)[-1] or "?"


def loop_launches(thunks: Sequence[Thunk], names: dict[int, str], loop: str,
                  op_names: dict[str, str],
                  scopes: Sequence[str] = ("forward", "backward", "weight_gradients",
                                           "grad_sync_in_cooldown"),
                  once: Sequence[str] = ("grad_sync_in_cooldown",)) -> LaunchCount | None:
    """Launch counts of one iteration of the while loop named ``loop`` (an HLO
    instruction name; ``names`` maps thunk ids to instruction names, ``op_names``
    instruction names to their ``op_name``), or ``None`` when its thunk is not found.

    Conditionals are named by the first of ``scopes`` in their ``op_name``; the
    command-buffer and custom-call counts take every conditional's busier branch except
    those of ``once`` (a task that is busy in one tick per step)."""
    ids = [i for i, n in names.items() if n == loop]
    t = find_thunk(thunks, ids[0]) if ids else None
    if t is None or t.kind != "kWhile":
        return None
    overhead, tasks, conds, once_ids, in_graphs = 0, {}, 0, set(), []
    seqs = list(t.nested.values())

    def task_key(cond: Thunk) -> str:
        key = _task_of(op_names.get(names.get(cond.id, ""), ""), scopes)
        while key in tasks:
            key += "'"
        return key

    for seq in seqs:
        for x in seq:
            if x.kind == "kConditional":
                conds += 1
                key = task_key(x)
                if key.rstrip("'") in once:
                    once_ids.add(x.id)
                tasks[key] = (launches([x], busy=False), launches([x], busy=True))
            elif x.kind == "kCommandBuffer" and any(
                    y.kind == "kConditional" for y in x.walk()):
                # A conditional captured in a command buffer (a CUDA graph's conditional
                # node): the graph is one launch, busy or idle.
                key = task_key(next(y for y in x.walk() if y.kind == "kConditional"))
                in_graphs.append(key)
                tasks[key] = (1, 1)
            else:
                overhead += launches([x])
    busy_nodes = [x for seq in seqs for top in seq for x in _busy_walk(top, once_ids)]
    return LaunchCount(
        overhead=overhead, tasks=tasks,
        command_buffers=sum(x.kind == "kCommandBuffer" for x in busy_nodes),
        kernels_in_command_buffers=sum(
            len([y for s in x.nested.values() for top in s for y in top.walk()
                 if y.kind not in _CONTAINERS and y.kind not in ("kCommandBuffer", "kConditional", "kWhile")])
            for x in busy_nodes if x.kind == "kCommandBuffer"),
        custom_calls_outside=sum(x.kind == "kCustomCall" for x in busy_nodes),
        conditionals=conds, tasks_in_command_buffers=tuple(in_graphs))


def _busy_walk(t: Thunk, idle=frozenset()):
    """``t`` and what it runs, taking every conditional's busier branch (the lighter one
    for the ids in ``idle``), not entering command buffers."""
    yield t
    if t.kind == "kCommandBuffer":
        return
    seqs = list(t.nested.values())
    if t.kind == "kConditional" and seqs:
        seqs = [(min if t.id in idle else max)(seqs, key=lambda s: launches(s))]
    for s in seqs:
        for x in s:
            yield from _busy_walk(x, idle)
