"""Checkpoint and resume through the example: exact on the same layout, onto other layouts
(and optimizer modes), after a killed save, and a clear error for another model."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from script_util import SMALL_GPT

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

SMALL = [*SMALL_GPT, "--no-progress"]
L222 = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--use-distributed-optimizer",
]


def _losses(path):
    return [r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def straight_and_saved(pretrain, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    pretrain.main(
        SMALL + L222 + ["--train-iters", "6", "--metrics-file", str(d / "straight.jsonl")]
    )
    pretrain.main(SMALL + L222 + ["--train-iters", "3", "--save", str(d / "ckpt")])
    return d, _losses(d / "straight.jsonl")


def test_resume_is_bitwise_exact_on_the_same_layout(pretrain, straight_and_saved):
    d, straight = straight_and_saved
    out = d / "resumed.jsonl"
    pretrain.main(
        SMALL + L222 + ["--train-iters", "6", "--load", str(d / "ckpt"), "--metrics-file", str(out)]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert [r["loss"] for r in rows] == straight[3:]  # bitwise


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
            id="tp2pp4",
            marks=pytest.mark.slow,  # suite time: dp8 changes every mesh axis and the optimizer
        ),
        pytest.param([], id="dp8"),  # (8, 1, 1), replicated optimizer
        # context parallelism: the optimizer sharded over data x context, dp 2 -> 1
        # (-m slow: suite time; the default run's CP cover is tests/test_context_parallel.py)
        pytest.param(
            [*L222, "--context-parallel-size", "2"], id="tp2pp2cp2", marks=pytest.mark.slow
        ),
    ],
)
def test_resume_onto_another_layout(pretrain, straight_and_saved, layout):
    d, straight = straight_and_saved
    out = d / f"other-{len(layout)}.jsonl"
    pretrain.main(
        SMALL
        + layout
        + ["--train-iters", "6", "--load", str(d / "ckpt"), "--metrics-file", str(out)]
    )
    got = _losses(out)
    assert len(got) == 3
    for a, b in zip(got, straight[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, straight)


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_without_it(pretrain, straight_and_saved, tmp_path):
    """Saved with ``--context-parallel-size 2`` (the optimizer sharded over data x
    context), resumed on CP 1: the losses of the straight CP 1 run."""
    d, straight = straight_and_saved
    saved = tmp_path / "cp2"
    pretrain.main(
        SMALL + L222 + ["--context-parallel-size", "2", "--train-iters", "3", "--save", str(saved)]
    )
    out = tmp_path / "resumed.jsonl"
    pretrain.main(
        SMALL + L222 + ["--train-iters", "6", "--load", str(saved), "--metrics-file", str(out)]
    )
    got = _losses(out)
    assert len(got) == 3
    for a, b in zip(got, straight[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, straight)


@pytest.mark.slow  # a parameters-only restore (load_optim=False) stays in the default run:
# test_training_ux.py::test_eval_loss_equals_single_device_reference
def test_no_load_optim_keeps_parameters_only(pretrain, straight_and_saved):
    d, straight = straight_and_saved
    out = d / "fresh-optim.jsonl"
    pretrain.main(
        SMALL
        + L222
        + [
            "--train-iters",
            "5",
            "--load",
            str(d / "ckpt"),
            "--no-load-optim",
            "--metrics-file",
            str(out),
        ]
    )
    got = _losses(out)
    assert got[0] == straight[3]  # same parameters, same batch: same loss
    assert got[1] != straight[4]  # but a fresh Adam state moves differently


def test_other_model_is_a_clear_error(pretrain, straight_and_saved, capsys):
    d, _ = straight_and_saved
    other = [a if a != "32" else "64" for a in SMALL]  # hidden 64 (and seq 64)
    with pytest.raises(SystemExit) as exc:
        pretrain.main(other + ["--train-iters", "4", "--load", str(d / "ckpt")])
    assert exc.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert (
        "was saved for a different model: --hidden-size=32 in the checkpoint, 64 in this "
        "run; --seq-length=32 in the checkpoint, 64 in this run" in err
    ), err


_KILL_DURING_SAVE = r"""
import os, signal, sys
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
from jax_wgrad.pretrain import main
from jax_wgrad.training import checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, plan, state, *, step, **kw):
    save(self, plan, state, step=step, **kw)
    if step == 4:  # the async save of step 4 is under way: die now
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save_then_die
main(sys.argv[1:])
"""


@pytest.mark.slow  # two runs, one a subprocess; resuming an interrupted run with each step once
# in the metrics stays in the default run: test_training_ux.py::test_interrupted_run_resumes_...
def test_killed_async_save_leaves_the_previous_checkpoint_loadable(pretrain, tmp_path):
    """SIGKILL during the save of step 4; the resumed run (same metrics file) continues from
    the newest complete checkpoint and the metrics file holds every step exactly once."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    script = _KILL_DURING_SAVE
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            *SMALL,
            "--train-iters",
            "6",
            "--save",
            str(ckpt),
            "--save-interval",
            "2",
            "--metrics-file",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    from jax_wgrad.training import Checkpointer

    latest = Checkpointer(ckpt).latest_step()
    assert latest in (2, 4), latest  # 4 only if its write finished before the kill
    leftovers = [p.name for p in ckpt.iterdir() if not p.name.isdigit()]
    killed_steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert killed_steps == [1, 2, 3, 4]  # steps after the checkpoint are in the file
    pretrain.main(
        SMALL
        + ["--train-iters", str(latest + 1), "--load", str(ckpt), "--metrics-file", str(metrics)]
    )
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, latest + 2))  # each step once: the redone ones replaced
    assert all("tmp" in name for name in leftovers), leftovers
    assert np.isfinite(_losses(metrics)).all()


