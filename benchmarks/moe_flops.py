#!/usr/bin/env python
"""Expert GEMM FLOPs and CPU time of the MoE MLP step: dropless vs capacity buffers.

For the jitted forward + backward of :func:`jax_wgrad.functional.moe_mlp` (expert weight
gradients fused into a flat bucket, as ``tests/test_moe.py::_sharded_loss_and_grads``
builds it) on ``EP`` expert ranks of the 8 virtual CPU devices, each rank ``T`` tokens,
for three variants of the layer:

  dropless      ``capacity_factor=None``: tokens sorted by expert, ragged grouped GEMMs
                (``jax_wgrad_ragged_matmul`` forward and dgrad,
                ``jax_wgrad_ragged_wgrad_accumulate`` wgrad)
  capacity=E    ``capacity_factor=E``: every expert a buffer of all ``T k`` choices of a
                rank (padded, nothing dropped): batched ``dot`` forward and dgrad,
                the grouped ``jax_wgrad_wgrad_accumulate`` wgrad
  capacity=1    ``capacity_factor=1.0``: buffers of ``ceil(T k / E)`` (drops tokens)

it reads the expert GEMM FLOPs per rank from the COMPILED HLO (``compile().as_text()``):

* XLA's ``dot``/``convolution`` instructions (fused ones included, weighted by how often
  their computation runs) whose operands are the expert buffers: a batch of ``E/EP``
  products over ``H`` and ``F`` (``2F`` for SwiGLU's fc1); ``2 B M N K`` each;
* the grouped wgrad custom calls (``x [E/EP, C, in]``: ``2 (E/EP) C in out``);
* the ragged custom calls, each ``2 rows in out`` with ``rows`` = the sum of its group
  sizes at run time: the rows the rank received, from the step's ``tokens_per_expert``
  stats, checked against the group sizes of the dispatch itself; reported as the mean
  over the ranks (``T k``; its maximum in ``max_rank``).

``ratio`` = expert GEMM FLOPs / the routed tokens' (``2 T k (H F1 + F H) x 3`` for
forward + backward, ``F1 = F``, or ``2F`` with SwiGLU): about 1 dropless, about ``E`` at
capacity ``E``, about 1 at capacity 1.0 (which drops tokens). ``xla_gflop`` is XLA's
``cost_analysis()["flops"]`` of the step (it does not count custom calls) and
``rest_gflop`` that minus the expert ``dot`` FLOPs it holds. ``step_ms``: median CPU wall
time of the step (the EP devices share this host's cores), ``vs_dropless`` its ratio to
the dropless step of the same routing; ``skewed`` routing sends every token's first
choice to expert 0 (``top_share``: the busiest expert's share of the routed choices;
``dropped``: the share past the capacity; ``max_rank``: the busiest expert rank's ratio).

    python benchmarks/moe_flops.py                     # T=1024 H=256 F=512 k=2, E 8 16
    python benchmarks/moe_flops.py --experts 8 32 --ep 4 --swiglu
    python benchmarks/moe_flops.py --no-time --json    # FLOPs only, one JSON line per row
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import jax

import jax_wgrad

jax_wgrad.use_virtual_cpu_devices(8)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_wgrad.aot.hlo import computations, entry_name, instructions  # noqa: E402
from jax_wgrad.functional import MoEConfig, moe_mlp  # noqa: E402
from jax_wgrad.functional.moe import route  # noqa: E402
from jax_wgrad.functional.moe_dispatch import DroplessDispatch  # noqa: E402
from jax_wgrad.ops import handlers  # noqa: E402
from jax_wgrad.parallel.mesh import EXPERT  # noqa: E402


def _load_sibling(name: str):
    """Another benchmark of this folder, as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VARIANTS = ("dropless", "capacity=E", "capacity=1")


def capacity_factor(variant: str, experts: int) -> float | None:
    """``moe_expert_capacity_factor`` of a variant (``None``: dropless)."""
    return {"dropless": None, "capacity=E": float(experts), "capacity=1": 1.0}[variant]


