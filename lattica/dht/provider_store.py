"""py-libp2p's provider store with a configurable record lifetime and bounded by a ledger.

The library hard-codes 48 h; run membership needs a member that left to vanish within
minutes (seconds in tests). Records announced to us expire ``ttl`` after their last
announcement; our own keys never expire here (we re-announce them ourselves).

Every record another peer announces is an entry of the ``StoreLedger`` (``quota.py``), charged
to the announcing peer (py-libp2p stores a provider record only for the peer that sent it): an
announcement the ledger refuses is not stored, and records the ledger evicts are removed. As in
the library, a key keeps at most ``BUCKET_SIZE`` providers; a new one for a full key is dropped.
"""

from __future__ import annotations

import time

from libp2p.abc import IHost
from libp2p.kad_dht.common import BUCKET_SIZE
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.provider_store import ProviderRecord, ProviderStore
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht.quota import EntryKey, StoreLedger, StoreLimits, provider_cost, provider_entry


class ExpiringProviderStore(ProviderStore):
    def __init__(
        self,
        host: IHost,
        peer_routing: PeerRouting | None = None,
        *,
        ttl: float,
        ledger: StoreLedger | None = None,
    ) -> None:
        super().__init__(host, peer_routing)
        self.ttl = ttl
        self.ledger = ledger if ledger is not None else StoreLedger(StoreLimits())
        self.ledger.on_evict(self._forget_evicted)

    def add_provider(self, key: bytes, provider: PeerInfo) -> None:
        """Store (or refresh) ``provider`` for ``key`` if the key and the ledger have room."""
        if not provider or not provider.peer_id:
            return
        peer = str(provider.peer_id)
        records = self.providers.get(key, {})
        if peer not in records and len(records) >= BUCKET_SIZE:
            return
        if peer != str(self.local_peer_id):
            cost = provider_cost(key, provider.peer_id.to_bytes(), (a.to_bytes() for a in provider.addrs))
            admission = self.ledger.admit(provider_entry(key, peer), peer, cost)
            if not admission.accepted:
                return
        self.providers.setdefault(key, {})[peer] = ProviderRecord(provider_info=provider, timestamp=time.time())

    def _forget_evicted(self, entry: object) -> None:
        if isinstance(entry, tuple) and len(entry) == 3 and entry[0] == "provider":
            self._drop(entry[1], entry[2])

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
            self._drop(key, peer_id)

    def entries(self) -> list[EntryKey]:
        """The ledger entries of the records held now (our own excluded)."""
        local = str(self.local_peer_id)
        return [
            provider_entry(key, peer) for key, records in self.providers.items() for peer in records if peer != local
        ]

    def _expire_key(self, key: bytes, now: float) -> None:
        records = self.providers.get(key)
        if records is None:
            return
        local = str(self.local_peer_id)
        for peer, record in list(records.items()):
            if peer != local and now - record.timestamp >= self.ttl:
                self._drop(key, peer)

    def _drop(self, key: bytes, peer: str) -> None:
        records = self.providers.get(key)
        if records is not None:
            records.pop(peer, None)
            if not records:
                del self.providers[key]
        self.ledger.release(provider_entry(key, peer))