def _usage_error(pretrain, capsys, argv) -> str:
    """``argv`` ends the example with exit code 2 and one error line (no traceback)."""
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ": error: " in ln]
    return line


def test_load_of_a_missing_directory_is_an_error(pretrain, tmp_path, capsys):
    typo = tmp_path / "ckpt-typo"
    line = _usage_error(pretrain, capsys, SMALL + ["--train-iters", "2", "--load", str(typo)])
    assert f"--load {typo}: no such directory" in line and "--save" in line
    assert not typo.exists()  # nothing created
    (tmp_path / "empty").mkdir()
    line = _usage_error(
        pretrain, capsys, SMALL + ["--train-iters", "2", "--load", str(tmp_path / "empty")]
    )
    assert "no checkpoint in this directory" in line


@pytest.mark.slow  # --load equal to --save stays in the default run:
# test_training_ux.py::test_interrupted_run_resumes_with_each_step_once_in_the_metrics
def test_load_equal_to_save_starts_from_scratch_and_says_so(pretrain, tmp_path, capsys):
    d = str(tmp_path / "new")
    pretrain.main(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "16",
            "--no-progress",
            "--train-iters",
            "1",
            "--load",
            d,
            "--save",
            d,
        ]
    )
    assert f"no checkpoint in {d} yet: starting from scratch" in capsys.readouterr().out
    from jax_wgrad.training import Checkpointer

    assert Checkpointer(d).latest_step() == 1


