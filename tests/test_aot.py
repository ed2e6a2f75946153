"""Compiling the train step for GPUs without one (:mod:`jax_wgrad.aot`).

Tests marked ``aot`` compile for H100s with jax's CUDA plugin (no GPU, no driver) and skip
with the reason where the plugin is not usable: those compiling in this process need the
session started with ``JAX_PLATFORMS=cpu``; the production-size one runs the example in a
process of its own, which sets that up itself. The others check the text analyses on
CPU-compiled HLO and on small hand-written HLO/thunk texts, and run everywhere.
"""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jax_wgrad import (
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    default_optimizer,
    fusion_available,
    make_mesh,
    wgrad_accumulate,
)
from jax_wgrad.aot import gpu_target, hlo, thunks
from jax_wgrad.ops import handlers

# --------------------------------------------------------------- everywhere (text analyses)

N = 1 << 16  # a "bucket"


def _loop_hlo(update) -> str:
    def f(b, xs):
        return lax.scan(lambda b, x: (update(b, x), None), b, xs)[0]

    args = (jnp.zeros(N, jnp.float32), jnp.ones((3, 8, 16), jnp.float32))
    return jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()


def _fused_update(b, x):
    acc = lax.dynamic_slice(b, (128,), (16 * 16,)).reshape(16, 16)
    return lax.dynamic_update_slice(b, wgrad_accumulate(x, x, acc).ravel(), (128,))


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_schedule_loop_and_custom_call_aliasing_on_cpu_hlo():
    text = _loop_hlo(
        lambda b, x: b.at[:256].add(
            wgrad_accumulate(x, x, jnp.zeros((16, 16), jnp.float32)).ravel()
        )
    )
    name, body = hlo.schedule_loop(text, [N])
    assert name and body in hlo.computations(text)
    calls = hlo.custom_calls(text, handlers.TARGET)
    assert calls and all(hlo.aliased(c) for c in calls)
    assert hlo.schedule_loop(text, [N + 1]) is None  # no loop carries such an array


def test_bucket_sized_kernel_in_loop_is_found():
    comps_of = lambda t: (hlo.computations(t), hlo.schedule_loop(t, [N]))
    comps, (_, body) = comps_of(_loop_hlo(lambda b, x: b * 1.5 + x.sum()))
    found = hlo.sized_ops(comps, hlo.reachable(comps, body), [N])
    assert found and all(f"f32[{N}]" in i.shape for i in found), found

    # A traced-offset block update: XLA:CPU updates in place, no bucket-sized kernel.
    def block(b, x):
        o = (x[0, 0] > 0).astype(jnp.int32) * 512
        return lax.dynamic_update_slice(b, lax.dynamic_slice(b, (o,), (128,)) + x.ravel(), (o,))

    comps, (_, body) = comps_of(_loop_hlo(block))
    assert [
        i for i in hlo.sized_ops(comps, hlo.reachable(comps, body), [N]) if i.opcode == "copy"
    ] == []


def test_16bit_scatter_is_found():
    # XLA:CPU upcasts 16-bit scatters itself (XLA:GPU does not): a GPU-style line.
    line = (
        "  %input_scatter_fusion = bf16[256,2048]{1,0} scatter(%p0, %p1, %p2), "
        "update_window_dims={1}, to_apply=%add"
    )
    assert [i.name for i in hlo.scatters_16bit(line)] == ["input_scatter_fusion"]
    ids = jnp.arange(64) % 7
    text = (
        jax.jit(lambda t, g: t.at[ids].add(g))
        .lower(jnp.zeros((16, 8), jnp.float32), jnp.ones((64, 8), jnp.float32))
        .compile()
        .as_text()
    )
    assert "scatter(" in text and hlo.scatters_16bit(text) == []


# The HLO and thunk-sequence fixtures below are XLA's text, one instruction (or thunk) a
# line; a line over the length limit is continued with a backslash-newline, which the
# string does not contain.
_SCHEDULED = """\
HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %collective-permute-start = ((f32[8]{0}), f32[8]{0}) collective-permute-start(%p), \
channel_id=1, source_target_pairs={{0,1}}, \
metadata={op_name="jit(step)/while/body/send_recv/ppermute"}
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %collective-permute-done = f32[8]{0} collective-permute-done(%collective-permute-start), \
metadata={op_name="jit(step)/while/body/send_recv/ppermute"}
  %reduce-scatter-start = ((f32[8]{0}), f32[4]{0}) reduce-scatter-start(%fusion.1), \
metadata={op_name="jit(step)/while/body/grad_sync_in_cooldown/reduce_scatter"}
  %reduce-scatter-done = f32[4]{0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce.2 = f32[8]{0} all-reduce(%collective-permute-done), to_apply=%add
  ROOT %copy.1 = f32[8]{0} copy(%all-reduce.2)
}
"""


def test_async_collectives_and_what_runs_between():
    comps = hlo.computations(_SCHEDULED)
    found = {c.kind: c for c in hlo.async_collectives(comps)}
    permute = found["collective-permute"]
    assert permute.compute_between == ("fusion.1",)  # an elementwise fusion only
    assert not permute.overlapped and permute.memory_bound_only
    assert "send_recv" in permute.op_name
    assert not found["reduce-scatter"].overlapped
    assert not found["reduce-scatter"].memory_bound_only  # nothing at all between
    assert [i.name for i in hlo.sync_collectives(comps)] == ["all-reduce.2"]


# The cooldown grad sync as XLA:GPU schedules it (H100 compile of Llama-3-8B TP2 PP2, the
# grad_sync_in_cooldown branch): each bucket's reduce-scatter is in flight while the next
# bucket's 1/dp multiply runs -- memory-bound kernels of the same branch, no GEMM -- and a
# pipeline permute in flight while a GEMM (a Triton GEMM fusion) runs.
_COOLDOWN = """\
HloModule m, is_scheduled=true

%fused_multiply (param_0: f32[64]) -> f32[64] {
  %param_0 = f32[64]{0} parameter(0)
  %c = f32[] constant(0.5)
  %b = f32[64]{0} broadcast(%c), dimensions={}
  ROOT %m = f32[64]{0} multiply(%param_0, %b)
}

%gemm_computation (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %d = bf16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%async_computation (p: f32[64]) -> f32[32] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[32]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

%async_computation.1 (p: f32[64]) -> f32[32] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[32]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

%sync_branch (param.1: (f32[64], f32[64])) -> (f32[32], f32[32]) {
  %param.1 = (f32[64]{0}, f32[64]{0}) parameter(0)
  %loop_multiply_fusion = f32[64]{0} fusion(%param.1#0), kind=kLoop, calls=%fused_multiply
  %reduce-scatter-start = ((f32[64]{0}), f32[32]{0}) async-start(%loop_multiply_fusion), \
calls=%async_computation, \
metadata={op_name="jit(step)/while/body/grad_sync_in_cooldown/cond/branch_1_fun/reduce_scatter"}
  %loop_multiply_fusion.1 = f32[64]{0} fusion(%param.1#1), kind=kLoop, calls=%fused_multiply
  %reduce-scatter-done = f32[32]{0} async-done(%reduce-scatter-start)
  %reduce-scatter-start.1 = ((f32[64]{0}), f32[32]{0}) async-start(%loop_multiply_fusion.1), \
calls=%async_computation.1, \
metadata={op_name="jit(step)/while/body/grad_sync_in_cooldown/cond/branch_1_fun/reduce_scatter"}
  %reduce-scatter-done.1 = f32[32]{0} async-done(%reduce-scatter-start.1)
  ROOT %t = (f32[32]{0}, f32[32]{0}) tuple(%reduce-scatter-done, %reduce-scatter-done.1)
}

ENTRY %main (a: bf16[8,8], g: (f32[64], f32[64])) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %g = (f32[64]{0}, f32[64]{0}) parameter(1)
  %collective-permute-start = ((bf16[8,8]{1,0}), bf16[8,8]{1,0}) collective-permute-start(%a), \
source_target_pairs={{0,1}}, metadata={op_name="jit(step)/while/body/send_recv/ppermute"}
  %gemm_fusion = bf16[8,8]{1,0} fusion(%a, %a), kind=kCustom, calls=%gemm_computation
  %collective-permute-done = bf16[8,8]{1,0} collective-permute-done(%collective-permute-start)
  %p = pred[] constant(true)
  %conditional = (f32[32]{0}, f32[32]{0}) conditional(%p, %g, %g), \
true_computation=%sync_branch, false_computation=%sync_branch, \
metadata={op_name="jit(step)/while/body/grad_sync_in_cooldown/cond"}
  ROOT %r = bf16[8,8]{1,0} add(%gemm_fusion, %collective-permute-done)
}
"""


