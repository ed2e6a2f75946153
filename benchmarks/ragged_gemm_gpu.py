"""Timing of the ragged grouped GEMMs (dropless MoE experts) on a GPU, against XLA.

For each case G x R x K x N (G experts, R routed rows, x [R, K], expert weights
[G, N, K]) and dtype, with the rows spread over the experts evenly or skewed (--skew:
group g gets a share proportional to (g + 1) ** skew), times (median of --iters runs of
one jitted scan over --steps stacked inputs, after --warmup runs):
  fwd      jax_wgrad.ops.ragged_matmul(x, w, sizes, transpose_rhs=True)   y [R, N]
  dgrad    jax_wgrad.ops.ragged_matmul(dy, w, sizes, transpose_rhs=False) dx [R, K]
  wgrad    jax_wgrad.ops.ragged_wgrad_accumulate(x, dy, sizes, acc)  acc [G, N, K] f32,
           donated
  xla_ragged_dot  jax.lax.ragged_dot(x, w [G, K, N], sizes) (XLA's own ragged product)
  dense_fwd       einsum over [G, R / G, K] (even split only: cuBLAS's batched GEMM with
                  the same useful FLOPs, the bar to reach)
and prints one JSON line per case with the milliseconds per call and the TFLOP/s of the
routed rows (2 * R * K * N per GEMM). jax_wgrad's ops are timed once per kernel choice of
--kernels (default both: "auto", CUTLASS's sm90 grouped GEMMs on a Hopper GPU where the
shapes allow, and "wmma", the fallback kernels forced with
jax_wgrad.ops.ragged.set_cuda_kernel), each key naming the kernels that actually ran
(counted by the handlers): e.g. fwd[cutlass]_ms, fwd[wmma]_ms.

    python benchmarks/ragged_gemm_gpu.py
    python benchmarks/ragged_gemm_gpu.py --cases 64x16384x2048x1408 --dtype bfloat16 --skew 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_wgrad import ops
from jax_wgrad.ops import ragged

CASES = [(8, 16384, 4096, 1024), (64, 16384, 2048, 1408), (128, 16384, 2048, 768)]
# (XLA expands ragged_dot densely: [R, G, K] for its lhs, 8.6 GB in the last case.)


def group_sizes(groups: int, rows: int, skew: float) -> np.ndarray:
    share = (np.arange(groups) + 1.0) ** skew
    sizes = np.floor(rows * share / share.sum()).astype(np.int32)
    sizes[-1] += rows - sizes.sum()
    return sizes


def timed(fn, args, warmup: int, iters: int) -> float:
    """Median seconds of fn(*args) (blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scan_of(op, steps):
    """A jitted scan applying op to each of `steps` stacked inputs; the carry keeps one
    element of each result, so that no call can be hoisted or removed."""

    def run(stacked, *rest):
        def body(c, xs):
            return c + op(xs, *rest)[0, 0].astype(jnp.float32), None

        return jax.lax.scan(body, jnp.float32(0), stacked)[0]

    return jax.jit(run)


def kernels_ran(before: dict[str, int]) -> str:
    """The kernels the ragged handlers enqueued since ``before`` (a launch count)."""
    after = ragged.cuda_kernel_launches()
    ran = [k for k in ("cutlass", "wmma") if after[k] > before[k]]
    return "+".join(ran) or "none"


def run_case(case, dtype, skew, steps, warmup, iters, device, kernels=("auto", "wmma")):
    g, r, k, n = case
    key = jax.random.key(0)
    with jax.default_device(device):  # generated on the device: no host copies
        xs, dys, w = (
            jax.random.normal(kk, shape, dtype) * scale
            for kk, shape, scale in zip(
                jax.random.split(key, 3),
                ((steps, r, k), (steps, r, n), (g, n, k)),
                (1.0, 1.0, float(1.0 / np.sqrt(k))),
            )
        )
        w_kn = jnp.swapaxes(w, 1, 2)
    sizes = jax.device_put(jnp.asarray(group_sizes(g, r, skew)), device)
    data = (xs, dys, w, w_kn, sizes)
    row = {}
    for i, kernel in enumerate(kernels):
        ragged.set_cuda_kernel(kernel)
        jax.clear_caches()  # fresh executables: nothing recorded with the other choice
        row.update(_run_case(case, data, skew, steps, warmup, iters, device, baselines=i == 0))
    ragged.set_cuda_kernel("auto")
    return row


def _run_case(case, data, skew, steps, warmup, iters, device, baselines):
    g, r, k, n = case
    xs, dys, w, w_kn, sizes = data
    dtype = xs.dtype

    per_call = {}
    before = ragged.cuda_kernel_launches()
    per_call["fwd"] = (
        timed(
            scan_of(lambda x, w, s: ops.ragged_matmul(x, w, s, transpose_rhs=True), steps),
            (xs, w, sizes),
            warmup,
            iters,
        )
        / steps
    )
    per_call[f"fwd[{kernels_ran(before)}]"] = per_call.pop("fwd")
    before = ragged.cuda_kernel_launches()
    per_call["dgrad"] = (
        timed(
            scan_of(lambda dy, w, s: ops.ragged_matmul(dy, w, s, transpose_rhs=False), steps),
            (dys, w, sizes),
            warmup,
            iters,
        )
        / steps
    )
    per_call[f"dgrad[{kernels_ran(before)}]"] = per_call.pop("dgrad")
    if baselines:
        per_call.update(_baselines(xs, w, w_kn, sizes, g, r, k, n, skew, steps, warmup, iters))

    def wgrad_scan(acc, xs, dys, s):
        def body(a, xy):
            return ops.ragged_wgrad_accumulate(xy[0], xy[1], s, a), None

        return jax.lax.scan(body, acc, (xs, dys))[0]

    wgrad = jax.jit(wgrad_scan, donate_argnums=0)
    acc = [jax.device_put(jnp.zeros((g, n, k), jnp.float32), device)]

    def wgrad_once(xs, dys, s):  # the donated accumulator is threaded from call to call
        acc[0] = wgrad(acc[0], xs, dys, s)
        return acc[0]

    before = ragged.cuda_kernel_launches()
    seconds = timed(wgrad_once, (xs, dys, sizes), warmup, iters) / steps
    per_call[f"wgrad[{kernels_ran(before)}]"] = seconds

    flops = 2.0 * r * k * n
    row = {
        "platform": device.platform,
        "device": device.device_kind,
        "dtype": jnp.dtype(dtype).name,
        "G": g,
        "R": r,
        "K": k,
        "N": n,
        "skew": skew,
    }
    for name, seconds in per_call.items():
        row[f"{name}_ms"] = round(seconds * 1e3, 4)
        row[f"{name}_tflops"] = round(flops / seconds / 1e12, 1)
    return row


def _baselines(xs, w, w_kn, sizes, g, r, k, n, skew, steps, warmup, iters):
    """XLA's own ragged product and (even split) cuBLAS's batched GEMM, seconds per call."""
    per_call = {}
    per_call["xla_ragged_dot"] = (
        timed(
            scan_of(
                lambda x, w, s: jax.lax.ragged_dot(
                    x, w, s, preferred_element_type=jnp.float32
                ).astype(x.dtype),
                steps,
            ),
            (xs, w_kn, sizes),
            warmup,
            iters,
        )
        / steps
    )
    if skew == 0 and r % g == 0:
        per_call["dense_fwd"] = (
            timed(
                scan_of(
                    lambda x, w: jnp.einsum("gck,gnk->gcn", x.reshape(g, r // g, k), w).reshape(
                        r, n
                    ),
                    steps,
                ),
                (xs, w),
                warmup,
                iters,
            )
            / steps
        )
    return per_call


def parse_cases(parser: argparse.ArgumentParser, values: list[str] | None, default, example: str):
    """``--cases`` values ``AxBx...`` as int tuples of ``example``'s length (``default``
    when not given); a malformed one is a usage error showing ``example``."""
    if not values:
        return default
    try:
        cases = [tuple(int(v) for v in c.split("x")) for c in values]
    except ValueError:
        cases = [()]
    if any(len(c) != len(example.split("x")) for c in cases):
        parser.error(f"--cases takes {example}")
    return cases


def gpu_device(script: str):
    """The first CUDA GPU jax sees; exits naming ``script`` without one."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        sys.exit(f"{script}: needs a CUDA GPU visible to jax")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=None, help="GxRxKxN ...")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto", "wmma"],
        choices=["auto", "wmma"],
        help="kernel choices of the ragged handlers to time (set_cuda_kernel)",
    )
    args = parser.parse_args(argv)
    cases = parse_cases(parser, args.cases, CASES, "GxRxKxN, e.g. 8x16384x4096x1024")
    device = gpu_device("ragged_gemm_gpu")
    for case in cases:
        print(
            json.dumps(
                run_case(
                    case,
                    jnp.dtype(args.dtype),
                    args.skew,
                    args.steps,
                    args.warmup,
                    args.iters,
                    device,
                    tuple(args.kernels),
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
