"""The estimated step time from compiled HLO (``jax_wgrad.aot.estimate``): each kernel's
roofline, collectives hidden or exposed, loops, conditionals, the schedule's ticks, and
Megatron's model FLOPs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import GPTConfig
from jax_wgrad.aot import estimate as est
from jax_wgrad.aot import thunks

# Round numbers, no latencies: every expected time below is exact.
PEAKS = est.Peaks(
    "test",
    tensor_flops={"bf16": 1e12, "f32": 5e11},
    vector_flops=1e11,
    hbm_bandwidth=1e9,
    nvlink_bandwidth=1e8,
    network_bandwidth=1e7,
    launch_s=0.0,
    graph_kernel_s=0.0,
    collective_s=0.0,
    host_sync_s=0.0,
)


@pytest.mark.parametrize(
    "line,size,crosses",
    [
        # jax's mesh form: the 'tensor' axis of a (2, 1, 2, 2) mesh: ids d, d + 2
        ("replica_groups=mesh['data'=2,'expert'=1,'tensor'=2,'pipeline'=2] {'tensor'}", 2, False),
        # the 'data' axis: ids d, d + 4 -- on two hosts of 4 GPUs
        ("replica_groups=mesh['data'=2,'expert'=1,'tensor'=2,'pipeline'=2] {'data'}", 2, True),
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4, False),
        ("replica_groups={{0,4},{1,5}}", 2, True),
        ("replica_groups=[2,4]<=[8]", 4, False),  # rows of iota(8).reshape(2, 4)
        ("replica_groups=[4,2]<=[2,4]T(1,0)", 2, True),  # columns: {0,4}, {1,5}, ...
        ("source_target_pairs={{0,1},{1,0}}", 2, False),
        ("source_target_pairs={{3,4}}", 2, True),
        ("no groups at all", 0, True),
    ],
)
def test_group_span(line, size, crosses):
    hosts = [d // 4 for d in range(8)]  # two hosts of four devices
    assert est.group_span(line, hosts) == (size, crosses)


_MODULE = """\
HloModule m, is_scheduled=true

