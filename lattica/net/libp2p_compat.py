"""Every place Lattica relies on py-libp2p beyond its public interface, in one module.

py-libp2p 0.8.1's interfaces (``libp2p.abc``) do not give a node everything it needs. What is
taken from behind them is here, and nowhere else in ``lattica``:

- methods of the swarm that ``INetwork`` does not declare: ``unblock_peer`` (its negative dial
  cache would refuse a peer that came back; our callers pace redials themselves) and the
  ``auto_connector`` (stopped: Lattica decides whom to connect to);
- the host's observed-address manager (``_observed_addr_manager``, its ``_conn_observations``):
  the addresses peers saw us at, per connection;
- the layers under a connection (swarm connection, muxer, secure session, raw connection, trio
  stream: ``_conn`` among them), walked to the TCP socket, or to the stream a relayed
  connection runs on;
- private functions: identify's message builder, DCUtR's TCP listen addresses, the circuit
  relay's HOP stream handler (registered by Lattica itself while it serves as a relay);
- the private hooks of three protocol classes whose behaviour Lattica changes: DCUtR's hole
  punch, AutoNAT's dial-back and the per-peer query of a Kademlia walk. The base classes below
  forward each hook to a public method, which ``lattica.net.nat.holepunch``,
  ``lattica.net.nat.autonat`` and ``lattica.dht.reach`` override;
- the nested errors of libp2p's ``MultiError`` (``errors``) and of exception groups.

Where a name is missing the code degrades (no observations, no relay named, no unblocking)
rather than fail a node; ``tests/net/test_libp2p_compat.py`` checks every name against the
installed library, pinned to 0.8.1 in ``pyproject.toml``, and fails naming the one an upgrade
moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from libp2p.abc import IHost, INetConn
from libp2p.custom_types import StreamHandlerFn
from libp2p.exceptions import MultiError
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.identity.identify.identify import _mk_identify_protobuf
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.network.auto_connector import AutoConnector
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol, _local_tcp_listen_addrs
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from multiaddr import Multiaddr

COMPATIBLE_VERSION = "0.8.1"

# the attributes that hold the next layer down, across py-libp2p's connection classes
CONN_LAYERS = ("muxed_conn", "secured_conn", "conn", "read_writer", "read_write_closer", "raw_conn", "_conn", "stream")


# -- the swarm -----------------------------------------------------------------------------------


def unblock_peer(host: IHost, peer: ID) -> None:
    """Take ``peer`` out of the swarm's negative dial cache (nothing when the network has none)."""
    unblock = getattr(host.get_network(), "unblock_peer", None)
    if unblock is not None:
        unblock(peer)


def auto_connector(host: IHost) -> AutoConnector | None:
    """The swarm's auto-connector, which dials every peer the peerstore has heard of."""
    connector = getattr(host.get_network(), "auto_connector", None)
    return connector if isinstance(connector, AutoConnector) else None


# -- what peers observe ----------------------------------------------------------------------------


def observed_addrs(host: IHost, *, min_observers: int) -> list[Multiaddr]:
    """The addresses at least ``min_observers`` peers reported seeing us at (identify)."""
    manager = getattr(host, "_observed_addr_manager", None)
    if manager is None:
        return []
    try:
        return list(manager.addrs(min_observers=min_observers))
    except Exception:  # noqa: BLE001 - the library's observed-address manager; any failure means no observations
        return []


def connection_observations(host: IHost) -> list[tuple[str, INetConn]]:
    """(the address a peer saw us at, the live connection it saw it on), per connection."""
    manager = getattr(host, "_observed_addr_manager", None)
    entries = getattr(manager, "_conn_observations", None)
    if not isinstance(entries, dict):
        return []
    found = []
    for _local, external, _group, conn_ref in list(entries.values()):
        conn = conn_ref()
        if conn is not None:
            found.append((str(external), conn))
    return found


# -- the layers under a connection -----------------------------------------------------------------


def tcp_socket_of(conn: object) -> trio.SocketStream | None:
    """The TCP socket under a libp2p connection, walking its layers (None when relayed)."""
    layer: object | None = conn
    for _ in range(len(CONN_LAYERS) + 3):
        if isinstance(layer, trio.SocketStream):
            return layer
        layer = _next_layer(layer, CONN_LAYERS)
        if layer is None:
            return None
    return None


