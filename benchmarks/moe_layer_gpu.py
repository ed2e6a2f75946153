"""Forward + backward of one MoE MLP layer on one GPU: dropless (ragged grouped GEMMs,
CUTLASS or WMMA kernels) against capacity buffers (XLA's batched GEMMs).

For each case ``T x H x F x E x k`` (``T`` tokens of hidden ``H`` routed to ``k`` of ``E``
SwiGLU experts of width ``F``; bf16 weights and activations), times the jitted
``jax.value_and_grad`` of ``sum(moe_mlp(params, x) ** 2)`` with respect to the weights and
``x`` (median of ``--iters`` calls after ``--warmup``), for:

  dropless[auto]  :func:`jax_wgrad.functional.moe_mlp` without capacity: tokens sorted by
                  expert, ragged grouped GEMMs, the kernels the handlers choose with
                  ``set_cuda_kernel("auto")`` (CUTLASS's sm90 grouped GEMMs on Hopper)
  dropless[wmma]  the same, the WMMA kernels forced
  capacity=1      ``capacity_factor=1.0``: ``[E, ceil(T k / E), H]`` buffers, XLA's batched
                  dots and the grouped wgrad calls; the same expert FLOPs as dropless
                  when the routing is balanced (it drops the choices past the capacity)

and prints one JSON line per case: milliseconds per layer step, the expert GEMMs' TFLOP/s
at the routed tokens' FLOPs (``2 T k (H 2F + F H) x 3``: forward, input and weight
gradients) and each variant's ratio to capacity=1. The router is random (the weights of a
fresh layer), so routing is close to balanced.

    python benchmarks/moe_layer_gpu.py                                  # Mixtral, Qwen3-MoE
    python benchmarks/moe_layer_gpu.py --cases 8192x4096x14336x8x2

``--estimate h200`` (or ``h100``) runs nothing: it compiles the dropless step of each case
for that GPU without one (jax's CUDA plugin; ``JAX_PLATFORMS=cpu``) and prints
:mod:`jax_wgrad.aot.estimate`'s figure for it, to set beside a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jax_wgrad.functional import MoEConfig, moe_mlp
from jax_wgrad.ops import ragged

sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks are scripts, not a package
from ragged_gemm_gpu import gpu_device, kernels_ran, parse_cases, timed

# Mixtral-8x7B and Qwen3-30B-A3B layers, 8192 tokens (micro-batch 2 x 4096).
CASES = [(8192, 4096, 14336, 8, 2), (8192, 2048, 768, 128, 8)]


def _step(cfg: MoEConfig):
    def loss(params, x):
        y, stats = moe_mlp(params, x, cfg)
        return jnp.sum(jnp.square(y.astype(jnp.float32))), stats.dropped_fraction

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def run_case(case, warmup: int, iters: int, device) -> dict:
    t, h, f, e, k = case
    keys = jax.random.split(jax.random.key(0), 4)
    with jax.default_device(device):
        params = {
            "router": jax.random.normal(keys[0], (e, h), jnp.float32) * h**-0.5,
            "fc1": (jax.random.normal(keys[1], (e, 2, f, h), jnp.float32) * h**-0.5).astype(
                jnp.bfloat16
            ),
            "fc2": (jax.random.normal(keys[2], (e, h, f), jnp.float32) * f**-0.5).astype(
                jnp.bfloat16
            ),
        }
        x = jax.random.normal(keys[3], (t, h), jnp.bfloat16)
    flops = 2.0 * t * k * (h * 2 * f + f * h) * 3
    row = {"device": device.device_kind, "T": t, "H": h, "F": f, "E": e, "k": k}
    variants = [
        ("dropless[auto]", None, "auto"),
        ("dropless[wmma]", None, "wmma"),
        ("capacity=1", 1.0, "auto"),
    ]
    seconds = {}
    for name, factor, kernel in variants:
        ragged.set_cuda_kernel(kernel)
        if device.platform == "gpu":
            jax.clear_caches()  # a step recorded into a CUDA graph keeps its kernels
        cfg = MoEConfig(
            num_experts=e, ffn_hidden_size=f, topk=k, capacity_factor=factor, swiglu=True
        )
        step = _step(cfg)
        before = ragged.cuda_kernel_launches()
        seconds[name] = timed(step, (params, x), warmup, iters)
        row[f"{name}_kernels"] = kernels_ran(before)
        (_, dropped), _ = step(params, x)
        row[f"{name}_dropped"] = round(float(dropped), 4)
    ragged.set_cuda_kernel("auto")
    for name, s in seconds.items():
        row[f"{name}_ms"] = round(s * 1e3, 3)
        row[f"{name}_expert_tflops"] = round(flops / s / 1e12, 1)
        row[f"{name}_vs_capacity1"] = round(s / seconds["capacity=1"], 3)
    return row


def estimate_case(case, target: str) -> dict:
    """The estimated dropless layer step of ``case`` on ``target`` GPUs (deviceless compile:
    nothing runs); the expert GEMMs' TFLOP/s at that time as :func:`run_case` counts them."""
    from jax.sharding import SingleDeviceSharding

    from jax_wgrad.aot import estimate
    from jax_wgrad.aot.targets import target_devices

    t, h, f, e, k = case
    where = SingleDeviceSharding(target_devices(target, 1)[0])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=where)
    params = {
        "router": spec((e, h), jnp.float32),
        "fc1": spec((e, 2, f, h), jnp.bfloat16),
        "fc2": spec((e, h, f), jnp.bfloat16),
    }
    cfg = MoEConfig(num_experts=e, ffn_hidden_size=f, topk=k, capacity_factor=None, swiglu=True)
    text = _step(cfg).lower(params, spec((t, h), jnp.bfloat16)).compile().as_text()
    flops = 2.0 * t * k * (h * 2 * f + f * h) * 3
    est = estimate.estimate_step(text, estimate.PEAKS[target], model_flops=flops)
    return {
        "target": target,
        "T": t,
        "H": h,
        "F": f,
        "E": e,
        "k": k,
        "estimated_ms": round(est.seconds * 1e3, 2),
        "gemm_bound_ms": round(est.cost.compute_s * 1e3, 2),
        "memory_bound_ms": round(est.cost.memory_s * 1e3, 2),
        "kernels": est.cost.launches,
        "expert_tflops": round(flops / est.seconds / 1e12, 1),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=None, help="TxHxFxExk ...")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--estimate",
        choices=("h100", "h200"),
        help="run nothing: the estimated step of a deviceless compile for these GPUs",
    )
    args = parser.parse_args(argv)
    cases = parse_cases(parser, args.cases, CASES, "TxHxFxExk, e.g. 8192x4096x14336x8x2")
    if args.estimate:
        for case in cases:
            print(json.dumps(estimate_case(case, args.estimate)), flush=True)
        return
    device = gpu_device("moe_layer_gpu")
    for case in cases:
        print(json.dumps(run_case(case, args.warmup, args.iters, device)), flush=True)


if __name__ == "__main__":
    main()
