"""One-program 1F1B pipeline: a ``lax.scan`` over schedule ticks inside ``shard_map``.

Schedule (``P`` stages, ``M`` microbatches, stage ``s``, tick ``t``)::

    forward  of microbatch f = t - s            when 0 <= f < M
    backward of microbatch b = t - (2P - 2 - s)  when 0 <= b < M
    T = M + 2P - 2 ticks

Within a tick a stage first runs its forward, then its backward; the last stage runs
the backward of the microbatch it just forwarded. At the end of every tick activations
move ``s -> s+1`` and gradients ``s+1 -> s`` with two acyclic ``ppermute``\\ s. A stage
with no forward (warm-up/cool-down) or no backward in a tick skips that compute with
``lax.cond``, so the whole step costs ``(M + P - 1) * (F + B)`` like Megatron's 1F1B.
Stage ``s`` holds at most ``2 (P - 1 - s) + 1`` microbatches in flight, so the carry has
``K = 2P - 1`` activation slots whatever ``M`` is, and the scan keeps compile time
independent of ``M``.

Backward of a microbatch is an explicit ``jax.vjp`` of the stage, recomputing its forward
from the stored stage INPUT (Megatron's full activation recompute). Storing vjp residuals
instead would be wrong with gradient accumulation fusion: the fused ``custom_vjp`` saves
the main-grad accumulator at forward time and would accumulate into a stale copy.

Gradients accumulate in fp32 in the scan carry (``acc``, same tree as the parameters).
With fusion every linear weight's entry of ``acc`` is the main-grad buffer that the fused
op updates; all other entries (and all entries without fusion) accumulate ordinary
gradients. ``acc`` holds the gradient of the mean token loss of the GLOBAL batch: each
microbatch backward is seeded with ``1 / (global_batch_size * seq_length)``.

After the scan: sum over ``data`` (plain all-reduce; the bucket issue replaces it), sum
of embedding/head gradients over ``pipeline`` (only the first and last stage contribute:
this is Megatron's embedding-group all-reduce for tied weights, and keeps the pipeline
replicas of those parameters identical), and with sequence parallelism the sum over
``tensor`` of the gradients of tensor-replicated parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.gpt import LINEAR_LAYERS, GPTStages, param_specs, sequence_parallel_replicated

__all__ = ["PipelineCarry", "schedule", "num_slots", "num_ticks", "stage_gradients",
           "pipeline_gradients"]

Params = dict[str, Any]


def num_ticks(num_stages: int, num_microbatches: int) -> int:
    """``T = M + 2P - 2``."""
    return num_microbatches + 2 * num_stages - 2


def num_slots(num_stages: int) -> int:
    """Activation slots per stage, ``2P - 1`` (independent of ``M``)."""
    return 2 * num_stages - 1


def schedule(num_stages: int, num_microbatches: int) -> list[list[tuple[int | None, int | None]]]:
    """The tick table: ``table[t][s] = (forward microbatch, backward microbatch)``,
    ``None`` for a skipped (bubble) slot. Pure Python, for docs and tests."""
    p, m = num_stages, num_microbatches
    table = []
    for t in range(num_ticks(p, m)):
        row = []
        for s in range(p):
            f, b = t - s, t - (2 * p - 2 - s)
            row.append((f if 0 <= f < m else None, b if 0 <= b < m else None))
        table.append(row)
    return table


class PipelineCarry(NamedTuple):
    """Per-device state carried across ticks (O(P) activations, not O(M))."""

    acc: Params
    """fp32 gradient / main-grad accumulators, same tree as the local parameters."""
    slots: jax.Array
    """``[2P-1, mb, s(/tp), H]`` stage inputs of in-flight microbatches."""
    x_recv: jax.Array
    """``[mb, s(/tp), H]`` activation received from stage ``s-1`` last tick."""
    g_recv: jax.Array
    """``[mb, s(/tp), H]`` gradient received from stage ``s+1`` last tick."""
    loss_sum: jax.Array
    """fp32 scalar: sum of token losses computed on this device (last stage)."""


def _add(a: Params, b: Params) -> Params:
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def _layer_main_grads(acc_layers: Params) -> dict[str, jax.Array]:
    return {n: acc_layers[n]["weight"] for n in LINEAR_LAYERS}


def _set_layer_main_grads(acc_layers: Params, mg: dict[str, jax.Array]) -> Params:
    out = dict(acc_layers)
    for n in LINEAR_LAYERS:
        out[n] = {**acc_layers[n], "weight": mg[n]}
    return out


def _output_weight_path(stages: GPTStages) -> tuple[str, ...]:
    if stages.tied:
        return ("embedding", "word", "embedding")
    return ("head", "output", "weight")


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Params, path: tuple[str, ...], value: Any) -> Params:
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def stage_gradients(
    stages: GPTStages, params: Params, tokens: jax.Array
) -> tuple[Params, jax.Array]:
    """Per-device body (call inside ``shard_map`` over ``(data, tensor, pipeline)``).

    Args:
      stages: the model pieces for this layout.
      params: this device's parameter shards; layers ``[L/P, ...]``.
      tokens: int ``[global_batch / dp, S + 1]`` this data rank's sequences.
    Returns:
      ``(grads, loss)``: fp32 gradients of the global mean loss (this device's shards,
      already reduced over ``data`` / ``pipeline`` / ``tensor`` as needed) and the
      global mean loss.
    """
    par, cfg = stages.parallel, stages.model
    pp, tp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    m, mb = par.num_microbatches, par.micro_batch_size
    fusion, sp = par.gradient_accumulation_fusion, par.sequence_parallel
    seq = cfg.seq_length
    s_local = seq // tp if sp else seq
    dtype = jnp.dtype(cfg.compute_dtype)
    scale = 1.0 / (par.global_batch_size * seq)
    k_slots = num_slots(pp)
    out_path = _output_weight_path(stages)

    if tokens.shape != (m * mb, seq + 1):
        raise ValueError(
            f"stage_gradients: expected local tokens [{m * mb}, {seq + 1}], got {tokens.shape}"
        )
    micro = tokens.reshape(m, mb, seq + 1)
    stage = lax.axis_index("pipeline") if pp > 1 else jnp.int32(0)
    is_first = stage == 0
    is_last = stage == pp - 1
    act = jnp.zeros((mb, s_local, cfg.hidden_size), dtype)
    shared_params = {"embedding": params["embedding"], "head": params["head"]}

    def take(i):
        return lax.dynamic_index_in_dim(micro, jnp.clip(i, 0, m - 1), 0, keepdims=False)

    def forward(c: PipelineCarry, f) -> tuple[jax.Array, jax.Array]:
        ids = take(f)[:, :-1]
        x_in = lax.cond(
            is_first, lambda: stages.embed(params["embedding"], ids), lambda: c.x_recv
        )
        # The last stage only stores its input: its backward recomputes everything.
        y = lax.cond(
            is_last, lambda: act, lambda: stages.layers(params["layers"], None, x_in)
        )
        slots = lax.dynamic_update_index_in_dim(c.slots, x_in, f % k_slots, 0)
        return slots, y

    def head_backward(shared_acc: Params, h, labels):
        if fusion:
            def fn(p, mg, x):
                return stages.head_loss(p, mg, x, labels)

            loss, vjp = jax.vjp(fn, shared_params, _get(shared_acc, out_path), h)
            dp, new_mg, dh = vjp(jnp.float32(scale))
            shared_acc = _set(_add(shared_acc, dp), out_path, new_mg)
        else:
            def fn(p, x):
                return stages.head_loss(p, None, x, labels)

            loss, vjp = jax.vjp(fn, shared_params, h)
            dp, dh = vjp(jnp.float32(scale))
            shared_acc = _add(shared_acc, dp)
        return dh, shared_acc, loss

    def embed_backward(shared_acc: Params, dx, ids):
        _, vjp = jax.vjp(lambda p: stages.embed(p, ids), params["embedding"])
        (dp,) = vjp(dx)
        return {**shared_acc, "embedding": _add(shared_acc["embedding"], dp)}

    def backward(c: PipelineCarry, b) -> tuple[Params, jax.Array, jax.Array]:
        tok = take(b)
        ids, labels = tok[:, :-1], tok[:, 1:]
        x_in = lax.dynamic_index_in_dim(c.slots, b % k_slots, 0, keepdims=False)
        acc = c.acc
        if fusion:
            h, layers_vjp = jax.vjp(
                stages.layers, params["layers"], _layer_main_grads(acc["layers"]), x_in
            )
        else:
            h, layers_vjp = jax.vjp(
                lambda p, x: stages.layers(p, None, x), params["layers"], x_in
            )
        shared_acc = {"embedding": acc["embedding"], "head": acc["head"]}
        dh, shared_acc, loss = lax.cond(
            is_last,
            lambda a: head_backward(a, h, labels),
            lambda a: (c.g_recv, a, jnp.float32(0.0)),
            shared_acc,
        )
        if fusion:
            dp, new_mg, dx = layers_vjp(dh)
            acc_layers = _set_layer_main_grads(_add(acc["layers"], dp), new_mg)
        else:
            dp, dx = layers_vjp(dh)
            acc_layers = _add(acc["layers"], dp)
        shared_acc = lax.cond(
            is_first, lambda a: embed_backward(a, dx, ids), lambda a: a, shared_acc
        )
        return {**shared_acc, "layers": acc_layers}, dx, loss

    def tick(c: PipelineCarry, t) -> tuple[PipelineCarry, None]:
        f = t - stage
        b = t - (2 * pp - 2 - stage)
        do_fwd = (f >= 0) & (f < m)
        do_bwd = (b >= 0) & (b < m)
        with jax.named_scope("forward"):
            slots, y = lax.cond(do_fwd, forward, lambda c, f: (c.slots, act), c, f)
        c = c._replace(slots=slots)
        with jax.named_scope("backward"):
            acc, dx, loss = lax.cond(
                do_bwd, backward, lambda c, b: (c.acc, act, jnp.float32(0.0)), c, b
            )
        if pp > 1:
            with jax.named_scope("send_recv"):
                x_recv = lax.ppermute(y, "pipeline", [(i, i + 1) for i in range(pp - 1)])
                g_recv = lax.ppermute(dx, "pipeline", [(i + 1, i) for i in range(pp - 1)])
        else:
            x_recv, g_recv = act, act
        return PipelineCarry(acc, slots, x_recv, g_recv, c.loss_sum + loss), None

    carry = PipelineCarry(
        acc=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        slots=jnp.zeros((k_slots, *act.shape), dtype),
        x_recv=act,
        g_recv=act,
        loss_sum=jnp.float32(0.0),
    )
    carry, _ = lax.scan(tick, carry, jnp.arange(num_ticks(pp, m)))
    return _finalize(stages, carry.acc, carry.loss_sum * scale)


def _finalize(stages: GPTStages, acc: Params, loss: jax.Array) -> tuple[Params, jax.Array]:
    par = stages.parallel
    with jax.named_scope("finalize_grads"):
        if par.data_parallel_size > 1:
            acc = lax.psum(acc, "data")
            loss = lax.psum(loss, "data")
        if par.pipeline_model_parallel_size > 1:
            shared = lax.psum({"embedding": acc["embedding"], "head": acc["head"]}, "pipeline")
            acc = {**acc, **shared}
            loss = lax.psum(loss, "pipeline")
        if par.sequence_parallel:
            replicated = sequence_parallel_replicated(param_specs(stages.model))
            acc = jax.tree.map(
                lambda g, r: lax.psum(g, "tensor") if r else g, acc, replicated
            )
    return acc, loss


def pipeline_gradients(
    stages: GPTStages, mesh: Mesh, params: Params, tokens: jax.Array
) -> tuple[Params, jax.Array]:
    """Gradients and mean loss of one global batch; traceable under ``jax.jit``.

    Args:
      params: canonical parameters sharded as :func:`jax_wgrad.gpt.param_specs`.
      tokens: int ``[global_batch_size, S + 1]`` sharded over ``data``.
    Returns:
      ``(grads, loss)``: fp32 gradients sharded like ``params`` and the scalar loss.
    """
    specs = param_specs(stages.model)
    fn = jax.shard_map(
        lambda p, t: stage_gradients(stages, p, t),
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=(specs, P()),
        check_vma=False,
    )
    return fn(params, tokens)
