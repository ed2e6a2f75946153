"""The compile-only command lines without compiling: ``--report-json`` validation in
``examples/pretrain_gpt.py`` and ``benchmarks/scale_table.py``'s layouts, rows and table
(from canned report figures). No CUDA plugin needed."""

import json
import os
import subprocess
import sys

import pytest
from script_util import ROOT, load_script

from jax_wgrad.pretrain import cli

# ------------------------------------------------------------ --report-json validation

SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--seq-length",
    "32",
    "--global-batch-size",
    "16",
    "--micro-batch-size",
    "2",
]


def _usage_error(pretrain, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def test_report_json_needs_compile_only(pretrain, capsys, tmp_path):
    path = tmp_path / "r.json"
    line = _usage_error(pretrain, [*SMALL, "--report-json", str(path)], capsys)
    assert line.endswith(
        f"error: --report-json {path}: needs --compile-only (the report "
        "is of a compile for --target GPUs)"
    )
    assert not path.exists()


def test_report_json_path_must_be_writable(pretrain, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    path = a_file / "r.json"  # its "directory" is a file: cannot be created
    line = _usage_error(pretrain, ["--compile-only", *SMALL, "--report-json", str(path)], capsys)
    assert line.endswith(f"error: --report-json {path}: {a_file} is not a directory")
    line = _usage_error(
        pretrain, ["--compile-only", *SMALL, "--report-json", str(tmp_path)], capsys
    )
    assert line.endswith(f"error: --report-json {tmp_path}: is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no probe left


_PLATFORMS = """
import os, sys
if sys.argv[1] == "jax-first":
    import jax
from jax_wgrad.pretrain.launch import start_jax_on_cpu_to_compile_only
assert sys.argv[1] == "jax-first" or "jax" not in sys.modules  # the launcher imports no jax
start_jax_on_cpu_to_compile_only(sys.argv[2:])
print(os.environ.get("JAX_PLATFORMS"))
"""


@pytest.mark.parametrize(
    "argv, env, want",
    [
        (["--compile-only"], None, "cpu"),
        (["--bf16", "--compile-o"], None, "cpu"),  # an abbreviation argparse accepts
        (["--bf16"], None, "None"),
        (["--compile-only"], "cuda", "cuda"),  # the user's choice stands
        (["jax-first", "--compile-only"], None, "None"),  # jax already imported: too late
    ],
)
def test_compile_only_starts_jax_on_the_cpu(argv, env, want):
    """Before jax is imported (a fresh process, as the example is run), only with
    --compile-only, never over the user's JAX_PLATFORMS."""
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if env is not None:
        environ["JAX_PLATFORMS"] = env
    argv = argv if argv[0] == "jax-first" else ["plain", *argv]
    out = subprocess.run(
        [sys.executable, "-c", _PLATFORMS, *argv],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == want


# ------------------------------------------------------------------------ scale table


@pytest.fixture(scope="module")
def scale():
    return load_script("benchmarks/scale_table.py")


def _figures(**over) -> dict:
    """A report's figures (``--report-json``) as the example writes them."""
    gib = 1 << 30
    out = {
        "target": "NVIDIA H100 80GB HBM3",
        "gpus_per_host": 8,
        "hosts": 1,
        "mesh_shape": [2, 1, 2, 2],
        "num_params": 8_030_000_000,
        "params_per_device": 2_000_000_000,
        "peak_bytes": int(32.7 * gib),
        "budget_bytes": int(59.32 * gib),
        "device_memory_bytes": 84929347584,
        "mem_fraction": 0.75,
        "memory_bandwidth_bytes_per_s": 3.35e12,
        "fits": True,
        "params_bytes": 4_000_000_000,
        "optimizer_bytes": 12_000_000_000,
        "grad_bytes": 8_000_000_000,
        "temp_bytes": 10 * gib,
        "bytes_per_param": {"params": 2.0, "grads": 4.0, "optimizer": 6.0, "total": 12.0},
        "megatron_bytes_per_param": {"params": 2.0, "grads": 4.0, "optimizer": 6.0, "total": 12.0},
        "megatron_formula": "2 + 4 + 12/DP (DP 2)",
        "launches_per_microbatch": 805.2,
        "non_gemm_bytes_per_microbatch": 58.4e9,
        "fused_calls": 9,
        "fused_aliased": 9,
        "loop_bucket_ops": [],
        "compile_s": 37.2,
        "host_syncs_per_step": 78.0,
        "estimated_step_ms": 1110.7,
        "estimated_mfu": 0.3,
        "dp_sync_overlapped": False,
    }
    out.update(over)
    return out


def test_layouts_are_the_promised_ones(scale, capsys):
    names = [layout.name for layout in scale.LAYOUTS]
    assert len(names) == len(set(names)) == len(scale.BY_NAME)
    gpus = {(layout.model, layout.gpus) for layout in scale.LAYOUTS}
    assert {
        ("llama3-8b", 8),
        ("llama3-70b", 64),
        ("mixtral-8x7b", 16),
        ("mixtral-8x7b", 32),
    } <= gpus
    assert sum(layout.model == "llama3-8b" for layout in scale.LAYOUTS) >= 3
    seqs = {layout.flags[layout.flags.index("--seq-length") + 1] for layout in scale.LAYOUTS}
    assert seqs == {"4096", "8192", "32768", "131072"}  # the long ones: context parallelism
    for layout in scale.LAYOUTS:
        argv = layout.argv("h200")
        per_host, hosts = (
            int(argv[argv.index(f) + 1]) for f in ("--target-gpus", "--target-hosts")
        )
        assert per_host * hosts == layout.gpus and "--target" in argv and "h200" in argv
        for flag in scale.COMMON_FLAGS:
            assert flag in argv
    # every layout's flags parse with the example's parser (names, choices, values)
    for layout in scale.LAYOUTS:
        parser = cli.make_parser()
        cli.apply_preset(parser, layout.argv("h100"))
        parser.parse_args(layout.argv("h100"))
    scale.main(["--list"])
    out = capsys.readouterr().out
    assert all(name in out for name in names)
    assert "--target-hosts 8 --model llama3-70b" in out


def test_only_names_known_layouts(scale, capsys):
    with pytest.raises(SystemExit) as exc:
        scale.main(["--only", "llama3-8b-tp2pp2dp2-s4k", "gpt-5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --only: unknown layout gpt-5; known: llama3-8b-tp2pp2dp2-s4k, " in err


def test_rows_table_and_jsonl_from_canned_reports(scale, capsys, tmp_path):
    """Each layout's compile is a call of ``run``; its row goes to the table and to the
    JSON lines; a layout whose compile fails is a row saying so (the rest still run)."""
    calls = []

    def fake_run(layout, target, timeout):
        calls.append((layout.name, target))
        if layout.name == "llama3-70b-tp8pp4dp2-s4k-full":
            return {
                "name": layout.name,
                "gpus": layout.gpus,
                "status": "failed",
                "wall_s": 3.0,
                "error": "OverflowError: Python integer 3087138816 out of bounds for int32 | x",
            }
        if layout.name == "llama3-8b-tp2dp4-s4k":
            return {
                "name": layout.name,
                "gpus": layout.gpus,
                "wall_s": 50.0,
                "status": "does not fit",
                **_figures(
                    fits=False,
                    peak_bytes=int(61.32 * (1 << 30)),
                    loop_bucket_ops=["copy copy.1 f32[100]{0}"],
                    fused_aliased=8,
                ),
            }
        return {
            "name": layout.name,
            "gpus": layout.gpus,
            "wall_s": 40.0,
            "status": "fits",
            **_figures(),
        }

    out, jsonl = tmp_path / "scale.md", tmp_path / "scale.jsonl"
    only = ["llama3-8b-tp2pp2dp2-s4k-full", "llama3-8b-tp2dp4-s4k", "llama3-70b-tp8pp4dp2-s4k-full"]
    rows = scale.main(
        ["--only", *only, "--target", "h200", "--out", str(out), "--jsonl", str(jsonl)],
        run=fake_run,
    )
    assert calls == [(n, "h200") for n in only]  # in the table's order, one at a time
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3
    assert table[1] == (
        "| `llama3-8b-tp2pp2dp2-s4k-full` | 8 | 2, 1, 2, 2 | 32.7 / 59.3 GiB | "
        "yes (26.6 GiB spare) | 2.00 + 4.00 + 6.00 = 12.0 (2 + 4 + 6.00 = 12.0) | "
        "58.4 GB (17.4 ms) | 805 | 78 | 1111 ms (30.0%) | exposed | 9/9 | 37 s |"
    )
    assert "| **no** (over by 2.0 GiB) |" in table[2]
    assert "| 8/9; **1 bucket-sized ops per tick** |" in table[2]
    assert table[3].startswith(
        "| `llama3-70b-tp8pp4dp2-s4k-full` | 64 | — | — | — | "
        "**failed**: OverflowError: Python integer 3087138816 out "
        "of bounds for int32 \\| x |"
    )
    assert table[3].count("|") - table[3].count("\\|") == len(scale.COLUMNS) + 1
    assert "Compiled for H200 with `benchmarks/scale_table.py`" in printed
    saved = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["name"] for r in saved] == only == [r["name"] for r in rows]
    assert saved[0]["peak_bytes"] == _figures()["peak_bytes"]
    # the same table again from the JSON lines, compiling nothing
    again = scale.main(["--from-jsonl", str(jsonl)], run=None)
    assert capsys.readouterr().out == printed and again == saved


def test_out_must_be_writable(scale, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exc:
        scale.main(["--out", str(a_file / "t.md")], run=None)  # nothing compiled
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: --out {a_file / 't.md'}: cannot write there (" in err


def test_a_crashing_example_is_a_row(scale, tmp_path):
    """run_layout on a "python" that exits with an error: the row carries its last line."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
        "echo 'OverflowError: out of bounds for int32' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    row = scale.run_layout(scale.LAYOUTS[0], "h100", python=str(fake))
    assert row["status"] == "failed" and row["returncode"] == 1
    assert row["error"] == "OverflowError: out of bounds for int32"
    assert row["command"].startswith(
        ".venv/bin/python examples/pretrain_gpt.py --compile-only --target h100"
    )
