#!/usr/bin/env python
"""A jax_wgrad train step against the same model written in plain JAX, on one device.

Three train steps of the example's GPT, in one process, on jax's default backend (first
device, mesh 1 x 1 x 1), each jitted with its state donated. All three are compiled and
warmed up (``--warmup`` steps) first, then timed in ``--rounds`` interleaved rounds of
``--steps`` steps each (the order rotates every round, so a burst of load on a shared
machine hits all three alike); each time is the median over all timed steps:

  fused    jax_wgrad's step with --gradient-accumulation-fusion: weight gradients
           accumulated by the FFI GEMM into flat fp32 buckets, every other gradient
           added to its own bucket block in place (``bucket_add``), Megatron's
           finalization, AdamW on the fp32 master weights
  unfused  jax_wgrad's step without fusion (all gradients through ``bucket_add``)
  plain    the same model in plain JAX: fp32 parameters, the same compute dtype and
           attention, ``jax.value_and_grad`` per microbatch summed in a ``lax.scan``,
           ``optax`` global-norm clipping (1.0) and AdamW (same hyperparameters and
           weight-decay mask)

and prints ONE JSON line for the configuration: ``plain_ms``, ``fused_ms``,
``unfused_ms``, ``fused_over_plain``, ``unfused_over_plain``, ``fused_over_unfused`` (each
ratio the median of the per-round ratios), the first-step losses of all
three (same parameters and batch: they must agree), the model FLOPs of a step and ``mfu``
(model FLOPs / step time / the device's peak; ``peak_tflops`` and ``peak_source`` say
which peak: the datasheet dense peak of a known GPU for the compute dtype, else a plain
XLA GEMM measured here, or ``--peak-tflops``).

    python benchmarks/step_vs_plain_jax.py                      # small CPU default
    python benchmarks/step_vs_plain_jax.py --hidden-size 2048 --num-layers 4 \\
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 4 \\
        --global-batch-size 64 --bf16                           # the issue's GPU case
    python benchmarks/step_vs_plain_jax.py ... --bf16 --fp8-format hybrid  # FP8 vs BF16

With ``--fp8-format`` the two jax_wgrad steps run their layers' linears in FP8
(:mod:`jax_wgrad.functional.fp8`) and the plain JAX step stays in bf16: the ratios
``fused_over_plain`` and ``unfused_over_plain`` are then FP8 against BF16.

Beside each measured time the JSON has the estimate of the same compiled step
(``estimated_*_ms``, :mod:`jax_wgrad.aot.estimate`, with the device's peaks: a known GPU's
datasheet, else the measured GEMM and copy bandwidth) and its error (``estimate_error_*``).

``--compile-only --target h100`` compiles the three steps for an H100 that is not there
(``JAX_PLATFORMS=cpu`` with jax's CUDA plugin) and prints, instead of times, each step's
estimated time and MFU (:mod:`jax_wgrad.aot.estimate`), launches per microbatch, host
syncs and peak memory, with ``estimated_fused_over_plain`` and the other ratios.

``--variants`` times only some of the three (each holds its parameters and optimizer state
on the device: at 1.6 B an 80 GB H100 holds two, ``--variants fused plain``).

On a GPU, and compiled for one, all three steps get the example's XLA flags
(:func:`jax_wgrad.training.gpu.gpu_xla_flags`); ``--layer-scan-unroll`` and
``--cuda-graph-scope`` apply to all three alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_wgrad import (
    DDPConfig,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    aot,
    build_train_step,
    default_optimizer,
    init_params,
    init_train_state,
    make_mesh,
    shard_batch,
)
from jax_wgrad.functional import causal_attention
from jax_wgrad.training.gpu import CUDA_GRAPH_SCOPES, apply_gpu_xla_flags, check_cuda_graph_scope

LR, B1, B2, EPS, WEIGHT_DECAY, CLIP = 1e-4, 0.9, 0.95, 1e-8, 0.01, 1.0
VARIANTS = ("fused", "unfused", "plain")
RATIOS = (("fused", "plain"), ("unfused", "plain"), ("fused", "unfused"))

# Dense (no sparsity) datasheet peaks, TFLOP/s: (16-bit, TF32) tensor-core throughput.
GPU_PEAKS = {"H100": (989.0, 494.7), "H200": (989.0, 494.7), "A100": (312.0, 156.0)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--bf16", action="store_true", help="bfloat16 compute (fp32 params)")
    p.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid"),
        default=None,
        help="the jax_wgrad steps' layer linears in FP8 (the example's flag; needs --bf16); "
        "the plain JAX step stays in bf16, so fused_over_plain is FP8 against BF16",
    )
    p.add_argument("--attention-backend", choices=("auto", "xla", "cudnn"), default="auto")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved timing rounds (fused, unfused, plain; rotating order)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak for the MFU (default: datasheet or measured)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the three steps for --target without running them (no GPU needed: "
        "JAX_PLATFORMS=cpu and jax's CUDA plugin) and print their estimated times "
        "(jax_wgrad.aot.estimate) and launches instead of measured ones",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the steps to time, all in one process (each holds its own parameters and "
        "optimizer state on the device: at 1.6 B on an 80 GB H100 two fit, three do not); "
        "ratios are printed for the pairs timed",
    )
    p.add_argument("--target", choices=("h100", "h200"), default="h100")
    p.add_argument(
        "--layer-scan-unroll",
        type=int,
        default=1,
        help="layers per iteration of the layer loop, in all three steps (lax.scan's unroll; "
        "the layer count: straight-line code)",
    )
    p.add_argument(
        "--cuda-graph-scope",
        choices=CUDA_GRAPH_SCOPES,
        default="kernels",
        help="what XLA:GPU runs as CUDA graphs, for all three steps (the example's flag; "
        "'full_iteration' needs --layer-scan-unroll = --num-layers)",
    )
    args = p.parse_args(argv)
    try:
        check_cuda_graph_scope(args.cuda_graph_scope, args.layer_scan_unroll, args.num_layers)
    except ValueError as exc:
        p.error(str(exc))
    if args.compile_only and sorted(args.variants) != sorted(VARIANTS):
        p.error(
            f"--variants {' '.join(args.variants)}: --compile-only compiles all three steps "
            "(nothing is held on a device); leave --variants out"
        )
    if args.fp8_format and not args.bf16:
        p.error(f"--fp8-format {args.fp8_format} needs --bf16")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        p.error(
            f"--steps ({args.steps}), --rounds ({args.rounds}) and --warmup "
            f"({args.warmup}) must be >= 1"
        )
    return args


# ----------------------------------------------------------------------------- plain JAX


def _layer_norm(x, p, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x.dtype)


def _dense(x, p):
    y = x @ p["weight"].T.astype(x.dtype)
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


def plain_loss(params, tokens, cfg: GPTConfig, attention: str):
    """Mean next-token loss of one microbatch, written the way a JAX user would."""
    dt = jnp.dtype(cfg.compute_dtype)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = ids.shape
    nh, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.layernorm_epsilon
    emb = params["embedding"]
    x = (jnp.take(emb["word"]["embedding"], ids, axis=0) + emb["position"][None, :s]).astype(dt)

    def layer(x, p):
        qkv = _dense(_layer_norm(x, p["ln1"], eps), p["qkv"]).reshape(b, s, nh, 3, hd)
        a = causal_attention(
            qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], implementation=attention
        )
        x = x + _dense(a, p["proj"])
        h = jax.nn.gelu(_dense(_layer_norm(x, p["ln2"], eps), p["fc1"]), approximate=False)
        return x + _dense(h, p["fc2"]), None

    x, _ = jax.lax.scan(layer, x, params["layers"], unroll=cfg.layer_scan_unroll)
    x = _layer_norm(x, params["head"]["final_norm"], eps)
    w = (
        params["head"]["output"]["weight"]
        if "output" in params["head"]
        else emb["word"]["embedding"]
    )
    logits = (x @ w.T.astype(dt)).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))


def plain_optimizer(params) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW, decaying only weights and the word embedding
    (what jax_wgrad's default optimizer decays)."""
    decay = jax.tree_util.tree_map_with_path(
        lambda path, _: jax.tree_util.keystr(path).endswith(
            ("['weight']", "['word']['embedding']")
        ),
        params,
    )
    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay),
    )


