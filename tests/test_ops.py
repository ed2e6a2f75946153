"""wgrad_accumulate: numerics against numpy float64, in-place HLO, transformations, errors."""

import functools
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls, entry_aliases_param
from jax.sharding import PartitionSpec as P

from jax_wgrad import ops
from jax_wgrad.ops import handlers, status, wgrad

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# (input dtype, main_grad dtype): every combination apex supports.
DTYPE_COMBOS = [(F32, F32), (BF16, F32), (F16, F32), (BF16, BF16), (F16, F16)]
UNIT_ROUNDOFF = {jnp.dtype(F32): 2.0**-24, jnp.dtype(BF16): 2.0**-8, jnp.dtype(F16): 2.0**-11}


def _data(seed, lead, n_in, n_out, in_dtype, acc_dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(lead + (n_in,)), in_dtype)
    dy = jnp.asarray(rng.standard_normal(lead + (n_out,)), in_dtype)
    acc = jnp.asarray(rng.standard_normal((n_out, n_in)), acc_dtype)
    return x, dy, acc


def _check_against_float64(result, x, dy, acc, *, input_roundoff=0.0):
    """|result - exact| within the fp32-accumulation bound (+ one final 16-bit rounding).

    The exact value uses the already-quantized inputs in float64. A dot of K terms
    summed in fp32 in any order errs by at most (K + 1) u32 * sum|terms|; a 16-bit
    accumulator adds one rounding of the result, u16 * |result|. Inputs rounded once more
    by the GEMM (TF32 tensor cores: ``input_roundoff`` = 2^-11) add (2u + u^2) per term.
    """
    x64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    dy64 = np.asarray(dy, np.float64).reshape(-1, dy.shape[-1])
    acc64 = np.asarray(acc, np.float64)
    exact = acc64 + dy64.T @ x64
    magnitude = np.abs(acc64) + np.abs(dy64).T @ np.abs(x64)
    bound = (x64.shape[0] + 2) * UNIT_ROUNDOFF[jnp.dtype(F32)] * magnitude
    bound += (2 * input_roundoff + input_roundoff**2) * magnitude
    bound += UNIT_ROUNDOFF[jnp.dtype(acc.dtype)] * np.abs(exact)
    got = np.asarray(result, np.float64)
    assert result.dtype == acc.dtype and result.shape == acc.shape
    excess = np.abs(got - exact) - bound
    assert excess.max() <= 0, f"max error over bound {excess.max()}"
    # The bound must not be vacuous: it stays far below the values themselves.
    assert np.median(bound / np.maximum(magnitude, 1e-30)) < 1e-2


@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
@pytest.mark.parametrize(
    "lead,n_in,n_out",
    [
        ((1,), 3, 5),
        ((7,), 13, 19),
        ((37,), 64, 17),
        ((4099,), 33, 24),
        ((3, 50), 16, 9),
        ((2, 3, 700), 11, 6),
    ],
)
def test_matches_float64(in_dtype, acc_dtype, lead, n_in, n_out):
    x, dy, acc = _data(0, lead, n_in, n_out, in_dtype, acc_dtype)
    _check_against_float64(jax.jit(ops.wgrad_accumulate)(x, dy, acc), x, dy, acc)


@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
def test_eager_and_zero_tokens(in_dtype, acc_dtype):
    x, dy, acc = _data(1, (0,), 8, 4, in_dtype, acc_dtype)
    assert ops.wgrad_accumulate(x, dy, acc) is acc  # T = 0: no-op
    x, dy, acc = _data(1, (5,), 8, 4, in_dtype, acc_dtype)
    _check_against_float64(ops.wgrad_accumulate(x, dy, acc), x, dy, acc)


def test_large_token_count_blocks_exactly():
    # T spans several 512-token conversion blocks plus a remainder.
    x, dy, acc = _data(2, (4096 + 77,), 40, 24, BF16, F32)
    _check_against_float64(jax.jit(ops.wgrad_accumulate)(x, dy, acc), x, dy, acc)


