"""Sliding-window attention (Megatron's ``--window-size``, Hugging Face's ``sliding_window``):
the mask against a brute-force float64 loop and jax's own ``local_window_size``, the cuDNN
path's window in its lowering, a pipelined tensor-parallel model against single-device
``jax.grad`` of the reference, the flag, and the Hugging Face import, export and parity
(the ``mistral_window`` fixture, made by tools/make_hf_fixtures.py with transformers'
sliding-window mask: ``kv_idx > q_idx - sliding_window``, causal)."""

import argparse
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_util import FIXTURES, hf_config, log_softmax, pipeline_loss, reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import (
    GPTConfig,
    GPTProgram,
    ParallelConfig,
    fusion_available,
    init_params,
    make_mesh,
    pipeline_gradients,
)
from jax_wgrad.functional import causal_attention
from jax_wgrad.interop import UnsupportedHFConfig, config_from_hf, hf_config_from, import_hf
from jax_wgrad.layout import lay_out
from jax_wgrad.models.gpt import validate
from jax_wgrad.pretrain import cli
from jax_wgrad.testing import reference_logits, reference_loss

MULTI = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def _qkv(s=8, heads=4, groups=2, d=8, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (2, s, heads, d), dtype)
    k = jax.random.normal(keys[1], (2, s, groups, d), dtype)
    v = jax.random.normal(keys[2], (2, s, groups, d), dtype)
    return q, k, v


def _brute_force(q, k, v, window):
    """float64 attention, one query at a time: query ``i`` sees keys ``i - window < j <=
    i`` (every ``j <= i`` without a window); query head ``h`` uses kv head ``h // (H/G)``."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, h, d = q.shape
    per_group = h // k.shape[2]
    out = np.zeros((b, s, h, d))
    for n in range(b):
        for head in range(h):
            g = head // per_group
            for i in range(s):
                keys = [j for j in range(s) if j <= i and (window is None or j > i - window)]
                scores = np.array([q[n, i, head] @ k[n, j, g] for j in keys]) / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[n, i, head] = (p / p.sum()) @ v[n, keys, g]
    return out.reshape(b, s, h * d)


# --------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("window", [1, 2, 3, 7, None])
def test_window_equals_a_float64_brute_force_loop(window):
    q, k, v = _qkv()
    ours = np.asarray(causal_attention(q, k, v, window=window), np.float64)
    want = _brute_force(q, k, v, window)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("window", [8, 9, 10**6])
def test_a_window_of_the_sequence_or_longer_is_plain_causal_attention(window):
    q, k, v = _qkv(s=8)
    plain = np.asarray(causal_attention(q, k, v))
    np.testing.assert_array_equal(np.asarray(causal_attention(q, k, v, window=window)), plain)
    # one token shorter than the sequence: the last query loses its first key
    shorter = np.asarray(causal_attention(q, k, v, window=7))
    np.testing.assert_array_equal(shorter[:, :-1], plain[:, :-1])
    assert np.abs(shorter[:, -1] - plain[:, -1]).max() > 1e-3


@pytest.mark.parametrize("window", [1, 3, 6])
def test_window_equals_jax_local_window_size_left_window_minus_one(window):
    """The cuDNN path passes ``local_window_size=(window - 1, 0)``; jax's XLA path, with
    the same documented meaning of ``(left, right)``, equals ours."""
    q, k, v = _qkv()
    b, s, h, d = q.shape
    theirs = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation="xla"
    ).reshape(b, s, h * d)
    np.testing.assert_allclose(causal_attention(q, k, v, window=window), theirs, atol=2e-6)


@pytest.mark.parametrize("window", [0, -3, True, 2.0, "4"])
def test_a_bad_window_is_refused(window):
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=re.escape(f"window must be an int >= 1 or None, got {window!r}")
    ):
        causal_attention(q, k, v, window=window)


def _cudnn_backend_configs(fn, *args) -> list[dict]:
    """The cuDNN fused-attention custom calls' backend configs of ``fn`` lowered for CUDA
    on this (CPU) machine, jax's cuDNN version check stubbed (it needs a GPU's cuDNN)."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fa, "check_cudnn_version"):
        pytest.skip("this jax has no check_cudnn_version to stub")
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    configs = re.findall(r'backend_config = "(\{.*?\})"', text)
    unescape = lambda c: re.sub(r"\\([0-9a-fA-F]{2})", lambda m: chr(int(m[1], 16)), c)
    return [json.loads(unescape(c)) for c in configs if "fmha" in c]


