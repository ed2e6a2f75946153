"""Compiled-HLO facts of the pipeline executor: what each task computes, in place, memory.

GEMMs and custom calls are attributed to the ``F``/``B``/``W`` task by the named scopes of
the executor's tick (``forward``, ``backward``, ``weight_gradients``) in their metadata.
The model: one decoder layer per stage (pp = 4, 4 layers), fused linears.
"""

import collections
import functools
import re

import jax
import numpy as np
import pytest
from hlo_util import computations, copies_of, entry_name, reachable, while_bodies

from jax_wgrad import (
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    fusion_available,
    init_train_state,
    make_mesh,
    shard_batch,
)

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices"),
    pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler"),
]

MODEL = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)


@functools.cache  # one compile per layout in this module (the tests share some)
def _step(schedule, recompute, m=2, dp=2, pp=4, **options):
    par = ParallelConfig(
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=2 * dp * m,
        gradient_accumulation_fusion=True,
        pipeline_schedule=schedule,
        recompute_granularity=recompute,
        **(dict(recompute_method="uniform", recompute_num_layers=1) if recompute == "full" else {}),
        **options,
    )
    mesh = make_mesh(par)
    plan = TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3))
    state = init_train_state(plan, 0)
    tokens = shard_batch(mesh, np.zeros((par.global_batch_size, 17), np.int32))
    return build_train_step(plan, state).lower(state, tokens).compile()


def _by_task(hlo: str) -> collections.Counter:
    count = collections.Counter()
    for line in hlo.splitlines():
        if " dot(" not in line and "custom_call_target" not in line:
            continue
        op = (re.search(r'op_name="([^"]*)"', line) or re.search("()", "")).group(1)
        task = (
            "F"
            if "/forward/" in op
            else "B"
            if "/backward/" in op
            else "W"
            if "/weight_gradients/" in op
            else "-"
        )
        kind = "dot" if " dot(" in line else re.search(r'custom_call_target="(\w+)"', line).group(1)
        count[task, WGRAD if kind in WGRAD_TARGETS else kind] += 1
    return count


WGRAD = "jax_wgrad_wgrad_accumulate"
WGRAD_TARGETS = (WGRAD, "jax_wgrad_wgrad_accumulate_at")
"""A fused wgrad call: at a static block offset, or at a traced one (the layers' scan)."""
# Per stage (one layer): forward GEMMs qkv, QK^T, PV, proj, fc1, fc2 (6) and on the last
# stage the head's logits and its data gradient (2) = 8 in F; backward: 4 data-gradient
# GEMMs + 4 attention-backward GEMMs = 8, plus the 4 fused wgrad calls (1F1B).
BACKWARD_DOTS = 8


# -m slow (suite time): by default the backward's recomputed GEMMs are counted in
# test_zb_h1_weight_gradients_only_in_w_tasks[full], what each granularity stores in
# tests/test_residuals.py, the fused wgrad calls in 1F1B's loop in tests/test_ddp.py.
@pytest.mark.slow
@pytest.mark.parametrize("recompute, recomputed", [(None, 0), ("selective", 2), ("full", 5)])
def test_backward_task_recomputes_only_what_the_granularity_says(recompute, recomputed):
    # None: no forward GEMM in B. Selective: the attention core's two batched GEMMs.
    # Full: the forward GEMMs the backward needs (fc2's output is not needed: 5 of 6).
    count = _by_task(_step("1f1b", recompute).as_text())
    assert count["B", "dot"] == BACKWARD_DOTS + recomputed, count
    assert count["F", "dot"] == 8 and count["B", WGRAD] == 4 and count["F", WGRAD] == 1


@pytest.mark.parametrize("recompute", [pytest.param(None, marks=pytest.mark.slow), "full"])
def test_zb_h1_weight_gradients_only_in_w_tasks(recompute):
    count = _by_task(_step("zb-h1", recompute).as_text())
    # B: data gradients only -- no wgrad call, and no more dots than 1F1B's backward.
    assert count["B", WGRAD] == 0 and count["F", WGRAD] == 0, count
    assert count["B", "dot"] == BACKWARD_DOTS + (5 if recompute == "full" else 0), count
    # W: the 4 layers' fused GEMMs and the output layer's (last stage), nothing else.
    assert count["W", WGRAD] == 5 and count["W", "dot"] == 0, count
    assert sum(v for (task, kind), v in count.items() if kind == WGRAD) == 5