# Shapes big enough for the CPU handler to split each GEMM (for 16-bit inputs: the GEMM of
# each 512-token conversion block) into row (out >= in) or column tiles run on XLA's
# threads (at least 2 tiles of >= 8 MFLOP on a machine with 2+ cores); features that are
# not multiples of the 16-element tile alignment, T beyond one conversion block.
TILED_CASES = [((700,), 200, 97), ((600,), 61, 301), ((2, 515), 130, 129)]


@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
@pytest.mark.parametrize("lead,n_in,n_out", TILED_CASES)
def test_tiled_gemm_matches_float64(in_dtype, acc_dtype, lead, n_in, n_out):
    x, dy, acc = _data(20, lead, n_in, n_out, in_dtype, acc_dtype)
    _check_against_float64(jax.jit(ops.wgrad_accumulate)(x, dy, acc), x, dy, acc)


@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_tiled_gemm_flat_offset_and_vmap(in_dtype):
    # Tiles write only their block of a flat buffer; under vmap every batch element's.
    xs, dys, _ = _data(21, (2, 640), 112, 150, in_dtype, F32)
    block = 150 * 112
    flats = jnp.asarray(np.random.default_rng(3).standard_normal((2, block + 37)), F32)
    got = jax.jit(jax.vmap(functools.partial(ops.wgrad_accumulate, offset=21)))(xs, dys, flats)
    for i in range(2):
        np.testing.assert_array_equal(got[i, :21], flats[i, :21])
        np.testing.assert_array_equal(got[i, 21 + block :], flats[i, 21 + block :])
        _check_against_float64(
            got[i, 21 : 21 + block].reshape(150, 112),
            xs[i],
            dys[i],
            flats[i, 21 : 21 + block].reshape(150, 112),
        )


def test_repeated_accumulation_in_scan():
    xs, dys, acc = _data(3, (6, 33), 20, 12, F32, F32)

    def run(acc, xs, dys):
        return jax.lax.scan(lambda a, b: (ops.wgrad_accumulate(*b, a), None), acc, (xs, dys))[0]

    got = jax.jit(run)(acc, xs, dys)
    _check_against_float64(got, xs, dys, acc)  # sum over microbatches == one long T


def test_in_place_under_donated_jit():
    x, dy, acc = _data(4, (64,), 48, 40, BF16, F32)
    hlo = compiled_text(ops.wgrad_accumulate, x, dy, acc, donate_argnums=2)
    assert entry_aliases_param(hlo, 2), hlo.splitlines()[0]
    calls = custom_calls(hlo, handlers.TARGET)
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (2, {})}" in calls[0]
    assert calls[0].startswith("ROOT %wgrad_accumulate") or "%wgrad_accumulate" in calls[0]
    assert copies_of(hlo, "f32", (40, 48)) == []


def test_not_donated_costs_exactly_one_copy_semantics():
    # Without donation XLA must keep the input alive: the result is still correct and
    # the input buffer is untouched.
    x, dy, acc = _data(5, (16,), 8, 8, F32, F32)
    before = np.asarray(acc).copy()
    out = jax.jit(ops.wgrad_accumulate)(x, dy, acc)
    np.testing.assert_array_equal(np.asarray(acc), before)
    _check_against_float64(out, x, dy, acc)


def test_in_place_as_scan_carry():
    xs, dys, acc = _data(6, (4, 16), 24, 40, F32, F32)

    def run(acc, xs, dys):
        return jax.lax.scan(lambda a, b: (ops.wgrad_accumulate(*b, a), None), acc, (xs, dys))[0]

    hlo = compiled_text(run, acc, xs, dys, donate_argnums=0)
    assert entry_aliases_param(hlo, 0)
    assert "while(" in hlo and len(custom_calls(hlo, handlers.TARGET)) == 1
    assert copies_of(hlo, "f32", (40, 24)) == []


def test_vmap_matches_per_example():
    xs, dys, _ = _data(7, (3, 10), 6, 5, F32, F32)
    accs = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 6)), F32)
    got = jax.jit(jax.vmap(ops.wgrad_accumulate))(xs, dys, accs)
    for i in range(3):
        _check_against_float64(got[i], xs[i], dys[i], accs[i])
    # Unbatched accumulator: broadcast, one result per batch element.
    got = jax.vmap(ops.wgrad_accumulate, in_axes=(1, 1, None))(
        jnp.swapaxes(xs, 0, 1), jnp.swapaxes(dys, 0, 1), accs[0]
    )
    for i in range(3):
        _check_against_float64(got[i], xs[i], dys[i], accs[0])


