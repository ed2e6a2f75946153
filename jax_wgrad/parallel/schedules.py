"""Pipeline schedules as data: a per-tick, per-stage table of tasks.

A schedule is a pure function ``(num_stages, num_microbatches) -> ScheduleTable``. The
executor (:mod:`jax_wgrad.parallel.pipeline.executor`) runs ANY valid table in one
``lax.scan`` over ticks: it reads the table (as arrays indexed by the tick) instead of
re-deriving formulas, so adding a schedule is adding a table.

**Tasks.** ``F``: a microbatch's forward through the stage (on the last stage also the loss
and the head's backward). ``B``: its backward through the stage's layers -- the whole
backward, or with ``split_backward`` only the input gradients. ``W``: with
``split_backward``, the weight-gradient GEMMs of a microbatch whose ``B`` ran (zero-bubble
pipelining, Qi et al., ICLR 2024).

**Tick semantics** (the executor's): all stages advance in lock step. In a tick, a stage
runs its ``F``, then its ``B``, then its ``W`` task, each on the microbatch the table names
(or nothing: ``IDLE``). At the end of the tick every stage sends the output of its ``F`` to
the next stage and the input gradient of its ``B`` to the previous one (two acyclic
``ppermute``\\ s); what a stage receives is kept in a slot until the task that consumes it
runs. A tick lasts as long as the busiest stage's work in it (:meth:`ScheduleTable.makespan`).
:meth:`ScheduleTable.validate` checks the rules: every stage runs each task of every
microbatch once, in microbatch order; ``F(m)`` on stage ``s > 0`` in a later tick than on
``s - 1``; ``B(m)`` on ``s < P - 1`` in a later tick than on ``s + 1``; ``B(m)`` not before
``F(m)`` and ``W(m)`` not before ``B(m)`` on the same stage (the same tick is fine).

**Schedules.** :func:`one_f_one_b`, :func:`one_f_one_b_paired` and :func:`zb_h1` come
from one list scheduler (:func:`list_schedule`): each tick a stage runs ONE task: a ready
``B`` first (the critical path), else an ``F`` if fewer than ``P - s`` microbatches are in
flight on it (Megatron's 1F1B activation bound), else (zero bubble) a pending ``W``.

**Paired ticks.** In lock step a message takes one tick per hop, so a microbatch's
``F`` on stage ``s`` and its ``B`` there are ``2 (P - s) - 1`` ticks apart. 1F1B's bound
of ``P - s`` in flight then lets a stage run only every other tick's ``F`` or ``B``: in
its steady state one stage of each neighbouring pair runs an ``F`` while the other runs a
``B``, and the tick lasts a ``B``. ``1f1b-paired`` (:func:`one_f_one_b_paired`) lets a
stage run a ready ``B`` *and* an ``F`` in the same tick, holding up to ``2 (P - s)``
microbatches: every steady-state tick is one ``F`` plus one ``B`` on every stage, and
the makespan is 1F1B's bubble-bounded ideal ``(M + P - 1) (F + B)`` (at ``P = 4, M = 8``
with ``F = 1`` and a backward of 2: 33 against 1F1B's 40) for twice the activation slots.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

__all__ = [
    "IDLE",
    "ScheduleTable",
    "list_schedule",
    "single_stage",
    "source_of",
    "one_f_one_b",
    "one_f_one_b_paired",
    "zb_h1",
    "SCHEDULES",
    "INTERLEAVED_FORMS",
    "get_schedule",
]

IDLE = -1
"""Table entry of a stage that has no such task in a tick."""

Task = Literal["F", "B", "W"]


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """``forward[t, s]`` / ``backward[t, s]`` / ``weight[t, s]``: the microbatch stage ``s``
    runs that task on in tick ``t``, or :data:`IDLE`; ``forward_chunk[t, s]`` (...): the
    model chunk it runs it on (interleaved schedules; module docstring).

    Attributes:
      name: the schedule's name.
      forward, backward: ``int32 [num_ticks, num_stages]``.
      weight: likewise; all :data:`IDLE` unless ``split_backward``.
      split_backward: ``B`` computes input gradients only and ``W`` the weight gradients.
      num_chunks: model chunks per stage (``V``: virtual stage ``v * P + s`` is chunk
        ``v`` of stage ``s``); 1 for the non-interleaved schedules.
      forward_chunk, backward_chunk, weight_chunk: ``int32 [num_ticks, num_stages]``, the
        chunk of each task (0 where idle; all 0 when ``num_chunks == 1``).
    """

    name: str
    forward: np.ndarray
    backward: np.ndarray
    weight: np.ndarray | None = None
    split_backward: bool = False
    num_chunks: int = 1
    forward_chunk: np.ndarray | None = None
    backward_chunk: np.ndarray | None = None
    weight_chunk: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.weight is None:
            object.__setattr__(self, "weight", np.full_like(np.asarray(self.forward), IDLE))
        for field in ("forward_chunk", "backward_chunk", "weight_chunk"):
            if getattr(self, field) is None:
                object.__setattr__(self, field, np.zeros_like(np.asarray(self.forward)))
        for field in (
            "forward",
            "backward",
            "weight",
            "forward_chunk",
            "backward_chunk",
            "weight_chunk",
        ):
            value = np.asarray(getattr(self, field), np.int32)
            value.setflags(write=False)
            object.__setattr__(self, field, value)
        self.validate()

    # -------------------------------------------------------------------------- shape

    @property
    def num_ticks(self) -> int:
        return int(self.forward.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.forward.shape[1])

    @property
    def num_microbatches(self) -> int:
        return int(self.forward.max()) + 1

    def _table(self, task: Task) -> np.ndarray:
        return {"F": self.forward, "B": self.backward, "W": self.weight}[task]

    def chunks(self, task: Task) -> np.ndarray:
        """``[num_ticks, num_stages]`` model chunk of each ``task`` entry."""
        return {"F": self.forward_chunk, "B": self.backward_chunk, "W": self.weight_chunk}[task]

    def ticks(self, task: Task, stage: int, chunk: int = 0) -> np.ndarray:
        """Ticks of ``stage``'s ``task`` on model ``chunk``, indexed by microbatch (-1:
        never)."""
        col, chunks = self._table(task)[:, stage], self.chunks(task)[:, stage]
        out = np.full(self.num_microbatches, -1, np.int64)
        for t in np.flatnonzero((col != IDLE) & (chunks == chunk)):
            out[col[t]] = t
        return out

    def source(self, task: Task, stage: int, chunk: int) -> tuple[int, int] | None:
        """``(stage, chunk)`` whose ``task`` sends ``(stage, chunk)``'s input for ``task``
        (``F``: the activation, ``B``: the gradient), or ``None`` for the first virtual
        stage's ``F`` (its ``pre``) and the last virtual stage's ``B`` (its own ``F`` ran
        the loss) (:func:`source_of`)."""
        return source_of(task, stage, chunk, self.num_stages, self.num_chunks)

    # -------------------------------------------------------------------------- facts

    def last_grad_tick(self, stage: int) -> int:
        """Tick of ``stage``'s last ``B`` or ``W`` (over its chunks): after it the stage's
        gradients are complete and its buckets can be synced (the cooldown sync)."""
        tasks = ("B", "W") if self.split_backward else ("B",)
        return max(
            int(self.ticks(task, stage, v).max()) for task in tasks for v in range(self.num_chunks)
        )

    def always_busy(self, task: Task) -> bool:
        """Every stage runs ``task`` in every tick (one stage, :func:`single_stage`): the
        executor calls it without a conditional."""
        return bool((self._table(task) != IDLE).all())

    def sync_tick(self, stage: int) -> int:
        """Tick of ``stage``'s cooldown sync (its buckets' data-parallel collectives): the
        tick after its :meth:`last_grad_tick`, in which the stage has no task left while
        the stages before it still run backwards, so its collectives take no time of its
        own from the schedule; the last gradient tick itself when that is the schedule's
        last tick (nothing runs after it: the first stage under 1F1B)."""
        return min(self.last_grad_tick(stage) + 1, self.num_ticks - 1)

    def _live(self, stage: int, start: Task, end: Task, chunk: int) -> np.ndarray:
        """``[num_ticks]``: microbatches of ``(stage, chunk)`` between ``start`` and
        ``end`` (both ticks included)."""
        a, b = self.ticks(start, stage, chunk), self.ticks(end, stage, chunk)
        t = np.arange(self.num_ticks)[:, None]
        return ((a <= t) & (b >= t)).sum(axis=1)

    def live_count(self, stage: int, start: Task, end: Task, chunk: int | None = 0) -> int:
        """Most microbatches ``stage`` has run ``start`` but not yet ``end`` of on
        ``chunk`` (both ticks included); ``chunk=None``: over all its chunks at once."""
        chunks = range(self.num_chunks) if chunk is None else (chunk,)
        return int(sum(self._live(stage, start, end, v) for v in chunks).max())

    def in_flight(self, stage: int) -> int:
        """Most (microbatch, chunk) pairs ``stage`` holds activations of at once: from the
        tick its ``F`` ran through the tick its last task on them ran (``W`` if split,
        else ``B``)."""
        return self.live_count(stage, "F", "W" if self.split_backward else "B", chunk=None)

    def slot_map(self, start: Task, end: Task) -> np.ndarray:
        """``int32 [num_stages, num_chunks, num_microbatches]``: the buffer slot each
        microbatch of each (stage, chunk) keeps from its ``start`` tick through its ``end``
        tick (both included), the lowest one free then (interval colouring: a stage needs
        as many slots as it holds pairs at once, :meth:`live_count` over its chunks --
        Megatron's bound, whatever order the chunks interleave in)."""
        out = np.zeros((self.num_stages, self.num_chunks, self.num_microbatches), np.int32)
        for s in range(self.num_stages):
            spans = sorted(
                (int(self.ticks(start, s, v)[m]), int(self.ticks(end, s, v)[m]), v, m)
                for v in range(self.num_chunks)
                for m in range(self.num_microbatches)
            )
            busy: dict[int, int] = {}  # slot -> last tick it is held
            for a, b, v, m in spans:
                slot = next(k for k in range(len(busy) + 1) if busy.get(k, -1) < a)
                busy[slot] = b
                out[s, v, m] = slot
        return out

    @property
    def num_slots(self) -> int:
        """Residual slots per stage (a microbatch's from its ``F`` to its ``B``, on one of
        the stage's chunks): the largest :meth:`in_flight` count of ``F`` to ``B`` over the
        stages; where each goes: :meth:`slot_map` ``("F", "B")``."""
        return int(self.slot_map("F", "B").max()) + 1

    @property
    def weight_slots(self) -> int:
        """W-stash slots per stage (a microbatch's from its ``F``, which records the fused
        linears' inputs, to its ``W``); 0 unless ``split_backward``; where each goes:
        :meth:`slot_map` ``("F", "W")``."""
        return int(self.slot_map("F", "W").max()) + 1 if self.split_backward else 0

    def inbox_depth(self, task: Task) -> int:
        """Slots per chunk needed for what a stage receives before the task consuming it
        runs: activations (``"F"``) or gradients (``"B"``) from :meth:`source` (on the last
        virtual stage the loss gradient its own ``F`` produced)."""
        depth = 1
        for s in range(self.num_stages):
            for v in range(self.num_chunks):
                src = self.source(task, s, v)
                if src is not None:
                    arrive = self.ticks(task, *src) + 1
                elif task == "B":
                    arrive = self.ticks("F", s, v)  # the head's backward runs in the F task
                else:
                    continue
                use = self.ticks(task, s, v)
                t = np.arange(self.num_ticks)[:, None]
                depth = max(depth, int(((arrive <= t) & (use >= t)).sum(axis=1).max()))
        return depth

    def work(self, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0) -> np.ndarray:
        """``[num_ticks, num_stages]`` work per stage and tick. A ``B`` that also computes
        weight gradients (not ``split_backward``) costs ``cost_b + cost_w``."""
        b = cost_b if self.split_backward else cost_b + cost_w
        return (
            (self.forward != IDLE) * cost_f
            + (self.backward != IDLE) * b
            + (self.weight != IDLE) * cost_w
        )

    def makespan(self, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0) -> float:
        """Duration under lock-step ticks: each tick lasts as long as the busiest stage's
        work in it."""
        return float(self.work(cost_f, cost_b, cost_w).max(axis=1).sum())

    def bubble_fraction(
        self, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0
    ) -> float:
        """Share of stage-time spent idle: ``1 - busy / (P * makespan)``."""
        busy = self.work(cost_f, cost_b, cost_w).sum()
        return float(1.0 - busy / (self.num_stages * self.makespan(cost_f, cost_b, cost_w)))

    # -------------------------------------------------------------------------- checks

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first rule (module docstring) it breaks."""
        arrays = (
            self.forward,
            self.backward,
            self.weight,
            self.forward_chunk,
            self.backward_chunk,
            self.weight_chunk,
        )
        shapes = {a.shape for a in arrays}
        if self.forward.ndim != 2 or len(shapes) != 1:
            raise ValueError(
                f"schedule {self.name!r}: the task and chunk tables must be "
                f"[ticks, stages] of one shape, got {sorted(shapes)}"
            )
        if not self.split_backward and (self.weight != IDLE).any():
            raise ValueError(f"schedule {self.name!r}: W tasks need split_backward=True")
        v = self.num_chunks
        if any(((c < 0) | (c >= v)).any() for c in arrays[3:]):
            raise ValueError(
                f"schedule {self.name!r}: chunk entries must be in [0, {v}) (num_chunks={v})"
            )
        for s in range(self.num_stages):
            for chunk in range(v):
                self._validate_stage(s, chunk)

    def _validate_stage(self, s: int, chunk: int) -> None:
        m, where = (
            self.num_microbatches,
            f"stage {s}" + (f" chunk {chunk}" if self.num_chunks > 1 else ""),
        )
        tasks = ("F", "B", "W") if self.split_backward else ("F", "B")
        for task in tasks:
            col, chunks = self._table(task)[:, s], self.chunks(task)[:, s]
            order = col[(col != IDLE) & (chunks == chunk)].tolist()
            if order != list(range(m)):
                raise ValueError(
                    f"schedule {self.name!r}: {where} runs {task} of "
                    f"microbatches {order}, expected 0..{m - 1} in order"
                )
        f, b = self.ticks("F", s, chunk), self.ticks("B", s, chunk)
        if (b < f).any():
            raise ValueError(
                f"schedule {self.name!r}: {where} runs B before F of "
                f"microbatch {int(np.argmax(b < f))}"
            )
        if self.split_backward and (self.ticks("W", s, chunk) < b).any():
            raise ValueError(f"schedule {self.name!r}: {where} runs W before B")
        src = self.source("F", s, chunk)
        if src is not None and (f <= self.ticks("F", *src)).any():
            raise ValueError(
                f"schedule {self.name!r}: {where} runs F before its input "
                "arrives from the previous stage"
            )
        src = self.source("B", s, chunk)
        if src is not None and (b <= self.ticks("B", *src)).any():
            raise ValueError(
                f"schedule {self.name!r}: {where} runs B before its "
                "gradient arrives from the next stage"
            )


def source_of(
    task: Task, stage: int, chunk: int, num_stages: int, num_chunks: int
) -> tuple[int, int] | None:
    """The one rule of who feeds whom: virtual stage ``v P + s`` follows ``v P + s - 1``
    (the ring edge takes the last stage's chunk ``v`` to the first stage's chunk
    ``v + 1``); ``(stage, chunk)`` whose ``task`` sends this one's input, or ``None`` at
    the ends (:meth:`ScheduleTable.source`)."""
    virtual = chunk * num_stages + stage + (-1 if task == "F" else 1)
    if not 0 <= virtual < num_stages * num_chunks:
        return None
    return virtual % num_stages, virtual // num_stages


def list_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    split_backward: bool,
    paired: bool = False,
) -> ScheduleTable:
    """Builds a table tick by tick; each stage runs ONE task per tick, chosen in this order:
    its next ``B`` if the gradient for it has arrived (on the last stage: its ``F`` ran),
    else its next ``F`` if the input has arrived and fewer than ``P - s`` microbatches are
    in flight on it (held from ``F`` until ``W``, or ``B`` without ``split_backward``),
    else (``split_backward``) its oldest pending ``W``.

    ``paired`` (not with ``split_backward``): a stage runs its ready ``B`` and, in the same
    tick, its next ``F`` if the input has arrived and fewer than ``2 (P - s)`` microbatches
    are in flight on it (a ``B`` of this tick still holding its own; module docstring).

    With one stage there is no pipeline and no lock step: every schedule is ``F``, ``B``
    (and ``W``) of microbatch ``m`` in tick ``m`` (:func:`single_stage`)."""
    p, m = _check(num_stages, num_microbatches)
    if paired and split_backward:
        raise ValueError(f"schedule {name!r}: paired ticks have no split-backward form")
    if p == 1:
        return single_stage(name, m, split_backward=split_backward)
    bound = [(2 if paired else 1) * (p - s) for s in range(p)]
    done = {k: np.full((p, m), -1, np.int64) for k in "FBW"}
    count = {k: [0] * p for k in "FBW"}
    release = "W" if split_backward else "B"
    rows: list[list[list[tuple[str, int]]]] = []  # per tick, per stage: its tasks
    t = 0
    while min(count[release]) < m:
        row: list[list[tuple[str, int]]] = []
        for s in range(p):
            b, f = count["B"][s], count["F"][s]
            tasks: list[tuple[str, int]] = []
            if b < m and 0 <= done["F"][s, b] < t and (s == p - 1 or 0 <= done["B"][s + 1, b] < t):
                tasks.append(("B", b))
            if (
                (paired or not tasks)
                and f < m
                and f - count[release][s] < bound[s]
                and (s == 0 or 0 <= done["F"][s - 1, f] < t)
            ):
                tasks.append(("F", f))
            if not tasks and split_backward and count["W"][s] < count["B"][s]:
                tasks.append(("W", count["W"][s]))
            row.append(tasks)
        for s, tasks in enumerate(row):
            for task, mb in tasks:
                done[task][s, mb] = t
                count[task][s] += 1
        rows.append(row)
        t += 1
    tables = {k: np.full((len(rows), p), IDLE) for k in "FBW"}
    for tick, row in enumerate(rows):
        for s, tasks in enumerate(row):
            for task, mb in tasks:
                tables[task][tick, s] = mb
    return ScheduleTable(name, tables["F"], tables["B"], tables["W"], split_backward=split_backward)


def single_stage(name: str, num_microbatches: int, *, split_backward: bool) -> ScheduleTable:
    """The one-stage table of every schedule: tick ``m`` runs ``F(m)``, ``B(m)`` (and, with
    ``split_backward``, ``W(m)``). It is 1F1B's and ZB-H1's order at ``P = 1`` in ``M``
    ticks instead of ``2 M`` (``3 M``), one microbatch in flight, and no task is ever idle
    (:meth:`ScheduleTable.always_busy`): the executor runs the tasks without conditionals."""
    _, m = _check(1, num_microbatches)
    ticks = np.arange(m, dtype=np.int32)[:, None]
    weight = ticks if split_backward else np.full_like(ticks, IDLE)
    return ScheduleTable(name, ticks, ticks, weight, split_backward=split_backward)


def one_f_one_b(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """Megatron's 1F1B: ``P - s - 1`` warm-up forwards, then one forward one backward, then
    the cool-down backwards; stage ``s`` holds at most ``P - s`` microbatches."""
    return list_schedule("1f1b", num_stages, num_microbatches, split_backward=False)


def one_f_one_b_paired(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """1F1B's order with paired ticks (module docstring): a stage runs a ready ``B`` and
    its next ``F`` in the same tick, holding up to ``2 (P - s)`` microbatches; every
    steady-state tick is one ``F`` plus one ``B`` on every stage."""
    return list_schedule(
        "1f1b-paired", num_stages, num_microbatches, split_backward=False, paired=True
    )


def zb_h1(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """ZB-H1 (Qi et al.): 1F1B's order and activation bound (``P - s`` from ``F`` to
    ``W``) with each backward split into ``B`` (input gradients, on the critical path) and
    ``W`` (weight gradients), the ``W``\\ s filling the ticks where the stage would idle."""
    return list_schedule("zb-h1", num_stages, num_microbatches, split_backward=True)


SCHEDULES = {"1f1b": one_f_one_b, "1f1b-paired": one_f_one_b_paired, "zb-h1": zb_h1}
"""Schedules by name (``ParallelConfig.pipeline_schedule``'s values)."""

INTERLEAVED_FORMS = ("1f1b", "1f1b-paired", "zb-h1")
"""The schedules with an interleaved form (``num_chunks > 1``,
:mod:`~jax_wgrad.parallel.interleaved`)."""


def get_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
) -> ScheduleTable:
    """The table of schedule ``name``; with ``num_chunks > 1`` its interleaved form
    (:mod:`~jax_wgrad.parallel.interleaved`: ``1f1b`` -> Megatron's interleaved
    1F1B, ``1f1b-paired`` -> the same order with a ``B`` and an ``F`` sharing a tick,
    ``zb-h1`` -> the same order with ``B`` and ``W`` split)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    if num_chunks == 1:
        return SCHEDULES[name](num_stages, num_microbatches)
    if name not in INTERLEAVED_FORMS:
        raise ValueError(
            f"pipeline schedule {name!r} has no interleaved form (num_chunks "
            f"{num_chunks}); those with one: {list(INTERLEAVED_FORMS)}"
        )
    from jax_wgrad.parallel.interleaved import interleaved_schedule

    _check(num_stages, num_microbatches)
    return interleaved_schedule(
        num_stages,
        num_microbatches,
        num_chunks,
        group_size=group_size,
        split_backward=name == "zb-h1",
        paired=name == "1f1b-paired",
    )


def _check(num_stages: int, num_microbatches: int) -> tuple[int, int]:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(num_stages), int(num_microbatches)
