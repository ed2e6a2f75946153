"""Compiling the train step for GPUs without one (:mod:`jax_wgrad.aot`).

Tests marked ``aot`` compile for H100s with jax's CUDA plugin (no GPU, no driver: run with
``JAX_PLATFORMS=cpu``) and skip with the reason where the plugin is not importable. The
others check the text analyses on CPU-compiled HLO and on small hand-written HLO/thunk
texts, and run everywhere.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jax_wgrad import GPTConfig, ParallelConfig, TrainPlan, default_optimizer
from jax_wgrad import fusion_available, make_mesh, wgrad_accumulate
from jax_wgrad.aot import gpu_target, hlo, thunks
from jax_wgrad.ops import registry

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
    text = _loop_hlo(lambda b, x: b.at[:256].add(wgrad_accumulate(
        x, x, jnp.zeros((16, 16), jnp.float32)).ravel()))
    name, body = hlo.schedule_loop(text, [N])
    assert name and body in hlo.computations(text)
    calls = hlo.custom_calls(text, registry.TARGET)
    assert calls and all(hlo.aliased(c) for c in calls)
    assert hlo.schedule_loop(text, [N + 1]) is None  # no loop carries such an array


def test_bucket_sized_kernel_in_loop_is_found():
    comps_of = lambda t: (hlo.computations(t), hlo.schedule_loop(t, [N]))  # noqa: E731
    comps, (_, body) = comps_of(_loop_hlo(lambda b, x: b * 1.5 + x.sum()))
    found = hlo.sized_ops(comps, hlo.reachable(comps, body), [N])
    assert found and all(f"f32[{N}]" in i.shape for i in found), found
    # A traced-offset block update: XLA:CPU updates in place, no bucket-sized kernel.
    def block(b, x):
        o = (x[0, 0] > 0).astype(jnp.int32) * 512
        return lax.dynamic_update_slice(b, lax.dynamic_slice(b, (o,), (128,)) + x.ravel(), (o,))
    comps, (_, body) = comps_of(_loop_hlo(block))
    assert [i for i in hlo.sized_ops(comps, hlo.reachable(comps, body), [N])
            if i.opcode == "copy"] == []


def test_16bit_scatter_is_found():
    # XLA:CPU upcasts 16-bit scatters itself (XLA:GPU does not): a GPU-style line.
    line = ("  %input_scatter_fusion = bf16[256,2048]{1,0} scatter(%p0, %p1, %p2), "
            "update_window_dims={1}, to_apply=%add")
    assert [i.name for i in hlo.scatters_16bit(line)] == ["input_scatter_fusion"]
    ids = jnp.arange(64) % 7
    text = jax.jit(lambda t, g: t.at[ids].add(g)).lower(
        jnp.zeros((16, 8), jnp.float32), jnp.ones((64, 8), jnp.float32)).compile().as_text()
    assert "scatter(" in text and hlo.scatters_16bit(text) == []


_SCHEDULED = """\
HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %collective-permute-start = ((f32[8]{0}), f32[8]{0}) collective-permute-start(%p), channel_id=1, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/while/body/send_recv/ppermute"}
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %collective-permute-done = f32[8]{0} collective-permute-done(%collective-permute-start), metadata={op_name="jit(step)/while/body/send_recv/ppermute"}
  %reduce-scatter-start = ((f32[8]{0}), f32[4]{0}) reduce-scatter-start(%fusion.1), metadata={op_name="jit(step)/while/body/grad_sync_in_cooldown/reduce_scatter"}
  %reduce-scatter-done = f32[4]{0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce.2 = f32[8]{0} all-reduce(%collective-permute-done), to_apply=%add
  ROOT %copy.1 = f32[8]{0} copy(%all-reduce.2)
}
"""


def test_async_collectives_and_what_runs_between():
    comps = hlo.computations(_SCHEDULED)
    found = {c.kind: c for c in hlo.async_collectives(comps)}
    assert found["collective-permute"].overlapped
    assert found["collective-permute"].compute_between == ("fusion.1",)
    assert "send_recv" in found["collective-permute"].op_name
    assert not found["reduce-scatter"].overlapped
    assert [i.name for i in hlo.sync_collectives(comps)] == ["all-reduce.2"]


_THUNKS = """\
000: kCommandBuffer [source        | next=003 (1) ]
    001: kCustomKernel [source        | sink         ] loop_broadcast_fusion grid: [128, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    002: kCopy         [source        | sink         ] kCopy
003: kWhile         [prev=000 (1)  | next=000 (1) ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kAsyncStart   [source       | next=007 (4)] stream=computation_stream[1], async_id=5
        006: kDynamicSliceFusion [source | sink] params=1, results=1
            060: kCopy [source | sink] kCopy
    007: kAsyncDone    [source       | sink        ] async_id=5
    008: kConditional  [prev=007 (2) | next=009 (1)]
      false_branch:
        000: kCommandBuffer [source       | next=011 (1)]
            009: kCustomKernel [source | sink] fusion_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            010: kCuDnn        [prev=009 (1)  | next=011 (1)] kCuDnn
        011: kCustomCall    [prev=000 (1) | next=012 (3)] kCustomCall
        012: kWhile         [prev=011 (1) | sink ]
        condition:
            013: kCustomKernel [source | sink] loop_compare_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            014: kCustomKernel [source | sink] inner grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
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
_META = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
                f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
                for i, n in [(3, "while.1"), (8, "cond.1"), (15, "cond.2")])


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
    count = thunks.loop_launches(seq, thunks.thunk_names(_META), "while.1",
                              {"cond.1": "jit(step)/while/body/forward/cond",
                               "cond.2": "jit(step)/while/body/grad_sync_in_cooldown/cond"})
    assert count.overhead == 2  # the condition's compare and the async slice copy
    assert count.tasks == {"forward": (0, 4), "grad_sync_in_cooldown": (0, 1)}
    assert count.tick("forward") == 6 and count.conditionals == 2
    # the cooldown's branch is busy once per step: not in the per-tick counts
    assert (count.command_buffers, count.kernels_in_command_buffers,
            count.custom_calls_outside) == (1, 2, 1)


def _nested_scan_hlo() -> str:
    # a scan over ticks whose body scans over layers, both carrying the bucket (the
    # pipeline's layer scan inside a tick); XLA:CPU prints the inner while first
    def f(b, xs):
        def tick(b, x):
            layer = lambda b, w: (b.at[:16].add(w.sum() * x.sum()), None)  # noqa: E731
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
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kCustomKernel [source | next=008 (1)] loop_dynamic_slice_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    008: kConditional  [prev=005 (1) | next=030 (1)]
      false_branch:
        009: kCustomKernel [source | next=020 (1)] fusion_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        020: kWhile         [prev=009 (1) | next=026 (1)]
condition:
            021: kCustomKernel [source | sink] loop_compare_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            022: kCustomKernel [source | next=000 (1)] layer_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            000: kCommandBuffer [prev=022 (1) | next=025 (1)]
                023: kCustomKernel [source | sink] layer_b grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
                024: kCustomKernel [source | sink] layer_c grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            025: kCustomCall    [prev=000 (1) | sink] kCustomCall
        026: kCustomKernel [prev=020 (1) | sink] fusion_b grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      true_branch:
        No thunks.
    030: kWhile         [prev=008 (1) | sink]
condition:
        031: kCustomKernel [source | sink] loop_compare_fusion_3 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        032: kCustomKernel [source | sink] other grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
_NESTED_META = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, n in [(3, "while.1"), (8, "cond.1"), (20, "while.2"), (30, "while.3")])