def test_under_checkpoint():
    x, dy, acc = _data(8, (12,), 7, 3, F32, F32)
    f = jax.checkpoint(lambda x, dy, acc: ops.wgrad_accumulate(jnp.sin(x), dy, acc))
    _check_against_float64(jax.jit(f)(x, dy, acc), jnp.sin(x), dy, acc)


def test_in_shard_map_per_shard():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    x, dy, _ = _data(9, (8 * 5,), 6, 4, F32, F32)
    accs = jnp.asarray(np.random.default_rng(1).standard_normal((8 * 4, 6)), F32)
    fn = jax.shard_map(
        ops.wgrad_accumulate,
        mesh=mesh,
        in_specs=(P("data"), P("data"), P("data")),
        out_specs=P("data"),
    )
    got = jax.jit(fn)(x, dy, accs)
    assert (
        len(custom_calls(jax.jit(fn).lower(x, dy, accs).compile().as_text(), handlers.TARGET)) == 1
    )
    for i in range(8):
        sl, ac = slice(5 * i, 5 * i + 5), slice(4 * i, 4 * i + 4)
        _check_against_float64(got[ac], x[sl], dy[sl], accs[ac])


def test_visible_as_named_custom_call_in_profile(tmp_path):
    x, dy, acc = _data(10, (32,), 16, 8, F32, F32)
    fn = jax.jit(ops.wgrad_accumulate)
    hlo = fn.lower(x, dy, acc).compile().as_text()
    assert any("%wgrad_accumulate" in c for c in custom_calls(hlo, handlers.TARGET))
    fn(x, dy, acc).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        fn(x, dy, acc).block_until_ready()
    traces = glob.glob(os.path.join(tmp_path, "**", "*.xplane.pb"), recursive=True)
    assert traces, "the profiler wrote no trace"
    assert any(b"wgrad_accumulate" in open(t, "rb").read() for t in traces)


# ---- bad input --------------------------------------------------------------------
@pytest.mark.parametrize(
    "x,dy,acc,match",
    [
        ((5,), (5,), (1, 1), "rank >= 2"),
        ((5, 3), (5, 2, 1), (2, 3), "same rank"),
        ((5, 3), (4, 2), (2, 3), "leading"),
        ((5, 3), (5, 2), (3, 2), r"\[out, in\] = \[2, 3\]"),
        ((2, 5, 3), (2, 5, 2), (2, 2, 3), r"\[out, in\]"),
    ],
)
def test_bad_shapes(x, dy, acc, match):
    with pytest.raises(ValueError, match=match):
        ops.wgrad_accumulate(jnp.zeros(x), jnp.zeros(dy), jnp.zeros(acc))


@pytest.mark.parametrize(
    "in_dtype,dy_dtype,acc_dtype,match",
    [
        (jnp.int8, jnp.int8, F32, "float32, bfloat16 or float16"),
        (jnp.int32, jnp.int32, F32, "float32, bfloat16 or float16"),
        (BF16, F16, F32, "float32, bfloat16 or float16"),
        (F32, F32, BF16, "main_grad must be float32"),
        (BF16, BF16, F16, "main_grad must be float32"),
        (F16, F16, jnp.int32, "main_grad must be float32"),
    ],
)
def test_bad_dtypes(in_dtype, dy_dtype, acc_dtype, match):
    x = jax.ShapeDtypeStruct((4, 3), in_dtype)
    dy = jax.ShapeDtypeStruct((4, 2), dy_dtype)
    acc = jax.ShapeDtypeStruct((2, 3), acc_dtype)
    with pytest.raises(ValueError, match=match) as err:
        jax.eval_shape(ops.wgrad_accumulate, x, dy, acc)
    assert jnp.dtype(acc_dtype).name in str(err.value)  # names the offending dtypes