def relay_peer_of(conn: object) -> str | None:
    """The peer at the far end of the stream a relayed connection runs on: its relay.

    (On the receiving side py-libp2p 0.8.1 names *us* as the relay in the circuit address.)
    """
    layer: object | None = conn
    for _ in range(len(CONN_LAYERS) + 2):
        stream_conn = getattr(getattr(layer, "stream", None), "muxed_conn", None)
        if stream_conn is not None and hasattr(stream_conn, "peer_id"):
            return str(stream_conn.peer_id)
        layer = _next_layer(layer, CONN_LAYERS[:-1])
        if layer is None:
            return None
    return None


def _next_layer(layer: object, names: Sequence[str]) -> object | None:
    return next((inner for name in names if (inner := getattr(layer, name, None)) is not None), None)


# -- private functions ------------------------------------------------------------------------------


def identify_message(host: IHost) -> Identify:
    """What identify tells a peer about us (the observed address left for the caller)."""
    return _mk_identify_protobuf(host, None)


def tcp_listen_endpoints(host: IHost) -> list[tuple[str, int]]:
    """Our TCP listen addresses as (ip, port), relay addresses left out."""
    return [(ip, port) for _family, ip, port in _local_tcp_listen_addrs(host)]


def hop_stream_handler(protocol: CircuitV2Protocol) -> StreamHandlerFn:
    """The relay's handler of HOP streams (reservations, circuits), to register while serving."""
    return protocol._handle_hop_stream


def nested_errors(exc: BaseException) -> list[BaseException]:
    """The errors a libp2p ``MultiError`` or an exception group holds (none for others)."""
    if isinstance(exc, MultiError):
        return [e for e in exc.errors if isinstance(e, BaseException)]
    if isinstance(exc, BaseExceptionGroup):
        return list(exc.exceptions)
    return []


# -- private hooks, under public names ----------------------------------------------------------------


class DCUtRHooks(DCUtRProtocol):
    """py-libp2p's DCUtR (hole punching) with the steps Lattica changes as public methods.

    Override ``drive`` (the background loop that punches towards every relayed peer),
    ``direct_dial_first`` (a plain dial before the exchange) and ``punch`` (the simultaneous
    dials after SYNC); the library's own state and steps are read through the methods below.
    """

    async def _auto_drive_loop(self) -> None:
        await self.drive()

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        return await self.direct_dial_first(peer_id)

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False) -> bool:
        return await self.punch(peer_id, addrs, as_responder=as_responder)

    async def drive(self) -> None:
        await super()._auto_drive_loop()

    async def direct_dial_first(self, peer_id: ID) -> bool:
        return await super()._try_unilateral_upgrade(peer_id)

    async def punch(self, peer_id: ID, addrs: list[Multiaddr], *, as_responder: bool = False) -> bool:
        return await super()._perform_hole_punch(peer_id, addrs, as_responder)

    def session_running(self, peer_id: ID) -> bool:
        """A session with ``peer_id`` is running (ours or one the peer started)."""
        return peer_id in self._in_progress

    def forget_attempts(self, peer_id: ID) -> None:
        """Reset the library's count of attempts per connection (it stops after 3)."""
        self._hole_punch_attempts.pop(peer_id, None)

    async def connected_directly(self, peer_id: ID) -> bool:
        return await self._verify_direct_connection(peer_id)

    async def dial_from(
        self, peer_id: ID, addr: Multiaddr, source: tuple[str, int] | None, *, as_responder: bool,
    ) -> None:
        """Dial ``addr`` from the local ``source`` (ip, port), as the punch's simultaneous open does."""
        await self._dial_peer(peer_id, addr, source, as_responder)

    def close_relay_later(self, peer_id: ID) -> None:
        """Close the relayed connection to ``peer_id`` after the library's grace period."""
        self._schedule_relay_close(peer_id)


class AutoNATHooks(AutoNATService):
    """py-libp2p's AutoNAT service with its dial-back as a public method: override ``dial_back``."""

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        return await self.dial_back(peer_id, addrs)

    async def dial_back(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        """Dial ``peer_id`` back at one of ``addrs``; the address reached, or None."""
        return await super()._try_dial(peer_id, addrs)


class PeerRoutingHooks(PeerRouting):
    """py-libp2p's Kademlia peer routing with the query of one peer in a FIND_NODE walk as a
    public method: override ``query_closest``."""

    async def _query_single_peer_for_closest(self, peer: ID, target_key: bytes, new_peers: list[ID]) -> None:
        await self.query_closest(peer, target_key, new_peers)

    async def query_closest(self, peer: ID, target_key: bytes, new_peers: list[ID]) -> None:
        """Ask ``peer`` for the peers closest to ``target_key``, adding them to ``new_peers``."""
        await super()._query_single_peer_for_closest(peer, target_key, new_peers)
