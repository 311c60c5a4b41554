"""Facts about the machine and the model that go into a profile: device, library versions, static memory."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch

from regen.version import __version__ as regen_version
from regen.errors import DeviceError
from regen.formats.profile import DeviceInfo
from regen.profiler.bandwidth import Bandwidth

OPTIONAL_LIBRARIES = ("transformers", "pulp", "highspy")


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch.device for `device`, refusing CUDA where there is none."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device '{device}': {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}': no CUDA device is available here "
                              f"(torch {torch.__version__}, cuda build: {torch.version.cuda or 'no'})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device '{device}': only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise DeviceError(f"device '{device}': regen profiles on cpu or cuda[:N]")
    return dev


def device_info(device: torch.device, bandwidth: Bandwidth) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, int(props.total_memory)
    else:
        name, total = _cpu_name(), _host_memory_bytes()
    return DeviceInfo(type=device.type, name=name, total_memory_bytes=total,
                      d2h_bytes_per_s=float(bandwidth.d2h_bytes_per_s),
                      h2d_bytes_per_s=float(bandwidth.h2d_bytes_per_s), bandwidth_method=bandwidth.method)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def library_versions() -> dict[str, str]:
    """python, torch, regen, and the optional libraries that are installed (read without importing them)."""
    versions = {"python": platform.python_version(), "torch": str(torch.__version__), "regen": regen_version}
    if torch.version.cuda:
        versions["cuda"] = str(torch.version.cuda)
    for name in OPTIONAL_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    versions["platform"] = f"{sys.platform}-{platform.machine()}"
    return versions


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
