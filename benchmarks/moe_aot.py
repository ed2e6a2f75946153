"""Deviceless XLA:GPU compile (H100s; nothing is run) of the MoE layer's dispatch and expert
GEMMs: what the dropless path lowers to, against the capacity path.

Needs jax's CUDA plugin and jax_wgrad built with its CUDA handlers
(``docs/design/aot.md``); run with ``JAX_PLATFORMS=cpu``. Three commands:

``mlp``: ``functional.moe_mlp`` forward + backward with fused buckets (the expert weight
gradients into one flat fp32 bucket, donated), inside ``shard_map`` over the expert axis
(``--gpus 1``: no expert axis, as the model passes it for EP = 1), per variant
(``dropless``: capacity factor None; ``cf=E``: the factor equal to E, i.e. a capacity of
``T k`` per expert; ``cf=1``: factor 1.0). Prints one JSON line per compile: memory
analysis, the jax_wgrad custom calls (operand shapes, aliasing), every GEMM (a cuBLAS
custom call or a Triton GEMM fusion: shapes, FLOPs, the Python function that emitted it),
the all-to-alls, and the largest non-fused buffers::

    JAX_PLATFORMS=cpu python benchmarks/moe_aot.py mlp --gpus 1 --experts 8 64
    JAX_PLATFORMS=cpu python benchmarks/moe_aot.py mlp --gpus 8 --experts 8 64 --cublas

``ragged-a2a``: a ``jax.lax.ragged_all_to_all`` of a ``[T k, H]`` send buffer over the
expert axis (per-destination offsets and sizes, each source's rows at ``src * T k`` of a
worst-case receive buffer), forward and its transpose, on its own (``DroplessDispatch``
exchanges the same way, its sources back to back in a buffer of ``receive_rows``); prints
the HLO collectives and the thunks they lower to. ``--platform cpu`` compiles the same on
XLA:CPU (8 host devices) and prints the error.

``scan``: the backward of a ``lax.scan`` over ``L`` stacked dropless MoE layers whose expert
weight gradients go into one flat fp32 bucket at TRACED offsets (an ``xs`` entry per layer;
the pattern of tests/test_traced_offset.py): where the ragged wgrad calls are, their
aliasing, bucket-sized instructions and thunks in the loop, the bucket's allocation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.aot import hlo, thunks
from jax_wgrad.aot.compile import read_largest_dump
from jax_wgrad.aot.targets import target_devices
from jax_wgrad.functional import MoEConfig, moe_mlp
from jax_wgrad.ops import handlers
from jax_wgrad.parallel.mesh import EXPERT

AXIS = EXPERT  # the mesh axis the experts are split over
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
_WGRAD_TARGETS = (
    handlers.RAGGED_MATMUL_TARGET,
    handlers.RAGGED_WGRAD_TARGET,
    handlers.TARGET,
    handlers.TARGET_AT,
)


# ------------------------------------------------------------------------ HLO reading
def _nbytes(dtype: str, shape) -> int:
    return _BYTES.get(dtype, 4) * math.prod(shape)


def _fmt(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def stack_functions(text: str) -> dict[int, list[str]]:
    """``{stack frame id: ["file.py:function", innermost first]}`` from the module's
    ``FunctionNames``/``FileLocations``/``StackFrames`` tables (a frame's printed
    ``parent_frame_id`` is its parent's id + 1, 0: none)."""

    def table(name):
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.DOTALL | re.MULTILINE)
        return m.group(1).splitlines() if m else []

    funcs = {int(l.split()[0]): l.split(None, 1)[1].strip('"') for l in table("FunctionNames")}
    files = {int(l.split()[0]): l.split(None, 1)[1].strip('"') for l in table("FileNames")}
    locs = {
        int(l.split()[0]): (
            int(re.search(r"file_name_id=(\d+)", l).group(1)),
            int(re.search(r"function_name_id=(\d+)", l).group(1)),
        )
        for l in table("FileLocations")
    }
    frames = {
        int(l.split()[0]): (
            int(re.search(r"file_location_id=(\d+)", l).group(1)),
            int(re.search(r"parent_frame_id=(\d+)", l).group(1)) - 1,
        )
        for l in table("StackFrames")
    }
    out = {}
    for fid in frames:
        chain, f = [], fid
        while f in frames and len(chain) < 64:
            loc, parent = frames[f]
            file_id, func_id = locs.get(loc, (None, None))
            chain.append(f"{os.path.basename(files.get(file_id, '?'))}:{funcs.get(func_id, '?')}")
            f = parent
        out[fid] = chain
    return out


