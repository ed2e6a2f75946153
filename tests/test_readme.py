"""Every Python code sample of the README runs as written (each in a fresh namespace)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_samples():
    assert len(SAMPLES) >= 3


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_readme_sample_runs(index, capsys):
    exec(compile(SAMPLES[index], f"README.md sample {index}", "exec"), {"__name__": "__readme__"})
