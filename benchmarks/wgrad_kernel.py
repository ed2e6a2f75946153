"""Benchmark of the fused weight-gradient accumulation against XLA's own paths.

For each (dtype, T, out, in) case -- or (dtype, E, T, out, in) for expert weights
[E, out, in], the grouped op, E experts in one call -- in one process, times (median of
--iters runs after --warmup runs, each call blocked on), all at the same matmul precision
(--precision, default jax's: TF32 for float32 on a GPU, as XLA's own dot):
  fused    jax_wgrad.wgrad_accumulate (FFI, accumulator donated: in place); grouped:
           jax_wgrad.ops.grouped_wgrad_accumulate
  xla      acc + jnp.dot(dy.T, x, preferred_element_type=f32) in one jit, acc donated
           (XLA's own fused path; on GPU a cuBLAS GEMM with beta = 1); grouped: the
           batched dot (einsum) over the experts
  unfused  dW = dot(dy.T, x) in one call, acc + dW in another (acc donated)
  gemm     the plain GEMM dot(dy.T, x) alone (the lower bound)
and, for a dense case, the same update of the second [out, in] block of a flat bucket of
two at a position traced from a jit argument, as a scan over stacked layers gives it:
  fused_at jax_wgrad.wgrad_accumulate(..., offset=BlockOffset(0, index, out * in)) (the
           _at handler: on a GPU the position stays on the device, a set-up kernel writes
           the pointer arrays of one cublasGemmBatchedEx)
  xla_at   XLA's own: dynamic_slice of the block + dot, dynamic_update_slice back
and prints one JSON line per case:
  platform, dtype, precision, E (grouped only), T, out, in, fused_ms, xla_ms, unfused_ms, gemm_ms,
  fused_at_ms, xla_at_ms (dense only), fused_over_xla, fused_over_gemm, fused_at_over_xla_at,
  fused_at_over_fused (dense only), rel_diff (the largest of fused vs xla and fused_at vs
  xla_at, checked against the tolerance of the precision used) (and tflops on GPU, of the
  fused and fused_at calls; blas_core on CPU).

``--dtypes float8`` times the FP8 form (:func:`jax_wgrad.ops.fp8_wgrad_accumulate`, dense
cases only): ``x`` in E4M3 and ``dy`` in E5M2 (Megatron's hybrid format) with their
power-of-two scales (:func:`jax_wgrad.functional.fp8.quantize`); ``xla`` is then XLA's own
FP8 GEMM (``dot_general`` on the FP8 values, float32 output, times the scales:
cuBLASLt's FP8 GEMM on a GPU) plus the add, ``gemm`` that GEMM alone, and the tolerance
that of float32 sums of exact products.

On CPU the handler's speed depends on the OpenBLAS kernel family (``blas_core``): an
``OPENBLAS_CORETYPE`` set in the environment (e.g. Haswell on an AVX-512 machine) forces
an older, slower kernel.

    python benchmarks/wgrad_kernel.py                 # default cases of the platform
    python benchmarks/wgrad_kernel.py --cases 4096x1024x1024 --dtypes float32
    python benchmarks/wgrad_kernel.py --cases 8x1024x1024x4096   # 8 experts
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_wgrad

# (T, out, in), or (E, T, out, in) for the grouped expert op (T tokens per expert).
CPU_CASES = [
    (4096, 1024, 1024),
    (8192, 4096, 1024),
    (2048, 4096, 4096),
    (8, 512, 1024, 1024),
    (4, 1024, 2048, 512),
]
GPU_CASES = [
    (4096, 1024, 1024),
    (8192, 4096, 1024),
    (2048, 4096, 4096),
    (16384, 8192, 8192),
    (32768, 4096, 4096),
    (8192, 12288, 4096),
    (4096, 16384, 4096),  # the MLP weights of the 1.6 B step of step_vs_plain_jax.py
    (4096, 4096, 16384),
    (8, 2048, 4096, 1024),
    (8, 2048, 1024, 4096),
    (64, 512, 2048, 1024),
]


def blas_core() -> str:
    """OpenBLAS kernel family used by the CPU handler (OPENBLAS_CORETYPE overrides it)."""
    import ctypes
    import os

    import scipy_openblas32

    lib = ctypes.CDLL(
        os.path.join(scipy_openblas32.get_lib_dir(), "lib" + scipy_openblas32.get_library() + ".so")
    )
    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    return lib.scipy_openblas_get_corename().decode()


def _time(fn, make_args, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn(*args)``; ``make_args(prev)`` threads donated buffers."""
    out = None
    times = []
    for i in range(warmup + iters):
        args = make_args(out)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tolerance(dtype: jnp.dtype, precision: str | None) -> float:
    """Max relative difference allowed between two GEMMs of the same precision.

    16-bit inputs are multiplied exactly and summed in fp32 by both, in different orders:
    1e-4. float32 on a GPU below HIGHEST rounds every input to TF32 (u = 2^-11), so each
    result is off by about 2u relative; two such results differ by up to ~4u, and 8u
    covers the largest of many elements.
    """
    tf32 = (
        jnp.dtype(dtype) == jnp.float32
        and jax.default_backend() == "gpu"
        and jax_wgrad.ops.matmul_precision(precision) < 2
    )
    return 8 * 2.0**-11 if tf32 else 1e-4


