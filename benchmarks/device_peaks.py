"""What this device sustains, through XLA: a square GEMM's FLOP/s and an elementwise
kernel's memory bandwidth, and their fractions of the datasheet peaks that the step
estimate knows (:data:`jax_wgrad.aot.estimate.PEAKS`: ``gemm_efficiency`` and
``hbm_efficiency`` there come from this script's figures on the lent GPU).

Per size, the mean of --iters back-to-back calls after one warm-up; prints one JSON line:
``device``, ``gemm_<dtype>_<n>_tflops`` per --gemm-sizes, ``copy_tbps`` (bytes read +
written per second by ``x * 2`` over --copy-mib MiB of float32), and, for a known GPU,
``gemm_efficiency`` (the first size's) and ``hbm_efficiency``.

    python benchmarks/device_peaks.py
    python benchmarks/device_peaks.py --gemm-sizes 8192 16384 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jax_wgrad import aot


def _mean_seconds(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _sig(value: float) -> float:
    """Four significant digits."""
    return float(f"{value:.4g}")


def known_peaks(device) -> aot.estimate.Peaks | None:
    """The estimate's datasheet peaks of ``device`` (an H100 or H200), else ``None``."""
    for key in aot.estimate.PEAKS:
        if device.platform == "gpu" and key.upper() in device.device_kind:
            return aot.estimate.PEAKS[key]
    return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemm-sizes", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--copy-mib", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    (device, *_) = jax.devices()
    result: dict = {"device": device.device_kind, "platform": device.platform}
    matmul = jax.jit(lambda a, b: a @ b)
    for n in args.gemm_sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), args.dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), args.dtype)
        seconds = _mean_seconds(matmul, a, b, iters=args.iters)
        result[f"gemm_{args.dtype}_{n}_tflops"] = _sig(2 * n**3 / seconds / 1e12)
        del a, b
    x = jnp.ones((args.copy_mib << 18,), jnp.float32)
    seconds = _mean_seconds(jax.jit(lambda x: x * 2.0), x, iters=args.iters)
    result["copy_tbps"] = _sig(2 * x.nbytes / seconds / 1e12)
    peaks = known_peaks(device)
    if peaks is not None:
        first = result[f"gemm_{args.dtype}_{args.gemm_sizes[0]}_tflops"] * 1e12
        dtype = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[args.dtype]
        result["gemm_efficiency"] = _sig(first / peaks.gemm_peak(dtype))
        result["hbm_efficiency"] = _sig(result["copy_tbps"] * 1e12 / peaks.hbm_bandwidth)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
