"""Setting up a fast channel over libp2p: both sides of the handshake (see ``fastpath.py``).

The initiator (``dial``) opens a ``FAST_PROTOCOL`` stream, sends its nonce and reads the
responder's port, nonce and session id; it dials that port at the IP address its live, direct
libp2p connection to the peer comes from (a relayed connection gets no fast channel). The
responder (``PendingSessions.offer``) answers with a fresh nonce and session id, and remembers
the session for ``PENDING_TTL_S``; the TCP connection that then presents the session id is
``claim``-ed as that peer's channel. Malformed requests and replies are ``RemoteProtocolError``;
a peer without a fast path, or one unreachable, is ``BrokenError``.
"""

from __future__ import annotations

import os

import multiaddr
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from lattica.errors import BrokenError, RemoteProtocolError
from lattica.net.streams import close_quietly
from lattica.net.tensors import fastpath
from lattica.net.wire import read_message, write_message

MAX_SETUP_MESSAGE = 4096


async def dial(host: IHost, peer: str, own_peer_id: str, *, frame_bytes: int) -> fastpath.FastChannel:
    """A fast channel to ``peer``, set up over a libp2p stream (the initiator's side)."""
    try:
        stream = await host.new_stream(ID.from_base58(peer), [TProtocol(fastpath.FAST_PROTOCOL)])
    except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds when a stream cannot be opened
        raise BrokenError(f"fast setup stream failed: {exc!r}", peer_id=peer) from None
    try:
        address = observed_host(stream, peer)
        nonce = os.urandom(fastpath.NONCE_BYTES)
        await write_message(stream, {"nonce": nonce}, peer_id=peer)
        reply = await read_message(stream, max_size=MAX_SETUP_MESSAGE, peer_id=peer)
    finally:
        await close_quietly(stream)
    port, their_nonce, sid = check_setup_reply(reply, peer)
    k_out, k_in = fastpath.derive_keys(nonce, their_nonce, own_peer_id, peer, sid)
    return await fastpath.connect(
        address, port, sid, send_key=k_out, recv_key=k_in, peer_id=peer, frame_bytes=frame_bytes,
    )


class PendingSessions:
    """Sessions offered to peers whose TCP connection has not arrived yet (the responder's side)."""

    def __init__(self) -> None:
        self._pending: dict[bytes, tuple[str, bytes, bytes, float]] = {}  # sid -> (peer, k_out, k_in, expiry)

    def offer(self, peer: str, their_nonce: bytes, own_peer_id: str, port: int, now: float) -> dict[str, object]:
        """The reply to ``peer``'s setup request; the session is kept for ``PENDING_TTL_S``."""
        nonce, sid = os.urandom(fastpath.NONCE_BYTES), os.urandom(fastpath.SESSION_ID_BYTES)
        k_in, k_out = fastpath.derive_keys(their_nonce, nonce, peer, own_peer_id, sid)
        self._expire(now)
        self._pending[sid] = (peer, k_out, k_in, now + fastpath.PENDING_TTL_S)
        return {"port": port, "nonce": nonce, "sid": sid}

    def claim(self, sid: bytes | None, now: float) -> tuple[str, bytes, bytes] | None:
        """(peer, send key, receive key) of the session ``sid`` names, once; None if unknown."""
        self._expire(now)
        entry = self._pending.pop(sid, None) if sid else None
        return None if entry is None else entry[:3]

    def _expire(self, now: float) -> None:
        for sid in [s for s, entry in self._pending.items() if entry[3] < now]:
            del self._pending[sid]


def observed_host(stream: INetStream, peer: str) -> str:
    """The IP address the peer's live libp2p connection comes from: the only host its fast
    channel is dialed at (a host the peer names could be anyone's); a relayed one has none."""
    if stream.muxed_conn.get_connection_type() is ConnectionType.RELAYED:
        raise BrokenError("relayed connection: no direct address for the fast path", peer_id=peer)
    remote = stream.get_remote_address()
    if not remote or not isinstance(remote[0], str) or not remote[0]:
        raise BrokenError("no observed address to dial the fast path", peer_id=peer)
    return remote[0]


def check_setup_reply(reply: object, peer: str) -> tuple[int, bytes, bytes]:
    """The port, nonce and session id of a setup reply (a ``host`` in it is ignored)."""
    if isinstance(reply, dict) and "err" in reply:
        raise BrokenError(f"peer has no fast path: {reply.get('err')!r}", peer_id=peer)
    if not isinstance(reply, dict):
        raise RemoteProtocolError("bad fast path reply", peer_id=peer)
    port, nonce, sid = reply.get("port"), reply.get("nonce"), reply.get("sid")
    if type(port) is not int or not 0 < port < 65536:
        raise RemoteProtocolError("bad fast path port", peer_id=peer)
    if not isinstance(nonce, bytes) or len(nonce) != fastpath.NONCE_BYTES:
        raise RemoteProtocolError("bad fast path nonce", peer_id=peer)
    if not isinstance(sid, bytes) or len(sid) != fastpath.SESSION_ID_BYTES:
        raise RemoteProtocolError("bad fast path session id", peer_id=peer)
    return port, nonce, sid


def setup_nonce(request: object, peer: str) -> bytes:
    """The initiator's nonce from a fast path request; ``RemoteProtocolError`` if malformed."""
    their_nonce = request.get("nonce") if isinstance(request, dict) else None
    if not isinstance(their_nonce, bytes) or len(their_nonce) != fastpath.NONCE_BYTES:
        raise RemoteProtocolError("bad fast path request", peer_id=peer)
    return their_nonce


def listen_host(host: IHost) -> str:
    """The first IP address ``host`` listens on: where the fast path listens by default."""
    for addr in host.get_addrs():
        for proto in ("ip4", "ip6"):
            try:
                return str(addr.value_for_protocol(proto))
            except (multiaddr.exceptions.ProtocolLookupError, ValueError):
                continue
    return "0.0.0.0"


def least_busy(channels: list[fastpath.FastChannel]) -> fastpath.FastChannel:
    return min(channels, key=lambda c: c.send_lock.locked())
