"""Deferred output-layer weight gradients (stash / recompute), Megatron's
validation, gradients equal to the non-deferred run and the single-device reference,
and the compiled drain's tensor-ring structure."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import computations, jaxpr_eqns
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import (
    GPTConfig,
    GPTProgram,
    ParallelConfig,
    fusion_available,
    init_params,
    make_mesh,
    param_specs,
    pipeline_gradients,
)
from jax_wgrad.layout import lay_out
from jax_wgrad.models.gpt import validate
from jax_wgrad.parallel import deferred
from jax_wgrad.testing import reference_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

needs_fusion = pytest.mark.skipif(
    not fusion_available("cpu"), reason="the CPU wgrad_accumulate handler was not built"
)

# --------------------------------------------------------------------------- validation


def test_validation_messages():
    with pytest.raises(
        ValueError, match="Cannot defer embedding wgrad when pipeline parallel not used"
    ):
        ParallelConfig(
            pipeline_model_parallel_size=1,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            world_size=8,
        )
    with pytest.raises(
        ValueError, match="Cannot defer embedding wgrad without gradient accumulation fusion"
    ):
        ParallelConfig(
            pipeline_model_parallel_size=2, defer_embedding_wgrad_compute=True, world_size=8
        )
    with pytest.raises(ValueError, match="Wgrad deferral limit must be >= 0"):
        ParallelConfig(
            pipeline_model_parallel_size=2,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            wgrad_deferral_limit=-1,
            world_size=8,
        )


@pytest.mark.parametrize("limit", [1.5, "2", True, None])
def test_bad_limits_refused(limit):
    with pytest.raises(ValueError, match="wgrad_deferral_limit must be an integer"):
        ParallelConfig(
            pipeline_model_parallel_size=2,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            wgrad_deferral_limit=limit,
            world_size=8,
        )


def test_bad_mode_refused():
    with pytest.raises(ValueError, match="defer_mode"):
        ParallelConfig(
            pipeline_model_parallel_size=2,
            gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=True,
            defer_mode="later",
            world_size=8,
        )


@pytest.mark.parametrize(
    "limit, m, expect",
    [(0, 5, 5), (1, 5, 1), (2, 5, 2), (4, 5, 4), (5, 5, 5), (8, 5, 5), (0, 1, 1), (1, 1, 1)],
)
def test_number_of_deferred_microbatches(limit, m, expect):
    par = ParallelConfig(
        pipeline_model_parallel_size=2,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=limit,
        micro_batch_size=1,
        global_batch_size=4 * m,
        world_size=8,
    )
    assert par.num_microbatches == m and par.num_deferred_microbatches == expect
    assert ParallelConfig(world_size=8).num_deferred_microbatches == 0


# --------------------------------------------------------------------------- gradients

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
_cache = {}


def _run(m, *, sp, tied, defer, limit=0, mode="stash", mesh=(2, 2, 2)):
    dp, tp, pp = mesh
    cfg = GPTConfig(**CFG, untie_embeddings_and_output_weights=not tied)
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=2 * dp * m,
        sequence_parallel=sp,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=defer,
        wgrad_deferral_limit=limit,
        defer_mode=mode,
    )
    validate(par, cfg)
    mesh_ = make_mesh(par)
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, 64)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh_, s), param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
    )
    stages = lay_out(GPTProgram(cfg, par))
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(stages, mesh_, p, t))(
        jax.device_put(params, shardings), jax.device_put(tokens, NamedSharding(mesh_, P("data")))
    )
    return float(loss), jax.tree.map(np.asarray, grads), (params, tokens, cfg)


def _baseline(m, sp, tied, mesh=(2, 2, 2)):
    key = (m, sp, tied, mesh)
    if key not in _cache:
        loss, grads, (params, tokens, cfg) = _run(m, sp=sp, tied=tied, defer=False, mesh=mesh)
        ref_loss, ref_grads = jax.value_and_grad(reference_loss)(params, tokens, cfg)
        _cache[key] = (loss, grads, float(ref_loss), jax.tree.map(np.asarray, ref_grads))
    return _cache[key]


def _close(a, b, tol):
    flat, _ = jax.tree_util.tree_flatten_with_path(a)
    for (path, g), r in zip(flat, jax.tree.leaves(b)):
        diff, scale = np.abs(g - r).max(), np.abs(r).max()
        assert diff <= tol * scale, (
            f"{jax.tree_util.keystr(path)}: {diff:.3g} > {tol} x {scale:.3g}"
        )


def _check(m, limit, sp, tied, mode, mesh=(2, 2, 2)):
    base_loss, base_grads, ref_loss, ref_grads = _baseline(m, sp, tied, mesh)
    loss, grads, _ = _run(m, sp=sp, tied=tied, defer=True, limit=limit, mode=mode, mesh=mesh)
    assert jax.tree.structure(grads) == jax.tree.structure(base_grads)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    _close(grads, base_grads, 1e-6)  # = the non-deferred run
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads, 1e-5)  # = single-device jax.grad (as test_pipeline)


@needs_fusion
@pytest.mark.parametrize(
    "m, limit, sp, tied, mode",
    [
        (2, 0, True, True, "stash"),
        pytest.param(5, 2, True, False, "stash", marks=pytest.mark.slow),  # suite time
        pytest.param(1, 1, False, True, "stash", marks=pytest.mark.slow),  # suite time
        pytest.param(5, 0, True, True, "recompute", marks=pytest.mark.slow),  # suite time
        (2, 1, False, False, "recompute"),
    ],
    ids=str,
)
def test_deferred_equals_non_deferred(m, limit, sp, tied, mode):
    _check(m, limit, sp, tied, mode)


def _grid():
    for m in (1, 2, 5, 8):
        for limit in sorted({0, 1, 2, m - 1, m, m + 3} - ({-1} if m > 1 else {-1})):
            if limit < 0:
                continue
            for sp in (False, True):
                for tied in (True, False):
                    for mode in ("stash", "recompute"):
                        yield m, limit, sp, tied, mode


@needs_fusion
@pytest.mark.slow
@pytest.mark.parametrize("m, sp, tied, mode", sorted({g[:1] + g[2:] for g in _grid()}), ids=str)
def test_full_grid(m, sp, tied, mode):
    for limit in sorted({0, 1, 2, m - 1, m, m + 3} - {-1}):
        if limit >= 0:
            _check(m, limit, sp, tied, mode)


# --------------------------------------------------------------------------- HLO


def _operands(line: str) -> list[str]:
    rhs = line.split("=", 1)[1]
    rhs = re.sub(
        r"(branch_computations=\{[^}]*\}|calls=%[\w.\-]+|to_apply=%[\w.\-]+"
        r"|body=%[\w.\-]+|condition=%[\w.\-]+|metadata=\{.*)",
        "",
        rhs,
    )
    return re.findall(r"%([\w.\-]+)", rhs)


@needs_fusion
def test_drain_ring_overlaps_gemms_with_permutes():
    """Compiled train-step gradients, (1, 4, 2) mesh with SP: in the drain's loop body the
    k-th fused GEMM depends on the permutes of ring steps < k only (2 acyclic permutes per
    step), never on the one issued beside it; no all-gather feeds the drain; and the
    schedule starts GEMMs before the last permute (no wait for a whole gather)."""
    cfg = GPTConfig(**CFG)
    tp = 4
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=3,
        sequence_parallel=True,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=True,
    )
    mesh = make_mesh(par)
    stages = lay_out(GPTProgram(cfg, par))
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    sh = jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
    )
    fn = jax.jit(
        lambda p, t: pipeline_gradients(stages, mesh, p, t),
        in_shardings=(sh, NamedSharding(mesh, P("data"))),
    )
    hlo = fn.lower(params, jax.ShapeDtypeStruct((3, 9), jnp.int32)).compile().as_text()
    comps = computations(hlo)
    bodies = [
        n
        for n, lines in comps.items()
        if any("collective-permute" in l and "deferred_wgrad_ring" in l for l in lines)
    ]
    assert len(bodies) == 1, bodies
    lines = comps[bodies[0]]
    assert not any("all-gather" in l for l in lines)
    defs = {}
    order = []
    for l in lines:
        m = re.match(r"(?:ROOT )?%([\w.\-]+) = ", l)
        if m:
            defs[m.group(1)] = l
            order.append(m.group(1))

    def ancestors(name, seen=None):
        seen = set() if seen is None else seen
        for op in _operands(defs[name]):
            if op in defs and op not in seen:
                seen.add(op)
                ancestors(op, seen)
        return seen

    # The GEMMs are the `active` conditionals (fused op in their true branch).
    gemms = [n for n in order if " conditional(" in defs[n] and "deferred_wgrad_ring" in defs[n]]
    permutes = [n for n in order if "collective-permute(" in defs[n]]
    assert len(gemms) == tp and len(permutes) == 2 * (tp - 1)
    for l in (defs[g] for g in gemms):
        branches = re.search(r"branch_computations=\{([^}]*)\}", l).group(1)
        assert any(
            'custom_call_target="jax_wgrad_wgrad_accumulate"' in x
            for b in branches.split(",")
            for x in comps[b.strip().lstrip("%")]
        )
    for g in gemms:
        ring = int(re.search(r"deferred_wgrad_ring(\d+)", defs[g]).group(1))
        n_perm = sum(1 for a in ancestors(g) if a in permutes)
        assert n_perm == 2 * ring, (g, ring, n_perm)
    assert order.index(gemms[0]) < order.index(permutes[-1])


def _primitives(jaxpr) -> set[str]:
    """Every primitive of ``jaxpr`` and of the jaxprs nested in it."""
    return {e.primitive.name for e in jaxpr_eqns(jaxpr)}


@needs_fusion
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("mode", ["stash", "recompute"])
def test_drain_conditionals_hold_only_the_gemm_work(sp, mode):
    """The drain's conditionals on ``active`` (the last stage) hold the fused GEMM (and,
    recomputing, the rebuild of ``dy``) but no slice at a traced position: XLA:GPU makes
    such a slice an asynchronous copy, which keeps the conditional out of a CUDA graph
    (a host sync per item and ring step). The loop and the slices run on every device."""
    tp, m, mb, s, h, v = 2, 3, 1, 8, 4, 6
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=2,
        micro_batch_size=mb,
        global_batch_size=m,
        sequence_parallel=sp,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=True,
        defer_mode=mode,
        world_size=tp * 2,
    )
    tokens = s // tp if sp else s
    x = jnp.zeros((m, mb, tokens, h), jnp.bfloat16)
    if mode == "stash":
        stash, recompute = (x, jnp.zeros((m, mb, s, v), jnp.bfloat16)), None
    else:
        stash = (x, jnp.zeros((m, mb, s), jnp.float32), jnp.zeros((m, mb, s), jnp.int32))
        recompute = lambda x, extras: (extras[0][..., None] + jnp.zeros(v)).astype(x.dtype)

    def per_device(bucket, *stash):
        active = jax.lax.axis_index("tensor") == 0  # traced, as "the last stage" is
        return deferred.drain(par, stash, bucket, 0, recompute, active=active)

    mesh = jax.make_mesh((tp,), ("tensor",), devices=jax.devices()[:tp])
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P("tensor"), check_vma=False)
    jaxpr = jax.make_jaxpr(fn)(jnp.zeros(v * h, jnp.float32), *stash).jaxpr
    conds = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "cond"]
    assert len(conds) == (tp if sp else 1)
    for eqn in conds:
        idle, busy = (_primitives(b.jaxpr) for b in eqn.params["branches"])
        assert "dynamic_slice" not in idle | busy, busy
        assert any("wgrad" in p for p in busy), busy
    # the loop over the stash runs outside the conditionals
    assert "scan" in {e.primitive.name for e in jaxpr.eqns} or "scan" in _primitives(jaxpr)
    assert not any("scan" in _primitives(b.jaxpr) for e in conds for b in e.params["branches"])
