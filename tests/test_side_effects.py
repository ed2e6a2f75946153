"""The library changes nothing process-wide; the pretraining job (``jax_wgrad.pretrain.main``)
changes the exception hooks, the warning filters and file descriptor 1 only while it runs,
and leaves them as it found them when it returns, fails, or is interrupted."""

import logging
import os
import sys
import threading
import warnings

import jax
import pytest

from jax_wgrad.pretrain import job
from jax_wgrad.training import checkpoint

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

TINY = [
    "--num-layers",
    "1",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--no-progress",
]


def _process_state() -> dict:
    fd1 = os.fstat(1)
    return {
        "sys.excepthook": sys.excepthook,
        "sys.unraisablehook": sys.unraisablehook,
        "threading.excepthook": threading.excepthook,
        "warnings.filters": list(warnings.filters),
        "asyncio log filters": list(logging.getLogger("asyncio").filters),
        "fd 1": (fd1.st_dev, fd1.st_ino),
    }


def _changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if a[k] != b[k]}


def _failed_restore(directory) -> None:
    """A restore that fails as a damaged checkpoint's does (a file missing)."""

    def read():
        raise FileNotFoundError(2, "No such file", str(directory / "3" / "params"))

    with pytest.raises(checkpoint.CheckpointError, match="step 3"):
        checkpoint.Checkpointer(directory)._read(3, read)


def test_a_failed_restore_outside_the_job_changes_nothing(tmp_path):
    before = _process_state()
    _failed_restore(tmp_path / "ckpt")
    assert _process_state() == before
    assert checkpoint._QUIET_SCOPES == []


def test_main_leaves_the_process_as_it_found_it_after_a_run(capsys):
    before = _process_state()
    summary = job.main(TINY + ["--train-iters", "1"])
    assert summary["steps"] == 1
    assert _process_state() == before
    assert "done:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "ending, code",
    [
        (checkpoint.CheckpointError, None),  # an exception main does not handle
        (KeyboardInterrupt, 130),  # Ctrl-C: SystemExit(130)
        ("usage", 2),  # a usage error: SystemExit(2)
    ],
)
def test_main_leaves_the_process_as_it_found_it_when_it_raises(
    tmp_path, monkeypatch, capsys, ending, code
):
    """Inside the job (a stand-in for its training, after the flags are checked) the hooks,
    the warning filters and fd 1 are the job's; after it ends by an exception, by Ctrl-C
    or by a usage error they are what they were before."""
    inside = []

    def train(parser, args, opts):
        inside.append(_process_state())
        _failed_restore(tmp_path / "ckpt")  # arms the quieting of its leftovers
        inside.append(_process_state())
        if ending is checkpoint.CheckpointError:
            raise checkpoint.CheckpointError(str(tmp_path), 3, "damaged")
        if ending is KeyboardInterrupt:
            raise KeyboardInterrupt
        parser.error("a usage error")

    monkeypatch.setattr(job, "train", train)
    # --distributed (with a coordinator, never contacted here) routes fd 1 through the
    # filter of the CPU collectives' chatter
    argv = TINY + ["--distributed", "--coordinator-address", "localhost:1"]
    before = _process_state()
    if code is None:
        with pytest.raises(checkpoint.CheckpointError):
            job.main(argv)
    else:
        with pytest.raises(SystemExit) as exc:
            job.main(argv)
        assert exc.value.code == code
    assert _process_state() == before
    assert checkpoint._QUIET_SCOPES == []
    started, armed = inside
    assert _changed(before, started) == {"sys.unraisablehook", "fd 1"}
    assert _changed(started, armed) == {
        "sys.excepthook",
        "sys.unraisablehook",
        "threading.excepthook",
        "warnings.filters",
        "asyncio log filters",
    }
    if code == 130:
        assert "interrupted; no checkpoint was written (no --save)" in capsys.readouterr().err
