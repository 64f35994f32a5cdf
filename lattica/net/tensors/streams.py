"""libp2p streams for the data plane, seen as a byte channel.

A tensor message on a libp2p stream (a peer without a fast channel: relayed, hole-punched, or
not directly dialable) is read and written through ``StreamChannel``, the same ``receive_some``
/ ``send_all`` surface as a ``FastChannel``, in chunks of a configured size. libp2p raises many
kinds of exception on a broken stream; they all become ``BrokenError`` here.
"""

from __future__ import annotations

from libp2p.abc import INetStream

from lattica.errors import BrokenError


class StreamChannel:
    """A libp2p stream seen as the same byte channel as a ``FastChannel``."""

    def __init__(self, stream: INetStream, peer_id: str, chunk: int) -> None:
        self._stream, self.peer_id, self._chunk = stream, peer_id, chunk

    async def receive_some(self) -> bytes:
        try:
            return await self._stream.read(self._chunk)
        except EOFError:
            return b""
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
            raise BrokenError(f"stream broken: {exc!r}", peer_id=self.peer_id) from None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, len(view), self._chunk):
                await self._stream.write(bytes(view[start : start + self._chunk]))
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
            raise BrokenError(f"stream broken: {exc!r}", peer_id=self.peer_id) from None

