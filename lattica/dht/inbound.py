"""The inbound side of the Kademlia protocol: screen every frame, then let py-libp2p answer.

``ScreenedStream`` wraps an inbound stream. It reads whole frames from the wire through a
``FrameDecoder``, runs ``screen_request`` on each and hands only accepted frames to
py-libp2p's ``KadDHT.handle_stream`` (which reads varint-prefixed frames too, so it cannot
tell the difference). On a rejected frame it reports to ``on_reject`` and then reports end
of stream, so the library's handler winds down quietly; the guard resets the stream.

A frame asking to store more than the store ledger allows its sender (``check_store``) ends the
stream the same way, but is reported to ``on_refuse``: over quota is not bad input. While the
library serves a stream, ``serving_peer()`` names the peer it serves, so the bounded value
store can charge what it stores to that peer.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import cast

from libp2p.abc import INetStream
from libp2p.kad_dht.pb.kademlia_pb2 import Message

from lattica.dht.quota import Refusal
from lattica.dht.screen import FrameDecoder, RecordValidator, encode_varint, screen_request
from lattica.errors import RemoteProtocolError
from lattica.net.streams import reset_quietly

logger = logging.getLogger(__name__)
_READ_CHUNK = 16 * 1024
_serving: contextvars.ContextVar[str | None] = contextvars.ContextVar("dht_serving_peer", default=None)

StoreCheck = Callable[[Message], Refusal | None]  # a screened request -> why it is refused, or None


def serving_peer() -> str | None:
    """The peer whose inbound DHT stream the current task serves; None outside one."""
    return _serving.get()


class ScreenedStream:
    """A read-side filter over an ``INetStream``; everything else passes through."""

    def __init__(
        self,
        stream: INetStream,
        *,
        validator: RecordValidator,
        max_frame: int,
        peer_id: str,
        check_store: StoreCheck = lambda msg: None,
    ) -> None:
        self._stream = stream
        self._validator = validator
        self._peer_id = peer_id
        self._check_store = check_store
        self._decoder = FrameDecoder(max_frame=max_frame, peer_id=peer_id)
        self._ready = bytearray()
        self.rejection: RemoteProtocolError | None = None
        self.refusal: Refusal | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if not self._ready and self.rejection is None and self.refusal is None:
            await self._fill()
        if not self._ready:
            return b""
        size = len(self._ready) if n is None else min(n, len(self._ready))
        out = bytes(self._ready[:size])
        del self._ready[:size]
        return out

    async def _fill(self) -> None:
        try:
            while (frame := self._decoder.next_frame()) is None:
                try:
                    chunk = await self._stream.read(_READ_CHUNK)
                except EOFError:
                    chunk = b""
                if not chunk:
                    return
                self._decoder.feed(chunk)
            msg = screen_request(frame, validator=self._validator, peer_id=self._peer_id)
        except RemoteProtocolError as exc:
            self.rejection = exc
            return
        self.refusal = self._check_store(msg)
        if self.refusal is None:
            self._ready += encode_varint(len(frame)) + frame


async def guarded_handler(
    stream: INetStream,
    *,
    inner: Callable[[INetStream], Awaitable[None]],
    validator: RecordValidator,
    max_frame: int,
    is_banned: Callable[[str], bool],
    on_reject: Callable[[RemoteProtocolError], Awaitable[None]],
    check_store: Callable[[str, Message], Refusal | None] = lambda peer, msg: None,
    on_refuse: Callable[[str, Refusal], None] = lambda peer, why: None,
) -> None:
    """Serve one inbound DHT stream; never raises, whatever the peer sends."""
    peer_id = str(stream.muxed_conn.peer_id)
    if is_banned(peer_id):
        await reset_quietly(stream)
        return
    screened = ScreenedStream(
        stream, validator=validator, max_frame=max_frame, peer_id=peer_id,
        check_store=lambda msg: check_store(peer_id, msg),
    )
    token = _serving.set(peer_id)
    try:
        # the library's handler is declared for INetStream and given the ScreenedStream, which
        # forwards everything but ``read`` to the real stream (it is no INetStream subclass)
        await inner(cast("INetStream", screened))
    except Exception as exc:  # noqa: BLE001 - the library's handler is not ours; whatever it raises ends this stream only
        logger.debug("DHT handler for %s failed: %r", peer_id, exc)
    finally:
        _serving.reset(token)
    if screened.rejection is not None:
        await reset_quietly(stream)
        await on_reject(screened.rejection)
    elif screened.refusal is not None:
        on_refuse(peer_id, screened.refusal)
        await reset_quietly(stream)

