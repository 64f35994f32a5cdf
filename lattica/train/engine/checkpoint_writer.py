"""Checkpoints of a running trainer, written through a full disk.

Theory of operation
-------------------
``CheckpointWriter.save`` writes one checkpoint in a worker thread: the event loop keeps
serving the network during serialization and fsync. Writes are serialized (a lock), so the
trainer's round checkpoints and the states outer sync adopts never share a temporary file.

A disk that is full (or over quota, or failing) does not stop training: the state in memory is
intact, only its copy on disk is late. The failed write (``StorageError``: the file, the reason
and the space left, in one line) is logged once, ``failing`` says it until a write succeeds
(``lattica status`` shows it), and later checkpoints are tried with backoff (``WriteRetry``: the
first 1 s after the failure, doubling up to 30 s): a checkpoint asked for before the backoff is
over is not written. The store leaves no partial file and keeps the older checkpoints, so a
restart meanwhile resumes from the newest one written. The first write that succeeds again is
logged; a trainer whose last round could not be written keeps trying (``until_written``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

from lattica.errors import StorageError
from lattica.files import WriteRetry
from lattica.train.engine.checkpoint import CheckpointStore, StateDict

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes to ``store``; a failing disk is retried with backoff, never raised to the trainer."""

    def __init__(
        self, store: CheckpointStore, *, retry: WriteRetry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._retry = retry or WriteRetry()
        self._clock = clock
        self._lock = trio.Lock()

    @property
    def failing(self) -> str | None:
        """The last failed write while writes fail; None when the last one succeeded."""
        return self._retry.error

    def wait_s(self) -> float:
        """Seconds until the next write is due (0 when it is)."""
        return self._retry.wait_s(self._clock())

    async def save(self, state: Callable[[], StateDict]) -> Path | None:
        """Write ``state()`` (a trainer's, with its ``step``) as a checkpoint; its path, or None
        when it was not written (the disk failed now, or before and no attempt is due yet)."""
        async with self._lock:
            if not self._retry.due(self._clock()):
                return None
            snapshot = state()  # taken once the lock is ours: the newest state
            try:
                path = await trio.to_thread.run_sync(self.store.save, int(snapshot["step"]), snapshot)
            except StorageError as exc:
                if self._retry.failed(str(exc), self._clock()):
                    log.warning("checkpoints failing, training goes on: %s", exc)
                return None
            if self._retry.succeeded():
                log.info("checkpoints written again: %s", path)
            return path

    async def until_written(self, state: Callable[[], StateDict]) -> None:
        """While writes fail, try again whenever the backoff is over, until one succeeds."""
        while self.failing is not None:
            await trio.sleep(self.wait_s())
            await self.save(state)
