"""Read from the compiled step: the dropless MoE layer's expert GEMM FLOPs are the routed
tokens' (within 1.25x), while a capacity of every routed choice (capacity factor E) costs
about E times that; counted by ``benchmarks/moe_flops.py`` on a tiny shape."""

from collections import Counter

import jax
import numpy as np
import pytest
from script_util import load_script

from jax_wgrad.functional import MoEConfig
from jax_wgrad.ops import fusion_available

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices"),
    pytest.mark.skipif(
        not fusion_available("cpu", families=("dense", "ragged")),
        reason="the ragged GEMMs need the CPU FFI handlers",
    ),
]

E, H, F, T, K = 8, 16, 24, 12, 2  # experts, hidden, expert ffn, tokens per rank, top-k


bench = load_script("benchmarks/moe_flops.py")


def _compiled_step(factor, ep, swiglu=False):
    """``(cfg, hlo, rows each expert rank's ragged GEMMs get at run time)``."""
    cfg = MoEConfig(
        num_experts=E,
        ffn_hidden_size=F,
        topk=K,
        capacity_factor=factor,
        aux_loss_coeff=1e-2,
        swiglu=swiglu,
    )
    params, x, r = bench.make_inputs(cfg, ep, T, H)
    compiled = bench.build_step(cfg, ep).lower(params, x, r).compile()
    counts = np.asarray(compiled(params, x, r)[3])  # [EP(src), E] tokens_per_expert
    assert (counts.sum(1) == T * K).all()  # every source routes T k rows
    rank_rows = counts.sum(0).reshape(ep, -1).sum(1)
    if factor is None:  # the ragged calls' group sizes are those rows
        sizes = bench.dispatch_group_sizes(params, x, cfg, ep)
        np.testing.assert_array_equal(sizes.sum(1), rank_rows)
    return cfg, compiled.as_text(), rank_rows


# ~12 s each; the default run keeps EP 4 (SwiGLU experts: -m slow, as in
# tests/test_moe_dropless.py).
@pytest.mark.parametrize("ep,swiglu", [pytest.param(1, True, marks=pytest.mark.slow), (4, False)])
def test_dropless_expert_gemm_flops_are_the_routed_tokens(ep, swiglu):
    routed = bench.routed_flops(T, K, H, F, swiglu)
    cfg, hlo, rows = _compiled_step(None, ep, swiglu)
    got = bench.expert_gemm_flops(hlo, cfg, ep, H, rows)
    assert 0 < got["flops"] <= 1.25 * routed, got["flops"] / routed

    # One MoE layer: exactly 6 ragged custom calls -- forward, dgrad and wgrad of fc1 and
    # of fc2 -- and no XLA GEMM over an [E, ...] expert buffer.
    calls = bench.ragged_calls(hlo)
    assert Counter((c.role, bench._linear(c, H)) for c in calls) == Counter(
        (role, fc) for role in ("fwd", "dgrad", "wgrad") for fc in ("fc1", "fc2")
    ), calls
    dots = bench.dots(hlo)
    widths = (2 * F, F) if swiglu else (F,)
    assert bench.expert_dots(dots, E // ep, H, widths) == []
    assert bench.batched_over(dots, E // ep) == [] and bench.batched_over(dots, E) == []

    # capacity = E: every expert a buffer of all T k choices -> about E times the work.
    cfg, hlo, rows = _compiled_step(float(E), ep, swiglu)
    old = bench.expert_gemm_flops(hlo, cfg, ep, H, rows)
    assert old["flops"] >= E / 2 * routed, old["flops"] / routed
    assert len(old["dots"]) == 4 and len(old["calls"]) == 2  # fwd, dgrad dots; wgrad calls
    assert old["ragged"] == 0
