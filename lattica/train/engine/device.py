"""Pick the best local device: CUDA with bf16 autocast when present, else CPU in fp32.

Weights and optimizer state stay fp32 on every device so that outer steps (and their hashes)
are computed the same way everywhere; only the inner forward pass runs under autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lattica.errors import ConfigError


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    autocast_dtype: torch.dtype | None

    def describe(self) -> str:
        precision = "bf16 autocast" if self.autocast_dtype == torch.bfloat16 else "fp32"
        if self.device.type == "cuda":
            return f"{torch.cuda.get_device_name(self.device)} ({precision})"
        return f"cpu ({precision})"


def select_device(prefer: str = "auto") -> DeviceInfo:
    """``prefer`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if prefer == "auto":
        prefer = "cuda" if torch.cuda.is_available() else "cpu"
    if prefer == "cpu":
        return DeviceInfo(torch.device("cpu"), None)
    if not prefer.startswith("cuda"):
        raise ConfigError(f"unknown device {prefer!r}; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {prefer!r} requested but CUDA is not available")
    device = torch.device(prefer)
    bf16 = torch.cuda.is_bf16_supported()
    return DeviceInfo(device, torch.bfloat16 if bf16 else None)


@contextlib.contextmanager
def autocast(info: DeviceInfo) -> Iterator[None]:
    """Mixed precision for the forward pass where the device supports it."""
    if info.autocast_dtype is None:
        yield
        return
    with torch.autocast(device_type=info.device.type, dtype=info.autocast_dtype):
        yield