def test_handler_rejects_bad_operands_itself():
    # Bypass the Python checks: the C++ handler validates on its own.
    x = jnp.zeros((4, 3), jnp.int32)
    with pytest.raises(Exception, match="float32, bfloat16 or float16"):
        jax.jit(functools.partial(ops.wgrad_accumulate_p.bind, offset=0, precision=0))(
            x, jnp.zeros((4, 2), x.dtype), jnp.zeros((2, 3))
        )


def test_unavailable_platform_error(monkeypatch):
    monkeypatch.setitem(
        handlers._LOADED, "cuda", "jax_wgrad._wgrad_ffi_cuda could not be imported: x"
    )
    assert not ops.fusion_available("gpu")
    with pytest.raises(RuntimeError, match="you must turn off gradient accumulation fusion"):
        status.require_fusion("cuda")
    with pytest.raises(RuntimeError, match="no handler for platform 'tpu'"):
        status.require_fusion("tpu")


def test_cpu_handler_is_built():
    assert ops.fusion_available("cpu"), ops.fusion_status()


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI checks the CUDA build")
def test_cuda_handler_is_built_in_ci():
    # CI builds the CUDA handler (nvcc is on the PATH) so compile errors are caught. Loading
    # it also needs libcublas.so.13 (installed with jax's CUDA plugin), which a CPU-only
    # machine may lack: then the recorded reason must say so.
    import importlib.util

    assert importlib.util.find_spec("jax_wgrad._wgrad_ffi_cuda") is not None
    cuda = ops.fusion_status().get("cuda")
    assert cuda is None or "libcublas" in cuda or "no cuda device" in cuda, cuda


def test_fusion_status_is_shown_by_a_call(monkeypatch):
    assert ops.fusion_status()["cpu"] is None and status._VERIFIED["cpu", "dense"] is None
    assert not ops.fusion_available("tpu")
    # A handler that runs but is wrong, or fails, is reported as unavailable, with why.
    monkeypatch.setattr(status, "_VERIFIED", {})
    monkeypatch.setattr(wgrad, "wgrad_accumulate", lambda x, dy, acc, **kw: acc)
    assert not ops.fusion_available("cpu")
    assert "returned wrong values" in ops.fusion_status()["cpu"]
    with pytest.raises(RuntimeError, match="returned wrong values.*turn off gradient"):
        status.require_fusion("cpu")

    def broken(*args, **kw):
        raise RuntimeError("INTERNAL: handler exploded")

    monkeypatch.setattr(status, "_VERIFIED", {})
    monkeypatch.setattr(wgrad, "wgrad_accumulate", broken)
    assert "failed: RuntimeError: INTERNAL: handler exploded" in ops.fusion_status()["cpu"]


def test_cuda_registered_under_the_plugin_platform_name():
    # XLA's CUDA plugin flushes pending registrations keyed "CUDA" only
    # (docs/design/h100_findings.md, section 3).
    assert handlers._MODULES["cuda"][1] == "CUDA"


# ---- GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
@pytest.mark.parametrize("lead,n_in,n_out", [((1,), 3, 5), ((4099,), 33, 24), ((3, 50), 16, 9)])
@pytest.mark.parametrize("precision", [None, "highest"])
def test_gpu_matches_float64(in_dtype, acc_dtype, lead, n_in, n_out, precision):
    gpu = jax.devices("gpu")[0]
    x, dy, acc = jax.device_put(_data(11, lead, n_in, n_out, in_dtype, acc_dtype), gpu)
    got = jax.jit(functools.partial(ops.wgrad_accumulate, precision=precision))(x, dy, acc)
    tf32 = in_dtype == F32 and ops.matmul_precision(precision) < 2
    _check_against_float64(got, x, dy, acc, input_roundoff=2.0**-11 if tf32 else 0.0)


@pytest.mark.gpu
def test_gpu_fusion_status():
    assert ops.fusion_available("gpu"), ops.fusion_status()


