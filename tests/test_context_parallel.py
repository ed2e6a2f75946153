"""Context parallelism (Megatron's ``--context-parallel-size``, ``--cp-comm-type``): the
attention core over a sequence split across the ``context`` axis against
:func:`~jax_wgrad.functional.causal_attention` on the whole sequence, the GPT's gradients
against ``jax.grad`` of the single-device reference, the example's losses against CP 1, and
the refusals."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grad_util import LLAMA, assert_grads_close, pipeline_and_reference
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad import GPTConfig, GPTProgram, ParallelConfig, init_params
from jax_wgrad.functional import (
    ContextParallel,
    causal_attention,
    context_parallel_attention,
    context_positions,
    load_balanced_positions,
)
from jax_wgrad.models.gpt.config import validate
from jax_wgrad.testing import reference_loss

MULTI = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def test_load_balanced_positions_are_megatrons_chunks():
    """``get_batch_on_this_cp_rank``: 2 cp chunks, rank r holds r and 2 cp - 1 - r."""
    np.testing.assert_array_equal(load_balanced_positions(8, 2, 0), [0, 1, 6, 7])
    np.testing.assert_array_equal(load_balanced_positions(8, 2, 1), [2, 3, 4, 5])
    np.testing.assert_array_equal(load_balanced_positions(16, 4, 3), [6, 7, 8, 9])
    every = np.concatenate([load_balanced_positions(24, 3, r) for r in range(3)])
    np.testing.assert_array_equal(np.sort(every), np.arange(24))


def _split_attention(n, comm, *, heads=4, groups=2, window=None, shift="ppermute", s=32):
    """``(value, grads)`` of a weighted sum of the attention on ``n`` context ranks and of
    the whole-sequence reference, on the same inputs."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    keys = jax.random.split(jax.random.key(0), 4)
    b, d = 2, 8
    q = jax.random.normal(keys[0], (b, s, heads, d))
    k = jax.random.normal(keys[1], (b, s, groups, d))
    v = jax.random.normal(keys[2], (b, s, groups, d))
    w = jax.random.normal(keys[3], (b, s, heads * d))
    order = np.concatenate([load_balanced_positions(s, n, r) for r in range(n)])
    context = ContextParallel(n, comm, "context", shift)

    def local(q, k, v, w):
        pos = context_positions(s, n, "context")
        out = context_parallel_attention(q, k, v, pos, context, window=window)
        return jax.lax.psum(jnp.sum(out * w), "context")

    split = jax.shard_map(
        local, mesh=mesh, in_specs=(P(None, "context"),) * 4, out_specs=P(), check_vma=False
    )
    got = jax.jit(
        jax.value_and_grad(
            lambda q, k, v: split(q[:, order], k[:, order], v[:, order], w[:, order]), (0, 1, 2)
        )
    )(q, k, v)
    ref = jax.value_and_grad(
        lambda q, k, v: jnp.sum(causal_attention(q, k, v, window=window) * w), (0, 1, 2)
    )(q, k, v)
    return got, ref


@MULTI
@pytest.mark.parametrize(
    "n, comm, kw",
    [
        (2, "p2p", {}),
        (4, "p2p", dict(window=5)),
        # -m slow (suite time): the GPT tests run the ring's all-to-all shift on the CPU
        pytest.param(4, "p2p", dict(shift="all_to_all", heads=4, groups=4), marks=pytest.mark.slow),
        (4, "allgather", dict(window=5)),
        (2, "a2a", dict(window=5)),
        pytest.param(4, "a2a", dict(heads=8, groups=4), marks=pytest.mark.slow),
    ],
    ids=["p2p-2", "p2p-4-window", "p2p-4-alltoall-mha", "allgather-4-window", "a2a-2", "a2a-4"],
)
def test_split_attention_equals_the_whole_sequence(n, comm, kw):
    """Values and q/k/v gradients (the ring's, the gather's and the all-to-all's
    transposes) against the whole sequence's attention, GQA and sliding windows included."""
    (value, grads), (ref_value, ref_grads) = _split_attention(n, comm, **kw)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-6)


