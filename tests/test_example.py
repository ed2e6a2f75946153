"""examples/pretrain_gpt.py end to end (in-process: the test session already has 8 devices)."""

import json
from pathlib import Path

import jax
import pytest
from script_util import SMALL_GPT

from jax_wgrad import fusion_available
from jax_wgrad.pretrain import cli

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


SMALL = [*SMALL_GPT, "--no-progress"]


def _curve(pretrain, tmp_path, name, extra):
    path = tmp_path / f"{name}.jsonl"
    summary = pretrain.main(SMALL + ["--train-iters", "6", "--metrics-file", str(path)] + extra)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert set(rows[0]) == {"step", "loss", "grad_norm", "skipped", "step_time_s", "tokens_per_s"}
    assert summary["compile_time_s"] > 0
    return [r["loss"] for r in rows]


@pytest.mark.slow  # equal results across layouts stay in the default run: test_ddp.py::
# test_five_steps_equal_single_device_optax[(2, 2, 2)-...], and through this example
# test_checkpoint.py::test_resume_onto_another_layout[dp8]
def test_loss_curves_equal_across_layouts_and_loss_falls(pretrain, tmp_path):
    base = _curve(pretrain, tmp_path, "dp8", [])
    assert base[-1] < base[0]
    for name, extra in [
        (
            "dp2tp2pp2",
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
        ),
        (
            "tp2pp4",
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"]
            + (["--gradient-accumulation-fusion"] if fusion_available("cpu") else []),
        ),
    ]:
        curve = _curve(pretrain, tmp_path, name, extra)
        for a, b in zip(curve, base):
            assert abs(a - b) <= 1e-4 * abs(b), (name, curve, base)


@pytest.mark.slow  # both optimizers and bucketings against one reference stay in the default
# run: test_ddp.py (five steps, replicated; non-finite, distributed with small buckets),
# test_dist_optimizer.py; averaging in the collective: test_grad_buffer.py
def test_loss_curve_unchanged_by_distributed_optimizer_and_bucket_size(pretrain, tmp_path):
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--clip-grad",
        "0.3",
    ]  # dp = 2; clipping active
    base = _curve(pretrain, tmp_path, "replicated", layout)
    for name, extra in [
        ("distopt", ["--use-distributed-optimizer"]),
        (
            "distopt-small-buckets",
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
        ),
        (
            "small-buckets-avg",
            ["--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--ddp-average-in-collective"],
        ),
    ]:
        curve = _curve(pretrain, tmp_path, name, layout + extra)
        for a, b in zip(curve, base):
            assert abs(a - b) <= 1e-5 * abs(b), (name, curve, base)


def test_profile_dir(pretrain, tmp_path):
    prof = tmp_path / "prof"
    pretrain.main(
        SMALL + ["--train-iters", "3", "--profile-dir", str(prof), "--profile-steps", "1"]
    )
    assert list(prof.rglob("*.xplane.pb"))


