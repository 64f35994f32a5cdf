"""The replicated state's durability: its log, written from trio (``ReplicatedState``'s first duty).

Theory of operation: every envelope the replica accepts (our own writes and peers') is appended
to ``data_dir/state-<run>.log`` and fsync'd in a worker thread, one batch at a time under one
lock, so the log holds the replica's history in order. Our own writes (``write``) are built
under that lock and are *not durable* until their append returned: ``only_durable`` keeps them
out of what peers are offered, so a crash can never make us reuse a seq someone else holds. When
the log holds much more than the replica still needs (``retained``), it is rewritten
(compaction). A full disk does not stop the node: ``log.HeldRecordsLog`` holds what it cannot
write, in order, and writes it once space returns — with the next batch, or by
``retry_held_records`` once its backoff is over; meanwhile writes are offered to peers before
they are durable. ``close`` (at shutdown, shielded) tries once more and closes the file; what
comes after is kept in memory only, as if it had come a moment later.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

from lattica.crdt.envelope import Envelope
from lattica.crdt.log import AppendLog, HeldRecordsLog

log = logging.getLogger(__name__)

_EnvelopeKey = tuple[str, str, int]  # doc, writer, seq


def state_log_path(data_dir: Path, run_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return data_dir / f"state-{safe}.log"


class DurableLog:
    """The state log of one replica; ``retained()`` is what a rewrite must keep."""

    def __init__(self, path: Path, *, compact_min_records: int, retained: Callable[[], list[Envelope]]) -> None:
        self.path = path
        self._compact_min_records = compact_min_records
        self._retained = retained
        self._log: HeldRecordsLog | None = None
        self._lock = trio.Lock()
        self._closed = False
        self._not_durable: set[_EnvelopeKey] = set()
        self.torn_bytes_at_open = 0

    async def open(self) -> list[object]:
        """Open the log (cutting a torn tail); the records it holds, oldest first."""
        opened, records = await trio.to_thread.run_sync(AppendLog.open, self.path)
        self._log = HeldRecordsLog(opened)
        self.torn_bytes_at_open = opened.torn_bytes
        if opened.torn_bytes:
            log.warning("state log %s: cut a torn tail of %d bytes", self.path, opened.torn_bytes)
        return records

    @property
    def started(self) -> bool:
        """``open`` has run (the log may be closed again since)."""
        return self._log is not None or self._closed

    async def write(self, make: Callable[[], list[Envelope]]) -> list[Envelope]:
        """The envelopes ``make`` builds (our own writes), made under the log's lock and
        persisted before they count as durable."""
        async with self._lock:
            envelopes = make()
            keys = {(e.doc, e.writer, e.seq) for e in envelopes}
            self._not_durable |= keys
            try:
                await self._persist(envelopes)
            finally:
                self._not_durable -= keys
        return envelopes

    async def append(self, envelopes: list[Envelope]) -> None:
        """Persist envelopes the replica accepted from peers."""
        async with self._lock:
            await self._persist(envelopes)

    def only_durable(self, envelopes: list[Envelope]) -> list[Envelope]:
        """``envelopes`` without our own writes whose append has not returned yet."""
        if not self._not_durable:
            return envelopes
        return [e for e in envelopes if (e.doc, e.writer, e.seq) not in self._not_durable]

    async def _persist(self, envelopes: list[Envelope]) -> None:
        """Append, and compact when due; called with the lock held. Once closed (the daemon is
        shutting down) the change stays in memory only, and is not replicated either."""
        if self._log is None:
            if envelopes:
                log.debug("state log closed: %d change(s) not persisted at shutdown", len(envelopes))
            return
        current = self._log
        await trio.to_thread.run_sync(current.append, [e.to_wire() for e in envelopes], time.monotonic())
        limit = max(self._compact_min_records, 2 * len(self._retained()))
        if current.needs_rewrite(limit, time.monotonic()):
            keep = [e.to_wire() for e in self._retained()]
            await trio.to_thread.run_sync(current.rewrite, keep, time.monotonic())

    async def retry_held_records(self) -> None:
        """While the log cannot be written (a full disk), write the held records once its
        backoff is over: with no new record to carry them, they would wait for the next one."""
        while True:
            current = self._log
            if current is None or current.failing is None:
                await trio.sleep(1.0)
                continue
            await trio.sleep(max(0.05, current.wait_s(time.monotonic())))
            async with self._lock:
                await self._persist([])

    async def close(self) -> None:
        """Write what is held once more, then close the file (shielded: this runs at shutdown).
        A write or a received update may be in a worker thread right now: the log closes only
        between two of them, and later ones find it closed (``_persist``)."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                self._closed = True
                if self._log is not None:
                    self._last_attempt(self._log)
                    self._log.close()
                    self._log = None

    def _last_attempt(self, current: HeldRecordsLog) -> None:
        if current.failing is None:
            return
        now = float("inf")  # whatever the backoff
        if not current.append([], now) and current.needs_rewrite(sys.maxsize, now):  # records dropped
            current.rewrite([e.to_wire() for e in self._retained()], now)
        if current.failing is not None:
            log.warning("state log %s: %d record(s) not written at shutdown", self.path, current.held)

    @property
    def failing(self) -> str | None:
        """Why the log cannot be written now (a full disk), or None."""
        return self._log.failing if self._log else None

    @property
    def size_bytes(self) -> int:
        return self._log.log.size_bytes if self._log else 0

    @property
    def held(self) -> int:
        """Records held in memory while the log cannot be written."""
        return self._log.held if self._log else 0
