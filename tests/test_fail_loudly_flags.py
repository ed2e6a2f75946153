"""Fail loudly, round 3: flags Megatron has that jax_wgrad refuses saying why (``--fp16``),
flags people try that neither has (``--params-dtype``), Megatron's ``--window-size -1,0``,
flags that would be ignored without their partner (named with it, as Megatron ignores
them), checkpoint directories given to the other flag, ``--load-hf X --load Y``
(Megatron's ``--pretrained-checkpoint X --load Y``), the preset line with every model
flag, empty datasets and splits, ``JAX_PLATFORMS=cuda`` without a GPU, XLA's GEMM tiling
error of a tiny ``--compile-only`` and the jax version the documented figures need, and
``benchmarks/scale_table.py``'s exit status."""

import re
import shutil

import jax
import numpy as np
import pytest
from test_fail_loudly import FIXTURES, SMALL, usage_error

from jax_wgrad import aot
from jax_wgrad.pretrain import cli

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def _parse(argv: list[str]):
    """``(parser, args, preset)`` as the job parses ``argv`` (nothing is checked)."""
    parser = cli.make_parser()
    preset = cli.apply_preset(parser, argv)
    args = parser.parse_args(argv)
    args.given_flags = cli.given_flags(argv)
    return parser, args, preset


# ------------------------------------------------------------------------ precision


@pytest.mark.parametrize("extra", [["--fp16"], ["--bf16", "--fp16"], ["--fp16", "--bf16"]])
def test_fp16_is_refused_saying_what_to_use(pretrain, capsys, extra):
    err = usage_error(
        pretrain, capsys, SMALL + extra, "--fp16 (Megatron) is not built in jax_wgrad: "
    )
    assert "loss scaling" in err and "--bf16" in err and "unrecognized" not in err


@pytest.mark.parametrize("extra", [["--params-dtype", "bf16"], ["--params-dtype"]])
def test_params_dtype_is_not_a_flag_and_the_error_names_the_precision_flags(
    pretrain, capsys, extra
):
    err = usage_error(pretrain, capsys, SMALL + extra, "--params-dtype is not a flag: ")
    assert "--bf16" in err and "--fp32" in err and "unrecognized" not in err


# --------------------------------------------------------------------- --window-size


@pytest.mark.parametrize("argv", [["--window-size", "-1,0"], ["--window-size=-1,0"]])
def test_megatrons_unlimited_window_is_no_window(argv):
    _, args, _ = _parse(SMALL + argv)
    assert args.window_size is None and "window_size" in args.given_flags


def test_minus_one_zero_overrides_a_presets_window():
    """A preset's sliding window, switched off by Megatron's ``-1,0`` (and named in the
    preset line as an override)."""
    argv = ["--model", "mistral-tiny", "--window-size", "4,0", "--seq-length", "32"]
    assert _parse(argv)[1].window_size == (4, 0)
    parser, args, preset = _parse(argv[:2] + ["--window-size", "-1,0"])
    assert args.window_size is None
    assert "--window-size" in cli.preset_line(parser, args, preset)


@pytest.mark.parametrize("text", ["-1,0", "(-1,0)", "-1, 0"])
def test_window_type_reads_megatrons_tuple(text):
    assert cli.window_size_type(text) is None
    assert cli.window_size_type(text.replace("-1", "7")) == (7, 0)


def test_negative_values_are_values_not_flags():
    for text in ("-1", "-1,0", "-.5", "-1e-3"):
        assert cli.NEGATIVE_VALUE.match(text), text
    for text in ("--lr", "-h", "--window-size"):
        assert not cli.NEGATIVE_VALUE.match(text), text


@pytest.mark.parametrize(
    "value, message",
    [
        ("3,1", "argument --window-size: 3,1: the right window must be 0, got 1"),
        ("-2,0", "argument --window-size: -2,0: the left window must be >= 0, or -1"),
        ("-1,-1", "argument --window-size: -1,-1: the right window must be 0, got -1"),
        ("4", "argument --window-size: expected LEFT,RIGHT"),
        ("a,b", "argument --window-size: expected LEFT,RIGHT"),
    ],
)
def test_an_invalid_window_names_the_flag(pretrain, capsys, value, message):
    err = usage_error(pretrain, capsys, SMALL + ["--window-size", value], message)
    assert "expected one argument" not in err