def routed_flops(tokens: int, topk: int, hidden: int, ffn: int, swiglu: bool = False) -> int:
    """Expert GEMM FLOPs of one rank's routed tokens, forward + backward: the ``T k`` rows
    through fc1 (``H -> F1``) and fc2 (``F -> H``), three GEMMs each (fwd, dgrad, wgrad)."""
    f1 = 2 * ffn if swiglu else ffn
    return 2 * tokens * topk * (hidden * f1 + ffn * hidden) * 3


# ---------------------------------------------------------------------- the step
def build_step(cfg: MoEConfig, ep: int):
    """jitted ``(params, x, r) -> (loss, grads, dx, tokens_per_expert [EP, E])`` on ``ep``
    expert ranks: each rank its own tokens and ``E/EP`` experts, loss = sum(y r) / N + the
    ranks' aux losses, the expert weight gradients in a flat fp32 bucket (the fused path)."""

    def local(p, x, r):
        sizes = (p["fc1"].size, p["fc2"].size)

        def loss(p, bucket, x):
            (y, bucket), stats = moe_mlp(
                p, x, cfg, expert_axis=EXPERT, buckets=(bucket, 0, sizes[0])
            )
            return jnp.sum(y * r) / (ep * x.shape[0]) + stats.aux_loss, (bucket, stats)

        bucket = jnp.zeros(sum(sizes), jnp.float32)
        (value, (_, stats)), (dp, dbucket, dx) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True
        )(p, bucket, x)
        dp = dict(
            dp,
            fc1=dbucket[: sizes[0]].reshape(p["fc1"].shape),
            fc2=dbucket[sizes[0] :].reshape(p["fc2"].shape),
            router=jax.lax.psum(dp["router"], EXPERT),
        )
        return jax.lax.psum(value, EXPERT), dp, dx, stats.tokens_per_expert[None]

    specs = {"router": P(), "fc1": P(EXPERT), "fc2": P(EXPERT)}
    mesh = Mesh(np.array(jax.devices()[:ep]), (EXPERT,))
    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, P(EXPERT), P(EXPERT)),
            out_specs=(P(), specs, P(EXPERT), P(EXPERT)),
            check_vma=False,
        )
    )


def dispatch_group_sizes(params, x, cfg: MoEConfig, ep: int) -> np.ndarray:
    """``[EP, E/EP]``: the group sizes the dropless dispatch hands to each rank's ragged
    GEMMs (the library's router and :class:`DroplessDispatch`, run on their own)."""

    def local(router, x):
        _, experts, _ = route(x, router, cfg.topk)
        _, sizes, _ = DroplessDispatch(
            expert_axis=EXPERT, ep=ep, num_experts=cfg.num_experts
        ).dispatch(x, experts)
        return sizes[None]

    mesh = Mesh(np.array(jax.devices()[:ep]), (EXPERT,))
    fn = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(EXPERT)), out_specs=P(EXPERT), check_vma=False
        )
    )
    return np.asarray(fn(params["router"], x))


def make_inputs(
    cfg: MoEConfig, ep: int, tokens: int, hidden: int, skewed: bool = False, seed: int = 0
):
    """``(params, x [EP T, H], r [EP T, H])``; ``skewed``: every token's first choice is
    expert 0 (router and tokens shifted as ``tests/test_moe_dropless.py`` does)."""
    e, f = cfg.num_experts, cfg.ffn_hidden_size
    k = jax.random.split(jax.random.key(seed), 5)
    router = jax.random.normal(k[0], (e, hidden))
    x = jax.random.normal(k[3], (ep * tokens, hidden))
    if skewed:
        u = jnp.ones((hidden,)) / np.sqrt(hidden)
        router = 0.3 * router + 4.0 * jnp.outer(jnp.eye(e)[0] - 3 * jnp.eye(e)[e - 1], u)
        x = x + 2.0
    fc1 = (e, 2, f, hidden) if cfg.swiglu else (e, f, hidden)
    params = {
        "router": router,
        "fc1": jax.random.normal(k[1], fc1) / np.sqrt(hidden),
        "fc2": jax.random.normal(k[2], (e, hidden, f)) / np.sqrt(f),
    }
    return params, x, jax.random.normal(k[4], (ep * tokens, hidden))


