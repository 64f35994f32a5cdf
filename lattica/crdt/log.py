"""Durable append-only log of envelopes: fsync'd, CRC-checked, compacted by rewriting.

File layout: an 8-byte magic, then records of ``length:u32 | crc32(body):u32 | body``, where
body is the msgpack form of one envelope. ``append`` writes a batch and fsyncs before it
returns — an update counts as *acknowledged* only after that. ``open`` scans from the start
and stops at the first record that is short, over-long or fails its CRC: that is a torn write
from a crash (kill -9, power loss) and everything from there on is cut off, so later appends
start from a clean boundary. ``rewrite`` replaces the file atomically (write a temporary file,
fsync it, rename over the log, fsync the directory) with the records still needed; a crash in
the middle leaves either the old or the new log, never a mix.

A full disk (or any failed write) raises ``StorageError`` in one line (the file, the reason,
the space left) and leaves the file as it was: a failed append is cut off again, a failed
rewrite removes its temporary file. ``HeldRecordsLog`` is the log as the replicated state
writes it: records that cannot be written are held in memory, in order, and written first
when the next attempt succeeds; attempts follow a backoff (``WriteRetry``: 1 s, doubling up to
30 s). Past ``max_held`` records the oldest held ones are dropped and the next successful
write must be a rewrite with everything the state still needs (``needs_rewrite``), which holds
them too. Records held when the process dies are lost: the log then ends where the disk filled.
A compaction that does not fit (it writes a whole copy) loses nothing: it is postponed with a
backoff of its own, warned once, while appends go on.

This module does blocking file I/O; async callers run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import msgpack

from lattica.errors import StorageError
from lattica.files import WriteRetry, writing

log = logging.getLogger(__name__)

MAGIC = b"LTCSLOG1"
_HEADER = struct.Struct(">II")
MAX_RECORD_BYTES = 4 * 1024 * 1024


def _encode_record(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body), zlib.crc32(body)) + body


def _scan(data: bytes) -> tuple[list[object], int]:
    """Decode records; return them and the offset just past the last good one."""
    records: list[object] = []
    offset = len(MAGIC)
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        body = data[start : start + length]
        if length > MAX_RECORD_BYTES or len(body) < length or zlib.crc32(body) != crc:
            break
        try:
            records.append(msgpack.unpackb(body, raw=False, strict_map_key=False))
        except (ValueError, TypeError, msgpack.UnpackException):
            break
        offset = start + length
    return records, offset


def read_records(path: Path) -> list[object]:
    """The intact records of the log at ``path``, read only: a torn tail is ignored, not cut,
    and a file that is not a state log yields nothing."""
    data = path.read_bytes()
    return _scan(data)[0] if data.startswith(MAGIC) else []


class AppendLog:
    """One log file. Not thread-safe: callers serialize access."""

    def __init__(self, path: Path, fd: int, *, size: int, records: int, torn_bytes: int) -> None:
        self.path = path
        self._fd = fd
        self.size_bytes = size
        self.record_count = records
        self.torn_bytes = torn_bytes

    @classmethod
    def open(cls, path: Path) -> tuple[AppendLog, list[object]]:
        """Open (or create) the log; return it with every intact record, in order."""
        with writing(path, what="state log"):
            return cls._open(path)

    @classmethod
    def _open(cls, path: Path) -> tuple[AppendLog, list[object]]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            data = _read_all(fd)
            if len(data) < len(MAGIC) or not data.startswith(MAGIC):
                _check_header_prefix(data, path)
                records: list[object] = []
                good_end, torn = len(MAGIC), 0
                os.ftruncate(fd, 0)
                os.pwrite(fd, MAGIC, 0)
            else:
                records, good_end = _scan(data)
                torn = len(data) - good_end
                if torn:
                    os.ftruncate(fd, good_end)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, size=good_end, records=len(records), torn_bytes=torn), records

    def append(self, objs: Iterable[object]) -> None:
        """Append records and fsync; when this returns they survive a crash. On a failure
        (``StorageError``) none of them is in the log."""
        records = [_encode_record(obj) for obj in objs]
        blob = b"".join(records)
        if not blob:
            return
        with writing(self.path, what="state log"):
            try:
                _write_at(self._fd, blob, self.size_bytes)
                os.fsync(self._fd)
            except OSError:
                with contextlib.suppress(OSError):  # a part written: a torn tail, cut at open anyway
                    os.ftruncate(self._fd, self.size_bytes)
                raise
        self.size_bytes += len(blob)
        self.record_count += len(records)

    def rewrite(self, objs: Iterable[object]) -> None:
        """Atomically replace the log's content with ``objs`` (compaction). On a failure
        (``StorageError``) the log is as it was."""
        tmp = self.path.with_name(self.path.name + ".compact")
        records = [_encode_record(obj) for obj in objs]
        blob = MAGIC + b"".join(records)
        with writing(self.path, what="state log"):
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    _write_at(fd, blob, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            fd, self._fd = self._fd, os.open(self.path, os.O_RDWR)
            os.close(fd)
            self.size_bytes = len(blob)
            self.record_count = len(records)
            _fsync_dir(self.path.parent)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HeldRecordsLog:
    """An ``AppendLog`` that outlives a full disk (module docstring). Not thread-safe."""

    def __init__(self, log: AppendLog, *, retry: WriteRetry | None = None, max_held: int = 4096) -> None:
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held}")
        self.log = log
        self.max_held = max_held
        self._retry = retry or WriteRetry()
        self._compaction = WriteRetry()  # a compaction needs room for a whole copy: postponed apart
        self._held: list[object] = []
        self._dropped = False  # held records were dropped: only a rewrite restores them

    @property
    def failing(self) -> str | None:
        """The last failed write while writes fail; None when the last one succeeded."""
        return self._retry.error

    @property
    def held(self) -> int:
        """Records accepted but not written yet."""
        return len(self._held)

    def wait_s(self, now: float) -> float:
        return self._retry.wait_s(now)

    def needs_rewrite(self, max_records: int, now: float) -> bool:
        """Whether the next write is a rewrite: held records were dropped, or the log holds more
        than ``max_records`` (compaction; not while writes fail, and postponed with a backoff of
        its own when it failed: the appends may still fit where a whole copy does not)."""
        if self._dropped:
            return self._retry.due(now)
        return self._retry.error is None and self._compaction.due(now) and self.log.record_count > max_records

    def append(self, objs: Iterable[object], now: float) -> bool:
        """Hold ``objs`` after the records already held and write them all when an attempt is
        due; True when nothing is held any more."""
        self._held.extend(objs)
        if len(self._held) > self.max_held:
            del self._held[: len(self._held) - self.max_held]
            self._dropped = True
        if not self._held or not self._retry.due(now) or self._dropped:
            return not self._held and not self._dropped
        return self._attempt(lambda: self.log.append(self._held), now)

    def rewrite(self, objs: Iterable[object], now: float) -> bool:
        """Replace the log with ``objs``: everything the state needs, the held records too."""
        records = list(objs)
        if self._held or self._dropped:
            return self._attempt(lambda: self.log.rewrite(records), now)
        try:
            self.log.rewrite(records)
        except StorageError as exc:  # nothing is lost: the log as it was grows on
            if self._compaction.failed(str(exc), now):
                log.warning("state log compaction postponed: %s", exc)
            return False
        self._compaction.succeeded()
        return True

    def _attempt(self, write: Callable[[], None], now: float) -> bool:
        try:
            write()
        except StorageError as exc:
            if self._retry.failed(str(exc), now):
                log.warning("state log failing, keeping the state in memory: %s", exc)
            return False
        written, self._held, self._dropped = len(self._held), [], False
        if self._retry.succeeded():
            log.info("state log %s written again (%d held record(s))", self.log.path, written)
        return True

    def close(self) -> None:
        self.log.close()


def _write_at(fd: int, blob: bytes, offset: int) -> None:
    written = 0
    while written < len(blob):
        written += os.pwrite(fd, blob[written:], offset + written)


def _check_header_prefix(data: bytes, path: Path) -> None:
    """A file shorter than a header is a log torn while it was created, or not a log."""
    if data and not MAGIC.startswith(data):
        raise ValueError(f"{path} is not a state log")


def _read_all(fd: int) -> bytes:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