def test_a_negative_learning_rate_is_read_as_a_value(pretrain, capsys):
    """The wider negative-number rule keeps argparse's old cases: ``--lr -1e-3`` is a
    value (refused by its range), not an unknown flag."""
    usage_error(pretrain, capsys, SMALL + ["--lr", "-1e-3"], "argument --lr: must be >= 0")


# ------------------------------------------------------- flags ignored without partner


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--ddp-bucket-size", "1000"],
            "--ddp-bucket-size 1000 needs --overlap-grad-reduce (without it each gradient "
            "buffer is one bucket; Megatron ignores the size then)",
        ),
        (
            ["--pad-buckets-for-high-nccl-busbw"],
            "--pad-buckets-for-high-nccl-busbw needs --use-distributed-optimizer",
        ),
        (
            ["--ddp-pad-buckets-for-high-nccl-busbw"],
            "--pad-buckets-for-high-nccl-busbw needs --use-distributed-optimizer",
        ),
        (
            ["--expert-tensor-parallel-size", "1"],
            "--expert-tensor-parallel-size 1 needs --num-experts (a dense model has no "
            "experts to split; Megatron ignores it there)",
        ),
        (
            [
                "--num-experts",
                "4",
                "--moe-router-load-balancing-type",
                "none",
                "--moe-aux-loss-coeff",
                "0.01",
            ],
            "--moe-aux-loss-coeff 0.01 needs --moe-router-load-balancing-type aux_loss",
        ),
    ],
)
def test_a_flag_ignored_without_its_partner_names_both(pretrain, capsys, argv, message):
    err = usage_error(pretrain, capsys, SMALL + argv, message)
    assert "Megatron ignores" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--ddp-bucket-size", "1000", "--overlap-grad-reduce"],
        ["--pad-buckets-for-high-nccl-busbw", "--use-distributed-optimizer"],
        ["--num-experts", "4", "--expert-tensor-parallel-size", "1"],
        ["--num-experts", "4", "--moe-router-load-balancing-type", "none"],
        ["--num-experts", "4", "--moe-router-load-balancing-type", "none"]
        + ["--moe-aux-loss-coeff", "0"],
        ["--num-experts", "4", "--moe-aux-loss-coeff", "0.1"],
    ],
)
def test_with_its_partner_the_flag_is_accepted(argv):
    parser, args, _ = _parse(SMALL + argv)
    cli.check_flags(parser, args, args.given_flags)  # no SystemExit


# ------------------------------------------------------------- checkpoint directories


def _hf(tmp_path, family="llama"):
    return shutil.copytree(FIXTURES / family, tmp_path / family)


def _megatron(tmp_path):
    d = tmp_path / "megatron"
    (d / "iter_0000100").mkdir(parents=True)
    (d / "latest_checkpointed_iteration.txt").write_text("100")
    return d


def _jax_wgrad(tmp_path):
    d = tmp_path / "ckpt"
    (d / "4" / "params").mkdir(parents=True)
    return d


def test_directory_kinds(tmp_path):
    assert cli.directory_kind(str(_hf(tmp_path))) == "hf"
    assert cli.directory_kind(str(_megatron(tmp_path))) == "megatron"
    assert cli.directory_kind(str(_jax_wgrad(tmp_path))) == "jax_wgrad"
    (tmp_path / "empty").mkdir()
    assert cli.directory_kind(str(tmp_path / "empty")) is None
    assert cli.directory_kind(str(tmp_path / "missing")) is None


def test_load_of_a_hugging_face_directory_points_to_load_hf(pretrain, capsys, tmp_path):
    hf = _hf(tmp_path)
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load", str(hf)],
        f"--load {hf}: a Hugging Face model directory, not a jax_wgrad checkpoint: start "
        f"from it with --load-hf {hf}",
    )


def test_load_hf_of_a_jax_wgrad_checkpoint_points_to_load(pretrain, capsys, tmp_path):
    ckpt = _jax_wgrad(tmp_path)
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(ckpt)],
        f"--load-hf {ckpt}: a jax_wgrad checkpoint, not a Hugging Face model directory: "
        f"resume it with --load {ckpt}",
    )