%gemm (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %d = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%scale (q: f32[1000]) -> f32[1000] {
  %q = f32[1000]{0} parameter(0)
  %c = f32[] constant(2)
  %b = f32[1000]{0} broadcast(%c), dimensions={}
  ROOT %m = f32[1000]{0} multiply(%q, %b)
}

%ag (agp: f32[1000]) -> f32[2000] {
  %agp = f32[1000]{0} parameter(0)
  ROOT %g = f32[2000]{0} all-gather(%agp), replica_groups={{0,1}}, dimensions={0}
}

%body (t: (s32[], f32[1000])) -> (s32[], f32[1000]) {
  %t = (s32[], f32[1000]{0}) parameter(0)
  %x = f32[1000]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %y = f32[1000]{0} fusion(%x), kind=kLoop, calls=%scale
  ROOT %r = (s32[], f32[1000]{0}) tuple(%i, %y)
}

%cond (t: (s32[], f32[1000])) -> pred[] {
  %t = (s32[], f32[1000]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%light (x: f32[1000]) -> f32[1000] {
  ROOT %x = f32[1000]{0} parameter(0)
}

%heavy (x: f32[1000]) -> f32[1000] {
  %x = f32[1000]{0} parameter(0)
  ROOT %y = f32[1000]{0} fusion(%x), kind=kLoop, calls=%scale
}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], v: f32[1000], k: pred[]) -> f32[1000] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  %v = f32[1000]{0} parameter(2)
  %k = pred[] parameter(3)
  %all-gather-start = ((f32[1000]{0}), f32[2000]{0}) async-start(%v), calls=%ag, \
metadata={op_name="jit(step)/tensor/all_gather"}
  %gemm_fusion = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %all-gather-done = f32[2000]{0} async-done(%all-gather-start)
  %all-reduce = f32[1000]{0} all-reduce(%v), replica_groups={{0,1}}, to_apply=%scale, \
metadata={op_name="jit(step)/data_parallel_sync/psum"}
  %z = s32[] constant(0)
  %init = (s32[], f32[1000]{0}) tuple(%z, %v)
  %while = (s32[], f32[1000]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %w = f32[1000]{0} get-tuple-element(%while), index=1
  ROOT %c = f32[1000]{0} conditional(%k, %w, %w), true_computation=%heavy, \
false_computation=%light
}
"""


def test_roofline_of_each_kernel_and_collective():
    mc = est.ModuleCosts(_MODULE, PEAKS, hosts=(0, 0))
    cost = mc.computation(mc.entry)
    gemm_s = 2 * 64 * 128 * 256 / 1e12  # 4.2 us at the bf16 peak
    gemm_io = (64 * 128 + 128 * 256 + 64 * 256) * 2  # 115 us at 1 GB/s: memory-bound
    gemm_bound = max(gemm_s, gemm_io / 1e9)
    scale_s = 8000 / 1e9  # read 4000 B, write 4000 B
    assert cost.flops == 2 * 64 * 128 * 256
    # the gemm (memory-bound at these peaks) + 3 loop iterations + the heavier branch
    assert cost.memory_s == pytest.approx(gemm_bound + 3 * scale_s + scale_s)
    assert cost.compute_s == 0.0  # the GEMM's bytes dominate its FLOPs here
    # all-gather: 1/2 of 8000 B over NVLink, nothing GEMM-bound between start and done;
    # the all-reduce is synchronous: 2 * 1/2 * 4000 B
    ag, ar = 4000 / 1e8, 4000 / 1e8
    assert cost.exposed_comm_s == pytest.approx(ag + ar)
    assert cost.seconds == pytest.approx(cost.memory_s + ag + ar)
    assert {c.kind for c in mc.collectives} == {"all-gather", "all-reduce"}


def test_gemm_class_work_between_start_and_done_hides_the_collective():
    fast = dataclasses_replace(PEAKS, hbm_bandwidth=1e15)  # the GEMM becomes FLOP-bound
    mc = est.ModuleCosts(_MODULE, fast, hosts=(0, 0))
    cost = mc.computation(mc.entry)
    gemm_s = 2 * 64 * 128 * 256 / 1e12
    ag = 4000 / 1e8
    assert cost.compute_s == pytest.approx(gemm_s)
    (gather,) = [c for c in mc.collectives if c.kind == "all-gather"]
    assert gather.hidden_s == pytest.approx(min(ag, gemm_s))
    assert gather.exposed_s == pytest.approx(ag - gemm_s)
    assert cost.hidden_comm_s == pytest.approx(gemm_s)


_ALLOCATED = """\
HloModule m, is_scheduled=true

%ag (agp: f32[1000]) -> f32[2000] {
  %agp = f32[1000]{0} parameter(0)
  ROOT %g = f32[2000]{0} all-gather(%agp), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (v: f32[1000]) -> (f32[2000], bf16[8,1024,1024]) {
  %v = f32[1000]{0} parameter(0)
  %all-gather-start = ((f32[1000]{0}), f32[2000]{0}) async-start(%v), calls=%ag
  %stack = bf16[8,1024,1024]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %all-gather-done = f32[2000]{0} async-done(%all-gather-start)
  ROOT %t = (f32[2000]{0}, bf16[8,1024,1024]{2,1,0}) tuple(%all-gather-done, %stack)
}
"""


def test_an_allocated_buffer_is_no_kernel():
    # XLA's DUS-accumulator zero-init elimination leaves AllocateBuffer where a loop's
    # stacked output was zero-filled: no kernel, no bytes, nothing that hides a collective
    from jax_wgrad.aot import hlo

    mc = est.ModuleCosts(_ALLOCATED, PEAKS, hosts=(0, 0))
    (stack,) = [i for i in hlo.instructions(mc.comps[mc.entry]) if i.name == "stack"]
    assert stack.allocates_only
    assert mc.kernel(stack) == est.Cost()
    assert hlo.kernel_traffic(stack, mc.comps) is None
    assert not hlo.gemm_class(stack, mc.comps)
    cost = mc.computation(mc.entry)
    assert cost.hbm_bytes == 0 and cost.launches == 0
    assert cost.exposed_comm_s == pytest.approx(4000 / 1e8) and cost.hidden_comm_s == 0
    (gather,) = hlo.async_collectives(mc.comps)
    assert gather.compute_between == () and gather.gemms_between == ()


def test_lighter_branch_and_network_bandwidth():
    mc = est.ModuleCosts(_MODULE, PEAKS, hosts=(0, 1))  # {0,1} spans two hosts
    idle = mc.computation(mc.entry, busy=False)
    busy = mc.computation(mc.entry)
    assert busy.memory_s - idle.memory_s == pytest.approx(8000 / 1e9)
    assert busy.exposed_comm_s == pytest.approx(2 * 4000 / 1e7)


def dataclasses_replace(p, **kw):
    import dataclasses

    return dataclasses.replace(p, **kw)


def test_schedule_time_is_the_slowest_stage_per_tick():
    idle, on = est.Cost(memory_s=0.5), est.Cost(compute_s=2.0)
    # stage 0 busy in ticks 0 and 1, stage 1 in ticks 1 and 2: every tick has a busy
    # stage, so 3 x 2 s, though each stage alone is busy for 2 + 2 + 0.5 s
    busy = {(0, 0), (1, 0), (1, 1), (2, 1)}
    seconds, stage = est.schedule_time(
        est.Cost(), {"forward": (idle, on)}, lambda k, t, s: (t, s) in busy, 3, 2
    )
    assert seconds == pytest.approx(3 * 2.0)
    assert stage.seconds == pytest.approx(2 + 2 + 0.5)


def test_a_switch_task_is_charged_the_branch_its_tick_runs():
    """The backward of a step with layer groups is a switch (idle, busy, the stage's last
    with the syncs): each tick is charged the branch the table runs, not the heaviest."""
    idle, on, last = est.Cost(), est.Cost(compute_s=1.0), est.Cost(compute_s=1.5)
    which = {(0, 0): 1, (1, 0): 1, (2, 0): 2, (0, 1): 0, (1, 1): 1, (2, 1): 2}
    seconds, stage = est.schedule_time(
        est.Cost(), {"backward": (idle, on, last)}, lambda k, t, s: which[t, s], 3, 2
    )
    assert seconds == pytest.approx(1.0 + 1.0 + 1.5)
    assert stage.seconds == pytest.approx(1.0 + 1.0 + 1.5)
    from jax_wgrad.aot.compile import table_busy
    from jax_wgrad.parallel.schedules import get_schedule

    t = get_schedule("1f1b", 2, 4)
    busy = table_busy(t)
    for s in range(2):
        ticks = [k for k in range(t.num_ticks) if busy("backward", k, s) == 2]
        assert ticks == [t.last_grad_tick(s)]


def test_flops_of_a_cpu_compiled_scan_of_matmuls():
    """The estimate counts a real compiled module's GEMMs: a scan of three matmuls."""

    def f(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    x, ws = jnp.ones((64, 128), jnp.float32), jnp.ones((3, 128, 128), jnp.float32)
    text = jax.jit(f).lower(x, ws).compile().as_text()
    e = est.estimate_step(text, PEAKS)
    assert e.cost.flops == pytest.approx(3 * 2 * 64 * 128 * 128)
    assert e.seconds > 0 and e.mfu is None


def test_host_syncs_and_graphed_kernels_from_thunks():
    text = """\
001: kConditional   [source | sink]
  true_branch:
    002: kKernel    [source | sink]
003: kCommandBuffer [source | sink]
    004: kKernel    [source | sink]
    008: kConditional [source | sink]
005: kWhile         [source | sink]
condition:
  006: kKernel      [source | sink]
body:
  007: kKernel      [source | sink]
"""
    seq = thunks.parse_thunks(text)
    names = {1: "cond.1", 2: "fusion.2", 4: "fusion.4", 5: "while.5", 6: "cmp", 7: "fusion.7"}
    names[8] = "cond.8"  # captured in the command buffer: a CUDA graph conditional node
    assert thunks.graphed_instructions(seq, names) == frozenset({"fusion.4", "cond.8"})
    assert thunks.host_syncs(seq, names, {"while.5": None}) == {"cond.1": 1, "while.5": 1}
    assert thunks.host_syncs(seq, names, {"while.5": 12}) == {"cond.1": 1}


def test_megatron_model_flops():
    """``GPTConfig.flops_per_step`` is Megatron-LM's ``num_floating_point_operations``: for
    a GPT-3-style model it is the Megatron paper's ``72 B s L h^2 (1 + s / 6h + V / 12 L h)``
    (arXiv 2104.04473, appendix), and for Llama-3-8B the GQA/SwiGLU form."""
    gpt = GPTConfig(
        vocab_size=51200, num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048
    )
    b, s, n, h, v = 8, 2048, 24, 2048, 51200
    paper = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    assert gpt.flops_per_step(b) == pytest.approx(paper, rel=1e-12)
    llama = GPTConfig(
        vocab_size=128256,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        group_query_attention=True,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=4096,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    attention = 1 + 8 / 32 + 4096 / 4096
    mlp = 14336 / 4096 * 1.5
    logit = 128256 / (2 * 32 * 4096)
    want = 12 * 16 * 4096 * 32 * 4096**2 * (attention + mlp + logit)
    assert llama.flops_per_step(16) == pytest.approx(want, rel=1e-12)
    assert np.isclose(want, 3.37e15, rtol=0.01)


def test_report_figures_carry_the_estimate():
    import dataclasses

    from test_aot import _report

    e = est.StepEstimate(
        0.5,
        est.Cost(compute_s=0.4, memory_s=0.1, host_syncs=3),
        est.PEAKS["h100"],
        devices=8,
        model_flops=0.5 * 8 * 989.4e12 * 0.45,
        collectives=(
            est.CollectiveCost(
                "rs.1", "reduce-scatter", "x/grad_sync_in_cooldown/rs", 2, False, 1.0, 1e-3, 1e-3
            ),
        ),
    )
    r = dataclasses.replace(_report(None), estimate=e, host_syncs_per_step=3.0)
    fig = r.figures()
    assert fig["estimated_step_ms"] == pytest.approx(500.0)
    assert fig["estimated_mfu"] == pytest.approx(0.45)
    assert fig["host_syncs_per_step"] == 3.0 and fig["dp_sync_overlapped"] is True
    assert "estimated step on NVIDIA H100" in r.format() and "MFU 45.0%" in r.format()
    exposed = dataclasses.replace(
        e,
        collectives=(
            est.CollectiveCost(
                "rs.1", "reduce-scatter", "x/data_parallel_sync/rs", 2, False, 1.0, 1e-3, 0.0
            ),
        ),
    )
    r = dataclasses.replace(r, estimate=exposed)
    assert r.figures()["dp_sync_overlapped"] is False
    assert "data-parallel gradient sync: exposed: reduce-scatter rs.1 1.00 ms" in r.format()
    # Layer groups: the verdict is about the syncs inside the last backward; the tail
    # after it (Megatron's last buckets) is reported exposed beside it.
    cc = est.CollectiveCost
    groups = dataclasses.replace(
        e,
        collectives=(
            cc("rs.2", "reduce-scatter", "x/grad_sync_in_backward/rs", 2, False, 1.0, 2e-3, 2e-3),
            cc("rs.3", "reduce-scatter", "x/data_parallel_sync/rs", 2, False, 1.0, 1e-3, 0.0),
        ),
    )
    r = dataclasses.replace(r, estimate=groups)
    assert r.figures()["dp_sync_overlapped"] is True
    assert (
        "overlapped with the last backward: 1 collectives, 2.00 of 2.00 ms hidden; after it "
        "(the buckets the backward completes last, as in Megatron): 1.00 ms exposed"
    ) in r.format()
    half = dataclasses.replace(
        groups, collectives=(dataclasses.replace(groups.collectives[0], hidden_s=1e-3),)
    )
    assert dataclasses.replace(r, estimate=half).figures()["dp_sync_overlapped"] is False


def test_the_ends_are_charged_in_the_ticks_that_run_them():
    """``post`` (the loss head) runs in the last stage's F of the last chunk and ``pre``'s
    backward in the first stage's B of chunk 0: the estimate charges them there, not with
    every F or B (interleaved: half of the last stage's forwards have no head)."""
    from jax_wgrad.aot.compile import table_busy
    from jax_wgrad.parallel.schedules import get_schedule

    for t in (get_schedule("1f1b-paired", 2, 4, 2), get_schedule("1f1b", 4, 8)):
        busy, last, v = table_busy(t), t.num_stages - 1, t.num_chunks
        posts = pres = 0
        for tick in range(t.num_ticks):
            for s in range(t.num_stages):
                f, fc = t.forward[tick, s], t.forward_chunk[tick, s]
                b, bc = t.backward[tick, s], t.backward_chunk[tick, s]
                assert busy("post", tick, s) == (s == last and f >= 0 and fc == v - 1)
                assert busy("pre_backward", tick, s) == (s == 0 and b >= 0 and bc == 0)
                posts += busy("post", tick, s)
                pres += busy("pre_backward", tick, s)
        assert posts == pres == t.num_microbatches


_RAGGED = """\
HloModule m, is_scheduled=true

ENTRY %main (x: bf16[1024,64], w: bf16[4,128,64], g: s32[4], dy: bf16[1024,128], \
b: f32[4,128,64], i: s32[]) -> f32[4,128,64] {
  %x = bf16[1024,64]{1,0} parameter(0)
  %w = bf16[4,128,64]{2,1,0} parameter(1)
  %g = s32[4]{0} parameter(2)
  %dy = bf16[1024,128]{1,0} parameter(3)
  %b = f32[4,128,64]{2,1,0} parameter(4)
  %i = s32[] parameter(5)
  %y = bf16[1024,128]{1,0} custom-call(%x, %w, %g), \
custom_call_target="jax_wgrad_ragged_matmul", api_version=API_VERSION_TYPED_FFI
  ROOT %a = f32[4,128,64]{2,1,0} custom-call(%x, %dy, %g, %b, %i), \
custom_call_target="jax_wgrad_ragged_wgrad_accumulate", \
output_to_operand_aliasing={{}: (3, {})}, api_version=API_VERSION_TYPED_FFI
}
"""


@pytest.mark.parametrize("fill", [1.0, 0.25])
def test_ragged_gemms_are_charged_for_the_routed_rows_their_time_plus_their_bytes(fill):
    """A ragged grouped GEMM: the FLOPs and row bytes of ``fill`` of its rows, the expert
    weights (the wgrad's G fp32 blocks read and written) in full; GEMM time PLUS bytes
    time (:func:`~jax_wgrad.aot.estimate.grouped_gemm_cost`)."""
    cost = est.ModuleCosts(_RAGGED, PEAKS, ragged_fill=fill).computation("main")
    rows = 1024 * fill
    fwd_flops, wgrad_flops = 2 * rows * 64 * 128, 2 * rows * 64 * 128
    fwd_bytes = rows * (64 + 128) * 2 + 4 * 128 * 64 * 2
    wgrad_bytes = rows * (64 + 128) * 2 + 2 * 4 * 128 * 64 * 4  # every block read + written
    assert cost.flops == fwd_flops + wgrad_flops
    assert cost.hbm_bytes == pytest.approx(fwd_bytes + wgrad_bytes)
    assert cost.compute_s == pytest.approx((fwd_flops + wgrad_flops) / 1e12)
    assert cost.memory_s == pytest.approx((fwd_bytes + wgrad_bytes) / 1e9)  # not max(...)
    assert cost.seconds == pytest.approx(cost.compute_s + cost.memory_s)


@pytest.mark.parametrize("fill", [0.0, 1.5, float("nan")])
def test_a_fill_outside_zero_one_is_refused(fill):
    with pytest.raises(ValueError, match=r"ragged_fill must be in \(0, 1\]"):
        est.ModuleCosts(_RAGGED, PEAKS, ragged_fill=fill)


@pytest.mark.parametrize(
    "op_name,kw,part",
    [
        ("jit(step)/jvp(moe)/experts/dot_general", dict(gemm=True), "expert GEMMs"),
        ("jit(step)/transpose(jvp(moe))/experts/mul", {}, "expert activation"),
        ("jit(step)/transpose(jvp(moe))/dispatch/gather", {}, "permute / unpermute"),
        ("jit(step)/jvp(moe)/combine/all_to_all", dict(collective=True), "expert exchanges"),
        ("jit(step)/jvp(moe)/router/softmax", {}, "router"),
        ("jit(step)/jvp(attention)/core_attention/exp", {}, "attention core"),
        ("jit(step)/jvp(attention)/column_parallel_linear/dot", dict(gemm=True), "attention GEMMs"),
        ("jit(step)/jvp(attention)/rms_norm/mul", {}, "attention other"),
        (
            "jit(step)/jvp(attention)/all_gather",
            dict(collective=True),
            "tensor-parallel collectives",
        ),
        ("jit(step)/transpose(jvp(mlp))/dot", dict(gemm=True), "dense MLP"),
        ("jit(step)/optimizer/mul", {}, "optimizer"),
        (
            "jit(step)/grad_sync_in_cooldown/reduce_scatter",
            dict(collective=True),
            "data-parallel gradient sync",
        ),
        ("jit(step)/send_recv/ppermute", dict(collective=True), "pipeline sends"),
        ("jit(step)/jvp(output_layer)/dot", dict(gemm=True), "embedding, output layer, loss"),
        ("jit(step)/while/body/copy", dict(copy=True), "copies"),
        ("jit(step)/while/body/add", {}, "other"),
        ("jit(step)/jvp(moe_x)/add", {}, "other"),  # a scope is a whole name
    ],
)
def test_part_of_reads_the_named_scopes(op_name, kw, part):
    assert est.part_of(op_name, **kw) == part
    assert part in est.PARTS


def test_the_parts_add_up_to_the_step():
    """Every kernel's time lands in one part (:attr:`~jax_wgrad.aot.estimate.Cost.parts`),
    so the breakdown sums to the estimate, loops times their trip counts."""
    text = _MODULE.replace(
        "kind=kCustom, calls=%gemm",
        'kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/jvp(moe)/experts/dot_general"}',
    )
    step = est.estimate_step(text, PEAKS, hosts=(0, 0))
    parts = step.time_by_part()
    assert sum(parts.values()) == pytest.approx(step.seconds)
    assert parts["expert GEMMs"] == pytest.approx(
        max(2 * 64 * 128 * 256 / 1e12, (64 * 128 + 128 * 256 + 64 * 256) * 2 / 1e9)
    )
    assert parts["data-parallel gradient sync"] == pytest.approx(4000 / 1e8)  # the all-reduce
    assert parts["tensor-parallel collectives"] == pytest.approx(4000 / 1e8)  # the all-gather
    assert parts["other"] == pytest.approx(4 * 8000 / 1e9)  # 3 loop iterations, the branch


_WRAPPED = """\
HloModule m, is_scheduled=true

%dynamic-slice-fusion (p0: bf16[2,1024,64], p1: s32[], p2: bf16[1024,128], p3: s32[4], \
p4: f32[4,128,64], p5: s32[]) -> f32[4,128,64] {
  %p0 = bf16[2,1024,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,64]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,64}
  %xs = bf16[1024,64]{1,0} bitcast(%ds)
  %p2 = bf16[1024,128]{1,0} parameter(2)
  %p3 = s32[4]{0} parameter(3)
  %p4 = f32[4,128,64]{2,1,0} parameter(4)
  %p5 = s32[] parameter(5)
  ROOT %a = f32[4,128,64]{2,1,0} custom-call(%xs, %p2, %p3, %p4, %p5), \
custom_call_target="jax_wgrad_ragged_wgrad_accumulate", \
output_to_operand_aliasing={{}: (3, {})}, api_version=API_VERSION_TYPED_FFI, \
metadata={op_name="jit(step)/transpose(jvp(moe))/experts/ragged_wgrad_accumulate"}
}

ENTRY %main (x: bf16[2,1024,64], k: s32[], dy: bf16[1024,128], g: s32[4], \
b: f32[4,128,64], i: s32[]) -> f32[4,128,64] {
  %x = bf16[2,1024,64]{2,1,0} parameter(0)
  %k = s32[] parameter(1)
  %dy = bf16[1024,128]{1,0} parameter(2)
  %g = s32[4]{0} parameter(3)
  %b = f32[4,128,64]{2,1,0} parameter(4)
  %i = s32[] parameter(5)
  ROOT %f = f32[4,128,64]{2,1,0} fusion(%x, %k, %dy, %g, %b, %i), kind=kCustom, \
calls=%dynamic-slice-fusion
}
"""


def test_a_dynamic_slice_fusion_is_its_custom_call_in_its_part():
    """XLA:GPU's dynamic-slice fusion around the expert wgrad (no ``op_name`` of its own)
    costs the call's GEMM and bytes and counts in the call's part."""
    cost = est.ModuleCosts(_WRAPPED, PEAKS).computation("main")
    assert cost.flops == 2 * 1024 * 64 * 128
    assert dict(cost.parts) == {"expert GEMMs": pytest.approx(cost.seconds)}


@pytest.mark.parametrize(
    "config,causal",
    [
        ('{"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}', True),  # jax 0.12
        ('{"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}', True),
        ('{"cudnn_fmha_backend_config": {"mask_type": "PADDING_CAUSAL"}}', True),
        ('{"cudnn_fmha_backend_config": {"mask_type": "NO_MASK"}}', False),
    ],
)
def test_cudnn_attention_flops_halved_under_a_causal_mask(config, causal):
    text = f"""\
HloModule m, is_scheduled=true

ENTRY %main (q: bf16[2,64,8,16], k: bf16[2,64,2,16], v: bf16[2,64,2,16]) -> bf16[2,8,64,16] {{
  %q = bf16[2,64,8,16]{{3,2,1,0}} parameter(0)
  %k = bf16[2,64,2,16]{{3,2,1,0}} parameter(1)
  %v = bf16[2,64,2,16]{{3,2,1,0}} parameter(2)
  %a = (bf16[2,8,64,16]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), \
custom_call_target="__cudnn$fmhaSoftmax", backend_config={config}
  ROOT %o = bf16[2,8,64,16]{{3,1,2,0}} get-tuple-element(%a), index=0
}}
"""
    cost = est.ModuleCosts(text, PEAKS).computation("main")
    full = 4.0 * 2 * 8 * 64 * 64 * 16  # 4 b h s_q s_kv d
    assert cost.flops == (full / 2 if causal else full)


# FP8 (Megatron's --fp8-format hybrid): forward and input-gradient GEMMs are cuBLASLt FP8
# matmuls (XLA's rewrite, xla_gpu_enable_triton_gemm=false), weight gradients the library's
# FP8 FFI calls with their CUDA results (the cuBLASLt workspace, the u8 scratch).
FP8_PEAKS = dataclasses_replace(
    PEAKS,
    tensor_flops={"bf16": 1e12, "f8": 2e12, "f32": 5e11},
    hbm_bandwidth=1e15,  # every GEMM below FLOP-bound
    gemm_efficiency=0.8,
    f8_gemm_efficiency=0.5,
)


def _fp8_gemm_module(lhs: str = "f8e4m3fn") -> str:
    """A bf16 activation quantized to ``lhs`` by a convert fusion, then ``[64, 128] x
    [256, 128]^T`` in a cuBLASLt FP8 matmul with its two f32 scales (a bf16 result and the
    cuBLAS workspace)."""
    return f"""\
HloModule m, is_scheduled=true

%convert (p: bf16[64,128]) -> {lhs}[64,128] {{
  %p = bf16[64,128]{{1,0}} parameter(0)
  ROOT %c = {lhs}[64,128]{{1,0}} convert(%p)
}}

ENTRY %main (a: bf16[64,128], w: f8e4m3fn[256,128], sa: f32[], sw: f32[]) -> bf16[64,256] {{
  %a = bf16[64,128]{{1,0}} parameter(0)
  %w = f8e4m3fn[256,128]{{1,0}} parameter(1)
  %sa = f32[] parameter(2)
  %sw = f32[] parameter(3)
  %loop_convert_fusion = {lhs}[64,128]{{1,0}} fusion(%a), kind=kLoop, calls=%convert
  %cublas-gemm.1 = (bf16[64,256]{{1,0}}, s8[4194304]{{0}}) custom-call(%loop_convert_fusion, \
%w, %sa, %sw), custom_call_target="__cublas$lt$matmul$f8", \
backend_config={{"gemm_backend_config":{{"alpha_real":1,"dot_dimension_numbers":\
{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],\
"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}}}}, \
metadata={{op_name="jit(step)/jvp(mlp)/column_parallel_linear/dot_general"}}
  ROOT %o = bf16[64,256]{{1,0}} get-tuple-element(%cublas-gemm.1), index=0
}}
"""


@pytest.mark.parametrize("lhs", ["f8e4m3fn", "f8e5m2"])  # hybrid: dgrad's dy is E5M2
def test_an_fp8_cublas_gemm_is_charged_at_the_fp8_sustained_rate(lhs):
    from jax_wgrad.aot import hlo

    mc = est.ModuleCosts(_fp8_gemm_module(lhs), FP8_PEAKS)
    (gemm,) = [i for i in hlo.instructions(mc.comps[mc.entry]) if i.opcode == "custom-call"]
    flops = 2 * 64 * 256 * 128  # 2 M N K
    assert mc._custom_call(gemm)[:2] == (flops, lhs)
    cost = mc.kernel(gemm)
    assert cost.flops == cost.fp8_flops == flops
    assert cost.compute_s == pytest.approx(flops / (2e12 * 0.5))  # not bf16's 0.8
    assert mc.fp8_gemms == {"cublas-gemm.1": "__cublas$lt$matmul$f8"}
    assert dict(cost.parts) == {"dense MLP": pytest.approx(cost.seconds)}


def test_the_fp8_efficiency_of_the_targets():
    """FP8 at its own sustained fraction (published, below BF16's measured one); a
    :class:`Peaks` without one runs FP8 at :attr:`Peaks.gemm_efficiency`."""
    h100 = est.PEAKS["h100"]
    assert h100.sustained_gemm_flops("f8e4m3fn") == pytest.approx(1304.5e12)
    assert h100.sustained_gemm_flops("f8e5m2") == h100.sustained_gemm_flops("f8e4m3fn")
    assert h100.sustained_gemm_flops("bf16") == pytest.approx(798e12)
    assert h100.f8_gemm_efficiency < h100.gemm_efficiency
    assert est.PEAKS["h200"].f8_gemm_efficiency == h100.f8_gemm_efficiency
    plain = dataclasses_replace(FP8_PEAKS, f8_gemm_efficiency=None)
    assert plain.sustained_gemm_flops("f8e4m3fn") == pytest.approx(2e12 * 0.8)


def _fp8_wgrad_module(target: str, config: str, *, staged: bool) -> str:
    """One FP8 weight-gradient call as the CUDA lowering writes it: ``x f8e4m3fn[512, 64]``,
    ``dy f8e5m2[512, 128]``, a flat f32 bucket aliased to result 0, the two scales
    (``_at``: and the index), the workspace and the scratch (its staging slot when
    ``staged``) as results 1 and 2."""
    from jax_wgrad.ops import fp8
    from jax_wgrad.ops.wgrad import WORKSPACE

    scratch = fp8.cuda_scratch_bytes(512, 64, 128, staged=staged)
    at = target.endswith("_at")
    params = ", i: s32[]" if at else ""
    index = ", %i" if at else ""
    results = f"(f32[100000]{{0}}, u8[{WORKSPACE.shape[0]}]{{0}}, u8[{scratch}]{{0}})"
    return f"""\
HloModule m, is_scheduled=true

ENTRY %main (x: f8e4m3fn[512,64], dy: f8e5m2[512,128], g: f32[100000], sx: f32[], \
sy: f32[]{params}) -> f32[100000] {{
  %x = f8e4m3fn[512,64]{{1,0}} parameter(0)
  %dy = f8e5m2[512,128]{{1,0}} parameter(1)
  %g = f32[100000]{{0}} parameter(2)
  %sx = f32[] parameter(3)
  %sy = f32[] parameter(4)
  {"%i = s32[] parameter(5)" if at else ""}
  %w = {results} custom-call(%x, %dy, %g, %sx, %sy{index}), custom_call_target="{target}", \
output_to_operand_aliasing={{{{0}}: (2, {{}})}}, api_version=API_VERSION_TYPED_FFI, \
metadata={{op_name="jit(step)/transpose(jvp(mlp))/row_parallel_linear/fp8_wgrad_accumulate"}}, \
backend_config={{{config}}}
  ROOT %o = f32[100000]{{0}} get-tuple-element(%w), index=0
}}
"""


@pytest.mark.parametrize(
    "target,config,staged",
    [
        ("jax_wgrad_fp8_wgrad_accumulate", "offset = 2048 : i64", False),  # 16-byte aligned
        ("jax_wgrad_fp8_wgrad_accumulate", "offset = 6 : i64", True),  # not: staged
        ("jax_wgrad_fp8_wgrad_accumulate_at", "base = 0 : i64, stride = 8192 : i64", True),
    ],
)
def test_the_fp8_wgrad_call_flops_and_bytes(target, config, staged):
    """``2 T in out`` FLOPs at the FP8 rate; bytes: the fp8 operands read, transposed into
    scratch and read again (``3 T (in + out)``), the fp32 ``[out, in]`` block read and
    written, and where the CUDA handler stages it (its scratch holds the slot) once more."""
    mc = est.ModuleCosts(_fp8_wgrad_module(target, config, staged=staged), FP8_PEAKS)
    cost = mc.computation("main")
    t, d_in, d_out = 512, 64, 128
    flops = 2 * t * d_in * d_out
    nbytes = 3 * t * (d_in + d_out) + (4 if staged else 2) * 4 * d_out * d_in
    assert cost.flops == cost.fp8_flops == flops
    assert cost.hbm_bytes == nbytes == est.fp8_wgrad_bytes(t, d_in, d_out, staged=staged)
    assert cost.compute_s == pytest.approx(flops / (2e12 * 0.5))
    assert mc.fp8_gemms == {"w": target}
    assert dict(cost.parts) == {"dense MLP": pytest.approx(cost.seconds)}


def test_the_report_gives_the_fp8_gemms_and_the_mfu_convention():
    """With FP8 GEMMs the figures and the printed report give their number (by target) and
    share of the counted FLOPs, and say the MFU is against the BF16 peak; without them,
    no line and a share of 0."""
    import dataclasses

    from test_aot import _report

    # a bf16 dot fusion (_MODULE's), one cuBLASLt FP8 matmul and one FP8 wgrad call
    fp8 = _fp8_gemm_module().replace("ENTRY %main", "%fwd").replace("ROOT %o", "ROOT %o1")
    wgrad = _fp8_wgrad_module("jax_wgrad_fp8_wgrad_accumulate", "offset = 0 : i64", staged=False)
    text = (
        _MODULE.split("ENTRY %main")[0]
        + fp8.split("is_scheduled=true\n")[1]
        + wgrad.split("is_scheduled=true\n")[1].replace(
            "ROOT %o = f32[100000]{0} get-tuple-element(%w), index=0",
            "%o = f32[100000]{0} get-tuple-element(%w), index=0\n"
            "  %a = bf16[64,128]{1,0} parameter(5)\n"
            "  %b = bf16[128,256]{1,0} parameter(6)\n"
            "  %sa = f32[] parameter(7)\n"
            "  %wf = f8e4m3fn[256,128]{1,0} parameter(8)\n"
            "  %d = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm\n"
            "  %f = bf16[64,256]{1,0} call(%a, %wf, %sa, %sa), to_apply=%fwd\n"
            "  ROOT %t = (f32[100000]{0}, bf16[64,256]{1,0}, bf16[64,256]{1,0}) "
            "tuple(%o, %d, %f)",
        )
    )
    h100 = est.PEAKS["h100"]
    e = est.estimate_step(text, h100, model_flops=1e9)
    bf16_flops, fp8_flops = 2 * 64 * 128 * 256, 2 * 64 * 256 * 128 + 2 * 512 * 64 * 128
    assert e.cost.flops == bf16_flops + fp8_flops
    fig = e.figures()
    assert fig["fp8_gemm_calls"] == 2
    assert fig["fp8_gemm_calls_by_target"] == {
        "__cublas$lt$matmul$f8": 1,
        "jax_wgrad_fp8_wgrad_accumulate": 1,
    }
    assert fig["estimated_fp8_gemm_share"] == pytest.approx(fp8_flops / (bf16_flops + fp8_flops))
    assert fig["estimated_mfu_peak_flops"] == 989.4e12
    assert e.mfu == pytest.approx(1e9 / (e.seconds * 989.4e12))  # the BF16 peak, not FP8's
    r = dataclasses.replace(_report(None), estimate=e)
    assert r.figures()["fp8_gemm_calls"] == 2
    out = r.format()
    assert (
        "FP8 GEMMs: 2 kernels in the program (__cublas$lt$matmul$f8 1, "
        "jax_wgrad_fp8_wgrad_accumulate 1), 75.0% of the busiest stage's counted FLOPs (GEMMs, "
        "attention), charged at 1304 TFLOP/s sustained (FP8 peak 1978.9)"
    ) in out
    assert "MFU is model FLOPs over the BF16 dense peak (989.4 TFLOP/s)" in out

    plain = est.estimate_step(_MODULE, h100, hosts=(0, 0))
    assert plain.figures()["fp8_gemm_calls"] == 0
    assert plain.figures()["estimated_fp8_gemm_share"] == 0.0
    assert "FP8 GEMMs" not in dataclasses.replace(_report(None), estimate=plain).format()
