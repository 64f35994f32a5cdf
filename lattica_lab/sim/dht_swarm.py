"""Run discovery over a virtual Kademlia DHT: the product's ``ProviderLookup`` walks.

Every node has a k-bucket table in py-libp2p's keyspace (sha256 of the peer id's bytes, XOR
distance; ``k`` = 20 per bucket, buckets by the length of the prefix shared with the node's
own key), filled at join from the live nodes as a self-lookup fills it, and refilled every
``DHTConfig.table_refresh_interval``; a dead entry stays until then (or until a query to it
fails). Members announce the run key to the ``k`` closest live nodes every
``reprovide_interval``; a record lapses after ``provider_ttl`` and is lost with its holder.

A lookup is ``ProviderLookup`` (width, parallelism from ``DHTConfig``) seeded with the asker's
closest table entries; a live node answers with the provider records it holds and its own
closest entries, a dead one fails after ``query_timeout``. It succeeds when it returns a live
member; its hops are ``first_provider_hop``; its time follows the link latencies (queries in
flight overlap).
"""

from __future__ import annotations

import hashlib
import heapq
import random
from dataclasses import dataclass, field

from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht.config import DHTConfig
from lattica.dht.keys import run_key
from lattica.dht.lookup import ProviderLookup
from lattica_lab.sim.links import LinkModel

K = 20


def _key_int(peer: ID) -> int:
    return int.from_bytes(hashlib.sha256(peer.to_bytes()).digest(), "big")


@dataclass
class DhtNode:
    peer: ID
    key: int
    alive: bool = True
    table: list[ID] = field(default_factory=list)
    refreshed_s: float = 0.0
    providers: dict[ID, float] = field(default_factory=dict)  # provider -> expiry (s)
    announced_s: float = -1e18


@dataclass
class LookupOutcome:
    success: bool
    hops: int | None
    seconds: float
    queries: int


@dataclass
class DhtSwarm:
    config: DHTConfig
    links: LinkModel
    run_id: str = "sim-run"
    seed: int = 0
    nodes: dict[ID, DhtNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.key = run_key(self.run_id)
        self._target = int.from_bytes(hashlib.sha256(self.key).digest(), "big")

    # -- nodes ----------------------------------------------------------------------------------

    def add(self, peer: ID, now_s: float) -> DhtNode:
        node = DhtNode(peer, _key_int(peer))
        self.nodes[peer] = node
        self._fill(node, now_s)
        for other in self._closest_live(node.key, K):  # the self-lookup makes it known near itself
            if other != peer:
                self._offer(self.nodes[other], peer)
        return node

    def remove(self, peer: ID) -> None:
        node = self.nodes[peer]
        node.alive = False
        node.providers.clear()

    def live_nodes(self) -> list[DhtNode]:
        return [n for n in self.nodes.values() if n.alive]

    def _fill(self, node: DhtNode, now_s: float) -> None:
        buckets: dict[int, list[ID]] = {}
        for other in self.live_nodes():
            if other.peer != node.peer:
                buckets.setdefault((node.key ^ other.key).bit_length(), []).append(other.peer)
        table = []
        for _, members in sorted(buckets.items()):
            table += members if len(members) <= K else self.rng.sample(members, K)
        node.table, node.refreshed_s = table, now_s

    def _offer(self, node: DhtNode, peer: ID) -> None:
        bucket = (node.key ^ _key_int(peer)).bit_length()
        same = [p for p in node.table if (node.key ^ _key_int(p)).bit_length() == bucket]
        if peer not in node.table and len(same) < K:
            node.table.append(peer)

    def _closest_live(self, target: int, count: int) -> list[ID]:
        live = sorted(self.live_nodes(), key=lambda n: n.key ^ target)
        return [n.peer for n in live[:count]]

    # -- maintenance -------------------------------------------------------------------------------

    def maintain(self, now_s: float, members: list[ID]) -> None:
        """Table refreshes and provider announcements that are due at ``now_s``."""
        for node in self.live_nodes():
            if now_s - node.refreshed_s >= self.config.table_refresh_interval:
                self._fill(node, now_s)
            node.providers = {p: t for p, t in node.providers.items() if t > now_s}
        for peer in members:
            node = self.nodes[peer]
            if now_s - node.announced_s >= self.config.reprovide_interval:
                self.announce(peer, now_s)

    def announce(self, peer: ID, now_s: float) -> None:
        self.nodes[peer].announced_s = now_s
        for holder in self._closest_live(self._target, K):
            self.nodes[holder].providers[peer] = now_s + self.config.provider_ttl

    # -- lookups ---------------------------------------------------------------------------------

    def lookup(self, asker: ID) -> LookupOutcome:
        node = self.nodes[asker]
        seeds = sorted(node.table, key=lambda p: _key_int(p) ^ self._target)[:K]
        walk = ProviderLookup(self.key, seeds, local_id=asker,
                              width=self.config.lookup_width, parallelism=self.config.lookup_parallelism)
        walk.add_local_providers(self._live_records(node))
        now, order = 0.0, 0
        events: list[tuple[float, int, ID, bool]] = []  # (when, order, peer, answered)
        while True:
            for peer in walk.next_queries():
                target = self.nodes.get(peer)
                if target is None or not target.alive:
                    heapq.heappush(events, (now + self.config.query_timeout, order, peer, False))
                else:
                    heapq.heappush(events, (now + 2 * self.links.latency_s(str(asker), str(peer)), order, peer, True))
                order += 1
            if walk.done or not events:
                break
            now, _, peer, answered = heapq.heappop(events)
            if answered:
                target = self.nodes[peer]
                closer = sorted(target.table, key=lambda p: _key_int(p) ^ self._target)[:K]
                walk.on_response(peer, providers=self._live_records(target), closer=closer)
            else:
                walk.on_failure(peer)
                if peer in node.table:
                    node.table.remove(peer)
        found = [info for info in walk.providers if info.peer_id != asker and self.nodes[info.peer_id].alive]
        return LookupOutcome(bool(found), walk.first_provider_hop, now, walk.queries)

    def _live_records(self, node: DhtNode) -> list[PeerInfo]:
        return [PeerInfo(p, []) for p in node.providers]