def usage_error(pretrain, capsys, argv: list[str], message: str) -> None:
    """``argv`` ends the example with an argparse-style error (exit code 2, usage and
    ``pretrain_gpt.py: error: <message>`` on stderr, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {message}" in err, err


def test_clear_error(pretrain, capsys):
    # The config's error names its fields; the example names the flags the user typed.
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--pipeline-model-parallel-size", "8"],
        "--num-layers (4) must be divisible by --pipeline-model-parallel-size (8)",
    )


@pytest.mark.slow  # ~1 min alone (5 runs of 6 steps)
@pytest.mark.skipif(not fusion_available("cpu"), reason="deferral needs the fused op")
def test_loss_curve_unchanged_by_deferred_output_wgrad(pretrain, tmp_path):
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--gradient-accumulation-fusion",
    ]
    base = _curve(pretrain, tmp_path, "no-defer", layout)
    for name, extra in [
        ("defer-all", ["--defer-embedding-wgrad-compute"]),
        ("defer-1", ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "1"]),
        ("defer-3", ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "3"]),
        ("defer-recompute", ["--defer-embedding-wgrad-compute", "--defer-mode", "recompute"]),
    ]:
        curve = _curve(pretrain, tmp_path, name, layout + extra)
        for a, b in zip(curve, base):
            assert abs(a - b) <= 1e-5 * abs(b), (name, curve, base)


def test_deferral_errors(pretrain, capsys):
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--defer-embedding-wgrad-compute", "--gradient-accumulation-fusion"],
        "Cannot defer embedding wgrad when pipeline parallel not used",
    )
    usage_error(
        pretrain,
        capsys,
        SMALL
        + [
            "--defer-embedding-wgrad-compute",
            "--gradient-accumulation-fusion",
            "--pipeline-model-parallel-size",
            "2",
            "--wgrad-deferral-limit",
            "-2",
        ],
        "Wgrad deferral limit must be >= 0",
    )


def _schedule_runs():
    # All in -m slow: schedules with recomputation equal jax.grad in the default run
    # (test_pipeline.py::test_schedules_and_recompute_equal_jax_grad[default-zb-h1-selective-m3]).
    slow = [
        ("zb-h1", "selective"),
        ("1f1b", "full"),
        ("1f1b", "selective"),
        ("zb-h1", None),
        ("zb-h1", "full"),
    ]
    return [pytest.param(s, r, id=f"{s}-{r}", marks=pytest.mark.slow) for s, r in slow]


@pytest.mark.skipif(not fusion_available("cpu"), reason="zb-h1 needs the fused op")
@pytest.mark.parametrize("schedule, recompute", _schedule_runs())
def test_loss_curve_unchanged_by_schedule_and_recompute(pretrain, tmp_path, schedule, recompute):
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--gradient-accumulation-fusion",
    ]
    base = _curve(pretrain, tmp_path, "1f1b-none", layout)
    extra = (
        ["--pipeline-schedule", schedule]
        + (["--recompute-granularity", recompute] if recompute else [])
        + (
            ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
            if recompute == "full"
            else []
        )
    )
    curve = _curve(pretrain, tmp_path, f"{schedule}-{recompute}", layout + extra)
    for a, b in zip(curve, base):
        assert abs(a - b) <= 1e-5 * abs(b), (schedule, recompute, curve, base)


def test_recompute_errors(pretrain, capsys):
    """Megatron's rules and wording for the recompute flags."""
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--recompute-granularity", "full"],
        'Using --recompute-granularity: full so --recompute-method must be "block" or "uniform"',
    )
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--recompute-granularity", "full", "--recompute-method", "block"],
        "When using --recompute-granularity: full --recompute-num-layers must be between",
    )
    usage_error(
        pretrain,
        capsys,
        SMALL
        + [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "0",
        ],
        "--recompute-num-layers must be a positive integer, got 0",
    )
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
        "When using --recompute-granularity: selective --recompute-num-layers must be None",
    )
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--recompute-method", "uniform"],
        "--recompute-method (uniform) is only used with --recompute-granularity 'full'",
    )


def test_schedule_errors(pretrain, capsys):
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
        "Cannot use the zb-h1 pipeline schedule without gradient accumulation fusion",
    )


def test_model_preset_gives_the_flags_defaults_and_flags_override():
    """``--model NAME``: the preset's config, with the flags given on the command line."""
    from jax_wgrad.models.gpt.presets import preset

    parser = cli.make_parser()
    argv = ["--model", "qwen2.5-tiny", "--num-layers", "2"]
    cli.apply_preset(parser, argv)
    model, _, _ = cli.build_configs(parser.parse_args(argv), 256, parser)
    # The example's own default padding (Megatron's 128; GPTConfig's is 1) joins the preset
    assert model == preset("qwen2.5-tiny", num_layers=2, make_vocab_size_divisible_by=128)
    assert model.add_qkv_bias and not model.add_bias_linear and model.layernorm_epsilon == 1e-6
