"""The Kademlia DHT as a daemon service: run discovery and content routing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from libp2p.peer.peerinfo import PeerInfo
from trio_typing import TaskStatus

from lattica.net.host import LatticaHost
from lattica.node.services import METRICS_INTERVAL_S
from lattica.observability import NodeMetrics

if TYPE_CHECKING:
    from lattica.dht.discovery import DhtStatus, RunDiscovery
    from lattica.net.connectivity import Connectivity


class DiscoveryService:
    """The Kademlia DHT: run discovery (``/lattica/run/<id>``) and content routing."""

    name = "dht"

    def __init__(self, host: LatticaHost, *, run_id: str, connectivity: Connectivity, metrics: NodeMetrics) -> None:
        from lattica.dht.config import DHTConfig
        from lattica.dht.discovery import RunDiscovery

        async def connect(info: PeerInfo) -> bool:
            return await connectivity.dial_peer(info.peer_id.to_base58(), [str(a) for a in info.addrs])

        self._metrics = metrics
        self.discovery: RunDiscovery = RunDiscovery(host, run_id=run_id, config=DHTConfig(), connect=connect)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # bootstrapping and the first lookups take network round trips: do not hold start-up
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.discovery.run)
            nursery.start_soon(self._export_metrics)

    async def _export_metrics(self) -> None:
        previous = None
        while True:
            self._metrics.dht_routing_table_peers.set(self.discovery.routing_table_size())
            stats = self.discovery.dht.store_stats()
            self._metrics.set_dht_store(stats, previous=previous)
            previous = stats
            await trio.sleep(METRICS_INTERVAL_S)

    async def set_reachability(self, public: bool) -> None:
        await self.discovery.set_reachability(public)

    def statistics(self) -> DhtStatus:
        return self.discovery.statistics()

    def status(self) -> dict[str, object]:
        return {"dht": self.statistics().as_json()}