_GPU_BAD_OPERANDS = r"""
import functools, jax, jax.numpy as jnp
from jax_wgrad import ops
gpu = jax.devices("gpu")[0]
cases = [
    (functools.partial(ops.wgrad_accumulate_p.bind, offset=0, precision=0),
     (jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 2), jnp.int32), jnp.zeros((2, 3)))),
    (functools.partial(ops.wgrad_accumulate_p.bind, offset=80, precision=0),
     (jnp.zeros((4, 6)), jnp.zeros((4, 5)), jnp.zeros(100))),
    (functools.partial(ops.bucket_add_p.bind, offsets=(6,)), (jnp.zeros(8), jnp.ones(3))),
]
for fn, args in cases:
    try:
        jax.jit(fn)(*jax.device_put(args, gpu)).block_until_ready()
        print("NO ERROR")
    except Exception as exc:
        print("ERROR:", str(exc).splitlines()[0])
print("ALIVE")
"""


# Host calls a CUDA handler may not make: it is recorded into XLA's CUDA graphs (the
# handlers declare the command-buffer trait), where CUDA refuses stream queries, allocation
# and synchronisation while capturing (cudaStreamGetDevice failed exactly so on an H200).
# And no iostreams: ``ostream << int64`` in a handler segfaulted in XLA's thread there.
_CAPTURE_UNSAFE = re.compile(
    r"\b(cudaStreamGetDevice|cudaStreamSynchronize|cudaDeviceSynchronize|cudaMalloc|"
    r"cudaFree|cudaMemcpy|cudaMemset|cudaStreamQuery)\s*\(|std::(o|i)?stringstream|"
    r"std::ostream|#include <(sstream|iostream|ostream)>"
)


def test_cuda_handlers_make_only_capture_safe_host_calls():
    root = os.path.join(os.path.dirname(__file__), "..", "ffi")
    sources = [
        p
        for p in sorted(glob.glob(os.path.join(root, "*")))
        if p.endswith((".cu", ".cuh", ".h")) and not p.endswith(("_cpu.h", "metadata.h"))
    ]
    assert any(p.endswith("wgrad_accumulate_cuda.cu") for p in sources), sources
    found = [
        f"{os.path.basename(p)}:{n}: {line.strip()}"
        for p in sources
        for n, line in enumerate(open(p).read().splitlines(), 1)
        if not line.lstrip().startswith("//") and _CAPTURE_UNSAFE.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.gpu
def test_gpu_handler_errors_are_python_exceptions():
    # In a subprocess: a crash fails this test instead of killing the test run.
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _GPU_BAD_OPERANDS], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-3000:])
    lines = run.stdout.splitlines()
    assert lines[-1] == "ALIVE", run.stdout
    errors = [l for l in lines if l.startswith("ERROR:")]
    assert len(errors) == 3, run.stdout
    assert "float32, bfloat16 or float16" in errors[0]
    assert "exceeds the flat main_grad" in errors[1]
    assert "does not fit in the bucket of 8 elements" in errors[2]


@pytest.mark.gpu
@pytest.mark.parametrize("bucket_dtype,grad_dtype", [(F32, F32), (F32, BF16), (BF16, BF16)])
def test_gpu_bucket_add_in_place(bucket_dtype, grad_dtype):
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(17)
    n = 1 << 20
    bucket = jax.device_put(jnp.asarray(rng.standard_normal(n), bucket_dtype), gpu)
    shapes = [(2048,), (64, 33), (5,)] + [(700,)] * 40  # > 32 blocks: two launches
    grads = [jax.device_put(jnp.asarray(rng.standard_normal(s), grad_dtype), gpu) for s in shapes]
    offsets, pos = [], 0
    for g in grads:
        offsets.append(pos)
        pos += g.size + 13
    fn = lambda b, *g: ops.bucket_add(b, g, offsets)
    hlo = compiled_text(fn, bucket, *grads, donate_argnums=0)
    hlo_dtype = {jnp.dtype(F32): "f32", jnp.dtype(BF16): "bf16"}[jnp.dtype(bucket_dtype)]
    assert entry_aliases_param(hlo, 0) and copies_of(hlo, hlo_dtype, (n,)) == []
    want = np.asarray(ops.bucket_add_ref(bucket, grads, offsets), np.float64)
    got = np.asarray(jax.jit(fn)(bucket, *grads), np.float64)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_gpu_in_place_under_donated_jit():
    gpu = jax.devices("gpu")[0]
    x, dy, acc = jax.device_put(_data(12, (256,), 128, 64, BF16, F32), gpu)
    hlo = compiled_text(ops.wgrad_accumulate, x, dy, acc, donate_argnums=2)
    assert entry_aliases_param(hlo, 2)
    assert copies_of(hlo, "f32", (64, 128)) == []


