"""Hugging Face in and out (jax_wgrad.interop): config mapping and refusals, the tensor
table, streamed import, export -> import bitwise, and parity with ``transformers`` from the
committed fixtures (tests/fixtures/hf, made by tools/make_hf_fixtures.py): the reference
model's logits, bf16 KL, and the pipeline's cross entropy on (2,2,2)+SP and (1,2,4)."""

import dataclasses
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_util import (
    FIXTURES,
    assert_export_round_trip_is_bitwise,
    file_tensors,
    hf_config,
    log_softmax,
    pipeline_loss,
    reference,
)

from jax_wgrad.interop import (
    UnsupportedHFConfig,
    config_from_hf,
    export_hf,
    hf_config_from,
    hf_tensors,
    import_hf,
    read_hf_tensors,
)

FAMILIES = ["llama", "mistral", "qwen2", "mixtral"]


def _families_keeping(default: str) -> list:
    """FAMILIES, all but ``default`` in ``-m slow`` (suite time). The parity grids keep
    one family each by default, together every family's features: mistral (llama's, and
    head_dim != hidden / heads), qwen2 (qkv bias, tied embeddings), mixtral (MoE)."""
    return [f if f == default else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


# --------------------------------------------------------------------------- the tensor table
# (against the canonical layout as specified, independent of the model's code)


def _spec_namespace(hf: dict):
    """The GPTConfig fields the table reads, from an HF config, as a plain namespace."""
    nh, h = hf["num_attention_heads"], hf["hidden_size"]
    moe = hf["architectures"][0] == "MixtralForCausalLM"
    return types.SimpleNamespace(
        vocab_size=hf["vocab_size"],
        hidden_size=h,
        num_attention_heads=nh,
        num_layers=hf["num_hidden_layers"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or h // nh,
        ffn_hidden_size=hf["intermediate_size"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        num_moe_experts=hf.get("num_local_experts"),
        add_bias_linear=False,
        add_qkv_bias=hf["model_type"] == "qwen2",
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        moe_layer_pattern=(moe,) * hf["num_hidden_layers"],
    )


def _spec_skeleton(c) -> dict:
    """Canonical arrays as the layout spec gives them (group-major qkv, fc1 [L, 2, F, H],
    experts.fc1 [L, E, 2, F, H])."""
    L, h, d, nh, ng = (
        c.num_layers,
        c.hidden_size,
        c.kv_channels,
        c.num_attention_heads,
        c.num_query_groups,
    )
    qkv = (nh + 2 * ng) * d
    layer = {
        "ln1": {"scale": (L, h)},
        "ln2": {"scale": (L, h)},
        "qkv": {"weight": (L, qkv, h), **({"bias": (L, qkv)} if c.add_qkv_bias else {})},
        "proj": {"weight": (L, h, nh * d)},
    }
    if c.num_moe_experts:
        e, f = c.num_moe_experts, c.moe_ffn_hidden_size
        stacks = {
            "moe_layers": {
                **layer,
                "router": (L, e, h),
                "experts": {"fc1": (L, e, 2, f, h), "fc2": (L, e, h, f)},
            }
        }
    else:
        f = c.ffn_hidden_size
        stacks = {
            "layers": {**layer, "fc1": {"weight": (L, 2, f, h)}, "fc2": {"weight": (L, h, f)}}
        }
    head = {"final_norm": {"scale": (h,)}}
    if c.untie_embeddings_and_output_weights:
        head["output"] = {"weight": (c.vocab_size, h)}
    tree = {"embedding": {"word": {"embedding": (c.vocab_size, h)}}, **stacks, "head": head}
    return jax.tree.map(
        lambda s: np.full(s, np.nan, np.float32), tree, is_leaf=lambda x: isinstance(x, tuple)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_table_fills_the_canonical_layout_and_reads_back_bitwise(family):
    c = _spec_namespace(hf_config(family))
    params = read_hf_tensors(FIXTURES / family, c, _spec_skeleton(c))
    assert not any(np.isnan(a).any() for a in jax.tree.leaves(params))  # every element set
    files = file_tensors(FIXTURES / family)
    # group-major qkv: group g = query heads g*hpg .. (g+1)*hpg-1, then key g, then value g
    d, ng = c.kv_channels, c.num_query_groups
    hpg = c.num_attention_heads // ng
    stack = "moe_layers" if c.num_moe_experts else "layers"
    qkv = params[stack]["qkv"]["weight"][1].reshape(ng, hpg + 2, d, -1)
    p = "model.layers.1.self_attn."
    for g in range(ng):
        q = files[p + "q_proj.weight"].reshape(ng * hpg, d, -1)[g * hpg : (g + 1) * hpg]
        np.testing.assert_array_equal(qkv[g, :hpg], q.astype(np.float32))
        np.testing.assert_array_equal(
            qkv[g, hpg], files[p + "k_proj.weight"].reshape(ng, d, -1)[g].astype(np.float32)
        )
        np.testing.assert_array_equal(
            qkv[g, hpg + 1], files[p + "v_proj.weight"].reshape(ng, d, -1)[g].astype(np.float32)
        )
    for t in hf_tensors(c):  # every tensor of the files, and nothing else, read back bitwise
        np.testing.assert_array_equal(
            np.asarray(t.view(params)).reshape(t.shape),
            files.pop(t.name).astype(np.float32),
            err_msg=t.name,
        )
    assert files == {}


def test_a_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    c = _spec_namespace(hf_config("qwen2"))
    files = file_tensors(FIXTURES / "qwen2")
    del files["model.layers.2.mlp.up_proj.weight"]
    save_file(files, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers.fc1.weight.*model.layers.2.mlp.up_proj"):
        read_hf_tensors(tmp_path, c, _spec_skeleton(c))


# --------------------------------------------------------------------------- configs


def test_config_mapping():
    cfg = config_from_hf(hf_config("llama"))
    assert (cfg.normalization, cfg.position_embedding_type, cfg.swiglu) == ("RMSNorm", "rope", True)
    assert (cfg.group_query_attention, cfg.num_query_groups) == (True, 2)
    assert (cfg.add_bias_linear, cfg.add_qkv_bias) == (False, False)
    assert cfg.untie_embeddings_and_output_weights and cfg.rotary_base == 10000.0
    assert cfg.layernorm_epsilon == 1e-5 and cfg.seq_length == 64 and cfg.ffn_hidden_size == 128
    mistral = config_from_hf(hf_config("mistral"))
    assert mistral.kv_channels == 32 and mistral.rotary_base == 1e6
    qwen = config_from_hf(hf_config("qwen2"))
    assert qwen.add_qkv_bias and not qwen.add_bias_linear
    assert not qwen.untie_embeddings_and_output_weights
    moe = config_from_hf(hf_config("mixtral"), seq_length=16)
    assert (
        moe.num_moe_experts,
        moe.moe_router_topk,
        moe.moe_ffn_hidden_size,
        moe.moe_layer_freq,
        moe.moe_aux_loss_coeff,
        moe.seq_length,
    ) == (4, 2, 64, 1, 0.0, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_config_maps_back_to_the_same_model(family):
    cfg = config_from_hf(hf_config(family))
    assert config_from_hf(hf_config_from(cfg)) == cfg


@pytest.mark.parametrize(
    "family, change, field",
    [
        (
            "llama",
            {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
            "rope_scaling.rope_type",
        ),
        # llama3 scaling without its band parameters
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias/mlp_bias"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ("mistral", {"sliding_window": 0}, "sliding_window"),
        (
            "qwen2",  # a window on layers 2-3 only
            {
                "use_sliding_window": True,
                "sliding_window": 32,
                "max_window_layers": 2,
                "layer_types": None,
            },
            "max_window_layers",
        ),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ],
)
def test_unrepresentable_configs_are_refused_naming_the_field(family, change, field):
    with pytest.raises(UnsupportedHFConfig, match=f"config {field}="):
        config_from_hf({**hf_config(family), **change})


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "change",
    [
        {"rope_scaling": LLAMA31_ROPE},  # transformers 4
        {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}},  # transformers 5
    ],
    ids=["rope_scaling", "rope_parameters"],
)
def test_llama31_rope_scaling_imports_and_exports(change):
    """Llama 3.1-3.3's ``rope_type: "llama3"`` becomes Megatron's --use-rope-scaling with
    Hugging Face's band parameters, and exports back to the same dict."""
    base = {k: v for k, v in hf_config("llama").items() if k != "rope_parameters"}
    cfg = config_from_hf({**base, "rope_theta": 500000.0, **change})
    assert cfg.rope_scaling and cfg.rotary_base == 500000.0
    assert (
        cfg.rope_scaling_factor,
        cfg.rope_scaling_low_freq_factor,
        cfg.rope_scaling_high_freq_factor,
        cfg.rope_scaling_original_max_position_embeddings,
    ) == (8.0, 1.0, 4.0, 8192)
    out = hf_config_from(cfg)
    assert out["rope_scaling"] == LLAMA31_ROPE
    assert config_from_hf(out) == cfg


def test_llama31_rope_frequency_bands():
    """Llama 3.1 (head_dim 128, base 5e5, factor 8 over 8192 positions): frequencies whose
    wavelength is under 8192 / 4 are kept, over 8192 divided by 8, and between
    interpolated (transformers' ``_compute_llama3_parameters``)."""
    from jax_wgrad.functional import RopeScaling, rope_frequencies

    plain = np.asarray(rope_frequencies(128, 500000.0), np.float64)
    scaled = np.asarray(rope_frequencies(128, 500000.0, RopeScaling()), np.float64)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 2048, wavelen > 8192
    medium = ~high & ~low
    assert high.sum() and low.sum() and medium.sum()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-7)
    ratio = scaled[medium] / plain[medium]
    assert np.all((ratio > 1 / 8) & (ratio < 1)) and np.all(np.diff(ratio) < 0)
    # smooth = (8192 / wavelen - 1) / (4 - 1); inv * ((1 - smooth) / 8 + smooth)
    smooth = (8192 / wavelen[medium] - 1) / 3
    np.testing.assert_allclose(ratio, (1 - smooth) / 8 + smooth, rtol=1e-6)


def test_a_sliding_window_on_some_layers_longer_than_the_sequence_is_accepted():
    """Qwen2's window on layers 2-3 only: no window for sequences it covers, refused for
    longer ones (a window on every layer is Megatron's --window-size:
    tests/test_sliding_window.py)."""
    partial = {
        **hf_config("qwen2"),
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 2,
        "layer_types": None,
    }
    assert config_from_hf(partial).window_size is None  # max_position_embeddings 64
    with pytest.raises(UnsupportedHFConfig, match="max_window_layers=2"):
        config_from_hf(partial, seq_length=128)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_import_is_bitwise(family, tmp_path):
    assert_export_round_trip_is_bitwise(family, tmp_path)


def test_export_of_a_random_model_imports_bitwise(tmp_path):
    from jax_wgrad import GPTConfig, init_params

    cfg = GPTConfig(
        vocab_size=96,
        num_layers=2,
        hidden_size=48,
        num_attention_heads=6,
        seq_length=32,
        ffn_hidden_size=80,
        normalization="RMSNorm",
        position_embedding_type="rope",
        rotary_base=5e5,
        swiglu=True,
        group_query_attention=True,
        num_query_groups=2,
        add_bias_linear=False,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=True,
    )
    params = jax.tree.map(np.asarray, init_params(cfg, seed=5))
    export_hf(cfg, params, tmp_path)
    cfg2, params2 = import_hf(tmp_path)
    assert cfg2 == dataclasses.replace(cfg, init_method_std=cfg2.init_method_std)
    jax.tree.map(np.testing.assert_array_equal, params2, params)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", _families_keeping("mistral"))
def test_reference_logits_equal_transformers_fp32(family):
    from jax_wgrad.testing import reference_logits

    ref = reference(family)
    cfg, params = import_hf(FIXTURES / family, seq_length=16)
    ids = jnp.asarray(ref["tokens"][:, :-1])
    ours = np.asarray(reference_logits(jax.tree.map(jnp.asarray, params), ids, cfg))
    theirs = ref["logits_fp32"]
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("family", _families_keeping("qwen2"))
def test_bf16_kl_per_token(family):
    """The reference model in bf16 (``compute_dtype``: activations and GEMM inputs)
    against transformers' fp32 logits: KL(HF fp32 || ours bf16) <= 1e-3 for every token."""
    from jax_wgrad.testing import reference_logits

    ref = reference(family)
    cfg, params = import_hf(FIXTURES / family, seq_length=16, compute_dtype="bfloat16")
    ids = jnp.asarray(ref["tokens"][:, :-1])
    ours = log_softmax(np.asarray(reference_logits(jax.tree.map(jnp.asarray, params), ids, cfg)))
    theirs = log_softmax(ref["logits_fp32"])
    kl = (np.exp(theirs) * (theirs - ours)).sum(-1)
    assert kl.max() <= 1e-3, kl.max()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
@pytest.mark.parametrize(
    "dp, tp, pp, sp",
    [(2, 2, 2, True), pytest.param(1, 2, 4, False, marks=pytest.mark.slow)],
    ids=str,
)
@pytest.mark.parametrize("family", _families_keeping("mixtral"))
def test_pipeline_cross_entropy_equals_transformers(family, dp, tp, pp, sp):
    ref = reference(family)
    sp = sp or family == "mixtral"  # MoE with tensor parallelism needs SP (Megatron's rule)
    cfg, params = import_hf(FIXTURES / family, seq_length=16)
    tokens = ref["tokens"]
    theirs = -np.mean(np.take_along_axis(log_softmax(ref["logits_fp32"]), tokens[:, 1:, None], -1))
    ours = pipeline_loss(cfg, params, jnp.asarray(tokens), dp, tp, pp, sp)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


# --------------------------------------------------------------------------- checkpoints


# ~27 s; a parameters-only --load stays in the default run: the converted checkpoint of
# test_the_example_starts_from_a_hf_directory, the field-named refusal in
# test_checkpoint.py::test_other_model_is_a_clear_error.
@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
def test_a_parameters_only_checkpoint_starts_a_run(pretrain, tmp_path, capsys):
    """What tools/convert_hf.py writes: --load starts at step 0 from those parameters with a
    fresh optimizer (here: the seed's own initial parameters, so the first loss equals a
    run from scratch bitwise); another model is refused with the field named."""
    from jax_wgrad import GPTConfig, init_params
    from jax_wgrad.training.checkpoint import save_params_checkpoint

    small = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--no-progress",
        "--seed",
        "3",
        "--train-iters",
        "1",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ]
    cfg = GPTConfig(
        vocab_size=256, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16
    )
    save_params_checkpoint(
        tmp_path / "ckpt",
        cfg,
        jax.tree.map(np.asarray, init_params(cfg, 3)),
        source="a test",
        required_fields=("layernorm_epsilon",),
    )
    scratch = pretrain.main(small)
    loaded = pretrain.main(small + ["--load", str(tmp_path / "ckpt")])
    assert loaded["first_loss"] == scratch["first_loss"]
    assert "starting from the parameters in" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pretrain.main(small[:3] + ["64"] + small[4:] + ["--load", str(tmp_path / "ckpt")])
    assert "--hidden-size=32 in the checkpoint, 64 in this run" in capsys.readouterr().err


@pytest.mark.slow  # suite time: the example starting from a HF directory on tp 2 stays in
# the default run in test_vocab_padding.py::test_the_example_trains_a_32001_vocabulary_on_tp2,
# the refusal naming the field in test_public_helpers.py, the tool's round trip in
# test_vocab_padding.py::test_the_convert_tool_round_trips_a_padded_vocabulary
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
def test_the_example_starts_from_a_hf_directory(pretrain, tmp_path, capsys):
    """``--load-hf DIR``: the directory's config gives the model flags, its weights the
    initial parameters; the first loss is bitwise the one of the converted checkpoint
    (``tools/convert_hf.py`` then ``--load``); a flag giving another model is refused with
    the field named."""
    from jax_wgrad.interop import import_hf
    from jax_wgrad.training.checkpoint import save_params_checkpoint

    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 400)  # ASCII: ids < the fixture's vocab 128
    run = [
        "--data-path",
        str(text),
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--no-progress",
        "--seed",
        "3",
        "--train-iters",
        "1",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    direct = pretrain.main(run + ["--load-hf", str(FIXTURES / "llama")])
    assert "starting from the Hugging Face model in" in capsys.readouterr().out
    cfg, params = import_hf(FIXTURES / "llama", seq_length=16)
    save_params_checkpoint(
        tmp_path / "ckpt", cfg, params, source="a test", required_fields=("layernorm_epsilon",)
    )
    from jax_wgrad.pretrain.cli import model_flags

    converted = pretrain.main(run + model_flags(cfg) + ["--load", str(tmp_path / "ckpt")])
    assert direct["first_loss"] == converted["first_loss"]
    with pytest.raises(SystemExit):
        pretrain.main(run + ["--load-hf", str(FIXTURES / "llama"), "--hidden-size", "32"])
    assert "hidden_size=64 in the directory, 32 in this run" in capsys.readouterr().err


# --------------------------------------------------------------------------- tokenizer


def test_preprocess_takes_a_hf_directorys_tokenizer(tmp_path):
    import importlib.util

    tokenizers = pytest.importorskip("tokenizers", reason="the optional tokenizers library")
    spec = importlib.util.spec_from_file_location(
        "preprocess_data", Path(__file__).parents[1] / "tools" / "preprocess_data.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from jax_wgrad.training.indexed import IndexedDataset

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(
            {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4}, unk_token="[UNK]"
        )
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "config.json").write_text(json.dumps({"vocab_size": 8, "eos_token_id": 1}))
    (tmp_path / "t.txt").write_text("a b zz")
    args = [
        "--input",
        str(tmp_path / "t.txt"),
        "--output-prefix",
        str(tmp_path / "t"),
        "--tokenizer-hf-dir",
        str(hf),
        "--append-eod",
    ]
    assert tool.main(args)["vocab_size"] == 8
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "t")[0], [3, 4, 2, 1])
    (hf / "config.json").write_text(json.dumps({"vocab_size": 4}))
    with pytest.raises(SystemExit):
        tool.main(args)


def test_convert_tool_round_trip_is_bitwise(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "convert_hf", Path(__file__).parents[1] / "tools" / "convert_hf.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.main(
        [
            "--hf-dir",
            str(FIXTURES / "mixtral"),
            "--out",
            str(tmp_path / "ckpt"),
            "--seq-length",
            "16",
        ]
    )
    assert "--num-experts 4" in out["flags"] and "--hidden-size 64" in out["flags"]
    tool.main(
        [
            "--export",
            "--load",
            str(tmp_path / "ckpt"),
            "--hf-dir",
            str(tmp_path / "hf"),
            "--hf-template",
            str(FIXTURES / "mixtral"),
        ]
    )
    theirs, ours = file_tensors(FIXTURES / "mixtral"), file_tensors(tmp_path / "hf")
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k].astype(np.float32), err_msg=k)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 2
