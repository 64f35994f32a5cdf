"""Identify push (``/ipfs/id/push/1.0.0``): telling connected peers what changed about us.

Theory of operation: the push carries the same ``Identify`` message as an identify answer —
public key, listen addresses (relay addresses included), protocols, the signed peer record —
as one varint-prefixed protobuf on a fresh stream, which the sender closes; the receiver
does not reply. It is sent to every connected peer whenever the protocols we serve or the
addresses we advertise change (``AnnouncementWatcher``, the relay service turning on).

``observedAddr`` is left out. It is where the *receiver* is seen from our end of the
connection, which an identify answer fills from the socket it answers on; a push has no such
socket, and py-libp2p's own push writes the field as empty bytes. An empty field is present
on the wire, so go-libp2p parses it as a multiaddr, fails, and logs an error for every push; a
missing field is skipped. Peers learn their observed address from identify answers instead.

Best effort: a peer that left or refuses the protocol costs one failed stream, logged at
debug level; at most ``PUSH_CONCURRENCY`` pushes are in flight at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_uvarint

from lattica.net.libp2p_compat import identify_message
from lattica.net.streams import reset_quietly

log = logging.getLogger(__name__)

IDENTIFY_PUSH = TProtocol("/ipfs/id/push/1.0.0")
PUSH_CONCURRENCY = 10


def push_message(host: IHost) -> Identify:
    """What we tell peers about ourselves, without an observed address."""
    message = identify_message(host)
    message.ClearField("observed_addr")
    return message


def push_frame(host: IHost) -> bytes:
    """``push_message`` as it goes on the wire: varint length, then the protobuf."""
    body = push_message(host).SerializeToString()
    return encode_uvarint(len(body)) + body


async def push_identify(host: IHost, peers: Iterable[ID] | None = None) -> int:
    """Push identify to ``peers`` (default: every connected peer); how many received it."""
    targets = list(host.get_connected_peers() if peers is None else peers)
    frame = push_frame(host)
    limiter = trio.CapacityLimiter(PUSH_CONCURRENCY)
    delivered: list[ID] = []
    async with trio.open_nursery() as nursery:
        for peer in targets:
            nursery.start_soon(_push_one, host, peer, frame, limiter, delivered)
    return len(delivered)


async def _push_one(host: IHost, peer: ID, frame: bytes, limiter: trio.CapacityLimiter,
                    delivered: list[ID]) -> None:
    async with limiter:
        try:
            stream = await host.new_stream(peer, [IDENTIFY_PUSH])
        except Exception as exc:  # noqa: BLE001 - a peer that left or lacks the protocol is skipped
            log.debug("identify push to %s: no stream: %r", peer, exc)
            return
        try:
            await stream.write(frame)
            await stream.close()
        except Exception as exc:  # noqa: BLE001 - the peer broke the stream: the push is lost, nothing else
            log.debug("identify push to %s failed: %r", peer, exc)
            await reset_quietly(stream)
            return
        delivered.append(peer)
