"""Which devices a node trains on: ``train.devices`` resolved against this machine.

``config.check_devices_syntax`` has checked the text; here the names meet the hardware, once,
at start-up (``settings_check``) and again when the trainer is built:

- ``auto``: every visible CUDA device, else one CPU — unless ``train.device = "cpu"`` asks for
  the CPU, which stays one CPU rank;
- ``cpu:N``: N CPU ranks (the multi-rank path without an accelerator), at most one per core;
- ``cuda:I,cuda:J,…`` (``cuda`` alone is ``cuda:0``): those devices, each present and listed once.

Counting CUDA devices does not create a CUDA context (``torch.cuda.device_count``), so the
daemon, which never trains itself when it has several ranks, leaves every GPU's memory to them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lattica.errors import ConfigError


@dataclass(frozen=True)
class NodeDevices:
    """The devices of one node, one rank each, in rank order (``cpu``, ``cpu:1``, ``cuda:0``…)."""

    names: tuple[str, ...]

    @property
    def ranks(self) -> int:
        return len(self.names)

    @property
    def kind(self) -> str:
        return "cuda" if self.names[0].startswith("cuda") else "cpu"

    @property
    def single(self) -> str:
        """The one device of a one-rank node, as ``select_device`` takes it."""
        return "cpu" if self.kind == "cpu" else self.names[0]


def resolve_devices(devices: str, device: str = "auto", *, cuda_count: int | None = None,
                    cpu_count: int | None = None) -> NodeDevices:
    """``train.devices`` (with the older ``train.device``) on this machine; ``ConfigError``
    (one line) for a device that is not there, more ranks than devices, or a contradiction."""
    text = devices.replace(" ", "")
    cuda = _cuda_count() if cuda_count is None else cuda_count
    cores = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    if text == "auto":
        if device == "cpu" or (device == "auto" and cuda == 0):
            return NodeDevices(("cpu",))
        if cuda == 0:
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        return NodeDevices(tuple(f"cuda:{i}" for i in range(cuda)))
    if text.startswith("cpu"):
        if device == "cuda":
            raise ConfigError(f"train.devices = {devices!r} contradicts train.device = 'cuda'")
        count = int(text.partition(":")[2] or 1)
        if count > cores:
            raise ConfigError(f"train.devices = {devices!r} asks for {count} CPU ranks, more than this "
                              f"machine's {cores} cores")
        return NodeDevices(("cpu",) if count == 1 else tuple(f"cpu:{i}" for i in range(count)))
    if device == "cpu":
        raise ConfigError(f"train.devices = {devices!r} contradicts train.device = 'cpu'")
    names = tuple(name if ":" in name else "cuda:0" for name in text.split(","))
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"train.devices lists {name} twice: one rank per device")
        index = int(name.partition(":")[2])
        if index >= cuda:
            seen = ", ".join(f"cuda:{j}" for j in range(cuda)) or "none"
            raise ConfigError(f"device {name} is not available (CUDA devices here: {seen})")
    return NodeDevices(names)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