@MULTI
@pytest.mark.parametrize(
    "kw",
    [
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(cp_comm_type="allgather", pipeline_model_parallel_size=2),
        pytest.param(dict(cp_comm_type="a2a", world_size=4), marks=pytest.mark.slow),
        pytest.param(
            dict(
                context_parallel_size=4,
                pipeline_model_parallel_size=2,
                pipeline_schedule="zb-h1",
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                pipeline_model_parallel_size=2,
                defer_embedding_wgrad_compute=True,
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                world_size=4,
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(
                context_parallel_size=4,
                cp_comm_type="allgather",
                tensor_model_parallel_size=2,
                sequence_parallel=True,
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(cp_comm_type="a2a", pipeline_model_parallel_size=2, pipeline_schedule="zb-h1"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "p2p-tp2-sp",
        "allgather-pp2",
        "a2a",
        "cp4-pp2-zbh1",
        "tp2-pp2-deferred-recompute",
        "vp2",
        "allgather-cp4-tp2-sp",
        "a2a-pp2-zbh1",
    ],
)
def test_gpt_gradients_equal_the_single_device_reference(kw):
    """CP 2 (4) with tensor and sequence parallelism, the pipeline's schedules, deferred
    output-layer wgrads and recompute, fused wgrads into the buckets: the loss and every
    gradient against ``jax.grad`` of the single-device model on the whole sequences."""
    kw = dict(dict(context_parallel_size=2, world_size=8, gradient_accumulation_fusion=True), **kw)
    layers = 4 if kw.get("virtual_pipeline_model_parallel_size") else 2  # suite time
    cfg = GPTConfig(num_layers=layers, hidden_size=32, seq_length=8, vocab_size=64, **LLAMA)
    par = ParallelConfig(global_batch_size=4, **kw)
    assert_grads_close(*pipeline_and_reference(cfg, par))


@MULTI
@pytest.mark.slow
def test_moe_gradients_with_context_parallelism_equal_the_reference():
    """EP 2 beside CP 2 and TP 2: the router's load-balancing statistics summed over the
    whole sequence (tensor and context ranks), as the reference computes them."""
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        seq_length=8,
        vocab_size=64,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        **LLAMA,
    )
    par = ParallelConfig(
        context_parallel_size=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        gradient_accumulation_fusion=True,
        world_size=8,
        global_batch_size=4,
    )
    loss, ref_loss, grads, ref_grads = pipeline_and_reference(
        cfg, par, micro_batch_size=par.micro_batch_size
    )
    # the step reports the language-model loss; the reference's includes the aux loss
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, 64)  # pipeline_and_reference's
    params = init_params(cfg, seed=0)
    no_aux = dataclasses.replace(cfg, moe_aux_loss_coeff=0.0)
    lm_loss = reference_loss(params, tokens, no_aux, micro_batch_size=par.micro_batch_size)
    assert float(ref_loss) - float(lm_loss) > 1e-3  # the aux loss is in the gradients
    assert_grads_close(loss, lm_loss, grads, ref_grads)


def test_mesh_puts_the_context_ranks_after_the_tensor_ranks():
    """Megatron's rank order tp-cp-ep-dp-pp; gradients reduced over data x context."""
    from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL, EXPERT_DATA_PARALLEL, make_mesh

    par = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2, world_size=8)
    assert par.mesh_shape == (2, 1, 2, 2, 1)
    assert par.data_parallel_size == 2 and par.data_context_parallel_size == 4
    mesh = make_mesh(par, jax.devices()[:8])
    for d, c, t in np.ndindex(2, 2, 2):
        assert mesh.devices[d, 0, c, t, 0] == jax.devices()[t + 2 * (c + 2 * d)]
    assert DATA_CONTEXT_PARALLEL == ("data", "expert", "context")
    assert EXPERT_DATA_PARALLEL == ("data", "context")


@pytest.mark.parametrize(
    "model_kw, par_kw, message",
    [
        (
            dict(seq_length=12),
            dict(context_parallel_size=4),
            r"seq-length \(12\) should be a multiple of 2 \* context-parallel-size \(4\) if "
            r"context-parallel-size > 1\.",
        ),
        (
            dict(seq_length=12, num_query_groups=4),
            dict(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True),
            r"seq_length \(12\) / context_parallel_size \(2\) must be divisible by "
            r"tensor_model_parallel_size \(4\)",
        ),
        (
            dict(seq_length=8),
            dict(context_parallel_size=4, cp_comm_type="a2a"),
            r"cp_comm_type 'a2a' .* num_query_groups \(2\) / tensor_model_parallel_size \(1\) "
            r"must be a multiple of it",
        ),
    ],
)
def test_layouts_context_parallelism_cannot_split_are_refused(model_kw, par_kw, message):
    cfg = GPTConfig(num_layers=2, hidden_size=32, vocab_size=64, **dict(LLAMA, **model_kw))
    with pytest.raises(ValueError, match=message):
        validate(ParallelConfig(world_size=8, **par_kw), cfg)


def test_bad_context_parallel_settings_are_refused():
    with pytest.raises(ValueError, match=r"cp_comm_type must be one of \['p2p', 'allgather', "):
        ParallelConfig(world_size=8, context_parallel_size=2, cp_comm_type="ring")
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer"):
        ParallelConfig(world_size=8, context_parallel_size=0)
    with pytest.raises(ValueError, match=r"x context_parallel_size \(3\)"):
        ParallelConfig(world_size=8, context_parallel_size=3)


def test_cudnn_attention_where_the_blocks_can_run_it():
    """allgather, and p2p with a sliding window, compute their blocks in XLA: an explicit
    cuDNN backend is refused, not ignored; ``auto`` resolves to XLA there, to cuDNN with
    p2p (its blocks) and a2a (the whole sequence's core)."""
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        seq_length=8,
        vocab_size=64,
        attention_backend="cudnn",
        compute_dtype="bfloat16",
    )
    gather = ParallelConfig(world_size=8, context_parallel_size=2, cp_comm_type="allgather")
    with pytest.raises(ValueError, match="cp_comm_type 'allgather' computes its attention blo"):
        GPTProgram(cfg, gather, platform="cpu")
    windowed = dataclasses.replace(cfg, window_size=(3, 0))
    with pytest.raises(ValueError, match="cp_comm_type 'p2p' with a sliding window computes"):
        GPTProgram(windowed, ParallelConfig(world_size=8, context_parallel_size=2), platform="cpu")
    auto = dataclasses.replace(cfg, attention_backend="auto")
    for comm, impl in (("p2p", "cudnn"), ("allgather", "xla"), ("a2a", "cudnn")):
        par = ParallelConfig(world_size=8, context_parallel_size=2, cp_comm_type=comm)
        assert auto.attention_implementation("gpu", par) == impl
    par = ParallelConfig(world_size=8, context_parallel_size=2)
    assert (
        dataclasses.replace(auto, window_size=(3, 0)).attention_implementation("gpu", par) == "xla"
    )
    assert auto.attention_implementation("gpu", ParallelConfig(world_size=8)) == "cudnn"