def plain_step_fn(cfg: GPTConfig, num_micro: int, attention: str, tx):
    def step(state, tokens):
        params, opt_state = state
        micro = tokens.reshape(num_micro, -1, tokens.shape[-1])

        def body(carry, mb):
            loss_sum, acc = carry
            loss, g = jax.value_and_grad(plain_loss)(params, mb, cfg, attention)
            return (loss_sum + loss, jax.tree.map(jnp.add, acc, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss_sum, grads), _ = jax.lax.scan(body, (jnp.float32(0.0), zeros), micro)
        grads = jax.tree.map(lambda g: g / num_micro, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss_sum / num_micro

    return jax.jit(step, donate_argnums=0)


# ----------------------------------------------------------------------------- timing


class _Timed:
    """One compiled, donated train step and its running state."""

    def __init__(self, step, state, batches):
        t0 = time.perf_counter()
        self.compiled = step.lower(state, batches[0]).compile()
        self.compile_s = time.perf_counter() - t0
        self.state, self.batches, self.calls = state, batches, 0
        self.first_loss, self.times = None, []

    def run(self, n: int, record: bool) -> list[float]:
        """Runs ``n`` steps (blocking on each loss); their ms if ``record``."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.state, loss = self.compiled(
                self.state, self.batches[self.calls % len(self.batches)]
            )
            loss = float(loss if not isinstance(loss, dict) else loss["loss"])
            times.append((time.perf_counter() - t0) * 1e3)
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.calls += 1
        if record:
            self.times.extend(times)
        return times


def _time_interleaved(
    variants: dict[str, _Timed], warmup: int, steps: int, rounds: int
) -> dict[str, list[float]]:
    """Warms every variant up, then ``rounds`` rounds of ``steps`` timed steps each, the
    variants' order rotated per round. Returns each variant's per-round medians (ms).
    Running out of device memory with several variants' states held says to time fewer."""
    try:
        for v in variants.values():
            v.run(warmup, record=False)
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc) or len(variants) < 2:
            raise
        raise SystemExit(
            f"out of device memory with the states of {len(variants)} steps "
            f"({', '.join(variants)}) on the device at once; time fewer of them per run "
            f"with --variants (e.g. --variants fused plain): {str(exc).splitlines()[0]}"
        ) from exc
    names = list(variants)
    per_round = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            per_round[n].append(statistics.median(variants[n].run(steps, record=True)))
    return per_round


def model_flops_per_step(cfg: GPTConfig, tokens: int) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of the GEMMs and the causal
    attention core: per token and layer 2(4H^2 + 2HF) + 2SH (QK^T and PV, causal half),
    plus the output layer's 2HV."""
    h, f, s = cfg.hidden_size, cfg.ffn_hidden_size, cfg.seq_length
    per_token = cfg.num_layers * (2 * (4 * h * h + 2 * h * f) + 2 * s * h) + 2 * h * cfg.vocab_size
    return 3.0 * per_token * tokens


def device_peak(device, dtype: str, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-tflops"
    if device.platform == "gpu":
        for name, (p16, p32) in GPU_PEAKS.items():
            if name in device.device_kind:
                return (
                    p16 if dtype == "bfloat16" else p32
                ), f"datasheet dense {'bf16' if dtype == 'bfloat16' else 'TF32'} of {name}"
    n = 2048
    a = jnp.ones((n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a))
    best = min(_timed(mm, a) for _ in range(5))
    return 2 * n**3 / best / 1e12, f"measured XLA {dtype} GEMM {n}^3 on {device.device_kind}"


def device_peaks(device, peak_tflops: float) -> aot.estimate.Peaks:
    """The peaks the estimate uses for ``device``: a known GPU's datasheet
    (:data:`jax_wgrad.aot.estimate.PEAKS`), else ``peak_tflops`` (the measured GEMM) and
    a measured copy bandwidth, no launch latency (XLA:CPU runs its kernels in-process)."""
    for name in ("H100", "H200"):
        if device.platform == "gpu" and name in device.device_kind:
            return aot.estimate.PEAKS[name.lower()]
    a = jnp.ones((1 << 26,), jnp.float32)  # 256 MiB
    copy = jax.jit(lambda a: a * 2.0)
    jax.block_until_ready(copy(a))
    bandwidth = 2 * a.nbytes / min(_timed(copy, a) for _ in range(5))
    flops = peak_tflops * 1e12
    return aot.estimate.Peaks(
        f"{device.device_kind}: measured GEMM {peak_tflops:.3g} TFLOP/s, copy "
        f"{bandwidth / 1e9:.3g} GB/s",
        tensor_flops={"f32": flops, "bf16": flops, "f16": flops},
        vector_flops=flops,
        hbm_bandwidth=bandwidth,
        nvlink_bandwidth=bandwidth,
        network_bandwidth=bandwidth,
        launch_s=0.0,
        graph_kernel_s=0.0,
        collective_s=0.0,
        host_sync_s=0.0,
    )


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab_size,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        attention_backend=args.attention_backend,
        compute_dtype="bfloat16" if args.bf16 else "float32",
        layer_scan_unroll=args.layer_scan_unroll,
        fp8_format=args.fp8_format,
    )


def _shape(args, cfg: GPTConfig, attention: str) -> dict:
    """What the JSON line says of the run: jax, the model, the batch, the attention."""
    return {
        "jax": jax.__version__,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "seq_length": cfg.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "dtype": cfg.compute_dtype,
        "fp8_format": cfg.fp8_format,
        "attention": attention,
    }


def _parallel(args, fusion: bool) -> ParallelConfig:
    return ParallelConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        world_size=1,
        gradient_accumulation_fusion=fusion,
    )


