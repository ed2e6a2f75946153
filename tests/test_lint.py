"""The tree is ruff-clean: ``ruff check`` and ``ruff format --check`` over the repository,
with the configuration of ``pyproject.toml`` (ruff is pinned in the ``test`` extra)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed; pip install -e '.[test]' installs the pinned version",
)


@pytest.mark.parametrize(
    "command",
    [["check", "--output-format", "concise"], ["format", "--check", "--diff"]],
    ids=["check", "format"],
)
def test_ruff(command):
    # --no-cache: the test writes nothing into the tree.
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"ruff {' '.join(command)} failed:\n{run.stdout}{run.stderr}"
