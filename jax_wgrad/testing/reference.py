"""A plain single-device GPT in ``jnp``, independent of the library's layers.

Use it to check any layout: the loss and the ``jax.grad`` of :func:`reference_loss` on the
canonical parameters must equal what the pipelined, sharded train step computes::

    grads = jax.grad(jax_wgrad.testing.reference_loss)(params, tokens, cfg)

An MoE model's layers (``cfg.moe_layer_pattern``) use the dense MoE reference
(:func:`~jax_wgrad.testing.reference_moe_mlp`: every token through its top-k experts, no
capacity) -- equal to the expert-parallel layer whenever no token is dropped. A
sliding window (``cfg.window_size``) is applied by this module's own mask.

With FP8 (``cfg.fp8_format``) the transformer layers' linears are the quantize-dequantize
model written plainly (:func:`fp8_reference_linear`): float32 GEMMs at ``HIGHEST`` of the
quantized-then-dequantized input and weight, the output gradient quantized-dequantized in
the backward, every quantized tensor's gradient passed straight through. Activations are
scaled per microbatch of ``micro_batch_size`` sequences, as the training step does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_wgrad.functional.fp8 import Fp8Recipe, quantize
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.testing.moe_reference import reference_moe_mlp

__all__ = ["fp8_reference_linear", "reference_loss", "reference_logits"]


def _qdq(x: jax.Array, dtype) -> jax.Array:
    """``x`` quantized to ``dtype`` with its per-tensor scale, dequantized in float32."""
    q = quantize(x, dtype)
    return q.value.astype(jnp.float32) * q.scale_inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _ste_qdq(x: jax.Array, dtype) -> jax.Array:
    """:func:`_qdq` whose gradient passes straight through."""
    return _qdq(x, dtype)


_ste_qdq.defvjp(lambda x, dtype: (_qdq(x, dtype), None), lambda dtype, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _qdq_gradient(y: jax.Array, dtype) -> jax.Array:
    """Identity whose gradient is quantized-dequantized (an output gradient's FP8)."""
    return y


_qdq_gradient.defvjp(lambda y, dtype: (y, None), lambda dtype, _, g: (_qdq(g, dtype),))


def fp8_reference_linear(
    x: jax.Array, w: jax.Array, b: jax.Array | None, recipe: Fp8Recipe
) -> jax.Array:
    """``x [..., in] @ w [out, in]^T + b`` as FP8 training computes it, written plainly:
    float32 GEMMs of the quantize-dequantized ``x`` and ``w`` (E4M3), the output
    gradient quantize-dequantized (E5M2 in ``hybrid``) before it reaches them, the bias
    and its gradient in float32. ``[..., out]`` float32."""
    y = jnp.einsum(
        "...i,oi->...o",
        _ste_qdq(x, recipe.forward_dtype),
        _ste_qdq(w, recipe.forward_dtype),
        precision=jax.lax.Precision.HIGHEST,
    )
    y = _qdq_gradient(y, recipe.gradient_dtype)
    return y if b is None else y + b


def _norm(x, p, cfg: GPTConfig):
    xf = x.astype(jnp.float32)
    if cfg.normalization == "RMSNorm":  # Hugging Face's LlamaRMSNorm
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + cfg.layernorm_epsilon)
        return y.astype(x.dtype) * p["scale"].astype(x.dtype)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) / jnp.sqrt(var + cfg.layernorm_epsilon) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def _dense(x, p, w="weight", b="bias", fp8: Fp8Recipe | None = None):
    if fp8 is not None:
        weight = p[w].reshape(-1, p[w].shape[-1])  # SwiGLU's [2, F, H]: one GEMM
        return fp8_reference_linear(x, weight, p.get(b), fp8).astype(x.dtype)
    y = x @ p[w].T.astype(x.dtype)
    return y + p[b].astype(x.dtype) if b in p else y


