"""The built FFI handlers as jax meets them: the API version they declare, registration
that can fail without breaking jax, a status that tells the truth everywhere (under
tracing, after a transient failure, on every process), per op family (a broken expert
kernel leaves a dense model's fusion usable; an MoE plan is gated on its own family), the
CUDA library's architectures and command-buffer (CUDA graph) compatibility."""

import importlib
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_wgrad
from jax_wgrad import ops
from jax_wgrad.ops import handlers, status, wgrad


def _loaded_platforms() -> list[str]:
    return [p for p in handlers.PLATFORMS if handlers.load_error(p) is None]


# ---- 1. handlers that load into every supported jax ----------------------------------


def test_built_handlers_declare_the_oldest_supported_api():
    # Asked the way XLA asks at registration (a metadata call frame): every handler must
    # declare an FFI API that jax 0.10.2 (0.3) accepts -- XLA rejects newer handlers.
    assert handlers.OLDEST_SUPPORTED_FFI_API == (0, 3)
    assert "cpu" in _loaded_platforms()
    for platform in _loaded_platforms():
        module = importlib.import_module(handlers._MODULES[platform][0])
        if module.built_for_newer_ffi_api:
            pytest.skip(
                f"the {platform} handlers were built with "
                "JAX_WGRAD_ALLOW_NEWER_FFI_API=ON (they load into that jax and newer)"
            )
        metadata = handlers.handler_metadata(platform)
        assert set(metadata) == {
            handlers.TARGET,
            handlers.TARGET_AT,
            handlers.BUCKET_ADD_TARGET,
            handlers.RAGGED_MATMUL_TARGET,
            handlers.RAGGED_WGRAD_TARGET,
            handlers.FP8_TARGET,
            handlers.FP8_TARGET_AT,
        }, platform
        for name, meta in metadata.items():
            assert tuple(meta["api_version"]) <= handlers.OLDEST_SUPPORTED_FFI_API, (
                platform,
                name,
                meta,
            )


def test_runtime_ffi_api_is_read_from_the_running_jaxlib():
    runtime = handlers.runtime_ffi_api()
    assert runtime is not None and runtime >= handlers.OLDEST_SUPPORTED_FFI_API
    if jax.__version__ == "0.10.2":
        assert runtime == (0, 3)


_REAL_IMPORT = importlib.import_module


def _importing(monkeypatch, name, fake):
    """``importlib.import_module(name)`` returns ``fake`` (an object, or an exception to
    raise); every other import is the real one."""

    def import_module(requested, *args, **kwargs):
        if requested != name:
            return _REAL_IMPORT(requested, *args, **kwargs)
        if isinstance(fake, Exception):
            raise fake
        return fake

    monkeypatch.setattr(importlib, "import_module", import_module)


class _FakeModule:
    """A handler module as a build against other headers would export it."""

    def __init__(self, version=(0, 3), registrations=None):
        self.version, self._registrations, self.registered = version, registrations, False

    def handler_metadata(self):
        return {
            "fake_target": {
                "api_version": self.version,
                "traits": 0,
                "command_buffer_compatible": False,
            }
        }

    def registrations(self):
        self.registered = True
        if self._registrations is None:
            raise RuntimeError("INVALID_ARGUMENT: duplicate registration")
        return self._registrations


def test_newer_handler_api_is_a_status_not_a_broken_backend(monkeypatch):
    fake = _FakeModule(version=(0, 99))
    _importing(monkeypatch, "jax_wgrad._fake", fake)
    monkeypatch.setattr(handlers, "_METADATA", {})
    reason = handlers._register_module("cpu", "jax_wgrad._fake", "cpu")
    assert "built against XLA FFI API 0.99, newer than this jaxlib's" in reason
    assert "Rebuild jax_wgrad" in reason
    assert not fake.registered  # nothing reached XLA
    # ... and jax's CPU backend still works.
    assert float(jnp.ones(3).sum()) == 3.0


def test_registration_error_is_a_status(monkeypatch):
    fake = _FakeModule(version=(0, 1), registrations=None)
    _importing(monkeypatch, "jax_wgrad._fake", fake)
    monkeypatch.setattr(handlers, "_METADATA", {})
    reason = handlers._register_module("cuda", "jax_wgrad._fake", "CUDA")
    assert reason.startswith("registering the handlers of jax_wgrad._fake failed: ")
    assert "duplicate registration" in reason


def test_import_error_is_a_status(monkeypatch):
    _importing(
        monkeypatch,
        "jax_wgrad._wgrad_ffi_cuda",
        ImportError("libcublas.so.13: cannot open shared object file"),
    )
    reason = handlers._register_module("cuda", "jax_wgrad._wgrad_ffi_cuda", "CUDA")
    assert "could not be imported: libcublas.so.13" in reason