def _fp8_operands(T: int, n_out: int, n_in: int):
    """``(x, dy)`` quantized as FP8 training does (E4M3 input, E5M2 output gradient)."""
    from jax_wgrad.functional.fp8 import quantize

    k1, k2 = jax.random.split(jax.random.key(0))
    x = quantize(jax.random.normal(k1, (T, n_in), jnp.float32), jnp.float8_e4m3fn)
    dy = quantize(jax.random.normal(k2, (T, n_out), jnp.float32) * 1e-3, jnp.float8_e5m2)
    return x, dy


def bench_fp8_case(T: int, n_out: int, n_in: int, warmup: int, iters: int) -> dict:
    """Times one dense case of the FP8 form (module docstring)."""
    from jax_wgrad.functional.fp8 import fp8_dot

    x, dy = _fp8_operands(T, n_out, n_in)
    zeros = lambda: jnp.zeros((n_out, n_in), jnp.float32)

    def dw(x, dy):
        return fp8_dot(dy, x, (((0,), (0,)), ((), ())), jnp.float32)

    def accumulate(x, dy, acc, offset=None):
        return jax_wgrad.ops.fp8_wgrad_accumulate(
            x.value, dy.value, x.scale_inv, dy.scale_inv, acc, offset=offset
        )

    fused = jax.jit(accumulate, donate_argnums=2)
    xla = jax.jit(lambda x, dy, acc: acc + dw(x, dy), donate_argnums=2)
    gemm = jax.jit(dw)
    add = jax.jit(lambda acc, d: acc + d, donate_argnums=0)
    acc_args = lambda prev: (x, dy, zeros() if prev is None else prev)
    result = {
        "platform": jax.default_backend(),
        "dtype": "float8 (e4m3 x, e5m2 dy)",
        "precision": "fp8, fp32 accumulation",
        "T": T,
        "out": n_out,
        "in": n_in,
        "fused_ms": _time(fused, acc_args, warmup, iters),
        "xla_ms": _time(xla, acc_args, warmup, iters),
        "unfused_ms": _time(lambda x, dy, acc: add(acc, gemm(x, dy)), acc_args, warmup, iters),
        "gemm_ms": _time(gemm, lambda prev: (x, dy), warmup, iters),
    }
    a, b = fused(x, dy, zeros()), xla(x, dy, zeros())
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    at = lambda x, dy, bucket, offset: accumulate(x, dy, bucket, offset)
    err = max(err, _bench_traced_position(result, x, dy, dw, at, warmup, iters))
    return _finish(result, err, 1e-4, T * n_out * n_in)


