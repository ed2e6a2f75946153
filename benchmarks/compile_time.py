#!/usr/bin/env python
"""Compile time of the example's train step against the number of layers.

Runs ``examples/pretrain_gpt.py`` for one step per depth on the README's (2, 2, 2) layout
(tensor 2, pipeline 2, data 2, sequence parallelism, fused wgrad, distributed optimizer,
cooldown sync, deferred output-layer wgrad) and prints one JSON line per depth with the
example's own ``compile_time_s`` (jit trace + lower + XLA compile of the step)::

    python benchmarks/compile_time.py --layers 4 16 32

With the layers of a stage in a ``lax.scan`` the compile time is flat in the depth; the
unrolled form grew with it (``docs/design/pipeline_executor.md``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

LAYOUT = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--gradient-accumulation-fusion",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--defer-embedding-wgrad-compute",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    p.add_argument(
        "--example",
        default=str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"),
    )
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("pretrain_gpt", args.example)
    example = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = example
    spec.loader.exec_module(example)
    for n in args.layers:
        summary = example.main(
            LAYOUT + ["--num-layers", str(n), "--train-iters", "1", "--no-progress"]
        )
        print(
            json.dumps({"num_layers": n, "compile_time_s": round(summary["compile_time_s"], 2)}),
            flush=True,
        )


if __name__ == "__main__":
    main()