def _no_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", shape)


def _frame(line: str) -> int | None:
    m = re.search(r"stack_frame_id=(\d+)", line)
    return int(m.group(1)) if m else None


def classify(chain: list[str]) -> str:
    """Which part of the MoE layer emitted an instruction."""
    if "moe.py:route" in chain:
        return "router"
    if any(f.startswith("expert_linear.py:") for f in chain):
        return "expert"
    if any(f.startswith("moe_dispatch.py:") for f in chain):
        return "dispatch"
    return "other"


def _shapes_by_name(lines) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    return {i.name: i.arrays() for i in hlo.instructions(lines)}


def _operand_names(line: str, opcode: str) -> list[str]:
    m = re.search(rf" {re.escape(opcode)}\(([^)]*)\)", line)
    return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def gemms(text: str) -> list[dict]:
    """Every GEMM of a compiled module: ``dot`` instructions (in a Triton GEMM fusion or
    elsewhere) and cuBLAS custom calls, with shapes, FLOPs and the emitting function."""
    comps = hlo.computations(text)
    frames = stack_functions(text)
    # fused computation -> the instruction (in a non-fused computation) that calls it
    caller = {}
    for lines in comps.values():
        for ins in hlo.instructions(lines):
            m = re.search(r"calls=%([\w.\-]+)", ins.line)
            if m and ins.opcode == "fusion":
                caller[m.group(1)] = ins.name
    out = []
    for c, lines in comps.items():
        shapes = _shapes_by_name(lines)
        for ins in hlo.instructions(lines):
            cublas = ins.opcode == "custom-call" and "__cublas" in ins.line
            if ins.opcode != "dot" and not cublas:
                continue
            ops_ = [shapes.get(n, [("?", ())])[0] for n in _operand_names(ins.line, ins.opcode)]
            if cublas:
                target = re.search(r'custom_call_target="([^"]+)"', ins.line).group(1)
                cd = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line)
                contracting = [int(x.strip('" ')) for x in cd.group(1).split(",") if x.strip()]
                result = ins.arrays()[0]
                kind = target
            else:
                cd = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
                contracting = [int(x) for x in cd.group(1).split(",") if x]
                result = ins.arrays()[0]
                kind = "fusion " + caller[c] if c in caller else "dot"
            lhs = ops_[0][1] if ops_ else ()
            k = math.prod(lhs[d] for d in contracting) if lhs else 0
            chain = frames.get(_frame(ins.line), [])
            out.append(
                {
                    "kind": kind,
                    "result": _fmt(*result),
                    "operands": [_fmt(*o) for o in ops_[:2]],
                    "flops": 2 * math.prod(result[1]) * k,
                    "part": classify(chain),
                    "fn": next((f for f in chain if not f.endswith("<lambda>")), "?"),
                }
            )
    return out


