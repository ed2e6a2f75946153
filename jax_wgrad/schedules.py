"""Pipeline schedule simulator: ``python -m jax_wgrad.schedules``.

Builds a schedule's table (:mod:`jax_wgrad.parallel.pipeline.schedules`) and reports what
the executor will do with it under its lock-step tick semantics (a tick lasts as long as
the longest work any stage does in it)::

    python -m jax_wgrad.schedules --schedule zb-h1 --stages 4 --microbatches 8 --json
    python -m jax_wgrad.schedules --schedule 1f1b --stages 4 --microbatches 8 --plot 1f1b.png

``--json`` prints one object: ``schedule``, ``stages``, ``microbatches``, ``costs``,
``num_ticks``, ``makespan``, ``bubble_fraction``, ``max_in_flight`` (per stage: most
microbatches whose activations it holds), ``residual_slots``, ``weight_slots``.
``--plot FILE.png`` draws the per-stage timeline (F/B/W colours, microbatch numbers).
"""

from __future__ import annotations

import argparse
import json
import sys

from jax_wgrad.parallel.pipeline.schedules import SCHEDULES, ScheduleTable, get_schedule

__all__ = ["summary", "plot_timeline", "main"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def summary(table: ScheduleTable, cost_f: float = 1.0, cost_b: float = 1.0,
            cost_w: float = 1.0) -> dict:
    """The simulator's JSON object for ``table`` (module docstring)."""
    return {
        "schedule": table.name, "stages": table.num_stages,
        "microbatches": table.num_microbatches,
        "costs": {"F": cost_f, "B": cost_b, "W": cost_w},
        "num_ticks": table.num_ticks,
        "makespan": table.makespan(cost_f, cost_b, cost_w),
        "bubble_fraction": round(table.bubble_fraction(cost_f, cost_b, cost_w), 6),
        "max_in_flight": [table.in_flight(s) for s in range(table.num_stages)],
        "residual_slots": table.num_slots, "weight_slots": table.weight_slots,
    }


def plot_timeline(table: ScheduleTable, path: str, cost_f: float = 1.0, cost_b: float = 1.0,
                  cost_w: float = 1.0) -> None:
    """Draws each stage's tasks on the lock-step time axis into ``path`` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full_b = cost_b if table.split_backward else cost_b + cost_w
    cost = {"F": cost_f, "B": full_b, "W": cost_w}
    tick_len = table.work(cost_f, cost_b, cost_w).max(axis=1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * float(tick_len.sum())),
                                    0.6 * table.num_stages + 1.2))
    start = 0.0
    for t in range(table.num_ticks):
        for s in range(table.num_stages):
            offset = start
            for task, col in (("F", table.forward), ("B", table.backward), ("W", table.weight)):
                m = int(col[t, s])
                if m < 0:
                    continue
                ax.barh(s, cost[task], left=offset, color=COLORS[task], edgecolor="black",
                        linewidth=0.5)
                ax.text(offset + cost[task] / 2, s, str(m), ha="center", va="center",
                        fontsize=7, color="white")
                offset += cost[task]
        start += float(tick_len[t])
    ax.set_yticks(range(table.num_stages), [f"stage {s}" for s in range(table.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (lock-step ticks; a tick lasts as long as its busiest stage)")
    ax.set_title(f"{table.name}: P={table.num_stages}, M={table.num_microbatches}, makespan "
                 f"{table.makespan(cost_f, cost_b, cost_w):g}, bubble "
                 f"{100 * table.bubble_fraction(cost_f, cost_b, cost_w):.0f}%")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items()
               if k != "W" or table.split_backward]
    labels = ["F", "B" if table.split_backward else "B (with W)"] + (
        ["W"] if table.split_backward else [])
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m jax_wgrad.schedules",
                                description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches M")
    p.add_argument("--cost-f", type=float, default=1.0)
    p.add_argument("--cost-b", type=float, default=1.0,
                   help="input-gradient backward (B); without a split backward B costs B + W")
    p.add_argument("--cost-w", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the per-stage timeline")
    args = p.parse_args(argv)
    try:
        table = get_schedule(args.schedule, args.stages, args.microbatches)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("cost_f", "cost_b", "cost_w"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    out = summary(table, args.cost_f, args.cost_b, args.cost_w)
    if args.plot:
        plot_timeline(table, args.plot, args.cost_f, args.cost_b, args.cost_w)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['schedule']}: P={out['stages']} M={out['microbatches']} | ticks "
              f"{out['num_ticks']} | makespan {out['makespan']:g} | bubble "
              f"{100 * out['bubble_fraction']:.1f}% | max in flight {out['max_in_flight']}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
