"""The layer scan writing what its backward reads straight into the pipeline's residual
slots (``scan_layers(slots=ResidualSlots)``): the same gradients as JAX's own scan
autodiff, bit for bit, in every recompute form; the activations live only in the slot
buffers (the pullback keeps the weights live and nothing of the microbatch); a forward
writes its own slot and nothing else; integer residuals survive the trip. A run of layers
unrolled whole writes none (it stacks nothing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad.functional import scan_layers
from jax_wgrad.functional.residual_slots import ResidualSlots, carrier_dtype
from jax_wgrad.functional.stacked import LayerRecompute

N, B, H = 6, 3, 8


def _layer(p, h):
    """A layer with GEMMs, an integer residual (the top index, gathered by) and a norm."""
    a = jnp.tanh(h @ p["w1"])
    top = jnp.argmax(a, axis=-1)
    picked = jnp.take_along_axis(a, top[:, None], axis=-1)
    y = (a * p["g"]) @ p["w2"] + h * picked
    return y, jnp.sum(picked)


def _params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "w1": jax.random.normal(k[0], (N, H, H)) * 0.4,
        "w2": jax.random.normal(k[1], (N, H, H)) * 0.4,
        "g": 1.0 + 0.1 * jax.random.normal(k[2], (N, H)),
    }


def _layouts(recompute, rows, unroll):
    rec = ResidualSlots.recorder()
    jax.eval_shape(
        lambda p, x: scan_layers(
            _layer, x, p, recompute=recompute, rows=rows, unroll=unroll, slots=rec
        ),
        _params(),
        jnp.zeros((B, H)),
    )
    return rec.layouts


RECOMPUTE = [
    None,
    LayerRecompute("selective"),
    LayerRecompute("full", "uniform", 2),
    LayerRecompute("full", "block", 1),
]


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=["none", "selective", "uniform2", "block1"])
@pytest.mark.parametrize("unroll", [1, N], ids=["scan", "unrolled"])
def test_gradients_equal_the_scans_own_autodiff(recompute, unroll):
    params, x = _params(), jax.random.normal(jax.random.PRNGKey(5), (B, H))
    rows = (jnp.int32(2), 4) if unroll == 1 else None  # a model chunk's rows, traced
    count = 4 if rows else N
    layouts = _layouts(recompute, rows, unroll)
    # only loops write the slots (a run unrolled whole stacks nothing to avoid)
    assert (len(layouts) == 0) == (unroll == N), layouts
    slots_n, slot = 3, 1

    def plain(p, x):
        return scan_layers(_layer, x, p, recompute=recompute, rows=rows, unroll=unroll)

    (y_ref, aux_ref), pull_ref = jax.vjp(plain, params, x)
    ct = (jnp.cos(y_ref), jnp.ones((count,)))
    dp_ref, dx_ref = pull_ref(ct)

    def slotted(p, x, buffers):
        slots = ResidualSlots(buffers, jnp.int32(slot))
        y, aux = scan_layers(
            _layer, x, p, recompute=recompute, rows=rows, unroll=unroll, slots=slots
        )
        return (y, aux), tuple(slots.buffers)

    buffers = ResidualSlots.allocate(layouts, slots_n)
    buffers = jax.tree.map(lambda b: jnp.full(b.shape, 7, b.dtype), buffers)  # a sentinel
    ((y, aux), written), pull = jax.vjp(slotted, params, x, buffers)
    dp, dx, _ = pull((ct, written))  # the slots ride the backward as their own cotangent
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(aux, aux_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    for k in params:
        np.testing.assert_array_equal(dp[k], dp_ref[k], err_msg=k)
    # the forward wrote its own slot, nothing else
    if unroll == N:
        return
    for after in jax.tree.leaves(written):
        after = np.asarray(after, np.float32)
        others = np.delete(after, slot, axis=0)
        np.testing.assert_array_equal(others, np.full(others.shape, 7, np.float32))
        assert (after[slot] != 7).any()
    # what the pullback keeps: the weights (live: the same arrays) and int32 indices, no
    # activation of the microbatch (block 1's first layer is a run of one iteration,
    # traced without a loop: its residuals are JAX's)
    kept = jax.tree.leaves(pull)
    ids = {id(a) for a in jax.tree.leaves(params)}
    acts = [a.shape for a in kept if id(a) not in ids and a.dtype != jnp.int32]
    if recompute is None or recompute.method != "block":
        assert not acts, acts


def test_integer_residuals_ride_in_a_float_of_their_width():
    layouts = _layouts(None, None, 1)
    dtypes = {s.dtype for scan in layouts for s in scan}
    assert jnp.dtype(jnp.int32) in dtypes, dtypes  # the top index
    assert carrier_dtype(jnp.int32) == jnp.float32
    assert carrier_dtype(jnp.bool_) == jnp.float8_e4m3fn
    assert carrier_dtype(jnp.bfloat16) == jnp.bfloat16
    buffers = ResidualSlots.allocate(layouts, 2)
    assert all(jnp.issubdtype(b.dtype, jnp.floating) for b in jax.tree.leaves(buffers))


def test_slots_laid_out_for_another_function_are_refused():
    layouts = _layouts(None, None, 1)
    wrong = ResidualSlots.allocate(layouts, 2)[0][:-1]  # one buffer short

    def forward(buffers):
        slots = ResidualSlots(buffers, jnp.int32(0))
        return jax.vjp(lambda x: scan_layers(_layer, x, _params(), slots=slots), jnp.ones((B, H)))

    with pytest.raises(ValueError, match="differ from the slots laid out"):
        forward([wrong])
    with pytest.raises(ValueError, match="more layer scans"):
        forward([])