@pytest.mark.parametrize("window, length", [(5, 5), (1, 1), (16, 0), (None, 0)])
def test_cudnn_path_lowers_with_the_window(monkeypatch, window, length):
    """Forward and backward custom calls carry cuDNN's ``sliding_window_length`` (keys
    ``(pos - length, pos]``: the window itself; 0 is none), whatever the GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    q, k, v = _qkv(s=16, d=64, dtype=jnp.bfloat16)

    def loss(q, k, v):
        out = causal_attention(q, k, v, implementation="cudnn", window=window)
        return out.astype(jnp.float32).sum()

    configs = _cudnn_backend_configs(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert len(configs) == 2, configs  # forward (kept for the backward) and backward
    for c in configs:
        fmha = c["cudnn_fmha_backend_config"]
        assert int(fmha.get("sliding_window_length", 0)) == length, fmha
        assert fmha["mask_type"] == "CAUSAL", fmha


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 7, 64, 255])
def test_cudnn_window_equals_xla_on_a_gpu(window):
    """cuDNN's window on a GPU (bf16: the two paths round differently)."""
    gpu = jax.devices("gpu")[0]
    q, k, v = jax.device_put(_qkv(s=256, heads=8, groups=2, d=64, dtype=jnp.bfloat16), gpu)
    fast, plain = (
        np.asarray(causal_attention(q, k, v, implementation=impl, window=window), np.float32)
        for impl in ("cudnn", "xla")
    )
    np.testing.assert_allclose(fast, plain, atol=2e-2)


# --------------------------------------------------------------------------- the model


LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    group_query_attention=True,
    num_attention_heads=8,
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _pipeline_grads(cfg, dp, tp, pp, **par_kw):
    """``(loss, grads)`` of the pipelined train step (canonical layout) and ``(loss, grads)``
    of single-device ``jax.grad`` of the reference (test_pipeline's pattern)."""
    if not fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=4 * dp,
        sequence_parallel=tp > 1,
        gradient_accumulation_fusion=True,
        **par_kw,
    )
    validate(par, cfg)
    mesh = make_mesh(par, jax.devices()[: par.world_size])
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(
        jax.random.key(1), (par.global_batch_size, cfg.seq_length + 1), 0, 64
    )
    ref = jax.value_and_grad(reference_loss)(params, tokens, cfg)
    program = lay_out(GPTProgram(cfg, par))
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), program.param_specs(), is_leaf=lambda x: isinstance(x, P)
    )
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(program, mesh, p, t))(
        jax.device_put(program.from_canonical(params), shardings),
        jax.device_put(tokens, NamedSharding(mesh, P("data"))),
    )
    return (loss, program.to_canonical(grads)), ref, (params, tokens)


