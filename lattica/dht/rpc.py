"""Outbound Kademlia GET_PROVIDERS, parsed defensively.

One stream per request: write a varint-prefixed request, read one varint-prefixed answer
(capped before the body is read), check it is a GET_PROVIDERS answer for our key, and keep
at most ``max_providers`` providers and ``width`` closer peers, each with at most
``max_addrs`` parseable addresses. Closer peers' addresses go into the peerstore (with a
TTL) so the lookup can dial them. Malformed answers raise ``RemoteProtocolError``; a peer
we cannot reach or that breaks the stream raises ``PeerUnavailableError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import multihash
from google.protobuf.message import DecodeError
from libp2p.abc import IHost, INetStream
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from lattica.dht.screen import FrameDecoder, encode_varint
from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.net.streams import close_quietly

ADDR_TTL = 3600


@dataclass(frozen=True, kw_only=True)
class ResponseCaps:
    max_message: int
    max_providers: int
    max_addrs: int
    width: int


@dataclass(frozen=True)
class ProvidersAnswer:
    providers: list[PeerInfo]
    closer: list[PeerInfo]


def parse_providers_answer(raw: bytes, *, key: bytes, caps: ResponseCaps, peer_id: str) -> ProvidersAnswer:
    """Sans-IO half: one response body -> providers and closer peers."""
    msg = Message()
    try:
        msg.ParseFromString(raw)
    except DecodeError:
        raise RemoteProtocolError("GET_PROVIDERS answer is not a protobuf", peer_id=peer_id) from None
    if msg.type != Message.MessageType.GET_PROVIDERS or (msg.key and msg.key != key):
        raise RemoteProtocolError("answer is not GET_PROVIDERS for our key", peer_id=peer_id)
    if len(msg.providerPeers) > caps.max_providers:
        raise RemoteProtocolError(
            f"{len(msg.providerPeers)} providers exceed {caps.max_providers}", peer_id=peer_id
        )
    providers = [p for p in map(lambda e: _peer_info(e, caps), msg.providerPeers) if p]
    closer = [p for p in map(lambda e: _peer_info(e, caps), msg.closerPeers[: caps.width]) if p]
    return ProvidersAnswer(providers=providers, closer=closer)


def _peer_info(entry: Message.Peer, caps: ResponseCaps) -> PeerInfo | None:
    try:
        multihash.decode(entry.id)
        peer_id = ID(entry.id)
    except ValueError:
        return None
    addrs: list[Multiaddr] = []
    for raw in entry.addrs[: caps.max_addrs]:
        try:
            addrs.append(Multiaddr(raw))
        except (MultiaddrError, ValueError):
            continue
    return PeerInfo(peer_id, addrs)


async def get_providers(host: IHost, peer: ID, key: bytes, *, caps: ResponseCaps) -> ProvidersAnswer:
    """Ask ``peer`` for providers of ``key`` and for peers closer to it."""
    request = Message()
    request.type = Message.MessageType.GET_PROVIDERS
    request.key = key
    body = request.SerializeToString()
    try:
        stream = await host.new_stream(peer, [PROTOCOL_ID])
    except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds when a stream cannot be opened
        raise PeerUnavailableError(f"cannot open DHT stream: {exc!r}", peer_id=str(peer)) from None
    try:
        await stream.write(encode_varint(len(body)) + body)
        raw = await _read_frame(stream, caps.max_message, str(peer))
    finally:
        await close_quietly(stream)
    answer = parse_providers_answer(raw, key=key, caps=caps, peer_id=str(peer))
    store = host.get_peerstore()
    for info in answer.closer:
        if info.addrs and info.peer_id != host.get_id():
            store.add_addrs(info.peer_id, info.addrs, ADDR_TTL)
    return answer


async def _read_frame(stream: INetStream, max_message: int, peer_id: str) -> bytes:
    decoder = FrameDecoder(max_frame=max_message, peer_id=peer_id)
    while (frame := decoder.next_frame()) is None:
        try:
            chunk = await stream.read(16 * 1024)
        except EOFError:
            chunk = b""
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
            raise PeerUnavailableError(f"DHT stream broken: {exc!r}", peer_id=peer_id) from None
        if not chunk:
            raise PeerUnavailableError("DHT stream ended before an answer", peer_id=peer_id)
        decoder.feed(chunk)
    return frame
