"""The comparison the GPT's layout tests share: the pipelined, sharded step's loss and
gradients against ``jax.grad`` of the single-device reference
(:func:`jax_wgrad.testing.reference_loss`) on the same canonical parameters and tokens."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import GPTProgram, init_params, make_mesh, pipeline_gradients
from jax_wgrad.layout import lay_out
from jax_wgrad.testing import reference_loss

LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    group_query_attention=True,
    num_attention_heads=4,
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
"""The Llama options of the small GPTs these comparisons run (4 heads, 2 query groups)."""


def pipeline_and_reference(cfg, par, *, ddp=None, table=None, micro_batch_size=None):
    """``(loss, ref_loss, grads, ref_grads)`` of one step of ``cfg`` laid out as ``par``
    (on the first ``par.world_size`` devices) and of the reference, canonical trees.
    ``micro_batch_size``: the reference's (MoE aux loss and FP8 scales per microbatch)."""
    mesh = make_mesh(par, jax.devices()[: par.world_size])
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, 64)
    ref_loss, ref_grads = jax.value_and_grad(reference_loss)(
        params, tokens, cfg, micro_batch_size=micro_batch_size
    )
    stages = lay_out(GPTProgram(cfg, par))
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), stages.param_specs(), is_leaf=lambda x: isinstance(x, P)
    )
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(stages, mesh, p, t, ddp, table=table))(
        jax.device_put(stages.from_canonical(params), shardings),
        jax.device_put(tokens, NamedSharding(mesh, P("data"))),
    )
    grads = stages.to_canonical(grads)  # the interleaved layout's layer stacks -> [L, ...]
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    return loss, ref_loss, grads, ref_grads


def assert_grads_close(loss, ref_loss, grads, ref_grads, tol=1e-5):
    """The losses within ``tol`` relative, every gradient within ``tol`` of its largest
    element (which must not be zero)."""
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=tol)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g), np.asarray(r)
        diff, scale = np.abs(g - r).max(), np.abs(r).max()
        assert scale > 0, jax.tree_util.keystr(path)
        assert diff <= tol * scale, (
            f"{jax.tree_util.keystr(path)}: {diff:.3g} > {tol} x {scale:.3g}"
        )
