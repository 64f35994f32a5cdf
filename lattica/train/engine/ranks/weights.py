"""The node's weights in one shared-memory buffer, between the daemon and rank 0.

Theory of operation: the daemon creates a file of the parameters' total size (each tensor's
bytes at an offset aligned to 64 bytes) under ``/dev/shm`` (mode 0600, a fresh random name),
maps it, and rank 0 maps the same file when it starts; once every rank is up the daemon
unlinks the name, so nothing is left behind whatever happens to either process. Before a phase
the daemon copies its replica's parameters in and rank 0 copies them onto its device (then
broadcasts them to the other ranks); after the phase rank 0 copies its trained parameters in
and the daemon copies them out. The two sides take turns, ordered by the messages of
``messages.py``, so the buffer needs no lock.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

_ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """Where each parameter lives in the buffer: byte offsets, in parameter order."""

    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, params: Iterable[torch.Tensor]) -> Layout:
        offsets, end = [], 0
        for p in params:
            offsets.append(end)
            end += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        return cls(tuple(offsets), max(end, _ALIGN))


class SharedWeights:
    """A mapped buffer holding one copy of the parameters (module docstring)."""

    def __init__(self, path: Path, layout: Layout) -> None:
        self.path, self.layout = path, layout
        self.buffer = torch.from_file(str(path), shared=True, size=layout.nbytes, dtype=torch.uint8)

    @classmethod
    def create(cls, layout: Layout) -> SharedWeights:
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        path = folder / f"lattica-weights-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.nbytes)
        finally:
            os.close(fd)
        return cls(path, layout)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _view(self, index: int, like: torch.Tensor) -> torch.Tensor:
        start = self.layout.offsets[index]
        raw = self.buffer[start : start + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def store(self, params: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(params):
                self._view(i, p).copy_(p.detach())

    def load(self, params: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(self._view(i, p))
