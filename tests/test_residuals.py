"""What the pipeline stores per in-flight microbatch: activations only, never a weight or
a gradient bucket, and less with more recomputation."""

import jax
import jax.numpy as jnp
import pytest

from jax_wgrad import GPTConfig, GPTProgram, ParallelConfig, fusion_available
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.parallel.pipeline.executor import _StageRun
from jax_wgrad.parallel.pipeline.gradients import grad_layout, grad_sink, schedule_of

MODEL = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=64, compute_dtype="bfloat16")


def _store(recompute, schedule="1f1b"):
    par = ParallelConfig(micro_batch_size=2, global_batch_size=4, world_size=1,
                         gradient_accumulation_fusion=True, recompute_granularity=recompute,
                         pipeline_schedule=schedule)
    program = GPTProgram(MODEL, par, platform="cpu")
    layout, table = grad_layout(program, DDPConfig()), schedule_of(program)
    params = program.device_tree(program.init_params(0))
    run = _StageRun(program, grad_sink(program, layout, table), DDPConfig(), table, params,
                    jnp.zeros((4, 17), jnp.int32))
    weights = {tuple(x.shape) for x in jax.tree.leaves(params)}
    buckets = {(n,) for n in layout.buffer.bucket_numels}
    return run.store, weights, buckets


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_residuals_are_activations_only(schedule):
    sizes = {}
    for recompute in (None, "selective", "full"):
        store, weights, buckets = _store(recompute, schedule)
        shapes = [tuple(s.shape) for s in store.shapes]
        assert shapes and all(s[0] == 2 for s in shapes), shapes  # [micro_batch, ...]
        assert not set(shapes) & (weights | buckets), shapes
        assert all(i is not None for i in store.live_index if i is not None)
        assert sum(i is not None for i in store.live_index) > 0  # the weights, read live
        sizes[recompute] = store.stored_bytes
        if recompute == "full":  # the stage input alone
            assert shapes == [(2, 16, 32)] and store.shapes[0].dtype == jnp.bfloat16
    assert sizes["full"] < sizes["selective"] < sizes[None], sizes