# ---- 2. a status that tells the truth everywhere ---------------------------------------


@pytest.fixture
def fresh_status(monkeypatch):
    """No status remembered (of any ``(platform, family)``): the next query probes again."""
    monkeypatch.setattr(status, "_VERIFIED", {})


def test_status_asked_while_tracing_is_not_a_failure(fresh_status):
    seen = []

    def f(x):
        seen.append(ops.fusion_status()["cpu"])
        return x + 1

    jax.jit(f)(1.0)
    jax.eval_shape(f, jax.ShapeDtypeStruct((2,), jnp.float32))
    assert seen == [None, None]
    assert status._VERIFIED["cpu", "dense"] is None
    assert status._VERIFIED["cpu", "bucket_add"] is None


def test_fused_linear_built_inside_nnx_eval_shape(fresh_status):
    # Building the module runs require_fusion (a probe) inside NNX's abstract trace.
    layer = nnx.eval_shape(
        lambda: jax_wgrad.Linear(4, 3, gradient_accumulation_fusion=True, rngs=nnx.Rngs(0))
    )
    assert layer.weight.get_value().shape == (3, 4) == layer.main_grad.get_value().shape
    assert ops.fusion_status()["cpu"] is None


def test_probe_runs_on_a_device_of_this_process(fresh_status, monkeypatch):
    # jax.devices() lists every process's devices; only local ones can run the probe.
    def no_global_devices(*args, **kwargs):
        raise AssertionError("the probe must not pick a device from jax.devices()")

    monkeypatch.setattr(jax, "devices", no_global_devices)
    assert status._status("cpu") is None


def test_transient_failure_is_not_remembered(fresh_status, monkeypatch):
    real = jax.local_devices

    def none_yet(*args, **kwargs):
        raise RuntimeError("Unknown backend cpu")

    monkeypatch.setattr(jax, "local_devices", none_yet)
    assert "jax sees no cpu device of this process" in status._status("cpu")
    assert "jax sees no cpu device of this process" in ops.op_status("cpu")["ragged"]
    assert status._VERIFIED == {}
    monkeypatch.setattr(jax, "local_devices", real)
    assert status._status("cpu") is None and status._VERIFIED["cpu", "dense"] is None


