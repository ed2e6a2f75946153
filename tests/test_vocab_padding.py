"""Vocabulary padding (Megatron's ``--make-vocab-size-divisible-by``): the padded model's
loss and gradients equal the unpadded model's on every layout (the padding rows' logits
are masked out of the softmax, their gradient is zero), Hugging Face import pads and
export unpads, checkpoints carry the padding, and bad values are refused by name."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import GPTConfig, GPTProgram, ParallelConfig, make_mesh, pipeline_gradients
from jax_wgrad.layout import lay_out
from jax_wgrad.models.gpt import validate
from jax_wgrad.models.gpt.config import vocab_size_with_padding
from jax_wgrad.testing import reference_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

V, PADDED = 101, 128
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8)
VOCAB_ROWS = (("embedding", "word", "embedding"), ("head", "output", "weight"))


def _vocab_leaves(tree):
    for path in VOCAB_ROWS:
        node = tree
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            yield path, node


def _set(tree, path, value):
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _padded_params(params, cfg):
    """The unpadded ``params`` with random padding rows (values that must not matter)."""
    out = jax.tree.map(lambda a: a, params)  # a copy of the dict structure
    key = jax.random.key(7)
    for path, a in list(_vocab_leaves(params)):
        pad = jax.random.normal(key, (cfg.padded_vocab_size - a.shape[0], a.shape[1]), a.dtype)
        _set(out, path, jnp.concatenate([a, pad]))
    return out


def _layout_grads(cfg, par, params, tokens):
    validate(par, cfg)
    mesh = make_mesh(par, jax.devices()[: par.world_size])
    program = lay_out(GPTProgram(cfg, par))
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        program.param_specs(),
        is_leaf=lambda x: isinstance(x, P),
    )
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(program, mesh, p, t))(
        jax.device_put(params, shardings), jax.device_put(tokens, NamedSharding(mesh, P("data")))
    )
    return float(loss), jax.tree.map(np.asarray, grads)


def _check_equal_to_unpadded(par, **arch):
    """The padded model on ``par`` = single-device ``jax.grad`` of the unpadded model: the
    same loss, the same gradients on every true row, zero on the padding rows."""
    from jax_wgrad import init_params

    unpadded = GPTConfig(**{**SMALL, "vocab_size": V, **arch})
    cfg = dataclasses.replace(unpadded, make_vocab_size_divisible_by=PADDED)
    assert cfg.padded_vocab_size == PADDED
    params = jax.jit(init_params, static_argnums=(0, 1))(unpadded, 0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, V)
    reference = jax.jit(jax.value_and_grad(reference_loss), static_argnums=2)
    ref_loss, ref_grads = reference(params, tokens, unpadded)
    loss, grads = _layout_grads(cfg, par, _padded_params(params, cfg), tokens)
    np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-5)
    for path, g in _vocab_leaves(grads):
        assert g.shape[0] == PADDED
        np.testing.assert_array_equal(g[V:], 0.0, err_msg=f"padding rows of {path}")
        _set(grads, path, g[:V])
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        r = np.asarray(r)
        diff, scale = np.abs(g - r).max(), np.abs(r).max()
        assert diff <= 1e-5 * scale, f"{jax.tree_util.keystr(path)}: {diff:.3g} > {scale:.3g}e-5"


def test_padded_equals_unpadded_on_tp2():
    """Vocab 101 padded to 128 on tp 2 (two devices), untied output layer."""
    par = ParallelConfig(
        tensor_model_parallel_size=2, micro_batch_size=2, global_batch_size=4, world_size=2
    )
    _check_equal_to_unpadded(par, untie_embeddings_and_output_weights=True, num_layers=1)


# The property of the default test above on heavier layouts: the vocabulary over the
# pipeline (a shard of padding only on (1, 4, 2)), sequence parallelism, the deferred
# output-layer wgrad (stash and recompute), tied and untied.
@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, over_pipeline, defer, tied",
    [
        ((2, 2, 2), False, None, True),
        ((2, 2, 2), True, None, False),
        ((1, 4, 2), True, None, True),
        ((2, 2, 2), False, "stash", False),
        ((2, 2, 2), True, "recompute", True),
    ],
    ids=str,
)
def test_padded_equals_unpadded_on_pipelines(mesh, over_pipeline, defer, tied):
    dp, tp, pp = mesh
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=2 * dp * 2,
        sequence_parallel=True,
        vocab_parallel_over_pipeline=over_pipeline,
        gradient_accumulation_fusion=defer is not None,
        defer_embedding_wgrad_compute=defer is not None,
        defer_mode=defer or "stash",
    )
    _check_equal_to_unpadded(par, untie_embeddings_and_output_weights=not tied)


# --------------------------------------------------------------------------- the rule


def test_the_padding_rule():
    assert vocab_size_with_padding(32001, 128) == 32128
    assert vocab_size_with_padding(151665, 128) == 151680
    assert vocab_size_with_padding(32000, 128) == 32000
    assert vocab_size_with_padding(101, 1) == 101
    # Megatron's size for tp 8 (its multiple is 128 x 8): pass 1024
    assert vocab_size_with_padding(32001, 128 * 8) == 32768
    cfg = GPTConfig(vocab_size=32001, make_vocab_size_divisible_by=128)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (32001, 32128)
    assert GPTConfig(vocab_size=101).padded_vocab_size == 101  # the library's default: none


def test_shape_check_compares_the_padded_vocabularies():
    cfg = GPTConfig(vocab_size=V, make_vocab_size_divisible_by=128)
    same = dataclasses.asdict(dataclasses.replace(cfg, make_vocab_size_divisible_by=64))
    assert cfg.shape_differences(same) == []  # both 128 rows: the checkpoint fits
    other = dataclasses.asdict(dataclasses.replace(cfg, make_vocab_size_divisible_by=1))
    assert cfg.shape_differences(other) == [("make_vocab_size_divisible_by", 1, 128)]
    older = {k: v for k, v in other.items() if k != "make_vocab_size_divisible_by"}
    assert cfg.shape_differences(older) == [("make_vocab_size_divisible_by", 1, 128)]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "vocab, by, layout, message",
    [
        (
            V,
            1,
            dict(tensor_model_parallel_size=2),
            "vocab_size (101) must be divisible by tensor_model_parallel_size (2); pad it: "
            "make_vocab_size_divisible_by 128 (a multiple of 2; Megatron pads to a multiple "
            "of make_vocab_size_divisible_by x tensor_model_parallel_size)",
        ),
        (
            V,
            51,
            dict(tensor_model_parallel_size=4),
            "vocab_size (101) padded to a multiple of make_vocab_size_divisible_by (51), "
            "102, must be divisible by tensor_model_parallel_size (4); pad it: "
            "make_vocab_size_divisible_by 204 (a multiple of 4;",
        ),
        (
            V,
            12,
            dict(
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4,
                vocab_parallel_over_pipeline=True,
            ),
            "vocab_size (101) padded to a multiple of make_vocab_size_divisible_by (12), "
            "108, must be divisible by tensor_model_parallel_size x "
            "pipeline_model_parallel_size (2 x 4) with vocab_parallel_over_pipeline; pad "
            "it: make_vocab_size_divisible_by 24 (a multiple of 8;",
        ),
    ],
    ids=["unpadded", "padded", "over-pipeline"],
)
def test_a_layout_that_does_not_divide_the_padded_vocabulary_is_named(vocab, by, layout, message):
    cfg = dataclasses.replace(
        GPTConfig(**SMALL), num_layers=4, vocab_size=vocab, make_vocab_size_divisible_by=by
    )
    with pytest.raises(ValueError) as info:
        validate(ParallelConfig(**layout), cfg)
    assert message in str(info.value)


@pytest.mark.parametrize("by", [0, -128, True, 1.5])
def test_a_bad_multiple_is_refused(by):
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be a positive"):
        GPTConfig(make_vocab_size_divisible_by=by)
    with pytest.raises(ValueError, match=r"--make-vocab-size-divisible-by must be >= 1, got"):
        vocab_size_with_padding(V, by)


# ------------------------------------------------------------------ Hugging Face, 32001

HF_VOCAB = 32001  # Llama 2 plus one added token: no layout divides it
HF_MODEL = dict(
    vocab_size=HF_VOCAB,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=64,
    seq_length=16,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _hf_tensors(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from jax_wgrad.interop.hf import shard_files

    out = {}
    for path in shard_files(directory):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def hf_32001(tmp_path_factory):
    """A tiny Llama directory with a 32001-token vocabulary, written by the library's own
    export from random parameters (unpadded)."""
    from jax_wgrad import init_params
    from jax_wgrad.interop import export_hf

    cfg = GPTConfig(**HF_MODEL)
    directory = tmp_path_factory.mktemp("hf") / "llama-32001"
    export_hf(cfg, jax.tree.map(np.asarray, init_params(cfg, 0)), directory)
    return directory


def test_hf_import_pads_and_export_removes_the_padding(hf_32001, tmp_path):
    from jax_wgrad.interop import export_hf, import_hf

    theirs = _hf_tensors(hf_32001)
    cfg, params = import_hf(hf_32001, make_vocab_size_divisible_by=128)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (HF_VOCAB, 32128)
    for (path, a), name in zip(
        _vocab_leaves(params), ("model.embed_tokens.weight", "lm_head.weight"), strict=True
    ):
        assert a.shape == (32128, 32), path
        np.testing.assert_array_equal(a[:HF_VOCAB], theirs[name])
        np.testing.assert_array_equal(a[HF_VOCAB:], 0.0)  # no weights in HF: zero
    export_hf(cfg, params, tmp_path / "out")
    ours = _hf_tensors(tmp_path / "out")
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    assert ours["model.embed_tokens.weight"].shape == (HF_VOCAB, 32)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == HF_VOCAB


def _convert_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "tools" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 400)
    return text


RUN = [
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--no-progress",
    "--seed",
    "3",
]


def test_the_example_trains_a_32001_vocabulary_on_tp2(pretrain, hf_32001, tmp_path, capsys):
    """``--load-hf`` of a 32001-token directory on tp 2: padded to 32128 (the default
    ``--make-vocab-size-divisible-by 128``), 2 steps, saved; the convert tool's export of
    that checkpoint has exactly the 32001 rows again."""
    run = RUN + ["--data-path", str(_text(tmp_path)), "--tensor-model-parallel-size", "2"]
    out = pretrain.main(
        run
        + ["--load-hf", str(hf_32001), "--train-iters", "2"]
        + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    )
    assert out["steps"] == 2 and np.isfinite(out["last_loss"])
    assert "vocab 32001 (padded to 32128)," in capsys.readouterr().out
    _convert_tool().main(
        ["--export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "hf")]
    )
    ours = _hf_tensors(tmp_path / "hf")
    assert ours["model.embed_tokens.weight"].shape == ours["lm_head.weight"].shape == (HF_VOCAB, 32)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == HF_VOCAB


def test_a_vocabulary_no_layout_divides_is_named_on_the_command_line(
    pretrain, hf_32001, tmp_path, capsys
):
    run = RUN + ["--data-path", str(_text(tmp_path)), "--tensor-model-parallel-size", "2"]
    with pytest.raises(SystemExit):
        pretrain.main(run + ["--load-hf", str(hf_32001), "--make-vocab-size-divisible-by", "1"])
    assert (
        "error: --vocab-size (32001) must be divisible by --tensor-model-parallel-size (2); "
        "pad it: --make-vocab-size-divisible-by 128 (a multiple of 2; Megatron pads to a "
        "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size)"
    ) in capsys.readouterr().err


def test_the_convert_tool_round_trips_a_padded_vocabulary(hf_32001, tmp_path):
    tool = _convert_tool()
    out = tool.main(["--hf-dir", str(hf_32001), "--out", str(tmp_path / "ckpt")])
    assert "--make-vocab-size-divisible-by" not in out["flags"]  # the run's default, 128
    tool.main(["--export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "hf")])
    theirs, ours = _hf_tensors(hf_32001), _hf_tensors(tmp_path / "hf")
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    out = tool.main(
        ["--hf-dir", str(hf_32001), "--out", str(tmp_path / "c1")]
        + ["--make-vocab-size-divisible-by", "1"]
    )
    assert "--make-vocab-size-divisible-by 1" in out["flags"]


# The padding in a checkpoint; the default test_the_example_trains_a_32001_vocabulary_on_tp2
# covers the save and the export, this one the resume onto another layout.
@pytest.mark.slow
def test_a_padded_checkpoint_resumes_on_another_layout(pretrain, hf_32001, tmp_path, capsys):
    run = RUN + ["--data-path", str(_text(tmp_path)), "--save", str(tmp_path / "ckpt")]
    pretrain.main(
        run
        + ["--load-hf", str(hf_32001), "--train-iters", "2", "--tensor-model-parallel-size", "2"]
    )
    flags = _model_flags(hf_32001)
    assert "--make-vocab-size-divisible-by" not in flags  # 128: the run's default
    out = pretrain.main(
        run
        + flags
        + ["--load", str(tmp_path / "ckpt"), "--train-iters", "3"]
        + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
        + ["--vocab-parallel-over-pipeline"]
    )
    assert out["steps"] == 1 and np.isfinite(out["last_loss"])
    with pytest.raises(SystemExit):
        pretrain.main(
            run
            + flags
            + ["--load", str(tmp_path / "ckpt"), "--train-iters", "4"]
            + ["--make-vocab-size-divisible-by", "256", "--tensor-model-parallel-size", "2"]
        )
    assert (
        "--make-vocab-size-divisible-by=128 in the checkpoint, 256 in this run"
        in capsys.readouterr().err
    )


def _model_flags(directory) -> list[str]:
    """The model flags of the directory padded as the run pads (what the convert tool
    prints)."""
    from jax_wgrad.interop import config_from_hf, read_hf_config
    from jax_wgrad.pretrain.cli import model_flags

    hf = read_hf_config(directory)
    return model_flags(config_from_hf(hf, seq_length=16, make_vocab_size_divisible_by=128))
