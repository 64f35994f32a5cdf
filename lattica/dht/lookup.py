"""Iterative provider lookup as a state machine (sans-IO).

Theory of operation
-------------------
Kademlia's GET_PROVIDERS walk: keep the ``width`` peers closest to the key that have not
failed; query the closest unqueried of them, at most ``parallelism`` at a time; each answer
brings providers and closer peers. A peer first learned from a peer at hop *h* is at hop
*h + 1* (seeds from our routing table are hop 1). The walk ends when every one of the
``width`` closest live peers has answered or failed, or when ``enough`` providers are known.

Distances are measured between sha256(key) and sha256(peer id bytes), the keyspace that
py-libp2p's routing table uses, so both agree on who is "close".

Providers are deduplicated by peer id (one peer can be returned by many holders); their
addresses are merged. The driver (``content.py``) performs the RPCs and feeds results in;
nothing here touches the network or a clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo


def keyspace_distance(key_hash: int, peer_id: ID) -> int:
    return key_hash ^ int.from_bytes(hashlib.sha256(peer_id.to_bytes()).digest(), "big")


class ProviderLookup:
    def __init__(
        self,
        key: bytes,
        seeds: Iterable[ID],
        *,
        local_id: ID,
        width: int = 20,
        parallelism: int = 3,
        enough: int | None = None,
    ) -> None:
        self._key_hash = int.from_bytes(hashlib.sha256(key).digest(), "big")
        self._local_id = local_id
        self._width = width
        self._parallelism = parallelism
        self._enough = enough
        self._hop: dict[ID, int] = {}
        self._distance: dict[ID, int] = {}
        self._queried: set[ID] = set()
        self._in_flight: set[ID] = set()
        self._failed: set[ID] = set()
        self._providers: dict[ID, PeerInfo] = {}
        self.first_provider_hop: int | None = None
        self.queries = 0
        for peer in seeds:
            self._learn(peer, hop=1)

    # -- inputs ---------------------------------------------------------------------------
    def add_local_providers(self, providers: Iterable[PeerInfo]) -> None:
        for info in providers:
            self._add_provider(info, hop=0)

    def on_response(
        self, peer: ID, *, providers: Iterable[PeerInfo], closer: Iterable[ID]
    ) -> None:
        self._in_flight.discard(peer)
        hop = self._hop[peer]
        for info in providers:
            self._add_provider(info, hop=hop)
        for other in closer:
            self._learn(other, hop=hop + 1)

    def on_failure(self, peer: ID) -> None:
        self._in_flight.discard(peer)
        self._failed.add(peer)

    # -- outputs --------------------------------------------------------------------------
    def next_queries(self) -> list[ID]:
        if self._has_enough():
            return []
        picks: list[ID] = []
        for peer in self._closest_live():
            if len(self._in_flight) + len(picks) >= self._parallelism:
                break
            if peer not in self._queried:
                picks.append(peer)
        for peer in picks:
            self._queried.add(peer)
            self._in_flight.add(peer)
        self.queries += len(picks)
        return picks

    @property
    def done(self) -> bool:
        if self._in_flight:
            return False
        if self._has_enough():
            return True
        return all(peer in self._queried for peer in self._closest_live())

    @property
    def providers(self) -> list[PeerInfo]:
        return list(self._providers.values())

    # -- internals ------------------------------------------------------------------------
    def _learn(self, peer: ID, *, hop: int) -> None:
        if peer == self._local_id:
            return
        if peer not in self._hop:
            self._hop[peer] = hop
            self._distance[peer] = keyspace_distance(self._key_hash, peer)
        elif hop < self._hop[peer] and peer not in self._queried:
            self._hop[peer] = hop

    def _closest_live(self) -> list[ID]:
        live = [p for p in self._hop if p not in self._failed]
        live.sort(key=self._distance.__getitem__)
        return live[: self._width]

    def _add_provider(self, info: PeerInfo, *, hop: int) -> None:
        known = self._providers.get(info.peer_id)
        if known is None:
            self._providers[info.peer_id] = PeerInfo(info.peer_id, list(dict.fromkeys(info.addrs)))
        else:
            merged = list(dict.fromkeys([*known.addrs, *info.addrs]))
            self._providers[info.peer_id] = PeerInfo(info.peer_id, merged)
        if hop > 0 and (self.first_provider_hop is None or hop < self.first_provider_hop):
            self.first_provider_hop = hop

    def _has_enough(self) -> bool:
        return self._enough is not None and len(self._providers) >= self._enough