def library_calls(text: str) -> list[dict]:
    """jax_wgrad's custom calls: target, result, operand shapes, aliasing, where."""
    comps = hlo.computations(text)
    entry = hlo.entry_name(text)
    loops = {c for _, b in hlo.while_bodies(comps, entry) for c in hlo.reachable(comps, b)}
    out = []
    for c, lines in comps.items():
        for ins in hlo.instructions(lines):
            m = re.search(r'custom_call_target="([^"]+)"', ins.line)
            if ins.opcode != "custom-call" or not m or m.group(1) not in _WGRAD_TARGETS:
                continue
            lay = re.search(r"operand_layout_constraints=\{(.*?)\}, (?:output_to|api_)", ins.line)
            operands = re.findall(r"([a-z]+\d*\[[\d,]*\])", lay.group(1)) if lay else []
            alias = re.search(r"output_to_operand_aliasing=(\{\{.*?\)\})", ins.line)
            out.append(
                {
                    "target": m.group(1),
                    "result": _no_layout(ins.shape),
                    "operands": operands,
                    "alias": alias.group(1) if alias else None,
                    "computation": c,
                    "in_loop": c in loops,
                }
            )
    return out


_A2A_OP = re.compile(
    r"^(?:ROOT )?%?([\w.\-]+) = (.*?) (ragged-all-to-all-start|ragged-all-to-all|"
    r"all-to-all-start|all-to-all)\(([^)]*)\)"
)


def all_to_alls(text: str) -> list[dict]:
    """The (ragged) all-to-alls: opcode, operand shapes, result, async or not (read from
    the raw lines: a ragged all-to-all's tuple type nests deeper than hlo.instructions
    parses)."""
    comps = hlo.computations(text)
    out = []
    for c, lines in comps.items():
        shapes = _shapes_by_name(lines)
        for line in lines:
            m = _A2A_OP.match(line)
            if not m:
                continue
            names = re.findall(r"%([\w.\-]+)", m.group(4))
            ops_ = [_fmt(*shapes[n][0]) if n in shapes else n for n in names]
            arrays = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(2))
            last = arrays[-1] if arrays else ("?", "")
            result = (last[0], tuple(int(x) for x in last[1].split(",") if x))
            sync = re.search(r'"is_sync":(true|false)', line)
            out.append(
                {
                    "opcode": m.group(3),
                    "computation": c,
                    "async_": m.group(3).endswith("-start"),
                    "is_sync": None if sync is None else sync.group(1) == "true",
                    "operands": ops_,
                    "result": _fmt(*result),
                    "result_bytes": _nbytes(*result),
                }
            )
    return out


_SKIP = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "while",
    "conditional",
    "call",
    "opt-barrier",
    "after-all",
    "partition-id",
}


def largest_buffers(text: str, top: int = 10) -> list[dict]:
    """The largest results of instructions that run on their own (fused computations
    skipped), with the part of the layer that emitted them."""
    comps = hlo.computations(text)
    frames = stack_functions(text)
    rows = []
    for c, lines in comps.items():
        if (
            c.startswith(("fused_", "wrapped_", "gemm_fusion", "dynamic-slice-fusion"))
            or "fused_computation" in c
        ):
            continue
        for ins in hlo.instructions(lines):
            if ins.opcode in _SKIP or ins.opcode.endswith("-done"):
                continue
            for d, s in ins.arrays()[:1]:
                chain = frames.get(_frame(ins.line), [])
                fn = next((f for f in chain if not f.endswith("<lambda>")), "?")
                rows.append(
                    {
                        "bytes": _nbytes(d, s),
                        "shape": _fmt(d, s),
                        "opcode": ins.opcode,
                        "name": ins.name,
                        "part": classify(chain),
                        "fn": fn,
                    }
                )
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def _dims(array: str) -> tuple[int, ...]:
    return tuple(int(x) for x in array.split("[")[1].rstrip("]").split(",") if x)


def _call_flops(call: dict) -> int:
    """FLOPs of a jax_wgrad GEMM call if it computed every row of its operands (the
    ragged calls compute only the rows in groups: the routed tokens)."""
    x, other = _dims(call["operands"][0]), _dims(call["operands"][1])
    if call["target"] == handlers.RAGGED_MATMUL_TARGET:  # x [R, K], w [G, ., .]
        return 2 * x[0] * x[1] * _dims(call["result"])[-1]
    return 2 * math.prod(x) * other[-1]  # wgrad: x [.., in], dy [.., out]


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
    }


