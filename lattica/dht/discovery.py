"""Run-scoped discovery: from one known address to knowing (and reaching) the whole run.

Theory of operation
-------------------
Members of run ``R`` provide the key ``/lattica/run/R`` (``keys.run_key``). The service:

1. bootstraps the routing table from the peers the host is already connected to (the
   daemon dials its ``--peer`` addresses itself), then looks itself up to fill buckets;
2. provides the run key, and re-provides every ``reprovide_interval`` (< ``provider_ttl``,
   so a live member never lapses while one that left disappears after the TTL);
3. looks up the run's providers every ``lookup_interval`` (sooner, at a quarter of it,
   while it knows fewer than ``min_run_peers`` members; while it knows none, after 1 s,
   then 2, 4, … up to that quarter) and connects to those it is not connected to, up to
   ``max_run_peers``, each the moment the walk learns of it (through ``connect`` when
   given: the daemon's path dialer, which also tries the member's relay addresses; the DHT
   reaches the peers it queries the same way, ``reach.py``);
4. expires stale records, republishes its own value records, and refreshes the routing
   table (a self-lookup) every ``table_refresh_interval``;
5. provides again at once when the addresses it advertises change (a relay reservation came
   or went): a provider record carries the addresses of its announcement, so a DHT server
   would otherwise hand out a NAT'd member's private address until the next reprovide.

Steps 1–3 start together: the first lookup does not wait for the self-lookup or the
provide, whose walks may be slowed by unreachable peers (each query is bounded by
``query_timeout``). Every step tolerates failure: a lookup or provide that fails is logged
and retried next period. ``known_run_members`` is the result of the latest lookup (minus
this node).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from trio_typing import TaskStatus

from lattica.dht.config import DHTConfig
from lattica.dht.keys import content_key, run_key, validate_run_id
from lattica.dht.node import LatticaDHT

logger = logging.getLogger(__name__)

_ADDR_POLL_S = 1.0


class RunDiscovery:
    def __init__(self, host: IHost, *, run_id: str, config: DHTConfig,
                 connect: Callable[[PeerInfo], Awaitable[bool]] | None = None) -> None:
        self.run_id = validate_run_id(run_id)
        self._host = host
        self._config = config
        self._run_key = run_key(run_id)
        self.dht = LatticaDHT(host, config=config, reach=connect)
        self._connect = connect or self.dht.connect
        self._members: dict[ID, PeerInfo] = {}
        self._changed = trio.Event()
        self.lookups_done = 0

    # -- public state ---------------------------------------------------------------------
    def routing_table_size(self) -> int:
        return self.dht.routing_table_size()

    def known_run_members(self) -> list[PeerInfo]:
        return list(self._members.values())

    @property
    def rejected_inputs(self) -> int:
        return self.dht.rejected_inputs

    def statistics(self) -> DhtStatus:
        store = self.dht.store_stats()
        return DhtStatus(
            dht_mode="server" if self.dht.is_server else "client",
            routing_table=self.routing_table_size(),
            run_members=len(self._members),
            member_lookups=self.lookups_done,
            rejected_inputs=self.rejected_inputs,
            stored_records=store.records,
            stored_bytes=store.bytes,
            store_refused=sum(store.refused.values()),
            store_evicted=store.evicted,
        )

    def status(self) -> dict[str, object]:
        """The ``dht`` part of ``lattica status``."""
        return self.statistics().as_json()

    async def set_reachability(self, public: bool) -> None:
        await self.dht.set_reachability(public)

    async def provide_content(self, content_hash: bytes) -> bool:
        return await self.dht.provide(content_key(content_hash))

    def stop_providing_content(self, content_hash: bytes) -> None:
        self.dht.content.stop_providing(content_key(content_hash))

    async def find_content_providers(self, content_hash: bytes) -> list[PeerInfo]:
        result = await self.dht.find_providers(content_key(content_hash))
        return result.providers

    async def wait_changed(self) -> None:
        """Return after the next lookup that changed the set of known members."""
        await self._changed.wait()

    # -- service ----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._step, "bootstrap", self.dht.bootstrap)
            nursery.start_soon(self._provide_every, self._config.reprovide_interval)
            nursery.start_soon(self._lookup_loop)
            task_status.started()
            nursery.start_soon(self._every, self._config.provider_ttl / 4, "expire", self._expire)
            nursery.start_soon(
                self._every, self._config.republish_interval, "republish", self.dht.republish_records
            )
            nursery.start_soon(
                self._every, self._config.table_refresh_interval, "refresh", self.dht.bootstrap
            )
            nursery.start_soon(self._reprovide_on_new_addrs)

    async def refresh_members(self) -> None:
        """One provider lookup for the run key; connect to members we are not connected to,
        each as soon as the walk learns of it."""
        me = self._host.get_id()
        connected = set(self._host.get_connected_peers())
        budget = self._config.max_run_peers - len(connected & self._members.keys())
        async with trio.open_nursery() as dials:

            def dial(info: PeerInfo) -> None:
                nonlocal budget
                if info.peer_id == me or info.peer_id in connected or budget <= 0:
                    return
                budget -= 1
                dials.start_soon(self._connect, info)

            result = await self.dht.find_providers(self._run_key, on_provider=dial)
        members = {p.peer_id: p for p in result.providers if p.peer_id != me}
        if members.keys() != self._members.keys():
            self._changed.set()
            self._changed = trio.Event()
        self._members = members
        self.lookups_done += 1

    async def _provide(self) -> None:
        if self.dht.is_server or self._host.get_connected_peers():
            await self.dht.provide(self._run_key)

    async def _reprovide_on_new_addrs(self) -> None:
        advertised = {str(a) for a in self._host.get_addrs()}
        while True:
            await trio.sleep(_ADDR_POLL_S)
            current = {str(a) for a in self._host.get_addrs()}
            if current != advertised:
                advertised = current
                await self._step("provide", self._provide)

    async def _expire(self) -> None:
        self.dht.expire_records()

    async def _provide_every(self, period: float) -> None:
        while True:
            await self._step("provide", self._provide)
            await trio.sleep(period)

    async def _lookup_loop(self) -> None:
        lookups_alone = 0
        while True:
            await self._step("lookup", self.refresh_members)
            lookups_alone = 0 if self._members else lookups_alone + 1
            await trio.sleep(lookup_delay(self._config, len(self._members), lookups_alone))

    async def _every(self, period: float, name: str, step: Callable[[], Awaitable[object]]) -> None:
        while True:
            await trio.sleep(period)
            await self._step(name, step)

    async def _step(self, name: str, step: Callable[[], Awaitable[object]]) -> None:
        try:
            with trio.move_on_after(max(self._config.query_timeout * 6, 10.0)):
                await step()
        except Exception as exc:  # noqa: BLE001 - task supervisor: a failed periodic round is logged and retried next period
            logger.warning("DHT %s failed: %r", name, exc)


def lookup_delay(config: DHTConfig, members: int, lookups_alone: int) -> float:
    """Seconds until the next member lookup: ``lookup_interval`` once ``min_run_peers``
    members are known, a quarter of it while fewer are; while none is known (a node that
    just started, whose peers may not have provided yet) 1 s, then 2, 4, … up to that quarter."""
    if members >= config.min_run_peers:
        return config.lookup_interval
    short = config.lookup_interval / 4
    if members:
        return short
    return min(2.0 ** max(lookups_alone - 1, 0), short)


@dataclass(frozen=True)
class DhtStatus:
    dht_mode: str  # server (publicly reachable) or client
    routing_table: int  # peers in the routing table
    run_members: int  # members of this run found through the DHT
    member_lookups: int
    rejected_inputs: int  # malformed or hostile DHT messages refused
    stored_records: int  # records held for others
    stored_bytes: int
    store_refused: int  # records refused by the store's quotas
    store_evicted: int

    def as_json(self) -> dict[str, object]:
        return asdict(self)
