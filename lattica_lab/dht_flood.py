"""A hostile DHT peer: Kademlia store requests written raw on real libp2p streams.

``store_request`` sends one PUT_VALUE or ADD_PROVIDER frame on a fresh ``/ipfs/kad/1.0.0``
stream and reports whether the receiver acknowledged it (py-libp2p echoes an accepted request;
a refused one ends in a reset or an empty answer). ``Flooder`` is an outsider that sends records
under fresh keys as fast as the receiver takes them and takes a fresh identity whenever the
current one is refused ``refusals_per_identity`` times in a row — the cheapest way around a
per-identity quota — counting what was accepted and refused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht.keys import content_key
from lattica.dht.records import ExpiringRecord, encode_record
from lattica.dht.screen import encode_varint
from lattica.net.host import build_host

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
_ANSWER_TIMEOUT_S = 5.0


def _frame(msg: Message) -> bytes:
    body = msg.SerializeToString()
    return encode_varint(len(body)) + body


def put_value_frame(key: str, value: bytes, *, ttl: float = 600.0) -> bytes:
    """PUT_VALUE of ``value`` under ``key`` in Lattica's record envelope."""
    msg = Message()
    msg.type = Message.MessageType.PUT_VALUE
    msg.key = msg.record.key = key.encode()
    msg.record.value = encode_record(ExpiringRecord(value=value, seq=1, expires_at=time.time() + ttl))
    return _frame(msg)


def add_provider_frame(host: IHost, key: bytes) -> bytes:
    """ADD_PROVIDER announcing ``host`` (with its addresses) as a holder of ``key``."""
    msg = Message()
    msg.type = Message.MessageType.ADD_PROVIDER
    msg.key = key
    provider = msg.providerPeers.add()
    provider.id = host.get_id().to_bytes()
    provider.addrs.extend(a.to_bytes() for a in host.get_addrs())
    return _frame(msg)


async def store_request(sender: IHost, receiver: PeerInfo, frame: bytes) -> bool:
    """Send one store request on a fresh DHT stream; True when the receiver acknowledged it."""
    try:
        stream = await sender.new_stream(receiver.peer_id, [PROTOCOL_ID])
    except Exception:  # noqa: BLE001 - libp2p raises many kinds when a stream cannot be opened
        return False
    try:
        await stream.write(frame)
        with trio.fail_after(_ANSWER_TIMEOUT_S):
            answer = await stream.read(64 * 1024)
    except Exception:  # noqa: BLE001 - a reset stream is how a refusal arrives; libp2p raises many kinds
        return False
    finally:
        with contextlib.suppress(Exception):  # best effort on a stream that may be gone
            await stream.close()
    return bool(answer)


@dataclass
class FloodCounts:
    accepted: int = 0
    refused: int = 0
    identities: int = 0
    value_bytes_accepted: int = 0


@dataclass
class Flooder:
    """Floods ``target`` with PUT_VALUEs of ``value_bytes`` (and an ADD_PROVIDER every
    ``provider_every`` requests) under fresh ``/lattica/run/…`` and content keys."""

    target: PeerInfo
    value_bytes: int = 16_000
    provider_every: int = 8
    refusals_per_identity: int = 16
    counts: FloodCounts | None = None

    def __post_init__(self) -> None:
        self.counts = self.counts or FloodCounts()
        self._serial = itertools.count()
        self._prefix = os.urandom(4).hex()  # fresh keys, whichever flooder sends them

    async def run(self) -> None:
        """Flood until cancelled, one identity after another."""
        while True:
            await self._one_identity()

    async def _one_identity(self) -> None:
        assert self.counts is not None
        host = build_host(create_new_key_pair(), listen_addrs=[LOOPBACK])
        async with host.run([LOOPBACK]):
            try:
                with trio.fail_after(10):
                    await host.connect(self.target)
            except Exception:  # noqa: BLE001 - a refused dial: try again with the next identity
                await trio.sleep(0.1)
                return
            self.counts.identities += 1
            refused_in_a_row = 0
            while refused_in_a_row < self.refusals_per_identity:
                n = next(self._serial)
                if n % self.provider_every == 0:
                    frame, size = add_provider_frame(host, content_key(f"{self._prefix}-{n}".encode())), 0
                else:
                    key = f"/lattica/run/flood-{self._prefix}-{n}"
                    frame, size = put_value_frame(key, b"x" * self.value_bytes), self.value_bytes
                if await store_request(host, self.target, frame):
                    self.counts.accepted += 1
                    self.counts.value_bytes_accepted += size
                    refused_in_a_row = 0
                else:
                    self.counts.refused += 1
                    refused_in_a_row += 1
