"""Relay (``/p2p-circuit``) addresses: parsing them, and one relayed dial.

A relay address names two peers: ``<relay transport addr>/p2p/<relay>/p2p-circuit/p2p/<peer>``.
The dialer connects to the relay, asks it (circuit relay v2 HOP CONNECT) for a circuit to the
peer, which must hold a reservation there, and runs the usual security and muxer upgrade over
that circuit. The final ``/p2p/<peer>`` is what the relay is asked for, so it must stay on the
address: py-libp2p's ``info_from_p2p_addr`` moves it into the peer id and leaves an address
that the relay transport refuses ("Missing /p2p/<peerID> at the end of circuit Multiaddr").

``dial_circuit`` makes one relayed dial: for the bootstrap peers of a node that was given a
relay address with ``--peer`` (before the NAT services' path ``Dialer`` runs), and for the
``Dialer``'s relay addresses. A relay that answers CONNECT with a status other than OK fails
the dial with ``PeerUnavailableError`` naming the relay, the status code and what it means
(``refusal_reason``): the connection to the relay itself does not reach the peer.
"""

from __future__ import annotations

from dataclasses import dataclass

from libp2p.abc import IHost, INetConn
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.exceptions import RelayConnectionError
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from multiaddr import Multiaddr

from lattica.errors import PeerUnavailableError
from lattica.net.libp2p_compat import unblock_peer

# Circuit relay v2 status codes a relay answers a CONNECT with, and what they mean for us.
_REFUSALS = {
    200: ("RESERVATION_REFUSED", "the relay refused a reservation"),
    201: ("RESOURCE_LIMIT_EXCEEDED", "the relay is at its limits"),
    202: ("PERMISSION_DENIED", "the relay does not serve this node"),
    203: ("CONNECTION_FAILED", "the relay could not reach the peer"),
    204: ("NO_RESERVATION", "the peer holds no reservation on this relay"),
    400: ("MALFORMED_MESSAGE", "the relay could not parse the request"),
    401: ("UNEXPECTED_MESSAGE", "the relay did not expect the request"),
}


@dataclass(frozen=True)
class CircuitAddr:
    relay_id: ID
    peer_id: ID
    relay_addr: str  # the relay's own address, ending in /p2p/<relay>


def parse_circuit_addr(text: str) -> CircuitAddr:
    """Split ``…/p2p/<relay>/p2p-circuit/p2p/<peer>``; ValueError when it is not one."""
    head, sep, tail = text.partition("/p2p-circuit")
    if not sep or "/p2p-circuit" in tail:
        raise ValueError(f"not a relay address (one /p2p-circuit): {text[:200]}")
    if "/p2p/" not in head:
        raise ValueError(f"relay address names no relay before /p2p-circuit: {text[:200]}")
    if not tail.startswith("/p2p/") or "/" in tail[len("/p2p/"):]:
        raise ValueError(f"relay address must end in /p2p-circuit/p2p/<peer id>: {text[:200]}")
    try:
        relay_id = ID.from_base58(head.rsplit("/p2p/", 1)[1])
        peer_id = ID.from_base58(tail[len("/p2p/"):])
        Multiaddr(text)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same bad address
        raise ValueError(f"bad relay address {text[:200]}: {exc}") from None
    if relay_id == peer_id:
        raise ValueError(f"relay address names the same peer as relay and target: {text[:200]}")
    return CircuitAddr(relay_id=relay_id, peer_id=peer_id, relay_addr=head)


def relay_transport(host: IHost) -> CircuitV2Transport:
    """A circuit transport for dialing only (no reservations, no HOP service)."""
    protocol = CircuitV2Protocol(host, allow_hop=False)
    return CircuitV2Transport(host, protocol, RelayConfig(roles=RelayRole.STOP))


async def dial_circuit(host: IHost, addr: Multiaddr, transport: CircuitV2Transport | None = None) -> INetConn:
    """Connect to the peer named at the end of ``addr`` through the relay it names."""
    circuit = parse_circuit_addr(str(addr))
    # our callers pace redials; the swarm's negative cache must not
    unblock_peer(host, circuit.relay_id)
    unblock_peer(host, circuit.peer_id)
    try:
        return await (transport or relay_transport(host)).dial(addr)
    except ConnectionError as exc:
        status = relay_status(exc)
        if status is None:
            raise
        raise PeerUnavailableError(
            f"relay {circuit.relay_id} refused the circuit: {refusal_reason(status)}",
            peer_id=str(circuit.peer_id),
        ) from None  # the whole cause is in the message


def relay_status(exc: BaseException) -> int | None:
    """The status code of a relay's refusal inside ``exc`` (py-libp2p re-raises it as a plain
    ``ConnectionError`` whose context holds the ``RelayConnectionError``), or None."""
    inner: BaseException | None = exc
    for _ in range(4):
        if inner is None:
            return None
        if isinstance(inner, RelayConnectionError) and inner.status_code is not None:
            return int(inner.status_code)
        inner = inner.__cause__ or inner.__context__
    return None


def refusal_reason(status: int) -> str:
    """``204 NO_RESERVATION (the peer holds no reservation on this relay)``."""
    name, meaning = _REFUSALS.get(status, ("UNKNOWN", "an unknown refusal"))
    return f"status {status} {name} ({meaning})"
