"""A plain single-device GPT in ``jnp``, independent of the library's layers.

Use it to check any layout: the loss and the ``jax.grad`` of :func:`reference_loss` on the
canonical parameters must equal what the pipelined, sharded train step computes::

    grads = jax.grad(jax_wgrad.testing.reference_loss)(params, tokens, cfg)

An MoE model's layers (``cfg.moe_layer_pattern``) use the dense MoE reference
(:func:`~jax_wgrad.testing.reference_moe_mlp`: every token through its top-k experts, no
capacity) -- equal to the expert-parallel layer whenever no token is dropped.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.testing.moe_reference import reference_moe_mlp

__all__ = ["reference_loss"]


def _ln_ref(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_loss(params: dict[str, Any], tokens: jax.Array, cfg: GPTConfig, *,
                   micro_batch_size: int | None = None) -> jax.Array:
    """Mean next-token cross entropy of a plain single-device fp32 GPT.

    ``tokens``: int ``[B, S + 1]``; inputs are ``tokens[:, :-1]``, labels
    ``tokens[:, 1:]``. Independent of the parallel layers (no collectives, no NNX).

    An MoE model adds every MoE layer's load-balancing loss, computed (as in training) per
    microbatch of ``micro_batch_size`` consecutive sequences and averaged over them.
    """
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = ids.shape
    nh, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.layernorm_epsilon
    emb = params["embedding"]
    x = emb["word"]["embedding"][ids] + emb["position"][:s][None]

    def attention(x, p):
        h = _ln_ref(x, p["ln1"], eps)
        qkv = (h @ p["qkv"]["weight"].T + p["qkv"]["bias"]).reshape(b, s, nh, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, -1), v).reshape(b, s, nh * hd)
        return x + a @ p["proj"]["weight"].T + p["proj"]["bias"]

    def dense(x, p):
        x = attention(x, p)
        h = _ln_ref(x, p["ln2"], eps)
        h = jax.nn.gelu(h @ p["fc1"]["weight"].T + p["fc1"]["bias"], approximate=False)
        return x + h @ p["fc2"]["weight"].T + p["fc2"]["bias"]

    mb = micro_batch_size or b
    moe_cfg = cfg.moe_config()

    def moe(x, p):
        x = attention(x, p)
        h = _ln_ref(x, p["ln2"], eps).reshape(b // mb, mb * s, -1)
        w = {"router": p["router"], **p["experts"]}
        y, aux = jax.vmap(lambda t: reference_moe_mlp(w, t, moe_cfg))(h)
        return x + y.reshape(x.shape), jnp.mean(aux)

    aux_total = jnp.float32(0.0)
    index = {"layers": 0, "moe_layers": 0}
    for is_moe in cfg.moe_layer_pattern:
        key = "moe_layers" if is_moe else "layers"
        p = jax.tree.map(lambda a, i=index[key]: a[i], params[key])
        index[key] += 1
        if is_moe:
            x, aux = moe(x, p)
            aux_total = aux_total + aux
        else:
            x = dense(x, p)
    head = params["head"]
    x = _ln_ref(x, head["final_norm"], eps)
    w = head["output"]["weight"] if "output" in head else emb["word"]["embedding"]
    logits = x @ w.T
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)) + aux_total
