"""libp2p streams: read so that a busy reader never stalls its sender; closed or reset quietly.

py-libp2p's yamux gives up a ``write`` when the receive window stays closed for 5 s, which is
what happens when the receiving application is busy (a GPU step, a slow disk) and does not
read. ``DrainingReader`` runs a pump task that keeps reading the stream into a bounded
in-memory buffer, independent of when the application consumes it, so windows keep opening.
The buffer cap bounds memory; a sender that exceeds it is a protocol error, not a stall.

``close_quietly`` and ``reset_quietly`` end a stream as best they can: it may be gone already,
and libp2p raises many kinds of exception then, none of which matters to the caller.
"""

from __future__ import annotations

import logging

import trio
from libp2p.abc import INetStream
from trio_typing import TaskStatus

from lattica.errors import BrokenError, RemoteProtocolError

log = logging.getLogger(__name__)


class DrainingReader:
    def __init__(self, stream: INetStream, *, max_buffer: int, peer_id: str | None = None) -> None:
        self._stream = stream
        self._max_buffer = max_buffer
        self._peer_id = peer_id
        self._buffer = bytearray()
        self._eof = False
        self._error: Exception | None = None
        self._changed = trio.Event()

    async def pump(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read until EOF; run this in a nursery next to the consumer."""
        task_status.started()
        try:
            while True:
                try:
                    chunk = await self._stream.read(1 << 16)
                except EOFError:
                    chunk = b""
                if not chunk:
                    self._eof = True
                    return
                if len(self._buffer) + len(chunk) > self._max_buffer:
                    self._error = RemoteProtocolError(
                        f"peer sent more than the {self._max_buffer}-byte buffer allows", peer_id=self._peer_id
                    )
                    return
                self._buffer += chunk
                self._wake()
        except Exception as exc:  # noqa: BLE001 - reported to the consumer
            self._error = BrokenError(f"stream broken: {exc!r}", peer_id=self._peer_id)
        finally:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    async def read_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if self._error is not None:
                raise self._error
            if self._eof:
                raise BrokenError(f"stream ended with {len(self._buffer)} of {n} bytes", peer_id=self._peer_id)
            await self._changed.wait()
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


async def close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception as exc:  # noqa: BLE001 - best effort on a stream that may be gone; libp2p raises many kinds
        log.debug("closing a stream failed: %r", exc)


async def reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception as exc:  # noqa: BLE001 - best effort on a stream that may be gone; libp2p raises many kinds
        log.debug("resetting a stream failed: %r", exc)
