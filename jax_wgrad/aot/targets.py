"""GPUs to compile for without one: XLA ``GpuTargetConfigProto`` texts and their devices.

``h100``: an H100 SXM 80 GB (132 SMs, 3.35 TB/s, CUDA 13.0, cuDNN 9.10), the config XLA
wrote on such a machine (``h100_target_config.txtpb``, shipped with the package).
``h200``: the same Hopper chip with the H200's memory: ``device_memory_size`` (what CUDA
reports: nvidia-smi's 143,771 MiB less the 565 MiB the H100's config shows reserved),
``memory_bandwidth`` 4.8 TB/s and its name; everything else (SMs, caches, clocks) is the
H100's.
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

__all__ = ["TARGETS", "GpuTarget", "cuda_plugin", "gpu_target", "target_devices"]

TARGETS: tuple[str, ...] = ("h100", "h200")
"""Names accepted by :func:`gpu_target`."""

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU model to compile for."""

    name: str
    """``"h100"`` or ``"h200"``."""
    config: str
    """The ``GpuTargetConfigProto`` text XLA compiles against."""

    @property
    def description(self) -> str:
        return re.search(r'device_description_str: "([^"]*)"', self.config).group(1)

    @property
    def memory_bandwidth(self) -> float:
        """Device memory bandwidth in bytes/s (``memory_bandwidth``)."""
        return float(re.search(r"memory_bandwidth: (\d+)", self.config).group(1))

    @property
    def memory_bytes(self) -> int:
        """Device memory as CUDA reports it (``device_memory_size``)."""
        return int(re.search(r"device_memory_size: (\d+)", self.config).group(1))

    def with_memory(self, nbytes: int) -> GpuTarget:
        """The same GPU with ``nbytes`` of device memory (a smaller or larger variant)."""
        return GpuTarget(self.name, _with(self.config, device_memory_size=int(nbytes)))


def _h100() -> str:
    return resources.files("jax_wgrad.aot").joinpath("h100_target_config.txtpb").read_text()


def _with(config: str, **fields) -> str:
    for key, value in fields.items():
        text = f'"{value}"' if isinstance(value, str) else str(value)
        # A function replacement, not a template: ``text`` is inserted as is (no escapes).
        config, n = re.subn(
            rf"({key}: )(\"[^\"]*\"|\d+)", lambda m, text=text: m.group(1) + text, config
        )
        assert n == 1, key
    return config


def gpu_target(name: str) -> GpuTarget:
    """The target named ``name`` (one of :data:`TARGETS`).

    Raises:
      ValueError: an unknown name.
    """
    name = name.lower()
    if name == "h100":
        return GpuTarget("h100", _h100())
    if name == "h200":
        return GpuTarget(
            "h200",
            _with(
                _h100(),
                device_memory_size=(143771 - 565) * _MiB,
                memory_bandwidth=4_800_000_000_000,
                device_description_str="NVIDIA H200",
            ),
        )
    raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(TARGETS)}")


def cuda_plugin() -> str | None:
    """The module of jax's CUDA plugin installed here (``"jax_plugins.xla_cuda13"``), or
    ``None`` when there is none. Only looks: nothing is imported from the plugin."""
    import pkgutil

    try:
        import jax_plugins
    except ImportError:
        return None
    names = sorted(
        m.name for m in pkgutil.iter_modules(jax_plugins.__path__) if m.name.startswith("xla_cuda")
    )
    return f"jax_plugins.{names[-1]}" if names else None


def target_devices(target: GpuTarget | str, gpus_per_host: int = 1, hosts: int = 1) -> list:
    """Compile-only devices of ``hosts`` hosts with ``gpus_per_host`` GPUs each (jax's
    topology ``1x<hosts>x<gpus_per_host>``), from jax's CUDA plugin; nothing is started.

    On a machine without a usable GPU the plugin only starts when jax's platforms exclude
    CUDA (``JAX_PLATFORMS=cpu`` before jax is imported): otherwise its CUDA version check
    fails and jax drops it. The error says which of the two happened.

    Raises:
      RuntimeError: jax's CUDA plugin is not installed, or it is but cannot describe the
        topology (the reason is in the message).
      ValueError: a non-positive count.
    """
    if isinstance(target, str):
        target = gpu_target(target)
    for what, n in (("gpus_per_host", gpus_per_host), ("hosts", hosts)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"target_devices: {what} must be a positive int, got {n!r}")
    import jax
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=target.config, topology=f"1x{hosts}x{gpus_per_host}"
        )
    except Exception as exc:
        what = f"{hosts} x {gpus_per_host} {target.description}"
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        plugin = cuda_plugin()
        if plugin is None:
            raise RuntimeError(
                "compiling for a GPU needs jax's CUDA plugin (e.g. pip install "
                f"'jax[cuda13]'), and none is installed here; jax could not describe {what}: "
                f"{reason}"
            ) from exc
        platforms = jax.config.jax_platforms
        hint = ""
        if not platforms or any(p.strip() in ("cuda", "gpu") for p in platforms.split(",")):
            hint = (
                "; without a usable GPU the plugin does not start when jax's platforms "
                f"include CUDA (JAX_PLATFORMS is {platforms or 'unset'}): set "
                "JAX_PLATFORMS=cpu before jax is imported (examples/pretrain_gpt.py "
                "--compile-only does it itself)"
            )
        raise RuntimeError(
            f"jax's CUDA plugin ({plugin}) is installed but could not "
            f"describe {what}: {reason}{hint}"
        ) from exc
    return list(topo.devices)