def test_reduce_scatters_beside_memory_bound_kernels_are_not_overlapped():
    from jax_wgrad.aot.report import COLLECTIVE_GROUPS, collectives

    comps = hlo.computations(_COOLDOWN)
    found = {c.start.name: c for c in hlo.async_collectives(comps)}
    first = found["reduce-scatter-start"]
    assert first.compute_between == ("loop_multiply_fusion.1",)
    assert first.gemms_between == () and not first.overlapped and first.memory_bound_only
    permute = found["collective-permute-start"]
    assert permute.gemms_between == ("gemm_fusion",) and permute.overlapped
    groups = {c.group: c for c in collectives(comps)}
    sync = groups[COLLECTIVE_GROUPS["grad_sync_in_cooldown"]]
    assert (sync.total, sync.asynchronous, sync.overlapped, sync.memory_bound_only) == (2, 2, 0, 1)
    assert sync.format().endswith(
        "not overlapped with compute: only memory-bound kernels run while they are in flight"
    )
    assert groups["pipeline permutes"].format().endswith(": all overlapped with compute")


# A tick of a schedule loop as XLA:GPU compiles it, with the traffic of each kernel known:
#   forward (busy): a zero-fill f32[1024] (4096 B written), an fp32->bf16 weight cast
#     f32[64,64] -> bf16[64,64] (16384 read + 8192 written), a Triton GEMM fusion and a
#     custom call (not counted);
#   backward (busy): a loop of 3 iterations copying f32[256] (2 x 1024 B each);
#   every tick: a dynamic-update-slice of a bf16 [64,64] slot, read through a dynamic slice
#     of a [2,64,64] stash, into a f32[16384] buffer in place (8192 read + 16384 written +
#     the s32 offset 4), and a collective-permute (not counted).
_TICK = """\
HloModule m, is_scheduled=true

%fused_zero () -> f32[1024] {
  %c = f32[] constant(0)
  ROOT %b = f32[1024]{0} broadcast(%c), dimensions={}
}

%fused_convert (param_0: f32[64,64]) -> bf16[64,64] {
  %param_0 = f32[64,64]{1,0} parameter(0)
  ROOT %cv = bf16[64,64]{1,0} convert(%param_0)
}

%gemm_computation (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %d = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_dus (param_0: f32[16384], param_1: bf16[2,64,64], param_2: s32[]) -> f32[16384] {
  %param_0 = f32[16384]{0} parameter(0)
  %param_1 = bf16[2,64,64]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,64]{2,1,0} dynamic-slice(%param_1, %param_2, %zero, %zero), \
dynamic_slice_sizes={1,64,64}
  %cv = f32[1,64,64]{2,1,0} convert(%ds)
  %flat = f32[4096]{0} bitcast(%cv)
  %offset = s32[] multiply(%param_2, %param_2)
  ROOT %u = f32[16384]{0} dynamic-update-slice(%param_0, %flat, %offset)
}

%fwd_busy (p: (f32[64,64], bf16[64,64])) -> (f32[1024], bf16[64,64]) {
  %p = (f32[64,64]{1,0}, bf16[64,64]{1,0}) parameter(0)
  %loop_broadcast_fusion = f32[1024]{0} fusion(), kind=kLoop, calls=%fused_zero
  %loop_convert_fusion = bf16[64,64]{1,0} fusion(%p#0), kind=kLoop, calls=%fused_convert
  %gemm_fusion = bf16[64,64]{1,0} fusion(%loop_convert_fusion, %p#1), kind=kCustom, \
calls=%gemm_computation
  %cc = bf16[64,64]{1,0} custom-call(%gemm_fusion), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %t = (f32[1024]{0}, bf16[64,64]{1,0}) tuple(%loop_broadcast_fusion, %cc)
}

%fwd_idle (p: (f32[64,64], bf16[64,64])) -> (f32[1024], bf16[64,64]) {
  %p = (f32[64,64]{1,0}, bf16[64,64]{1,0}) parameter(0)
  %z = f32[1024]{0} constant({...})
  %w = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  ROOT %t = (f32[1024]{0}, bf16[64,64]{1,0}) tuple(%z, %w)
}

%layer_body (q: (s32[], f32[256])) -> (s32[], f32[256]) {
  %q = (s32[], f32[256]{0}) parameter(0)
  %x = f32[256]{0} get-tuple-element(%q), index=1
  %copy.3 = f32[256]{0} copy(%x)
  %i = s32[] get-tuple-element(%q), index=0
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %copy.3)
}

%layer_cond (q: (s32[], f32[256])) -> pred[] {
  %q = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%bwd_busy (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  ROOT %while.2 = (s32[], f32[256]{0}) while(%p), condition=%layer_cond, \
body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
}

%bwd_idle (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  ROOT %p = (s32[], f32[256]{0}) parameter(0)
}

%tick (param.1: (f32[16384], bf16[2,64,64], s32[], (f32[64,64], bf16[64,64]), \
(s32[], f32[256]))) -> f32[16384] {
  %param.1 = (f32[16384]{0}, bf16[2,64,64]{2,1,0}, s32[], (f32[64,64]{1,0}, bf16[64,64]{1,0}), \
(s32[], f32[256]{0})) parameter(0)
  %pred = pred[] constant(false)
  %conditional.1 = (f32[1024]{0}, bf16[64,64]{1,0}) conditional(%pred, %param.1#3, %param.1#3), \
true_computation=%fwd_idle, false_computation=%fwd_busy, \
metadata={op_name="jit(step)/while/body/forward/cond"}
  %conditional.2 = (s32[], f32[256]{0}) conditional(%param.1#2, %param.1#4, %param.1#4), \
branch_computations={%bwd_idle, %bwd_busy}, metadata={op_name="jit(step)/while/body/backward/cond"}
  %loop_dynamic_update_slice_fusion = f32[16384]{0} fusion(%param.1#0, %param.1#1, %param.1#2), \
kind=kLoop, calls=%fused_dus
  %cp = bf16[64,64]{1,0} collective-permute(%param.1#1), source_target_pairs={{0,1}}
  ROOT %r = f32[16384]{0} copy(%loop_dynamic_update_slice_fusion)
}
"""


