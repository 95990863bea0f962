"""Platform detection and capability probes.

``detect(cfg)`` turns the ``platform`` config group into a :class:`PlatformInfo`: the torch device to run on,
the platform kind, the compute capability where one exists, and what the probes read (device name, driver,
CUDA/HIP runtime, cuDNN). The same object feeds backend capability checks (``kernels``) and the manifest.
"""

from __future__ import annotations

import platform as _py_platform
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from runner.core.errors import UserInputError


class PlatformError(UserInputError, RuntimeError):
    """The requested platform is not present on this machine."""


@dataclass
class PlatformInfo:
    """What the run executes on.

    Attributes:
        kind: ``cpu`` | ``cuda`` | ``rocm`` | ``xpu`` | ``npu`` | ``mps``.
        device: torch device string, e.g. ``cuda:0`` or ``cpu``.
        capability: CUDA compute capability ``(major, minor)`` (``(9, 0)`` on H100/H200), None elsewhere.
        probes: name -> value of every probe that ran (device name, driver, cuda, cudnn, hip...).
    """

    kind: str
    device: str
    capability: Optional[Tuple[int, int]] = None
    probes: Dict[str, Any] = field(default_factory=dict)

    @property
    def sm(self) -> Optional[int]:
        """Compute capability as an integer (``90`` for sm90), or None."""
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["capability"] = None if self.capability is None else f"sm{self.sm}"
        return d


def _detect_kind() -> str:
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu registers torch.npu
        return "npu"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _available(kind: str) -> bool:
    if kind == "cpu":
        return True
    if kind in ("cuda", "rocm"):
        return torch.cuda.is_available() and (kind == "rocm") == bool(getattr(torch.version, "hip", None))
    if kind == "mps":
        return torch.backends.mps.is_available()
    mod = getattr(torch, kind, None)
    return bool(mod is not None and mod.is_available())


def _probe(name: str, kind: str) -> Any:
    if name == "device_name":
        if kind in ("cuda", "rocm"):
            return torch.cuda.get_device_name(torch.cuda.current_device())
        if kind == "xpu":
            return torch.xpu.get_device_name(0)
        if kind == "cpu":
            return _py_platform.processor() or _py_platform.machine()
        return kind
    if name == "capability" and kind in ("cuda", "rocm"):
        return "sm%d%d" % torch.cuda.get_device_capability(torch.cuda.current_device())
    if name == "cuda" and kind == "cuda":
        return torch.version.cuda
    if name == "hip" and kind == "rocm":
        return torch.version.hip
    if name == "cudnn" and kind == "cuda":
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if name == "driver" and kind == "cuda":
        try:
            import subprocess
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def detect(name: str = "auto", device: str = "auto", probes: tuple = ()) -> PlatformInfo:
    """Resolve the platform group to a live :class:`PlatformInfo`.

    Args:
        name: platform group name (``auto`` detects: cuda/rocm, xpu, npu, mps, then cpu).
        device: torch device type, or ``auto``.
        probes: names of the probes to run (unknown or inapplicable probes record ``None``).

    Raises:
        PlatformError: the named platform is not available here (e.g. ``platform=cuda`` on a CPU machine).
    """
    # Plain strings from here on (the config's are runner.core.schema choices): they reach torch and the manifest.
    name, device, probes = str(name), str(device), tuple(str(p) for p in probes)
    kind = _detect_kind() if name == "auto" else name
    if not _available(kind):
        raise PlatformError(f"platform={name}: no {kind} device is available on this machine "
                            f"(detected: {_detect_kind()}); fix: use platform=auto or platform={_detect_kind()}")
    dev_type = {"rocm": "cuda"}.get(kind, kind) if device == "auto" else device
    import os

    index = int(os.environ.get("LOCAL_RANK", 0))  # torchrun: one device per local rank
    if dev_type == "cuda" and torch.cuda.device_count():
        index %= torch.cuda.device_count()  # more ranks than GPUs (wiring checks): ranks share GPUs round-robin
    dev = f"{dev_type}:{index}" if dev_type in ("cuda", "xpu", "npu") else dev_type
    if dev_type == "cuda":
        torch.cuda.set_device(index)
    cap = tuple(torch.cuda.get_device_capability(index)) if kind in ("cuda", "rocm") else None
    probed = {p: _probe(p, kind) for p in (probes or ("device_name",))}
    probed.setdefault("device_name", _probe("device_name", kind))
    probed["torch_threads"] = torch.get_num_threads()
    return PlatformInfo(kind=kind, device=dev, capability=cap, probes=probed)
