"""NAT traversal inside the daemon: reservations, advertised addresses, members, peer table.

Theory of operation: the node's ``NatTraversal`` (``lattica.net.nat.traversal``, run by its
connectivity) runs AutoNAT against the directly connected peers, serves circuit relay v2 while
public and dials through the best path. This service acts on its verdicts: once the node is
known to be private — or earlier, as soon as peers see it at an address that is not its own
(behind a NAT) — it keeps reservations on relays among its peers and advertises the
``/p2p-circuit`` addresses in its replicated membership record and in what the host tells every
libp2p peer (identify's listen addresses, pushed on change; signed peer records; DHT provider
records), again whenever its reservations change (a relay went away). A PUBLIC verdict drops
the reservations.

Every member's advertised addresses are copied from the replicated state into the node's
peer book, so peer exchange passes a NAT'd peer's relay addresses on. Live members that no
connection reaches yet are dialed with their advertised addresses, with a per-member backoff.
The path book follows every connection (direct, hole-punched or relayed, and through which
relay) and samples RTTs; the daemon's peer table shows both (``lattica peers``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from trio_typing import TaskStatus

from lattica.diagnostics import NodeFacts
from lattica.net.host import LatticaHost
from lattica.net.nat.addresses import (
    conn_is_relayed,
    is_circuit,
    predicted_external_addrs,
    relay_of,
)
from lattica.net.nat.autonat import Reachability
from lattica.net.nat.paths import Path
from lattica.net.nat.relay import RelayReservations
from lattica.net.nat.traversal import NatTraversal
from lattica.net.nat.upnp import PortMapper
from lattica.net.peerbook import PeerBook
from lattica.observability import NodeMetrics
from lattica.train.swarm.membership import MembershipView

if TYPE_CHECKING:
    from lattica.crdt.state import ReplicatedState

log = logging.getLogger(__name__)

_SYNC_INTERVAL_S = 1.0
_MEMBER_DIAL_BACKOFF_S = (2.0, 60.0)
_MAX_MEMBER_ADDRS = 16


class NodePeers(Protocol):
    """What the NAT service needs of the node's connectivity (``lattica.net.connectivity``)."""

    @property
    def peer_book(self) -> PeerBook: ...

    def dialable_addrs(self) -> list[str]: ...

    async def dial_peer(self, peer_id: str, addrs: Sequence[str] = ()) -> bool: ...