def test_non_gemm_traffic_of_a_tick_by_task_and_kind():
    tick = hlo.loop_traffic(_TICK, "tick")
    # the copy at the root (2 x 65536 B) and the in-place dynamic-update-slice
    assert tick.overhead == hlo.Traffic(copy=2 * 65536, dynamic_update_slice=8192 + 16384 + 4)
    assert set(tick.tasks) == {"forward", "backward"}
    idle, busy = tick.tasks["forward"]
    assert idle == hlo.Traffic() and busy == hlo.Traffic(fusion=16384 + 8192, memset=4096)
    idle, busy = tick.tasks["backward"]
    assert idle == hlo.Traffic() and busy == hlo.Traffic(copy=3 * 2 * 1024)
    assert busy.total == 6144 and tick.unknown_trip_loops == 0
    comps = hlo.computations(_TICK)
    gemm = next(i for i in hlo.instructions(comps["fwd_busy"]) if i.name == "gemm_fusion")
    assert hlo.gemm_class(gemm, comps) and hlo.kernel_traffic(gemm, comps) is None
    # compiled.as_text() runs the dynamic-update-slice as an asynchronous fusion: the same
    dus = (
        "%loop_dynamic_update_slice_fusion = f32[16384]{0} fusion(%param.1#0, "
        "%param.1#1, %param.1#2), kind=kLoop, calls=%fused_dus"
    )
    started = (
        "%fusion-start = ((f32[16384]{0}, bf16[2,64,64]{2,1,0}, s32[]), f32[16384]{0}, "
        "u32[]) fusion-start(%param.1#0, %param.1#1, %param.1#2), kind=kLoop, "
        "calls=%fused_dus\n  %loop_dynamic_update_slice_fusion = f32[16384]{0} "
        "fusion-done(%fusion-start)"
    )
    assert dus in _TICK
    assert hlo.loop_traffic(_TICK.replace(dus, started), "tick").overhead == tick.overhead
    # a loop of unknown trip count: one iteration, its condition included, and said so
    unknown = _TICK.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    tick = hlo.loop_traffic(unknown, "tick")
    assert tick.tasks["backward"][1] == hlo.Traffic(copy=2 * 1024)
    assert tick.unknown_trip_loops == 1


def test_dynamic_update_slice_into_a_fresh_buffer_writes_all_of_it():
    text = """HloModule m

%fused (param_0: f32[64]) -> f32[1024] {
  %param_0 = f32[64]{0} parameter(0)
  %zero = f32[] constant(0)
  %fresh = f32[1024]{0} broadcast(%zero), dimensions={}
  %at = s32[] constant(128)
  ROOT %u = f32[1024]{0} dynamic-update-slice(%fresh, %param_0, %at)
}

ENTRY %main (x: f32[64]) -> f32[1024] {
  %x = f32[64]{0} parameter(0)
  ROOT %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused
}
"""
    comps = hlo.computations(text)
    fusion = hlo.instructions(comps["main"])[-1]
    assert hlo.kernel_traffic(fusion, comps) == ("fusion", 256 + 4096)


def test_shape_bytes():
    assert hlo.shape_bytes("f32[8,4]{1,0}") == 128
    assert hlo.shape_bytes("(bf16[2,3]{1,0}, s32[], /*index=2*/pred[4]{0})") == 12 + 4 + 4
    assert hlo.shape_bytes("f8e4m3fn[16]{0}") == 16 and hlo.shape_bytes("token[]") == 0


def test_non_gemm_traffic_of_a_cpu_compiled_scan():
    # A scan of 3 iterations: b * 1.5 over the carried f32[N] (a fusion reading and writing
    # 4 N bytes each), and a 128-float block written into a carried f32[2 N] buffer at a
    # traced offset (in place: 512 B read from xs, 512 B written -- not the 8 N bytes of
    # the buffer). What else runs is scalar bookkeeping (the counter, the offset).
    def f(b, c, xs):
        def body(carry, x):
            b, c, i = carry
            return (b * 1.5, lax.dynamic_update_slice(c, x * 2.0, (i * 128,)), i + 1), None

        return lax.scan(body, (b, c, jnp.int32(0)), xs)[0]

    text = (
        jax.jit(f, donate_argnums=(0, 1))
        .lower(
            jnp.zeros(N, jnp.float32),
            jnp.zeros(2 * N, jnp.float32),
            jnp.ones((3, 128), jnp.float32),
        )
        .compile()
        .as_text()
    )
    _, body = hlo.schedule_loop(text, [2 * N])
    tick = hlo.loop_traffic(text, body)
    scalars = 64  # a few s32 copies and adds
    assert 8 * N <= tick.overhead.fusion <= 8 * N + scalars
    assert 1024 <= tick.overhead.dynamic_update_slice <= 1024 + scalars
    assert tick.overhead.memset == 0 and tick.overhead.copy <= scalars
    assert tick.tasks == {}
    comps = hlo.computations(text)
    whole, unknown = hlo.computation_traffic(comps, hlo.entry_name(text))
    assert unknown == 0
    assert 3 * tick.overhead.total <= whole.total <= 3 * tick.overhead.total + 4 * scalars


def test_per_microbatch_cost_of_the_busiest_stage():
    from jax_wgrad.aot.compile import _per_microbatch
    from jax_wgrad.parallel.schedules import one_f_one_b

    table = one_f_one_b(2, 4)  # 2 stages, 4 microbatches
    t = table.num_ticks
    tasks = {
        "forward": (hlo.Traffic(fusion=1), hlo.Traffic(fusion=10)),
        "backward": (hlo.Traffic(), hlo.Traffic(copy=100)),
        "grad_sync_in_cooldown": (hlo.Traffic(), hlo.Traffic(memset=1000)),
    }
    got = _per_microbatch(hlo.Traffic(dynamic_update_slice=2), tasks, table, lambda x: x.total)
    # every stage runs 4 forwards, 4 backwards and its cooldown sync once
    want = hlo.Traffic(
        fusion=4 * 10 + (t - 4) * 1, copy=4 * 100, memset=1000, dynamic_update_slice=2 * t
    ) * (1 / 4)
    assert got == want
    launches = _per_microbatch(3, {"forward": (1, 5), "backward": (0, 7)}, table, float)
    assert launches == (3 * t + 4 * 5 + (t - 4) * 1 + 4 * 7) / 4


_THUNKS = """\
000: kCommandBuffer [source        | next=003 (1) ]
    001: kCustomKernel [source        | sink         ] loop_broadcast_fusion \
grid: [128, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    002: kCopy         [source        | sink         ] kCopy
003: kWhile         [prev=000 (1)  | next=000 (1) ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kAsyncStart   [source       | next=007 (4)] stream=computation_stream[1], async_id=5
        006: kDynamicSliceFusion [source | sink] params=1, results=1
            060: kCopy [source | sink] kCopy
    007: kAsyncDone    [source       | sink        ] async_id=5
    008: kConditional  [prev=007 (2) | next=009 (1)]
      false_branch:
        000: kCommandBuffer [source       | next=011 (1)]
            009: kCustomKernel [source | sink] fusion_a \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            010: kCuDnn        [prev=009 (1)  | next=011 (1)] kCuDnn
        011: kCustomCall    [prev=000 (1) | next=012 (3)] kCustomCall
        012: kWhile         [prev=011 (1) | sink ]
        condition:
            013: kCustomKernel [source | sink] loop_compare_fusion_2 \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            014: kCustomKernel [source | sink] inner \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      true_branch:
        No thunks.
    015: kConditional  [prev=008 (2) | sink]
      false_branch:
        016: kCustomCall    [source | sink] kCustomCall
      true_branch:
        No thunks.
000: kCommandBuffer [prev=003 (1) | sink        ]
    017: kCopy         [source        | sink         ] kCopy
"""
_META = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, n in [(3, "while.1"), (8, "cond.1"), (15, "cond.2")]
)


def test_thunk_sequence_launch_counts():
    seq = thunks.parse_thunks(_THUNKS)
    assert [t.kind for t in seq] == ["kCommandBuffer", "kWhile", "kCommandBuffer"]
    loop = seq[1]
    assert set(loop.nested) == {"condition", "body"}
    inner = thunks.find_thunk(seq, 12)
    assert inner.kind == "kWhile" and set(inner.nested) == {"condition", "body"}
    # once: 2 command buffers + the while (condition 1, body: async copy 1, busy branches
    # 1 graph + 1 custom call + inner while 2, and 1 custom call)
    assert thunks.launches(seq) == 2 + 1 + 1 + 4 + 1
    count = thunks.loop_launches(
        seq,
        thunks.thunk_names(_META),
        "while.1",
        {
            "cond.1": "jit(step)/while/body/forward/cond",
            "cond.2": "jit(step)/while/body/grad_sync_in_cooldown/cond",
        },
    )
    assert count.overhead == 2  # the condition's compare and the async slice copy
    assert count.tasks == {"forward": (0, 4), "grad_sync_in_cooldown": (0, 1)}
    assert count.tick("forward") == 6 and count.conditionals == 2
    # the cooldown's branch is busy once per step: not in the per-tick counts
    assert (
        count.command_buffers,
        count.kernels_in_command_buffers,
        count.custom_calls_outside,
    ) == (1, 2, 1)