def _losses(pretrain, path, *flags):
    """The example's losses: the README's TP2 PP2 layout (the example's model), 30 steps."""
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    options = ["--sequence-parallel", "--gradient-accumulation-fusion", "--no-progress"]
    pretrain.main([*tp2pp2, *options, "--train-iters", "30", "--metrics-file", str(path), *flags])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return np.array([r["loss"] for r in rows if "loss" in r])


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
def test_example_losses_with_context_parallelism_equal_cp1(pretrain, tmp_path, comm):
    """The example's loss curve with ``--context-parallel-size 2`` equals CP 1's within
    1e-4 relative (the same global batch: the data ranks halve)."""
    base = _losses(pretrain, tmp_path / "cp1.jsonl")
    cp2 = ("--context-parallel-size", "2", "--cp-comm-type", comm)
    split = _losses(pretrain, tmp_path / "cp2.jsonl", *cp2)
    assert len(base) == len(split) == 30
    np.testing.assert_allclose(split, base, rtol=1e-4)


# --------------------------------------------------------------------------- cuDNN blocks


def _block_inputs(c=64, heads=8, groups=2, d=64, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(keys[0], (2, c, groups, heads // groups, d), dtype)
    k = jax.random.normal(keys[1], (2, c, groups, d), dtype)
    v = jax.random.normal(keys[2], (2, c, groups, d), dtype)
    d_out = jax.random.normal(keys[3], (2, c, groups, heads // groups, d), jnp.float32)
    pos = jnp.arange(c, dtype=jnp.int32)
    return q, k, v, d_out, pos


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_ring_blocks_lower_for_cuda(monkeypatch, causal):
    """The ring's cuDNN blocks through jax's own fused-attention rules (this jax's
    signature): a forward and a backward custom call with the block's mask; the backward
    is handed the whole attention's output and log-sum-exp, not its own forward's."""
    from jax_wgrad.functional import context_parallel as cp

    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    q, k, v, d_out, pos = _block_inputs()
    kpos = pos if causal else pos - 64

    def both(q, k, v, lse, out):
        o, stat = cp._cudnn_block(q, k, v, pos, kpos, causal, None)
        grads = cp._cudnn_block_grads(q, k, v, pos, kpos, causal, None, lse, out, d_out, None)
        return o, stat, grads

    lse = jnp.zeros((2, 2, 4, 64), jnp.float32)
    out = jnp.zeros(d_out.shape, jnp.float32)
    text = jax.jit(both).trace(q, k, v, lse, out).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(\S+)\(", text)
    fmha = [c for c in calls if "fmha" in c]
    assert len(fmha) == 2 and any("Backward" in c for c in fmha), calls
    masks = re.findall(r"mask_type\\22: \\22(\w+)\\22", text)
    assert masks == ["CAUSAL" if causal else "NO_MASK"] * 2, masks


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_ring_blocks_equal_the_xla_blocks_on_a_gpu(causal):
    """cuDNN's block and its backward from a given output and log-sum-exp against the XLA
    block's (bf16 inputs: the two round differently)."""
    from jax_wgrad.functional import context_parallel as cp

    gpu = jax.devices("gpu")[0]
    q, k, v, d_out, pos = jax.device_put(_block_inputs(), gpu)
    kpos = pos if causal else pos - 64
    ref_o, ref_lse = cp._block(q, k, v, pos, kpos, causal, None)
    o, lse = cp._cudnn_block(q, k, v, pos, kpos, causal, None)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref_o), atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2)
    # the backward of the whole attention: here the block is all of it
    delta = jnp.moveaxis(jnp.sum(d_out * ref_o, axis=-1), 1, -1)
    ref = cp._block_grads(q, k, v, pos, kpos, causal, None, ref_lse, ref_o, d_out, delta)
    got = cp._cudnn_block_grads(q, k, v, pos, kpos, causal, None, ref_lse, ref_o, d_out, delta)
    for g, r in zip(got, ref):
        scale = float(np.abs(np.asarray(r)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), atol=3e-2 * scale)


def test_fp8_activation_scales_are_the_whole_sequences():
    """With context parallelism a linear's input and output gradient are quantized with
    the amax of the whole sequence (reduced over ``context``, Megatron's amax group), so
    each rank's FP8 values are the whole tensor's: here the two halves differ 16-fold in
    magnitude, and a per-rank amax would give the small half another scale."""
    from jax_wgrad.functional.fp8 import Fp8Gemm, Fp8Recipe, quantize

    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    x = jax.random.normal(jax.random.key(0), (2, 8, 16)).at[:, 4:].multiply(1 / 16)
    gemm = Fp8Gemm.column(Fp8Recipe("hybrid"), None, token_axis="context")
    for name in ("input", "gradient"):
        split = jax.shard_map(
            lambda a, name=name: getattr(gemm, name)(a).value.astype(jnp.float32),
            mesh=mesh,
            in_specs=P(None, "context"),
            out_specs=P(None, "context"),
        )(x)
        dtype = gemm.recipe.forward_dtype if name == "input" else gemm.recipe.gradient_dtype
        whole = quantize(x, dtype).value.astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
        per_rank = quantize(x[:, 4:], dtype).value.astype(jnp.float32)
        assert not np.array_equal(np.asarray(per_rank), np.asarray(whole[:, 4:]))
