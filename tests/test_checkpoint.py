"""Checkpoint and resume through the example: exact on the same layout, onto other layouts
(and optimizer modes), after a killed save, and a clear error for another model."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

SMALL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "3e-3", "--no-progress", "--seed", "3"]
L222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer"]


def _losses(path):
    return [r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())
            if "loss" in r]


@pytest.fixture(scope="module")
def straight_and_saved(example, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    example.main(SMALL + L222 + ["--train-iters", "6", "--metrics-file", str(d / "straight.jsonl")])
    example.main(SMALL + L222 + ["--train-iters", "3", "--save", str(d / "ckpt")])
    return d, _losses(d / "straight.jsonl")


def test_resume_is_bitwise_exact_on_the_same_layout(example, straight_and_saved):
    d, straight = straight_and_saved
    out = d / "resumed.jsonl"
    example.main(SMALL + L222 + ["--train-iters", "6", "--load", str(d / "ckpt"),
                                 "--metrics-file", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert [r["loss"] for r in rows] == straight[3:]  # bitwise


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
    [],  # (8, 1, 1), replicated optimizer
], ids=["tp2pp4", "dp8"])
def test_resume_onto_another_layout(example, straight_and_saved, layout):
    d, straight = straight_and_saved
    out = d / f"other-{len(layout)}.jsonl"
    example.main(SMALL + layout + ["--train-iters", "6", "--load", str(d / "ckpt"),
                                   "--metrics-file", str(out)])
    got = _losses(out)
    assert len(got) == 3
    for a, b in zip(got, straight[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, straight)


def test_no_load_optim_keeps_parameters_only(example, straight_and_saved):
    d, straight = straight_and_saved
    out = d / "fresh-optim.jsonl"
    example.main(SMALL + L222 + ["--train-iters", "5", "--load", str(d / "ckpt"),
                                 "--no-load-optim", "--metrics-file", str(out)])
    got = _losses(out)
    assert got[0] == straight[3]  # same parameters, same batch: same loss
    assert got[1] != straight[4]  # but a fresh Adam state moves differently


def test_other_model_is_a_clear_error(example, straight_and_saved, capsys):
    d, _ = straight_and_saved
    other = [a if a != "32" else "64" for a in SMALL]  # hidden 64 (and seq 64)
    with pytest.raises(SystemExit) as exc:
        example.main(other + ["--train-iters", "4", "--load", str(d / "ckpt")])
    assert exc.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert "was saved for a different model: hidden_size=32 in the checkpoint, 64 in this run" \
        in err, err


_KILL_DURING_SAVE = r"""
import os, signal, sys
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
import importlib.util
spec = importlib.util.spec_from_file_location("pretrain_gpt", sys.argv[0] if False else %r)
ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
from jax_wgrad.training import checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, plan, state, *, step, **kw):
    save(self, plan, state, step=step, **kw)
    if step == 4:  # the async save of step 4 is under way: die now
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save_then_die
ex.main(sys.argv[1:])
"""


def test_killed_async_save_leaves_the_previous_checkpoint_loadable(example, tmp_path):
    ckpt = tmp_path / "ckpt"
    script = _KILL_DURING_SAVE % str(ROOT / "examples" / "pretrain_gpt.py")
    run = subprocess.run([sys.executable, "-c", script, *SMALL, "--train-iters", "6",
                          "--save", str(ckpt), "--save-interval", "2"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    from jax_wgrad.training import Checkpointer

    latest = Checkpointer(ckpt).latest_step()
    assert latest in (2, 4), latest  # 4 only if its write finished before the kill
    leftovers = [p.name for p in ckpt.iterdir() if not p.name.isdigit()]
    out = tmp_path / "after.jsonl"
    example.main(SMALL + ["--train-iters", str(latest + 1), "--load", str(ckpt),
                          "--metrics-file", str(out)])
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [latest + 1]
    assert all("tmp" in name for name in leftovers), leftovers
    assert np.isfinite(_losses(out)).all()