def _nested_scan_hlo() -> str:
    # a scan over ticks whose body scans over layers, both carrying the bucket (the
    # pipeline's layer scan inside a tick); XLA:CPU prints the inner while first
    def f(b, xs):
        def tick(b, x):
            layer = lambda b, w: (b.at[:16].add(w.sum() * x.sum()), None)
            return lax.scan(layer, b, jnp.ones((3, 4), jnp.float32))[0], None

        return lax.scan(tick, b, xs)[0]

    args = (jnp.zeros(N, jnp.float32), jnp.ones((5, 8), jnp.float32))
    return jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()


def test_schedule_loop_is_the_outermost_loop_carrying_the_bucket():
    text = _nested_scan_hlo()
    comps = hlo.computations(text)
    name, body = hlo.schedule_loop(text, [N])
    trips = hlo.trip_counts(text)
    assert trips[name] == 5 and sorted(trips.values()) == [3, 5]
    inner = next(n for n in trips if n != name)
    # the tick loop's body reaches the layer loop, not the other way round
    assert any(inner in line for c in hlo.reachable(comps, body) for line in comps[c])
    assert hlo.schedule_loop(text, [N + 1]) is None


# XLA prints a while's "condition:" at column 0 however deep the while is nested (as in
# the H100 compile of the pipeline with a layer scan inside each tick).
_NESTED_THUNKS = """\
003: kWhile         [source | sink]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kCustomKernel [source | next=008 (1)] loop_dynamic_slice_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    008: kConditional  [prev=005 (1) | next=030 (1)]
      false_branch:
        009: kCustomKernel [source | next=020 (1)] fusion_a \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        020: kWhile         [prev=009 (1) | next=026 (1)]
condition:
            021: kCustomKernel [source | sink] loop_compare_fusion_2 \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            022: kCustomKernel [source | next=000 (1)] layer_a \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            000: kCommandBuffer [prev=022 (1) | next=025 (1)]
                023: kCustomKernel [source | sink] layer_b \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
                024: kCustomKernel [source | sink] layer_c \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            025: kCustomCall    [prev=000 (1) | sink] kCustomCall
        026: kCustomKernel [prev=020 (1) | sink] fusion_b \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      true_branch:
        No thunks.
    030: kWhile         [prev=008 (1) | sink]
condition:
        031: kCustomKernel [source | sink] loop_compare_fusion_3 \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        032: kCustomKernel [source | sink] other \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
_NESTED_META = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, n in [(3, "while.1"), (8, "cond.1"), (20, "while.2"), (30, "while.3")]
)


def test_nested_while_counts_its_body_times_its_trip_count():
    seq = thunks.parse_thunks(_NESTED_THUNKS)
    assert [t.id for t in seq] == [3]
    layers = thunks.find_thunk(seq, 20)
    assert {k: [t.id for t in v] for k, v in layers.nested.items()} == {
        "condition": [21],
        "body": [22, 0, 25],
    }
    # what follows the nested loop stays in the branch, not in the outer loop
    assert [t.id for t in thunks.find_thunk(seq, 8).nested["false_branch"]] == [9, 20, 26]
    assert [t.id for t in seq[0].nested["body"]] == [5, 8, 30]
    names, op_names = (
        thunks.thunk_names(_NESTED_META),
        {"cond.1": "jit(step)/while/body/forward/cond"},
    )
    # while.2 (the layers) runs 4 times, body only (XLA:GPU skips the condition of a loop of
    # known trip count); while.3's trip count is unknown: condition + body once
    trips = {"while.1": 10, "while.2": 4, "while.3": None}
    count = thunks.loop_launches(seq, names, "while.1", op_names, trips=trips)
    assert count.tasks == {"forward": (0, 1 + 4 * 3 + 1)}
    assert count.overhead == 1 + 1 + 2  # the condition, the slice, while.3 once
    assert count.tick("forward") == 18
    assert (count.nested_loops, count.nested_launches, count.unknown_trip_loops) == (2, 14, 1)
    assert (
        count.command_buffers,
        count.kernels_in_command_buffers,
        count.custom_calls_outside,
    ) == (4, 8, 4)
    assert thunks.launches(seq, trips={3: 10, 20: 4}) == 10 * (1 + 14 + 2)
    # without trip counts every nested loop is one iteration (condition + body)
    once = thunks.loop_launches(seq, names, "while.1", op_names)
    assert once.tasks == {"forward": (0, 1 + 4 + 1)} and once.overhead == 4
    assert (once.nested_loops, once.nested_launches, once.unknown_trip_loops) == (2, 6, 2)
    assert (once.command_buffers, once.kernels_in_command_buffers, once.custom_calls_outside) == (
        1,
        2,
        1,
    )


def _report(launches):
    from jax_wgrad.aot import AotReport

    return AotReport(
        target="t",
        gpus_per_host=1,
        hosts=1,
        mesh_shape=(1, 1, 1, 1),
        num_params=0,
        device_memory=1 << 30,
        mem_fraction=0.75,
        param_bytes=0,
        optimizer_bytes=0,
        bucket_bytes=0,
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        generated_code_bytes=0,
        trace_lower_s=0.0,
        compile_s=0.0,
        fusion="",
        wgrad_calls=0,
        wgrad_aliased=0,
        bucket_add_calls=0,
        bucket_add_aliased=0,
        loop="while.1",
        bucket_sizes=(),
        loop_bucket_ops=(),
        cooldown_bucket_ops=(),
        scatters_16bit=(),
        collectives=(),
        launches=launches,
        launches_per_microbatch=1.0,
        num_microbatches=1,
        num_ticks=1,
        xla_flags=(),
    )


def test_report_says_launches_in_nested_loops():
    seq, names = thunks.parse_thunks(_NESTED_THUNKS), thunks.thunk_names(_NESTED_META)
    op_names = {"cond.1": "jit(step)/while/body/forward/cond"}
    count = thunks.loop_launches(
        seq, names, "while.1", op_names, trips={"while.2": 4, "while.3": 7}
    )
    assert (
        "launches per tick (a tick running every task): 23 (loop 9, forward 14, of "
        "which 19 in 2 nested loops);"
    ) in _report(count).format()
    count = thunks.loop_launches(seq, names, "while.1", op_names, trips={"while.2": 4})
    assert (
        "18 (loop 4, forward 14, of which 14 in 2 nested loops (a loop of unknown trip "
        "count counted once));"
    ) in _report(count).format()
    # no nested loop: the line as before
    flat = thunks.loop_launches(
        thunks.parse_thunks(_GRAPH_COND),
        thunks.thunk_names(_META),
        "while.1",
        {"cond.1": "jit(step)/while/body/backward/cond"},
    )
    assert (
        "launches per tick (a tick running every task): 2 (loop 1, backward 1); "
        in _report(flat).format()
    )


def test_bytes_per_parameter_beside_megatron():
    from jax_wgrad.aot.report import megatron_figures

    bf16, text = megatron_figures(2, True, 4)
    assert bf16 == {"params": 2, "grads": 4, "optimizer": 3, "total": 9}
    assert text == "2 + 4 + 12/DP (DP 4)"
    fp32, text = megatron_figures(4, True, 2)
    assert fp32 == {"params": 4, "grads": 4, "optimizer": 4, "total": 12}
    assert megatron_figures(2, False, 8)[0]["total"] == 18  # Megatron's table
    assert megatron_figures(4, False, 8)[0]["total"] == 16
    # half the parameters are experts, sharded over an expert-DP group of 1 (DP 4, EP 4)
    moe, text = megatron_figures(2, True, 4, 0.5, 1)
    assert moe["optimizer"] == 12 * (0.5 / 4 + 0.5 / 1) and "expert-DP size 1" in text
    report = dataclasses.replace(
        _report(None),
        param_bytes=2 * 1000,
        bucket_bytes=4 * 1000,
        optimizer_bytes=3 * 1000,
        params_per_device=1000,
        param_itemsize=2,
        distributed_optimizer=True,
        data_parallel_size=4,
        traffic=hlo.TickTraffic(hlo.Traffic(), {}, 0),
        traffic_per_microbatch=hlo.Traffic(fusion=2e9, copy=1e9),
        memory_bandwidth=3e12,
    )
    assert report.bytes_per_parameter() == {"params": 2, "grads": 4, "optimizer": 3, "total": 9}
    text = report.format()
    assert (
        "params 2.00 | grads 4.00 | optimizer 3.00 | total 9.00; Megatron-LM (16-bit "
        "params, fp32 grads, distributed optimizer): 2 + 4 + 12/DP (DP 4)"
    ) in text
    assert "non-GEMM memory traffic per microbatch" in text
    assert ": 3.00 GB, 1.00 ms at 3.00 TB/s (fusions 2.00 GB, copies 1.00 GB," in text
    figures = report.figures()
    assert figures["non_gemm_bytes_per_microbatch"] == 3e9
    assert figures["bytes_per_param"]["total"] == figures["megatron_bytes_per_param"]["total"] == 9
    json.dumps(figures)  # plain JSON values


def test_targets():
    h100, h200 = gpu_target("h100"), gpu_target("H200")
    assert h100.description == "NVIDIA H100 80GB HBM3" and h200.description == "NVIDIA H200"
    assert h100.memory_bytes == 84929347584 and h200.memory_bytes > 139 * 2**30
    assert "memory_bandwidth: 4800000000000" in h200.config
    assert h100.with_memory(2**30).memory_bytes == 2**30
    with pytest.raises(ValueError, match="unknown GPU target"):
        gpu_target("a100")


MODEL = GPTConfig(
    vocab_size=256, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32
)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_plan_without_fusion_check(monkeypatch):
    par = ParallelConfig(
        micro_batch_size=2, global_batch_size=16, gradient_accumulation_fusion=True
    )
    mesh = make_mesh(par)
    from jax_wgrad.training import plan as plan_module

    def must_not_run(*a, **k):
        raise AssertionError("the fused handler's test call ran")

    monkeypatch.setattr(plan_module, "require_fusion", must_not_run)
    TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3), check_fusion=False)
    # A handler that is not loaded cannot be lowered: said at once, with the reason.
    monkeypatch.setitem(handlers._LOADED, "cpu", "the module is missing (test)")
    with pytest.raises(RuntimeError, match="cannot be lowered.*missing \\(test\\)"):
        TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3), check_fusion=False)


def test_target_devices_blames_the_plugin_only_when_it_is_missing(monkeypatch):
    from jax.experimental import topologies

    from jax_wgrad.aot import targets

    def no_topology(**kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_topology)
    monkeypatch.setattr(targets, "cuda_plugin", lambda: None)
    with pytest.raises(RuntimeError) as exc:
        targets.target_devices("h100", 8)
    assert str(exc.value).startswith(
        "compiling for a GPU needs jax's CUDA plugin (e.g. pip install 'jax[cuda13]'), and "
        "none is installed here; jax could not describe 1 x 8 NVIDIA H100 80GB HBM3: "
        "NotImplementedError: topology not implemented for cuda"
    )
    # installed, but jax started with CUDA among its platforms on a machine without a GPU
    monkeypatch.setattr(targets, "cuda_plugin", lambda: "jax_plugins.xla_cuda13")
    old = jax.config.jax_platforms
    try:
        for platforms, hint in ((None, True), ("cpu,cuda", True), ("cpu", False)):
            jax.config.update("jax_platforms", platforms)
            with pytest.raises(RuntimeError) as exc:
                targets.target_devices("h100", 8)
            text = str(exc.value)
            assert text.startswith(
                "jax's CUDA plugin (jax_plugins.xla_cuda13) is installed "
                "but could not describe 1 x 8 NVIDIA H100 80GB HBM3: "
            )
            assert "needs jax's CUDA plugin" not in text
            assert ("set JAX_PLATFORMS=cpu before jax is imported" in text) == hint
            assert (f"(JAX_PLATFORMS is {platforms or 'unset'})" in text) == hint
    finally:
        jax.config.update("jax_platforms", old)


# --------------------------------------------------------------- with jax's CUDA plugin


@functools.cache
def _plugin_error() -> str | None:
    try:
        from jax_wgrad.aot import target_devices

        target_devices("h100", 1)
    except Exception as exc:
        return str(exc)
    if handlers.load_error("cuda") is not None:
        return f"the CUDA handler is not loaded: {handlers.load_error('cuda')}"
    return None


@pytest.fixture
def plugin():
    if _plugin_error() is not None:
        pytest.skip(f"needs jax's CUDA plugin (deviceless compile): {_plugin_error()}")


aot = pytest.mark.aot


def _older_jax() -> bool:
    from jax_wgrad.aot import older_jax_note

    return older_jax_note() is not None


def _figures_jax() -> str:
    from jax_wgrad.aot import FIGURES_JAX_VERSION

    return FIGURES_JAX_VERSION


needs_the_figures_jax = pytest.mark.skipif(
    _older_jax(),
    reason=f"checks the structure jax >= {_figures_jax()}'s XLA:GPU compiles (the documented "
    f"figures); jax {jax.__version__} here compiles it differently "
    "(docs/performance.md#jax-versions)",
)
"""The ``aot`` tests that fail with an older jax's CUDA plugin (jax 0.10.2: more memory,
bucket-sized copies in the schedule loop, host syncs, a collective left in flight)."""


@aot
def test_single_h100_step_structure(plugin):
    from jax_wgrad.aot import compile_for_target

    par = ParallelConfig(
        micro_batch_size=2, global_batch_size=8, world_size=1, gradient_accumulation_fusion=True
    )
    model = GPTConfig(**{**MODEL.__dict__, "compute_dtype": "bfloat16"})
    report = compile_for_target(model, par, target="h100")
    assert report.fits and "fits (" in report.verdict()
    assert report.fusion == "fused-handler check skipped (compile only: nothing is run)"
    assert report.wgrad_calls > 0 and report.wgrad_aliased == report.wgrad_calls
    assert report.bucket_add_calls > 0 and report.bucket_add_aliased == report.bucket_add_calls
    assert report.loop is not None and report.loop_bucket_ops == ()
    assert report.scatters_16bit == ()
    assert report.launches is not None and report.launches.tick("forward", "backward") > 0
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in report.xla_flags
    assert "--xla_gpu_enable_dus_accumulator_zero_init_elimination=true" in report.xla_flags
    assert report.bucket_bytes > 0 and report.param_bytes > 0
    text = report.format()
    assert "launches per tick" in text and "DOES NOT FIT" not in text
    # the estimate: the model's FLOPs are Megatron's, the counted ones include them
    e = report.estimate
    assert e is not None and e.seconds > 0 and 0 < e.mfu < 1
    assert e.cost.flops >= e.model_flops * 0.9  # forward + both backward GEMMs counted
    assert report.host_syncs_per_step is not None and "estimated step on" in text
    figures = report.figures()
    assert figures["estimated_step_ms"] == pytest.approx(e.seconds * 1e3)


@aot
def test_the_layer_scan_saved_activations_are_not_zero_filled(plugin):
    # GPU_XLA_FLAGS lets XLA leave a loop's stacked outputs uninitialised when every row
    # is written before it is read: the layer scan's saved activations were zero-filled
    # every microbatch (memsets in the schedule loop), and with the flag are not
    from jax_wgrad.aot import compile_for_target

    par = ParallelConfig(
        micro_batch_size=2, global_batch_size=8, world_size=1, gradient_accumulation_fusion=True
    )
    model = GPTConfig(**{**MODEL.__dict__, "compute_dtype": "bfloat16"})
    flag = "xla_gpu_enable_dus_accumulator_zero_init_elimination"
    on = compile_for_target(model, par, target="h100")
    off = compile_for_target(model, par, target="h100", xla_options={flag: False})
    assert f"--{flag}=true" in on.xla_flags and f"--{flag}=false" in off.xla_flags
    saved = off.traffic_per_microbatch.memset - on.traffic_per_microbatch.memset
    assert saved > 0.5 * off.traffic_per_microbatch.memset
    assert on.traffic_per_microbatch.fusion == off.traffic_per_microbatch.fusion
    assert on.estimate.cost.hbm_bytes < off.estimate.cost.hbm_bytes


@aot
@pytest.mark.parametrize("inner", [None, "psum"])
@needs_the_figures_jax
def test_a_collective_stays_in_flight_across_a_loop_only_if_the_loop_holds_none(plugin, inner):
    """The XLA:GPU fact the parameter all-gather's place rests on (docs/design/aot.md,
    ``--overlap-param-gather``): a data-parallel all-gather issued before a loop of GEMMs
    whose result only the code after the loop reads stays in flight across the loop (its
    GEMMs hide it) when the loop holds no collective, and is synchronous when the loop
    holds one (a tensor-parallel psum). 8 compile-only H100s, (data 4, tensor 2)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_wgrad.aot import target_devices
    from jax_wgrad.aot.compile import compile_program

    mesh = Mesh(np.array(target_devices("h100", 8)).reshape(4, 2), ("data", "tensor"))
    layers, tokens, hidden, shard = 4, 4096, 2048, 1 << 22

    def f(params_shard, x, w):
        gathered = lax.all_gather(params_shard, "data", tiled=True)

        def body(c, wl):
            y = c @ wl
            return jnp.tanh(y if inner is None else lax.psum(y, "tensor")), None

        return lax.scan(body, x, w)[0], gathered

    spec = lambda *a: NamedSharding(mesh, P(*a))
    args = (
        jax.ShapeDtypeStruct((4 * shard,), jnp.bfloat16, sharding=spec("data")),
        jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=spec()),
        jax.ShapeDtypeStruct((layers, hidden, hidden), jnp.bfloat16, sharding=spec()),
    )
    step = jax.shard_map(
        f, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P()), check_vma=False
    )
    prog = compile_program(jax.jit(step).trace(*args).lower(), "h100")
    entry = hlo.computations(prog.compiled.as_text())[hlo.entry_name(prog.compiled.as_text())]
    order = [
        op
        for line in entry
        for op in ("all-gather-start", "while", "all-gather-done")
        if f" {op}(" in line
    ]
    (gather,) = [c for c in prog.estimate.collectives if c.kind == "all-gather"]
    if inner is None:
        assert order == ["all-gather-start", "while", "all-gather-done"]
        assert gather.hidden_s > 0
    else:
        assert "all-gather-start" not in order and gather.hidden_s == 0