def _mesh(gpus: int) -> Mesh:
    return Mesh(np.array(target_devices("h100", gpus)), (AXIS,))


def _options(cublas: bool, dump: str | None = None) -> dict:
    opts = {"xla_gpu_enable_latency_hiding_scheduler": True}
    if cublas:
        opts["xla_gpu_enable_triton_gemm"] = False
    if dump:
        opts.update(xla_dump_to=dump, xla_dump_hlo_as_text=True)
    return opts


# ------------------------------------------------------------------------ mlp
def _capacity_factor(variant: str, e: int) -> float | None:
    return {"dropless": None, "cf=E": float(e), "cf=1": 1.0}[variant]


def compile_mlp(
    gpus: int,
    e: int,
    variant: str,
    t: int,
    h: int,
    f: int,
    k: int,
    swiglu: bool,
    cublas: bool,
    dump: str | None = None,
):
    """The compiled ``moe_mlp`` forward + backward of one rank (``T`` tokens, bf16)."""
    cfg = MoEConfig(e, f, topk=k, capacity_factor=_capacity_factor(variant, e), swiglu=swiglu)
    mesh = _mesh(gpus)
    ep = gpus
    el = e // ep
    fc1 = (el, 2, f, h) if swiglu else (el, f, h)
    n = math.prod(fc1) + el * h * f  # the rank's bucket: fc1 then fc2 blocks

    def local(p, bucket, x, dy):
        def fwd(p, bucket, x):
            (y, b), _ = moe_mlp(
                p, x, cfg, expert_axis=AXIS if ep > 1 else None, buckets=(bucket, 0, p["fc1"].size)
            )
            return y, b

        _, vjp = jax.vjp(fwd, p, bucket, x)
        dp, new_bucket, dx = vjp((dy, bucket))
        return dp["router"][None], new_bucket, dx

    pspec = {"router": P(), "fc1": P(AXIS), "fc2": P(AXIS)}
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(pspec, P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), P(AXIS), P(AXIS)),
        check_vma=False,
    )

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    bf = jnp.bfloat16
    params = {
        "router": arg((e, h), bf, P()),
        "fc1": arg((e,) + fc1[1:], bf, P(AXIS)),
        "fc2": arg((e, h, f), bf, P(AXIS)),
    }
    args = (
        params,
        arg((ep * n,), jnp.float32, P(AXIS)),
        arg((ep * t, h), bf, P(AXIS)),
        arg((ep * t, h), bf, P(AXIS)),
    )
    lowered = jax.jit(fn, donate_argnums=1).trace(*args).lower()
    t0 = time.time()
    compiled = lowered.compile(_options(cublas, dump))
    return compiled, time.time() - t0, cfg


