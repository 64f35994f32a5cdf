"""Dialing a peer over the best path it allows: direct, else relay then hole punch.

Theory of operation (happy eyeballs across paths). ``connect(peer_id, addrs)`` dials every
direct address at once; if none has succeeded after ``relay_delay`` seconds it also dials the
peer's ``/p2p-circuit`` addresses (a relay, which needs the peer to hold a reservation there).
The first connection wins and the others are cancelled. When the winner is a relayed
connection, a DCUtR hole punch runs in the background; if it succeeds the peer's path becomes
``hole-punched`` and new streams use the direct connection. ``results[peer]`` records the
winning path, the seconds to the first connection and the seconds to a direct one.

Failures: if every path fails, ``PeerUnavailableError``; a failed hole punch leaves the
relayed connection in place (symmetric NATs, firewalls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from multiaddr import Multiaddr

from lattica.errors import PeerUnavailableError
from lattica.net.nat.addresses import is_circuit
from lattica.net.nat.holepunch import HolePuncher
from lattica.net.nat.paths import Path, PathBook
from lattica.net.nat.relay import RelayServer

logger = logging.getLogger(__name__)


@dataclass
class DialResult:
    peer_id: str
    path: Path
    connect_s: float
    direct_s: float | None = None
    hole_punch: str = "not-needed"  # not-needed / running / succeeded / failed


class Dialer:
    def __init__(self, host: IHost, *, relay: RelayServer, paths: PathBook,
                 holepuncher: HolePuncher | None, direct_timeout: float = 3.0,
                 relay_delay: float = 0.3, relay_timeout: float = 5.0) -> None:
        self._host = host
        self._paths = paths
        self._holepuncher = holepuncher
        self._direct_timeout = direct_timeout
        self._relay_delay = relay_delay
        self._relay_timeout = relay_timeout
        self._transport = CircuitV2Transport(host, relay.protocol,
                                             RelayConfig(roles=RelayRole.STOP))
        self.results: dict[ID, DialResult] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def connect(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> DialResult:
        start = time.monotonic()
        direct = [a for a in addrs if not is_circuit(a)]
        relayed = [a for a in addrs if is_circuit(a)]
        won: list[Path] = []
        async with trio.open_nursery() as nursery:
            for addr in direct:
                nursery.start_soon(self._dial_direct, peer_id, addr, won, nursery.cancel_scope)
            if relayed:
                nursery.start_soon(self._dial_relayed, peer_id, relayed, won,
                                   nursery.cancel_scope, bool(direct))
        if not won:
            raise PeerUnavailableError("no direct or relayed path worked", peer_id=str(peer_id))
        result = DialResult(str(peer_id), won[0], round(time.monotonic() - start, 3))
        if won[0] is Path.DIRECT:
            result.direct_s = result.connect_s
        elif self._holepuncher is not None and self._nursery is not None:
            result.hole_punch = "running"
            self._nursery.start_soon(self._punch, peer_id, result, start)
        self.results[peer_id] = result
        return result

    async def _dial_direct(self, peer_id: ID, addr: Multiaddr, won: list[Path],
                           scope: trio.CancelScope) -> None:
        with trio.move_on_after(self._direct_timeout):
            try:
                await self._host.get_network().dial_addr(addr, peer_id)
            except Exception as exc:
                logger.debug("direct dial %s at %s failed: %r", peer_id, addr, exc)
                return
            won.append(Path.DIRECT)
            scope.cancel()

    async def _dial_relayed(self, peer_id: ID, addrs: list[Multiaddr], won: list[Path],
                            scope: trio.CancelScope, delay: bool) -> None:
        if delay:
            await trio.sleep(self._relay_delay)
        for addr in addrs:
            with trio.move_on_after(self._relay_timeout):
                try:
                    await self._transport.dial(addr)
                except Exception as exc:
                    logger.debug("relayed dial %s via %s failed: %r", peer_id, addr, exc)
                    continue
                self._paths.note_relayed(peer_id)
                won.append(Path.RELAYED)
                scope.cancel()
                return

    async def _punch(self, peer_id: ID, result: DialResult, start: float) -> None:
        assert self._holepuncher is not None
        ok = await self._holepuncher.upgrade(peer_id)
        result.hole_punch = "succeeded" if ok else "failed"
        if ok:
            result.path = Path.HOLE_PUNCHED
            result.direct_s = round(time.monotonic() - start, 3)
        logger.info("hole punch to %s: %s", peer_id, result.hole_punch)