class NatService:
    """The daemon's NAT wiring; ``traversal`` must run (the node's connectivity runs it)."""

    name = "nat"

    def __init__(
        self,
        traversal: NatTraversal,
        *,
        host: LatticaHost,
        peers: NodePeers,
        state: ReplicatedState | None,
        metrics: NodeMetrics,
        port_mapper: PortMapper | None = None,
        dial_members: bool = True,
        on_reachability: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.peers = peers
        self.state = state
        self.members = MembershipView(state, peer_id=host.get_id().to_base58()) if state is not None else None
        self.on_reachability = on_reachability
        self.reachability = traversal.reachability
        self.relay_server = traversal.relay_server
        self.paths = traversal.paths
        self.reservations: RelayReservations | None = None
        self._reservations_scope: trio.CancelScope | None = None
        self.port_mapper = port_mapper
        self._metrics = metrics
        self._dial_members = dial_members  # like peer exchange, dialing members is learning peers from others
        self._host = host
        self._me = host.get_id().to_base58()
        self._member_backoff: dict[str, tuple[float, float]] = {}  # peer -> (next try, pause)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            if self.port_mapper is not None:
                nursery.start_soon(self._map_port, self.port_mapper)
            nursery.start_soon(self._follow_reachability, nursery)
            nursery.start_soon(self._reserve_early, nursery)
            nursery.start_soon(self._copy_paths)
            if self.members is not None:
                nursery.start_soon(self._follow_members, nursery, self.members)

    async def _follow_reachability(self, nursery: trio.Nursery) -> None:
        while True:
            verdict = await self.reachability.wait_change()
            log.info("reachability: %s", verdict.value)
            if verdict == Reachability.PRIVATE:
                await self._start_reservations(nursery)
            elif verdict == Reachability.PUBLIC:
                self._stop_reservations()
            if self.on_reachability is not None and verdict != Reachability.UNKNOWN:
                # DHT server mode when publicly reachable, client mode behind NAT
                await self.on_reachability(verdict == Reachability.PUBLIC)
            await self._publish()

    async def _reserve_early(self, nursery: trio.Nursery) -> None:
        """Reserve as soon as peers see us at an address that is not ours (behind a NAT).

        Such a node is almost always private, and the AutoNAT verdict takes a dial-back
        timeout (3 s) to arrive, because the NAT silently drops the dial-back. Reserving
        now lets peers reach us seconds sooner; a PUBLIC verdict drops the reservations.
        """
        while self.reservations is None and self.reachability.reachability is Reachability.UNKNOWN:
            if predicted_external_addrs(self._host):
                log.info("behind a NAT: reserving on relays before the AutoNAT verdict")
                await self._start_reservations(nursery)
                return
            await trio.sleep(0.25)

    async def _start_reservations(self, nursery: trio.Nursery) -> None:
        if self.reservations is not None:
            return
        reservations = self.reservations = RelayReservations(self._host)
        scope = self._reservations_scope = trio.CancelScope()

        async def keep(*, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                async with trio.open_nursery() as inner:
                    await inner.start(reservations.run)
                    task_status.started()
                    inner.start_soon(self._follow_reservations, reservations)

        await nursery.start(keep)

    def _stop_reservations(self) -> None:
        if self._reservations_scope is not None:
            log.info("publicly reachable: dropping relay reservations")
            self._reservations_scope.cancel()
        self.reservations = self._reservations_scope = None

    async def _follow_reservations(self, reservations: RelayReservations) -> None:
        while True:
            addrs = await reservations.wait_change()
            log.info("relay addresses: %s", ", ".join(str(a) for a in addrs) or "none")
            await self._publish()

    async def _map_port(self, mapper: PortMapper) -> None:
        # discovery waits up to 3 s for a gateway: in the background, never holding start-up
        async with trio.open_nursery() as nursery:
            await nursery.start(mapper.run)
            if mapper.external_addr is not None:
                await self._publish()

    def mapped_addrs(self) -> list[str]:
        mapper = self.port_mapper
        if mapper is None or mapper.external_addr is None:
            return []
        return [f"{mapper.external_addr}/p2p/{self._me}"]

    async def _publish(self) -> None:
        # identify (pushed on change), signed peer records and DHT provider records carry
        # them to any libp2p peer, not only to Lattica members
        self._host.set_circuit_addrs(self.relay_addrs())
        if self.state is None:
            return
        addrs = [*self.peers.dialable_addrs(), *self.mapped_addrs(), *(str(a) for a in self.relay_addrs())]
        try:
            await self.state.update_member(addrs=addrs, reachability=self._reachability_text())
        except Exception as exc:  # noqa: BLE001 - best effort; the next change retries
            log.debug("could not publish reachability: %r", exc)

    def relay_addrs(self) -> list[Multiaddr]:
        return self.reservations.relay_addrs() if self.reservations is not None else []

    def _reachability_text(self) -> str:
        return str(self.reachability.reachability.value)

    # -- run members: their advertised addresses, and dialing those not connected yet ---------

    async def _follow_members(self, nursery: trio.Nursery, view: MembershipView) -> None:
        me, dial = self._me, self._dial_members
        while True:
            members = view.members()
            live = set(view.live())
            connected = {p.to_base58() for p in self._host.get_connected_peers()}
            now = time.monotonic()
            for peer_id, record in members.items():
                addrs = advertised_addrs(peer_id, record)
                if peer_id == me or not addrs:
                    continue
                self.peers.peer_book.learn(peer_id, addrs, now=time.time())
                if not dial or peer_id in connected or peer_id not in live or (
                    record.get("reachability") == "private" and not any(map(is_circuit, addrs))
                ):  # a private member is reachable only through a relay: wait for its address
                    self._member_backoff.pop(peer_id, None)
                    continue
                when, pause = self._member_backoff.get(peer_id, (now, _MEMBER_DIAL_BACKOFF_S[0]))
                if when <= now:
                    self._member_backoff[peer_id] = (now + pause, min(pause * 2, _MEMBER_DIAL_BACKOFF_S[1]))
                    nursery.start_soon(self.peers.dial_peer, peer_id)
            await trio.sleep(_SYNC_INTERVAL_S)

    # -- the peer table ------------------------------------------------------------------------

    async def _copy_paths(self) -> None:
        while True:
            self.refresh_peer_table()
            if self.reservations is not None:
                self._metrics.relay_reservations.set(len(self.relay_addrs()))
            await trio.sleep(_SYNC_INTERVAL_S)

    def refresh_peer_table(self) -> None:
        """Copy each connected peer's path (and relay) and RTT into the node's peer book."""
        for record in self.peers.peer_book.records():
            if not record.connected:
                continue
            peer = ID.from_base58(record.peer_id)
            path = self.paths.path(peer)
            if path is not None:
                record.path = path.value
            record.relay = self._relay_in_use(peer) if path is Path.RELAYED else None
            rtt = self.paths.rtt_ms(peer)
            if rtt is not None:
                record.rtt_ms = round(rtt, 2)

    def _relay_in_use(self, peer: ID) -> str | None:
        conns = self._host.get_network().connections.get(peer) or []
        me = self._me
        for conn in conns if isinstance(conns, list) else [conns]:
            if conn_is_relayed(conn) and (relay := relay_of(conn, me)) is not None:
                return relay
        return None

    def doctor_facts(self, facts: NodeFacts) -> NodeFacts:
        """``facts`` with the AutoNAT verdict and dial-backs, the relay addresses (advertised
        too) and whether this node serves as a relay."""
        relay_addrs = tuple(str(a) for a in self.relay_addrs())
        return dataclasses.replace(
            facts, advertised=(*facts.advertised, *relay_addrs), reachability=self._reachability_text(),
            dialback=dict(self.reachability.verdicts), relay_addrs=relay_addrs,
            relay_serving=bool(self.relay_server.serving),
        )

    def statistics(self) -> NatStatus:
        return NatStatus(
            reachability=self._reachability_text(),
            relay_serving=self.relay_server.serving,
            relay_addrs=tuple(str(a) for a in self.relay_addrs()),
            upnp="off" if self.port_mapper is None else (self.mapped_addrs() or ["no gateway"])[0],
        )

    def status(self) -> dict[str, object]:
        return self.statistics().as_json()


@dataclass(frozen=True)
class NatStatus:
    """The NAT service's part of ``lattica status``: top-level keys, beside the node's own."""

    reachability: str  # AutoNAT's verdict: public, private or unknown
    relay_serving: bool  # this node relays for others
    relay_addrs: tuple[str, ...]  # the /p2p-circuit addresses of its reservations
    upnp: str  # off, no gateway, or the mapped address

    def as_json(self) -> dict[str, object]:
        return {
            "reachability": self.reachability, "relay_serving": self.relay_serving,
            "relay_addrs": list(self.relay_addrs), "upnp": self.upnp,
        }


def port_mapper_for(listen: Sequence[str]) -> PortMapper | None:
    """A mapper for the first TCP listen port (UPnP maps one port; the daemon listens on one)."""
    for addr in listen:
        parts = str(addr).split("/")
        if len(parts) >= 5 and parts[3] == "tcp" and 0 < int(parts[4]) < 65536:
            return PortMapper(int(parts[4]))
    return None


def advertised_addrs(peer_id: str, record: object) -> list[str]:
    """The addresses a member record advertises (peer-written, so checked): strings naming
    that peer; relay addresses must end in its id."""
    addrs = record.get("addrs") if isinstance(record, dict) else None
    if not isinstance(addrs, list):
        return []
    out = []
    for addr in addrs[:_MAX_MEMBER_ADDRS]:
        if not isinstance(addr, str) or len(addr) > 512 or not addr.endswith(f"/p2p/{peer_id}"):
            continue
        if is_circuit(addr) and not addr.endswith(f"/p2p-circuit/p2p/{peer_id}"):
            continue
        out.append(addr)
    return out