# ------------------------------------------------------------- reading the compiled HLO
def _dims(shape: str) -> tuple[int, ...]:
    m = re.match(r"\s*[a-z]+\d*\[([\d,]*)\]", shape)
    return tuple(int(d) for d in m.group(1).split(",") if d)


def _attr_dims(line: str, attr: str) -> tuple[int, ...]:
    m = re.search(rf"\b{attr}=\{{([\d,]*)\}}", line)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def call_counts(hlo: str) -> dict[str, int]:
    """``{computation: how many times it runs per execution of the module}``, from the
    entry: fusions, calls, async wrappers and branches count once per call (a branch: at
    most once), ``while`` bodies their known trip count (``1`` if XLA does not know it)."""
    comps = computations(hlo)
    counts: dict[str, int] = {}

    def visit(comp: str, times: int) -> None:
        counts[comp] = counts.get(comp, 0) + times
        for ins in instructions(comps.get(comp, ())):
            callees = re.findall(r"\bcalls=%([\w.\-]+)", ins.line)
            callees += [
                c.strip().lstrip("%")
                for g in re.findall(r"branch_computations=\{([^}]*)\}", ins.line)
                for c in g.split(",")
            ]
            callees += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", ins.line)
            if ins.opcode == "call":
                callees += re.findall(r"\bto_apply=%([\w.\-]+)", ins.line)
            for c in callees:
                visit(c, times)
            if ins.opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.line)
                visit(
                    re.search(r"\bbody=%([\w.\-]+)", ins.line).group(1),
                    times * (int(trip.group(1)) if trip else 1),
                )

    visit(entry_name(hlo), 1)
    return counts


class Dot(NamedTuple):
    """A ``dot``/``convolution`` of a compiled module: ``B`` products ``[M, K] x [K, N]``."""

    name: str
    computation: str
    caller: str | None
    """The fusion instruction that runs it (its computation's caller), if any."""
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    batch: int
    m: int
    n: int
    k: int
    runs: int
    op_name: str

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k * self.runs


def dots(hlo: str) -> list[Dot]:
    """Every ``dot`` and ``convolution`` of the module with its FLOPs (``2 B M N K``,
    times the runs of its computation; a convolution as ``2 x output x kernel / output
    features``, expressed as ``B = M = 1``)."""
    comps, runs = computations(hlo), call_counts(hlo)
    callers = {}
    for lines in comps.values():
        for ins in instructions(lines):
            for callee in re.findall(r"\bcalls=%([\w.\-]+)", ins.line):
                callers.setdefault(callee, ins.name)
    out = []
    for c, lines in comps.items():
        parsed = instructions(lines)
        shapes = {ins.name: ins.shape for ins in parsed}
        for ins in parsed:
            if ins.opcode not in ("dot", "convolution"):
                continue
            args = re.search(rf"{ins.opcode}\((.*?)\)", ins.line).group(1)
            operands = []
            for arg in args.split(", "):  # "%a" or "f32[2,3]{1,0} %a"
                name = arg.split()[-1].lstrip("%")
                operands.append(_dims(arg) if "[" in arg else _dims(shapes[name]))
            lhs, rhs = operands[:2]
            if ins.opcode == "dot":
                lb, lc = (
                    _attr_dims(ins.line, "lhs_batch_dims"),
                    _attr_dims(ins.line, "lhs_contracting_dims"),
                )
                rb, rc = (
                    _attr_dims(ins.line, "rhs_batch_dims"),
                    _attr_dims(ins.line, "rhs_contracting_dims"),
                )
                batch = math.prod(lhs[d] for d in lb)
                kk = math.prod(lhs[d] for d in lc)
                m = math.prod(s for d, s in enumerate(lhs) if d not in lb + lc)
                n = math.prod(s for d, s in enumerate(rhs) if d not in rb + rc)
            else:
                labels = re.search(r"dim_labels=\w+_(\w+)->", ins.line).group(1)
                groups = re.search(r"feature_group_count=(\d+)", ins.line)
                groups = int(groups.group(1)) if groups else 1
                out_features = rhs[labels.index("o")]
                batch, m, n = 1, 1, math.prod(_dims(ins.shape))
                kk = math.prod(rhs) // out_features // groups
            out.append(
                Dot(
                    ins.name,
                    c,
                    callers.get(c),
                    lhs,
                    rhs,
                    batch,
                    m,
                    n,
                    kk,
                    runs.get(c, 0),
                    ins.op_name,
                )
            )
    return out