def mlp_report(gpus, e, variant, t, h, f, k, swiglu, cublas) -> dict:
    compiled, secs, cfg = compile_mlp(gpus, e, variant, t, h, f, k, swiglu, cublas)
    text = compiled.as_text()
    fo1 = (2 if swiglu else 1) * f
    routed = 3 * 2 * t * k * h * (fo1 + f)  # fwd + dgrad + wgrad of both expert linears
    gs = gemms(text)
    calls = library_calls(text)
    for c in calls:
        c["flops_over_all_rows"] = _call_flops(c)
    dense_calls = sum(
        c["flops_over_all_rows"]
        for c in calls
        if c["target"] in (handlers.TARGET, handlers.TARGET_AT)
    )
    expert_flops = sum(g["flops"] for g in gs if g["part"] == "expert") + dense_calls
    ragged_rows = sorted(
        {_dims(c["operands"][0])[0] for c in calls if c["target"].startswith("jax_wgrad_ragged")}
    )
    return {
        "gpus": gpus,
        "ep": gpus,
        "experts": e,
        "local_experts": e // gpus,
        "variant": variant,
        "capacity": None if cfg.capacity_factor is None else cfg.capacity(t),
        "T": t,
        "H": h,
        "F": f,
        "k": k,
        "swiglu": swiglu,
        "gemm_backend": "cublas" if cublas else "default",
        "compile_s": round(secs, 1),
        "memory": _memory(compiled),
        "routed_expert_gemm_flops": routed,
        "xla_expert_gemm_flops": expert_flops,
        "xla_expert_gemm_over_routed": round(expert_flops / routed, 3),
        "ragged_buffer_rows": ragged_rows,
        "ragged_flops_if_every_buffer_row": sum(
            c["flops_over_all_rows"] for c in calls if c["target"].startswith("jax_wgrad_ragged")
        ),
        "library_calls": calls,
        "gemms": gs,
        "all_to_alls": all_to_alls(text),
        "largest_buffers": largest_buffers(text),
    }


# ------------------------------------------------------------------------ ragged a2a
def _ragged_exchange(x, sizes_to):
    """``x [T k, H]`` rows grouped by destination rank, ``sizes_to [EP]`` rows per
    destination -> ``[EP(src) * T k, H]``: source ``s``'s rows at ``s * T k``."""
    tk = x.shape[0]
    ep = jax.lax.axis_size(AXIS)
    me = jax.lax.axis_index(AXIS).astype(jnp.int32)
    input_offsets = (jnp.cumsum(sizes_to) - sizes_to).astype(jnp.int32)
    recv_sizes = jax.lax.all_to_all(sizes_to, AXIS, 0, 0, tiled=True)
    output_offsets = jnp.full((ep,), me * tk, jnp.int32)  # where MY rows go on each peer
    out = jnp.zeros((ep * tk, x.shape[1]), x.dtype)
    return jax.lax.ragged_all_to_all(
        x,
        out,
        input_offsets,
        sizes_to.astype(jnp.int32),
        output_offsets,
        recv_sizes.astype(jnp.int32),
        axis_name=AXIS,
    )


def ragged_a2a_report(gpus, t, h, k, platform, keep_dump: str | None = None) -> dict:
    tk = t * k
    if platform == "cpu":
        devices = jax.devices("cpu")[:gpus]
        mesh = Mesh(np.array(devices), (AXIS,))
    else:
        mesh = _mesh(gpus)

    def local(x, sizes, dy):
        y, vjp = jax.vjp(lambda x: _ragged_exchange(x, sizes), x)
        return y, vjp(dy)[0]

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS), P(AXIS)),
            out_specs=(P(AXIS), P(AXIS)),
            check_vma=False,
        )
    )
    sh = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P(AXIS)))
    args = (
        sh((gpus * tk, h), jnp.bfloat16),
        sh((gpus * gpus,), jnp.int32),
        sh((gpus * gpus * tk, h), jnp.bfloat16),
    )
    row = {
        "platform": platform,
        "gpus": gpus,
        "send": _fmt("bf16", (tk, h)),
        "receive": _fmt("bf16", (gpus * tk, h)),
    }
    try:
        lowered = fn.trace(*args).lower()
    except Exception as err:
        return dict(row, error=f"lower: {type(err).__name__}: {err}")
    with tempfile.TemporaryDirectory(prefix="moe_aot_") as tmp:
        dump = keep_dump or tmp
        try:
            opts = _options(False, dump) if platform != "cpu" else {}
            compiled = lowered.compile(opts)
        except Exception as err:
            return dict(row, error=f"compile: {type(err).__name__}: {str(err)[:2000]}")
        seq = (
            read_largest_dump(dump, "*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt")
            or ""
        )
        names = thunks.thunk_names(read_largest_dump(dump, "*thunk_metadata.txt") or "")
    text = compiled.as_text()
    comm = [
        {"kind": w.kind, "instruction": names.get(w.id, ""), "text": w.text.strip()[:160]}
        for top in thunks.parse_thunks(seq)
        for w in top.walk()
        if re.search(r"AllToAll|Ragged|Nccl|Collective|Send|Recv|Memcpy|Copy", w.kind)
    ]
    return dict(
        row,
        memory=_memory(compiled),
        all_to_alls=all_to_alls(text),
        thunks=comm,
        hlo=[l for l in text.splitlines() if re.search(r"all-to-all|custom-call\(", l)][:12],
    )


