"""Helpers of the tests that compare with Hugging Face fixtures (``tests/fixtures/hf/``,
made by ``tools/make_hf_fixtures.py`` with ``transformers``)."""

import json
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.interop.hf import shard_files
from jax_wgrad.layout import lay_out

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def hf_config(family: str) -> dict:
    """The fixture's ``config.json``."""
    return json.loads((FIXTURES / family / "config.json").read_text())


def reference(family: str):
    """The fixture's ``reference.npz``: ``tokens``, ``logits_fp32``, ``logits_bf16``."""
    return np.load(FIXTURES / family / "reference.npz")


def file_tensors(directory) -> dict[str, np.ndarray]:
    """Every tensor of a directory's safetensors shards, by name."""
    from safetensors import safe_open

    out = {}
    for path in shard_files(directory):
        with safe_open(path, framework="numpy") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def assert_export_round_trip_is_bitwise(family: str, out) -> None:
    """Fixture ``family`` imported, exported into ``out`` (sharded), imported again: the
    same config and parameters bitwise, and the written files hold exactly the fixture's
    (bf16) tensors, as fp32, under the same names."""
    from jax_wgrad.interop import export_hf, import_hf

    cfg, params = import_hf(FIXTURES / family)
    files = export_hf(cfg, params, out, max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json") in files
    cfg2, params2 = import_hf(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    theirs, ours = file_tensors(FIXTURES / family), file_tensors(out)
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k].astype(np.float32), err_msg=k)


def log_softmax(x) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def pipeline_loss(cfg, params, tokens, dp, tp, pp, sp) -> float:
    """The library's mean token loss of canonical ``params`` on ``tokens`` ``[B, S + 1]``
    through the pipeline's evaluation on a ``(dp, tp, pp)`` layout (``sp``: sequence
    parallelism), micro-batch 1."""
    from jax_wgrad import GPTProgram, ParallelConfig, make_mesh
    from jax_wgrad.parallel.mesh import DATA_PARALLEL
    from jax_wgrad.parallel.pipeline.evaluate import eval_loss

    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=1,
        global_batch_size=tokens.shape[0],
        sequence_parallel=sp,
    )
    assert par.data_parallel_size == dp, (par.data_parallel_size, dp)
    mesh, program = make_mesh(par), lay_out(GPTProgram(cfg, par))
    specs = program.param_specs()
    fn = jax.shard_map(
        lambda p, t: eval_loss(program, program.device_tree(p), t),
        mesh=mesh,
        in_specs=(specs, P(DATA_PARALLEL)),
        out_specs=P(),
        check_vma=False,
    )
    shard = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    return float(
        jax.jit(fn)(
            jax.device_put(params, shard),
            jax.device_put(tokens, NamedSharding(mesh, P(DATA_PARALLEL))),
        )
    )