def expert_dots(
    all_dots: list[Dot], experts_local: int, hidden: int, widths: tuple[int, ...]
) -> list[Dot]:
    """The dots over expert buffers: a batch of ``E/EP`` products two of whose dimensions
    are ``H`` and an expert width (``F``, or ``2F`` for SwiGLU's fc1), the third the rows
    (the expert capacity, or the buffer's tokens in the wgrad)."""
    out = []
    for d in all_dots:
        if d.batch != experts_local or d.runs == 0:
            continue
        mnk = sorted((d.m, d.n, d.k))
        if any(_covers(mnk, (hidden, w)) for w in widths):
            out.append(d)
    return out


def _covers(mnk: list[int], pair: tuple[int, int]) -> bool:
    rest = list(mnk)
    for v in pair:
        if v not in rest:
            return False
        rest.remove(v)
    return True


def batched_over(all_dots: list[Dot], size: int) -> list[Dot]:
    """Dots with an operand of rank >= 3 whose leading dimension is ``size`` and is one of
    the dot's batch dimensions (a product batched over ``size`` experts)."""
    return [
        d
        for d in all_dots
        if d.batch % size == 0
        and d.batch >= size
        and any(len(s) >= 3 and s[0] == size for s in (d.lhs, d.rhs))
    ]


class ExpertCall(NamedTuple):
    """An expert GEMM custom call: ``role`` fwd, dgrad or wgrad; ``rows`` of ``in -> out``
    (the worst-case bound: a ragged call's work is the rows in its groups)."""

    name: str
    target: str
    role: str
    groups: int
    rows: int
    d_in: int
    d_out: int

    def flops(self, rows: float | None = None) -> float:
        """``2 groups rows in out`` (a ragged call: ``rows`` = its groups' total)."""
        if self.target == handlers.TARGET or self.target == handlers.TARGET_AT:
            return 2 * self.groups * self.rows * self.d_in * self.d_out
        return 2 * (self.rows if rows is None else rows) * self.d_in * self.d_out


