"""Expert-parallel MoE MLP: against the dense single-device reference, pinned token
dropping, the delayed expert wgrad bitwise equal to the serial order, and its HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import INSTRUCTION, ancestors, dataflow
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.functional import MoEConfig, moe_mlp
from jax_wgrad.functional.moe import dispatch_slots
from jax_wgrad.ops import handlers
from jax_wgrad.parallel.mesh import EXPERT
from jax_wgrad.testing import reference_moe_mlp

E, H, F, T = 8, 16, 32, 24  # experts, hidden, expert ffn, tokens per rank


def _params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "router": jax.random.normal(k[0], (E, H)),
        "fc1": jax.random.normal(k[1], (E, F, H)) / np.sqrt(H),
        "fc2": jax.random.normal(k[2], (E, H, F)) / np.sqrt(F),
    }


def _data(ep, seed=1):
    kx, kr = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (ep * T, H)), jax.random.normal(kr, (ep * T, H))


def _mesh(ep):
    return Mesh(np.array(jax.devices()[:ep]), (EXPERT,))


def _sharded_loss_and_grads(cfg, ep, fused):
    """jitted ``(params, x, r) -> (loss, grads, stats)`` on an EP mesh: each rank its own
    tokens and E/EP experts; loss = sum(y * r) / N + the ranks' aux losses."""
    n = ep * T
    e_local = E // ep
    sizes = (e_local * F * H, e_local * H * F)

    def local(p, x, r):
        def loss(p, bucket, x):
            if fused:
                (y, bucket), stats = moe_mlp(
                    p, x, cfg, expert_axis=EXPERT, buckets=(bucket, 0, sizes[0])
                )
            else:
                y, stats = moe_mlp(p, x, cfg, expert_axis=EXPERT)
            return jnp.sum(y * r) / n + stats.aux_loss, (bucket, stats)

        bucket = jnp.zeros(sum(sizes), jnp.float32)
        (value, (_, stats)), (dp, dbucket, dx) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True
        )(p, bucket, x)
        if fused:  # the expert weight gradients live in the bucket
            dp = dict(
                dp,
                fc1=dbucket[: sizes[0]].reshape(p["fc1"].shape),
                fc2=dbucket[sizes[0] :].reshape(p["fc2"].shape),
            )
        dp = dict(dp, router=jax.lax.psum(dp["router"], EXPERT))
        return jax.lax.psum(value, EXPERT), dp, dx, jax.tree.map(lambda a: a[None], stats)

    specs = {"router": P(), "fc1": P(EXPERT), "fc2": P(EXPERT)}
    fn = jax.shard_map(
        local,
        mesh=_mesh(ep),
        in_specs=(specs, P(EXPERT), P(EXPERT)),
        out_specs=(P(), specs, P(EXPERT), P(EXPERT)),
        check_vma=False,
    )
    return jax.jit(fn)


def _reference_loss(params, x, r, cfg, ep):
    total = 0.0
    for i in range(ep):  # the aux loss is per rank (its own tokens)
        y, aux = reference_moe_mlp(params, x[i * T : (i + 1) * T], cfg)
        total = total + jnp.sum(y * r[i * T : (i + 1) * T]) / (ep * T) + aux
    return total


