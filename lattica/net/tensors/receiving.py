"""Reading tensor messages off one channel (a fast channel or a libp2p stream) into the mailbox.

Theory of operation: ``MessageReader.read`` feeds what the channel delivers into a
``frames.FrameDecoder``. A message's header reserves its payload's bytes in the
``MemoryBudget`` (refused: the payload is read and dropped) and chooses its buffer — the one its
consumer posted in the ``Mailbox`` for a ``put`` (the fast channel decrypts straight into it),
else a fresh one. A complete ``put`` is delivered to the mailbox under ``(tag, sender, part)``;
a second copy of a part is a ``RemoteProtocolError``. A complete ``fetch`` request goes to
``on_fetch``. A consumer that withdraws its posted buffer (its collective ended) gets no more
bytes in it: the rest of that message is read and dropped. Whatever a broken or hostile channel
leaves half done — a reservation, a claimed buffer — is given back when ``read`` returns or raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

from lattica.errors import RemoteProtocolError
from lattica.net.tensors import fastpath, frames
from lattica.net.tensors.limits import MemoryBudget, TensorLimits
from lattica.net.tensors.mailbox import Key, Mailbox
from lattica.net.tensors.stats import TrafficStats
from lattica.net.tensors.streams import StreamChannel
from lattica.numerics import codecs

log = logging.getLogger(__name__)


class MessageReader:
    """Reads the messages of every incoming channel of one ``TensorService``."""

    def __init__(
        self, *, limits: TensorLimits, budget: MemoryBudget, mailbox: Mailbox, stats: TrafficStats,
        on_fetch: Callable[[str, frames.Incoming], None],
    ) -> None:
        self._limits, self.budget, self.mailbox, self.stats = limits, budget, mailbox, stats
        self._on_fetch = on_fetch

    async def read(self, channel: StreamChannel | fastpath.FastChannel, peer: str, path: str) -> None:
        """Read messages from ``channel`` until it ends between two messages; raises
        ``RemoteProtocolError`` for a malformed or duplicate message, ``BrokenError`` when the
        channel breaks. Whatever it reserved or claimed is given back either way."""
        limits = self._limits
        decoder = frames.FrameDecoder(peer_id=peer, max_header=limits.max_header_bytes)
        reserved: int | None = None
        posted: Key | None = None  # the message being written into a buffer its consumer posted

        def window() -> memoryview | None:
            """Where payload bytes may be written now. Checked after every wait and before
            every write: a consumer that withdrew its buffer (its collective ended) gets no
            more bytes in it — the rest of that message is read and dropped."""
            nonlocal posted
            if posted is not None and self.mailbox.revoked(posted):
                decoder.drop_payload()
                self.mailbox.end_claim(posted)
                posted = None
            return decoder.payload_window()

        data: bytes | memoryview
        try:
            while True:
                if path == "fast":  # decrypts straight into the payload buffer when it can
                    data, direct = await cast(fastpath.FastChannel, channel).receive_frame(window)
                else:
                    data, direct = await channel.receive_some(), False
                if not data:
                    if not decoder.idle:
                        raise RemoteProtocolError("stream ended inside a message", peer_id=peer)
                    return
                self.stats.bytes_received[(peer, path)] += len(data)
                if direct:
                    decoder.wrote_directly(len(data))
                    if posted is not None:  # the consumer may use what landed (see Mailbox.post)
                        self.mailbox.written(posted, decoder.payload_filled)
                else:
                    window()
                    decoder.feed(data)
                while (event := decoder.next_event()) is not None:
                    if isinstance(event, frames.Incoming):
                        reserved, posted = self._admit(decoder, peer, event)
                        continue
                    if posted is not None:
                        self.mailbox.end_claim(posted)
                        posted = None
                    if reserved is not None:
                        self.budget.end_transfer(peer)
                    if event.payload is None:  # refused, or its consumer is gone
                        if reserved is not None:
                            self.budget.release(peer, reserved)
                        reserved = None
                        continue
                    reserved = None
                    self.stats.messages_received[(peer, path)] += 1
                    self._dispatch(peer, event)
        finally:
            if posted is not None:
                self.mailbox.end_claim(posted)
            if reserved is not None:
                self.budget.end_transfer(peer)
                self.budget.release(peer, reserved)

    def _admit(
        self, decoder: frames.FrameDecoder, peer: str, incoming: frames.Incoming
    ) -> tuple[int | None, Key | None]:
        """Reserve the message's bytes and choose its buffer; returns (reserved, posted key)."""
        size = incoming.payload_size
        refusal = self.budget.try_reserve(peer, size)
        if refusal is not None:
            log.warning("refusing %s/%d from %s: %s", incoming.tag, incoming.part, peer, refusal)
            self.stats.refused[peer] += 1
            decoder.discard()
            return None, None
        key = (incoming.tag, peer, incoming.part)
        posted = self.mailbox.claim_posted(key, size) if incoming.kind == "put" else None
        decoder.accept(posted if posted is not None else codecs.writable_buffer(size))
        return size, key if posted is not None else None

    def _dispatch(self, peer: str, event: frames.Complete) -> None:
        incoming, payload = event.incoming, event.payload
        assert payload is not None
        if incoming.kind == "fetch":
            self.budget.release(peer, len(payload))
            self._on_fetch(peer, incoming)
            return
        key = (incoming.tag, peer, incoming.part)
        if not self.mailbox.deliver(key, incoming.specs, payload):
            raise RemoteProtocolError(f"duplicate part {incoming.tag}/{incoming.part}", peer_id=peer)
