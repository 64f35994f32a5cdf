"""Reading the small files a user hands us (config, peers list, key, secret) as untrusted input,
and writing the daemon's own files in its data dir.

A failed read is a ``ConfigError`` whose message names the file and what is wrong, fit to be
the one line the CLI prints. The size cap is checked before the content is used, so a huge or
endless file (``/dev/zero``) costs at most ``max_bytes + 1`` bytes of memory.

A failed write (a full disk, a quota, an I/O error) is a ``StorageError`` in one line that
names the file, the reason and the space left on its filesystem (``writing``). A writer that
keeps its state in memory meanwhile (checkpoints, the state log) tries again with backoff
(``WriteRetry``) and reports the failure once, not at every attempt.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lattica.errors import ConfigError, StorageError


def read_capped(path: Path, *, what: str, max_bytes: int, private: bool = False) -> bytes:
    """The bytes of ``path``; ``private`` files must not be accessible to group or others."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what} {path} is a directory, not a file")
        if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{what} {path} has mode {stat.S_IMODE(mode):04o}; it must be 0600 (run: chmod 600 {path})"
            )
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise ConfigError(f"{what} {path} is larger than {max_bytes} bytes")
    return raw


def read_text(path: Path, *, what: str, max_bytes: int) -> str:
    try:
        return read_capped(path, what=what, max_bytes=max_bytes).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None


def append_private(path: Path, text: str, *, what: str = "file") -> None:
    """Append ``text`` to ``path``, a file only its owner can read (0600; narrowed if wider)."""
    with writing(path, what=what):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            os.fchmod(fd, 0o600)
            f.write(text)


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # no blocks, no inodes, over quota


@contextmanager
def writing(path: Path, *, what: str) -> Iterator[None]:
    """Turn an ``OSError`` raised in the block into a ``StorageError`` about ``path``."""
    try:
        yield
    except OSError as exc:
        raise storage_error(path, exc, what=what) from None


def storage_error(path: Path, exc: OSError, *, what: str) -> StorageError:
    """``cannot write checkpoint /d/step-1.pt: No space left on device (0 B free of 16.0 MiB)``"""
    return StorageError(f"cannot write {what} {path}: {exc.strerror or exc} ({free_space(path)})")


def free_space(path: Path) -> str:
    """``<free> free of <size>`` of the filesystem that holds ``path`` (or would), and ``no
    inodes left`` when that is what is full."""
    folder = path
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        fs = os.statvfs(folder)
    except OSError:
        return "free space unknown"
    free = f"{_size(fs.f_bavail * fs.f_frsize)} free of {_size(fs.f_blocks * fs.f_frsize)}"
    return f"{free}, no inodes left" if fs.f_files and not fs.f_favail else free


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    amount = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        amount /= 1024
        if amount < 1024 or unit == "TiB":
            break
    return f"{amount:.1f} {unit}"


class WriteRetry:
    """When a write that keeps failing is tried again: ``first_s`` after the first failure,
    then twice as long each time, at most ``max_s``. Sans-IO: callers pass the monotonic time.

    ``error`` is the last failure while writes fail, ``None`` once one succeeded again."""

    def __init__(self, *, first_s: float = 1.0, max_s: float = 30.0) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"WriteRetry needs 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s, self.max_s = first_s, max_s
        self.error: str | None = None
        self.failures = 0
        self._next_at = 0.0

    def due(self, now: float) -> bool:
        """Whether to write now: always while writes succeed, else once the backoff is over."""
        return self.error is None or now >= self._next_at

    def wait_s(self, now: float) -> float:
        """Seconds until the next attempt is due (0 when it is)."""
        return 0.0 if self.due(now) else self._next_at - now

    def failed(self, error: str, now: float) -> bool:
        """Note a failed write; True when it is the first of a run of failures (report that one)."""
        first = self.error is None
        self.failures = 1 if first else self.failures + 1
        self.error = error
        self._next_at = now + min(self.max_s, self.first_s * 2 ** min(self.failures - 1, 32))
        return first

    def succeeded(self) -> bool:
        """Note a successful write; True when it ends a run of failures."""
        ended, self.error = self.error is not None, None
        return ended