# ------------------------------------------------------------------------ scan
def scan_report(layers, e, t, h, f, k, bucket_elems, keep_dump: str | None = None) -> dict:
    """The backward of ``layers`` stacked dropless MoE layers (one H100, EP 1) in a
    ``lax.scan``; fc1/fc2 gradients into one flat bucket at traced offsets."""
    cfg = MoEConfig(e, f, topk=k)
    per_layer = 2 * e * f * h
    base = 1_000_003
    assert base + layers * per_layer <= bucket_elems

    def stacked(ws, bucket, x):
        offsets = base + jnp.arange(layers, dtype=jnp.int32) * per_layer

        def layer(carry, xs):
            hid, bk = carry
            p, off = xs
            (y, bk), _ = moe_mlp(p, hid, cfg, buckets=(bk, off, off + e * f * h))
            return (hid + y, bk), None

        return jax.lax.scan(layer, (x, bucket), (ws, offsets))[0]

    def backward(ws, bucket, x, dy):
        _, vjp = jax.vjp(stacked, ws, bucket, x)
        dws, new_bucket, dx = vjp((dy, bucket))
        return dws["router"], new_bucket, dx

    mesh = _mesh(1)
    sh = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))
    bf = jnp.bfloat16
    ws = {
        "router": sh((layers, e, h), bf),
        "fc1": sh((layers, e, f, h), bf),
        "fc2": sh((layers, e, h, f), bf),
    }
    lowered = (
        jax.jit(backward, donate_argnums=1)
        .trace(ws, sh((bucket_elems,), jnp.float32), sh((t, h), bf), sh((t, h), bf))
        .lower()
    )
    stablehlo = lowered.as_text()
    lowering = [
        re.search(r"output_operand_aliases = \[.*?>\]", l).group(0)
        for l in stablehlo.splitlines()
        if f"@{handlers.RAGGED_WGRAD_TARGET}" in l and "output_operand_aliases" in l
    ]
    with tempfile.TemporaryDirectory(prefix="moe_aot_") as tmp:
        dump = keep_dump or tmp
        compiled = lowered.compile(_options(False, dump))
        assignment = (
            read_largest_dump(dump, "*buffer-assignment.txt", "*buffer_assignment.txt") or ""
        )
        seq = (
            read_largest_dump(dump, "*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt")
            or ""
        )
        names = thunks.thunk_names(read_largest_dump(dump, "*thunk_metadata.txt") or "")
    text = compiled.as_text()
    comps = hlo.computations(text)
    entry = hlo.entry_name(text)
    bodies = [b for _, b in hlo.while_bodies(comps, entry)]
    loops = {}
    for body in bodies:
        reach = hlo.reachable(comps, body)
        sized = hlo.sized_ops(comps, reach, [bucket_elems])
        loops[body] = {
            "ragged_calls": sum(1 for c in reach for l in comps[c] if "jax_wgrad_ragged" in l),
            "bucket_sized": [i.line[:160] for i in sized],
        }
    whole = hlo.sized_ops(comps, hlo.reachable(comps, entry), [bucket_elems])
    allocs = []
    for block in re.split(r"\n(?=allocation \d+:)", assignment):
        if block.startswith("allocation") and f"f32[{bucket_elems}]" in block:
            vals = [l.strip()[:150] for l in block.splitlines()[1:] if f"f32[{bucket_elems}]" in l]
            allocs.append({"head": block.splitlines()[0][:200], "values": vals})
    loop_thunks = {}
    for top in thunks.parse_thunks(seq):
        for w in top.walk():
            if w.kind != "kWhile":
                continue
            body = w.nested.get("body", [])
            loop_thunks[f"while thunk {w.id}"] = [
                f"{leaf.kind} {names.get(leaf.id, '')} {leaf.text.strip()[:120]}"
                for b in body
                for leaf in b.walk()
                if not leaf.nested or leaf.kind == "kCommandBuffer"
            ]
    alias = re.search(r"input_output_alias=(\{.*?\) \})", text)
    return {
        "layers": layers,
        "E": e,
        "T": t,
        "H": h,
        "F": f,
        "k": k,
        "bucket": f"f32[{bucket_elems}]",
        "stablehlo_wgrad_aliases": lowering,
        "module_input_output_alias": alias.group(1) if alias else None,
        "library_calls": library_calls(text),
        "loops": loops,
        "whole_program_bucket_sized": [i.line[:160] for i in whole],
        "bucket_allocations": allocs,
        "loop_thunks": loop_thunks,
        "memory": _memory(compiled),
    }