def expert_calls(hlo: str) -> list[ExpertCall]:
    """The ragged custom calls (``jax_wgrad_ragged_matmul`` with ``w [G, out, in]``: fwd
    ``x [R, in] -> [R, out]`` (``transpose_rhs = 1``), dgrad ``dy [R, out] -> [R, in]``
    (``transpose_rhs = 0``); ``jax_wgrad_ragged_wgrad_accumulate``: wgrad) and the
    grouped wgrad calls (``jax_wgrad_wgrad_accumulate`` with 3-D ``x [G, C, in]``), in
    module order; ``in``/``out`` are the expert linear's."""
    out = []
    for ins in instructions(hlo.splitlines()):
        target = re.search(r'custom_call_target="([^"]+)"', ins.line)
        if ins.opcode != "custom-call" or target is None:
            continue
        target = target.group(1)
        if target not in (
            handlers.RAGGED_MATMUL_TARGET,
            handlers.RAGGED_WGRAD_TARGET,
            handlers.TARGET,
            handlers.TARGET_AT,
        ):
            continue
        layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", ins.line)
        shapes = [_dims(s) for s in re.findall(r"[a-z]+\d*\[[\d,]*\]", layouts.group(1))]
        if target == handlers.RAGGED_MATMUL_TARGET:
            (rows, k), (g, a, b) = shapes[0], shapes[1]
            transpose = int(re.search(r"transpose_rhs = (\d)", ins.line).group(1))
            n = a if transpose else b
            # forward: x [R, in] -> [R, out]; dgrad: dy [R, out] -> dx [R, in] (fc's in/out)
            d_in, d_out = (k, n) if transpose else (n, k)
            out.append(
                ExpertCall(ins.name, target, "fwd" if transpose else "dgrad", g, rows, d_in, d_out)
            )
        elif target == handlers.RAGGED_WGRAD_TARGET:
            (rows, d_in), (_, d_out), (g,) = shapes[0], shapes[1], shapes[2]
            out.append(ExpertCall(ins.name, target, "wgrad", g, rows, d_in, d_out))
        elif target in (handlers.TARGET, handlers.TARGET_AT) and len(shapes[0]) == 3:
            (g, rows, d_in), (_, _, d_out) = shapes[0], shapes[1]
            out.append(ExpertCall(ins.name, target, "wgrad", g, rows, d_in, d_out))
    return out


def ragged_calls(hlo: str) -> list[ExpertCall]:
    return [
        c
        for c in expert_calls(hlo)
        if c.target in (handlers.RAGGED_MATMUL_TARGET, handlers.RAGGED_WGRAD_TARGET)
    ]


