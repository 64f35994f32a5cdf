"""py-libp2p's provider store with a configurable record lifetime.

The library hard-codes 48 h; run membership needs a member that left to vanish within
minutes (seconds in tests). Records announced to us expire ``ttl`` after their last
announcement; our own keys never expire here (we re-announce them ourselves).
"""

from __future__ import annotations

import time

from libp2p.abc import IHost
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.peer.peerinfo import PeerInfo


class ExpiringProviderStore(ProviderStore):
    def __init__(self, host: IHost, peer_routing: PeerRouting | None = None, *, ttl: float) -> None:
        super().__init__(host, peer_routing)
        self.ttl = ttl

    def get_providers(self, key: bytes) -> list[PeerInfo]:
        self._expire_key(key, time.time())
        return [
            PeerInfo(record.peer_id, record.addresses)
            for record in self.providers.get(key, {}).values()
        ]

    def cleanup_expired(self) -> None:
        now = time.time()
        for key in list(self.providers):
            self._expire_key(key, now)

    def remove_provider(self, peer_id: str) -> None:
        """Forget every record that ``peer_id`` announced (e.g. after bad input)."""
        for key in list(self.providers):
            self.providers[key].pop(peer_id, None)
            if not self.providers[key]:
                del self.providers[key]

    def _expire_key(self, key: bytes, now: float) -> None:
        records = self.providers.get(key)
        if records is None:
            return
        local = str(self.local_peer_id)
        for peer, record in list(records.items()):
            if peer != local and now - record.timestamp >= self.ttl:
                del records[peer]
        if not records:
            del self.providers[key]