# ------------------------------------------------------------------------ CLI
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mlp")
    m.add_argument("--gpus", type=int, default=1)
    m.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    m.add_argument(
        "--variants",
        nargs="+",
        default=["dropless", "cf=E", "cf=1"],
        choices=["dropless", "cf=E", "cf=1"],
    )
    m.add_argument("--tokens", type=int, default=4096, help="T per rank")
    m.add_argument("--hidden", type=int, default=2048)
    m.add_argument("--ffn", type=int, default=1024)
    m.add_argument("--topk", type=int, default=2)
    m.add_argument("--swiglu", action="store_true")
    m.add_argument(
        "--cublas",
        action="store_true",
        help="--xla_gpu_enable_triton_gemm=false: GEMMs as cuBLAS custom calls",
    )
    r = sub.add_parser("ragged-a2a")
    r.add_argument("--gpus", type=int, default=8)
    r.add_argument("--tokens", type=int, default=4096)
    r.add_argument("--hidden", type=int, default=2048)
    r.add_argument("--topk", type=int, default=2)
    r.add_argument("--platform", choices=["cuda", "cpu"], default="cuda")
    r.add_argument("--dump", help="keep XLA's dump in this directory")
    s = sub.add_parser("scan")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--experts", type=int, default=8)
    s.add_argument("--tokens", type=int, default=4096)
    s.add_argument("--hidden", type=int, default=2048)
    s.add_argument("--ffn", type=int, default=1024)
    s.add_argument("--topk", type=int, default=2)
    s.add_argument(
        "--bucket",
        type=int,
        default=200_000_003,
        help="bucket elements (odd: no other array has this size)",
    )
    s.add_argument("--dump", help="keep XLA's dump in this directory")
    a = ap.parse_args(argv)
    if a.cmd == "mlp":
        for e in a.experts:
            for v in a.variants:
                print(
                    json.dumps(
                        mlp_report(
                            a.gpus, e, v, a.tokens, a.hidden, a.ffn, a.topk, a.swiglu, a.cublas
                        )
                    ),
                    flush=True,
                )
    elif a.cmd == "ragged-a2a":
        print(json.dumps(ragged_a2a_report(a.gpus, a.tokens, a.hidden, a.topk, a.platform, a.dump)))
    else:
        print(
            json.dumps(
                scan_report(
                    a.layers, a.experts, a.tokens, a.hidden, a.ffn, a.topk, a.bucket, a.dump
                )
            )
        )


if __name__ == "__main__":
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        print("note: run with JAX_PLATFORMS=cpu (nothing needs a GPU)", file=sys.stderr)
    main()
