"""Pipeline schedule simulator: ``python -m jax_wgrad.schedules``.

Builds a schedule's table (:mod:`jax_wgrad.parallel.schedules`) and reports what
the executor will do with it under its lock-step tick semantics (a tick lasts as long as
the longest work any stage does in it)::

    python -m jax_wgrad.schedules --schedule zb-h1 --stages 4 --microbatches 8 --json
    python -m jax_wgrad.schedules --schedule 1f1b --stages 4 --microbatches 8 --plot 1f1b.png
    python -m jax_wgrad.schedules --stages 4 --microbatches 8 --virtual-stages 2 --compare

``--virtual-stages V`` (Megatron's ``--virtual-pipeline-model-parallel-size``): the
interleaved form of the schedule, each task on one of ``V`` model chunks of ``L / (P V)``
layers, so the costs given (those of a whole stage's ``L / P`` layers) are divided by
``V``. ``--compare`` reports 1F1B, ZB-H1 and (with ``V > 1``) both interleaved schedules
side by side for the same ``P``, ``M`` and costs.

``--json`` prints one object (with ``--compare``: a list): ``schedule``, ``stages``,
``microbatches``, ``virtual_stages``, ``costs`` (per task, after the division by ``V``),
``num_ticks``, ``makespan``, ``bubble_fraction``, ``max_in_flight`` (per stage: most
microbatch-chunk pairs whose activations it holds), ``residual_slots``, ``weight_slots``.
``--plot FILE.png`` draws the per-stage timeline (F/B/W colours, microbatch numbers; with
chunks, chunk ``v > 0`` hatched and labelled ``m.v``).
"""

from __future__ import annotations

import argparse
import json
import sys

from jax_wgrad.parallel.schedules import (
    INTERLEAVED_FORMS,
    SCHEDULES,
    ScheduleTable,
    get_schedule,
)

__all__ = ["summary", "plot_timeline", "main"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def summary(
    table: ScheduleTable, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0
) -> dict:
    """The simulator's JSON object for ``table`` (module docstring)."""
    return {
        "schedule": table.name,
        "stages": table.num_stages,
        "microbatches": table.num_microbatches,
        "virtual_stages": table.num_chunks,
        "costs": {"F": cost_f, "B": cost_b, "W": cost_w},
        "num_ticks": table.num_ticks,
        "makespan": table.makespan(cost_f, cost_b, cost_w),
        "bubble_fraction": round(table.bubble_fraction(cost_f, cost_b, cost_w), 6),
        "max_in_flight": [table.in_flight(s) for s in range(table.num_stages)],
        "residual_slots": table.num_slots,
        "weight_slots": table.weight_slots,
    }


def plot_timeline(
    table: ScheduleTable, path: str, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0
) -> None:
    """Draws each stage's tasks on the lock-step time axis into ``path`` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full_b = cost_b if table.split_backward else cost_b + cost_w
    cost = {"F": cost_f, "B": full_b, "W": cost_w}
    tick_len = table.work(cost_f, cost_b, cost_w).max(axis=1)
    fig, ax = plt.subplots(
        figsize=(max(6.0, 0.35 * float(tick_len.sum())), 0.6 * table.num_stages + 1.2)
    )
    start = 0.0
    for t in range(table.num_ticks):
        for s in range(table.num_stages):
            offset = start
            for task, col in (("F", table.forward), ("B", table.backward), ("W", table.weight)):
                m, v = int(col[t, s]), int(table.chunks(task)[t, s])
                if m < 0:
                    continue
                ax.barh(
                    s,
                    cost[task],
                    left=offset,
                    color=COLORS[task],
                    edgecolor="black",
                    linewidth=0.5,
                    hatch="//" if v else None,
                )
                label = f"{m}.{v}" if table.num_chunks > 1 else str(m)
                ax.text(
                    offset + cost[task] / 2,
                    s,
                    label,
                    ha="center",
                    va="center",
                    fontsize=6 if table.num_chunks > 1 else 7,
                    color="white",
                )
                offset += cost[task]
        start += float(tick_len[t])
    ax.set_yticks(range(table.num_stages), [f"stage {s}" for s in range(table.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (lock-step ticks; a tick lasts as long as its busiest stage)")
    chunks = f", V={table.num_chunks}" if table.num_chunks > 1 else ""
    ax.set_title(
        f"{table.name}: P={table.num_stages}, M={table.num_microbatches}{chunks}, makespan "
        f"{table.makespan(cost_f, cost_b, cost_w):g}, bubble "
        f"{100 * table.bubble_fraction(cost_f, cost_b, cost_w):.0f}%"
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for k, c in COLORS.items()
        if k != "W" or table.split_backward
    ]
    labels = ["F", "B" if table.split_backward else "B (with W)"] + (
        ["W"] if table.split_backward else []
    )
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m jax_wgrad.schedules", description=__doc__.splitlines()[0]
    )
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches M")
    p.add_argument("--cost-f", type=float, default=1.0)
    p.add_argument(
        "--cost-b",
        type=float,
        default=1.0,
        help="input-gradient backward (B); without a split backward B costs B + W",
    )
    p.add_argument("--cost-w", type=float, default=1.0)
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per stage (interleaved schedule; costs divided by V)",
    )
    p.add_argument(
        "--microbatch-group-size",
        type=int,
        default=None,
        help="Megatron's --microbatch-group-size-per-virtual-pipeline-stage "
        "(default: P, and M must be a multiple of P)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="every schedule and (V > 1) the interleaved forms side by side",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the per-stage timeline")
    args = p.parse_args(argv)
    for name in ("cost_f", "cost_b", "cost_w"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.virtual_stages < 1:
        p.error(f"--virtual-stages must be >= 1, got {args.virtual_stages}")
    runs = [(args.schedule, args.virtual_stages)]
    if args.compare:
        runs = [
            (n, v)
            for v in sorted({1, args.virtual_stages})
            for n in sorted(SCHEDULES if v == 1 else INTERLEAVED_FORMS)
        ]
    rows = []
    for name, v in runs:
        try:
            table = get_schedule(
                name, args.stages, args.microbatches, v, args.microbatch_group_size
            )
        except ValueError as exc:
            p.error(str(exc))
        costs = (args.cost_f / v, args.cost_b / v, args.cost_w / v)
        rows.append(summary(table, *costs))
        if args.plot and not args.compare:
            plot_timeline(table, args.plot, *costs)
    if args.json:
        print(json.dumps(rows if args.compare else rows[0]))
    else:
        for out in rows:
            print(
                f"{out['schedule']}: P={out['stages']} M={out['microbatches']} "
                f"V={out['virtual_stages']} | ticks {out['num_ticks']} | makespan "
                f"{out['makespan']:g} | bubble {100 * out['bubble_fraction']:.1f}% | "
                f"max in flight {out['max_in_flight']}"
            )
    return rows if args.compare else rows[0]


if __name__ == "__main__":
    main(sys.argv[1:])