@pytest.mark.parametrize(
    "schedule, recompute",
    [pytest.param("1f1b", None, marks=pytest.mark.slow), ("zb-h1", "selective")],
)
def test_no_copy_of_a_carried_buffer_inside_the_loop(schedule, recompute):
    hlo = _step(schedule, recompute).as_text()
    comps = computations(hlo)
    loops = [
        (line, body) for line, body in while_bodies(comps, entry_name(hlo)) if line.count("[") > 20
    ]  # the schedule's scan: the big carried tuple
    ((line, body),) = loops
    carried = {
        (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in re.finditer(r"(f32|bf16|s32)\[([\d,]*)\]", line.split(" while(")[0])
    }
    inside = "\n".join(l for c in reachable(comps, body) for l in comps[c])
    big = [(d, s) for d, s in carried if np.prod(s or (1,)) >= 256]
    assert big, line
    for dtype, shape in big:
        assert copies_of(inside, dtype, shape) == [], (dtype, shape)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_temp_memory_independent_of_microbatches(schedule):
    small = _step(schedule, None, m=4, dp=2).memory_analysis().temp_size_in_bytes
    large = _step(schedule, None, m=32, dp=2).memory_analysis().temp_size_in_bytes
    assert large <= 1.25 * small, (small, large)


@pytest.mark.parametrize(
    "schedule",
    [
        "1f1b",
        pytest.param("1f1b-paired", marks=pytest.mark.slow),
        pytest.param("zb-h1", marks=pytest.mark.slow),
    ],
)
def test_one_stage_step_has_no_conditional(schedule):
    """With one stage the table runs every task in every tick and "first"/"last stage" are
    static: no conditional is left for XLA:GPU to run on the host (a host sync each)."""
    options = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    one = _step(schedule, None, m=3, dp=4, pp=1, **options).as_text()
    assert " conditional(" not in one
    # Four stages idle in some ticks: their tasks stay conditional (test_temp_memory_...'s
    # compile).
    assert " conditional(" in _step("1f1b", None, m=4, dp=2).as_text()


def test_the_ends_are_scoped_for_the_estimate():
    """The conditionals that run ``post`` inside F and ``pre``'s backward inside B carry
    the scopes the step estimate charges separately (jax_wgrad.aot.hlo.END_SCOPES)."""
    from jax_wgrad.aot import hlo

    text = _step("1f1b", None, m=4, dp=2).as_text()  # test_temp_memory_...'s compile
    scopes = {
        (hlo.task_of(i.op_name), hlo.task_of(i.op_name, hlo.END_SCOPES))
        for c in hlo.computations(text).values()
        for i in hlo.instructions(c)
        if i.opcode == "conditional"
    }
    assert ("forward", "post") in scopes and ("backward", "pre_backward") in scopes


def test_layer_loops_write_the_residual_slots_one_iteration_at_a_time():
    """Two layers a stage (a layer loop) and two residual slots: the MLP's saved fc1 output
    lives in the schedule loop's carried slot buffer ``[slots 2, layers 2, mb 2, seq 16,
    ffn 128]``, written one layer at a time inside the layer loop (ResidualSlots) -- never a
    whole ``[1, layers, ...]`` stack copied in after the forward, as when the store held
    the layer scan's stacked outputs."""
    hlo = _step("1f1b", None, m=4, dp=4, pp=2).as_text()
    comps = computations(hlo)
    ((line, body),) = [
        (line, body) for line, body in while_bodies(comps, entry_name(hlo)) if line.count("[") > 20
    ]
    slot = "f32[2,2,2,16,128]"
    assert slot in line.split(" while(")[0], line
    updates = []
    for c in reachable(comps, body):
        shapes = {}
        for text in comps[c]:
            m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (\w+\[[\d,]*\])", text)
            if m:
                shapes[m.group(1)] = m.group(2)
        for text in comps[c]:
            if "dynamic-update-slice(" in text and text.split("=", 1)[1].strip().startswith(slot):
                operands = re.search(r"dynamic-update-slice\(([^)]*)\)", text).group(1).split(", ")
                updates.append(shapes.get(operands[1].strip()))
    assert updates and set(updates) == {"f32[1,1,2,16,128]"}, updates
