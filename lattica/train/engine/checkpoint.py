"""Local checkpoints and the content hash of weights.

Theory of operation
-------------------
``CheckpointStore.save`` writes ``step-<n>.pt`` atomically: serialise to a temporary file in the
same folder, ``fsync`` it, ``os.replace`` it over the final name and ``fsync`` the folder — a
crash leaves either the old set of checkpoints or the new one, never a torn file. Only the last
``keep`` checkpoints are kept. A full disk fails the write with one line (``StorageError``: the
file, the reason, the space left) and leaves the older checkpoints as they were; the trainer
keeps training and tries again later (``Trainer``). ``load_latest`` returns the newest
checkpoint that loads; a corrupt file is skipped (and reported), so a restarted peer resumes
from the one before.

Checkpoints are read with ``torch.load(weights_only=True)``: tensors, numbers, strings and
containers only — a checkpoint file cannot run code. They hold the run's weights: the folder is
0700 and every file 0600, whatever the umask (older, wider ones are narrowed on open).

A kill during ``save`` leaves its temporary ``.step-<n>.pt.<pid>.tmp`` behind; opening the store
removes those whose writer is gone (or that are older than ``STALE_TMP_S``).

``weights_hash`` is the content hash published in the replicated state next to a member's last
completed round and checked by a joiner on weights fetched from other peers: sha256 over every
tensor's name, dtype, shape and raw bytes, in name order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from lattica.errors import ConfigError, RemoteProtocolError
from lattica.files import DISK_FULL_ERRNOS, writing

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d{9,})\.pt$")
_TMP_NAME = re.compile(r"^\.step-\d{9,}\.pt\.(\d+)\.tmp$")
STALE_TMP_S = 3600.0

StateDict = dict[str, Any]
"""A state as ``state_dict()`` returns it and ``torch.save`` writes it: tensors, numbers and
nested dicts and lists of them, by name (a trainer's checkpoint, a strategy's outer state)."""


def weights_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex digest over names, dtypes, shapes and raw bytes, independent of dict order."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights_hash: {name!r} is {type(tensor).__name__}, not a tensor")
        header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0"
        hasher.update(len(header).to_bytes(8, "big") + header.encode("utf-8"))
        hasher.update(_raw_bytes(tensor))
    return hasher.hexdigest()


def verify_weights(
    state: Mapping[str, torch.Tensor], expected: str, *, peer_id: str | None = None
) -> None:
    """Raise ``RemoteProtocolError`` (naming the peer) when ``state`` does not hash to ``expected``."""
    actual = weights_hash(state)
    if actual != expected:
        raise RemoteProtocolError(
            f"weights hash mismatch: expected {expected[:16]}…, got {actual[:16]}…", peer_id=peer_id
        )


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous()
    if flat.numel() == 0:
        return b""
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


class CheckpointStore:
    """Atomic ``step-<n>.pt`` files in ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointStore keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise ConfigError(f"cannot create checkpoint folder {self.directory}: {exc}") from None
            return  # no checkpoint to find; the first save creates the folder, or says why not
        for path in (self.directory, *(p for _, p in self.checkpoints())):
            _make_private(path)
        self._remove_stale_temporaries()

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        found = []
        for path in self._entries():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporaries of saves that were killed: their process is gone, or they
        are older than ``STALE_TMP_S`` (a reused pid)."""
        now = time.time()
        for path in self._entries():
            match = _TMP_NAME.match(path.name)
            if match is None:
                continue
            try:
                stale = not _process_alive(int(match.group(1))) or now - path.stat().st_mtime > STALE_TMP_S
                if stale:
                    path.unlink()
                    log.info("removed %s, left by an interrupted checkpoint write", path)
            except OSError:
                continue  # gone meanwhile, or not ours to remove

    def _entries(self) -> list[Path]:
        return list(self.directory.iterdir()) if self.directory.is_dir() else []

    def save(self, step: int, state: StateDict) -> Path:
        """Write ``step-<n>.pt`` and prune the oldest. A write that fails (a full disk) raises
        ``StorageError`` naming the file and the space left, removes its temporary and leaves
        every older checkpoint as it was."""
        final = self.directory / f"step-{step:09d}.pt"
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        with writing(final, what="checkpoint"):
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                _write_synced(tmp, state)
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(self.directory)
            self._prune()
        return final

    def _prune(self) -> None:
        for _, path in self.checkpoints()[: -self.keep]:
            path.unlink(missing_ok=True)

    def discard_after(self, step: int) -> None:
        """Remove checkpoints newer than ``step`` (a line of rounds the run did not keep)."""
        for saved, path in self.checkpoints():
            if saved > step:
                path.unlink(missing_ok=True)
        _fsync_dir(self.directory)

    def load(self, path: Path) -> StateDict:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many types for a truncated or foreign file
            raise ConfigError(f"checkpoint {path} is unreadable: {exc}") from None
        if not isinstance(state, dict):
            raise ConfigError(f"checkpoint {path} does not hold a dict")
        return state

    def load_latest(self) -> StateDict | None:
        """The newest readable checkpoint, or None when there is none."""
        for _, path in reversed(self.checkpoints()):
            try:
                return self.load(path)
            except ConfigError as exc:
                log.warning("skipping %s", exc)
        return None


def _write_synced(path: Path, state: StateDict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        out = _WriteErrorKept(f)
        try:
            torch.save(state, cast(BinaryIO, out))  # torch uses write and flush only
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None
        f.flush()
        os.fsync(f.fileno())


class _WriteErrorKept:
    """The file ``torch.save`` writes to. torch turns a failed write into a ``RuntimeError``
    that says only ``enforce fail at inline_container.cc``; this keeps the ``OSError`` behind
    it (``ENOSPC``) for the one line the user sees."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            self.error = exc
            raise


def _make_private(path: Path) -> None:
    """Narrow a folder to 0700, a file to 0600 (checkpoints of older versions were wider)."""
    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            path.chmod(0o700 if stat.S_ISDIR(mode) else 0o600)
    except OSError as exc:
        log.warning("cannot make %s private: %s", path, exc.strerror or exc)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible on every platform
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
