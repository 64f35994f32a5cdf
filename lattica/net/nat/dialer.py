"""Dialing a peer over the best path it allows: direct, else relay then hole punch.

Theory of operation (happy eyeballs across paths). ``connect(peer_id, addrs)`` dials every
direct address at once; if none has succeeded after ``relay_delay`` seconds it also dials the
peer's ``/p2p-circuit`` addresses (a relay, which needs the peer to hold a reservation there).
The first connection wins and the others are cancelled. When the winner is a relayed
connection, a DCUtR hole punch runs in the background; if it succeeds the peer's path becomes
``hole-punched`` and new streams use the direct connection. ``results[peer]`` records the
winning path, the seconds to the first connection and the seconds to a direct one.

A peer that is already connected is not dialed again: ``connect`` returns its current path.

Keeping the upgrade going: NAT mappings and a peer's luck change, so a relayed peer is not
given up after one punch. While ``run`` is active, every relayed peer gets another hole punch
after ``retry_after`` seconds, then with doubling pauses up to ``max_retry_after``. Only the
side with the smaller peer id retries (the first attempt is the dialer's), so the two sides
never start competing sessions; a punch the peer started is joined, not duplicated.

Failures: if every path fails, ``PeerUnavailableError``; a failed hole punch leaves the
relayed connection in place (symmetric NATs, firewalls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from multiaddr import Multiaddr
from trio_typing import TaskStatus

from lattica.errors import PeerUnavailableError
from lattica.net.libp2p_compat import unblock_peer
from lattica.net.nat.addresses import is_circuit
from lattica.net.nat.circuit import dial_circuit
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
    started: float = field(default=0.0, repr=False)  # time.monotonic() when the dial began


class Dialer:
    def __init__(self, host: IHost, *, relay: RelayServer, paths: PathBook,
                 holepuncher: HolePuncher | None, direct_timeout: float = 3.0,
                 relay_delay: float = 0.3, relay_timeout: float = 5.0,
                 retry_after: float = 10.0, max_retry_after: float = 300.0) -> None:
        if not 0 < retry_after <= max_retry_after:
            raise ValueError("need 0 < retry_after <= max_retry_after")
        self._host = host
        self._paths = paths
        self._holepuncher = holepuncher
        self._direct_timeout = direct_timeout
        self._relay_delay = relay_delay
        self._relay_timeout = relay_timeout
        self._transport = CircuitV2Transport(host, relay.protocol,
                                             RelayConfig(roles=RelayRole.STOP))
        self._retry_after = retry_after
        self._max_retry_after = max_retry_after
        self.results: dict[ID, DialResult] = {}
        self._nursery: trio.Nursery | None = None
        self._punching: set[ID] = set()
        self._next_punch: dict[ID, tuple[float, float]] = {}  # peer -> (when, pause after)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            if self._holepuncher is not None:
                await self._keep_upgrading(nursery)
            await trio.sleep_forever()

    async def connect(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> DialResult:
        current = self._paths.path(peer_id)
        if current is not None:
            known = self.results.get(peer_id)
            if known is not None and known.path == current:
                return known
            return DialResult(str(peer_id), current, 0.0)
        start = time.monotonic()
        # our callers pace redials; the swarm's negative cache must not
        unblock_peer(self._host, peer_id)
        for addr in addrs:
            if is_circuit(addr) and (relay := _relay_of(addr)) is not None:
                unblock_peer(self._host, relay)
        direct = [a for a in addrs if not is_circuit(a)]
        relayed = [a for a in addrs if is_circuit(a)]
        won: list[Path] = []
        failures: dict[str, str] = {}  # address -> why its dial failed, for the error message
        async with trio.open_nursery() as nursery:
            for addr in direct:
                nursery.start_soon(self._dial_direct, peer_id, addr, won, nursery.cancel_scope, failures)
            if relayed:
                nursery.start_soon(self._dial_relayed, peer_id, relayed, won,
                                   nursery.cancel_scope, bool(direct), failures)
        if not won:
            why = "; ".join(f"{addr}: {reason}" for addr, reason in failures.items())
            raise PeerUnavailableError(f"no direct or relayed path worked ({why or 'no address'})",
                                       peer_id=str(peer_id))
        result = DialResult(str(peer_id), won[0], round(time.monotonic() - start, 3), started=start)
        if won[0] is Path.DIRECT:
            result.direct_s = result.connect_s
        elif self._holepuncher is not None and self._nursery is not None \
                and peer_id not in self._punching:
            result.hole_punch = "running"
            self._punching.add(peer_id)
            self._nursery.start_soon(self._punch, peer_id, result)
        self.results[peer_id] = result
        return result

    async def _dial_direct(self, peer_id: ID, addr: Multiaddr, won: list[Path],
                           scope: trio.CancelScope, failures: dict[str, str]) -> None:
        failures[str(addr)] = f"timed out after {self._direct_timeout:g} s"
        with trio.move_on_after(self._direct_timeout):
            try:
                await self._host.get_network().dial_addr(addr, peer_id)
            except Exception as exc:  # noqa: BLE001 - network: any dial failure is a failed attempt, recorded with its reason
                logger.debug("direct dial %s at %s failed: %r", peer_id, addr, exc)
                failures[str(addr)] = dial_failure_reason(exc)
                return
            failures.pop(str(addr), None)
            won.append(Path.DIRECT)
            scope.cancel()

    async def _dial_relayed(self, peer_id: ID, addrs: list[Multiaddr], won: list[Path],
                            scope: trio.CancelScope, delay: bool, failures: dict[str, str]) -> None:
        if delay:
            await trio.sleep(self._relay_delay)
        for addr in addrs:
            failures[str(addr)] = f"timed out after {self._relay_timeout:g} s"
            with trio.move_on_after(self._relay_timeout):
                try:
                    await dial_circuit(self._host, addr, self._transport)
                except Exception as exc:  # noqa: BLE001 - network: any dial failure is a failed attempt, recorded with its reason
                    logger.debug("relayed dial %s via %s failed: %r", peer_id, addr, exc)
                    failures[str(addr)] = dial_failure_reason(exc)
                    continue
                failures.pop(str(addr), None)
                self._paths.note_relayed(peer_id)
                won.append(Path.RELAYED)
                scope.cancel()
                return

    async def _punch(self, peer_id: ID, result: DialResult | None) -> None:
        assert self._holepuncher is not None
        try:
            ok = await self._holepuncher.upgrade(peer_id)
        finally:
            self._punching.discard(peer_id)
        pause = self._next_punch.get(peer_id, (0.0, self._retry_after))[1]
        self._next_punch[peer_id] = (time.monotonic() + pause, min(pause * 2, self._max_retry_after))
        if result is not None:
            result.hole_punch = "succeeded" if ok else "failed"
            if ok:
                result.path = Path.HOLE_PUNCHED
                result.direct_s = round(time.monotonic() - result.started, 3)
        logger.info("hole punch to %s: %s", peer_id, "succeeded" if ok else "failed")

    async def _keep_upgrading(self, nursery: trio.Nursery) -> None:
        me = self._host.get_id().to_bytes()
        while True:
            await trio.sleep(1.0)
            now = time.monotonic()
            relayed = {p for p in list(self._host.get_network().connections)
                       if self._paths.path(p) is Path.RELAYED}
            for peer_id in list(self._next_punch):
                if peer_id not in relayed:
                    del self._next_punch[peer_id]  # upgraded or gone: start over if relayed again
            for peer_id in relayed:
                when, _pause = self._next_punch.setdefault(
                    peer_id, (now + self._retry_after, self._retry_after))
                if when > now or peer_id in self._punching or me > peer_id.to_bytes():
                    continue
                self._punching.add(peer_id)
                result = self.results.get(peer_id)
                nursery.start_soon(self._punch, peer_id, result)


def dial_failure_reason(exc: BaseException) -> str:
    """The innermost cause of a failed dial, in one line ("Connection refused", not py-libp2p's
    "fail to open connection to peer ...")."""
    inner: BaseException = exc
    for _ in range(8):
        below = inner.__cause__ or (inner.exceptions[0] if isinstance(inner, BaseExceptionGroup) else None)
        if below is None:
            break
        inner = below
    text = (str(inner) or type(inner).__name__).splitlines()[0]
    return text[:200]


def _relay_of(addr: Multiaddr) -> ID | None:
    """The relay's peer id in ``/.../p2p/<relay>/p2p-circuit/p2p/<peer>``."""
    head = str(addr).split("/p2p-circuit")[0]
    if "/p2p/" not in head:
        return None
    try:
        return ID.from_base58(head.rsplit("/p2p/", 1)[1])
    except ValueError:
        return None