def compile_only(args) -> dict:
    """The three steps compiled for one ``args.target`` GPU without one: per step its
    estimated time and MFU, launches per microbatch (of the microbatch loop: the
    library's schedule loop of the busiest stage over its microbatches, the plain
    step's ``lax.scan`` body), host syncs per step, peak memory; the ratios."""
    (device,) = aot.target_devices(args.target)
    cfg = _config(args)
    attention = cfg.attention_implementation("gpu")
    tokens = args.global_batch_size * cfg.seq_length
    flops = model_flops_per_step(cfg, tokens)
    result: dict = {
        "target": args.target,
        "compile_only": True,
        **_shape(args, cfg, attention),
        "model_tflop_per_step": round(flops / 1e12, 4),
    }
    batch_shape = (args.global_batch_size, cfg.seq_length + 1)
    steps: dict[str, tuple] = {}  # name -> (estimate, launches per microbatch, host syncs, peak)
    for name, fusion in (("fused", True), ("unfused", False)):
        par = _parallel(args, fusion)
        mesh = make_mesh(par, devices=[device])
        tx = default_optimizer(LR, weight_decay=WEIGHT_DECAY, b1=B1, b2=B2, eps=EPS)
        ddp = DDPConfig(clip_grad=CLIP)
        plan = TrainPlan.create(cfg, par, mesh, tx, ddp=ddp, check_fusion=False)
        report = aot.compile_plan(plan, args.target, cuda_graph_scope=args.cuda_graph_scope)
        steps[name] = (
            report.estimate,
            report.launches_per_microbatch,
            report.host_syncs_per_step,
            report.peak_bytes,
        )
        num_micro = par.num_microbatches
    one = jax.sharding.SingleDeviceSharding(device)
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.eval_shape(lambda: init_params(cfg, args.seed)),
    )
    tx = plain_optimizer(params)
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.eval_shape(tx.init, params),
    )
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=one)
    lowered = plain_step_fn(cfg, num_micro, attention, tx).trace((params, opt_state), batch).lower()
    plain = aot.compile_program(
        lowered, args.target, loop_trips=num_micro, cuda_graph_scope=args.cuda_graph_scope
    )
    mem = plain.compiled.memory_analysis()
    steps["plain"] = (
        plain.estimate,
        plain.loop_launches,
        plain.host_syncs,
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes,
    )
    peak = aot.estimate.PEAKS[args.target].gemm_peak("bf16" if args.bf16 else "f32")
    for name, (est, launches, syncs, peak_bytes) in steps.items():
        result.update(
            {
                f"estimated_{name}_ms": round(est.seconds * 1e3, 2),
                f"estimated_{name}_mfu": round(flops / est.seconds / peak, 4),
                f"estimated_{name}_breakdown_ms": {
                    k: round(v, 2) for k, v in est.figures()["estimated_breakdown_ms"].items()
                },
                f"{name}_launches_per_microbatch": launches,
                f"{name}_host_syncs_per_step": syncs,
                f"{name}_peak_bytes": peak_bytes,
            }
        )
    for a, b in RATIOS:
        result[f"estimated_{a}_over_{b}"] = round(steps[a][0].seconds / steps[b][0].seconds, 4)
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    apply_gpu_xla_flags(args.cuda_graph_scope)  # the example's flags, before jax's backends
    device = jax.devices()[0]
    cfg = _config(args)
    attention = cfg.attention_implementation(device.platform)
    rng = np.random.default_rng(args.seed)
    batches = [
        rng.integers(
            0, cfg.vocab_size, (args.global_batch_size, cfg.seq_length + 1), dtype=np.int32
        )
        for _ in range(2)
    ]
    result = {
        "device": device.device_kind,
        "platform": device.platform,
        **_shape(args, cfg, attention),
    }

    variants: dict[str, _Timed] = {}
    plans: dict[str, TrainPlan | None] = {"plain": None}
    num_micro = _parallel(args, True).num_microbatches
    for name, fusion in (("fused", True), ("unfused", False)):
        if name not in args.variants:
            continue
        par = _parallel(args, fusion)
        mesh = make_mesh(par, devices=[device])
        tx = default_optimizer(LR, weight_decay=WEIGHT_DECAY, b1=B1, b2=B2, eps=EPS)
        ddp = DDPConfig(clip_grad=CLIP)
        plan = plans[name] = TrainPlan.create(cfg, par, mesh, tx, ddp=ddp)
        state = init_train_state(plan, args.seed)
        step = build_train_step(plan, state)
        variants[name] = _Timed(step, state, [shard_batch(mesh, b) for b in batches])

    if "plain" in args.variants:
        params = jax.device_put(init_params(cfg, args.seed), device)
        tx = plain_optimizer(params)
        variants["plain"] = _Timed(
            plain_step_fn(cfg, num_micro, attention, tx),
            (params, tx.init(params)),
            [jax.device_put(b, device) for b in batches],
        )

    per_round = _time_interleaved(variants, args.warmup, args.steps, args.rounds)
    for name, v in variants.items():
        result.update(
            {
                f"{name}_ms": round(statistics.median(v.times), 3),
                f"{name}_first_loss": v.first_loss,
                f"{name}_compile_s": round(v.compile_s, 2),
            }
        )

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(per_round[a], per_round[b])), 4)

    flops = model_flops_per_step(cfg, args.global_batch_size * cfg.seq_length)
    peak, source = device_peak(device, cfg.compute_dtype, args.peak_tflops)
    peaks = device_peaks(device, peak)
    for name, v in variants.items():
        e = aot.estimate_compiled(v.compiled.as_text(), peaks, plan=plans[name])
        result[f"estimated_{name}_ms"] = round(e.seconds * 1e3, 3)
        result[f"estimate_error_{name}"] = round(e.seconds * 1e3 / result[f"{name}_ms"] - 1, 4)
    result["estimate_peaks"] = peaks.name
    result.update({"steps": args.steps, "rounds": args.rounds})
    for a, b in RATIOS:
        if a in variants and b in variants:
            result[f"{a}_over_{b}"] = ratio(a, b)
    result["model_tflop_per_step"] = round(flops / 1e12, 4)
    for name, key in (("fused", "mfu"), ("unfused", "mfu_unfused"), ("plain", "mfu_plain")):
        if name in variants:
            result[key] = round(flops / (result[f"{name}_ms"] * 1e-3) / (peak * 1e12), 4)
    result.update({"peak_tflops": round(peak, 2), "peak_source": source})
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