@aot
def test_does_not_fit_verdict(plugin):
    from jax_wgrad.aot import compile_for_target

    par = ParallelConfig(micro_batch_size=2, global_batch_size=8, world_size=1)
    small = gpu_target("h100").with_memory(4 << 20)  # a 4 MiB "H100"
    report = compile_for_target(MODEL, par, target=small)
    assert not report.fits
    assert report.verdict().startswith("DOES NOT FIT: needs ")
    assert "DOES NOT FIT" in report.format()
    assert report.fusion == "gradient accumulation fusion off" and report.wgrad_calls == 0


@aot
@needs_the_figures_jax
def test_example_compile_only_on_8_h100(plugin, pretrain, capsys):
    from jax_wgrad.aot.report import COLLECTIVE_GROUPS

    argv = [
        "--compile-only",
        "--target",
        "h100",
        "--target-gpus",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--gradient-accumulation-fusion",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--defer-embedding-wgrad-compute",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--seq-length",
        "32",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "2",
    ]
    report = pretrain.main(argv)["aot"]
    out = capsys.readouterr().out
    assert "8 NVIDIA H100 80GB HBM3" in out and "(2, 1, 2, 2)" in out
    assert "verdict: fits" in out
    assert "fused-handler check skipped (compile only: nothing is run)" in out
    assert report.wgrad_aliased == report.wgrad_calls > 0 and report.loop_bucket_ops == ()
    groups = {c.group: c for c in report.collectives}
    assert groups["pipeline permutes"].total > 0
    assert groups["deferred-wgrad ring"].total > 0
    assert groups[COLLECTIVE_GROUPS["grad_sync_in_cooldown"]].total > 0
    for line in ("pipeline permutes:", "deferred-wgrad ring:", "cooldown data-parallel grad sync"):
        assert line in out
    # 2 layers per stage, scanned inside each tick: the schedule loop is the tick loop
    # (the outermost that carries the buckets), its layer loops counted per iteration
    lc = report.launches
    assert lc.nested_loops > 0 and lc.unknown_trip_loops == 0
    assert 0 < lc.nested_launches < lc.tick("forward", "backward")
    assert f"of which {lc.nested_launches} in {lc.nested_loops} nested loop" in out