def _rope(x, cfg: GPTConfig):
    """``x [b, s, heads, d]``: Hugging Face Llama's rotary embedding (rotate_half), with
    Llama 3.x's frequency scaling when ``cfg.rope_scaling``."""
    s, d = x.shape[1], x.shape[-1]
    rot = int(d * cfg.rotary_percent)
    inv = 1.0 / (cfg.rotary_base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    if cfg.rope_scaling:  # transformers' _compute_llama3_parameters, step by step
        factor, old = cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings
        low_wavelen = old / cfg.rope_scaling_low_freq_factor
        high_wavelen = old / cfg.rope_scaling_high_freq_factor
        wavelen = 2 * math.pi / inv
        llama = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - cfg.rope_scaling_low_freq_factor) / (
            cfg.rope_scaling_high_freq_factor - cfg.rope_scaling_low_freq_factor
        )
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = jnp.logical_not(wavelen < high_wavelen) & jnp.logical_not(wavelen > low_wavelen)
        inv = jnp.where(medium, smoothed, llama)
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None]
    emb = jnp.concatenate([ang, ang], -1)
    cos, sin = (f(emb)[None, :, None].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    xr = x[..., :rot]
    half = jnp.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return jnp.concatenate([xr * cos + half * sin, x[..., rot:]], -1)


def _allowed(s: int, cfg: GPTConfig) -> jax.Array:
    """bool ``[s, s]``: query ``i`` sees key ``j``. Causal, and with Megatron's
    ``window_size (left, 0)`` only the ``left`` keys before the query besides itself
    (Hugging Face's ``sliding_window = left + 1``: ``kv_idx > q_idx - sliding_window``)."""
    q = jnp.arange(s)[:, None]
    kv = jnp.arange(s)[None, :]
    allowed = kv <= q
    if cfg.window_size is not None:
        allowed = allowed & (q - kv <= cfg.window_size[0])
    return allowed


def _attention(x, p, cfg: GPTConfig):
    b, s, _ = x.shape
    g, d = cfg.query_groups, cfg.head_dim
    m = cfg.num_attention_heads // g
    fp8 = cfg.fp8_config()
    qkv = _dense(_norm(x, p["ln1"], cfg), p["qkv"], fp8=fp8).reshape(b, s, g, m + 2, d)
    q, k, v = qkv[:, :, :, :m], qkv[:, :, :, m], qkv[:, :, :, m + 1]  # q [b, s, g, m, d]
    if cfg.qk_layernorm:
        q, k = _norm(q, p["q_norm"], cfg), _norm(k, p["k_norm"], cfg)
    if cfg.position_embedding_type == "rope":
        q = _rope(q.reshape(b, s, g * m, d), cfg).reshape(b, s, g, m, d)
        k = _rope(k, cfg)
    sc = jnp.einsum("bqgmd,bkgd->bgmqk", q, k, preferred_element_type=jnp.float32)
    sc = jnp.where(_allowed(s, cfg), sc / math.sqrt(d), -jnp.inf)
    a = jnp.einsum("bgmqk,bkgd->bqgmd", jax.nn.softmax(sc, -1).astype(v.dtype), v)
    return x + _dense(a.reshape(b, s, g * m * d), p["proj"], fp8=fp8)


def _mlp(h, p, cfg: GPTConfig):
    fp8 = cfg.fp8_config()
    if not cfg.swiglu:
        hidden = jax.nn.gelu(_dense(h, p["fc1"], fp8=fp8), approximate=False)
        return _dense(hidden, p["fc2"], fp8=fp8)
    if fp8 is not None:  # the fused gate and up projection: one GEMM, one scale
        gate, up = jnp.split(_dense(h, p["fc1"], fp8=fp8), 2, axis=-1)
        return _dense(jax.nn.silu(gate) * up, p["fc2"], fp8=fp8)
    w, bias = p["fc1"]["weight"], p["fc1"].get("bias")
    gate, up = (
        _dense(h, {"weight": w[i], **({} if bias is None else {"bias": bias[i]})}) for i in (0, 1)
    )
    return _dense(jax.nn.silu(gate) * up, p["fc2"])


def _in_bf16(layer_no: int, cfg: GPTConfig) -> bool:
    """Megatron's ``is_first_last_bf16_layer`` (``fp8_utils.py``): layer ``layer_no`` runs
    without FP8."""
    if not cfg.first_last_layers_bf16:
        return False
    return (
        layer_no < cfg.num_layers_at_start_in_bf16
        or layer_no >= cfg.num_layers - cfg.num_layers_at_end_in_bf16
    )


def _forward(params: dict[str, Any], ids: jax.Array, cfg: GPTConfig, mb: int, dtype):
    """``(fp32 logits [B, S, V], the MoE layers' aux loss)``, computed in ``dtype``."""
    b, s = ids.shape
    emb = params["embedding"]
    x = emb["word"]["embedding"][ids].astype(dtype)
    if "position" in emb:
        x = x + emb["position"][:s][None].astype(dtype)
    moe_cfg = cfg.moe_config()

    def moe(x, p, cfg):
        x = _attention(x, p, cfg)
        h = _norm(x, p["ln2"], cfg).reshape(b // mb, mb * s, -1)
        w = {"router": p["router"], **p["experts"]}
        y, aux = jax.vmap(lambda t: reference_moe_mlp(w, t, moe_cfg))(h)
        y = y.reshape(x.shape).astype(dtype)
        if "shared_expert" in p:  # Megatron's shared experts: a dense MLP beside them
            y = y + _mlp(_norm(x, p["ln2"], cfg), p["shared_expert"], cfg)
        return x + y, jnp.mean(aux)

    def layers(x):
        aux_total = jnp.float32(0.0)
        index = {"layers": 0, "moe_layers": 0}
        for layer_no, is_moe in enumerate(cfg.moe_layer_pattern):
            key = "moe_layers" if is_moe else "layers"
            p = jax.tree.map(lambda a, i=index[key]: a[i], params[key])
            index[key] += 1
            lcfg = cfg.without_fp8() if _in_bf16(layer_no, cfg) else cfg
            if is_moe:
                x, aux = moe(x, p, lcfg)
                aux_total = aux_total + aux
            else:
                x = _attention(x, p, lcfg)
                x = x + _mlp(_norm(x, p["ln2"], lcfg), p, lcfg)
        return x, aux_total

    if cfg.fp8_format is None:
        x, aux_total = layers(x)
    else:  # FP8 scales activations per microbatch: the layers per microbatch
        b = mb
        x, aux = jax.vmap(layers)(x.reshape(-1, mb, *x.shape[1:]))
        x, aux_total = x.reshape(-1, *x.shape[2:]), jnp.mean(aux)
    head = params["head"]
    x = _norm(x, head["final_norm"], cfg)
    w = head["output"]["weight"] if "output" in head else emb["word"]["embedding"]
    w = w[: cfg.vocab_size]  # a padded vocabulary's padding rows: no tokens, no logits
    return (x @ w.T.astype(dtype)).astype(jnp.float32), aux_total


def reference_logits(params: dict[str, Any], ids: jax.Array, cfg: GPTConfig) -> jax.Array:
    """fp32 ``[B, S, V]`` logits of a plain single-device model of ``cfg`` for int ``ids``
    ``[B, S]`` (in ``cfg.compute_dtype``, as Hugging Face runs a model of that dtype)."""
    return _forward(params, ids, cfg, ids.shape[0], jnp.dtype(cfg.compute_dtype))[0]


def reference_loss(
    params: dict[str, Any],
    tokens: jax.Array,
    cfg: GPTConfig,
    *,
    micro_batch_size: int | None = None,
) -> jax.Array:
    """Mean next-token cross entropy of a plain single-device fp32 model.

    ``tokens``: int ``[B, S + 1]``; inputs are ``tokens[:, :-1]``, labels
    ``tokens[:, 1:]``. Independent of the parallel layers (no collectives, no NNX).

    An MoE model adds every MoE layer's load-balancing loss, computed (as in training) per
    microbatch of ``micro_batch_size`` consecutive sequences and averaged over them.
    """
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    logits, aux = _forward(params, ids, cfg, micro_batch_size or ids.shape[0], jnp.float32)
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)) + aux
