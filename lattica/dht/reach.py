"""How the DHT reaches a peer it wants to query, within the query timeout.

Theory of operation
-------------------
A Kademlia walk learns peers from other peers' answers (closer peers, providers) and queries
those it is not connected to. py-libp2p opens the stream with ``host.new_stream``, which
dials through the swarm: the peer's direct addresses only (relay addresses are skipped), each
retried three times with backoff, under the library's fixed 10 s query timeout. A NAT'd node
that serves the DHT (nodes start as servers until AutoNAT says private) is advertised with its
private LAN address and its relay address; a walk that reaches it then spends ~10 s per query
on the LAN address and never tries the relay. The start-up self-lookup and every provide each
paid that before a node looked up its run's members: NAT'd nodes found each other through a
DHT server in 34–36 s although the query timeout is 5 s.

Here every DHT query goes through a ``PeerReacher`` first: a peer that is not connected is
reached with ``reach`` — in the daemon the node's path dialer, which dials the direct
addresses at once and the relay addresses 0.3 s later, the first connection winning — with
the addresses the peerstore holds for it (DHT answers and identify put them there). One reach
per peer at a time: queries of the same peer that arrive meanwhile wait for its outcome.
Callers bound the reach with the query timeout (``ReachingPeerRouting`` for the FIND_NODE walks
of py-libp2p's peer routing, ``ContentRouting`` for GET_PROVIDERS); a peer not reached in time
is skipped, and the walk goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.routing_table import RoutingTable
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from multiaddr import Multiaddr

from lattica.net.libp2p_compat import PeerRoutingHooks

logger = logging.getLogger(__name__)

Reach = Callable[[PeerInfo], Awaitable[bool]]
"""Connect to a peer at these addresses; True when connected afterwards."""


class PeerReacher:
    """One dial per peer at a time on behalf of the DHT's queries."""

    def __init__(self, host: IHost, reach: Reach) -> None:
        self._host = host
        self._reach = reach
        self._reaching: dict[ID, trio.Event] = {}

    def connected(self, peer: ID) -> bool:
        return bool(self._host.get_network().connections.get(peer))

    async def __call__(self, peer: ID) -> bool:
        """True when ``peer`` is connected, dialing it first if it is not."""
        if self.connected(peer):
            return True
        running = self._reaching.get(peer)
        if running is not None:
            await running.wait()
            return self.connected(peer)
        done = self._reaching[peer] = trio.Event()
        try:
            return await self._reach(PeerInfo(peer, self._addrs(peer))) and self.connected(peer)
        except Exception as exc:  # noqa: BLE001 - network: any dial failure means not reached
            logger.debug("reaching DHT peer %s failed: %r", peer, exc)
            return False
        finally:
            del self._reaching[peer]
            done.set()

    def _addrs(self, peer: ID) -> list[Multiaddr]:
        try:
            return list(self._host.get_peerstore().addrs(peer))
        except PeerStoreError:
            return []


class ReachingPeerRouting(PeerRoutingHooks):
    """py-libp2p's peer routing with each FIND_NODE query bounded by ``query_timeout`` and
    preceded by a ``PeerReacher`` dial."""

    def __init__(self, host: IHost, routing_table: RoutingTable, *, reacher: PeerReacher,
                 query_timeout: float) -> None:
        super().__init__(host, routing_table)
        self._reacher = reacher
        self._query_timeout = query_timeout

    async def query_closest(self, peer: ID, target_key: bytes, new_peers: list[ID]) -> None:
        with trio.move_on_after(self._query_timeout) as scope:
            if await self._reacher(peer):
                await super().query_closest(peer, target_key, new_peers)
            else:
                logger.debug("FIND_NODE: %s not reachable", peer)
        if scope.cancelled_caught:
            logger.debug("FIND_NODE to %s timed out", peer)