@aot
def test_example_exits_1_when_it_does_not_fit(plugin, pretrain, monkeypatch, capsys):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.00001")  # < 1 MiB of 79 GiB
    with pytest.raises(SystemExit) as exc:
        pretrain.main(
            [
                "--compile-only",
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--seq-length",
                "32",
                "--global-batch-size",
                "16",
                "--micro-batch-size",
                "2",
            ]
        )
    assert exc.value.code == 1
    assert "verdict: DOES NOT FIT: needs" in capsys.readouterr().out


@functools.cache
def _subprocess_skip() -> str | None:
    """Why a compile in a fresh process (the example, the scale table) cannot run here."""
    from jax_wgrad.aot import cuda_plugin

    if cuda_plugin() is None:
        return "jax's CUDA plugin is not installed (e.g. pip install 'jax[cuda13]')"
    if handlers.load_error("cuda") is not None:
        return f"the CUDA handler is not loaded: {handlers.load_error('cuda')}"
    return None


def _scale_row(name: str) -> dict:
    """The scale table's row ``name`` compiled for H100s (skips where that cannot run): the
    example in a process of its own, without JAX_PLATFORMS (it sets itself up), writing
    --report-json; the row must fit."""
    if _subprocess_skip() is not None:
        pytest.skip(_subprocess_skip())
    from script_util import load_script

    scale = load_script("benchmarks/scale_table.py")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    row = scale.run_layout(scale.BY_NAME[name], "h100", env=env)
    assert row["status"] == "fits", row.get("error", row["status"])
    return row


@aot
@needs_the_figures_jax
def test_qwen3_30b_a3b_fits_8_h100_with_the_precision_aware_optimizer():
    """Qwen3-30B-A3B on one host of 8 H100s, EP8: its expert parameters (70% of a
    device's) have expert-DP 1, so their optimizer state is not sharded; with bf16 moments
    and parameter remainders it is half (about 21 GiB instead of 43 on jax 0.12.0.1) and
    the step fits (54.8 GiB of 59.3; 76.0 without the option). 60-120 s."""
    row = _scale_row("qwen3-30b-a3b-8gpu")
    assert row["optimizer_bytes"] < 24 * 2**30, row["optimizer_bytes"] / 2**30