def _max_rel(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max() / np.abs(np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@MULTI
@pytest.mark.parametrize(
    "dp, tp, pp, par_kw",
    [
        # -m slow (suite time, 14-51 s): the window through the pipeline, tensor and sequence
        # parallelism stays in the default run forward-only, in
        # test_pipeline_cross_entropy_equals_transformers_mistral_window; the gradients here
        pytest.param(2, 2, 2, {}, marks=pytest.mark.slow),
        # -m slow (suite time): the same property as [2-2-2] through 4 stages, recomputed
        # layers and ZB-H1's split backward
        pytest.param(
            1,
            2,
            4,
            dict(
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
                pipeline_schedule="zb-h1",
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["2-2-2-sp", "1-2-4-sp-recompute-zbh1"],
)
def test_window_pipeline_equals_single_device_jax_grad(dp, tp, pp, par_kw):
    """A window of 3 tokens (``window_size (2, 0)``) at seq_length 8, Llama options, sequence
    parallel (the window applies to the gathered sequence), fused wgrads, two layers per
    stage in the layer scan."""
    cfg = GPTConfig(
        num_layers=4, hidden_size=32, seq_length=8, vocab_size=64, window_size=(2, 0), **LLAMA
    )
    (loss, grads), (ref_loss, ref_grads), (params, tokens) = _pipeline_grads(
        cfg, dp, tp, pp, **par_kw
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert _max_rel(grads, ref_grads) <= 1e-5
    # the window changes the gradients far beyond the tolerance (ignoring it would fail)
    unwindowed = jax.grad(reference_loss)(
        params, tokens, dataclasses.replace(cfg, window_size=None)
    )
    assert _max_rel(ref_grads, unwindowed) > 1e-3


# --------------------------------------------------------------------------- config and flag


@pytest.mark.parametrize(
    "value, message",
    [
        ((4095, 1), "window_size (4095, 1): the right window must be 0, got 1"),
        ((-1, 0), "window_size (-1, 0): the left window must be >= 0, got -1"),
        ((4096,), "window_size must be a (left, right) pair of integers, got (4096,)"),
        ((4.5, 0), "window_size must be a (left, right) pair of integers, got (4.5, 0)"),
    ],
)
def test_config_refuses_bad_windows(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(window_size=value)


def test_config_window_list_becomes_a_tuple():
    """A checkpoint's JSON gives a list."""
    cfg = GPTConfig(window_size=[4, 0])
    assert cfg.window_size == (4, 0) and cfg.attention_window == 5
    assert GPTConfig().attention_window is None


def _parse(argv):
    parser = cli.make_parser("pretrain_gpt.py")
    return parser, parser.parse_args(argv)


@pytest.mark.parametrize("text", ["4095,0", "(4095,0)", "(4095, 0)"])
def test_window_size_flag_takes_megatrons_tuple(text):
    parser, args = _parse(["--window-size", text])
    model, _, _ = cli.build_configs(args, 256, parser)
    assert model.window_size == (4095, 0) and model.attention_window == 4096
    flags = cli.model_flags(model)
    assert flags[flags.index("--window-size") + 1] == "4095,0"
    _, again = _parse(flags)
    assert again.window_size == (4095, 0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("4096", "argument --window-size: expected LEFT,RIGHT (Megatron's tuple, e.g. 4095,0"),
        ("a,b", "argument --window-size: expected LEFT,RIGHT"),
        ("1,2,3", "argument --window-size: expected LEFT,RIGHT"),
        (
            "4095,4095",
            "argument --window-size: 4095,4095: the right window must be 0, got 4095 (the GPT "
            "is causal",
        ),
        # -1,0 is Megatron's unlimited window (tests/test_fail_loudly_flags.py)
        (
            "-2,0",
            "argument --window-size: -2,0: the left window must be >= 0, or -1 (Megatron's "
            "unlimited window",
        ),
    ],
)
def test_window_size_flag_errors_name_the_flag_and_value(capsys, text, message):
    with pytest.raises(SystemExit) as exc:
        parser, args = _parse([f"--window-size={text}"])  # "-1,0" alone reads as a flag
        cli.build_configs(args, 256, parser)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err


def test_window_size_type_is_argparse_style():
    assert cli.window_size_type(" (2,0) ") == (2, 0)
    with pytest.raises(argparse.ArgumentTypeError):
        cli.window_size_type("2")


# --------------------------------------------------------------------------- Hugging Face


def _hf(family: str, **changes) -> dict:
    return {**hf_config(family), **changes}


def test_mistral_window_shorter_than_the_sequence_imports_and_exports():
    cfg = config_from_hf(_hf("mistral", sliding_window=32), seq_length=128)
    assert cfg.window_size == (31, 0) and cfg.attention_window == 32
    out = hf_config_from(cfg)
    assert out["sliding_window"] == 32 and out["architectures"] == ["MistralForCausalLM"]
    assert config_from_hf(out) == dataclasses.replace(
        cfg, seq_length=out["max_position_embeddings"]
    )
    plain = dataclasses.replace(cfg, window_size=None)
    assert hf_config_from(plain, family="mistral")["sliding_window"] is None


def test_a_windowed_llama_exports_as_mistral_and_never_as_llama():
    cfg = dataclasses.replace(config_from_hf(_hf("llama")), window_size=(7, 0))
    assert hf_config_from(cfg)["architectures"] == ["MistralForCausalLM"]
    with pytest.raises(ValueError, match=re.escape("cannot export as llama: window_size=(7, 0)")):
        hf_config_from(cfg, family="llama")


def test_qwen2_window_on_every_layer_imports_and_exports():
    hf = _hf(
        "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=None
    )
    cfg = config_from_hf(hf)
    assert cfg.window_size == (7, 0)
    out = hf_config_from(cfg)
    assert (out["use_sliding_window"], out["sliding_window"], out["max_window_layers"]) == (
        True,
        8,
        0,
    )
    assert config_from_hf(out) == cfg
    # transformers 5's layer_types, every layer sliding; use_sliding_window off: no window
    assert config_from_hf({**hf, "layer_types": ["sliding_attention"] * 4}).window_size == (7, 0)
    assert config_from_hf({**hf, "use_sliding_window": False}).window_size is None


@pytest.mark.parametrize(
    "changes, field, split",
    [
        (
            dict(max_window_layers=2, layer_types=None),
            "max_window_layers=2",
            "layers 2-3 and full attention on layers 0-1",
        ),
        (
            dict(layer_types=["full_attention", "sliding_attention"] * 2),
            "layer_types=['full_attention'",
            "layers 1, 3 and full attention on layers 0, 2",
        ),
    ],
)
def test_qwen2_window_on_some_layers_is_refused_naming_the_field_and_the_split(
    changes, field, split
):
    hf = _hf("qwen2", use_sliding_window=True, sliding_window=8, **changes)
    with pytest.raises(UnsupportedHFConfig, match=re.escape(f"config {field}")) as exc:
        config_from_hf(hf, seq_length=16)
    assert split in str(exc.value) and "seq_length <= 8; now 16" in str(exc.value)
    assert config_from_hf(hf, seq_length=8).window_size is None  # no sequence reaches past it


def test_load_hf_gives_the_window_flag_its_default(tmp_path):
    parser = cli.make_parser()
    cli.apply_preset(parser, ["--load-hf", str(FIXTURES / "mistral_window"), "--seq-length", "16"])
    assert parser.get_default("window_size") == (4, 0)


def test_reference_logits_equal_transformers_mistral_window_fp32():
    """transformers' MistralForCausalLM with sliding_window 5 over 16 tokens (fp32, sdpa),
    with test_hf's tolerance; without the window the logits are far off."""
    ref = reference("mistral_window")
    cfg, params = import_hf(FIXTURES / "mistral_window", seq_length=16)
    assert cfg.window_size == (4, 0)
    params = jax.tree.map(jnp.asarray, params)
    ids = jnp.asarray(ref["tokens"][:, :-1])
    theirs = ref["logits_fp32"]
    ours = np.asarray(reference_logits(params, ids, cfg))
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    plain = np.asarray(reference_logits(params, ids, dataclasses.replace(cfg, window_size=None)))
    assert np.abs(plain - theirs).max() / np.abs(theirs).max() > 1e-2


@MULTI
def test_pipeline_cross_entropy_equals_transformers_mistral_window():
    """The library's model on (2,2,2) with sequence parallelism against transformers' loss
    (test_hf's tolerance)."""
    ref = reference("mistral_window")
    cfg, params = import_hf(FIXTURES / "mistral_window", seq_length=16)
    tokens = ref["tokens"]
    theirs = -np.mean(np.take_along_axis(log_softmax(ref["logits_fp32"]), tokens[:, 1:, None], -1))
    ours = pipeline_loss(cfg, params, jnp.asarray(tokens), 2, 2, 2, True)
    np.testing.assert_allclose(float(ours), theirs, rtol=1e-5)