def test_out_of_memory_is_not_remembered(fresh_status, monkeypatch):
    def oom(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    monkeypatch.setattr(wgrad, "wgrad_accumulate", oom)
    assert "RESOURCE_EXHAUSTED" in status._status("cpu")
    assert ("cpu", "dense") not in status._VERIFIED


def _break(monkeypatch, op: str) -> None:
    """``ops.<op>`` returns its accumulator (or input) unchanged: a kernel that runs but
    computes nothing, as the probe calls it (from the module that defines it)."""
    monkeypatch.setattr(
        importlib.import_module(getattr(ops, op).__module__),
        op,
        lambda *args, **kwargs: args[2] if op == "grouped_wgrad_accumulate" else args[0],
    )


@pytest.mark.parametrize(
    "broken,family,case",
    [
        ("wgrad_accumulate", "dense", "float32 default"),
        ("grouped_wgrad_accumulate", "grouped", "grouped experts into a bucket"),
        ("bucket_add", "bucket_add", "bucket_add of several blocks"),
        ("ragged_matmul", "ragged", "ragged_matmul float32 transpose_rhs=1"),
        ("ragged_wgrad_accumulate", "ragged", "ragged_wgrad_accumulate float32"),
    ],
)
def test_probe_checks_every_kernel_variant(fresh_status, monkeypatch, broken, family, case):
    _break(monkeypatch, broken)
    per_family = ops.op_status("cpu")
    assert per_family[family].endswith(f"returned wrong values ({case})"), per_family
    # Every other family has its own program: unaffected.
    assert {f for f, reason in per_family.items() if reason is not None} == {family}
    # The dense model's view: only its families count; a reason names the family.
    dense = status._status("cpu")
    if family in ops.DENSE_FAMILIES:
        assert dense.startswith(f"op family '{family}': ") and dense.endswith(f"({case})")
    else:
        assert dense is None


def test_probe_cases_cover_the_variants():
    cases = [(c.name, c.family) for c in status._probe_cases()]
    assert cases == [
        ("float32 default", "dense"),
        ("float32 highest", "dense"),
        ("bfloat16 into float32", "dense"),
        ("bfloat16 into bfloat16", "dense"),
        ("float16 into float32", "dense"),
        ("float16 into float16", "dense"),
        ("offset block of a flat bucket", "dense"),
        ("grouped experts into a bucket", "grouped"),
        ("traced offset block of a flat bucket", "dense"),
        ("grouped experts at a traced, clamped offset", "grouped"),
        ("block at a 64-bit position base + index * stride", "dense"),
        ("grouped experts at an aligned position base + index * stride", "grouped"),
        ("bucket_add of several blocks", "bucket_add"),
        ("ragged_matmul float32 transpose_rhs=1", "ragged"),
        ("ragged_matmul bfloat16 transpose_rhs=0", "ragged"),
        ("ragged_matmul bfloat16 K = N = 8 transpose_rhs=1", "ragged"),
        ("ragged_matmul bfloat16 K = N = 8 transpose_rhs=0", "ragged"),
        ("ragged_wgrad_accumulate float32", "ragged"),
        ("ragged_wgrad_accumulate bfloat16 into bfloat16", "ragged"),
        ("ragged_wgrad_accumulate float16 into a bucket", "ragged"),
        ("ragged_wgrad_accumulate at a traced, clamped offset", "ragged"),
        ("ragged_wgrad_accumulate bfloat16 into float32, out = in = 8", "ragged"),
        ("ragged_wgrad_accumulate at a 64-bit position base + index * stride", "ragged"),
    ]
    assert handlers.OP_FAMILIES == ("dense", "bucket_add", "grouped", "ragged")
    assert handlers.DENSE_FAMILIES == ("dense", "bucket_add")
    assert {c.family for c in status._probe_cases()} == set(handlers.OP_FAMILIES)
    for family in handlers.OP_FAMILIES:
        assert [c.family for c in status._probe_cases(family)] == [
            f for _, f in cases if f == family
        ]


# ---- 3. a status per op family -------------------------------------------------------


def test_families_are_probed_in_order(fresh_status):
    # Asking for the ragged family first still runs the dense program first (a sticky
    # CUDA error left by a later family cannot hide the dense result), one per family.
    ops.require_fusion("cpu", families=("ragged",))
    assert list(status._VERIFIED) == [("cpu", f) for f in handlers.OP_FAMILIES]
    assert ops.op_status("cpu") == dict.fromkeys(handlers.OP_FAMILIES)
    assert ops.op_status() == ops.op_status("cpu")  # jax's default backend: the CPU here
    with pytest.raises(ValueError, match="unknown op families \\['moe'\\]"):
        ops.fusion_status(families=("dense", "moe"))


def test_a_broken_ragged_kernel_leaves_dense_fusion_usable(fresh_status, monkeypatch):
    _break(monkeypatch, "ragged_matmul")
    case = "ragged_matmul float32 transpose_rhs=1"
    # The dense model's fused path (the default families) still works ...
    assert ops.fusion_status()["cpu"] is None and jax_wgrad.fusion_status()["cpu"] is None
    assert ops.fusion_available("cpu") and jax_wgrad.fusion_available("cpu")
    ops.require_fusion("cpu")
    layer = jax_wgrad.Linear(4, 3, gradient_accumulation_fusion=True, rngs=nnx.Rngs(0))
    assert layer.main_grad.get_value().shape == (3, 4)
    # ... while the ragged family is reported broken, naming the case ...
    per_family = ops.op_status("cpu")
    assert per_family["ragged"].endswith(f"returned wrong values ({case})"), per_family
    assert per_family["dense"] is per_family["bucket_add"] is per_family["grouped"] is None
    assert not ops.fusion_available("cpu", families=("dense", "ragged"))
    assert ops.fusion_status(families="ragged")["cpu"].startswith("op family 'ragged': ")
    # ... and refused where asked for, in Megatron's words naming the family.
    with pytest.raises(RuntimeError, match=r"op family 'ragged'.*\(ragged_matmul float32"):
        ops.require_fusion("cpu", families=("ragged",), who="moe")
    with pytest.raises(RuntimeError, match="^moe was called with gradient_accumulation_fusion"):
        ops.require_fusion("cpu", families=("ragged",), who="moe")


def _tiny_gpt(**moe) -> jax_wgrad.GPTConfig:
    return jax_wgrad.GPTConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=32,
        **moe,
    )


_DROPLESS = dict(num_moe_experts=4, moe_ffn_hidden_size=16)
_CAPACITY = dict(
    _DROPLESS,
    moe_expert_capacity_factor=1.0,
    moe_pad_expert_input_to_capacity=True,
    moe_grouped_gemm=True,
)


def _fused_plan(model: jax_wgrad.GPTConfig) -> jax_wgrad.TrainPlan:
    par = jax_wgrad.ParallelConfig(gradient_accumulation_fusion=True, world_size=1)
    mesh = jax_wgrad.make_mesh(par, jax.devices("cpu")[:1])
    return jax_wgrad.TrainPlan.create(model, par, mesh, jax_wgrad.default_optimizer(1e-3))