def _damaged_copy(src: Path, dst: Path, damage) -> Path:
    import shutil

    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _data_chunk(step_dir: Path) -> Path:
    """The largest data file of a step's parameters (tensorstore's OCDBT chunks)."""
    return max(
        (p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )


@pytest.mark.parametrize(
    "damage, message",
    [  # suite time: the fallback test below also reads a fake step folder's message
        pytest.param(
            lambda d: (d / "9").mkdir(),
            "step 9 is damaged: item 'meta' is missing",
            id="fake-step-folder",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            lambda d: (d / "3" / "meta" / "metadata").unlink(),
            "step 3 is damaged: missing file ",
            id="deleted-meta",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            lambda d: _data_chunk(d / "3").unlink(),
            "step 3 is damaged: ValueError: ",
            id="deleted-data-chunk",
        ),
    ],
)
def test_damaged_checkpoint_is_one_line(
    pretrain, straight_and_saved, tmp_path, capsys, damage, message
):
    d, _ = straight_and_saved
    ckpt = _damaged_copy(d / "ckpt", tmp_path / "ckpt", damage)
    line = _usage_error(
        pretrain, capsys, SMALL + L222 + ["--train-iters", "4", "--load", str(ckpt)]
    )
    assert f"checkpoint {ckpt} {message}" in line, line
    assert len(line) < 400


def test_fallback_to_the_newest_intact_step_when_told(
    pretrain, straight_and_saved, tmp_path, capsys
):
    d, straight = straight_and_saved
    ckpt = _damaged_copy(d / "ckpt", tmp_path / "ckpt", lambda d: (d / "9").mkdir())
    out = tmp_path / "m.jsonl"
    pretrain.main(
        SMALL
        + L222
        + [
            "--train-iters",
            "4",
            "--load",
            str(ckpt),
            "--load-fallback-to-intact",
            "--metrics-file",
            str(out),
        ]
    )
    log = capsys.readouterr().out
    assert "step 9 is damaged: item 'meta' is missing; trying the previous step" in log
    assert f"resumed from {ckpt} at step 3" in log
    assert _losses(out) == straight[3:4]  # bitwise, as a plain resume


def _as_moe(ckpt: Path, experts: int) -> None:
    """Rewrites a checkpoint's stored model config as an MoE model's (the config is what is
    compared, before any array is read)."""
    meta = ckpt / "3" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["model"].update(num_moe_experts=experts, moe_ffn_hidden_size=128)
    meta.write_text(json.dumps(record))


@pytest.mark.slow  # the MoE fields' comparison stays in the default run:
# test_model_differences_field_by_field; the one-line message: test_other_model_is_a_clear_error
def test_moe_checkpoint_loaded_as_dense_names_the_fields(
    pretrain, straight_and_saved, tmp_path, capsys
):
    d, _ = straight_and_saved
    ckpt = _damaged_copy(d / "ckpt", tmp_path / "moe", lambda c: _as_moe(c, 4))
    line = _usage_error(
        pretrain, capsys, SMALL + L222 + ["--train-iters", "4", "--load", str(ckpt)]
    )
    assert line.endswith(
        "was saved for a different model: --num-experts=4 in the checkpoint, None in this run"
    ), line
    line = _usage_error(
        pretrain,
        capsys,
        SMALL + L222 + ["--train-iters", "4", "--load", str(ckpt), "--num-experts", "8"],
    )
    assert line.endswith("--num-experts=4 in the checkpoint, 8 in this run"), line


def test_model_differences_field_by_field():
    from jax_wgrad import GPTConfig
    from jax_wgrad.training.checkpoint import model_differences

    moe = GPTConfig(num_moe_experts=4, moe_ffn_hidden_size=128, moe_layer_freq=2)
    meta = lambda cfg: {"model_type": "GPTConfig", "model": dataclasses.asdict(cfg)}
    assert model_differences(meta(moe), moe) == []
    assert model_differences(meta(moe), GPTConfig()) == [("num_moe_experts", 4, None)]
    assert model_differences(
        meta(moe), dataclasses.replace(moe, moe_ffn_hidden_size=64, moe_layer_freq=1)
    ) == [("moe_ffn_hidden_size", 128, 64), ("moe_layer_freq", 2, 1)]
    shared = dataclasses.replace(moe, moe_shared_expert_intermediate_size=256)
    assert model_differences(meta(shared), moe) == [
        ("moe_shared_expert_intermediate_size", 256, None)
    ]  # shared experts fix shapes
    old = {
        k: v
        for k, v in dataclasses.asdict(GPTConfig()).items()
        if not k.startswith("moe") and k != "num_moe_experts"
    }  # a checkpoint from before MoE: the defaults
    assert model_differences({"model": old}, GPTConfig()) == []  # and before model_type
    assert model_differences({"model_type": "MLPStackConfig", "model": {}}, GPTConfig()) == [
        ("model type", "MLPStackConfig", "GPTConfig")
    ]


def test_save_target_that_cannot_be_written_fails_before_training(
    pretrain, tmp_path, capsys, monkeypatch
):
    (tmp_path / "a-file").write_text("")
    line = _usage_error(pretrain, capsys, SMALL + ["--save", str(tmp_path / "a-file" / "ckpt")])
    assert f"--save {tmp_path / 'a-file' / 'ckpt'}: cannot write there" in line
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        line = _usage_error(pretrain, capsys, SMALL + ["--save", str(ro)])
        assert "cannot write there (Permission denied)" in line
    import collections

    from jax_wgrad.training import loop

    full = collections.namedtuple("usage", "total used free")(10 << 20, 10 << 20, 1024)
    monkeypatch.setattr(loop.shutil, "disk_usage", lambda path: full)
    line = _usage_error(
        pretrain, capsys, SMALL + ["--train-iters", "2", "--save", str(tmp_path / "full")]
    )
    assert (
        f"--save {tmp_path / 'full'}: 0.0 MiB free, a checkpoint of this model takes up to" in line
    )