def test_nested_while_counts_its_body_times_its_trip_count():
    seq = thunks.parse_thunks(_NESTED_THUNKS)
    assert [t.id for t in seq] == [3]
    layers = thunks.find_thunk(seq, 20)
    assert {k: [t.id for t in v] for k, v in layers.nested.items()} == {
        "condition": [21], "body": [22, 0, 25]}
    # what follows the nested loop stays in the branch, not in the outer loop
    assert [t.id for t in thunks.find_thunk(seq, 8).nested["false_branch"]] == [9, 20, 26]
    assert [t.id for t in seq[0].nested["body"]] == [5, 8, 30]
    names, op_names = thunks.thunk_names(_NESTED_META), {
        "cond.1": "jit(step)/while/body/forward/cond"}
    # while.2 (the layers) runs 4 times, body only (XLA:GPU skips the condition of a loop of
    # known trip count); while.3's trip count is unknown: condition + body once
    trips = {"while.1": 10, "while.2": 4, "while.3": None}
    count = thunks.loop_launches(seq, names, "while.1", op_names, trips=trips)
    assert count.tasks == {"forward": (0, 1 + 4 * 3 + 1)}
    assert count.overhead == 1 + 1 + 2  # the condition, the slice, while.3 once
    assert count.tick("forward") == 18
    assert (count.nested_loops, count.nested_launches, count.unknown_trip_loops) == (2, 14, 1)
    assert (count.command_buffers, count.kernels_in_command_buffers,
            count.custom_calls_outside) == (4, 8, 4)
    assert thunks.launches(seq, trips={3: 10, 20: 4}) == 10 * (1 + 14 + 2)
    # without trip counts every nested loop is one iteration (condition + body)
    once = thunks.loop_launches(seq, names, "while.1", op_names)
    assert once.tasks == {"forward": (0, 1 + 4 + 1)} and once.overhead == 4
    assert (once.nested_loops, once.nested_launches, once.unknown_trip_loops) == (2, 6, 2)
    assert (once.command_buffers, once.kernels_in_command_buffers,
            once.custom_calls_outside) == (1, 2, 1)