@aot
@needs_the_figures_jax
@pytest.mark.parametrize(
    "name, mfu",
    [("mixtral-8x7b-best", 0.40), ("qwen3-30b-a3b-best", 0.35)],
)
def test_the_best_moe_layouts_reach_megatron_cores_league(name, mfu):
    """The issue's bars for MoE (Megatron-Core reports 39-49% MFU): Mixtral-8x7B on 64
    H100s at an estimated 40% or more, Qwen3-30B-A3B on 16 at 35% or more, with the ragged
    expert GEMMs charged for the routed rows of balanced routing; both fit, and their
    expert weight gradients are fused in place. 40-90 s each."""
    row = _scale_row(name)
    assert row["estimated_mfu"] >= mfu, row["estimated_mfu"]
    assert row["estimated_ragged_fill"] == pytest.approx(0.8)  # 1.25 T k buffers
    assert row["estimated_buffer_mfu"] < row["estimated_mfu"]
    assert row["wgrad_aliased"] == row["wgrad_calls"] > 0
    parts = row["estimated_time_by_part_ms"]
    assert max(parts, key=parts.get) == "expert GEMMs", parts


@aot
@needs_the_figures_jax
def test_llama3_8b_on_8_h100_fits_in_place():
    """Llama-3-8B TP2 PP2 DP2, seq 4096, --bf16, full recompute, fused, distributed
    optimizer, as the scale table compiles it: the example in a process of its own,
    without JAX_PLATFORMS (it sets itself up), writing --report-json. 40-60 s."""
    row = _scale_row("llama3-8b-tp2pp2dp2-s4k-full")
    for key in (
        "peak_bytes",
        "budget_bytes",
        "fits",
        "params_bytes",
        "optimizer_bytes",
        "grad_bytes",
        "temp_bytes",
        "launches_per_microbatch",
        "fused_calls",
        "fused_aliased",
        "compile_s",
        "bytes_per_param",
        "megatron_bytes_per_param",
        "non_gemm_bytes_per_microbatch",
        "estimated_step_ms",
        "estimated_mfu",
        "host_syncs_per_step",
        "dp_sync_overlapped",
    ):
        assert key in row, key
    assert 0.2 < row["estimated_mfu"] < 0.7 and row["estimated_step_ms"] > 0
    assert row["peak_bytes"] <= row["budget_bytes"]
    assert row["fused_calls"] > 0 and row["fused_aliased"] == row["fused_calls"]
    assert row["wgrad_aliased"] == row["wgrad_calls"] > 0
    assert row["loop_bucket_ops"] == []  # no bucket-sized kernel or copy in any tick
    # the cooldown's fp32 buckets go into their reduce-scatters unscaled (the 1/dp is in
    # the shard-sized token scaling): only the shard write-backs are bucket-sized there
    assert not [op for op in row["cooldown_bucket_ops"] if "multiply" in op], row
    assert row["launches_per_microbatch"] > 0 and row["non_gemm_bytes_per_microbatch"] > 0
    got, megatron = row["bytes_per_param"], row["megatron_bytes_per_param"]
    assert megatron == {"params": 2, "grads": 4, "optimizer": 6, "total": 12}  # DP 2
    assert got["params"] == pytest.approx(2, rel=0.02)  # bf16 parameters
    assert got["grads"] == pytest.approx(4, rel=0.05)  # fp32 buckets


@aot
@needs_the_figures_jax
def test_llama3_8b_fp8_on_8_h100():
    """The issue's FP8 bars that a compile can check: ``llama3-8b-fp8`` (TP2 DP4, seq
    8192, selective recompute, CUDA graphs, --fp8-format hybrid) fits, its FP8
    weight-gradient calls add into the buckets in place, its GEMMs are FP8 ones (most of
    the counted FLOPs: the attention core stays bf16) and its estimated MFU against the
    BF16 peak is 65% or more (NeMo's FP8 Llama 3.1 8B: about 70%). 60-120 s."""
    row = _scale_row("llama3-8b-fp8")
    assert row["estimated_mfu"] >= 0.65, row["estimated_mfu"]
    calls = row["fp8_gemm_calls_by_target"]
    assert calls.get("jax_wgrad_fp8_wgrad_accumulate_at", 0) > 0, calls
    assert row["wgrad_aliased"] == row["wgrad_calls"] > 0
    assert row["estimated_fp8_gemm_share"] > 0.7, row["estimated_fp8_gemm_share"]
    assert row["estimated_mfu_peak_flops"] == pytest.approx(989.4e12)


@aot
def test_fp8_linear_gemms_are_cublaslt_fp8_gemms(plugin):
    """A column-parallel FP8 linear into a bucket compiled for an H100 with XLA's cuBLAS
    GEMMs (``xla_gpu_enable_triton_gemm`` off; without a device XLA cannot autotune
    between cuBLAS and Triton): its forward and data-gradient GEMMs are cuBLASLt FP8
    GEMMs, not bf16 GEMMs with converts around them, and its weight gradient is the fused
    FP8 call, in place."""
    from jax.sharding import SingleDeviceSharding

    from jax_wgrad.aot import target_devices
    from jax_wgrad.functional import WgradRoutes, linear
    from jax_wgrad.functional.fp8 import Fp8Gemm, Fp8Recipe

    (device,) = target_devices("h100", 1)
    fp8 = Fp8Gemm(Fp8Recipe("hybrid"))
    n_in, n_out, tokens = 1024, 2048, 4096

    def step(x, w, dy, bucket):
        def f(x, bucket):
            routes = WgradRoutes([bucket])
            y = linear(x, routes.to_bucket(w, 0, offset=0), fp8=fp8)
            return y, routes.close()

        (y, _), vjp = jax.vjp(f, x, bucket)
        return y, vjp((dy, (bucket,)))  # y: the forward GEMM is not dead code

    sharding = SingleDeviceSharding(device)
    abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args = (
        abstract((tokens, n_in), jnp.bfloat16),
        abstract((n_out, n_in), jnp.bfloat16),
        abstract((tokens, n_out), jnp.bfloat16),
        abstract((n_out * n_in,), jnp.float32),
    )
    compiled = (
        jax.jit(step, donate_argnums=3)
        .trace(*args)
        .lower()
        .compile({"xla_gpu_enable_triton_gemm": False})
    )
    text = compiled.as_text()
    targets = [t for t in re.findall(r'custom_call_target="([^"]+)"', text) if "matmul" in t]
    assert targets.count("__cublas$lt$matmul$f8") == 2, targets  # forward, data gradient
    assert "__cublas$lt$matmul" not in targets, targets
    calls = hlo.custom_calls(text, handlers.FP8_TARGET)
    assert len(calls) == 1 and hlo.aliased(calls[0]), calls


@aot
def test_llama3_8b_without_pipeline_has_no_host_sync():
    """Llama-3-8B TP4 DP2 (one pipeline stage), as the scale table compiles it for 8 H100s:
    no conditional and no loop of unknown trip count on the host, so no host sync in the
    step (it had 56: the task conditionals and the ends' branches of every tick)."""
    row = _scale_row("llama3-8b-tp4dp2-s8k")
    assert row["host_syncs_per_step"] == 0
    assert row["fused_aliased"] == row["fused_calls"] > 0


_GRAPH_COND = """\
003: kWhile         [source | sink]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink]
        008: kConditional  [source | sink]
          false_branch:
            009: kCustomKernel [source | sink] fusion_a \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            011: kCustomCall    [prev=009 (1) | sink] kCustomCall
          true_branch:
            No thunks.
"""


def test_conditional_captured_in_a_command_buffer_is_one_launch():
    count = thunks.loop_launches(
        thunks.parse_thunks(_GRAPH_COND),
        thunks.thunk_names(_META),
        "while.1",
        {"cond.1": "jit(step)/while/body/backward/cond"},
    )
    assert count.tasks == {"backward": (1, 1)} and count.overhead == 1
    assert count.tasks_in_command_buffers == ("backward",) and count.conditionals == 0
    assert (
        count.command_buffers,
        count.kernels_in_command_buffers,
        count.custom_calls_outside,
    ) == (1, 2, 0)