@pytest.mark.parametrize("flag", ["--load-hf", "--load"])
def test_a_megatron_checkpoint_says_it_is_not_read_and_what_to_do(pretrain, capsys, tmp_path, flag):
    d = _megatron(tmp_path)
    err = usage_error(
        pretrain,
        capsys,
        SMALL + [flag, str(d)],
        f"{flag} {d}: a Megatron-LM checkpoint (torch_dist or torch format), which "
        "jax_wgrad does not read",
    )
    assert "--load-hf" in err.splitlines()[-1].split("read:", 1)[1]


HF_RUN = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "16"]
HF_RUN += ["--no-progress", "--train-iters", "1", "--lr", "0"]


def _ascii(tmp_path) -> list[str]:
    """``--data-path`` of ASCII text: token ids below the fixtures' vocabulary of 128."""
    text = tmp_path / "ascii.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog; " * 200)
    return ["--data-path", str(text)]


def test_load_hf_with_an_empty_load_starts_from_hugging_face(pretrain, capsys, tmp_path):
    """``--load-hf X --load Y --save Y``, Y without a checkpoint: X's weights at step 0
    (the first loss is the Hugging Face model's, the same as without --load), said so."""
    hf, y, data = _hf(tmp_path), tmp_path / "run", _ascii(tmp_path)
    argv = HF_RUN + data + ["--load-hf", str(hf), "--load", str(y), "--save", str(y)]
    out = pretrain.main(argv)
    log = capsys.readouterr().out
    assert (
        f"starting from the Hugging Face model in {hf} (step 0, fresh optimizer): "
        f"--load {y} holds no checkpoint yet" in log
    )
    plain = pretrain.main(HF_RUN + data + ["--load-hf", str(hf)])
    assert out["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)


def test_load_hf_with_a_checkpoint_in_load_resumes_it(pretrain, capsys, tmp_path):
    """``--load-hf X --load Y``, Y holding a checkpoint: the run resumes Y (its step and
    weights, not X's) and says that X's weights are not read."""
    hf, y, data = _hf(tmp_path), tmp_path / "run", _ascii(tmp_path)
    first = pretrain.main(HF_RUN + data + ["--load-hf", str(hf), "--save", str(y)])
    capsys.readouterr()
    assert cli.directory_kind(str(y)) == "jax_wgrad"
    argv = HF_RUN[:-4] + data + ["--train-iters", "2", "--lr", "0"]
    resumed = pretrain.main(argv + ["--load-hf", str(hf), "--load", str(y)])
    log = capsys.readouterr().out
    assert (
        f"--load {y} holds a checkpoint: the run resumes it, the weights in --load-hf "
        f"{hf} are not read" in log
    )
    assert "starting from the Hugging Face model" not in log
    assert resumed["steps"] == 1 and first["steps"] == 1  # step 2 only: step 1 was resumed


def test_load_hf_with_a_missing_load_is_still_a_typo(pretrain, capsys, tmp_path):
    hf, y = _hf(tmp_path), tmp_path / "nowhere"
    usage_error(
        pretrain,
        capsys,
        HF_RUN + ["--load-hf", str(hf), "--load", str(y)],
        f"--load {y}: no such directory",
    )


# -------------------------------------------------------------------- the preset line


@pytest.mark.parametrize(
    "argv, overrides",
    [
        (["--model", "qwen3-tiny", "--num-experts", "4"], "--num-experts"),
        (["--model", "llama3-tiny", "--window-size", "4,0"], "--window-size"),
        (
            ["--model", "qwen3-tiny", "--kv-channels", "16", "--num-layers", "2"],
            "--kv-channels, --num-layers",
        ),
    ],
)
def test_every_model_flag_given_is_named_as_an_override(argv, overrides):
    parser, args, preset = _parse(argv)
    line = cli.preset_line(parser, args, preset)
    assert line == f"model preset: {argv[0]} {argv[1]}; overridden by {overrides}", line


def test_run_flags_are_not_overrides_of_the_preset():
    parser, args, preset = _parse(["--model", "qwen3-tiny", "--lr", "1e-3", "--train-iters", "3"])
    assert cli.preset_line(parser, args, preset) == (
        "model preset: --model qwen3-tiny; no flag overrides it"
    )


# ------------------------------------------------------------------------------ data


def test_an_empty_megatron_dataset_is_named(pretrain, capsys, tmp_path):
    from jax_wgrad.training.indexed import write_indexed_dataset

    prefix = tmp_path / "empty_text_document"
    write_indexed_dataset(prefix, [[], []], np.int32)
    err = usage_error(
        pretrain,
        capsys,
        SMALL + ["--data-path", str(prefix)],
        f"--data-path '{prefix}': the Megatron dataset is empty (2 document(s), 0 tokens)",
    )
    assert "--vocab-size" not in err


def test_a_split_that_leaves_training_empty_is_named(pretrain, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello world " * 400)
    err = usage_error(
        pretrain,
        capsys,
        SMALL + ["--data-path", str(text), "--split", "0,1,0"],
        f"--split '0,1,0' leaves the training part empty ({text}[train]: 0 tokens)",
    )
    assert "--vocab-size" not in err


# ------------------------------------------------------------- JAX_PLATFORMS=cuda


@pytest.mark.parametrize(
    "platforms",
    ["cuda", "cpu,cuda", "gpu"],
    ids=["cuda", "cpu_then_cuda", "the_gpu_alias"],  # an id "gpu" would mark it a GPU test
)
def test_jax_platforms_cuda_without_a_gpu_is_refused(pretrain, capsys, monkeypatch, platforms):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(cli, "cuda_gpu_usable", lambda: False)
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--compile-only"],
        f"--compile-only with JAX_PLATFORMS={platforms}: this machine has no usable GPU",
    )
    err = usage_error(
        pretrain, capsys, SMALL, f"JAX_PLATFORMS={platforms}: this machine has no usable GPU"
    )
    assert "unset JAX_PLATFORMS" in err


def test_jax_platforms_cuda_with_a_gpu_passes_the_check(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(cli, "cuda_gpu_usable", lambda: True)
    parser, args, _ = _parse(SMALL + ["--compile-only"])
    cli.check_compile_platforms(parser, args)  # no SystemExit
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(cli, "cuda_gpu_usable", lambda: False)
    cli.check_compile_platforms(parser, args)


# --------------------------------------------- --compile-only: XLA's GEMM tiling error

_TILING = """INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.61 = \
f32[64,32]{1,0} dot(%bitcast.464, %parameter_1.13), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}, metadata={op_name="jit(step)/shard_map/while/body/closed_call/\
backward/attention/column_parallel_linear/dot_general" stack_frame_id=799}, \
backend_config={"sizes":["16"]}
\tSymbolic tile with
\toffset_map: (d0, d1, d2) -> (0, 0)
""" + "".join(f"  /somewhere/file{i}.py:{i}:1 [f{i}]\n" for i in range(40))


def test_the_gemm_tiling_error_is_one_line_saying_what_to_change(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    exc = aot.gemm_tiling_error(RuntimeError(_TILING))
    assert isinstance(exc, aot.GemmTilingError) and isinstance(exc, RuntimeError)
    msg = str(exc)
    assert "\n" not in msg and "Couldn't find" not in msg
    assert msg.startswith(
        "XLA:GPU of jax 0.10.2 found no Triton tiling for the matrix multiply f32[64,32] "
        "(attention/column_parallel_linear/dot_general) without a GPU to autotune on; "
    )
    for advice in (
        "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false",
        f"jax[cuda13]>={aot.FIGURES_JAX_VERSION}",
        "--hidden-size 64",
    ):
        assert advice in msg, advice
    monkeypatch.setattr(jax, "__version__", aot.FIGURES_JAX_VERSION)
    assert "jax[cuda13]>=" not in str(aot.gemm_tiling_error(RuntimeError(_TILING)))
    assert aot.gemm_tiling_error(RuntimeError("INTERNAL: something else")) is None


def test_the_gemm_tiling_error_ends_compile_only_with_exit_1(pretrain, capsys, monkeypatch):
    """At the compile call: one line, exit status 1 (the flags are valid), no
    traceback and no XLA stack."""

    def fail(*args, **kwargs):
        raise aot.gemm_tiling_error(RuntimeError(_TILING))

    monkeypatch.setattr(aot, "compile_for_target", fail)
    with pytest.raises(SystemExit) as exc:
        pretrain.main(SMALL + ["--compile-only", "--target-gpus", "8"])
    err = capsys.readouterr().err
    assert exc.value.code == 1, err
    assert re.match(r"\S+: error: XLA:GPU of jax \S+ found no Triton tiling for ", err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.aot
def test_tiny_compile_only_compiles_or_says_what_to_change(pretrain, capsys, monkeypatch):
    """The issue's tiny layout, compiled deviceless: the report on a jax that tiles its
    GEMMs, else XLA's error in one line with exit status 1."""
    try:
        aot.target_devices("h100", 1)
    except Exception as exc:  # no plugin, or one that cannot start here
        pytest.skip(f"needs jax's CUDA plugin (deviceless compile): {exc}")
    from jax_wgrad.ops import handlers

    if handlers.load_error("cuda") is not None:
        pytest.skip(f"the CUDA handler is not loaded: {handlers.load_error('cuda')}")
    argv = SMALL[:12] + ["--compile-only", "--target-gpus", "8"]
    try:
        out = pretrain.main(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 1 and "found no Triton tiling" in err, err
        assert len(err.strip().splitlines()) == 1, err
    else:
        assert out["aot"].fits


# ------------------------------------------------------- jax version of the figures


def test_an_older_jax_is_warned_about_in_one_line():
    note = aot.older_jax_note("0.10.2")
    assert note.startswith(
        f"warning: jax 0.10.2 compiles the step differently from jax {aot.FIGURES_JAX_VERSION}"
    )
    assert "\n" not in note and "docs/performance.md" in note
    assert aot.older_jax_note("0.11.2") is not None
    for same_or_newer in (aot.FIGURES_JAX_VERSION, "0.12.1", "0.13.0"):
        assert aot.older_jax_note(same_or_newer) is None, same_or_newer


def test_the_figures_version_is_the_one_the_docs_name():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for doc in ("docs/performance.md", "docs/design/aot.md"):
        text = (root / doc).read_text()
        assert f"jax {aot.FIGURES_JAX_VERSION}" in text, doc
    assert "0.10.2" in (root / "docs/performance.md").read_text()


def test_compile_only_logs_the_warning_before_compiling(pretrain, capsys, monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.10.2")

    def stop(*args, **kwargs):
        raise ValueError("stopped here")

    monkeypatch.setattr(aot, "compile_for_target", stop)
    with pytest.raises(SystemExit):
        pretrain.main(SMALL + ["--compile-only", "--target-gpus", "8"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("warning: jax 0.10.2")], out


# ------------------------------------------------------------- scale_table exit status


def _scale_table(tmp_path, rows: list[dict]):
    """``benchmarks/scale_table.py --from-jsonl`` of ``rows`` (nothing compiled)."""
    import json
    import subprocess
    import sys

    from script_util import ROOT

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({**r, "provenance": "made here"}) + "\n" for r in rows))
    return subprocess.run(
        [sys.executable, "benchmarks/scale_table.py", "--from-jsonl", str(jsonl)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def test_scale_table_exits_1_naming_the_layouts_that_failed(tmp_path):
    from test_aot_cli import _figures

    fits = {"name": "a", "gpus": 8, "wall_s": 40.0, "status": "fits", **_figures()}
    too_big = {**fits, "name": "b", "status": "does not fit", "fits": False}
    failed = {"name": "c", "gpus": 64, "wall_s": 3.0, "status": "failed", "error": "boom"}
    slow = {"name": "d", "gpus": 64, "wall_s": 9.0, "status": "timed out", "error": "no report"}
    proc = _scale_table(tmp_path, [fits, too_big, failed, slow])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "scale_table.py: 2 of 4 layouts failed: c (failed: boom); d (timed out: no report)"
    )
    assert "| `c` |" in proc.stdout  # the table is still printed
    ok = _scale_table(tmp_path, [fits, too_big])  # a layout that does not fit is a result
    assert ok.returncode == 0 and not ok.stderr.strip(), ok.stderr
