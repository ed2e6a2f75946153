#!/usr/bin/env python
"""Draw the metrics of one or several runs (``--metrics-file`` JSON lines) into a PNG.

Three panels against the step: training loss (validation loss as markers when the run
evaluated), gradient norm, and tokens per second; one line per file, labelled by the
file's name -- e.g. the same run on different parallel layouts, lying on top of each other::

    python examples/plot_metrics.py runs/dp8.jsonl runs/tp2pp2.jsonl -o curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read(path: str) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) of a metrics file."""
    train, valid = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from None
        (valid if "valid_loss" in row else train).append(row)
    return train, valid


def plot(paths: list[str], out: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("loss", "loss"), ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens / s")]
    for path in paths:
        train, valid = read(path)
        label = Path(path).stem
        for ax, (key, _) in zip(axes, panels):
            steps = [r["step"] for r in train if key in r]
            (line,) = ax.plot(steps, [r[key] for r in train if key in r], label=label, alpha=0.8)
            if key == "loss" and valid:
                ax.plot(
                    [r["step"] for r in valid],
                    [r["valid_loss"] for r in valid],
                    "o",
                    color=line.get_color(),
                    label=f"{label} (validation)",
                )
    for ax, (_, name) in zip(axes, panels):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", help="metrics JSON-lines files")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    missing = [m for m in args.metrics if not Path(m).is_file()]
    if missing:
        p.error(f"no such metrics file: {', '.join(missing)}")
    try:
        plot(args.metrics, args.output, args.title)
    except ValueError as exc:
        p.error(str(exc))
    except OSError as exc:  # an output path that cannot be written
        p.error(f"--output {args.output}: cannot write it ({exc.strerror or exc})")
    print(f"wrote {args.output} ({len(args.metrics)} metrics file(s))")


if __name__ == "__main__":
    main(sys.argv[1:])
