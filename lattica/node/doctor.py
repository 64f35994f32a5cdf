"""The daemon's side of ``lattica doctor``: the facts behind the ``doctor`` control request.

The request gathers what only the running node knows — its addresses, the AutoNAT dial-backs,
the addresses peers observed it at (with the local end of each socket, which tells a
port-preserving NAT from a symmetric one), relay reservations, every connected peer's path,
RTT, last tensor transfer and clock offset, and the bootstrap peers that fail and why — as one
``lattica.diagnostics.NodeFacts``. The node's own parts (host, connectivity, peer book) give
the first facts; each service then adds what it knows through the ``DoctorSource`` Protocol
(``services.py``): the NAT service its reachability and relays, the state service what the
members advertise, the training service its last transfers. The conclusions are drawn by the
CLI (``lattica.diagnostics``), so the same checks serve a standalone probe before joining.
"""

from __future__ import annotations

from collections.abc import Sequence

from lattica.config import NodeConfig
from lattica.diagnostics import NodeFacts, PeerFacts
from lattica.net.clock import measure_clocks
from lattica.net.connectivity import Connectivity
from lattica.net.host import LatticaHost
from lattica.net.nat.observations import observations
from lattica.node.services import DoctorSource, NodeService, PeerTableSource


async def node_facts(
    host: LatticaHost, connectivity: Connectivity, config: NodeConfig, services: Sequence[NodeService],
) -> NodeFacts:
    """The ``doctor`` control request: this node's facts.

    Served by the node itself, so it answers while bootstrap still runs (the services, and
    with them reachability and paths, start after it): then the failures so far are what
    matters.
    """
    for service in services:  # paths and RTTs as the connections are now
        if isinstance(service, PeerTableSource):
            service.refresh_peer_table()
    records = connectivity.peer_book.records()
    clocks = await measure_clocks(host, [r.peer_id for r in records if r.connected])
    peers = tuple(
        PeerFacts(
            peer_id=r.peer_id, connected=r.connected, path=r.path if r.connected else None,
            relay=r.relay if r.connected else None, rtt_ms=r.rtt_ms if r.connected else None,
            clock_offset_s=clocks[r.peer_id].offset_s if r.peer_id in clocks else None,
            clock_error_s=clocks[r.peer_id].error_s if r.peer_id in clocks else None,
        )
        for r in records
    )
    joined = connectivity.joined
    facts = NodeFacts(
        peer_id=host.get_id().to_base58(),
        listen=tuple(str(a) for a in host.get_transport_addrs()),
        announce=tuple(config.announce),
        advertised=tuple(connectivity.dialable_addrs()),
        observations=tuple(observations(host)),
        peers=peers,
        bootstrap_failures={**connectivity.bootstrap_errors, **joined.refused},
        bootstrap_plain=joined.plain,
        bootstrap_tried=len(config.peers),
    )
    for service in services:
        if isinstance(service, DoctorSource):
            facts = service.doctor_facts(facts)
    return facts
