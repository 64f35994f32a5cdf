"""py-libp2p's value store, bounded by the store ledger.

py-libp2p's Kademlia handler stores an accepted PUT_VALUE with ``put_record``; the inbound layer
names the peer whose stream it is serving (``inbound.serving_peer``), and the record becomes a
ledger entry charged to that peer (``quota.py``): refused, it is not stored (the library still
acknowledges it: a DHT store is best effort); admitted, records the ledger evicted are removed.
Records stored outside an inbound stream are this node's own (``put``: its puts; ``put_record``:
values it looked up) and are not charged.
"""

from __future__ import annotations

from libp2p.abc import IHost
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID

from lattica.dht.inbound import serving_peer
from lattica.dht.quota import EntryKey, StoreLedger, value_cost, value_entry


class BoundedValueStore(ValueStore):
    def __init__(self, host: IHost, local_peer_id: ID, *, ledger: StoreLedger) -> None:
        super().__init__(host, local_peer_id)
        self.ledger = ledger
        ledger.on_evict(self._forget_evicted)

    def put_record(self, key: bytes, record: Record) -> None:
        sender = serving_peer()
        if sender is not None:
            admission = self.ledger.admit(value_entry(key), sender, value_cost(key, record.value))
            if not admission.accepted:
                return
        else:
            self.ledger.release(value_entry(key))  # a value we looked up ourselves is ours
        super().put_record(key, record)

    def put(self, key: bytes, value: bytes, validity: float = 0.0) -> None:
        self.ledger.release(value_entry(key))  # our own record replaces whoever's was there
        super().put(key, value, validity)

    def remove(self, key: bytes) -> bool:
        self.ledger.release(value_entry(key))
        return super().remove(key)

    def entries(self) -> list[EntryKey]:
        """The ledger entries of the records held now."""
        return [value_entry(key) for key in self.store]

    def _forget_evicted(self, entry: object) -> None:
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "value":
            self.store.pop(entry[1], None)