# --cuda-graph-scope full_iteration: the schedule loop itself is a CUDA graph's while node
# (as in the H100 compile of Llama-3-8B TP2 PP2 with the layers unrolled), its task
# conditionals graph conditional nodes.
_LOOP_IN_GRAPH = """\
000: kCommandBuffer [source | next=030 (1)]
    001: kCustomKernel [source | sink] loop_broadcast_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    003: kWhile         [prev=001 (1) | sink]
    condition:
        004: kCustomKernel [source | sink] loop_compare_fusion \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        008: kConditional  [source | next=012 (1)]
          false_branch:
            009: kCustomKernel [source | sink] fusion_a \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            011: kCustomCall    [prev=009 (1) | sink] kCustomCall
          true_branch:
            No thunks.
        012: kCustomKernel [prev=008 (1) | sink] fusion_b \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
030: kCustomKernel [prev=000 (1) | sink] after \
grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""


def test_a_schedule_loop_inside_a_command_buffer_launches_nothing_per_tick():
    seq, names = thunks.parse_thunks(_LOOP_IN_GRAPH), thunks.thunk_names(_META)
    assert thunks.in_command_buffer(seq, 3) and thunks.in_command_buffer(seq, 8)
    assert not thunks.in_command_buffer(seq, 30)
    count = thunks.loop_launches(
        seq, names, "while.1", {"cond.1": "jit(step)/while/body/backward/cond"}
    )
    assert count.in_command_buffer and count.tick() == 0 and count.conditionals == 0
    assert count.kernels_in_command_buffers == 3  # the busy branch's 2, fusion_b
    assert thunks.host_syncs(seq, names, {"while.1": 11}) == {}
    assert thunks.launches(seq) == 2  # the graph, then the kernel after it
    text = _report(count).format()
    assert "launches per tick: 0, the schedule loop runs inside a command buffer" in text
    assert "a tick running every task holds 3 kernels" in text


def test_full_iteration_command_buffer_types_are_ones_xla_takes():
    """Every type of ``--cuda-graph-scope full_iteration`` is a name this jaxlib's
    ``xla_gpu_enable_command_buffer`` takes (the flag is parsed on any backend), and a
    name it does not know is refused, so the check can fail."""
    from jax_wgrad.training.gpu import FULL_ITERATION_COMMAND_BUFFERS, gpu_xla_flags

    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    flags = gpu_xla_flags("full_iteration")
    value = flags["--xla_gpu_enable_command_buffer"]
    assert value == FULL_ITERATION_COMMAND_BUFFERS
    assert {"CONDITIONAL", "WHILE", "COLLECTIVES", "CUSTOM_CALL"} <= set(value.split(","))
    lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": value})
    with pytest.raises(Exception, match="NOT_A_TYPE"):
        lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": value + ",NOT_A_TYPE"})
    assert "--xla_gpu_enable_command_buffer" not in gpu_xla_flags("kernels")
    with pytest.raises(ValueError, match="'everything'"):
        gpu_xla_flags("everything")


@aot
@needs_the_figures_jax
def test_llama3_8b_paired_as_cuda_graphs_has_no_host_sync():
    """Llama-3-8B TP2 PP2 DP2 paired with ``--cuda-graph-scope full_iteration`` and the
    layers unrolled, as the scale table compiles it for 8 H100s: the schedule loop and its
    task conditionals are captured in a CUDA graph, and the deferral drain's conditionals
    hold only their GEMMs, so nothing reads a predicate back (65 host syncs without)."""
    row = _scale_row("llama3-8b-tp2pp2dp2-s4k-paired-graphs")
    assert row["host_syncs_per_step"] == 0
    assert row["launches_per_tick"] == 0 and row["launches_per_microbatch"] == 0
    assert any("CONDITIONAL" in f for f in row["xla_flags"])
    assert row["fused_aliased"] == row["fused_calls"] > 0


@aot
@pytest.mark.parametrize(
    "name", ["llama3-8b-tp2pp2dp2-s4k-paired-groups-graphs", "llama3-8b-tp4dp2-s8k-groups-graphs"]
)
@needs_the_figures_jax
def test_llama3_8b_groups_as_cuda_graphs_overlap_the_sync_without_host_sync(name):
    """Llama-3-8B TP2 PP2 DP2 paired and TP4 DP2 with layer groups and
    ``--cuda-graph-scope full_iteration`` (layers unrolled), as the scale table compiles
    them for 8 H100s: no host sync, and every chunk sync of the layer groups' buckets in
    the last backward is hidden behind weight-gradient GEMMs in the estimate (issued
    beside a layer's weight gradients: ``sync_when_complete``; before it, straight-line
    code left half (paired) or all (TP4) of them with only memory-bound kernels between
    start and done)."""
    row = _scale_row(name)
    assert row["host_syncs_per_step"] == 0
    assert row["dp_sync_overlapped"] is True
    assert row["fused_aliased"] == row["fused_calls"] > 0


def test_example_compile_only_without_plugin_is_a_clear_error(pretrain, capsys):
    if _plugin_error() is None:
        pytest.skip("jax's CUDA plugin is here: the compile would run (see the aot tests)")
    with pytest.raises(SystemExit) as exc:
        pretrain.main(
            [
                "--compile-only",
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--seq-length",
                "32",
                "--global-batch-size",
                "16",
                "--micro-batch-size",
                "2",
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "compiling for a GPU needs jax's CUDA plugin" in err or "cannot be lowered" in err


def test_dynamic_slice_fusion_around_an_aliased_call_is_no_bucket_kernel():
    # XLA:GPU (H100 deviceless compile of a scan over stacked layers, traced offsets) wraps
    # the fused call in a dynamic-slice fusion that reads x from the stacked residuals in
    # place; the bucket (operand 2 of the call) is aliased: not a bucket-sized kernel.
    text = f"""HloModule m

%dynamic-slice-fusion (p0: f32[{N}], p1: s32[]) -> (f32[{N}], u8[64]) {{
  %p0 = f32[{N}]{{0}} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %wgrad_accumulate_at.0 = (f32[{N}]{{0}}, u8[64]{{0}}) custom-call(%x, %dy, %p0, %p1), \
custom_call_target="jax_wgrad_wgrad_accumulate_at", output_to_operand_aliasing={{{{0}}: (2, {{}})}}
}}

ENTRY %main (b: f32[{N}], o: s32[]) -> (f32[{N}], u8[64]) {{
  %b = f32[{N}]{{0}} parameter(0)
  %o = s32[] parameter(1)
  ROOT %dynamic_slice_fusion = (f32[{N}]{{0}}, u8[64]{{0}}) fusion(%b, %o), kind=kCustom, \
calls=%dynamic-slice-fusion
}}
"""
    comps = hlo.computations(text)
    assert hlo.wraps_aliased_custom_call(comps["main"][-1], comps)
    assert hlo.sized_ops(comps, ["main"], [N]) == []
    unaliased = text.replace(", output_to_operand_aliasing={{0}: (2, {})}", "")
    comps = hlo.computations(unaliased)
    assert [i.name for i in hlo.sized_ops(comps, ["main"], [N])] == ["dynamic_slice_fusion"]


@aot
def test_the_moe_layer_benchmark_estimates_a_deviceless_compile(plugin):
    """``benchmarks/moe_layer_gpu.py --estimate``: a dropless layer compiled for an
    H100 without one; the estimate charges its GEMMs (the expert FLOPs over the time are
    below the sustained bf16 rate) and its other kernels."""
    from script_util import load_script

    from jax_wgrad.aot.estimate import PEAKS

    layer = load_script("benchmarks/moe_layer_gpu.py")
    row = layer.estimate_case((4096, 1024, 2048, 8, 2), "h100")
    assert row["estimated_ms"] > 0 and row["gemm_bound_ms"] > 0 and row["kernels"] >= 10
    assert row["expert_tflops"] * 1e12 < PEAKS["h100"].sustained_gemm_flops("bf16")