def _report(launches):
    from jax_wgrad.aot import AotReport

    return AotReport(
        target="t", gpus_per_host=1, hosts=1, mesh_shape=(1, 1, 1, 1), num_params=0,
        device_memory=1 << 30, mem_fraction=0.75, param_bytes=0, optimizer_bytes=0,
        bucket_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
        generated_code_bytes=0, trace_lower_s=0.0, compile_s=0.0, fusion="", wgrad_calls=0,
        wgrad_aliased=0, bucket_add_calls=0, bucket_add_aliased=0, loop="while.1",
        bucket_sizes=(), loop_bucket_ops=(), cooldown_bucket_ops=(), scatters_16bit=(),
        collectives=(), launches=launches, launches_per_microbatch=1.0, num_microbatches=1,
        num_ticks=1, xla_flags=())


def test_report_says_launches_in_nested_loops():
    seq, names = thunks.parse_thunks(_NESTED_THUNKS), thunks.thunk_names(_NESTED_META)
    op_names = {"cond.1": "jit(step)/while/body/forward/cond"}
    count = thunks.loop_launches(seq, names, "while.1", op_names,
                                 trips={"while.2": 4, "while.3": 7})
    assert ("launches per tick (a tick running every task): 23 (loop 9, forward 14, of "
            "which 19 in 2 nested loops);") in _report(count).format()
    count = thunks.loop_launches(seq, names, "while.1", op_names, trips={"while.2": 4})
    assert ("18 (loop 4, forward 14, of which 14 in 2 nested loops (a loop of unknown trip "
            "count counted once));") in _report(count).format()
    # no nested loop: the line as before
    flat = thunks.loop_launches(thunks.parse_thunks(_GRAPH_COND), thunks.thunk_names(_META),
                                "while.1", {"cond.1": "jit(step)/while/body/backward/cond"})
    assert "launches per tick (a tick running every task): 2 (loop 1, backward 1); " in \
        _report(flat).format()


def test_targets():
    h100, h200 = gpu_target("h100"), gpu_target("H200")
    assert h100.description == "NVIDIA H100 80GB HBM3" and h200.description == "NVIDIA H200"
    assert h100.memory_bytes == 84929347584 and h200.memory_bytes > 139 * 2**30
    assert "memory_bandwidth: 4800000000000" in h200.config
    assert h100.with_memory(2**30).memory_bytes == 2**30
    with pytest.raises(ValueError, match="unknown GPU target"):
        gpu_target("a100")


MODEL = GPTConfig(vocab_size=256, num_layers=2, hidden_size=64, num_attention_heads=4,
                  seq_length=32)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_plan_without_fusion_check(monkeypatch):
    par = ParallelConfig(micro_batch_size=2, global_batch_size=16,
                         gradient_accumulation_fusion=True)
    mesh = make_mesh(par)
    from jax_wgrad.training import plan as plan_module

    def must_not_run(*a, **k):
        raise AssertionError("the fused handler's test call ran")

    monkeypatch.setattr(plan_module, "require_fusion", must_not_run)
    TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3), check_fusion=False)
    # A handler that is not loaded cannot be lowered: said at once, with the reason.
    monkeypatch.setitem(registry._LOADED, "cpu", "the module is missing (test)")
    with pytest.raises(RuntimeError, match="cannot be lowered.*missing \\(test\\)"):
        TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3), check_fusion=False)


# --------------------------------------------------------------- with jax's CUDA plugin


@functools.cache
def _plugin_error() -> str | None:
    try:
        from jax_wgrad.aot import target_devices

        target_devices("h100", 1)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    if registry.load_error("cuda") is not None:
        return f"the CUDA handler is not loaded: {registry.load_error('cuda')}"
    return None


@pytest.fixture
def plugin():
    if _plugin_error() is not None:
        pytest.skip(f"needs jax's CUDA plugin (deviceless compile): {_plugin_error()}")


aot = pytest.mark.aot


