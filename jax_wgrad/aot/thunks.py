"""XLA:GPU's thunk sequence: what the GPU executable launches, command buffers included.

Read from an ``--xla_dump_to`` dump: ``*thunk_sequence_after_thunk_passes.txt`` (the
executable's thunks, nested: a while's ``condition``/``body``, a conditional's branches,
the thunks a command buffer -- a CUDA graph -- or an async start holds) and
``*thunk_metadata.txt`` (each thunk's HLO instruction). :func:`loop_launches` counts the
launches of one iteration of a loop: a command buffer is ONE launch however many kernels it
holds; a while nested in it (a ``lax.scan`` over layers inside a tick) counts its body
times its trip count (:func:`jax_wgrad.aot.hlo.trip_counts`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence

from jax_wgrad.aot import hlo
from jax_wgrad.parallel.pipeline import scopes

__all__ = [
    "Thunk",
    "parse_thunks",
    "thunk_names",
    "find_thunk",
    "in_command_buffer",
    "launches",
    "LaunchCount",
    "loop_launches",
    "graphed_instructions",
    "host_syncs",
]


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
    prev: tuple[int, Thunk] | None = None  # the thunk on the line before, with its indent
    for line in text.splitlines():
        t, lab = _THUNK.match(line), _LABEL.match(line)
        if not t and not lab:
            continue
        indent = len((t or lab).group(1))
        if lab and lab.group(2) == "condition" and prev and prev[1].kind == "kWhile":
            # XLA prints a while's "condition:" at column 0 however deep the while is
            # nested: it belongs to the while on the line before, at that while's indent.
            indent = prev[0]
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
            prev = None
            continue
        thunk = Thunk(int(t.group(2)), t.group(3), t.group(4).strip())
        parent.nested.setdefault(label, []).append(thunk)
        stack.append((indent, thunk, ""))
        prev = (indent, thunk)
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


def in_command_buffer(thunks: Sequence[Thunk], id_: int) -> bool:
    """Whether the thunk ``id_`` runs inside a command buffer (a CUDA graph: a loop or a
    conditional captured whole becomes a graph's while or conditional node, which the
    host launches with the graph, once)."""

    def visit(t: Thunk, inside: bool) -> bool | None:
        if t.id == id_ and t.kind != "kCommandBuffer":
            return inside
        inside = inside or t.kind == "kCommandBuffer"
        for seq in t.nested.values():
            for x in seq:
                found = visit(x, inside)
                if found is not None:
                    return found
        return None

    return any(visit(top, False) for top in thunks)


_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams", "kPartitionId", "kReplicaId"}
_CONTAINERS = {"kAsyncStart", "kSequential", "kDynamicSliceFusion"}


def launches(
    thunks: Sequence[Thunk], *, busy: bool = True, trips: Mapping[int, int] | None = None
) -> int:
    """Device launches of a thunk sequence run once.

    A command buffer (a CUDA graph) counts as ONE launch however many kernels it holds;
    every other leaf thunk that puts work on a stream (a kernel, a copy, a custom call, a
    cuDNN or cuBLAS call, a collective) as one; a ``*Done`` or stream wait as none. A
    conditional counts its busier branch (``busy``) or its lighter one. A nested while
    whose thunk id has a trip count in ``trips`` (``{thunk id: trip count}``) counts its
    body that many times: XLA:GPU's while thunk runs a loop of known trip count without
    its condition (``WhileThunk::ExecuteOnStream``). Any other nested while counts its
    condition and body once (one iteration).
    """
    trips = trips or {}
    n = 0
    for t in thunks:
        if t.kind == "kCommandBuffer":
            n += 1
        elif t.kind == "kConditional":
            per = [launches(seq, busy=busy, trips=trips) for seq in t.nested.values()] or [0]
            n += max(per) if busy else min(per)
        elif t.kind == "kWhile":
            times, seqs = _iterations(t, trips)
            n += times * sum(launches(seq, busy=busy, trips=trips) for seq in seqs)
        elif t.kind in _CONTAINERS:
            inner = sum(launches(seq, busy=busy, trips=trips) for seq in t.nested.values())
            n += inner or 1
        elif t.kind in _NO_LAUNCH or t.kind.endswith("Done"):
            continue
        else:
            n += 1
    return n


def _iterations(t: Thunk, trips: Mapping[int, int]) -> tuple[int, list[list[Thunk]]]:
    """``(times, thunk sequences run that many times)`` of a while thunk ``t``: its body
    ``trips[t.id]`` times when the trip count is known, else condition and body once."""
    if trips.get(t.id) is not None:
        return trips[t.id], [seq for label, seq in t.nested.items() if label != "condition"]
    return 1, list(t.nested.values())


@dataclasses.dataclass(frozen=True)
class LaunchCount:
    """Launches of one tick of the schedule loop (its body and condition run once, a loop
    nested in it as many times as it iterates)."""

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
    nested_loops: int = 0
    """While loops nested in a tick with every task busy (the outermost ones: e.g. a
    ``lax.scan`` over layers inside the forward or backward), command buffers not entered."""
    nested_launches: int = 0
    """Launches of those loops (all their iterations), part of the counts above."""
    unknown_trip_loops: int = 0
    """Nested while loops (at any depth) in that tick with no known trip count: counted as
    one iteration."""
    in_command_buffer: bool = False
    """The loop itself runs inside a command buffer (a CUDA graph's while node): its ticks
    launch nothing from the host (every count above 0, but
    :attr:`kernels_in_command_buffers`: the kernels of a tick running every task)."""

    def tick(self, *busy_tasks: str) -> int:
        """Launches of a tick running ``busy_tasks`` (the others idle)."""
        return self.overhead + sum(b if k in busy_tasks else i for k, (i, b) in self.tasks.items())


def loop_launches(
    thunks: Sequence[Thunk],
    names: dict[int, str],
    loop: str,
    op_names: dict[str, str],
    scopes: Sequence[str] = hlo.TASK_SCOPES,
    once: Sequence[str] = (scopes.COOLDOWN_SYNC,),
    trips: Mapping[str, int | None] | None = None,
) -> LaunchCount | None:
    """Launch counts of one iteration of the while loop named ``loop`` (an HLO
    instruction name; ``names`` maps thunk ids to instruction names, ``op_names``
    instruction names to their ``op_name``), or ``None`` when its thunk is not found.

    Conditionals are named by the first of ``scopes`` in their ``op_name``
    (:func:`jax_wgrad.aot.hlo.task_of`); the
    command-buffer and custom-call counts take every conditional's busier branch except
    those of ``once`` (a task that is busy in one tick per step). A switch of more than
    two branches (the executor's backward with layer groups: idle, busy, and the
    stage's last, once a step) is counted by its first two. A while nested in the
    loop counts its body times its trip count where ``trips`` (``{while instruction name:
    known trip count or None}``, :func:`jax_wgrad.aot.hlo.trip_counts`) gives one, else
    once (:func:`launches`). A loop that runs inside a command buffer itself (a CUDA
    graph's while node) launches nothing per tick (:attr:`LaunchCount.in_command_buffer`)."""
    ids = [i for i, n in names.items() if n == loop]
    t = find_thunk(thunks, ids[0]) if ids else None
    if t is None or t.kind != "kWhile":
        return None
    trips_by_id = {i: trips[n] for i, n in names.items() if trips and trips.get(n) is not None}
    count = functools.partial(launches, trips=trips_by_id)
    if in_command_buffer(thunks, t.id):
        body = [seq for label, seq in t.nested.items() if label != "condition"]
        return LaunchCount(
            overhead=0,
            tasks={},
            command_buffers=0,
            kernels_in_command_buffers=sum(count(seq) for seq in body),
            custom_calls_outside=0,
            conditionals=0,
            in_command_buffer=True,
        )
    overhead, tasks, conds, once_ids, in_graphs = 0, {}, 0, set(), []
    seqs = list(t.nested.values())

    def task_key(cond: Thunk) -> str:
        key = hlo.task_of(op_names.get(names.get(cond.id, ""), ""), scopes)
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
                if len(x.nested) > 2:  # a switch (idle, busy, once a step): the first two
                    idle, busy = (count(seq) for seq in list(x.nested.values())[:2])
                    tasks[key] = (min(idle, busy), max(idle, busy))
                else:
                    tasks[key] = (count([x], busy=False), count([x], busy=True))
            elif x.kind == "kCommandBuffer" and any(y.kind == "kConditional" for y in x.walk()):
                # A conditional captured in a command buffer (a CUDA graph's conditional
                # node): the graph is one launch, busy or idle.
                key = task_key(next(y for y in x.walk() if y.kind == "kConditional"))
                in_graphs.append(key)
                tasks[key] = (1, 1)
            else:
                overhead += count([x])
    # (thunk, times it runs in a tick, inside a nested loop?)
    busy = [w for seq in seqs for top in seq for w in _busy_walk(top, once_ids, trips_by_id)]
    loops = [x for x, _, inside in busy if x.kind == "kWhile" and not inside]
    return LaunchCount(
        overhead=overhead,
        tasks=tasks,
        command_buffers=sum(k for x, k, _ in busy if x.kind == "kCommandBuffer"),
        kernels_in_command_buffers=sum(
            k
            * len(
                [
                    y
                    for s in x.nested.values()
                    for top in s
                    for y in top.walk()
                    if y.kind not in _CONTAINERS
                    and y.kind not in ("kCommandBuffer", "kConditional", "kWhile")
                ]
            )
            for x, k, _ in busy
            if x.kind == "kCommandBuffer"
        ),
        custom_calls_outside=sum(k for x, k, _ in busy if x.kind == "kCustomCall"),
        conditionals=conds,
        tasks_in_command_buffers=tuple(in_graphs),
        nested_loops=len(loops),
        nested_launches=sum(count([x]) for x in loops),
        unknown_trip_loops=sum(x.kind == "kWhile" and x.id not in trips_by_id for x, _, _ in busy),
    )


def _busy_walk(
    t: Thunk,
    idle=frozenset(),
    trips: Mapping[int, int] | None = None,
    times: int = 1,
    inside: bool = False,
):
    """``(thunk, times it runs, whether inside a nested while)`` for ``t`` and what it
    runs, taking every conditional's busier branch (the lighter one for the ids in
    ``idle``) and a while's body times its trip count (``trips``, as in
    :func:`launches`), not entering command buffers."""
    trips = trips or {}
    yield t, times, inside
    if t.kind == "kCommandBuffer":
        return
    seqs = list(t.nested.values())
    if t.kind == "kConditional" and seqs:
        seqs = [(min if t.id in idle else max)(seqs, key=lambda s: launches(s, trips=trips))]
    elif t.kind == "kWhile":
        n, seqs = _iterations(t, trips)
        times, inside = times * n, True
    for s in seqs:
        for x in s:
            yield from _busy_walk(x, idle, trips, times, inside)


def graphed_instructions(thunks: Sequence[Thunk], names: Mapping[int, str]) -> frozenset[str]:
    """Names of the HLO instructions whose kernels XLA:GPU runs inside command buffers
    (CUDA graphs), from the thunk sequence and ``names`` (:func:`thunk_names`)."""
    out: set[str] = set()
    for top in thunks:
        for t in top.walk():
            if t.kind == "kCommandBuffer":
                out |= {names[x.id] for x in t.walk() if x is not t and x.id in names}
    return frozenset(out)


def host_syncs(
    thunks: Sequence[Thunk], names: Mapping[int, str], trips: Mapping[str, int | None]
) -> dict[str, int]:
    """``{HLO instruction name: host synchronisations per run}`` of the control flow XLA:GPU
    runs on the host: a conditional outside command buffers copies its predicate to the
    host and waits for it (``ConditionalThunk``); so does a while loop of unknown trip
    count, once per iteration (``WhileThunk``; one is counted). A loop of known trip
    count (``trips``, :func:`jax_wgrad.aot.hlo.trip_counts`) and anything inside a
    command buffer (a CUDA graph's conditional or while node) reads nothing back."""
    out: dict[str, int] = {}

    def visit(t: Thunk) -> None:
        if t.kind == "kCommandBuffer":
            return
        name = names.get(t.id, "")
        if t.kind == "kConditional" or (t.kind == "kWhile" and trips.get(name) is None):
            out[name] = out.get(name, 0) + 1
        for seq in t.nested.values():
            for x in seq:
                visit(x)

    for top in thunks:
        visit(top)
    return out