# ---- flat buffers (gradient buckets) -------------------------------------------------
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_flat_buffer_offset_updates_only_the_block(in_dtype):
    x, dy, _ = _data(13, (21,), 6, 5, in_dtype, F32)
    flat = jnp.asarray(np.random.default_rng(2).standard_normal(100), F32)
    got = jax.jit(functools.partial(ops.wgrad_accumulate, offset=64))(x, dy, flat)
    np.testing.assert_array_equal(got[:64], flat[:64])
    np.testing.assert_array_equal(got[94:], flat[94:])
    _check_against_float64(got[64:94].reshape(5, 6), x, dy, flat[64:94].reshape(5, 6))
    ref = ops.wgrad_accumulate_ref(x, dy, flat, offset=64)
    np.testing.assert_array_equal(ref[:64], flat[:64])
    _check_against_float64(ref[64:94].reshape(5, 6), x, dy, flat[64:94].reshape(5, 6))


def test_flat_buffer_two_params_in_place_in_scan():
    # Two weights living in one bucket: [w2 (5x6) at 0 | pad | w1 (6x4) at 64], 128 long.
    xs1, dys1, _ = _data(14, (3, 8), 4, 6, F32, F32)
    xs2, dys2, _ = _data(15, (3, 8), 6, 5, F32, F32)

    def run(bucket, xs1, dys1, xs2, dys2):
        def body(b, mb):
            b = ops.wgrad_accumulate(mb[2], mb[3], b, offset=0)
            return ops.wgrad_accumulate(mb[0], mb[1], b, offset=64), None

        return jax.lax.scan(body, bucket, (xs1, dys1, xs2, dys2))[0]

    bucket = jnp.zeros((128,), F32)
    hlo = compiled_text(run, bucket, xs1, dys1, xs2, dys2, donate_argnums=0)
    assert copies_of(hlo, "f32", (128,)) == [] and len(custom_calls(hlo, handlers.TARGET)) == 2
    got = jax.jit(run)(bucket, xs1, dys1, xs2, dys2)
    _check_against_float64(got[64:88].reshape(6, 4), xs1, dys1, jnp.zeros((6, 4)))
    _check_against_float64(got[:30].reshape(5, 6), xs2, dys2, jnp.zeros((5, 6)))
    np.testing.assert_array_equal(got[30:64], 0)
    np.testing.assert_array_equal(got[88:], 0)


def test_flat_buffer_vmap():
    xs, dys, _ = _data(16, (2, 7), 3, 2, F32, F32)
    flats = jnp.zeros((2, 10), F32)
    got = jax.vmap(functools.partial(ops.wgrad_accumulate, offset=4))(xs, dys, flats)
    for i in range(2):
        _check_against_float64(got[i, 4:10].reshape(2, 3), xs[i], dys[i], jnp.zeros((2, 3)))


@pytest.mark.parametrize("offset,shape", [(-1, (100,)), (71, (100,)), (0, (10, 10)), (1.5, (100,))])
def test_flat_buffer_bad_offset(offset, shape):
    x, dy = jnp.zeros((4, 6)), jnp.zeros((4, 5))
    with pytest.raises(ValueError, match=f"offset={offset!r}"):
        ops.wgrad_accumulate(x, dy, jnp.zeros(shape), offset=offset)


def test_handler_rejects_out_of_range_offset_itself():
    x, dy = jnp.zeros((4, 6)), jnp.zeros((4, 5))
    with pytest.raises(Exception, match=r"exceeds the flat main_grad"):
        jax.jit(functools.partial(ops.wgrad_accumulate_p.bind, offset=80, precision=0))(
            x, dy, jnp.zeros(100)
        )
