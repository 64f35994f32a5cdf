"""Reachability: is this node dialable from the internet? (AutoNAT v1, ``/libp2p/autonat/1.0.0``)

Theory of operation. We ask a few peers connected to us over *direct* connections to dial us
back at our candidate addresses (listen, announce, and observed-IP x listen-port predictions).
Each answer is a verdict: OK (they reached us) or E_DIAL_ERROR (they could not); refusals and
failures to ask are no verdict. Reachability is PUBLIC when at least one server reached us and
no more failed than succeeded, PRIVATE when more failed, else UNKNOWN. A new check runs when
the set of directly connected peers or our observed addresses change, and every
``recheck_interval`` seconds. Only peers whose identify lists ``/libp2p/autonat/1.0.0`` (or
that have not identified yet) are asked: a plain relay or DHT server is not. A check that got
no verdict (servers refused, or none answered) is retried after ``first_retry`` seconds,
doubling up to ``recheck_interval`` — never every few seconds without end.

Serving side: py-libp2p 0.8.1's server answers a dial-back with ``host.connect()``, which
returns at once when the requester is already connected (it always is: it just asked), so every
node would look PUBLIC. We subclass it to make a *fresh* dial (``swarm.dial_addr``) under a
timeout and close that connection afterwards. The library keeps the spec's guards: only
addresses on the requester's observed IP are dialed, requests over relays are refused, and
messages are capped at 64 KiB (a malformed request is logged and the stream closed).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError
from trio_typing import TaskStatus

from lattica.net.host import peer_may_support
from lattica.net.libp2p_compat import AutoNATHooks
from lattica.net.nat.addresses import conn_is_relayed, dialable_addrs, observed_ips

logger = logging.getLogger(__name__)


class Reachability(enum.StrEnum):
    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


@dataclass(frozen=True, kw_only=True)
class AutoNATConfig:
    max_servers: int = 3
    query_timeout: float = 6.0
    dial_back_timeout: float = 3.0
    recheck_interval: float = 120.0
    poll_interval: float = 0.5
    first_retry: float = 2.0

    def __post_init__(self) -> None:
        if self.max_servers < 1:
            raise ValueError("max_servers must be >= 1")
        if self.dial_back_timeout <= 0 or self.dial_back_timeout >= self.query_timeout:
            raise ValueError("need 0 < dial_back_timeout < query_timeout")
        if self.recheck_interval <= 0 or self.poll_interval <= 0 or self.first_retry <= 0:
            raise ValueError("intervals must be positive")


def retry_delay(config: AutoNATConfig, *, verdicts: int, fruitless_checks: int) -> float:
    """Seconds until the next check: the recheck interval after a verdict; after
    ``fruitless_checks`` checks in a row without one, ``first_retry`` doubled each time."""
    if verdicts:
        return config.recheck_interval
    return min(config.first_retry * 2.0 ** max(fruitless_checks - 1, 0), config.recheck_interval)


class _FreshDialAutoNAT(AutoNATHooks):
    def __init__(self, host: IHost, dial_back_timeout: float) -> None:
        super().__init__(host, serve=True)  # type: ignore[arg-type]
        self._dial_back_timeout = dial_back_timeout

    async def dial_back(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network = self.host.get_network()
        for raw in addrs[:8]:
            try:
                addr = Multiaddr(raw)
            except (MultiaddrError, ValueError, TypeError):
                continue
            with trio.move_on_after(self._dial_back_timeout):
                try:
                    conn = await network.dial_addr(addr, peer_id)
                except Exception as exc:  # noqa: BLE001 - network: any dial failure is a failed dial-back
                    logger.debug("dial-back %s at %s failed: %r", peer_id, addr, exc)
                    continue
                # best effort on a connection that may be gone; libp2p raises many kinds
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await conn.close()
                return bytes(raw)
        return None


class ReachabilityService:
    def __init__(self, host: IHost, *, config: AutoNATConfig | None = None) -> None:
        self._host = host
        self._config = config or AutoNATConfig()
        self._autonat = _FreshDialAutoNAT(host, self._config.dial_back_timeout)
        self.reachability = Reachability.UNKNOWN
        self.verdicts: dict[str, bool] = {}
        self.queries_sent = 0
        self._fruitless_checks = 0
        self._changed = trio.Event()

    async def wait_change(self) -> Reachability:
        """Wait for the next change of ``reachability`` and return the new value."""
        await self._changed.wait()
        return self.reachability

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        signature: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        next_check = trio.current_time()
        while True:
            current = self._signature()
            if current != signature or trio.current_time() >= next_check:
                signature = current
                if current[0]:
                    await self.check()
                # a round without any verdict (the peers' services were still starting, or
                # the queries failed) is retried soon, then less and less often
                self._fruitless_checks = 0 if self.verdicts else self._fruitless_checks + 1
                retry = retry_delay(self._config, verdicts=len(self.verdicts),
                                    fruitless_checks=self._fruitless_checks)
                next_check = trio.current_time() + retry
            await trio.sleep(self._config.poll_interval)

    def _signature(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (tuple(sorted(str(p) for p in self._direct_peers())), tuple(observed_ips(self._host)))

    def _direct_peers(self) -> list[ID]:
        """Directly connected peers that may serve AutoNAT (by what their identify said)."""
        peers = []
        for peer_id, conns in self._host.get_network().connections.items():
            conns = conns if isinstance(conns, list) else [conns]
            if any(conn_is_relayed(c) is False for c in conns) and peer_may_support(
                self._host, peer_id, AUTONAT_PROTOCOL_ID
            ):
                peers.append(peer_id)
        return peers

    async def check(self) -> Reachability:
        servers = self._direct_peers()[: self._config.max_servers]
        addrs = [a.to_bytes() for a in dialable_addrs(self._host)]
        results: dict[str, bool] = {}

        async def ask(server: ID) -> None:
            self.queries_sent += 1
            with trio.move_on_after(self._config.query_timeout):
                try:
                    status, _ = await self._autonat.query_server(
                        server, addrs, timeout=self._config.query_timeout
                    )
                except Exception as exc:  # noqa: BLE001 - network: any failure of the library's query is a failed query
                    logger.debug("AutoNAT query to %s failed: %r", server, exc)
                    return
                if status == Message.OK:
                    results[str(server)] = True
                elif status == Message.E_DIAL_ERROR:
                    results[str(server)] = False

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(ask, server)
        self.verdicts = results
        self._set(_aggregate(results))
        return self.reachability

    def _set(self, value: Reachability) -> None:
        if value is Reachability.UNKNOWN and self.reachability is not Reachability.UNKNOWN:
            return  # no verdicts this round: keep what we knew
        if value != self.reachability:
            logger.info("reachability: %s -> %s", self.reachability, value)
            self.reachability = value
            self._changed.set()
            self._changed = trio.Event()


def _aggregate(results: dict[str, bool]) -> Reachability:
    successes = sum(results.values())
    failures = len(results) - successes
    if successes and successes >= failures:
        return Reachability.PUBLIC
    if failures:
        return Reachability.PRIVATE
    return Reachability.UNKNOWN