def bench_case(
    T: int,
    n_out: int,
    n_in: int,
    dtype: jnp.dtype,
    warmup: int,
    iters: int,
    precision: str | None = None,
    experts: int | None = None,
) -> dict:
    """Times one case; ``experts``: the grouped op on ``[E, T, ...]`` inputs."""
    k1, k2 = jax.random.split(jax.random.key(0))
    lead = () if experts is None else (experts,)
    x = jax.random.normal(k1, lead + (T, n_in), dtype)
    dy = jax.random.normal(k2, lead + (T, n_out), dtype)
    zeros = lambda: jnp.zeros(lead + (n_out, n_in), jnp.float32)

    def dw(x, dy):
        return jnp.einsum(
            "...to,...ti->...oi", dy, x, preferred_element_type=jnp.float32, precision=precision
        )

    op = jax_wgrad.wgrad_accumulate if experts is None else jax_wgrad.ops.grouped_wgrad_accumulate
    fused = jax.jit(functools.partial(op, precision=precision), donate_argnums=2)
    xla = jax.jit(lambda x, dy, acc: acc + dw(x, dy), donate_argnums=2)
    gemm = jax.jit(dw)
    add = jax.jit(lambda acc, d: acc + d, donate_argnums=0)

    def unfused(x, dy, acc):
        return add(acc, gemm(x, dy))

    def accumulate_at(x, dy, bucket, offset):
        return jax_wgrad.wgrad_accumulate(x, dy, bucket, offset=offset, precision=precision)

    acc_args = lambda prev: (x, dy, zeros() if prev is None else prev)
    result = {
        "platform": jax.default_backend(),
        "dtype": jnp.dtype(dtype).name,
        "precision": precision or str(jax.config.jax_default_matmul_precision or "default"),
        **({} if experts is None else {"E": experts}),
        "T": T,
        "out": n_out,
        "in": n_in,
        "fused_ms": _time(fused, acc_args, warmup, iters),
        "xla_ms": _time(xla, acc_args, warmup, iters),
        "unfused_ms": _time(unfused, acc_args, warmup, iters),
        "gemm_ms": _time(gemm, lambda prev: (x, dy), warmup, iters),
    }
    # Same answer from both fused paths (a benchmark of a wrong kernel is worthless).
    a, b = fused(x, dy, zeros()), xla(x, dy, zeros())
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    if experts is None:
        err = max(err, _bench_traced_position(result, x, dy, dw, accumulate_at, warmup, iters))
    return _finish(
        result, err, tolerance(dtype, precision), (experts or 1) * T * n_out * n_in, precision
    )


def _finish(result: dict, err: float, tol: float, macs: int, precision: str | None = None) -> dict:
    """``result`` with the difference checked against ``tol``, the ratios, the platform's
    figures (``macs``: the multiply-adds of one call) and the times rounded."""
    result["rel_diff"] = err
    if err > tol:
        raise AssertionError(
            f"fused and XLA results differ (relative {err:.2e} > {tol:.1e} at precision "
            f"{result['precision'] if precision is None else precision})"
        )
    result["fused_over_xla"] = round(result["fused_ms"] / result["xla_ms"], 4)
    result["fused_over_gemm"] = round(result["fused_ms"] / result["gemm_ms"], 4)
    if result["platform"] == "cpu":
        result["blas_core"] = blas_core()
    if result["platform"] == "gpu":
        result["tflops"] = round(2 * macs / (result["fused_ms"] * 1e-3) / 1e12, 2)
        if "fused_at_ms" in result:
            result["tflops_at"] = round(2 * macs / (result["fused_at_ms"] * 1e-3) / 1e12, 2)
    for key in ("fused_ms", "xla_ms", "unfused_ms", "gemm_ms", "fused_at_ms", "xla_at_ms"):
        if key in result:
            result[key] = round(result[key], 4)
    return result


