"""Loading the repository's scripts (``examples/``, ``benchmarks/``) as modules in tests, and
the small GPT the tests of the pretraining job share."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at ``ROOT / relative`` (e.g. ``"benchmarks/moe_flops.py"``), executed as a
    module named after its file."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL_GPT = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--lr",
    "3e-3",
    "--seed",
    "3",
]
"""Flags of the small GPT run of ``examples/pretrain_gpt.py`` the job's tests share (4
layers, hidden 32, 16 sequences of 32 tokens per step)."""