# The default run keeps fused-4-2 (EP 4, top-2, the grouped fused wgrad); the rest -m slow
# (EP 1, 2, top-1 and the plain expert gradients: tests/test_moe_dropless.py's defaults
# test_dropless_equals_dense_reference[4-1-True] and
# test_dropless_tensor_parallel_equals_dense_reference[2-1-False]).
@pytest.mark.parametrize(
    "fused,ep,topk",
    [
        pytest.param(
            fused,
            ep,
            topk,
            id=f"{'fused' if fused else 'plain'}-{ep}-{topk}",
            marks=[] if (fused, ep, topk) == (True, 4, 2) else [pytest.mark.slow],
        )
        for fused in (False, True)
        for ep, topk in [(1, 1), (2, 2), (4, 1), (4, 2)]
    ],
)
def test_no_drop_equals_dense_reference(ep, topk, fused):
    cfg = MoEConfig(
        num_experts=E, ffn_hidden_size=F, topk=topk, capacity_factor=None, aux_loss_coeff=1e-2
    )
    params, (x, r) = _params(), _data(ep)
    loss, grads, dx, stats = _sharded_loss_and_grads(cfg, ep, fused)(params, x, r)
    want, (wgrads, wdx) = jax.value_and_grad(_reference_loss, argnums=(0, 1))(params, x, r, cfg, ep)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(grads[name], wgrads[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(dx, wdx, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(stats.dropped_fraction)) == 0.0
    counts = np.asarray(stats.tokens_per_expert).sum(0)
    assert counts.sum() == ep * T * topk


def test_dispatch_slots_pin_the_dropped_tokens():
    # Top-1 choices of 8 tokens, capacity 1: the first token of each expert is kept.
    experts = jnp.array([[0], [0], [1], [0], [2], [2], [3], [1]])
    slot, kept = dispatch_slots(experts, 4, capacity=1)
    assert slot[:, 0].tolist() == [0, 1, 0, 2, 0, 1, 0, 1]
    assert kept[:, 0].tolist() == [True, False, True, False, True, False, True, False]
    # Top-2: all first choices queue before any second choice (k-major).
    experts = jnp.array([[0, 1], [1, 0], [1, 2]])
    slot, kept = dispatch_slots(experts, 3, capacity=2)
    assert slot.tolist() == [[0, 2], [0, 1], [1, 0]]
    assert kept.tolist() == [[True, False], [True, True], [True, True]]


def test_dropped_tokens_get_no_expert_output():
    cfg = MoEConfig(
        num_experts=4, ffn_hidden_size=8, topk=1, capacity_factor=0.5, load_balancing_type="none"
    )
    # Router = identity on the first 4 features: token i goes to expert argmax(x[i, :4]).
    choice = np.array([0, 0, 1, 0, 2, 2, 3, 1])
    x = np.zeros((8, 4), np.float32)
    x[np.arange(8), choice] = 1.0
    x += 0.01 * np.arange(8)[:, None]
    params = {"router": jnp.eye(4), "fc1": jnp.ones((4, 8, 4)), "fc2": jnp.ones((4, 4, 8))}
    y, stats = moe_mlp(params, jnp.asarray(x), cfg)
    assert cfg.capacity(8) == 1
    dropped = np.all(np.asarray(y) == 0.0, axis=1)
    assert dropped.tolist() == [False, True, False, True, False, True, False, True]
    assert float(stats.dropped_fraction) == 0.5
    assert stats.tokens_per_expert.tolist() == [3, 2, 2, 1]


def _train(cfg, ep, steps=3, lr=0.1):
    fn = _sharded_loss_and_grads(cfg, ep, fused=True)
    params, (x, r) = _params(2), _data(ep, 3)
    losses = []
    for _ in range(steps):
        loss, grads, _, _ = fn(params, x, r)
        losses.append(np.asarray(loss))
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return losses, params


# The default run keeps EP 4, top-2, capacity 1.0; the rest -m slow (the dropless delayed
# wgrad: tests/test_moe_dropless.py's HLO test; EP 2 with drops: tests/test_moe_gpt.py's
# bitwise default ep2-pp2-top2-distopt-drop).
@pytest.mark.parametrize(
    "ep,topk,factor",
    [
        (4, 2, 1.0),
        pytest.param(2, 1, 1.25, marks=pytest.mark.slow),
        pytest.param(4, 1, None, marks=pytest.mark.slow),
    ],
)
def test_delayed_wgrad_is_bitwise_the_serial_order(ep, topk, factor):
    # Megatron's test of --overlap-dispatch-backward-with-experts-wgrad: same seed, 3
    # optimizer steps, every loss and every final parameter bitwise equal.
    base = dict(
        num_experts=E, ffn_hidden_size=F, topk=topk, capacity_factor=factor, aux_loss_coeff=1e-2
    )
    off_losses, off_params = _train(MoEConfig(**base, overlap_wgrad=False), ep)
    on_losses, on_params = _train(MoEConfig(**base, overlap_wgrad=True), ep)
    assert [l.tobytes() for l in on_losses] == [l.tobytes() for l in off_losses]
    for name in off_params:
        np.testing.assert_array_equal(on_params[name], off_params[name], err_msg=name)
    assert off_losses[-1] < off_losses[0]


def _backward_graph(overlap, compiled):
    """Dataflow of the loss-and-gradient program on EP=4: the HLO given to XLA
    (``compiled=False``: optimization barriers still visible) or XLA's compiled HLO."""
    cfg = MoEConfig(
        num_experts=E,
        ffn_hidden_size=F,
        topk=2,
        capacity_factor=1.0,
        aux_loss_coeff=1e-2,
        overlap_wgrad=overlap,
    )
    params, (x, r) = _params(), _data(4)
    lowered = _sharded_loss_and_grads(cfg, 4, fused=True).lower(params, x, r)
    hlo = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    lines = [l.strip() for l in hlo.splitlines()]  # instruction names are module-unique
    graph = dataflow(lines)
    name = lambda l: INSTRUCTION.match(l).group(1)
    a2a = [name(l) for l in lines if re.search(r" all-to-all(-start)?\(", l)]
    wgrads = [name(l) for l in lines if f'custom_call_target="{handlers.TARGET}"' in l]
    kinds = {name(l): l for l in lines if INSTRUCTION.match(l)}
    # dispatch, combine, and their transposes: the dispatch backward needs two others
    # (dispatch forward, combine backward); the combine forward needs the dispatch.
    dispatch_bwd = [a for a in a2a if len(ancestors(graph, a) & set(a2a)) == 2]
    combine_fwd = [a for a in a2a if len(ancestors(graph, a) & set(a2a)) == 1]
    assert len(a2a) == 4 and len(dispatch_bwd) == 1 and len(combine_fwd) == 1, a2a
    combine_bwd = set(a2a) - ancestors(graph, combine_fwd[0]) - {combine_fwd[0], dispatch_bwd[0]}
    return graph, dispatch_bwd[0], combine_bwd.pop(), wgrads, kinds


@pytest.mark.parametrize("overlap", [True, False])
def test_hlo_expert_wgrad_order_in_the_program(overlap):
    graph, dispatch_bwd, combine_bwd, wgrads, kinds = _backward_graph(overlap, compiled=False)
    assert len(wgrads) == 2  # one grouped call per expert linear
    dispatch_deps = ancestors(graph, dispatch_bwd)
    for w in wgrads:
        assert combine_bwd in ancestors(graph, w)  # it needs the expert's output gradient
        assert dispatch_bwd not in ancestors(graph, w)
        # Serial baseline: the dispatch-backward all-to-all waits for the wgrad. Delayed:
        # it does not, and the wgrad's inputs pass a barrier with the data gradient.
        assert (w in dispatch_deps) == (not overlap)
        if overlap:  # ...that barrier also carries the data gradient to the all-to-all
            assert any(" opt-barrier(" in kinds[n] for n in ancestors(graph, w) & dispatch_deps)


def test_hlo_compiled_expert_wgrad_is_free_of_the_all_to_all():
    graph, dispatch_bwd, _, wgrads, kinds = _backward_graph(True, compiled=True)
    assert len(wgrads) == 2
    for w in wgrads:
        assert "output_to_operand_aliasing={{}: (2, {})}" in kinds[w]  # in place
        assert w not in ancestors(graph, dispatch_bwd)
        assert dispatch_bwd not in ancestors(graph, w)


def test_bad_config():
    with pytest.raises(ValueError, match=r"moe_router_topk \(9\) must be in \[1, "):
        MoEConfig(num_experts=8, ffn_hidden_size=4, topk=9)
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        MoEConfig(num_experts=8, ffn_hidden_size=4, capacity_factor=0)
    with pytest.raises(ValueError, match="'sinkhorn' is not supported"):
        MoEConfig(num_experts=8, ffn_hidden_size=4, load_balancing_type="sinkhorn")


def test_experts_not_divisible_by_the_expert_ranks():
    cfg = MoEConfig(num_experts=6, ffn_hidden_size=F, capacity_factor=1.0, aux_loss_coeff=1e-2)
    params = {"router": jnp.zeros((6, H)), "fc1": jnp.zeros((6, F, H)), "fc2": jnp.zeros((6, H, F))}
    fn = jax.shard_map(
        lambda p, x: moe_mlp(p, x, cfg, expert_axis=EXPERT)[0],
        mesh=_mesh(4),
        in_specs=({"router": P(), "fc1": P(), "fc2": P()}, P(EXPERT)),
        out_specs=P(EXPERT),
        check_vma=False,
    )
    with pytest.raises(
        ValueError,
        match=r"num_moe_experts \(6\) must equal "
        r"expert_model_parallel_size \(4\) x local experts",
    ):
        fn(params, jnp.zeros((4 * T, H)))


def test_expert_weights_must_match_the_ffn_hidden_size():
    cfg = MoEConfig(num_experts=4, ffn_hidden_size=8, capacity_factor=1.0, aux_loss_coeff=1e-2)
    params = {"router": jnp.zeros((4, 4)), "fc1": jnp.zeros((4, 6, 4)), "fc2": jnp.zeros((4, 4, 6))}
    with pytest.raises(
        ValueError,
        match=r"fc1 \[E/EP, moe_ffn_hidden_size, H\] = \[4, 8, 4\]"
        r".*got fc1 \[4, 6, 4\]",
    ):
        moe_mlp(params, jnp.zeros((8, 4)), cfg)
