"""A plain single-device GPT in ``jnp``, independent of the library's layers.

Use it to check any layout: the loss and the ``jax.grad`` of :func:`reference_loss` on the
canonical parameters must equal what the pipelined, sharded train step computes::

    grads = jax.grad(jax_wgrad.testing.reference_loss)(params, tokens, cfg)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_wgrad.models.gpt.config import GPTConfig

__all__ = ["reference_loss"]


def _ln_ref(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_loss(params: dict[str, Any], tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Mean next-token cross entropy of a plain single-device fp32 GPT.

    ``tokens``: int ``[B, S + 1]``; inputs are ``tokens[:, :-1]``, labels
    ``tokens[:, 1:]``. Independent of the parallel layers (no collectives, no NNX).
    """
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = ids.shape
    nh, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.layernorm_epsilon
    emb = params["embedding"]
    x = emb["word"]["embedding"][ids] + emb["position"][:s][None]

    def layer(x, p):
        h = _ln_ref(x, p["ln1"], eps)
        qkv = (h @ p["qkv"]["weight"].T + p["qkv"]["bias"]).reshape(b, s, nh, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, -1), v).reshape(b, s, nh * hd)
        x = x + a @ p["proj"]["weight"].T + p["proj"]["bias"]
        h = _ln_ref(x, p["ln2"], eps)
        h = jax.nn.gelu(h @ p["fc1"]["weight"].T + p["fc1"]["bias"], approximate=False)
        return x + h @ p["fc2"]["weight"].T + p["fc2"]["bias"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    head = params["head"]
    x = _ln_ref(x, head["final_norm"], eps)
    w = head["output"]["weight"] if "output" in head else emb["word"]["embedding"]
    logits = x @ w.T
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))