def _bench_traced_position(
    result: dict, x, dy, dw, accumulate_at, warmup: int, iters: int
) -> float:
    """Adds ``fused_at_ms``, ``xla_at_ms`` and their ratios to ``result``: the block
    ``[out, in]`` at position ``index * out * in`` (``index`` = 1, a jit argument, so
    traced) of a flat fp32 bucket of two blocks, donated, by ``accumulate_at(x, dy,
    bucket, offset)`` and by XLA's own slice, ``dw`` and update. Returns the relative
    difference between the two updated buckets."""
    n_out, n_in = jnp.shape(jax.tree.leaves(dy)[0])[-1], jnp.shape(jax.tree.leaves(x)[0])[-1]
    block = n_out * n_in
    index = jnp.int32(1)

    def fused_at(x, dy, bucket, i):
        return accumulate_at(x, dy, bucket, jax_wgrad.ops.BlockOffset(0, i, block))

    def xla_at(x, dy, bucket, i):
        start = i * block
        old = lax.dynamic_slice(bucket, (start,), (block,))
        return lax.dynamic_update_slice(bucket, old + dw(x, dy).reshape(-1), (start,))

    zeros = lambda: jnp.zeros((2 * block,), jnp.float32)
    args = lambda prev: (x, dy, zeros() if prev is None else prev, index)
    fused_at, xla_at = (jax.jit(f, donate_argnums=2) for f in (fused_at, xla_at))
    result["fused_at_ms"] = _time(fused_at, args, warmup, iters)
    result["xla_at_ms"] = _time(xla_at, args, warmup, iters)
    result["fused_at_over_xla_at"] = round(result["fused_at_ms"] / result["xla_at_ms"], 4)
    result["fused_at_over_fused"] = round(result["fused_at_ms"] / result["fused_ms"], 4)
    a, b = fused_at(*args(None)), xla_at(*args(None))
    if float(jnp.max(jnp.abs(a[:block]))) != 0.0:
        raise AssertionError("the traced-position call wrote outside its block")
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _parse_case(text: str) -> tuple[int, ...]:
    try:
        case = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        case = ()
    if len(case) not in (3, 4) or min(case) < 1:
        raise argparse.ArgumentTypeError(
            f"case '{text}' is not TxOUTxIN or ExTxOUTxIN (experts), e.g. 4096x1024x1024"
        )
    return case


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        type=_parse_case,
        nargs="+",
        help="TxOUTxIN, or ExTxOUTxIN for E experts' grouped weights "
        "(default: the platform's case list)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16", "float8"],
        help="float8: the FP8 form (module docstring), dense cases only",
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=["default", "tensorfloat32", "float32", "highest"],
        help="matmul precision of every path (default: jax's)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters ({args.iters}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    if not jax_wgrad.fusion_available():
        sys.exit(
            f"fused handler unavailable on {jax.default_backend()}: {jax_wgrad.fusion_status()}"
        )
    cases = args.cases or (GPU_CASES if jax.default_backend() == "gpu" else CPU_CASES)
    start = time.perf_counter()
    for dtype in args.dtypes:
        for case in cases:
            experts = case[0] if len(case) == 4 else None
            T, n_out, n_in = case[-3:]
            if dtype == "float8":
                if experts is not None:
                    continue  # no grouped FP8 op
                row = bench_fp8_case(T, n_out, n_in, args.warmup, args.iters)
            else:
                row = bench_case(
                    T,
                    n_out,
                    n_in,
                    jnp.dtype(dtype),
                    args.warmup,
                    args.iters,
                    args.precision,
                    experts,
                )
            print(json.dumps(row), flush=True)
    # On stderr: stdout stays one JSON line per case.
    print(
        f"run time: {time.perf_counter() - start:.1f} s ({len(cases) * len(args.dtypes)} "
        f"cases on {jax.default_backend()})",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
