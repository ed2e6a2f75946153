#!/usr/bin/env python
"""Ragged grouped GEMMs (dropless MoE experts) against jax.lax.ragged_dot.

R rows sorted into G equal groups that hold a fraction of the rows (the rest lie past
the groups: rows a dropless router did not route here, or padding), for each routed
fraction and dtype, times (median of --iters calls after --warmup, each blocked on):

  fwd   jax_wgrad.ops.ragged_matmul(x [R, H], w [G, F, H], sizes)   (transpose_rhs, the
        expert linear's forward layout)   vs   jax.lax.ragged_dot(x, w [G, H, F], sizes)
  wgrad jax_wgrad.ops.ragged_wgrad_accumulate(x, dy [R, F], sizes, acc [G, F, H] f32),
        acc donated (in place)   vs   acc [G, H, F] + d/dw of ragged_dot (jax.vjp with
        cotangent dy), acc donated

and prints a table with both times and their ratios (fused / XLA; < 1: the fused op is
faster). Each pair's results are checked to agree before timing. XLA lowers ragged_dot
to a dense masked product (G times the FLOPs of the routed rows, whatever is routed); the
fused ops do one GEMM per group over its rows only.

    python benchmarks/ragged_gemm.py                       # R=4096, H=512, F=1024, G=8
    python benchmarks/ragged_gemm.py --fractions 1 0.5 0.25 --dtypes float32 bfloat16
    python benchmarks/ragged_gemm.py --json                # one JSON line per row
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_wgrad
from jax_wgrad import ops


def _load_sibling(name: str):
    """Another benchmark of this folder, as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Median milliseconds of fn(*make_args(prev)), threading donated buffers.
_time = _load_sibling("wgrad_kernel")._time


def group_sizes(rows: int, groups: int, fraction: float) -> np.ndarray:
    """``groups`` near-equal sizes summing to ``round(fraction * rows)``."""
    routed = int(round(fraction * rows))
    return np.array([routed // groups + (g < routed % groups) for g in range(groups)], np.int32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def bench(
    rows: int,
    hidden: int,
    ffn: int,
    groups: int,
    fraction: float,
    dtype,
    warmup: int,
    iters: int,
    precision: str | None,
) -> dict:
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (rows, hidden), dtype)
    dy = jax.random.normal(k[1], (rows, ffn), dtype)
    w_nk = jax.random.normal(k[2], (groups, ffn, hidden), dtype) / hidden**0.5
    w_kn = jnp.swapaxes(w_nk, 1, 2)
    sizes = jnp.asarray(group_sizes(rows, groups, fraction))

    fused_fwd = jax.jit(lambda x, w, s: ops.ragged_matmul(x, w, s, precision=precision))
    xla_fwd = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=precision))
    fused_wgrad = jax.jit(
        lambda x, dy, s, acc: ops.ragged_wgrad_accumulate(x, dy, s, acc, precision=precision),
        donate_argnums=3,
    )

    def xla_grad(x, dy, s, acc):
        _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, s, precision=precision), w_kn)
        return acc + vjp(dy)[0]

    xla_wgrad = jax.jit(xla_grad, donate_argnums=3)

    acc_nk = lambda: jnp.zeros((groups, ffn, hidden), jnp.float32)
    acc_kn = lambda: jnp.zeros((groups, hidden, ffn), jnp.float32)
    fwd_err = _rel(fused_fwd(x, w_nk, sizes), xla_fwd(x, w_kn, sizes))
    wgrad_err = _rel(
        jnp.swapaxes(fused_wgrad(x, dy, sizes, acc_nk()), 1, 2), xla_wgrad(x, dy, sizes, acc_kn())
    )
    tol = 1e-4 if jnp.dtype(dtype) == jnp.float32 else 1e-2
    if max(fwd_err, wgrad_err) > tol:
        raise AssertionError(
            f"fused and XLA results differ: forward {fwd_err:.2e}, "
            f"wgrad {wgrad_err:.2e} (relative; tolerance {tol:.0e})"
        )
    row = {
        "platform": jax.default_backend(),
        "dtype": jnp.dtype(dtype).name,
        "R": rows,
        "H": hidden,
        "F": ffn,
        "G": groups,
        "routed": fraction,
        "fwd_fused_ms": _time(fused_fwd, lambda _: (x, w_nk, sizes), warmup, iters),
        "fwd_ragged_dot_ms": _time(xla_fwd, lambda _: (x, w_kn, sizes), warmup, iters),
        "wgrad_fused_ms": _time(
            fused_wgrad,
            lambda prev: (x, dy, sizes, acc_nk() if prev is None else prev),
            warmup,
            iters,
        ),
        "wgrad_xla_ms": _time(
            xla_wgrad,
            lambda prev: (x, dy, sizes, acc_kn() if prev is None else prev),
            warmup,
            iters,
        ),
    }
    row["fwd_ratio"] = row["fwd_fused_ms"] / row["fwd_ragged_dot_ms"]
    row["wgrad_ratio"] = row["wgrad_fused_ms"] / row["wgrad_xla_ms"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


# column, decimals (None: text); each column as wide as its name
_COLUMNS = [
    ("dtype", None),
    ("routed", 2),
    ("fwd_fused_ms", 3),
    ("fwd_ragged_dot_ms", 3),
    ("fwd_ratio", 3),
    ("wgrad_fused_ms", 3),
    ("wgrad_xla_ms", 3),
    ("wgrad_ratio", 3),
]


def _table_row(row: dict | None) -> str:
    """A row of the table, or its header for ``None``."""
    if row is None:
        return "  ".join(f"{name:>{max(9, len(name))}}" for name, _ in _COLUMNS)
    return "  ".join(
        f"{row[name]:>{max(9, len(name))}}"
        if dec is None
        else f"{row[name]:>{max(9, len(name))}.{dec}f}"
        for name, dec in _COLUMNS
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="R: rows (tokens x top-k)")
    parser.add_argument("--hidden", type=int, default=512, help="H: expert input features")
    parser.add_argument("--ffn", type=int, default=1024, help="F: expert output features")
    parser.add_argument("--groups", type=int, default=8, help="G: experts")
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[1.0, 0.5, 0.25],
        help="fractions of the R rows routed to the groups",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=["default", "tensorfloat32", "float32", "highest"],
        help="matmul precision of every path (default: jax's)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON line per row")
    args = parser.parse_args(argv)
    if min(args.rows, args.hidden, args.ffn, args.groups, args.iters) < 1 or args.warmup < 0:
        parser.error("--rows, --hidden, --ffn, --groups and --iters must be >= 1, --warmup >= 0")
    if not all(0.0 <= f <= 1.0 for f in args.fractions):
        parser.error(f"--fractions must lie in [0, 1], got {args.fractions}")
    if not jax_wgrad.fusion_available(families=("ragged",)):
        status = jax_wgrad.fusion_status(families=("ragged",))
        sys.exit(f"the ragged GEMM handlers are unavailable on {jax.default_backend()}: {status}")
    if not args.json:
        print(
            f"# {jax.default_backend()}: R={args.rows} H={args.hidden} F={args.ffn} "
            f"G={args.groups}; ratio = fused / XLA (median of {args.iters})"
        )
        print(_table_row(None))
    for dtype in args.dtypes:
        for fraction in args.fractions:
            row = bench(
                args.rows,
                args.hidden,
                args.ffn,
                args.groups,
                fraction,
                jnp.dtype(dtype),
                args.warmup,
                args.iters,
                args.precision,
            )
            print(json.dumps(row) if args.json else _table_row(row), flush=True)


if __name__ == "__main__":
    main()
