"""NAT traversal inside the daemon: reachability, relay service, hole punching, path book.

Theory of operation: the node runs AutoNAT against its directly connected peers. While it is
public it serves circuit relay v2 (with limits); once it is known to be private it keeps
reservations on relays among its peers and advertises the ``/p2p-circuit`` addresses in its
replicated membership record. The path book follows every connection (direct, hole-punched or
relayed) and samples RTTs; the daemon's peer table shows both (``lattica peers``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from lattica.net.nat.autonat import Reachability, ReachabilityService
from lattica.net.nat.holepunch import HolePuncher
from lattica.net.nat.paths import PathBook
from lattica.net.nat.relay import RelayReservations, RelayServer

log = logging.getLogger(__name__)

_SYNC_INTERVAL_S = 1.0


class NatServices:
    def __init__(
        self,
        node: Any,
        *,
        state: Any | None = None,
        on_reachability: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        host = node.host
        self.node = node
        self.state = state
        self.on_reachability = on_reachability
        self.reachability = ReachabilityService(host)
        self.relay_server = RelayServer(host, serve="auto", reachability=self.reachability)
        self.hole_puncher = HolePuncher(host)
        self.paths = PathBook(host)
        self.reservations: RelayReservations | None = None
        self._host = host

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for service in (self.relay_server, self.hole_puncher, self.paths, self.reachability):
                await nursery.start(service.run)
            task_status.started()
            nursery.start_soon(self._follow_reachability, nursery)
            nursery.start_soon(self._copy_paths)

    async def _follow_reachability(self, nursery: trio.Nursery) -> None:
        while True:
            verdict = await self.reachability.wait_change()
            log.info("reachability: %s", verdict.value if hasattr(verdict, "value") else verdict)
            if verdict == Reachability.PRIVATE and self.reservations is None:
                self.reservations = RelayReservations(self._host)
                await nursery.start(self.reservations.run)
            if self.on_reachability is not None and verdict != Reachability.UNKNOWN:
                # DHT server mode when publicly reachable, client mode behind NAT
                await self.on_reachability(verdict == Reachability.PUBLIC)
            await self._publish()

    async def _publish(self) -> None:
        if self.state is None:
            return
        addrs = list(self.node.dialable_addrs()) + [str(a) for a in self.relay_addrs()]
        try:
            await self.state.update_member(addrs=addrs, reachability=self._reachability_text())
        except Exception as exc:  # noqa: BLE001 - best effort; the next change retries
            log.debug("could not publish reachability: %r", exc)

    def relay_addrs(self) -> list[Any]:
        return self.reservations.relay_addrs() if self.reservations is not None else []

    def _reachability_text(self) -> str:
        value = self.reachability.reachability
        return str(getattr(value, "value", value))

    async def _copy_paths(self) -> None:
        metrics = getattr(self.node, "metrics", None)
        while True:
            for record in self.node.peer_book.records():
                if not record.connected:
                    continue
                peer = ID.from_base58(record.peer_id)
                path = self.paths.path(peer)
                if path is not None:
                    record.path = str(getattr(path, "value", path))
                rtt = self.paths.rtt_ms(peer)
                if rtt is not None:
                    record.rtt_ms = round(rtt, 2)
            if metrics is not None and self.reservations is not None:
                metrics.relay_reservations.set(len(self.relay_addrs()))
            await trio.sleep(_SYNC_INTERVAL_S)

    def status(self) -> dict[str, Any]:
        return {
            "reachability": self._reachability_text(),
            "relay_serving": bool(getattr(self.relay_server, "serving", False)),
            "relay_addrs": [str(a) for a in self.relay_addrs()],
        }
