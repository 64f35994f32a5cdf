"""The daemon's side of ``lattica doctor``: the facts behind the ``doctor`` control request.

The request gathers what only the running node knows — its addresses, the AutoNAT dial-backs,
the addresses peers observed it at (with the local end of each socket, which tells a
port-preserving NAT from a symmetric one), relay reservations, every connected peer's path,
RTT, last tensor transfer and clock offset, and the bootstrap peers that fail and why — as one
JSON object shaped like ``lattica.diagnostics.NodeFacts``. The conclusions are drawn by the CLI
(``lattica.diagnostics``), so the same checks serve a standalone probe before joining.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from lattica.diagnostics import NodeFacts, PeerFacts
from lattica.net.clock import measure_clocks
from lattica.net.nat.observations import observations

if TYPE_CHECKING:
    from lattica.node.nat_service import NatService
    from lattica.node.node import Node

log = logging.getLogger(__name__)



async def node_facts(node: Node) -> dict[str, object]:
    """The ``doctor`` control request: this node's facts as JSON (``NodeFacts``).

    Served by the node itself, so it answers while bootstrap still runs (the services, and
    with them reachability and paths, start after it): then the failures so far are what
    matters.
    """
    host = node.running_host
    nat = _nat_services(node)
    if nat is not None:
        nat.refresh_peer_table()
    records = node.peer_book.records()
    clocks = await measure_clocks(host, [r.peer_id for r in records if r.connected])
    transfers = _last_transfers(node)
    member_reach = _member_reachability(node)
    peers = tuple(
        PeerFacts(
            peer_id=r.peer_id, connected=r.connected, path=r.path if r.connected else None,
            relay=r.relay if r.connected else None, rtt_ms=r.rtt_ms if r.connected else None,
            last_transfer_bytes=transfers[r.peer_id][0] if r.peer_id in transfers else None,
            last_transfer_mbit_s=transfers[r.peer_id][1] if r.peer_id in transfers else None,
            clock_offset_s=clocks[r.peer_id].offset_s if r.peer_id in clocks else None,
            clock_error_s=clocks[r.peer_id].error_s if r.peer_id in clocks else None,
            reachability=member_reach.get(r.peer_id),
        )
        for r in records
    )
    relay_addrs = tuple(str(a) for a in nat.relay_addrs()) if nat is not None else ()
    failures = dict(node.bootstrap_errors)
    failures.update(node.joined.refused)
    facts = NodeFacts(
        peer_id=node.peer_id.to_base58(),
        listen=tuple(str(a) for a in host.get_transport_addrs()),
        announce=tuple(node.config.announce),
        advertised=(*node.dialable_addrs(), *relay_addrs),
        reachability=str(nat.reachability.reachability.value) if nat is not None else "unknown",
        dialback=dict(nat.reachability.verdicts) if nat is not None else {},
        observations=tuple(observations(host)),
        relay_addrs=relay_addrs,
        relay_serving=bool(nat.relay_server.serving) if nat is not None else False,
        peers=peers,
        bootstrap_failures=failures,
        bootstrap_plain=node.joined.plain,
        bootstrap_tried=len(node.config.peers),
    )
    return dataclasses.asdict(facts)


def _nat_services(node: Node) -> NatService | None:
    if not getattr(node.config, "nat", False):
        return None
    from lattica.node.nat_service import NatService

    return next((e for e in node.services if isinstance(e, NatService)), None)


def _last_transfers(node: Node) -> dict[str, tuple[int, float]]:
    """peer -> (bytes, Mbit/s) of the last large tensor message sent to it."""
    if getattr(node.config, "train", None) is None:
        return {}
    from lattica.train.service import TrainingService

    training = next((e for e in node.services if isinstance(e, TrainingService)), None)
    if training is None or training.tensors is None:
        return {}
    return {peer: (size, round(size * 8 / seconds / 1e6, 2))
            for peer, (size, seconds) in training.tensors.stats.last_sent.items() if seconds > 0}


def _member_reachability(node: Node) -> dict[str, str]:
    from lattica.node.state_service import StateService

    state = next((e for e in node.services if isinstance(e, StateService)), None)
    if state is None:
        return {}
    members = state.state.snapshot().get("members", {})
    return {peer: str(rec["reachability"]) for peer, rec in members.items()
            if isinstance(rec, dict) and isinstance(rec.get("reachability"), str)}