def _linear(call: ExpertCall, hidden: int) -> str:
    """Which expert linear: fc1 reads ``H``, fc2 writes it."""
    return "fc1" if call.d_in == hidden else "fc2"


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def expert_gemm_flops(
    hlo: str, cfg: MoEConfig, ep: int, hidden: int, rank_rows: np.ndarray | None = None
) -> dict:
    """Expert GEMM FLOPs per rank of a compiled step (module docstring).

    ``rank_rows``: ``[EP]`` rows each rank's ragged GEMMs compute on at run time (the sums
    of their group sizes); ``None``: the calls' static row bound (worst case).
    Returns ``{"flops": mean over the ranks, "max_rank": the largest rank's,
    "dot_flops": of the XLA dots, "bound": with every ragged call at its static row bound
    (the worst-case buffer), "dots": [names], "calls": [names], "ragged": count}``.
    """
    f = cfg.ffn_hidden_size
    widths = (2 * f, f) if cfg.swiglu else (f,)
    xd = expert_dots(dots(hlo), cfg.num_experts // ep, hidden, widths)
    calls = expert_calls(hlo)
    dot_flops = float(sum(d.flops for d in xd))
    per_rank = []
    rows = [None] if rank_rows is None else [float(r) for r in rank_rows]
    for r in rows:
        per_rank.append(dot_flops + sum(c.flops(r) for c in calls))
    return {
        "flops": float(np.mean(per_rank)),
        "max_rank": float(np.max(per_rank)),
        "dot_flops": dot_flops,
        "bound": dot_flops + sum(c.flops() for c in calls),
        "dots": [f"{d.caller or d.name}:{d.name}" for d in xd],
        "calls": [f"{c.name}({c.role} {_linear(c, hidden)})" for c in calls],
        "ragged": len([c for c in calls if c.target.startswith("jax_wgrad_ragged")]),
    }


# ------------------------------------------------------------------------ one row
def measure(
    variant: str,
    experts: int,
    ep: int,
    tokens: int,
    hidden: int,
    ffn: int,
    topk: int,
    swiglu: bool,
    skewed: bool,
    warmup: int,
    iters: int,
    time_it: bool = True,
) -> dict:
    """One (variant, E, EP, routing) row: expert GEMM FLOPs from the compiled step against
    the routed tokens', XLA's cost of the rest, and the step time."""
    cfg = MoEConfig(
        num_experts=experts,
        ffn_hidden_size=ffn,
        topk=topk,
        capacity_factor=capacity_factor(variant, experts),
        load_balancing_type="aux_loss",
        aux_loss_coeff=1e-2,
        swiglu=swiglu,
    )
    params, x, r = make_inputs(cfg, ep, tokens, hidden, skewed)
    step = build_step(cfg, ep)
    compiled = step.lower(params, x, r).compile()
    hlo = compiled.as_text()
    counts = np.asarray(compiled(params, x, r)[3])  # [EP(src), E] tokens_per_expert
    if not np.all(counts.sum(1) == tokens * topk):
        raise AssertionError(
            f"a source rank routed {counts.sum(1)} choices, not T k = {tokens * topk}"
        )
    rank_rows = counts.sum(0).reshape(ep, -1).sum(1)  # rows each expert rank receives
    if cfg.capacity_factor is None:
        sizes = dispatch_group_sizes(params, x, cfg, ep)  # [EP, E/EP] the ragged groups
        if not np.array_equal(sizes.sum(1), rank_rows):
            raise AssertionError(
                f"group sizes {sizes.tolist()} disagree with the stats' "
                f"rows per rank {rank_rows.tolist()}"
            )
    got = expert_gemm_flops(hlo, cfg, ep, hidden, rank_rows)
    routed = routed_flops(tokens, topk, hidden, ffn, swiglu)
    total = xla_flops(compiled)
    row = {
        "platform": jax.default_backend(),
        "variant": variant,
        "routing": "skewed" if skewed else "random",
        "E": experts,
        "EP": ep,
        "T": tokens,
        "H": hidden,
        "F": ffn,
        "k": topk,
        "swiglu": swiglu,
        "capacity": None if cfg.capacity_factor is None else cfg.capacity(tokens),
        "expert_gflop": got["flops"] / 1e9,
        "routed_gflop": routed / 1e9,
        "ratio": got["flops"] / routed,
        "max_rank": got["max_rank"] / routed,
        "bound_ratio": got["bound"] / routed,
        "xla_gflop": total / 1e9,
        "rest_gflop": (total - got["dot_flops"]) / 1e9,
        "top_share": float(counts.sum(0).max() / counts.sum()),
        "dropped": 0.0 if cfg.capacity_factor is None else _dropped(counts, cfg, tokens),
        "ragged_calls": got["ragged"],
        "expert_dots": got["dots"],
        "expert_calls": got["calls"],
    }
    if time_it:
        row["step_ms"] = _time(step, lambda _: (params, x, r), warmup, iters)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def _dropped(counts: np.ndarray, cfg: MoEConfig, tokens: int) -> float:
    """Fraction of the routed choices past the capacity (over all source ranks)."""
    cap = cfg.capacity(tokens)
    return float(np.maximum(counts - cap, 0).sum() / counts.sum())


def _time(fn, make_args, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn(*make_args(prev))`` (``wgrad_kernel._time``)."""
    global _timer
    if _timer is None:
        _timer = _load_sibling("wgrad_kernel")._time
    return _timer(fn, make_args, warmup, iters)


_timer = None


# column, format; each column as wide as its name (at least 8)
_COLUMNS = [
    ("routing", "s"),
    ("E", "d"),
    ("EP", "d"),
    ("variant", "s"),
    ("capacity", "s"),
    ("expert_gflop", ".3f"),
    ("routed_gflop", ".3f"),
    ("ratio", ".3f"),
    ("max_rank", ".3f"),
    ("xla_gflop", ".3f"),
    ("rest_gflop", ".3f"),
    ("top_share", ".3f"),
    ("dropped", ".3f"),
    ("ragged_calls", "d"),
    ("step_ms", ".1f"),
    ("vs_dropless", ".2f"),
]


def _table_row(row: dict | None) -> str:
    """A row of the table, or its header for ``None``."""
    width = lambda name: max(8, len(name), 10 if name == "variant" else 0)
    if row is None:
        return "  ".join(f"{name:>{width(name)}}" for name, _ in _COLUMNS)
    cells = []
    for name, fmt in _COLUMNS:
        v = row.get(name)
        text = "-" if v is None else format(v, fmt) if fmt != "s" else str(v)
        cells.append(f"{text:>{width(name)}}")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--tokens", type=int, default=1024, help="T: tokens per rank")
    parser.add_argument("--hidden", type=int, default=256, help="H: hidden size")
    parser.add_argument("--ffn", type=int, default=512, help="F: expert ffn hidden size")
    parser.add_argument("--topk", type=int, default=2, help="k: experts per token")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16], help="E values")
    parser.add_argument(
        "--ep",
        type=int,
        nargs="+",
        default=[1, 4],
        help="expert-parallel sizes (of the 8 virtual CPU devices)",
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--skewed-variants",
        nargs="*",
        default=["dropless", "capacity=E"],
        choices=VARIANTS,
        help="variants also run with skewed routing",
    )
    parser.add_argument("--swiglu", action="store_true", help="SwiGLU experts (F1 = 2F)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-time", action="store_true", help="FLOPs only (no step timing)")
    parser.add_argument("--json", action="store_true", help="one JSON line per row")
    args = parser.parse_args(argv)
    if (
        min(args.tokens, args.hidden, args.ffn, args.topk, args.iters, *args.experts, *args.ep) < 1
        or args.warmup < 0
    ):
        parser.error("sizes and --iters must be >= 1, --warmup >= 0")
    for e in args.experts:
        for ep in args.ep:
            if ep > jax.device_count() or e % ep or args.topk > e:
                parser.error(
                    f"E={e}, EP={ep}: EP must divide E and be <= "
                    f"{jax.device_count()} devices, and k <= E"
                )
    if not jax_wgrad.fusion_available(families=("ragged",)):
        status = jax_wgrad.fusion_status(families=("ragged",))
        sys.exit(f"the ragged GEMM handlers are unavailable on {jax.default_backend()}: {status}")
    if not args.json:
        print(
            f"# {jax.default_backend()}: T={args.tokens}/rank H={args.hidden} "
            f"F={args.ffn} k={args.topk}{' SwiGLU' if args.swiglu else ''}; per rank "
            "fwd+bwd; ratio = expert GEMM FLOPs / routed tokens'; step_ms median of "
            f"{args.iters}"
        )
        print(_table_row(None))
    named = {}  # variant -> (E, EP, the expert GEMM instructions counted)
    for routing in ("random", "skewed"):
        variants = (
            args.variants
            if routing == "random"
            else [v for v in args.variants if v in args.skewed_variants]
        )
        for e in args.experts:
            for ep in args.ep:
                base = None
                for v in variants:
                    row = measure(
                        v,
                        e,
                        ep,
                        args.tokens,
                        args.hidden,
                        args.ffn,
                        args.topk,
                        args.swiglu,
                        routing == "skewed",
                        args.warmup,
                        args.iters,
                        time_it=not args.no_time,
                    )
                    if v == "dropless":
                        base = row.get("step_ms")
                    if base and "step_ms" in row:
                        row["vs_dropless"] = round(row["step_ms"] / base, 4)
                    named[v] = (e, ep, row["expert_dots"] + row["expert_calls"])
                    print(json.dumps(row) if args.json else _table_row(row), flush=True)
    if not args.json:
        print("# expert GEMM instructions counted (fusion:dot, custom call(role linear)):")
        for v, (e, ep, names) in named.items():
            print(f"#   {v} (E={e}, EP={ep}): {', '.join(names)}")


if __name__ == "__main__":
    main()