def test_a_program_names_the_families_it_fuses():
    par = jax_wgrad.ParallelConfig(gradient_accumulation_fusion=True, world_size=1)
    families = lambda model: jax_wgrad.GPTProgram(model, par, "cpu").fused_op_families
    assert families(_tiny_gpt()) == ("dense", "bucket_add")
    assert families(_tiny_gpt(**_DROPLESS)) == ("dense", "bucket_add", "ragged")
    assert families(_tiny_gpt(**_CAPACITY)) == ("dense", "bucket_add", "grouped")
    # Capacity buffers without moe_grouped_gemm: the expert GEMMs are XLA's.
    no_grouped = dict(_CAPACITY, moe_grouped_gemm=False)
    assert families(_tiny_gpt(**no_grouped)) == ("dense", "bucket_add")


def test_an_moe_plan_is_gated_on_its_experts_family(fresh_status, monkeypatch):
    _break(monkeypatch, "ragged_matmul")
    # A dense GPT and a capacity-buffer MoE fuse; a dropless MoE (the ragged GEMMs) is
    # refused, naming the family.
    assert _fused_plan(_tiny_gpt()).program.fused_op_families == ("dense", "bucket_add")
    _fused_plan(_tiny_gpt(**_CAPACITY))
    with pytest.raises(RuntimeError, match=r"^gradient_accumulation_fusion was called.*'ragged'"):
        _fused_plan(_tiny_gpt(**_DROPLESS))


# ---- 4. CUDA architectures; 5. command buffers ------------------------------------------


def _cuobjdump() -> str | None:
    try:
        import nvidia.cu13

        for root in nvidia.cu13.__path__:
            tool = Path(root) / "bin" / "cuobjdump"
            if tool.exists():
                return str(tool)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _cuda_library() -> Path | None:
    spec = importlib.util.find_spec("jax_wgrad._wgrad_ffi_cuda")
    return Path(spec.origin) if spec is not None and spec.origin else None


def test_cuda_library_holds_sm80_sm90_sm100_code_and_ptx():
    library, tool = _cuda_library(), _cuobjdump()
    if library is None:
        pytest.skip("the CUDA handler was not built (no nvcc, or JAX_WGRAD_CUDA=OFF)")
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    elf = subprocess.run(
        [tool, "--list-elf", str(library)], capture_output=True, text=True, check=True
    ).stdout
    ptx = subprocess.run(
        [tool, "--list-ptx", str(library)], capture_output=True, text=True, check=True
    ).stdout
    for arch in ("sm_80", "sm_90", "sm_100"):
        assert f".{arch}.cubin" in elf, elf
    assert ".sm_100.ptx" in ptx, ptx


@pytest.mark.cuda_handler
def test_cuda_handlers_may_be_captured_into_cuda_graphs():
    metadata = handlers.handler_metadata("cuda")
    for name in (handlers.TARGET, handlers.TARGET_AT, handlers.BUCKET_ADD_TARGET):
        assert metadata[name]["command_buffer_compatible"], metadata
    # The wgrad targets are bundles: their initialize stage creates the cuBLAS handle before
    # any capture, so the execute stage only enqueues stream work.
    module = importlib.import_module("jax_wgrad._wgrad_ffi_cuda")
    for name in (handlers.TARGET, handlers.TARGET_AT):
        assert set(module.registrations()[name]) == {"initialize", "execute"}


def test_a_newer_jax_build_refuses_at_configure_time(tmp_path):
    # CMake reads the headers' version and stops with a clear message (no handler that
    # would break older jax is ever built), unless explicitly allowed.
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found")
    headers = tmp_path / "include" / "xla" / "ffi" / "api"
    headers.mkdir(parents=True)
    (headers / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 5\n")
    script = tmp_path / "check.cmake"
    source = (Path(__file__).resolve().parents[1] / "ffi" / "CMakeLists.txt").read_text()
    block = source[
        source.index("set(JAX_WGRAD_OLDEST_FFI_API") : source.index(
            'message(STATUS "jax_wgrad: XLA FFI API'
        )
    ]
    script.write_text(f'set(XLA_FFI_INCLUDE_DIR "{tmp_path / "include"}")\n' + block)
    out = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert "declare API 0.5, newer than 0.3" in " ".join(out.stderr.split())
    allowed = subprocess.run(
        [cmake, "-DJAX_WGRAD_ALLOW_NEWER_FFI_API=ON", "-P", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert allowed.returncode == 0, allowed.stderr