@aot
def test_single_h100_step_structure(plugin):
    from jax_wgrad.aot import compile_for_target

    par = ParallelConfig(micro_batch_size=2, global_batch_size=8, world_size=1,
                         gradient_accumulation_fusion=True)
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
    assert report.bucket_bytes > 0 and report.param_bytes > 0
    text = report.format()
    assert "launches per tick" in text and "DOES NOT FIT" not in text


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
def test_example_compile_only_on_8_h100(plugin, example, capsys):
    argv = ["--compile-only", "--target", "h100", "--target-gpus", "8",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--sequence-parallel", "--gradient-accumulation-fusion",
            "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--defer-embedding-wgrad-compute", "--num-layers", "4", "--hidden-size", "64",
            "--seq-length", "32", "--global-batch-size", "16", "--micro-batch-size", "2"]
    report = example.main(argv)["aot"]
    out = capsys.readouterr().out
    assert "8 NVIDIA H100 80GB HBM3" in out and "(2, 1, 2, 2)" in out
    assert "verdict: fits" in out
    assert "fused-handler check skipped (compile only: nothing is run)" in out
    assert report.wgrad_aliased == report.wgrad_calls > 0 and report.loop_bucket_ops == ()
    groups = {c.group: c for c in report.collectives}
    assert groups["pipeline permutes"].total > 0
    assert groups["deferred-wgrad ring"].total > 0
    assert groups["cooldown reduce-scatters (data-parallel grad sync)"].total > 0
    for line in ("pipeline permutes:", "deferred-wgrad ring:", "cooldown reduce-scatters"):
        assert line in out
    # 2 layers per stage, scanned inside each tick: the schedule loop is the tick loop
    # (the outermost that carries the buckets), its layer loops counted per iteration
    lc = report.launches
    assert lc.nested_loops > 0 and lc.unknown_trip_loops == 0
    assert 0 < lc.nested_launches < lc.tick("forward", "backward")
    assert f"of which {lc.nested_launches} in {lc.nested_loops} nested loop" in out


@aot
def test_example_exits_1_when_it_does_not_fit(plugin, example, monkeypatch, capsys):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.00001")  # < 1 MiB of 79 GiB
    with pytest.raises(SystemExit) as exc:
        example.main(["--compile-only", "--num-layers", "2", "--hidden-size", "64",
                      "--seq-length", "32", "--global-batch-size", "16",
                      "--micro-batch-size", "2"])
    assert exc.value.code == 1
    assert "verdict: DOES NOT FIT: needs" in capsys.readouterr().out


_GRAPH_COND = """\
003: kWhile         [source | sink]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink]
        008: kConditional  [source | sink]
          false_branch:
            009: kCustomKernel [source | sink] fusion_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
            011: kCustomCall    [prev=009 (1) | sink] kCustomCall
          true_branch:
            No thunks.
"""


def test_conditional_captured_in_a_command_buffer_is_one_launch():
    count = thunks.loop_launches(thunks.parse_thunks(_GRAPH_COND), thunks.thunk_names(_META), "while.1",
                              {"cond.1": "jit(step)/while/body/backward/cond"})
    assert count.tasks == {"backward": (1, 1)} and count.overhead == 1
    assert count.tasks_in_command_buffers == ("backward",) and count.conditionals == 0
    assert (count.command_buffers, count.kernels_in_command_buffers,
            count.custom_calls_outside) == (1, 2, 0)


def test_example_compile_only_without_plugin_is_a_clear_error(example, capsys):
    if _plugin_error() is None:
        pytest.skip("jax's CUDA plugin is here: the compile would run (see the aot tests)")
    with pytest.raises(SystemExit) as exc:
        example.main(["--compile-only", "--num-layers", "2", "--hidden-size", "64",
                      "--seq-length", "32", "--global-batch-size", "16",
                      "--micro-batch-size", "2"])
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
  ROOT %wgrad_accumulate_at.0 = (f32[{N}]{{0}}, u8[64]{{0}}) custom-call(%x, %dy, %p0, %p1), custom_call_target="jax_wgrad_wgrad_accumulate_at", output_to_operand_aliasing={{{{0}}: (2, {{}})}}
}}

ENTRY %main (b: f32[{N}], o: s32[]) -> (f32[{N}], u8[64]) {{
  %b = f32[{N}]{{0}} parameter(0)
  %o = s32[] parameter(1)
  ROOT %dynamic_slice_fusion = (f32[{N}]{{0}}, u8[64]{{0}}) fusion(%b, %o), kind=kCustom, calls=%dynamic-slice-fusion
}}
"""
    comps = hlo.computations(text)
    assert hlo.wraps_aliased_custom_call(comps["main"][-1], comps)
    assert hlo.sized_ops(comps, ["main"], [N]) == []
    unaliased = text.replace(", output_to_operand_aliasing={{0}: (2, {})}", "")
    comps = hlo.computations(unaliased)
    assert [i.name for i in hlo.sized_ops(comps, ["main"], [N])] == ["dynamic_slice_fusion"]
